//! The webhook against test plugins loaded in a sandbox (`ticket`: failure policy Fail,
//! converts v1 and v2; `pass`: failure policy Ignore), over HTTPS on loopback with a
//! client that trusts only the CA bundle the host announced, and a fake API server that
//! records what the host told it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::super::fake_api::{self, Calls};
use super::*;
use crate::plugin::{Sandbox, SandboxConfig};

/// The deadline of the test sandbox's calls: short, so that hostile plugins are
/// answered for quickly.
const DEADLINE: Duration = Duration::from_millis(500);

fn cache_dir() -> PathBuf {
    std::env::temp_dir().join("capstan-test-cache")
}

/// Loads the test plugin `name` on a thread of its own (loading blocks on the
/// sandbox's runtime, which a test's runtime may not do).
fn load(name: &str) -> (Sandbox, Plugin) {
    let name = name.to_string();
    std::thread::spawn(move || {
        let sandbox = Sandbox::new(SandboxConfig {
            deadline: DEADLINE,
            memory_limit: 32 << 20,
            cache_dir: Some(cache_dir()),
            instances: 8,
            ..SandboxConfig::default()
        })
        .unwrap();
        let plugin = sandbox
            .load_file_blocking(&crate::fixtures::test_plugin(&name))
            .unwrap_or_else(|e| panic!("{e} (build the test plugins: cargo xtask plugins)"));
        (sandbox, plugin)
    })
    .join()
    .expect("the plugin loads")
}

/// A fake API server that holds no object (a GET finds nothing) and accepts every
/// write, answering with what was written.
fn echo_writes(call: &fake_api::Call) -> (u16, Value) {
    match call.method {
        http::Method::GET => fake_api::status(404, "NotFound", "none"),
        _ => (200, call.body.clone()),
    }
}

/// How many calls wrote (the conversion's apply reads the CRD first).
fn writes(calls: &Calls) -> usize {
    calls
        .all()
        .iter()
        .filter(|c| c.method != http::Method::GET)
        .count()
}

/// A webhook on a free loopback port against a fake API server that accepts every
/// write, with `plugins` recorded under their names.
async fn webhook(plugins: &[&Plugin]) -> (Webhooks, Calls) {
    let (client, calls) = fake_api::client(echo_writes);
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut opts = WebhookOptions::new(addr, Reach::Url("https://127.0.0.1:1".into()));
    opts.configuration = "capstan-test".into();
    opts.namespace = Some("ns1".into());
    let webhooks = Webhooks::new(client.clone(), client, opts);
    for plugin in plugins {
        let file = PathBuf::from(format!("/plugins/{}.wasm", plugin.info().name));
        webhooks.update(&file, Some(plugin)).await.unwrap();
    }
    (webhooks, calls)
}

/// POSTs `body` to `path` over HTTPS, trusting only the webhook's CA bundle; returns
/// the status code and the body.
async fn post(webhooks: &Webhooks, path: &str, body: &Value) -> (u16, String) {
    let mut tls = tls_connect(webhooks).await;
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await.unwrap();
    answer(&mut tls).await
}

/// The status code and body of the answer on `tls`, read to its end.
async fn answer(tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> (u16, String) {
    let mut answer = Vec::new();
    // A TLS peer that closes without close_notify is an error here: the answer is
    // complete all the same.
    let _ = tls.read_to_end(&mut answer).await;
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// A TLS connection to the webhook, trusting only its CA bundle.
async fn tls_connect(
    webhooks: &Webhooks,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let addr = webhooks.local_addr().await.expect("the server runs");
    let bundle = webhooks.ca_bundle().await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    connector
        .connect(name, tcp)
        .await
        .expect("the certificate is valid for 127.0.0.1 and signed by the announced CA")
}

fn admission_review(operation: &str, old: Option<Value>, new: Value) -> Value {
    let mut request = json!({
        "uid": "req-1",
        "kind": {"group": "test.capstan.dev", "version": "v1", "kind": "Ticket"},
        "operation": operation,
        "object": new,
    });
    if let Some(old) = old {
        request["oldObject"] = old;
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

fn ticket(spec: Value) -> Value {
    json!({"apiVersion": "test.capstan.dev/v1", "kind": "Ticket",
           "metadata": {"name": "t", "namespace": "ns1", "uid": "u-t"}, "spec": spec})
}

/// POSTs an AdmissionReview and returns its `response`, and how long it took.
async fn admit(webhooks: &Webhooks, path: &str, review: Value) -> (Value, Duration) {
    let started = Instant::now();
    let (code, body) = post(webhooks, path, &review).await;
    let took = started.elapsed();
    assert_eq!(code, 200, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(body["kind"], "AdmissionReview");
    assert_eq!(body["response"]["uid"], "req-1");
    (body["response"].clone(), took)
}

const TICKETS: &str = "/validate/fail/tickets.test.capstan.dev";
const PASSES: &str = "/validate/ignore/passes.test.capstan.dev";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_allows_with_warnings_and_refuses_with_the_plugins_message() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;

    let (allowed, _) = admit(
        &webhooks,
        TICKETS,
        admission_review("CREATE", None, ticket(json!({"owner": "ana"}))),
    )
    .await;
    assert_eq!(allowed["allowed"], true);
    assert!(allowed.get("warnings").is_none());

    let (warned, _) = admit(
        &webhooks,
        TICKETS,
        admission_review(
            "CREATE",
            None,
            ticket(json!({"warn": "seat 13 is unlucky"})),
        ),
    )
    .await;
    assert_eq!(warned["allowed"], true);
    assert_eq!(warned["warnings"], json!(["seat 13 is unlucky"]));

    let (refused, _) = admit(
        &webhooks,
        TICKETS,
        admission_review(
            "CREATE",
            None,
            ticket(json!({"refuse": "no tickets for cats"})),
        ),
    )
    .await;
    assert_eq!(refused["allowed"], false);
    assert_eq!(refused["status"]["code"], 403);
    assert_eq!(refused["status"]["message"], "no tickets for cats");

    // UPDATE hands the old object too.
    let (changed, _) = admit(
        &webhooks,
        TICKETS,
        admission_review(
            "UPDATE",
            Some(ticket(json!({"owner": "ana"}))),
            ticket(json!({"owner": "bo"})),
        ),
    )
    .await;
    assert_eq!(changed["allowed"], false);
    assert!(
        changed["status"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot change"),
        "{changed}"
    );

    // A parent being deleted only loses finalizers: allowed without asking.
    let mut deleting = ticket(json!({"owner": "bo"}));
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let (released, _) = admit(
        &webhooks,
        TICKETS,
        admission_review("UPDATE", Some(ticket(json!({"owner": "ana"}))), deleting),
    )
    .await;
    assert_eq!(released["allowed"], true);
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validate_that_hangs_or_panics_is_answered_by_the_failure_policy_at_its_deadline() {
    let (_s1, ticket_plugin) = load("ticket");
    let (_s2, pass_plugin) = load("pass");
    let (webhooks, _) = webhook(&[&ticket_plugin, &pass_plugin]).await;
    // Well within the API server's wait (timeoutSeconds 2 for a 500 ms deadline).
    let prompt = DEADLINE + Duration::from_millis(1000);

    let (hung, took) = admit(
        &webhooks,
        TICKETS,
        admission_review("CREATE", None, ticket(json!({"sleep": true}))),
    )
    .await;
    assert_eq!(hung["allowed"], false, "Fail: refused");
    let message = hung["status"]["message"].as_str().unwrap();
    assert!(message.starts_with("validation could not run"), "{message}");
    assert!(message.contains("deadline"), "says why: {message}");
    assert!(took < prompt, "answered after {took:?}");

    let (panicked, _) = admit(
        &webhooks,
        TICKETS,
        admission_review("CREATE", None, ticket(json!({"panic": true}))),
    )
    .await;
    assert_eq!(panicked["allowed"], false);
    let message = panicked["status"]["message"].as_str().unwrap();
    assert!(message.starts_with("validation could not run"), "{message}");
    assert!(
        message.contains("spec.panic is set"),
        "the panic's message: {message}"
    );

    let pass = |spec| {
        json!({"apiVersion": "test.capstan.dev/v1", "kind": "Pass",
        "metadata": {"name": "p", "namespace": "ns1"}, "spec": spec})
    };
    let (let_through, took) = admit(
        &webhooks,
        PASSES,
        admission_review("CREATE", None, pass(json!({"sleep": true}))),
    )
    .await;
    assert_eq!(let_through["allowed"], true, "Ignore: allowed");
    let warning = let_through["warnings"][0].as_str().unwrap();
    assert!(
        warning.contains("allowed by failure policy Ignore"),
        "{warning}"
    );
    assert!(took < prompt, "answered after {took:?}");
    // Its own refusals still refuse: the policy is only for when it cannot answer.
    let (refused, _) = admit(
        &webhooks,
        PASSES,
        admission_review("CREATE", None, pass(json!({"refuse": "full"}))),
    )
    .await;
    assert_eq!(refused["allowed"], false);
    assert_eq!(refused["status"]["message"], "full");
    webhooks.stop().await;
}

fn conversion_review(to: &str, objects: Vec<Value>) -> Value {
    json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
           "request": {"uid": "conv-1", "desiredAPIVersion": to, "objects": objects}})
}

async fn convert(webhooks: &Webhooks, review: Value) -> (Value, Duration) {
    let started = Instant::now();
    let (code, body) = post(webhooks, "/convert/tickets.test.capstan.dev", &review).await;
    let took = started.elapsed();
    assert_eq!(code, 200, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["kind"], "ConversionReview");
    assert_eq!(body["response"]["uid"], "conv-1");
    (body["response"].clone(), took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversion_converts_every_object_or_fails_with_a_reason_within_the_deadline() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;
    let objects: Vec<Value> = (0..5)
        .map(|i| {
            let mut t = ticket(json!({"owner": format!("owner-{i}")}));
            t["metadata"]["name"] = json!(format!("t{i}"));
            t
        })
        .collect();
    let (done, _) = convert(
        &webhooks,
        conversion_review("test.capstan.dev/v2", objects.clone()),
    )
    .await;
    assert_eq!(done["result"]["status"], "Success");
    let converted = done["convertedObjects"].as_array().unwrap();
    assert_eq!(converted.len(), 5);
    for (i, object) in converted.iter().enumerate() {
        assert_eq!(object["apiVersion"], "test.capstan.dev/v2");
        assert_eq!(object["metadata"]["name"], format!("t{i}"), "in order");
        assert_eq!(object["spec"], json!({"holder": format!("owner-{i}")}));
    }
    // And back.
    let (back, _) = convert(
        &webhooks,
        conversion_review("test.capstan.dev/v1", converted.clone()),
    )
    .await;
    assert_eq!(back["convertedObjects"], json!(objects));

    for (misbehaviour, expected) in [
        ("sleep", "deadline"),
        ("panic", "asked to panic in convert"),
        ("refuse", "asked to refuse the conversion"),
    ] {
        let mut bad = objects.clone();
        bad[2]["metadata"]["annotations"] = json!({"test.capstan.dev/convert": misbehaviour});
        let (failed, took) =
            convert(&webhooks, conversion_review("test.capstan.dev/v2", bad)).await;
        assert_eq!(failed["result"]["status"], "Failure", "{misbehaviour}");
        let message = failed["result"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{misbehaviour}: {message}");
        assert_eq!(failed["convertedObjects"], json!([]));
        assert!(
            took < DEADLINE + Duration::from_secs(1),
            "{misbehaviour}: {took:?}"
        );
    }
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_is_told_about_each_plugin_and_about_each_that_goes() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, calls) = webhook(&[&plugin]).await;
    let applied = |calls: &Calls, suffix: &str| -> Vec<fake_api::Call> {
        calls
            .all()
            .into_iter()
            .filter(|c| c.method == http::Method::PATCH && c.path.ends_with(suffix))
            .collect()
    };
    let configurations = applied(
        &calls,
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/capstan-test",
    );
    assert_eq!(configurations.len(), 1, "{:?}", calls.summary());
    let first = &configurations[0];
    assert!(
        first.has_query("fieldManager=capstan-webhook"),
        "{}",
        first.query
    );
    assert!(first.has_query("force=true"));
    let hooks = first.body["webhooks"].as_array().unwrap();
    assert_eq!(hooks.len(), 1);
    assert_eq!(hooks[0]["name"], "validate.tickets.test.capstan.dev");
    assert_eq!(hooks[0]["failurePolicy"], "Fail");
    assert_eq!(
        hooks[0]["timeoutSeconds"], 2,
        "a 500 ms deadline, plus a second"
    );
    assert_eq!(
        hooks[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "ns1"
    );
    let bundle = webhooks.ca_bundle().await.unwrap();
    use base64::Engine as _;
    assert_eq!(
        hooks[0]["clientConfig"]["caBundle"],
        base64::engine::general_purpose::STANDARD.encode(&bundle)
    );
    let crds = applied(
        &calls,
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/tickets.test.capstan.dev",
    );
    assert_eq!(crds.len(), 1);
    assert_eq!(crds[0].body["spec"]["conversion"]["strategy"], "Webhook");
    assert!(crds[0].has_query("fieldManager=capstan-webhook"));

    // The same plugin again (a new limits file, say): nothing to tell.
    let file = Path::new("/plugins/ticket.wasm");
    webhooks.update(file, Some(&plugin)).await.unwrap();
    assert_eq!(writes(&calls), 2, "{:?}", calls.summary());

    // The plugin goes: its webhook entry goes; the CRD keeps its conversion webhook.
    webhooks.update(file, None).await.unwrap();
    let configurations = applied(
        &calls,
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/capstan-test",
    );
    assert_eq!(configurations.len(), 2);
    assert_eq!(configurations[1].body["webhooks"], json!([]));
    assert_eq!(writes(&calls), 3, "{:?}", calls.summary());
    // A request still on its way is answered as the configuration said: Fail.
    let (gone, _) = admit(
        &webhooks,
        TICKETS,
        admission_review("CREATE", None, ticket(json!({"owner": "a"}))),
    )
    .await;
    assert_eq!(gone["allowed"], false);
    assert!(
        gone["status"]["message"]
            .as_str()
            .unwrap()
            .contains("no plugin serves this webhook")
    );
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configuration_is_owned_by_the_named_clusterrole_once_it_can_be_read() {
    let (_sandbox, plugin) = load("ticket");
    // The ClusterRole is readable only after the first apply (RBAC not there yet, say).
    let readable = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let can_read = readable.clone();
    let (client, calls) = fake_api::client(move |call| match call.method {
        http::Method::GET
            if call.path == "/apis/rbac.authorization.k8s.io/v1/clusterroles/capstan"
                && can_read.load(std::sync::atomic::Ordering::SeqCst) =>
        {
            (
                200,
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                       "metadata": {"name": "capstan", "uid": "uid-of-the-role"}, "rules": []}),
            )
        }
        http::Method::GET if call.path.contains("/clusterroles/") => {
            fake_api::status(403, "Forbidden", "not yet")
        }
        _ => echo_writes(call),
    });
    let mut opts = WebhookOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        Reach::Url("https://127.0.0.1:1".into()),
    );
    opts.owner = Some("capstan".into());
    opts.check_every = Duration::from_millis(100);
    let webhooks = Webhooks::new(client.clone(), client, opts);
    webhooks
        .update(Path::new("/plugins/ticket.wasm"), Some(&plugin))
        .await
        .expect("applied without an owner while the ClusterRole cannot be read");
    let configurations = || -> Vec<Value> {
        calls
            .all()
            .into_iter()
            .filter(|c| {
                c.method == http::Method::PATCH
                    && c.path.ends_with("/validatingwebhookconfigurations/capstan")
            })
            .map(|c| c.body)
            .collect()
    };
    assert_eq!(configurations().len(), 1, "{:?}", calls.summary());
    assert!(configurations()[0]["metadata"]["ownerReferences"].is_null());

    readable.store(true, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while configurations().len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the maintenance did not apply the owner: {:?}",
            calls.summary()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        configurations()[1]["metadata"]["ownerReferences"],
        json!([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "name": "capstan", "uid": "uid-of-the-role"}])
    );
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_is_not_recorded_when_the_api_server_cannot_be_told() {
    let (_sandbox, plugin) = load("ticket");
    let (client, _) = fake_api::client(|_| fake_api::status(403, "Forbidden", "no rights"));
    let opts = WebhookOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        Reach::Url("https://127.0.0.1:1".into()),
    );
    let webhooks = Webhooks::new(client.clone(), client, opts);
    let err = webhooks
        .update(Path::new("/plugins/ticket.wasm"), Some(&plugin))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot apply ValidatingWebhookConfiguration capstan"),
        "{err}"
    );
    assert!(webhooks.inner.served.read().unwrap().is_empty());
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_needs_no_webhook_starts_no_server() {
    let (_sandbox, plugin) = load("widget");
    let (webhooks, calls) = webhook(&[&plugin]).await;
    assert_eq!(webhooks.local_addr().await, None);
    assert!(calls.all().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_and_methods_are_refused() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;
    let (code, _) = post(
        &webhooks,
        "/validate/maybe/tickets.test.capstan.dev",
        &json!({}),
    )
    .await;
    assert_eq!(code, 404);
    let (code, _) = post(&webhooks, "/metrics", &json!({})).await;
    assert_eq!(code, 404);
    let (code, body) = post(&webhooks, TICKETS, &json!({"apiVersion": "v1"})).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.starts_with("not a AdmissionReview v1"), "{body}");
    webhooks.stop().await;
}

#[tokio::test]
async fn an_oversized_review_is_refused_before_its_body_is_sent() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;
    for (path, limit) in [
        (TICKETS, MAX_ADMISSION_BODY),
        ("/convert/tickets.test.capstan.dev", MAX_CONVERSION_BODY),
    ] {
        let mut tls = tls_connect(&webhooks).await;
        // 64 MiB announced, not a byte of it sent: the answer comes all the same.
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            64 << 20
        );
        tls.write_all(head.as_bytes()).await.unwrap();
        let (code, body) = tokio::time::timeout(Duration::from_secs(5), answer(&mut tls))
            .await
            .expect("refused without waiting for the body");
        assert_eq!(code, 413, "{body}");
        assert!(
            body.contains(&format!("over this webhook's limit of {limit}")),
            "{body}"
        );
    }
    webhooks.stop().await;
}

#[tokio::test]
async fn a_review_of_another_kind_is_refused_on_its_head() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;
    let conversion = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "1", "desiredAPIVersion": "v1", "objects": []}});
    let (code, body) = post(&webhooks, TICKETS, &conversion).await;
    assert_eq!(code, 400, "{body}");
    assert!(
        body.starts_with(
            "not a AdmissionReview v1: it is a ConversionReview apiextensions.k8s.io/v1"
        ),
        "{body}"
    );
    webhooks.stop().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_and_reviews_go_on_once_they_go() {
    let (_sandbox, plugin) = load("ticket");
    let (webhooks, _) = webhook(&[&plugin]).await;
    let addr = webhooks.local_addr().await.unwrap();
    // Idle clients that never start their TLS handshake hold every connection.
    let mut idle = Vec::new();
    for _ in 0..crate::operator::http::MAX_CONNECTIONS {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // One more is accepted and closed at once (the accept loop takes them in order, so
    // retry until the cap is reached by the server's count).
    let closed = wait_until(Duration::from_secs(10), || async {
        let mut extra = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(500), extra.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => Some(()),
            _ => None,
        }
    })
    .await;
    assert!(
        closed.is_some(),
        "a connection beyond the cap was kept open"
    );
    drop(idle);
    let ticket = ticket(json!({"owner": "ana"}));
    let served = wait_until(Duration::from_secs(10), || async {
        let review = admission_review("CREATE", None, ticket.clone());
        let (code, _) = post(&webhooks, TICKETS, &review).await;
        (code == 200).then_some(())
    })
    .await;
    assert!(
        served.is_some(),
        "the webhook serves again once the idle clients went"
    );
    webhooks.stop().await;
}

/// Calls `check` until it gives a value, for at most `within`.
async fn wait_until<T, F, Fut>(within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Some(value) = check().await {
            return Some(value);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[test]
fn routes_name_the_policy_and_the_crd() {
    assert_eq!(
        route("/validate/fail/tickets.test.capstan.dev"),
        Some(Route::Validate(
            FailurePolicy::Fail,
            "tickets.test.capstan.dev"
        ))
    );
    assert_eq!(
        route("/validate/ignore/x.y.z"),
        Some(Route::Validate(FailurePolicy::Ignore, "x.y.z"))
    );
    assert_eq!(route("/convert/x.y.z"), Some(Route::Convert("x.y.z")));
    assert_eq!(route("/convert/x.y.z/more"), None);
    assert_eq!(route("/validate/x.y.z"), None);
    assert_eq!(route("/"), None);
}

/// A Secret as the API server stores it: data base64, with a resourceVersion.
fn secret_json(material: &Material, resource_version: u64) -> Value {
    use base64::Engine as _;
    let data: serde_json::Map<String, Value> = material
        .to_secret_data()
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                json!(base64::engine::general_purpose::STANDARD.encode(v)),
            )
        })
        .collect();
    json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
           "metadata": {"name": "capstan-webhook-tls", "namespace": "capstan-system",
                        "resourceVersion": resource_version.to_string()},
           "data": data})
}

#[tokio::test]
async fn replicas_share_the_certificate_through_the_secret() {
    let names = vec!["capstan-webhook.capstan-system.svc".to_string()];
    // What another replica writes while this one makes its own.
    let theirs = Material::generate(&names, Lifetimes::default(), SystemTime::now()).unwrap();
    let stored: Arc<std::sync::Mutex<Option<(Value, u64)>>> = Arc::default();
    let server = stored.clone();
    let written_by_them = theirs.clone();
    let (client, calls) = fake_api::client(move |call| {
        let mut stored = server.lock().unwrap();
        match (&call.method, stored.as_ref()) {
            (&http::Method::GET, None) => fake_api::status(404, "NotFound", "none"),
            (&http::Method::GET, Some((secret, _))) => (200, secret.clone()),
            // The other replica created it between our read and our create.
            (&http::Method::POST, None) => {
                *stored = Some((secret_json(&written_by_them, 1), 1));
                fake_api::status(409, "AlreadyExists", "already exists")
            }
            (&http::Method::POST, Some(_)) => {
                fake_api::status(409, "AlreadyExists", "already exists")
            }
            (&http::Method::PUT, Some((_, version))) => {
                let precondition = call.body["metadata"]["resourceVersion"].as_str();
                if precondition != Some(version.to_string().as_str()) {
                    return fake_api::status(409, "Conflict", "the object has been modified");
                }
                let mut written = call.body.clone();
                written["metadata"]["resourceVersion"] = json!((version + 1).to_string());
                *stored = Some((written.clone(), version + 1));
                (200, written)
            }
            _ => fake_api::status(404, "NotFound", "none"),
        }
    });
    let ours = stored_material(
        &client,
        "capstan-system",
        "capstan-webhook-tls",
        &names,
        Lifetimes::default(),
        true,
    )
    .await
    .unwrap();
    assert_eq!(
        ours.ca, theirs.ca,
        "the replica that lost the race takes the stored CA"
    );
    assert_eq!(ours.serving, theirs.serving);
    assert_eq!(
        calls
            .summary()
            .iter()
            .filter(|c| c.starts_with("POST"))
            .count(),
        1,
        "{:?}",
        calls.summary()
    );
    // Due for renewal: written back with the resourceVersion read as precondition, and
    // signed by the same CA.
    // (a 120-day lifetime makes the 30-day certificate stored have less than a third
    // of it left.)
    let longer = Lifetimes {
        ca: Duration::from_secs(365 * 24 * 3600),
        serving: Duration::from_secs(120 * 24 * 3600),
    };
    let renewed = stored_material(
        &client,
        "capstan-system",
        "capstan-webhook-tls",
        &names,
        longer,
        true,
    )
    .await
    .unwrap();
    assert_eq!(renewed.ca, theirs.ca, "the same CA");
    assert_ne!(renewed.serving, theirs.serving);
    let replace = calls
        .all()
        .into_iter()
        .find(|c| c.method == http::Method::PUT)
        .expect("a replace");
    assert_eq!(replace.body["metadata"]["resourceVersion"], "1");
    // The next replica reads the renewed one.
    let next = stored_material(
        &client,
        "capstan-system",
        "capstan-webhook-tls",
        &names,
        Lifetimes::default(),
        true,
    )
    .await
    .unwrap();
    assert_eq!(next, renewed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_serves_with_the_shared_certificate_and_tells_the_api_server_nothing() {
    let (_sandbox, plugin) = load("ticket");
    // Secrets are created (and echoed back); everything else is recorded.
    let (client, calls) = fake_api::client(|call| match call.method {
        http::Method::GET => fake_api::status(404, "NotFound", "none"),
        _ => (200, call.body.clone()),
    });
    let mut opts = WebhookOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        Reach::Url("https://127.0.0.1:1".into()),
    );
    opts.secret = Some(("capstan-system".into(), "capstan-webhook-tls".into()));
    let webhooks = Webhooks::new(client.clone(), client, opts);
    assert!(webhooks.shares_certificate());
    let file = Path::new("/plugins/ticket.wasm");
    webhooks.serve_only(file, Some(&plugin)).await.unwrap();
    assert_refuses_as_the_plugin_says(&webhooks).await;
    let summary = calls.summary();
    assert_eq!(
        summary,
        [
            "GET /api/v1/namespaces/capstan-system/secrets/capstan-webhook-tls",
            "POST /api/v1/namespaces/capstan-system/secrets",
        ],
        "only the Secret, created as it was missing"
    );
    // Leading: the registry's plugins are announced.
    webhooks.leading().await;
    webhooks.update(file, Some(&plugin)).await.unwrap();
    assert!(
        calls.summary().iter().any(|c| c.starts_with(
            "PATCH /apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/capstan"
        )),
        "{:?}",
        calls.summary()
    );
    webhooks.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_ready_only_once_it_serves_the_plugins_of_the_directory() {
    let (sandbox, _) = load("ticket");
    let dir = std::env::temp_dir().join(format!("capstan-standby-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        crate::fixtures::test_plugin("ticket"),
        dir.join("ticket.wasm"),
    )
    .unwrap();
    // The webhook's address is taken: the standby cannot serve, so it is not ready.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let (client, _) = fake_api::client(|call| match call.method {
        http::Method::GET => fake_api::status(404, "NotFound", "none"),
        _ => (200, call.body.clone()),
    });
    let mut opts = WebhookOptions::new(addr, Reach::Url("https://127.0.0.1:1".into()));
    opts.secret = Some(("capstan-system".into(), "capstan-webhook-tls".into()));
    let webhooks = Webhooks::new(client.clone(), client, opts);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    let standby = tokio::spawn(webhooks.clone().serve_standby(
        dir.clone(),
        crate::operator::source::PluginSource::files_only(),
        sandbox,
        Duration::from_millis(50),
        move || {
            let _ = tx.send(());
        },
    ));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        rx.try_recv().is_err(),
        "ready while the webhook cannot listen"
    );
    assert!(webhooks.local_addr().await.is_none());
    // Free: the next pass serves the plugin, and only then is the standby ready.
    drop(taken);
    tokio::time::timeout(Duration::from_secs(30), &mut rx)
        .await
        .expect("ready once it can serve")
        .unwrap();
    assert_refuses_as_the_plugin_says(&webhooks).await;
    standby.abort();
    webhooks.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ticket the plugin refuses is refused with its message: the webhook serves it.
async fn assert_refuses_as_the_plugin_says(webhooks: &Webhooks) {
    let (refused, _) = admit(
        webhooks,
        TICKETS,
        admission_review("CREATE", None, ticket(json!({"refuse": "standby says no"}))),
    )
    .await;
    assert_eq!(refused["status"]["message"], "standby says no");
}

/// The certificate the server presents now, DER.
async fn presented(webhooks: &Webhooks) -> Vec<u8> {
    let addr = webhooks.local_addr().await.unwrap();
    let bundle = webhooks.ca_bundle().await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .expect("the presented certificate is trusted by the announced bundle");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_ca_is_announced_before_its_certificate_is_served() {
    let (_sandbox, plugin) = load("ticket");
    let (client, calls) = fake_api::client(echo_writes);
    let mut opts = WebhookOptions::new(
        "127.0.0.1:0".parse().unwrap(),
        Reach::Url("https://127.0.0.1:1".into()),
    );
    // Renewed with a third of 4 s left: after about 3 s.
    opts.lifetimes = Lifetimes {
        ca: Duration::from_secs(4),
        serving: Duration::from_secs(4),
    };
    opts.check_every = Duration::from_millis(100);
    let webhooks = Webhooks::new(client.clone(), client, opts);
    webhooks
        .update(Path::new("/plugins/ticket.wasm"), Some(&plugin))
        .await
        .unwrap();
    let first = presented(&webhooks).await;
    let configurations = || {
        calls
            .all()
            .into_iter()
            .filter(|c| c.path.contains("validatingwebhookconfigurations"))
            .collect::<Vec<_>>()
    };
    let until = Instant::now() + Duration::from_secs(15);
    while configurations().len() < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let applied = configurations();
    assert!(
        applied.len() >= 2,
        "the renewal was announced: {:?}",
        calls.summary()
    );
    use base64::Engine as _;
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(
            applied[1].body["webhooks"][0]["clientConfig"]["caBundle"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    let bundle = String::from_utf8(bundle).unwrap();
    assert_eq!(
        bundle.matches("BEGIN CERTIFICATE").count(),
        2,
        "the new CA and the previous one, still valid"
    );
    let conversions = calls
        .all()
        .into_iter()
        .filter(|c| c.path.contains("customresourcedefinitions"))
        .count();
    assert!(
        conversions >= 2,
        "the CRD's bundle too: {:?}",
        calls.summary()
    );
    let renewed = presented(&webhooks).await;
    assert_ne!(first, renewed, "a new certificate is served");
    webhooks.stop().await;
}
