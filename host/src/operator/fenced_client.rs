//! The client the controllers write with: every mutating request (POST, PUT, PATCH,
//! DELETE) asks the [`WriteFence`] again at the last moment the host controls, when the
//! request future is first polled, just before it goes to the connection. A write that
//! passed the pipeline's own check and was then frozen (SIGSTOP, a stalled thread) past
//! the renew deadline is refused on waking instead of being sent by a deposed leader.
//! Reads (GET: LIST, WATCH) always pass: a standby's caches may stay warm.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Method, Request};
use kube::Client;
use kube::client::Body;
use tower::{Layer, Service};

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
/// `fence` just before it is sent.
pub fn fenced_client(client: &Client, fence: WriteFence) -> Client {
    let inner = client.clone();
    let send = tower::service_fn(move |request: Request<Body>| {
        let inner = inner.clone();
        async move { inner.send(request).await }
    });
    let service = FenceLayer::new(fence).layer(send);
    Client::new(service, client.default_namespace().to_string())
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
