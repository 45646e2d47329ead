// Command capstan-provisioner is the dynamic PersistentVolume provisioner of a local test
// cluster with a real node: for each claim of a StorageClass whose provisioner is
// capstan.dev/local-path, it makes a directory under -root and a `local` PersistentVolume
// on it, bound to the node the scheduler chose; when such a volume is released with the
// Delete policy, it removes the directory.
//
// The directories live in the cluster's state directory, so `cargo xtask cluster down`
// removes whatever a test left.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"
)

// name is the StorageClass provisioner this program serves.
const name = "capstan.dev/local-path"

// localPath provisions directories under root.
type localPath struct {
	root        string
	defaultNode string
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the provisioner's identity")
	root := flag.String("root", "", "directory under which each volume gets its own directory")
	node := flag.String("node", "", "node a volume is bound to when the claim names none (Immediate binding)")
	klog.InitFlags(nil)
	flag.Parse()
	if *kubeconfig == "" || *root == "" || *node == "" {
		fmt.Fprintln(os.Stderr, "capstan-provisioner: -kubeconfig, -root and -node are required")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *root, *node); err != nil {
		fmt.Fprintf(os.Stderr, "capstan-provisioner: %v\n", err)
		os.Exit(1)
	}
}

func run(kubeconfig, root, node string) error {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctrl := controller.NewProvisionController(ctx, client, name, &localPath{root: root, defaultNode: node},
		// One provisioner per cluster: leader election would only delay the first volume.
		controller.LeaderElection(false),
	)
	ctrl.Run(ctx)
	return nil
}

// Provision makes the directory and a local volume on it, pinned to the chosen node.
func (p *localPath) Provision(_ context.Context, opts controller.ProvisionOptions) (*v1.PersistentVolume, controller.ProvisioningState, error) {
	if opts.PVC.Spec.VolumeMode != nil && *opts.PVC.Spec.VolumeMode == v1.PersistentVolumeBlock {
		return nil, controller.ProvisioningFinished, errors.New("block volumes are not supported")
	}
	node := opts.SelectedNodeName
	if node == "" {
		node = p.defaultNode
	}
	dir := filepath.Join(p.root, opts.PVName)
	// World-writable like a fresh disk: the pod's user (which may not be root) must write.
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return nil, controller.ProvisioningFinished, err
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		return nil, controller.ProvisioningFinished, err
	}
	reclaim := v1.PersistentVolumeReclaimDelete
	if opts.StorageClass.ReclaimPolicy != nil {
		reclaim = *opts.StorageClass.ReclaimPolicy
	}
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        opts.PVName,
			Annotations: map[string]string{"capstan.dev/local-path": dir},
		},
		Spec: v1.PersistentVolumeSpec{
			PersistentVolumeReclaimPolicy: reclaim,
			AccessModes:                   opts.PVC.Spec.AccessModes,
			MountOptions:                  opts.StorageClass.MountOptions,
			Capacity:                      v1.ResourceList{v1.ResourceStorage: opts.PVC.Spec.Resources.Requests[v1.ResourceStorage]},
			PersistentVolumeSource: v1.PersistentVolumeSource{
				Local: &v1.LocalVolumeSource{Path: dir},
			},
			NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{
				NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{
					Key:      "kubernetes.io/hostname",
					Operator: v1.NodeSelectorOpIn,
					Values:   []string{node},
				}}}},
			}},
		},
	}
	return pv, controller.ProvisioningFinished, nil
}

// Delete removes the directory of a volume this provisioner made, and only that.
func (p *localPath) Delete(_ context.Context, pv *v1.PersistentVolume) error {
	dir, ok := pv.Annotations["capstan.dev/local-path"]
	if !ok || pv.Spec.Local == nil || pv.Spec.Local.Path != dir {
		return &controller.IgnoredError{Reason: "not made by capstan-provisioner"}
	}
	if filepath.Dir(dir) != filepath.Clean(p.root) || !strings.HasPrefix(filepath.Base(dir), "pvc-") {
		return &controller.IgnoredError{Reason: "its directory is not one of this provisioner's"}
	}
	return os.RemoveAll(dir)
}
