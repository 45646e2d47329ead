//! Contract 0.2's webhook on the real local control plane: `capstan run` outside the
//! cluster serves the `ticket` (failure policy Fail, converts v1 and v2) and `pass`
//! (failure policy Ignore) test plugins, and the API server calls it over loopback at
//! `https://127.0.0.1:PORT`. `kubectl apply` of a refused object fails with the plugin's
//! message, an allowed one passes with its warning shown, a `validate` that sleeps is
//! answered by the policy before the API server's timeout, and objects created as v1
//! read back as v2 and the reverse, through the plugin's `convert`.
//!
//! Both tests change the `tickets.test.capstan.dev` CRD (its conversion webhook): they
//! take turns.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use capstan_e2e::node::kubectl_path;
use capstan_e2e::operator::{Operator, free_port, test_plugin};
use capstan_e2e::{in_test_namespace, wait_for};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(90);
/// The plugins' call deadline here: the webhooks' `timeoutSeconds` is 2.
const PLUGIN_TIMEOUT_MS: &str = "1000";

static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `capstan run` with the ticket and pass plugins, its webhook on a free loopback port
/// and a ValidatingWebhookConfiguration of its own.
async fn operator(ns: &str) -> (Operator, String) {
    let configuration = format!("capstan-e2e-{ns}");
    let addr = format!("127.0.0.1:{}", free_port());
    let op = Operator::start(
        ns,
        &[&test_plugin("ticket"), &test_plugin("pass")],
        &[
            "--webhook-addr",
            &addr,
            "--webhook-configuration",
            &configuration,
            "--plugin-timeout-ms",
            PLUGIN_TIMEOUT_MS,
        ],
    )
    .await;
    (op, configuration)
}

/// What `kubectl` printed, and whether it succeeded.
struct Kubectl {
    ok: bool,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// `kubectl apply -f -` of `object` in `ns` (extra `args` after it).
fn apply(ns: &str, object: &Value, args: &[&str]) -> Kubectl {
    use std::io::Write as _;
    let started = Instant::now();
    let mut child = Command::new(kubectl_path())
        .args(["apply", "-n", ns, "-f", "-"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(object.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    Kubectl {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took: started.elapsed(),
    }
}

fn object(version: &str, kind: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": format!("test.capstan.dev/{version}"), "kind": kind,
           "metadata": {"name": name}, "spec": spec})
}

/// Waits until the API server calls the webhook: a server-side dry run of a refused
/// Ticket is refused (a dry run stores nothing while the webhook is not active yet).
async fn until_the_api_server_calls_the_webhook(ns: &str, op: &Operator) -> Result<()> {
    let refused = object("v1", "Ticket", "probe", json!({"refuse": "probe refused"}));
    wait_for("the API server to call the webhook", T, || {
        let out = apply(ns, &refused, &["--dry-run=server"]);
        async move {
            if !out.ok && out.stderr.contains("probe refused") {
                return Ok(Some(()));
            }
            bail!("dry run: ok={} {}", out.ok, out.stderr.trim())
        }
    })
    .await
    .with_context(|| op.log_tail())
}

/// Deletes what the test left cluster-wide: its ValidatingWebhookConfiguration, and the
/// test CRDs (with the conversion webhook of a host that is gone).
async fn clean_up(client: &Client, configuration: &str) {
    let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .delete(configuration, &DeleteParams::default())
        .await;
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    for crd in ["tickets.test.capstan.dev", "passes.test.capstan.dev"] {
        let _ = crds.delete(crd, &DeleteParams::default()).await;
    }
    let _ = wait_for("the test CRDs to be gone", T, || async {
        for crd in ["tickets.test.capstan.dev", "passes.test.capstan.dev"] {
            if crds.get_opt(crd).await?.is_some() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await;
}

#[tokio::test]
async fn kubectl_apply_is_validated_by_the_plugin() {
    let _turn = TURNS.lock().await;
    in_test_namespace("e2e-admission", T, async |client, ns| {
        let (op, configuration) = operator(&ns).await;
        let mut result = validation(&ns, &op).await;
        if result.is_ok() {
            result = a_parent_being_deleted_goes_without_the_host(&client, &ns, op).await;
        }
        clean_up(&client, &configuration).await;
        result
    })
    .await
    .unwrap();
}

/// The host is gone and its webhook (failure policy Fail) still configured: a parent
/// being deleted still loses its finalizer and goes. The API server does not call the
/// webhook about it (the configuration's match condition), so a deletion never hangs on
/// a host that is down or uninstalled.
async fn a_parent_being_deleted_goes_without_the_host(
    client: &Client,
    ns: &str,
    mut op: Operator,
) -> Result<()> {
    let mut held = object("v1", "Ticket", "held", json!({"owner": "ana"}));
    held["metadata"]["finalizers"] = json!(["test.capstan.dev/hold"]);
    let created = apply(ns, &held, &[]);
    anyhow::ensure!(created.ok, "create: {}", created.stderr);
    // Killed, as a crash or an uninstall: nothing of the host answers any more.
    op.kill();
    let tickets: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ticket_kind("v1"));
    // An ordinary update is still refused: nothing answers the webhook.
    let refused = apply(
        ns,
        &object("v1", "Ticket", "held", json!({"owner": "ana", "seat": 2})),
        &[],
    );
    anyhow::ensure!(
        !refused.ok,
        "the webhook is down and its policy is Fail: {}",
        refused.stdout
    );
    tickets.delete("held", &DeleteParams::default()).await?;
    let patch = json!({"metadata": {"finalizers": null}});
    tickets
        .patch(
            "held",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .context("take the finalizer from a Ticket being deleted, with the webhook down")?;
    wait_for("the Ticket to be gone", T, || async {
        Ok(tickets.get_opt("held").await?.is_none().then_some(()))
    })
    .await
}

async fn validation(ns: &str, op: &Operator) -> Result<()> {
    until_the_api_server_calls_the_webhook(ns, op).await?;

    let refused = apply(
        ns,
        &object(
            "v1",
            "Ticket",
            "cat",
            json!({"refuse": "no tickets for cats"}),
        ),
        &[],
    );
    assert!(!refused.ok, "refused: {}", refused.stdout);
    assert!(
        refused
            .stderr
            .contains("denied the request: no tickets for cats"),
        "the plugin's message: {}",
        refused.stderr
    );

    let warned = apply(
        ns,
        &object(
            "v1",
            "Ticket",
            "t13",
            json!({"owner": "ana", "warn": "seat 13 is unlucky"}),
        ),
        &[],
    );
    assert!(warned.ok, "allowed: {}", warned.stderr);
    assert!(
        warned.stderr.contains("Warning: seat 13 is unlucky"),
        "kubectl shows the warning: {}",
        warned.stderr
    );
    assert!(
        warned
            .stdout
            .contains("ticket.test.capstan.dev/t13 created"),
        "{}",
        warned.stdout
    );

    // UPDATE: the plugin sees the old object too.
    let changed = apply(
        ns,
        &object("v1", "Ticket", "t13", json!({"owner": "bo"})),
        &[],
    );
    assert!(!changed.ok, "refused: {}", changed.stdout);
    assert!(
        changed.stderr.contains("spec.owner cannot change once set"),
        "{}",
        changed.stderr
    );

    // Through v2 too: the API server converts to v1 (matchPolicy Equivalent) first.
    let v2 = apply(
        ns,
        &object(
            "v2",
            "Ticket",
            "dog",
            json!({"holder": "rex", "refuse": "no tickets for dogs"}),
        ),
        &[],
    );
    assert!(!v2.ok, "refused: {}", v2.stdout);
    assert!(
        v2.stderr
            .contains("denied the request: no tickets for dogs"),
        "{}",
        v2.stderr
    );

    // A validate that sleeps: answered by the host at the plugin's deadline, before the
    // API server's timeout (2 s), by the policy. Fail: refused, and says why.
    let hung = apply(
        ns,
        &object("v1", "Ticket", "sleepy", json!({"sleep": true})),
        &[],
    );
    assert!(!hung.ok, "refused: {}", hung.stdout);
    assert!(
        hung.stderr
            .contains("validation could not run, and its failure policy is Fail"),
        "the host's answer, not the API server's timeout: {}",
        hung.stderr
    );
    assert!(hung.stderr.contains("deadline"), "{}", hung.stderr);
    assert!(hung.took < Duration::from_secs(5), "took {:?}", hung.took);
    println!(
        "a sleeping validate (Fail) was answered in {:?}, kubectl included",
        hung.took
    );
    let panicked = apply(
        ns,
        &object("v1", "Ticket", "panicky", json!({"panic": true})),
        &[],
    );
    assert!(!panicked.ok);
    assert!(
        panicked.stderr.contains("spec.panic is set"),
        "{}",
        panicked.stderr
    );

    // Ignore: allowed, with a warning that says validation could not run.
    let let_through = apply(
        ns,
        &object("v1", "Pass", "sleepy", json!({"sleep": true})),
        &[],
    );
    assert!(let_through.ok, "allowed: {}", let_through.stderr);
    assert!(
        let_through
            .stderr
            .contains("allowed by failure policy Ignore"),
        "{}",
        let_through.stderr
    );
    assert!(
        let_through.took < Duration::from_secs(5),
        "took {:?}",
        let_through.took
    );
    let refused_pass = apply(
        ns,
        &object("v1", "Pass", "full", json!({"refuse": "sold out"})),
        &[],
    );
    assert!(!refused_pass.ok);
    assert!(
        refused_pass.stderr.contains("sold out"),
        "{}",
        refused_pass.stderr
    );
    Ok(())
}

fn ticket_kind(version: &str) -> ApiResource {
    ApiResource {
        group: "test.capstan.dev".into(),
        version: version.into(),
        api_version: format!("test.capstan.dev/{version}"),
        kind: "Ticket".into(),
        plural: "tickets".into(),
    }
}

#[tokio::test]
async fn objects_read_back_in_either_version_through_the_plugins_convert() {
    let _turn = TURNS.lock().await;
    in_test_namespace("e2e-conversion", T, async |client, ns| {
        let (op, configuration) = operator(&ns).await;
        let result = conversion(&client, &ns, &op).await;
        drop(op);
        clean_up(&client, &configuration).await;
        result
    })
    .await
    .unwrap();
}

async fn conversion(client: &Client, ns: &str, op: &Operator) -> Result<()> {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    wait_for("the CRD's conversion webhook", T, || async {
        let crd = crds.get("tickets.test.capstan.dev").await?;
        let conversion = crd.spec.conversion.context("no spec.conversion")?;
        Ok((conversion.strategy == "Webhook").then_some(()))
    })
    .await
    .with_context(|| op.log_tail())?;
    until_the_api_server_calls_the_webhook(ns, op).await?;
    let v1 = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ticket_kind("v1"));
    let v2 = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ticket_kind("v2"));
    let create = |version: &str, name: &str, spec: Value| -> DynamicObject {
        serde_json::from_value(object(version, "Ticket", name, spec)).unwrap()
    };
    v1.create(
        &PostParams::default(),
        &create("v1", "old", json!({"owner": "ana"})),
    )
    .await
    .context("create as v1")?;
    v2.create(
        &PostParams::default(),
        &create("v2", "new", json!({"holder": "bo"})),
    )
    .await
    .context("create as v2")?;

    let old_as_v2 = v2.get("old").await.context("read v1 object as v2")?;
    assert_eq!(
        old_as_v2.types.as_ref().unwrap().api_version,
        "test.capstan.dev/v2"
    );
    assert_eq!(old_as_v2.data["spec"], json!({"holder": "ana"}));
    let new_as_v1 = v1.get("new").await.context("read v2 object as v1")?;
    assert_eq!(new_as_v1.data["spec"], json!({"owner": "bo"}));
    let new_as_v2 = v2.get("new").await?;
    assert_eq!(new_as_v2.data["spec"], json!({"holder": "bo"}));
    let listed = v2.list(&Default::default()).await?;
    let mut holders: Vec<String> = listed
        .items
        .iter()
        .map(|o| {
            o.data["spec"]["holder"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    holders.sort();
    assert_eq!(holders, ["ana", "bo"], "the list is converted, every item");

    // A conversion the plugin refuses: the read fails with its message.
    let mut refusing = create("v1", "stubborn", json!({"owner": "cy"}));
    refusing.metadata.annotations =
        Some([("test.capstan.dev/convert".to_string(), "refuse".to_string())].into());
    v1.create(&PostParams::default(), &refusing).await?;
    let err = v2.get("stubborn").await.expect_err("the conversion fails");
    assert!(
        err.to_string().contains("asked to refuse the conversion"),
        "the plugin's reason: {err}"
    );
    Ok(())
}
