//! The operator's small HTTP listener: `/metrics` (Prometheus text), `/healthz` (every
//! part of the host runs), `/readyz` (ready to reconcile) and `/plugins` (JSON state of
//! every plugin file). Requests are tiny GETs from probes and scrapers, so one read of
//! the request line is enough; each connection is answered and closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::metrics::Metrics;

/// How long a client may take to send its request line.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the listener for [`serve`].
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the endpoints until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(answer(stream, metrics.clone()));
    }
}

async fn answer(mut stream: TcpStream, metrics: Arc<Metrics>) {
    let mut buf = [0u8; 2048];
    let n = match tokio::time::timeout(READ_TIMEOUT, stream.read(&mut buf)).await {
        Ok(Ok(n)) => n,
        _ => return,
    };
    let request = String::from_utf8_lossy(&buf[..n]);
    let path = request.split_whitespace().nth(1).unwrap_or("/");
    let (status, content_type, body) = route(path, &metrics);
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
}

fn route(path: &str, metrics: &Metrics) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain";
    match path {
        "/metrics" => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        "/healthz" => match metrics.health() {
            Ok(()) => ("200 OK", TEXT, "ok\n".into()),
            Err(why) => ("500 Internal Server Error", TEXT, format!("{why}\n")),
        },
        "/readyz" if metrics.is_ready() => ("200 OK", TEXT, "ok\n".into()),
        "/readyz" => ("503 Service Unavailable", TEXT, "not ready yet\n".into()),
        "/plugins" => ("200 OK", "application/json", metrics.plugins_json()),
        _ => ("404 Not Found", TEXT, "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_fails_once_a_part_of_the_host_stopped() {
        let m = Metrics::default();
        assert_eq!(route("/healthz", &m).0, "200 OK");
        assert_eq!(route("/readyz", &m).0, "503 Service Unavailable");
        m.set_ready();
        assert_eq!(route("/readyz", &m).0, "200 OK");
        m.set_failed("registry", "the plugin registry stopped".into());
        let (status, _, body) = route("/healthz", &m);
        assert_eq!(status, "500 Internal Server Error");
        assert!(
            body.contains("registry: the plugin registry stopped"),
            "{body}"
        );
    }
}
