//! Plugin authority on the real local control plane (issue #34): a plugin whose
//! declarations exceed what it was granted is refused at load, in one line, and nothing
//! of what it declared reaches the cluster.

use std::time::Duration;

use anyhow::{Context, ensure};
use capstan_e2e::operator::{Operator, capstan_bin, free_port, test_plugin};
use capstan_e2e::{in_audited_namespace, in_test_namespace, wait_for};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(90);

/// The attack of issue #34, as a new user tried it at `6922592`: a plugin of Leases
/// with a Fail webhook refusing every Lease write, dropped into the plugin directory of
/// a host that serves webhooks. Now it is refused at load, `/plugins` says how to grant
/// it, and Leases are written, read and left alone: no webhook names them, no
/// finalizer is put on them, no ConfigMap copies them.
#[tokio::test]
async fn a_plugin_of_a_built_in_kind_is_refused_and_lease_writes_go_on() {
    in_test_namespace("authority", T, async |client, ns| {
        let configuration = format!("capstan-e2e-{ns}");
        let addr = format!("127.0.0.1:{}", free_port());
        let op = Operator::start(
            &ns,
            &[&test_plugin("lease-guard")],
            &[
                "--webhook-addr",
                &addr,
                "--webhook-configuration",
                &configuration,
            ],
        )
        .await;
        let outcome = async {
            let error = wait_for("/plugins to show lease-guard refused", T, || async {
                let states = op.plugin_states().await?;
                Ok(states
                    .iter()
                    .find(|p| {
                        p["file"]
                            .as_str()
                            .is_some_and(|f| f.ends_with("lease-guard.wasm"))
                    })
                    .and_then(|p| p["error"].as_str().map(String::from)))
            })
            .await?;
            ensure!(
                error.contains("Lease.coordination.k8s.io/v1 is built into Kubernetes")
                    && error.contains("parents = [\"Lease.coordination.k8s.io\"]")
                    && !error.contains('\n'),
                "the refusal names the kind and the grant, in one line: {error}"
            );
            ensure!(
                op.log().contains("plugin lease-guard is refused"),
                "the refusal is logged: {}",
                op.log_tail()
            );

            // A user's Lease, created and updated in an unrelated namespace.
            let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
            let lease: Lease = serde_json::from_value(json!({
                "metadata": {"name": "mine"},
                "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15},
            }))?;
            leases
                .create(&PostParams::default(), &lease)
                .await
                .context("a Lease write is refused")?;
            let mut written = leases.get("mine").await?;
            written.spec.as_mut().expect("spec").holder_identity = Some("you".into());
            leases
                .replace("mine", &PostParams::default(), &written)
                .await
                .context("a Lease update is refused")?;

            // Held for a few seconds: nothing of the plugin shows up.
            capstan_e2e::holds_for(
                "nothing of lease-guard in the cluster",
                Duration::from_secs(5),
                || async {
                    let lease = leases.get("mine").await?;
                    ensure!(
                        lease.metadata.finalizers.unwrap_or_default().is_empty(),
                        "a finalizer was put on the user's Lease"
                    );
                    let copies = Api::<ConfigMap>::namespaced(client.clone(), &ns)
                        .list(&ListParams::default())
                        .await?;
                    ensure!(
                        copies.items.iter().all(|c| !c
                            .metadata
                            .name
                            .as_deref()
                            .unwrap_or_default()
                            .ends_with("-copy")),
                        "a ConfigMap copies a Lease"
                    );
                    let webhooks = Api::<ValidatingWebhookConfiguration>::all(client.clone())
                        .get_opt(&configuration)
                        .await?;
                    let names_leases = webhooks
                        .iter()
                        .flat_map(|c| c.webhooks.iter().flatten())
                        .any(|w| {
                            w.rules.iter().flatten().any(|r| {
                                r.resources
                                    .iter()
                                    .flatten()
                                    .any(|res| res == "leases" || res == "*")
                            })
                        });
                    ensure!(!names_leases, "a webhook names Leases: {webhooks:?}");
                    Ok(true)
                },
            )
            .await
        }
        .await;
        let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .delete(&configuration, &DeleteParams::default())
            .await;
        outcome.with_context(|| op.log_tail())
    })
    .await
    .unwrap();
}

/// `capstan run --plugin-identities NS`: every request the host makes for a plugin —
/// the watches of its parents and children, its writes — is made as the plugin's own
/// ServiceAccount (the API server's audit log, which records reads in this test's
/// namespace, says so), and the API
/// server, not only the host, bounds it to the RBAC `capstan rbac --plugin-identities`
/// printed for it: with its ConfigMap rule taken away, the plugin's next child is
/// refused with 403 and never written, while the host itself could still write it.
#[tokio::test]
async fn a_plugins_requests_are_made_as_its_own_account_and_bounded_by_its_rbac() {
    // The one namespace whose reads the audit log records too: the proof covers the
    // watches of the plugin's parents and children, not only its writes.
    in_audited_namespace(T, async |client, ns| {
        let plugins = tempfile::tempdir()?;
        std::fs::copy(test_plugin("widget"), plugins.path().join("widget.wasm"))?;
        let printed = std::process::Command::new(capstan_bin())
            .args(["rbac", "--plugins"])
            .arg(plugins.path())
            .args(["--plugin-identities", &ns])
            .output()?;
        ensure!(
            printed.status.success(),
            "{}",
            String::from_utf8_lossy(&printed.stderr)
        );
        let objects: Vec<serde_json::Value> =
            serde_yaml_ng::Deserializer::from_slice(&printed.stdout)
                .map(serde::Deserialize::deserialize)
                .collect::<Result<_, _>>()?;
        let account = "capstan-plugin-widget";
        let identity: Vec<&serde_json::Value> = objects
            .iter()
            .filter(|o| o["metadata"]["labels"]["capstan.dev/plugin"] == "widget")
            .collect();
        ensure!(identity.len() == 3, "SA, ClusterRole, binding: {objects:?}");
        let discovery = kube::discovery::Discovery::new(client.clone())
            .run()
            .await?;
        let apply = |object: &serde_json::Value| {
            let client = client.clone();
            let object = object.clone();
            let discovery = &discovery;
            async move {
                let gvk = kube::core::GroupVersionKind::try_from(&kube::core::TypeMeta {
                    api_version: object["apiVersion"].as_str().unwrap_or_default().into(),
                    kind: object["kind"].as_str().unwrap_or_default().into(),
                })?;
                let (resource, caps) = discovery
                    .resolve_gvk(&gvk)
                    .ok_or_else(|| anyhow::anyhow!("no {gvk:?}"))?;
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let api: Api<kube::api::DynamicObject> = match caps.scope {
                    kube::discovery::Scope::Namespaced => Api::namespaced_with(
                        client,
                        object["metadata"]["namespace"].as_str().unwrap_or_default(),
                        &resource,
                    ),
                    kube::discovery::Scope::Cluster => Api::all_with(client, &resource),
                };
                api.patch(
                    &name,
                    &kube::api::PatchParams::apply("e2e").force(),
                    &kube::api::Patch::Apply(&object),
                )
                .await?;
                anyhow::Ok(())
            }
        };
        for object in &identity {
            apply(object).await?;
        }
        let outcome = async {
            let op = Operator::start(
                &ns,
                &[&test_plugin("widget")],
                &["--plugin-identities", &ns],
            )
            .await;
            let widgets = Api::<kube::api::DynamicObject>::namespaced_with(
                client.clone(),
                &ns,
                &capstan_e2e::objects::test_kind("Widget", "widgets"),
            );
            let widget = |name: &str| -> anyhow::Result<kube::api::DynamicObject> {
                Ok(serde_json::from_value(json!({
                    "apiVersion": "test.capstan.dev/v1", "kind": "Widget",
                    "metadata": {"name": name}, "spec": {"count": 1, "message": "hi"}}))?)
            };
            widgets
                .create(&PostParams::default(), &widget("allowed")?)
                .await?;
            let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            wait_for(
                "the widget's ConfigMap, written as the plugin",
                T,
                || async { Ok(configmaps.get_opt("allowed-0").await?.map(|_| ())) },
            )
            .await
            .with_context(|| op.log_tail())?;
            let control_plane = capstan_e2e::control_plane::ControlPlane::from_env();
            let user = format!("system:serviceaccount:{ns}:{account}");
            let requests: Vec<_> = control_plane
                .audit_events(&ns)?
                .into_iter()
                .filter(|e| e.object_ref.namespace == ns && e.user_agent.starts_with("capstan/"))
                .filter(|e| ["configmaps", "widgets"].contains(&e.object_ref.resource.as_str()))
                .collect();
            for (verbs, what) in [
                (&["create", "patch"][..], "write"),
                (&["list", "watch"][..], "read"),
            ] {
                ensure!(
                    requests
                        .iter()
                        .any(|e| e.object_ref.resource == "configmaps"
                            && verbs.contains(&e.verb.as_str())),
                    "no {what} of the widget's ConfigMaps in the audit log"
                );
            }
            for event in &requests {
                ensure!(
                    event
                        .impersonated_user
                        .as_ref()
                        .map(|u| u.username.as_str())
                        == Some(user.as_str()),
                    "a request for the plugin made as {:?} (impersonating {:?}): {} {}/{}",
                    event.user.username,
                    event.impersonated_user,
                    event.verb,
                    event.object_ref.resource,
                    event.object_ref.name
                );
            }
            // The plugin's ConfigMap rule taken away: the API server refuses its next child.
            let mut narrowed = identity[1].clone();
            let mut taken = false;
            for rule in narrowed["rules"].as_array_mut().into_iter().flatten() {
                if let Some(resources) = rule["resources"].as_array_mut() {
                    let before = resources.len();
                    resources.retain(|r| r != "configmaps");
                    taken |= resources.len() < before;
                }
            }
            ensure!(taken, "no ConfigMap rule to take away: {narrowed}");
            apply(&narrowed).await?;
            widgets
                .create(&PostParams::default(), &widget("refused")?)
                .await?;
            let message = wait_for("the refused widget to say why", T, || async {
                let w = widgets.get("refused").await?;
                Ok(capstan_e2e::objects::ready_condition(&w)
                    .filter(|(status, _, message)| {
                        status == "False" && message.contains("forbidden")
                    })
                    .map(|(_, _, message)| message))
            })
            .await
            .with_context(|| op.log_tail())?;
            ensure!(message.contains(account), "{message}");
            ensure!(
                configmaps.get_opt("refused-0").await?.is_none(),
                "the API server let the plugin write outside its RBAC"
            );
            anyhow::Ok(())
        }
        .await;
        for object in identity.iter().filter(|o| o["kind"] != "ServiceAccount") {
            let name = object["metadata"]["name"].as_str().unwrap_or_default();
            let resource = match object["kind"].as_str() {
                Some("ClusterRole") => "clusterroles",
                _ => "clusterrolebindings",
            };
            let ar = kube::api::ApiResource {
                group: "rbac.authorization.k8s.io".into(),
                version: "v1".into(),
                api_version: "rbac.authorization.k8s.io/v1".into(),
                kind: object["kind"].as_str().unwrap_or_default().into(),
                plural: resource.into(),
            };
            let _ = Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar)
                .delete(name, &DeleteParams::default())
                .await;
        }
        outcome
    })
    .await
    .unwrap();
}
