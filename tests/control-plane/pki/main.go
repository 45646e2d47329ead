// Command capstan-pki makes the credentials of one local test control plane: a CA, the
// apiserver's serving certificate, the service-account signing key pair, the front
// proxy's CA and client certificate, and a client certificate plus kubeconfig for each
// component that talks to the apiserver. With -node-name, also the credentials of a real
// node: the kubelet's client and serving certificates, kube-proxy's, CoreDNS's and the
// volume provisioner's client certificates, and the apiserver's client certificate for
// the kubelet API.
//
// It uses only the Go standard library, so it builds wherever Go does; `cargo xtask
// cluster up` runs it once per state directory. Every key is new: two clusters never
// trust each other.
package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"flag"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// validity is long enough for any test run and short enough to never be mistaken for
// something to keep.
const validity = 365 * 24 * time.Hour

// client is one identity that gets a client certificate and a kubeconfig.
type client struct {
	file   string   // kubeconfig file name, also the stem of the .crt/.key pair
	user   string   // certificate CommonName: the Kubernetes user name
	groups []string // certificate Organizations: the Kubernetes groups
}

var clients = []client{
	// The person or test at the keyboard: cluster-admin through the system:masters group.
	{file: "admin", user: "capstan-admin", groups: []string{"system:masters"}},
	// The built-in identities that the default RBAC policy already grants what they need.
	{file: "kube-controller-manager", user: "system:kube-controller-manager"},
	{file: "kube-scheduler", user: "system:kube-scheduler"},
	// kwok stands in for every kubelet at once (node status, leases, pod status, pod
	// deletion on any node), which no single built-in role covers.
	{file: "kwok", user: "kwok-controller", groups: []string{"system:masters"}},
}

func main() {
	dir := flag.String("dir", "", "directory to write the credentials into (created if missing)")
	server := flag.String("server", "", "apiserver URL written into the kubeconfigs, e.g. https://127.0.0.1:6443")
	clusterName := flag.String("cluster-name", "capstan", "cluster and context name in the kubeconfigs")
	serviceIP := flag.String("service-ip", "10.96.0.1", "first IP of the service CIDR, a SAN of the serving certificate")
	var n node
	flag.StringVar(&n.name, "node-name", "", "a real node's name: also make its credentials")
	flag.StringVar(&n.ip, "node-ip", "", "the real node's IP: a SAN of the kubelet's and the apiserver's serving certificates")
	flag.StringVar(&n.server, "node-server", "", "apiserver URL as the node reaches it, written into the node's kubeconfigs")
	flag.Parse()
	if *dir == "" || *server == "" {
		fmt.Fprintln(os.Stderr, "capstan-pki: -dir and -server are required")
		os.Exit(2)
	}
	if n.name != "" && (net.ParseIP(n.ip) == nil || n.server == "") {
		fmt.Fprintln(os.Stderr, "capstan-pki: -node-name needs -node-ip (an IP address) and -node-server")
		os.Exit(2)
	}
	if err := run(*dir, *server, *clusterName, *serviceIP, n); err != nil {
		fmt.Fprintf(os.Stderr, "capstan-pki: %v\n", err)
		os.Exit(1)
	}
}

// node is a real node whose credentials are made too (when name is set).
type node struct {
	name   string
	ip     string
	server string
}

// nodeClient is one identity of the node, with the apiserver URL its kubeconfig names.
type nodeClient struct {
	client
	server string
}

// clients returns the node's identities: its processes reach the apiserver through the
// node's network (-node-server), the provisioner on the host through server.
func (n node) clients(server string) []nodeClient {
	return []nodeClient{
		// The Node authorizer and NodeRestriction admit exactly this identity.
		{client{file: "kubelet", user: "system:node:" + n.name, groups: []string{"system:nodes"}}, n.server},
		// Bound to system:node-proxier by the default RBAC policy.
		{client{file: "kube-proxy", user: "system:kube-proxy"}, n.server},
		// Given read access to Services and EndpointSlices by `cluster up`.
		{client{file: "coredns", user: "capstan:coredns"}, n.server},
		// Given PersistentVolume rights by `cluster up`; it runs on the host.
		{client{file: "provisioner", user: "capstan:provisioner"}, server},
	}
}

func run(dir, server, clusterName, serviceIP string, n node) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	w := writer{dir: dir}

	ca, caKey, err := newCA(clusterName)
	if err != nil {
		return err
	}
	w.cert("ca.crt", ca)
	w.key("ca.key", caKey)

	// A separate CA for the aggregation layer's front proxy, as kubeadm makes: the
	// apiserver trusts X-Remote-User headers only from the client that it signs.
	proxyCA, proxyCAKey, err := newCA(clusterName + "-front-proxy")
	if err != nil {
		return err
	}
	w.cert("front-proxy-ca.crt", proxyCA)
	w.key("front-proxy-ca.key", proxyCAKey)
	proxyClient, proxyClientKey, err := newClientCert(proxyCA, proxyCAKey, client{user: "front-proxy-client"})
	if err != nil {
		return err
	}
	w.cert("front-proxy-client.crt", proxyClient)
	w.key("front-proxy-client.key", proxyClientKey)

	var extraIPs []net.IP
	if n.name != "" {
		extraIPs = append(extraIPs, net.ParseIP(n.ip))
	}
	serving, servingKey, err := newServingCert(ca, caKey, serviceIP, extraIPs)
	if err != nil {
		return err
	}
	w.cert("apiserver.crt", serving)
	w.key("apiserver.key", servingKey)

	// RSA for the token signer: every verifier of service-account JWTs (RS256) accepts it.
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	w.key("sa.key", saKey)
	w.publicKey("sa.pub", saKey.Public())

	for _, c := range clients {
		cert, key, err := newClientCert(ca, caKey, c)
		if err != nil {
			return err
		}
		w.cert(c.file+".crt", cert)
		w.key(c.file+".key", key)
		w.kubeconfig(c.file+".kubeconfig", clusterName, server, ca, cert, key, c.user)
	}
	if n.name != "" {
		for _, c := range n.clients(server) {
			cert, key, err := newClientCert(ca, caKey, c.client)
			if err != nil {
				return err
			}
			w.cert(c.file+".crt", cert)
			w.key(c.file+".key", key)
			w.kubeconfig(c.file+".kubeconfig", clusterName, c.server, ca, cert, key, c.user)
		}
		// The kubelet's serving certificate, which the apiserver checks (for logs, exec,
		// port-forward) against the cluster CA and the node's IP.
		kubelet, kubeletKey, err := newKubeletServingCert(ca, caKey, n)
		if err != nil {
			return err
		}
		w.cert("kubelet-serving.crt", kubelet)
		w.key("kubelet-serving.key", kubeletKey)
		// The apiserver's identity towards the kubelet API, which authorizes it by RBAC.
		apiClient, apiClientKey, err := newClientCert(ca, caKey, client{user: "kube-apiserver-kubelet-client", groups: []string{"system:masters"}})
		if err != nil {
			return err
		}
		w.cert("apiserver-kubelet-client.crt", apiClient)
		w.key("apiserver-kubelet-client.key", apiClientKey)
	}
	return w.err
}

func newKubeletServingCert(ca *x509.Certificate, caKey crypto.Signer, n node) (*x509.Certificate, crypto.Signer, error) {
	tmpl := template(pkix.Name{CommonName: "system:node:" + n.name, Organization: []string{"system:nodes"}})
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	tmpl.DNSNames = []string{n.name}
	tmpl.IPAddresses = []net.IP{net.ParseIP(n.ip)}
	return sign(tmpl, ca, caKey)
}

func newCA(name string) (*x509.Certificate, crypto.Signer, error) {
	tmpl := template(pkix.Name{CommonName: name + "-ca"})
	tmpl.IsCA = true
	tmpl.BasicConstraintsValid = true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature
	return sign(tmpl, nil, nil)
}

func newServingCert(ca *x509.Certificate, caKey crypto.Signer, serviceIP string, extraIPs []net.IP) (*x509.Certificate, crypto.Signer, error) {
	tmpl := template(pkix.Name{CommonName: "kube-apiserver"})
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	tmpl.DNSNames = []string{
		"localhost",
		"kubernetes",
		"kubernetes.default",
		"kubernetes.default.svc",
		"kubernetes.default.svc.cluster.local",
	}
	tmpl.IPAddresses = append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, extraIPs...)
	if ip := net.ParseIP(serviceIP); ip != nil {
		tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
	} else {
		return nil, nil, fmt.Errorf("-service-ip %q is not an IP address", serviceIP)
	}
	return sign(tmpl, ca, caKey)
}

func newClientCert(ca *x509.Certificate, caKey crypto.Signer, c client) (*x509.Certificate, crypto.Signer, error) {
	tmpl := template(pkix.Name{CommonName: c.user, Organization: c.groups})
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	return sign(tmpl, ca, caKey)
}

func template(subject pkix.Name) *x509.Certificate {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	now := time.Now()
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      subject,
		// Backdated so that a clock a little behind still accepts the certificate.
		NotBefore: now.Add(-time.Hour),
		NotAfter:  now.Add(validity),
	}
}

// sign makes a P-256 key and a certificate for it, self-signed when parent is nil.
func sign(tmpl, parent *x509.Certificate, parentKey crypto.Signer) (*x509.Certificate, crypto.Signer, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), parentKey)
	if err != nil {
		return nil, nil, fmt.Errorf("sign %s: %w", tmpl.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

// writer writes PEM files and kubeconfigs into dir, keeping the first error.
type writer struct {
	dir string
	err error
}

func (w *writer) write(name string, data []byte, mode os.FileMode) {
	if w.err == nil {
		w.err = os.WriteFile(filepath.Join(w.dir, name), data, mode)
	}
}

func (w *writer) cert(name string, cert *x509.Certificate) {
	w.write(name, certPEM(cert), 0o644)
}

func (w *writer) key(name string, key crypto.Signer) {
	pemKey, err := keyPEM(key)
	if err != nil && w.err == nil {
		w.err = err
	}
	w.write(name, pemKey, 0o600)
}

func (w *writer) publicKey(name string, key crypto.PublicKey) {
	der, err := x509.MarshalPKIXPublicKey(key)
	if err != nil && w.err == nil {
		w.err = err
	}
	w.write(name, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644)
}

// kubeconfig writes a self-contained kubeconfig (certificates inline), so that it still
// works when copied elsewhere.
func (w *writer) kubeconfig(name, clusterName, server string, ca, cert *x509.Certificate, key crypto.Signer, user string) {
	pemKey, err := keyPEM(key)
	if err != nil && w.err == nil {
		w.err = err
	}
	b64 := base64.StdEncoding.EncodeToString
	config := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: %[1]s
  cluster:
    server: %[2]s
    certificate-authority-data: %[3]s
users:
- name: %[4]s
  user:
    client-certificate-data: %[5]s
    client-key-data: %[6]s
contexts:
- name: %[1]s
  context:
    cluster: %[1]s
    user: %[4]s
current-context: %[1]s
`, clusterName, server, b64(certPEM(ca)), user, b64(certPEM(cert)), b64(pemKey))
	w.write(name, []byte(config), 0o600)
}

func certPEM(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

// keyPEM encodes as PKCS#8, which Go, OpenSSL and rustls all read for RSA and EC keys.
func keyPEM(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}
