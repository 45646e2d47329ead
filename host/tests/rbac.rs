//! `capstan rbac` and the ClusterRole checked in under deploy/ (kustomize and Helm).

mod common;

use common::{capstan, plugin, root};

#[test]
fn the_checked_in_cluster_role_is_what_capstan_rbac_prints() {
    let dir = plugin("uuid").parent().unwrap().to_path_buf();
    let out = capstan(&["rbac", "--plugins", dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_yaml_ng::Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    // The kustomize base's, and the Helm chart's copy (its ClusterRole takes the rules).
    for file in [
        "deploy/base/clusterrole.yaml",
        "deploy/helm/capstan/files/clusterrole.yaml",
    ] {
        let path = root().join(file);
        let checked_in: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            printed,
            checked_in,
            "{} is stale: regenerate it with `capstan rbac --plugins target/plugins`",
            path.display()
        );
    }
}

#[test]
fn rbac_of_an_empty_directory_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = capstan(&["rbac", "--plugins", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("capstan: no *.wasm plugin in"),
        "{stderr}"
    );
}
