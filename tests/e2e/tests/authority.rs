//! Plugin authority on the real local control plane (issue #34): a plugin whose
//! declarations exceed what it was granted is refused at load, in one line, and nothing
//! of what it declared reaches the cluster.

use std::time::Duration;

use anyhow::{Context, ensure};
use capstan_e2e::operator::{Operator, free_port, test_plugin};
use capstan_e2e::{in_test_namespace, wait_for};
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
