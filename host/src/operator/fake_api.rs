//! A fake API server for the middle test tier: the pipeline's rules run against a
//! `kube::Client` whose every request is answered by a test's handler and recorded, so
//! a test can assert which requests were (and were not) made, in which order, with
//! which bodies — in milliseconds, without a cluster.
//!
//! Two kinds of handler: [`client`] answers with a closure; [`Store::client`] with an
//! in-memory object store that keeps what was written (create, get, list, server-side
//! apply, merge patch, delete with preconditions, `/status`), so that a test reads as a
//! scenario of several reconciles. A watch is answered by a stream that stays open and
//! sends nothing: the caches of a test are fed by the test.

use std::collections::BTreeMap;
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
    /// The request's headers.
    pub headers: http::HeaderMap,
}

impl Call {
    /// Whether the query string has `key=value` (value URL-encoded as sent).
    pub fn has_query(&self, pair: &str) -> bool {
        self.query.split('&').any(|p| p == pair)
    }

    /// The `Ready` condition a status write (a server-side apply of
    /// `status.conditions`) carries, if it carries one.
    pub fn ready_condition(&self) -> Option<Value> {
        self.body["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready")
            .cloned()
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
    client_with(move |call| {
        let (code, body) = handler(call);
        Answer::Now(code, body)
    })
}

/// How the fake server answers one request.
enum Answer {
    /// At once, with (status code, JSON body).
    Now(u16, Value),
    /// Never (a watch with nothing to tell).
    Pending,
}

fn client_with(handler: impl Fn(&Call) -> Answer + Send + Sync + 'static) -> (kube::Client, Calls) {
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
                headers: parts.headers,
            };
            let answer = handler(&call);
            recorded.0.lock().unwrap().push(call);
            let (code, answer) = match answer {
                Answer::Now(code, body) => (code, body),
                Answer::Pending => std::future::pending().await,
            };
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

/// The path of an object, or of a collection (`name` empty): `/api/v1/namespaces/ns/configmaps/c`,
/// `/apis/g/v/namespaces/ns/widgets`, `/apis/g/v/widgets` (cluster-scoped).
pub fn path(api_version: &str, plural: &str, namespace: Option<&str>, name: &str) -> String {
    let mut path = if api_version.contains('/') {
        format!("/apis/{api_version}")
    } else {
        format!("/api/{api_version}")
    };
    if let Some(ns) = namespace {
        path.push_str(&format!("/namespaces/{ns}"));
    }
    path.push_str(&format!("/{plural}"));
    if !name.is_empty() {
        path.push_str(&format!("/{name}"));
    }
    path
}

/// A fault a test injects: given a request, an answer instead of the store's.
type Fault = Box<dyn Fn(&Call) -> Option<(u16, Value)> + Send + Sync>;

/// An in-memory API server, shared by its clones: objects by path, each with a UID and
/// a resourceVersion from one counter, as etcd gives them.
///
/// It answers what the host sends: GET of an object or a collection, POST (create, 409
/// if the name is taken), PATCH (server-side apply, which creates; or JSON merge patch),
/// both with the `metadata.resourceVersion` precondition, on the object or on `/status`,
/// DELETE with the `uid`/`resourceVersion` preconditions (an object with finalizers is
/// only marked deleted; it goes when the last finalizer is removed). An apply merges
/// the patch into the object (objects merged, anything else replaced) and changes the
/// resourceVersion only if that changes the object. Events (any path with `/events`)
/// are kept apart, in order. Requests to watch stay open and send nothing.
#[derive(Clone, Default)]
pub struct Store {
    state: Arc<Mutex<StoreState>>,
    faults: Arc<Mutex<Vec<Fault>>>,
}

#[derive(Default)]
struct StoreState {
    objects: BTreeMap<String, Value>,
    events: Vec<Value>,
    revision: u64,
}

/// How a request names what it is about.
struct Target {
    /// The object's path (without `/status`), or the collection's.
    path: String,
    /// The collection's path.
    collection: String,
    /// The object's name, if the path has one.
    name: Option<String>,
    status: bool,
}

impl Target {
    fn of(path: &str, body: &Value, method: &Method) -> Target {
        let (path, status) = match path.strip_suffix("/status") {
            Some(p) => (p.to_string(), true),
            None => (path.to_string(), false),
        };
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        // api/v1/<plural>[/name], apis/g/v/<plural>[/name], with namespaces/<ns> after
        // the version.
        let version_len = if segments.first() == Some(&"api") {
            2
        } else {
            3
        };
        let mut rest = &segments[version_len.min(segments.len())..];
        if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
            rest = &rest[2..];
        }
        let named = rest.len() >= 2;
        let (collection, name) = if named {
            (
                path.rsplit_once('/').unwrap().0.to_string(),
                Some(rest[1].to_string()),
            )
        } else if *method == Method::POST {
            let name = body
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(String::from);
            (path.clone(), name)
        } else {
            (path.clone(), None)
        };
        let path = match (&name, named) {
            (Some(n), false) => format!("{collection}/{n}"),
            _ => path,
        };
        Target {
            path,
            collection,
            name,
            status,
        }
    }

    /// The namespace in the path, if any.
    fn namespace(&self) -> Option<String> {
        let mut segments = self.collection.split('/');
        segments.find(|s| *s == "namespaces")?;
        segments.next().map(String::from)
    }
}

impl Store {
    /// An empty store.
    pub fn new() -> Self {
        Store::default()
    }

    /// A client answered by this store; every request is recorded.
    pub fn client(&self) -> (kube::Client, Calls) {
        let store = self.clone();
        client_with(move |call| store.answer(call))
    }

    /// From now on, `fault` is asked first about every request: what it answers is
    /// sent instead of the store's answer, and nothing is stored.
    pub fn inject(&self, fault: impl Fn(&Call) -> Option<(u16, Value)> + Send + Sync + 'static) {
        self.faults.lock().unwrap().push(Box::new(fault));
    }

    /// Removes every injected fault.
    pub fn heal(&self) {
        self.faults.lock().unwrap().clear();
    }

    /// Creates `obj` at `collection` (the path of its kind, in its namespace), as if a
    /// user did: with a UID, a resourceVersion and generation 1. Returns it as stored.
    pub fn create(&self, collection: &str, obj: Value) -> Value {
        let mut state = self.state.lock().unwrap();
        let name = obj["metadata"]["name"]
            .as_str()
            .expect("a name")
            .to_string();
        let path = format!("{collection}/{name}");
        let namespace = Target::of(&path, &Value::Null, &Method::GET).namespace();
        state.insert_new(&path, obj, namespace)
    }

    /// The object at `path`, if any.
    pub fn get(&self, path: &str) -> Option<Value> {
        self.state.lock().unwrap().objects.get(path).cloned()
    }

    /// Changes the object at `path` as a user would (the resourceVersion moves on, and
    /// the generation too when `spec` changed). Returns it as stored.
    pub fn update(&self, path: &str, change: impl FnOnce(&mut Value)) -> Value {
        let mut state = self.state.lock().unwrap();
        let mut obj = state
            .objects
            .get(path)
            .cloned()
            .expect("an object to update");
        let spec = obj.get("spec").cloned();
        change(&mut obj);
        if obj.get("spec").cloned() != spec {
            let generation = obj["metadata"]["generation"].as_i64().unwrap_or(0);
            obj["metadata"]["generation"] = json!(generation + 1);
        }
        state.store(path, obj)
    }

    /// Deletes the object at `path` as a user would: marked deleted while it has
    /// finalizers, gone at once otherwise. Returns it as last stored.
    pub fn delete(&self, path: &str) -> Option<Value> {
        self.state.lock().unwrap().delete(path)
    }

    /// The paths of the objects under `collection` (the path of a kind in a namespace).
    pub fn names(&self, collection: &str) -> Vec<String> {
        let state = self.state.lock().unwrap();
        state
            .objects
            .keys()
            .filter_map(|p| p.strip_prefix(collection)?.strip_prefix('/'))
            .filter(|rest| !rest.contains('/'))
            .map(String::from)
            .collect()
    }

    /// How many objects the store holds.
    pub fn object_count(&self) -> usize {
        self.state.lock().unwrap().objects.len()
    }

    /// The last resourceVersion given out.
    pub fn revision(&self) -> u64 {
        self.state.lock().unwrap().revision
    }

    /// What Kubernetes' garbage collector does: deletes every object whose owners are
    /// all gone. Returns how many went.
    pub fn collect_garbage(&self) -> usize {
        let mut state = self.state.lock().unwrap();
        let uids: std::collections::HashSet<Value> = state
            .objects
            .values()
            .map(|o| o["metadata"]["uid"].clone())
            .collect();
        let orphans: Vec<String> = state
            .objects
            .iter()
            .filter(|(_, o)| {
                o.pointer("/metadata/ownerReferences")
                    .and_then(Value::as_array)
                    .is_some_and(|owners| {
                        !owners.is_empty() && owners.iter().all(|r| !uids.contains(&r["uid"]))
                    })
            })
            .map(|(p, _)| p.clone())
            .collect();
        for path in &orphans {
            state.delete(path);
        }
        orphans.len()
    }

    /// Every event posted, in order.
    pub fn events(&self) -> Vec<Value> {
        self.state.lock().unwrap().events.clone()
    }

    /// `reason` of every event posted, in order.
    pub fn event_reasons(&self) -> Vec<String> {
        let state = self.state.lock().unwrap();
        state
            .events
            .iter()
            .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn answer(&self, call: &Call) -> Answer {
        if call.has_query("watch=true") || call.has_query("watch=1") {
            return Answer::Pending;
        }
        for fault in self.faults.lock().unwrap().iter() {
            if let Some(answer) = fault(call) {
                return Answer::Now(answer.0, answer.1);
            }
        }
        let (code, body) = self.state.lock().unwrap().answer(call);
        Answer::Now(code, body)
    }
}

impl StoreState {
    fn next_revision(&mut self) -> String {
        self.revision += 1;
        self.revision.to_string()
    }

    fn insert_new(&mut self, path: &str, mut obj: Value, namespace: Option<String>) -> Value {
        let rv = self.next_revision();
        let meta = &mut obj["metadata"];
        meta["uid"] = json!(format!("uid-{rv}"));
        meta["resourceVersion"] = json!(rv);
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        if meta.get("generation").is_none() {
            meta["generation"] = json!(1);
        }
        if let Some(ns) = namespace {
            meta["namespace"] = json!(ns);
        }
        self.objects.insert(path.to_string(), obj.clone());
        obj
    }

    /// Stores `obj` at `path` with the next resourceVersion; an object marked deleted
    /// that has no finalizer left goes.
    fn store(&mut self, path: &str, mut obj: Value) -> Value {
        obj["metadata"]["resourceVersion"] = json!(self.next_revision());
        let finalizers = obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        if obj.pointer("/metadata/deletionTimestamp").is_some() && !finalizers {
            self.objects.remove(path);
        } else {
            self.objects.insert(path.to_string(), obj.clone());
        }
        obj
    }

    fn delete(&mut self, path: &str) -> Option<Value> {
        let mut obj = self.objects.get(path).cloned()?;
        if obj.pointer("/metadata/deletionTimestamp").is_none() {
            obj["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
        }
        Some(self.store(path, obj))
    }

    fn answer(&mut self, call: &Call) -> (u16, Value) {
        if call.path.contains("/events") {
            if call.method == Method::POST || call.method == Method::PATCH {
                self.events.push(call.body.clone());
                return (201, call.body.clone());
            }
            return (200, json!({"kind": "List", "items": []}));
        }
        let target = Target::of(&call.path, &call.body, &call.method);
        let existing = self.objects.get(&target.path).cloned();
        match (&call.method, &target.name, existing) {
            (&Method::GET, None, _) => (200, self.list(&target.collection)),
            (&Method::GET, Some(_), Some(obj)) => (200, obj),
            (&Method::POST, Some(_), Some(_)) => status(409, "AlreadyExists", "already exists"),
            (&Method::POST, Some(_), None) => {
                let ns = target.namespace();
                (201, self.insert_new(&target.path, call.body.clone(), ns))
            }
            (&Method::PATCH, Some(_), existing) => self.patch(call, &target, existing),
            (&Method::DELETE, Some(_), Some(obj)) => {
                let precondition = |field: &str| {
                    call.body
                        .pointer(&format!("/preconditions/{field}"))
                        .filter(|v| !v.is_null())
                };
                let differs = |field: &str, have: &Value| {
                    precondition(field).is_some_and(|want| want != have)
                };
                if differs("uid", &obj["metadata"]["uid"])
                    || differs("resourceVersion", &obj["metadata"]["resourceVersion"])
                {
                    return status(409, "Conflict", "Precondition failed");
                }
                (200, self.delete(&target.path).unwrap_or(obj))
            }
            (_, Some(_), None) => status(404, "NotFound", "not found"),
            _ => status(405, "MethodNotAllowed", "not served by the fake API"),
        }
    }

    fn list(&self, collection: &str) -> Value {
        let items: Vec<Value> = self
            .objects
            .iter()
            .filter(|(p, _)| {
                p.strip_prefix(collection)
                    .and_then(|r| r.strip_prefix('/'))
                    .is_some_and(|r| !r.contains('/'))
            })
            .map(|(_, o)| o.clone())
            .collect();
        json!({"kind": "List", "apiVersion": "v1",
               "metadata": {"resourceVersion": self.revision.to_string()}, "items": items})
    }

    fn patch(&mut self, call: &Call, target: &Target, existing: Option<Value>) -> (u16, Value) {
        let apply = call.query.contains("fieldManager=")
            && call.body.get("apiVersion").is_some()
            && call.body.get("kind").is_some();
        let wanted_rv = call
            .body
            .pointer("/metadata/resourceVersion")
            .filter(|v| !v.is_null());
        let Some(old) = existing else {
            if !apply || target.status {
                return status(404, "NotFound", "not found");
            }
            // As the API server does: an apply that creates ignores the resourceVersion
            // it carries (the host's create-only apply carries one no object can have).
            let ns = target.namespace();
            let mut created = call.body.clone();
            record_manager(&mut created, call);
            return (201, self.insert_new(&target.path, created, ns));
        };
        if wanted_rv.is_some_and(|rv| *rv != old["metadata"]["resourceVersion"]) {
            return status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            );
        }
        let mut patch = call.body.clone();
        if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        let mut next = old.clone();
        if apply {
            record_manager(&mut next, call);
        }
        if target.status {
            // Only the status of a `/status` write counts.
            merge(
                &mut next["status"],
                patch.get("status").cloned().unwrap_or(Value::Null),
            );
        } else {
            if let Some(obj) = patch.as_object_mut() {
                obj.remove("status");
            }
            merge(&mut next, patch);
        }
        if next == old {
            return (200, old);
        }
        (200, self.store(&target.path, next))
    }
}

/// Records the field manager of the apply `call` in `obj`'s managedFields (an entry of
/// operation Apply), as the API server does.
fn record_manager(obj: &mut Value, call: &Call) {
    let Some(manager) = call
        .query
        .split('&')
        .find_map(|pair| pair.strip_prefix("fieldManager="))
    else {
        return;
    };
    let manager = manager.replace("%2F", "/").replace("%2f", "/");
    let entries = &mut obj["metadata"]["managedFields"];
    if !entries.is_array() {
        *entries = json!([]);
    }
    let entries = entries.as_array_mut().expect("an array");
    if !entries
        .iter()
        .any(|e| e["manager"] == manager.as_str() && e["operation"] == "Apply")
    {
        entries.push(json!({"manager": manager, "operation": "Apply", "apiVersion": "v1", "fieldsType": "FieldsV1"}));
    }
}

/// JSON merge patch (RFC 7386): objects merge, `null` removes, anything else replaces.
fn merge(target: &mut Value, patch: Value) {
    let Value::Object(patch) = patch else {
        *target = patch;
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let map = target.as_object_mut().expect("an object");
    for (key, value) in patch {
        if value.is_null() {
            map.remove(&key);
        } else {
            merge(map.entry(key).or_insert(Value::Null), value);
        }
    }
}

/// The object a server-side apply would return: the patch, with a UID and a
/// resourceVersion, and `managed_fields` as its managedFields.
pub fn applied(patch: &Value, managed_fields: Value) -> (u16, Value) {
    // The host's field manager, as every apply of the host's leaves.
    let managed_fields = match managed_fields {
        Value::Array(entries) if entries.is_empty() => {
            json!([{"manager": "capstan/widget", "operation": "Apply"}])
        }
        other => other,
    };
    let mut obj = patch.clone();
    obj["metadata"]["uid"] = json!("uid-child");
    obj["metadata"]["resourceVersion"] = json!("7");
    obj["metadata"]["managedFields"] = managed_fields;
    (200, obj)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::{
        Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions,
    };

    fn configmap(name: &str, data: &str) -> DynamicObject {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name}, "data": {"k": data}}))
        .unwrap()
    }

    #[tokio::test]
    async fn the_store_answers_as_an_api_server_would() {
        let store = Store::new();
        let (client, calls) = store.client();
        let api: Api<DynamicObject> = Api::namespaced_with(
            client,
            "ns",
            &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
        );
        // Create, then a name taken.
        let made = api
            .create(&PostParams::default(), &configmap("a", "1"))
            .await
            .unwrap();
        assert_eq!(made.metadata.namespace.as_deref(), Some("ns"));
        let taken = api
            .create(&PostParams::default(), &configmap("a", "2"))
            .await;
        assert!(matches!(taken, Err(kube::Error::Api(s)) if s.code == 409));
        // An apply that changes nothing keeps the version; one that changes moves it.
        // (The first apply of a manager records it, which is a change.)
        let apply = PatchParams::apply("test");
        let first = api
            .patch("a", &apply, &Patch::Apply(&configmap("a", "1")))
            .await
            .unwrap();
        assert_ne!(
            first.metadata.resource_version,
            made.metadata.resource_version
        );
        assert_eq!(
            first
                .metadata
                .managed_fields
                .as_ref()
                .and_then(|m| m[0].manager.as_deref()),
            Some("test")
        );
        let same = api
            .patch("a", &apply, &Patch::Apply(&configmap("a", "1")))
            .await
            .unwrap();
        assert_eq!(
            same.metadata.resource_version,
            first.metadata.resource_version
        );
        let changed = api
            .patch("a", &apply, &Patch::Apply(&configmap("a", "3")))
            .await
            .unwrap();
        assert_ne!(
            changed.metadata.resource_version,
            made.metadata.resource_version
        );
        assert_eq!(changed.data["data"]["k"], "3");
        // Apply creates; a stale resourceVersion is a conflict.
        api.patch("b", &apply, &Patch::Apply(&configmap("b", "1")))
            .await
            .unwrap();
        let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}});
        let refused = api
            .patch("b", &PatchParams::default(), &Patch::Merge(&stale))
            .await;
        assert!(matches!(refused, Err(kube::Error::Api(s)) if s.code == 409));
        // Deletes check the UID; finalizers hold a deletion until they are removed.
        let other_uid = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("uid-0".into()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let refused = api.delete("a", &other_uid).await;
        assert!(matches!(refused, Err(kube::Error::Api(s)) if s.code == 409));
        let held = json!({"metadata": {"finalizers": ["f"]}});
        api.patch("a", &PatchParams::default(), &Patch::Merge(&held))
            .await
            .unwrap();
        api.delete("a", &DeleteParams::default()).await.unwrap();
        let marked = api.get("a").await.unwrap();
        assert!(marked.metadata.deletion_timestamp.is_some());
        let released = json!({"metadata": {"finalizers": []}});
        api.patch("a", &PatchParams::default(), &Patch::Merge(&released))
            .await
            .unwrap();
        assert!(api.get_opt("a").await.unwrap().is_none());
        assert_eq!(api.list(&Default::default()).await.unwrap().items.len(), 1);
        // Faults answer instead of the store.
        store.inject(|c: &Call| (c.method == Method::GET).then(|| status(503, "Unavailable", "x")));
        let err = api.get("b").await.unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 503),
            "{err}"
        );
        store.heal();
        assert!(api.get("b").await.is_ok());
        assert!(calls.all().len() > 10);
    }
}
