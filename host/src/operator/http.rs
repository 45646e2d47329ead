//! The operator's small HTTP listener: `/metrics` (Prometheus text), `/healthz` (every
//! part of the host runs), `/readyz` (ready to reconcile) and `/plugins` (JSON state of
//! every plugin file). HTTP/1.1 is hyper's; each connection is its own task, bounded in
//! time, so a client that sends half a request, garbage, or never reads its answer holds
//! only its own connection, and only for a while.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use super::metrics::Metrics;

/// How long a client may take to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may last, whatever the client does (a client that never
/// reads a large `/metrics` answer).
const CONNECTION_LIMIT: Duration = Duration::from_secs(30);
/// How long to wait after an accept error that is not one connection's: running out of
/// file descriptors lasts a while, and retrying at once would spin a core and flood the
/// log.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// Connections one address keeps open at once; one more is closed as soon as it is
/// accepted. Each connection's idle time is bounded too (its header timeout), so a
/// client that opens many and sends nothing holds them for seconds, not for ever.
pub const MAX_CONNECTIONS: usize = 256;

/// Binds the listener for [`serve`].
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the endpoints until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    accept_tcp(&listener, "metrics", move |stream| {
        serve_connection(stream, metrics.clone())
    })
    .await
}

/// Accepts connections on `listener` and serves each with `serve` on a task of its own
/// (the metrics address, and the webhook's): the one accept loop of the host. `what`
/// names the address in the log.
pub async fn accept_tcp<F, Fut>(listener: &TcpListener, what: &str, serve: F)
where
    F: FnMut(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    accept_loop(
        || async move { listener.accept().await.map(|(stream, _)| stream) },
        what,
        ACCEPT_BACKOFF,
        serve,
    )
    .await
}

/// Accepts connections from `accept` and serves each on a task of its own, at most
/// [`MAX_CONNECTIONS`] at once; waits `backoff` after an accept error that is not one
/// connection's.
async fn accept_loop<S, A, AFut, F, Fut>(mut accept: A, what: &str, backoff: Duration, mut serve: F)
where
    A: FnMut() -> AFut,
    AFut: Future<Output = std::io::Result<S>>,
    F: FnMut(S) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        match accept().await {
            Ok(stream) => match open.clone().try_acquire_owned() {
                Ok(permit) => {
                    let serving = serve(stream);
                    tokio::spawn(async move {
                        serving.await;
                        drop(permit);
                    });
                }
                Err(_) => {
                    tracing::debug!(
                        "{MAX_CONNECTIONS} connections open on the {what} address: one more closed"
                    );
                    drop(stream);
                }
            },
            // One client's connection went away before it was accepted: take the next.
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                tracing::warn!("cannot accept a connection on the {what} address: {e}");
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Serves the requests of one connection, closing it after the first answer.
async fn serve_connection<S>(stream: S, metrics: Arc<Metrics>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let response = answer(request.uri().path(), &metrics);
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(CONNECTION_LIMIT, connection).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!("metrics connection: {e}"),
        Err(_) => tracing::debug!("metrics connection closed after {CONNECTION_LIMIT:?}"),
    }
}

fn answer(path: &str, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, content_type, body) = route(path, metrics);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a static status and content type make a valid response")
}

fn route(path: &str, metrics: &Metrics) -> (StatusCode, &'static str, String) {
    const TEXT: &str = "text/plain";
    match path {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        "/healthz" => match metrics.health() {
            Ok(()) => (StatusCode::OK, TEXT, "ok\n".into()),
            Err(why) => (StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{why}\n")),
        },
        "/readyz" if metrics.is_ready() => (StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            "not ready yet\n".into(),
        ),
        "/plugins" => (StatusCode::OK, "application/json", metrics.plugins_json()),
        _ => (StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::time::Instant;

    use super::*;

    #[test]
    fn healthz_fails_once_a_part_of_the_host_stopped() {
        let m = Metrics::default();
        assert_eq!(route("/healthz", &m).0, StatusCode::OK);
        assert_eq!(route("/readyz", &m).0, StatusCode::SERVICE_UNAVAILABLE);
        m.set_ready();
        assert_eq!(route("/readyz", &m).0, StatusCode::OK);
        m.set_failed("registry", "the plugin registry stopped".into());
        let (status, _, body) = route("/healthz", &m);
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            body.contains("registry: the plugin registry stopped"),
            "{body}"
        );
    }

    async fn server() -> SocketAddr {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Arc::new(Metrics::default())));
        addr
    }

    /// Sends `request` on a new connection and reads the answer to its end.
    async fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    }

    const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: capstan\r\n\r\n";

    #[tokio::test]
    async fn stalled_and_malformed_clients_hold_up_no_one() {
        let addr = server().await;
        // Clients that send half a request and stall, many of them.
        let mut stalled = Vec::new();
        for _ in 0..50 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nhost: cap")
                .await
                .unwrap();
            stalled.push(s);
        }
        let garbage = get(addr, b"\x00\x01\x02 nonsense \xff\r\n\r\n").await;
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage:?}");
        let ok = get(addr, HEALTHZ).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok:?}");
        assert!(ok.ends_with("ok\n"), "{ok:?}");
        // The stalled clients got nothing yet (an answer to a request not yet complete
        // would be a guess), and get their answer once their request is complete.
        let mut buf = [0u8; 64];
        for s in &stalled {
            assert!(
                matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                "a stalled client was answered before it finished its request"
            );
        }
        let mut first = stalled.swap_remove(0);
        first.write_all(b"stan\r\n\r\n").await.unwrap();
        let mut answer = Vec::new();
        first.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    }

    #[tokio::test]
    async fn a_request_that_arrives_in_pieces_is_read_whole() {
        let addr = server().await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /read").await.unwrap();
        s.flush().await.unwrap();
        tokio::task::yield_now().await;
        s.write_all(b"yz HTTP/1.1\r\nhost: capstan\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 503"),
            "/readyz, not ready: {answer:?}"
        );
    }

    #[tokio::test]
    async fn accept_errors_do_not_spin() {
        // An accept that keeps failing (out of file descriptors): record when each
        // attempt is made. A sleep never ends early, so attempts a backoff apart are an
        // order of events, not a timing.
        let backoff = Duration::from_millis(20);
        let attempts = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let seen = attempts.clone();
        let accept = move || {
            let seen = seen.clone();
            async move {
                let tries = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(Instant::now());
                    seen.len()
                };
                if tries >= 5 {
                    std::future::pending::<()>().await;
                }
                Err::<TcpStream, _>(std::io::Error::other("too many open files"))
            }
        };
        let metrics = Arc::new(Metrics::default());
        let server = tokio::spawn(accept_loop(accept, "metrics", backoff, move |stream| {
            serve_connection(stream, metrics.clone())
        }));
        while attempts.lock().unwrap().len() < 5 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.abort();
        let attempts = attempts.lock().unwrap();
        for pair in attempts.windows(2) {
            assert!(
                pair[1] - pair[0] >= backoff,
                "an accept error was retried after {:?}, without waiting {backoff:?}",
                pair[1] - pair[0]
            );
        }
    }
}
