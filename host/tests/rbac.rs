//! `capstan rbac` and the ClusterRole checked in under deploy/ (kustomize and Helm).

mod common;

use common::{capstan, plugin, root};

#[test]
fn the_checked_in_rbac_is_what_capstan_rbac_prints() {
    let dir = plugin("uuid").parent().unwrap().to_path_buf();
    let out = capstan(&[
        "rbac",
        "--plugins",
        dir.to_str().unwrap(),
        "--plugin-identities",
        "capstan-system",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut printed: Vec<serde_yaml_ng::Value> =
        serde_yaml_ng::Deserializer::from_slice(&out.stdout)
            .map(serde::Deserialize::deserialize)
            .collect::<Result<_, _>>()
            .unwrap();
    // The host's ClusterRole first, then the plugins' identities.
    let identities = printed.split_off(1);
    let host = printed.pop().unwrap();
    let regenerate = "regenerate deploy/base/clusterrole.yaml (the first document) and deploy/base/plugin-identities.yaml (the rest) with `capstan rbac --plugins target/plugins --plugin-identities capstan-system`, and copy them into deploy/helm/capstan/files/";
    // The kustomize base's, and the Helm chart's copies.
    for base in ["deploy/base", "deploy/helm/capstan/files"] {
        let path = root().join(base).join("clusterrole.yaml");
        let checked_in: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            host,
            checked_in,
            "{} is stale: {regenerate}",
            path.display()
        );
        let path = root().join(base).join("plugin-identities.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        let checked_in: Vec<serde_yaml_ng::Value> = serde_yaml_ng::Deserializer::from_str(&text)
            .map(serde::Deserialize::deserialize)
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            identities,
            checked_in,
            "{} is stale: {regenerate}",
            path.display()
        );
    }
    // The host's own role holds none of the plugins' kinds: only its webhook's
    // configuration, its own ClusterRole and the converting plugin's CRD, by name.
    let resources: Vec<&str> = host["rules"]
        .as_sequence()
        .expect("rules")
        .iter()
        .flat_map(|r| r["resources"].as_sequence().expect("resources"))
        .filter_map(|r| r.as_str())
        .collect();
    for resource in &resources {
        assert!(
            [
                "validatingwebhookconfigurations",
                "clusterroles",
                "customresourcedefinitions"
            ]
            .contains(resource),
            "the host's ClusterRole names {resource}: {resources:?}"
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
