//! The Pods the shipped plugins run meet the `restricted` Pod Security Standard, as the
//! API server's PodSecurity admission enforces it (issue #34): every pod template of
//! every golden answer (`host/tests/golden/`: PostgreSQL's instances and backups,
//! MySQL's instance) is created as a Pod, with a server-side dry run, in a namespace
//! labelled `pod-security.kubernetes.io/enforce: restricted`. Nothing is stored.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use capstan_e2e::in_test_namespace;
use capstan_e2e::operator::root;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

/// The pod template of a workload child, if it is one.
fn pod_template(child: &Value) -> Option<&Value> {
    match child["kind"].as_str()? {
        "StatefulSet" | "Deployment" | "DaemonSet" | "ReplicaSet" | "Job" => {
            child.pointer("/spec/template")
        }
        "CronJob" => child.pointer("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

/// A Pod of `template`, as its controller would make it: the claims of its volume claim
/// templates become volumes, and the ServiceAccount (a child of the same answer,
/// absent from the test's namespace) is the namespace's default, which PodSecurity does
/// not look at.
fn pod_of(template: &Value, claims: &[String], name: &str) -> anyhow::Result<Pod> {
    let mut spec = template["spec"].clone();
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("serviceAccountName");
        let volumes = spec
            .entry("volumes")
            .or_insert_with(|| json!([]))
            .as_array_mut()
            .context("volumes")?;
        for claim in claims {
            volumes.push(json!({"name": claim, "persistentVolumeClaim": {"claimName": claim}}));
        }
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"].clone()},
        "spec": spec,
    }))?)
}

#[tokio::test]
async fn the_shipped_plugins_pods_meet_the_restricted_pod_security_standard() {
    in_test_namespace("restricted", T, async |client, ns| {
        Api::<Namespace>::all(client.clone())
            .patch(
                &ns,
                &PatchParams::apply("e2e"),
                &Patch::Apply(json!({
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": ns, "labels": {
                        "pod-security.kubernetes.io/enforce": "restricted",
                        "pod-security.kubernetes.io/enforce-version": "latest"}}
                })),
            )
            .await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let golden = root().join("host/tests/golden");
        let mut checked = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(&golden)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let answer: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&file)?)
                .with_context(|| file.display().to_string())?;
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            for child in answer["children"].as_array().into_iter().flatten() {
                let Some(template) = pod_template(child) else {
                    continue;
                };
                let claims: Vec<String> = child
                    .pointer("/spec/volumeClaimTemplates")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["metadata"]["name"].as_str().map(String::from))
                    .collect();
                let what = format!(
                    "{stem}: {} {}",
                    child["kind"].as_str().unwrap_or_default(),
                    child["metadata"]["name"].as_str().unwrap_or_default()
                );
                let pod = pod_of(template, &claims, &format!("pod-{}", checked.len()))?;
                if let Err(e) = pods.create(&dry_run, &pod).await {
                    bail!("{what}: the restricted namespace refuses its Pods: {e}");
                }
                checked.push(what);
            }
        }
        for plugin in ["postgresql", "database-mysql"] {
            ensure!(
                checked.iter().any(|w| w.starts_with(plugin)),
                "no pod template of {plugin} was checked: {checked:?}"
            );
        }
        ensure!(
            checked.iter().any(|w| w.contains("CronJob")),
            "the backup CronJob's Pods were not checked: {checked:?}"
        );
        // The check can fail: a privileged container is refused there.
        let mut privileged = pod_of(
            pod_template(
                &serde_yaml_ng::from_str::<Value>(&std::fs::read_to_string(
                    golden.join("database-mysql-replicas-1.yaml"),
                )?)?["children"]
                    .as_array()
                    .context("children")?
                    .iter()
                    .find(|c| c["kind"] == "StatefulSet")
                    .cloned()
                    .context("the MySQL StatefulSet")?,
            )
            .context("its template")?,
            &["data".into()],
            "privileged",
        )?;
        privileged.spec.as_mut().unwrap().containers[0]
            .security_context
            .get_or_insert_default()
            .privileged = Some(true);
        ensure!(
            pods.create(&dry_run, &privileged).await.is_err(),
            "a privileged Pod got into the restricted namespace: the check proves nothing"
        );
        Ok(())
    })
    .await
    .unwrap();
}
