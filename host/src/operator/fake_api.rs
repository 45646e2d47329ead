//! A fake API server for the middle test tier: the pipeline's rules run against a
//! `kube::Client` whose every request is answered by a test's handler and recorded, so
//! a test can assert which requests were (and were not) made, in which order, with
//! which bodies — in milliseconds, without a cluster.

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};

/// One request the host made.
#[derive(Debug, Clone)]
pub struct Call {
    /// HTTP method.
    pub method: Method,
    /// URL path, e.g. `/api/v1/namespaces/ns/configmaps/c`.
    pub path: String,
    /// Query string, e.g. `fieldManager=capstan%2Fwidget&force=true`.
    pub query: String,
    /// JSON body (`Null` when there was none).
    pub body: Value,
}

impl Call {
    /// Whether the query string has `key=value` (value URL-encoded as sent).
    pub fn has_query(&self, pair: &str) -> bool {
        self.query.split('&').any(|p| p == pair)
    }
}

/// The requests the fake server answered, in order.
#[derive(Clone, Default)]
pub struct Calls(Arc<Mutex<Vec<Call>>>);

impl Calls {
    /// Everything recorded so far.
    pub fn all(&self) -> Vec<Call> {
        self.0.lock().unwrap().clone()
    }

    /// `METHOD path` of every call, for compact assertions.
    pub fn summary(&self) -> Vec<String> {
        self.all()
            .iter()
            .map(|c| format!("{} {}", c.method, c.path))
            .collect()
    }
}

/// A client whose requests `handler` answers with (status code, JSON body).
pub fn client(
    handler: impl Fn(&Call) -> (u16, Value) + Send + Sync + 'static,
) -> (kube::Client, Calls) {
    let calls = Calls::default();
    let handler = Arc::new(handler);
    let recorded = calls.clone();
    let service = tower::service_fn(move |req: Request<Body>| {
        let (handler, recorded) = (handler.clone(), recorded.clone());
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            let body = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
            };
            let call = Call {
                method: parts.method,
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                body,
            };
            let (code, answer) = handler(&call);
            recorded.0.lock().unwrap().push(call);
            Ok::<_, kube::Error>(
                Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                    .unwrap(),
            )
        }
    });
    (kube::Client::new(service, "default"), calls)
}

/// A `metav1.Status` failure body with `code`.
pub fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "code": code, "reason": reason, "message": message}),
    )
}

/// The object a server-side apply would return: the patch, with a UID and a
/// resourceVersion, and `managed_fields` as its managedFields.
pub fn applied(patch: &Value, managed_fields: Value) -> (u16, Value) {
    let mut obj = patch.clone();
    obj["metadata"]["uid"] = json!("uid-child");
    obj["metadata"]["resourceVersion"] = json!("7");
    obj["metadata"]["managedFields"] = managed_fields;
    (200, obj)
}
