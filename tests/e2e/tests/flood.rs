//! The host's servers under abuse (issue #34), with `capstan run` as a process on the
//! real local control plane: 200 clients each streaming a 64 MiB admission review at
//! its webhook at once (chunked, so no length warns the server), with 100 idle
//! connections on the webhook and 100 on `/metrics`. Throughout, `/readyz` answers and
//! a parent created meanwhile is reconciled; afterwards, the host's peak resident
//! memory (`VmHWM`) is under the Deployment's memory limit, and no upload was accepted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use capstan_e2e::objects::{create_object, test_kind};
use capstan_e2e::operator::{Operator, free_port, http_get, test_plugin};
use capstan_e2e::{in_test_namespace, wait_for};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(120);
const UPLOADS: usize = 200;
const UPLOAD_BYTES: usize = 64 << 20;
const IDLE: usize = 100;
/// The memory limit of the host's container in deploy/ and the chart.
const MEMORY_LIMIT_MIB: u64 = 512;
const PATH: &str = "/validate/ignore/passes.test.capstan.dev";

/// How one upload ended.
#[derive(Debug)]
enum Ended {
    /// The server answered with this status before the body was all sent, or after.
    Answered(u16),
    /// The server closed the connection (or refused it: beyond its connection cap).
    Closed,
}

/// One hostile client: a review head the server accepts, then megabytes of a string
/// that never ends, until the server answers or closes.
async fn upload(connector: tokio_rustls::TlsConnector, addr: String) -> Ended {
    let Ok(tcp) = TcpStream::connect(&addr).await else {
        return Ended::Closed;
    };
    let name = ServerName::try_from("127.0.0.1").expect("an IP address");
    let Ok(mut tls) = connector.connect(name, tcp).await else {
        return Ended::Closed;
    };
    let head = format!(
        "POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    let start = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"flood","object":{"spec":{"message":""#;
    let chunk = vec![b'a'; 1 << 20];
    let mut sent = 0;
    let mut write = async || -> std::io::Result<()> {
        tls.write_all(head.as_bytes()).await?;
        tls.write_all(format!("{:x}\r\n", start.len()).as_bytes())
            .await?;
        tls.write_all(start).await?;
        tls.write_all(b"\r\n").await?;
        while sent < UPLOAD_BYTES {
            tls.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .await?;
            tls.write_all(&chunk).await?;
            tls.write_all(b"\r\n").await?;
            sent += chunk.len();
        }
        tls.write_all(b"0\r\n\r\n").await?;
        tls.flush().await
    };
    let _ = write().await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    match answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
    {
        Some(code) => Ended::Answered(code),
        None => Ended::Closed,
    }
}

/// `VmRSS` or `VmHWM` of process `pid`, in MiB.
fn memory_mib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("a number")?
        .parse()?;
    Ok(kib / 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_outlasts_huge_uploads_and_idle_connections() {
    in_test_namespace("flood", T, async |client, ns| {
        let webhook = format!("127.0.0.1:{}", free_port());
        let configuration = format!("capstan-e2e-{ns}");
        let op = Operator::start(
            &ns,
            &[&test_plugin("pass"), &test_plugin("widget")],
            &["--webhook-addr", &webhook, "--webhook-configuration", &configuration],
        )
        .await;
        let pid = op.pid().context("the host runs")?;
        let port = op.metrics_port();
        let outcome = async {
            // The CA the host announced to the API server is the one to trust.
            let configurations = Api::<ValidatingWebhookConfiguration>::all(client.clone());
            let bundle = wait_for("the webhook's configuration", T, || async {
                Ok(configurations.get_opt(&configuration).await?.and_then(|c| {
                    c.webhooks?
                        .into_iter()
                        .find_map(|w| w.client_config.ca_bundle)
                        .map(|b| b.0)
                }))
            })
            .await?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&bundle) {
                roots.add(cert?)?;
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let before = memory_mib(pid, "VmRSS:")?;

            let mut idle = Vec::new();
            for addr in [webhook.clone(), format!("127.0.0.1:{port}")] {
                for _ in 0..IDLE {
                    if let Ok(c) = TcpStream::connect(&addr).await {
                        idle.push(c);
                    }
                }
            }
            let started = Instant::now();
            let uploads: Vec<_> = (0..UPLOADS)
                .map(|_| tokio::spawn(upload(connector.clone(), webhook.clone())))
                .collect();

            // Meanwhile: readiness answers, and a parent is reconciled.
            let widgets = test_kind("Widget", "widgets");
            let widget_api: Api<kube::api::DynamicObject> =
                Api::namespaced_with(client.clone(), &ns, &widgets);
            create_object(
                &widget_api,
                &widgets,
                "during",
                json!({"count": 1, "message": "hi"}),
            )
            .await;
            let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            let mut reconciled = None;
            let mut peak_rss = before;
            while uploads.iter().any(|u| !u.is_finished()) {
                ensure!(started.elapsed() < T, "the uploads still run after {T:?}");
                let ready = tokio::time::timeout(Duration::from_secs(5), http_get(port, "/readyz"))
                    .await
                    .map_err(|_| anyhow::anyhow!("/readyz took over 5 s"))?
                    .context("/readyz")?;
                ensure!(ready.starts_with("ok"), "/readyz said {ready:?}");
                if reconciled.is_none() && configmaps.get_opt("during-0").await?.is_some() {
                    reconciled = Some(started.elapsed());
                }
                peak_rss = peak_rss.max(memory_mib(pid, "VmRSS:")?);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let took = started.elapsed();
            let mut answered = std::collections::BTreeMap::<String, usize>::new();
            for upload in uploads {
                let ended = upload.await?;
                if let Ended::Answered(code) = ended {
                    ensure!(
                        code >= 400,
                        "an upload of {UPLOAD_BYTES} bytes was answered {code}"
                    );
                }
                *answered.entry(format!("{ended:?}")).or_default() += 1;
            }
            if reconciled.is_none() {
                wait_for("the parent created during the flood", T, || async {
                    Ok(configmaps.get_opt("during-0").await?.map(|_| ()))
                })
                .await?;
            }
            let hwm = memory_mib(pid, "VmHWM:")?;
            eprintln!(
                "flood: {UPLOADS} uploads of {} MiB and {} idle connections in {took:.1?}: {answered:?}; \
                 RSS {before} MiB before, {peak_rss} MiB at most while sampled, VmHWM {hwm} MiB; \
                 the parent created meanwhile reconciled after {reconciled:?}",
                UPLOAD_BYTES >> 20,
                idle.len()
            );
            ensure!(
                hwm < MEMORY_LIMIT_MIB,
                "the host's peak resident memory, {hwm} MiB, passed the Deployment's limit of {MEMORY_LIMIT_MIB} MiB"
            );
            drop(idle);
            // And it serves reviews again.
            let ready = http_get(port, "/readyz").await?;
            if !ready.starts_with("ok") {
                bail!("/readyz after the flood: {ready:?}");
            }
            Ok(())
        }
        .await;
        let _ = configurations_cleanup(&client, &configuration).await;
        outcome.with_context(|| op.log_tail())
    })
    .await
    .unwrap();
}

async fn configurations_cleanup(client: &kube::Client, name: &str) -> Result<()> {
    Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .delete(name, &Default::default())
        .await?;
    Ok(())
}
