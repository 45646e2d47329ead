//! Smoke tests of the local control plane itself (`cargo xtask cluster up`): scheduling
//! onto kwok's fake node, StatefulSet volumes, garbage collection, and RBAC.
//!
//! They need a real cluster in `KUBECONFIG` (`cargo xtask test` starts one) and fail,
//! never skip, without it. Each runs in a namespace of its own that it deletes.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use capstan_e2e::{
    client_with_token, in_kwok_namespace, in_test_namespace, is_forbidden, service_account_token,
    wait_for,
};
use k8s_openapi::api::{
    apps::v1::{Deployment, StatefulSet},
    authentication::v1::SelfSubjectReview,
    core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, ServiceAccount},
    rbac::v1::{Role, RoleBinding},
};
use kube::{
    Resource,
    api::{Api, DeleteParams, ListParams, PostParams},
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// How long the cluster may take to converge on anything these tests ask of it.
const CONVERGE: Duration = Duration::from_secs(60);
/// How long deleting a test namespace (and all in it) may take.
const CLEANUP: Duration = Duration::from_secs(60);

#[tokio::test]
async fn deployment_pods_are_scheduled_on_the_kwok_node_and_become_ready() -> Result<()> {
    in_kwok_namespace("smoke-deployment", CLEANUP, async |client, ns| {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
        deployments
            .create(&PostParams::default(), &from_json(deployment("web", 3))?)
            .await?;

        wait_for("3 ready replicas of deployment web", CONVERGE, || async {
            let d = deployments.get("web").await?;
            let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            Ok((ready == 3).then_some(()))
        })
        .await?;

        let pods: Api<Pod> = Api::namespaced(client, &ns);
        let pods = pods
            .list(&ListParams::default().labels("app=web"))
            .await?
            .items;
        ensure!(pods.len() == 3, "expected 3 pods, found {}", pods.len());
        for pod in &pods {
            let name = pod.metadata.name.as_deref().unwrap_or("?");
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .unwrap_or("");
            ensure!(
                node.starts_with("kwok-node-"),
                "pod {name} is on {node:?}, not a kwok node"
            );
            let status = pod.status.as_ref().context("pod without status")?;
            ensure!(
                status.phase.as_deref() == Some("Running"),
                "pod {name}: {:?}",
                status.phase
            );
            ensure!(
                has_condition(&status.conditions, "Ready"),
                "pod {name} is not Ready"
            );
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn statefulset_claims_bind_and_its_pods_become_ready() -> Result<()> {
    in_kwok_namespace("smoke-statefulset", CLEANUP, async |client, ns| {
        let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
        statefulsets
            .create(&PostParams::default(), &from_json(statefulset("db", 2))?)
            .await?;

        wait_for("2 ready replicas of statefulset db", CONVERGE, || async {
            let s = statefulsets.get("db").await?;
            let ready = s.status.map(|s| s.ready_replicas.unwrap_or(0)).unwrap_or(0);
            Ok((ready == 2).then_some(()))
        })
        .await?;

        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client, &ns);
        for name in ["data-db-0", "data-db-1"] {
            let claim = claims
                .get(name)
                .await
                .with_context(|| format!("claim {name}"))?;
            let status = claim.status.unwrap_or_default();
            ensure!(
                status.phase.as_deref() == Some("Bound"),
                "claim {name}: {:?}",
                status.phase
            );
            let volume = claim.spec.and_then(|s| s.volume_name).unwrap_or_default();
            // The static pool of a kwok-only cluster, or the real node's provisioner.
            ensure!(
                volume.starts_with("capstan-pv-") || volume.starts_with("pvc-"),
                "claim {name} bound to {volume:?}"
            );
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn deleting_an_owner_garbage_collects_its_dependents() -> Result<()> {
    in_test_namespace("smoke-gc", CLEANUP, async |client, ns| {
        let maps: Api<ConfigMap> = Api::namespaced(client, &ns);
        let pp = PostParams::default();
        let owner = maps
            .create(&pp, &from_json(config_map("owner", None))?)
            .await?;
        let owner_ref = json!([{
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "owner",
            "uid": owner.meta().uid.clone().context("owner without uid")?,
            "blockOwnerDeletion": false,
        }]);
        for name in ["dependent-0", "dependent-1"] {
            maps.create(&pp, &from_json(config_map(name, Some(owner_ref.clone())))?)
                .await?;
        }
        maps.create(&pp, &from_json(config_map("bystander", None))?)
            .await?;

        maps.delete("owner", &DeleteParams::default()).await?;

        for name in ["dependent-0", "dependent-1"] {
            let what = format!("the garbage collector to delete {name}");
            wait_for(&what, CONVERGE, || async {
                Ok(maps.get_opt(name).await?.is_none().then_some(()))
            })
            .await?;
        }
        ensure!(
            maps.get_opt("bystander").await?.is_some(),
            "the garbage collector deleted a ConfigMap that had no owner"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_service_account_token_gets_what_its_role_allows_and_403_for_the_rest() -> Result<()> {
    in_test_namespace("smoke-rbac", CLEANUP, async |admin, ns| {
        let pp = PostParams::default();
        Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
            .create(&pp, &from_json(json!({"metadata": {"name": "reader"}}))?)
            .await?;
        Api::<Role>::namespaced(admin.clone(), &ns)
            .create(&pp, &from_json(config_map_reader_role())?)
            .await?;
        Api::<RoleBinding>::namespaced(admin.clone(), &ns)
            .create(&pp, &from_json(role_binding(&ns))?)
            .await?;
        Api::<ConfigMap>::namespaced(admin.clone(), &ns)
            .create(&pp, &from_json(config_map("visible", None))?)
            .await?;

        let token = service_account_token(&admin, &ns, "reader").await?;
        let reader = client_with_token(&token).await?;

        let review = Api::<SelfSubjectReview>::all(reader.clone())
            .create(&pp, &from_json(json!({}))?)
            .await?;
        let user = review
            .status
            .and_then(|s| s.user_info)
            .and_then(|u| u.username);
        let expected = format!("system:serviceaccount:{ns}:reader");
        ensure!(
            user.as_deref() == Some(expected.as_str()),
            "token authenticates as {user:?}"
        );

        // RBAC reads bindings from an informer cache: allow it a moment to see the new one.
        let maps: Api<ConfigMap> = Api::namespaced(reader.clone(), &ns);
        wait_for("the Role to allow reading ConfigMaps", CONVERGE, || async {
            match maps.get("visible").await {
                Ok(_) => Ok(Some(())),
                Err(e) if is_forbidden(&e) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await?;
        maps.list(&ListParams::default())
            .await
            .context("list ConfigMaps as reader")?;

        let refused = [
            (
                "create a ConfigMap",
                maps.create(&pp, &from_json(config_map("mine", None))?)
                    .await
                    .err(),
            ),
            (
                "delete a ConfigMap",
                maps.delete("visible", &DeleteParams::default()).await.err(),
            ),
            (
                "list Secrets",
                Api::<Secret>::namespaced(reader.clone(), &ns)
                    .list(&ListParams::default())
                    .await
                    .err(),
            ),
            (
                "read ConfigMaps in another namespace",
                Api::<ConfigMap>::namespaced(reader, "default")
                    .list(&ListParams::default())
                    .await
                    .err(),
            ),
        ];
        for (what, error) in refused {
            match error {
                Some(e) if is_forbidden(&e) => {}
                Some(e) => anyhow::bail!("{what}: expected 403 Forbidden, got {e}"),
                None => anyhow::bail!("{what}: allowed, but the Role does not grant it"),
            }
        }
        ensure!(
            Api::<ConfigMap>::namespaced(admin, &ns)
                .get_opt("mine")
                .await?
                .is_none(),
            "the refused ConfigMap was created all the same"
        );
        Ok(())
    })
    .await
}

fn has_condition(
    conditions: &Option<Vec<k8s_openapi::api::core::v1::PodCondition>>,
    kind: &str,
) -> bool {
    conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == kind && c.status == "True")
}

fn from_json<T: DeserializeOwned>(value: Value) -> Result<T> {
    serde_json::from_value(value).context("build a test object")
}

/// kwok never pulls images: any name will do, and none is fetched from anywhere.
const IMAGE: &str = "registry.invalid/capstan/smoke:1";

fn deployment(name: &str, replicas: i32) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "main",
                    "image": IMAGE,
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                }]},
            },
        },
    })
}

fn statefulset(name: &str, replicas: i32) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "main",
                    "image": IMAGE,
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }]},
            },
            // No storageClassName: the cluster's default class must be applied.
            "volumeClaimTemplates": [{
                "metadata": {"name": "data"},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }],
        },
    })
}

fn config_map(name: &str, owner_references: Option<Value>) -> Value {
    let mut map = json!({"metadata": {"name": name}, "data": {"key": "value"}});
    if let Some(refs) = owner_references {
        map["metadata"]["ownerReferences"] = refs;
    }
    map
}

fn config_map_reader_role() -> Value {
    json!({
        "metadata": {"name": "configmap-reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}],
    })
}

fn role_binding(ns: &str) -> Value {
    json!({
        "metadata": {"name": "reader-reads-configmaps"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
    })
}
