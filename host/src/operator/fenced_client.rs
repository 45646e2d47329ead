//! The client the controllers write with. Every mutating request (POST, PUT, PATCH,
//! DELETE) asks the [`WriteFence`] twice:
//!
//! 1. when the request future is first polled ([`FenceLayer`]), before it queues for a
//!    connection;
//! 2. with [`fenced_client_with_connections`], again on every write of its bytes to the
//!    socket ([`FencedStream`]): mutating requests go over connections of their own,
//!    whose writes check the fence just before the bytes reach the kernel.
//!
//! The second check is the one that holds: a request that passed the first and was then
//! frozen (SIGSTOP, a stalled thread) while it waited for a connection, a TLS handshake
//! or the client's buffer, past the renew deadline, is refused on waking instead of
//! being sent by a deposed leader. What reached the kernel before the freeze left
//! before the lease could expire. What remains is the few instructions between the
//! check and the `write` system call; a server-side fence would need a precondition
//! Kubernetes does not offer for every write (docs/operator.md#leader-election).
//! Reads (GET: LIST, WATCH) always pass, over the plain client's connections: a
//! standby's caches may stay warm.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::io;
use std::time::Duration;

use http::{Method, Request, Uri};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioExecutor;
use kube::Client;
use kube::client::{Body, ConfigExt};
use tower::{Layer, Service, ServiceBuilder};

use super::leader::WriteFence;

/// A write the fence refused: this process no longer holds its lease (or membership).
#[derive(Debug, thiserror::Error)]
#[error("{method} {path} refused: this replica no longer holds its lease")]
pub struct FenceShut {
    /// The request's method.
    pub method: Method,
    /// The request's path.
    pub path: String,
}

/// Whether `method` changes the cluster.
fn mutates(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// A [`Layer`] that checks a [`WriteFence`] before every mutating request.
#[derive(Debug, Clone)]
pub struct FenceLayer {
    fence: WriteFence,
}

impl FenceLayer {
    /// Guards writes with `fence`.
    pub fn new(fence: WriteFence) -> Self {
        FenceLayer { fence }
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = Fenced<S>;

    fn layer(&self, inner: S) -> Fenced<S> {
        Fenced {
            inner,
            fence: self.fence.clone(),
        }
    }
}

/// The service of a [`FenceLayer`].
#[derive(Debug, Clone)]
pub struct Fenced<S> {
    inner: S,
    fence: WriteFence,
}

impl<S, B> Service<Request<B>> for Fenced<S>
where
    S: Service<Request<B>>,
    S::Error: Into<tower::BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let refused = mutates(request.method()).then(|| FenceShut {
            method: request.method().clone(),
            path: request.uri().path().to_string(),
        });
        let fence = self.fence.clone();
        let sent = self.inner.call(request);
        Box::pin(async move {
            // Checked when first polled, not when called: the future may wait (a slot
            // of the client's buffer) between the two.
            if let Some(refused) = refused
                && !fence.is_open()
            {
                return Err(refused.into());
            }
            sent.await.map_err(Into::into)
        })
    }
}

/// `client`, sharing its connections, with every mutating request checked against
/// `fence` when it is first polled (the first check of the module's doc only).
pub fn fenced_client(client: &Client, fence: WriteFence) -> Client {
    let inner = client.clone();
    let send = tower::service_fn(move |request: Request<Body>| {
        let inner = inner.clone();
        async move { inner.send(request).await }
    });
    let service = FenceLayer::new(fence).layer(send);
    Client::new(service, client.default_namespace().to_string())
}

/// `client` for reads, and for writes a client of its own made from `config` whose
/// connections check `fence` on every write to the socket: both checks of the module's
/// doc. Writes keep the API server's retries (429, 503, 504), authentication (with
/// token refresh) and headers of a client kube builds from `config`; they get the
/// config's connect timeout, and its read timeout (or 295 s) as a deadline.
pub fn fenced_client_with_connections(
    client: &Client,
    config: &kube::Config,
    fence: WriteFence,
) -> Result<Client, kube::Error> {
    let writes = write_client(config, fence.clone())?;
    let reads = client.clone();
    let deadline = config.read_timeout.unwrap_or(Duration::from_secs(295));
    let send = tower::service_fn(move |request: Request<Body>| {
        let (target, bounded) = match mutates(request.method()) {
            true => (writes.clone(), true),
            false => (reads.clone(), false),
        };
        async move {
            match bounded {
                true => tokio::time::timeout(deadline, target.send(request))
                    .await
                    .map_err(|_| kube::Error::Service("write timed out".into()))?,
                false => target.send(request).await,
            }
        }
    });
    let service = FenceLayer::new(fence).layer(send);
    Ok(Client::new(service, client.default_namespace().to_string()))
}

/// A client made from `config` whose connections are [`FencedStream`]s: every write to
/// their sockets asks `fence` (the second check of the module's doc).
fn write_client(config: &kube::Config, fence: WriteFence) -> Result<Client, kube::Error> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    let connector = config.rustls_https_connector_with_connector(FencedConnector {
        inner: tcp,
        fence: fence.clone(),
    })?;
    let hyper: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let writes = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| {
            tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry())
        }))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(Client::new(writes, config.default_namespace.clone()))
}

/// A connector whose connections are [`FencedStream`]s.
#[derive(Debug, Clone)]
struct FencedConnector<C> {
    inner: C,
    fence: WriteFence,
}

impl<C> Service<Uri> for FencedConnector<C>
where
    C: Service<Uri>,
    C::Future: Send + 'static,
{
    type Response = FencedStream<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let fence = self.fence.clone();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            Ok(FencedStream {
                inner: connecting.await?,
                fence,
            })
        })
    }
}

/// A connection that refuses to write while its fence is shut: checked on every write
/// and flush, just before the bytes go to the kernel (under TLS, so the handshake too).
/// Reads pass, so a response to what was sent before still arrives.
#[derive(Debug)]
pub struct FencedStream<T> {
    inner: T,
    fence: WriteFence,
}

impl<T> FencedStream<T> {
    fn shut(&self) -> Option<io::Error> {
        (!self.fence.is_open()).then(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "write refused: this replica no longer holds its lease",
            )
        })
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for FencedStream<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for FencedStream<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(shut) = self.shut() {
            return Poll::Ready(Err(shut));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(shut) = self.shut() {
            return Poll::Ready(Err(shut));
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(shut) = self.shut() {
            return Poll::Ready(Err(shut));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<T: Connection> Connection for FencedStream<T> {
    fn connected(&self) -> Connected {
        self.inner.connected()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::time::Instant;
    use tower::ServiceExt;

    use super::*;

    /// A fake inner service: counts the requests it sends (when its future runs, as a
    /// connection would) and answers 200.
    fn counting() -> (
        tower::util::BoxCloneService<Request<()>, http::Response<()>, tower::BoxError>,
        Arc<AtomicUsize>,
    ) {
        let reached = Arc::new(AtomicUsize::new(0));
        let count = reached.clone();
        let service = tower::service_fn(move |_: Request<()>| {
            let count = count.clone();
            async move {
                count.fetch_add(1, Ordering::SeqCst);
                Ok::<_, tower::BoxError>(http::Response::new(()))
            }
        });
        (tower::util::BoxCloneService::new(service), reached)
    }

    fn request(method: Method) -> Request<()> {
        Request::builder()
            .method(method)
            .uri("/api/v1/namespaces/ns/configmaps/c")
            .body(())
            .unwrap()
    }

    const WRITES: [Method; 4] = [Method::POST, Method::PUT, Method::PATCH, Method::DELETE];

    #[tokio::test]
    async fn a_shut_fence_stops_every_write_and_no_read() {
        let fence = WriteFence::for_leader_election();
        let (inner, reached) = counting();
        let mut service = FenceLayer::new(fence.clone()).layer(inner);
        for method in WRITES {
            let err = service
                .ready()
                .await
                .unwrap()
                .call(request(method.clone()))
                .await
                .expect_err("a write with the fence shut");
            let refused = err.downcast_ref::<FenceShut>().expect("a FenceShut");
            assert_eq!(refused.method, method);
            assert_eq!(refused.path, "/api/v1/namespaces/ns/configmaps/c");
        }
        assert_eq!(
            reached.load(Ordering::SeqCst),
            0,
            "no write reached the wire"
        );
        service
            .ready()
            .await
            .unwrap()
            .call(request(Method::GET))
            .await
            .unwrap();
        assert_eq!(reached.load(Ordering::SeqCst), 1, "reads pass a shut fence");

        fence.renewed(Instant::now(), Duration::from_secs(10));
        for method in WRITES {
            service
                .ready()
                .await
                .unwrap()
                .call(request(method))
                .await
                .unwrap();
        }
        assert_eq!(
            reached.load(Ordering::SeqCst),
            5,
            "an open fence lets writes through"
        );
    }

    #[tokio::test]
    async fn a_write_frozen_after_the_call_is_refused_on_waking() {
        // The request passed every earlier check and was handed to the client; then the
        // process froze past the renew deadline before the request was sent.
        let fence = WriteFence::for_leader_election();
        fence.renewed(Instant::now(), Duration::from_secs(10));
        let (inner, reached) = counting();
        let mut service = FenceLayer::new(fence.clone()).layer(inner);
        let pending = service.ready().await.unwrap().call(request(Method::PATCH));
        fence.shut();
        assert!(
            pending.await.is_err(),
            "refused when it would have been sent"
        );
        assert_eq!(reached.load(Ordering::SeqCst), 0, "nothing was sent");
    }

    /// An in-memory connection that records what is written to it.
    struct Recording(Arc<std::sync::Mutex<Vec<u8>>>);

    impl hyper::rt::Write for Recording {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn write(stream: &mut FencedStream<Recording>, bytes: &[u8]) -> io::Result<usize> {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        match hyper::rt::Write::poll_write(Pin::new(stream), &mut cx, bytes) {
            Poll::Ready(result) => result,
            Poll::Pending => panic!("the recording never blocks"),
        }
    }

    #[test]
    fn a_connection_writes_only_while_its_fence_is_open() {
        // The freeze the first check cannot see: the request was past it, waiting for
        // its connection, when the process stopped; it wakes past the renew deadline
        // and the connection's write is the last moment the host controls.
        let fence = WriteFence::for_leader_election();
        let wire = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut stream = FencedStream {
            inner: Recording(wire.clone()),
            fence: fence.clone(),
        };
        let err = write(&mut stream, b"PATCH /a").expect_err("the fence starts shut");
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(
            err.to_string().contains("no longer holds its lease"),
            "{err}"
        );
        fence.renewed(Instant::now(), Duration::from_secs(10));
        assert_eq!(write(&mut stream, b"PATCH /b").unwrap(), 8);
        fence.shut();
        write(&mut stream, b"PATCH /c").expect_err("shut again");
        assert_eq!(
            &*wire.lock().unwrap(),
            b"PATCH /b",
            "only the open write left"
        );
    }

    #[tokio::test]
    async fn writes_go_over_fenced_connections_and_reads_over_the_plain_client() {
        // A server that answers every request 200 and counts the connections made.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: Request<hyper::body::Incoming>| {
                            log.lock().unwrap().push(format!(
                                "{} {}",
                                req.method(),
                                req.uri().path()
                            ));
                            async {
                                Ok::<_, std::convert::Infallible>(
                                http::Response::builder()
                                    .header("content-type", "application/json")
                                    .body(http_body_util::Full::new(bytes::Bytes::from_static(
                                        br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"c","namespace":"ns"}}"#,
                                    )))
                                    .unwrap(),
                            )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let plain = Client::try_from(config.clone()).unwrap();
        let fence = WriteFence::for_leader_election();
        let fenced = fenced_client_with_connections(&plain, &config, fence.clone()).unwrap();
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(fenced, "ns");
        api.get("c").await.expect("reads pass a shut fence");
        let err = api
            .delete("c", &Default::default())
            .await
            .expect_err("a write with the fence shut");
        assert!(
            err.to_string().contains("no longer holds its lease"),
            "{err}"
        );
        fence.renewed(Instant::now(), Duration::from_secs(10));
        api.delete("c", &Default::default())
            .await
            .expect("the fence is open");
        assert_eq!(
            *seen.lock().unwrap(),
            [
                "GET /api/v1/namespaces/ns/configmaps/c",
                "DELETE /api/v1/namespaces/ns/configmaps/c"
            ]
        );

        // The writes' own connections refuse at the socket, without the outer check: what
        // stops a write that passed it and froze before it was sent.
        fence.shut();
        let writes: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(write_client(&config, fence.clone()).unwrap(), "ns");
        let err = writes
            .delete("c", &Default::default())
            .await
            .expect_err("the socket refuses while the fence is shut");
        let mut chain = Vec::new();
        let mut cause: Option<&dyn std::error::Error> = Some(&err);
        while let Some(e) = cause {
            chain.push(e.to_string());
            cause = e.source();
        }
        assert!(
            chain
                .iter()
                .any(|m| m.contains("no longer holds its lease")),
            "{chain:?}"
        );
        assert_eq!(seen.lock().unwrap().len(), 2, "nothing reached the server");
    }

    #[tokio::test]
    async fn the_fenced_client_refuses_writes_through_kube() {
        let (client, calls) = super::super::fake_api::client(|_| {
            (
                200,
                serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                                     "metadata": {"name": "c", "namespace": "ns"}}),
            )
        });
        let fence = WriteFence::for_leader_election();
        let fenced = fenced_client(&client, fence.clone());
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(fenced, "ns");
        api.get("c").await.expect("reads pass");
        let err = api
            .delete("c", &Default::default())
            .await
            .expect_err("a write with the fence shut");
        assert!(
            err.to_string().contains("no longer holds its lease"),
            "{err}"
        );
        assert_eq!(calls.summary(), ["GET /api/v1/namespaces/ns/configmaps/c"]);
        fence.renewed(Instant::now(), Duration::from_secs(10));
        api.delete("c", &Default::default())
            .await
            .expect("the fence is open");
        assert_eq!(calls.all().len(), 2);
    }
}
