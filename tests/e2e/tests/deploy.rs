//! deploy/ on the real control plane: the manifests are accepted, the Deployment comes
//! up (kwok runs its pod), and the generated least-privilege ClusterRole is enough for
//! `capstan run` to reconcile both shipped plugins — and no more.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use capstan_e2e::operator::{Operator, plugin, root};
use capstan_e2e::{
    TestNamespace, client, client_with_token, is_forbidden, service_account_token, wait_for,
};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(120);

fn kubectl(args: &[&str]) -> String {
    let bin = std::env::var_os("CAPSTAN_KUBECTL")
        .map(PathBuf::from)
        .expect("CAPSTAN_KUBECTL is not set: run the tests with `cargo xtask test`");
    let out = Command::new(&bin).args(args).output().expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn dyn_api(
    client: &kube::Client,
    ns: &str,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

#[tokio::test]
async fn deploy_manifests_run_and_their_role_is_enough_and_no_more() {
    let client = client().await;
    kubectl(&["apply", "-k", &root().join("deploy").to_string_lossy()]);
    let deployments = Api::<Deployment>::namespaced(client.clone(), "capstan-system");
    wait_for("the capstan Deployment to be available", T, || {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get("capstan").await?;
            Ok((d.status.and_then(|s| s.available_replicas) == Some(2)).then_some(()))
        }
    })
    .await
    .unwrap();

    // A token of the Deployment's ServiceAccount, in a kubeconfig for capstan run.
    let token = service_account_token(&client, "capstan-system", "capstan")
        .await
        .unwrap();
    let admin = std::fs::read_to_string(std::env::var("KUBECONFIG").unwrap()).unwrap();
    let admin: serde_yaml_ng::Value = serde_yaml_ng::from_str(&admin).unwrap();
    let cluster = admin["clusters"][0]["cluster"].clone();
    let kubeconfig = serde_yaml_ng::to_string(&json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": serde_json::to_value(&cluster).unwrap()}],
        "users": [{"name": "capstan", "user": {"token": token}}],
        "contexts": [{"name": "capstan", "context": {"cluster": "local", "user": "capstan"}}],
        "current-context": "capstan",
    }))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, kubeconfig).unwrap();

    // As that identity, capstan reconciles both shipped plugins.
    let ns = TestNamespace::new(&client, "rbac").await;
    let op = Operator::start_as(&path, &ns.name, &[&plugin("uuid"), &plugin("postgresql")]).await;
    let uuids = dyn_api(&client, &ns.name, "demo.operator", "v1", "Uuid", "uuid");
    let uuid: DynamicObject = serde_json::from_value(
        json!({"apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": {"name": "u"}}),
    )
    .unwrap();
    uuids.create(&PostParams::default(), &uuid).await.unwrap();
    let pgcs = dyn_api(
        &client,
        &ns.name,
        "db.example.com",
        "v1alpha1",
        "PostgreSQLCluster",
        "postgresqlclusters",
    );
    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg"}, "spec": {"replicas": 1, "version": "16.1", "storage": "1Gi", "backupSchedule": "0 3 * * *"},
    }))
    .unwrap();
    pgcs.create(&PostParams::default(), &pgc).await.unwrap();
    wait_for(
        "the Uuid and the PostgreSQLCluster to be reconciled",
        T,
        || {
            let (uuids, pgcs) = (uuids.clone(), pgcs.clone());
            async move {
                let u = uuids.get("u").await?;
                let p = pgcs.get("pg").await?;
                let done = u.data.pointer("/status/uuid").is_some()
                    && p.data.pointer("/status/phase") == Some(&json!("Running"));
                Ok(done.then_some(()))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(
        Api::<StatefulSet>::namespaced(client.clone(), &ns.name)
            .get("pg")
            .await
            .is_ok()
    );
    assert!(
        Api::<Secret>::namespaced(client.clone(), &ns.name)
            .get("pg-credentials")
            .await
            .is_ok()
    );
    assert!(
        !op.log().contains("Forbidden"),
        "no request of capstan was refused:\n{}",
        op.log_tail()
    );

    // And no more: the same identity may not touch CRDs, namespaces or other kinds.
    let restricted = client_with_token(&token).await.unwrap();
    let err = Api::<CustomResourceDefinition>::all(restricted.clone())
        .delete("uuid.demo.operator", &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");
    let err = Api::<Namespace>::all(restricted.clone())
        .delete(&ns.name, &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");
    let err = Api::<Deployment>::namespaced(restricted, "capstan-system")
        .list(&Default::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");
    drop(op);

    // The sharded variant: three replicas with --shards, and the Lease rights that
    // membership needs, which are enough for `capstan run --shards` as that identity.
    kubectl(&[
        "apply",
        "-k",
        &root().join("deploy/sharded").to_string_lossy(),
    ]);
    wait_for("the sharded Deployment to be available", T, || {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get("capstan").await?;
            let args = d
                .spec
                .template
                .spec
                .as_ref()
                .and_then(|p| p.containers[0].args.clone())
                .unwrap_or_default();
            let sharded =
                args.iter().any(|a| a == "--shards") && !args.iter().any(|a| a == "--leader-elect");
            let available = d.status.and_then(|s| s.available_replicas) == Some(3);
            Ok((sharded && available).then_some(()))
        }
    })
    .await
    .unwrap();
    let sharded = Operator::start_as_with(
        &path,
        &ns.name,
        &[&plugin("uuid")],
        &[
            "--shards",
            "--leader-election-namespace",
            "capstan-system",
            "--shard-group",
            "e2e-deploy",
        ],
    )
    .await;
    let second: DynamicObject = serde_json::from_value(
        json!({"apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": {"name": "u2"}}),
    )
    .unwrap();
    uuids.create(&PostParams::default(), &second).await.unwrap();
    wait_for("a Uuid reconciled by the sharded replica", T, || {
        let uuids = uuids.clone();
        async move {
            let u = uuids.get("u2").await?;
            Ok(u.data.pointer("/status/uuid").is_some().then_some(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", sharded.log_tail()));
    assert!(
        !sharded.log().contains("Forbidden"),
        "no request of the sharded replica was refused:\n{}",
        sharded.log_tail()
    );
    drop(sharded);
    // Back to the base, as other tests and reruns expect it.
    kubectl(&["apply", "-k", &root().join("deploy").to_string_lossy()]);
}
