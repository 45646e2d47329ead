//! Every Kubernetes API call a reconcile makes (its reads of children come from the
//! shared caches of [`super::children`]): server-side apply under the ownership rules, pruning with a UID precondition, status, finalizers
//! and events. Every request has a timeout, and errors keep kube's error (and with it
//! the HTTP status) so the pipeline can tell permanent from transient failures.

use std::future::Future;
use std::time::Duration;

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions,
    PropagationPolicy,
};
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

use super::leader::WriteFence;
use crate::contract::{Event, EventType, KindRef, ObservedChild};
use crate::ownership::{self, Ownership};
use crate::plan::{self, PlannedChild};

/// How long one API request may take before it counts as failed (transient).
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

/// The resourceVersion that makes a server-side apply create-only.
///
/// An apply that carries a resourceVersion is an update with that precondition when the
/// object exists (the API server answers 409 unless it matches), and a plain create
/// when it does not (the version is then not compared, and the stored object gets its
/// own). No object ever has this version (u64::MAX; etcd revisions are signed 64-bit),
/// so such an apply creates the object or is refused, never writes an existing one.
/// A create (POST) would not do: its fields are owned by an `Update` entry of the
/// manager, which the manager's later applies can never remove (docs/operator.md,
/// "Ownership").
pub const CREATE_ONLY: &str = "18446744073709551615";

/// Why a request to the API server did not do what the host asked.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server answered with an error status, or the request failed on its way.
    #[error("cannot {action}: {}", short(.source))]
    Api {
        /// What the host tried to do.
        action: String,
        /// kube's error, with the status code when the server answered.
        #[source]
        source: kube::Error,
    },
    /// This replica is not, or can no longer prove to be, the leader: nothing is written.
    #[error("cannot {action}: this replica is not the leader")]
    NotLeader {
        /// What the host tried to do.
        action: String,
    },
    /// The request got no answer within [`API_TIMEOUT`].
    #[error("cannot {action}: no answer from the API server within {timeout:?}")]
    Timeout {
        /// What the host tried to do.
        action: String,
        /// The timeout.
        timeout: Duration,
    },
}

/// How the pipeline reacts to an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retrying the same request gives the same answer (400, 403, 404, 405, 422, …):
    /// report it on the parent and retry only at the resync period.
    Permanent,
    /// Someone else changed the object first (409): retry soon, report nothing.
    Conflict,
    /// The server is busy, failing or unreachable (429, 5xx, timeouts, transport):
    /// back off and retry; it says nothing about the parent, so `Ready` stays.
    Transient,
}

impl Error {
    /// The HTTP status the API server answered with, if it answered.
    pub fn code(&self) -> Option<u16> {
        match self {
            Error::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }

    /// How to react; decided from the status code, never from a message.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Timeout { .. } | Error::NotLeader { .. } => ErrorClass::Transient,
            Error::Api { .. } => classify(self.code()),
        }
    }
}

/// The class of an API answer with status `code` (`None`: no answer).
pub fn classify(code: Option<u16>) -> ErrorClass {
    match code {
        Some(409) => ErrorClass::Conflict,
        Some(408 | 429) => ErrorClass::Transient,
        Some(400..=499) => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// Result of cluster calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs one API request under [`API_TIMEOUT`], naming `action` in its error.
async fn request<T>(
    action: impl FnOnce() -> String,
    fut: impl Future<Output = kube::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(API_TIMEOUT, fut).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(Error::Api {
            action: action(),
            source,
        }),
        Err(_) => Err(Error::Timeout {
            action: action(),
            timeout: API_TIMEOUT,
        }),
    }
}

fn is_status(e: &Error, code: u16) -> bool {
    e.code() == Some(code)
}

/// The `ApiResource` of a declared kind.
pub fn api_resource(kind: &KindRef) -> ApiResource {
    ApiResource {
        group: kind.group.clone(),
        version: kind.version.clone(),
        api_version: kind.api_version(),
        kind: kind.kind.clone(),
        plural: kind.plural.clone(),
    }
}

/// A plugin's declared child kinds, resolved for the API.
#[derive(Clone)]
pub struct ChildKinds {
    kinds: Vec<(KindRef, ApiResource)>,
}

impl ChildKinds {
    /// Resolves the declared kinds.
    pub fn new(kinds: &[KindRef]) -> Self {
        ChildKinds {
            kinds: kinds.iter().map(|k| (k.clone(), api_resource(k))).collect(),
        }
    }

    /// The declared kind at `index`.
    pub fn kind(&self, index: usize) -> &KindRef {
        &self.kinds[index].0
    }
}

/// What happened to one desired child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildOutcome {
    /// Written (created, or updated because this parent controls it).
    Applied {
        /// The object's resourceVersion after the write.
        resource_version: Option<String>,
    },
    /// An existing object that consented to it was adopted, then written.
    Adopted,
    /// An existing object of that name is not this parent's: nothing was written.
    Conflict(OwnershipConflict),
}

/// A desired child whose name is taken by an object this parent does not control.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{kind} {name:?} already exists and is {}; nothing was written to it (to hand it over, remove its controller and annotate it {annotation}={adoption})",
    match .controller { Some(c) => format!("controlled by {c}"), None => "not controlled by this parent".to_string() },
    annotation = ownership::ADOPT_ANNOTATION
)]
pub struct OwnershipConflict {
    /// The child's kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its controller, if it has one.
    pub controller: Option<String>,
    /// The annotation value that would let this parent adopt it.
    pub adoption: String,
}

/// Cluster access for one plugin's reconciles.
#[derive(Clone)]
pub struct ClusterWrites {
    client: Client,
    parent_kind: KindRef,
    parent: ApiResource,
    recorder: Recorder,
    /// This plugin's field manager for children and status.
    manager: String,
    /// Its field manager for failure reports (conditions only).
    report_manager: String,
    /// Asked before every write.
    fence: WriteFence,
}

/// A kube error without the noise of its debug form.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => {
            format!("{} ({}, {})", status.message, status.reason, status.code)
        }
        other => other.to_string(),
    }
}

impl ClusterWrites {
    /// Cluster access for parents of kind `parent`, reconciled by `plugin`.
    pub fn new(client: Client, parent: &KindRef, plugin: &str, fence: WriteFence) -> Self {
        let reporter = Reporter {
            controller: format!("capstan/{plugin}"),
            instance: std::env::var("POD_NAME").ok(),
        };
        ClusterWrites {
            recorder: Recorder::new(client.clone(), reporter),
            parent: api_resource(parent),
            parent_kind: parent.clone(),
            client,
            manager: plan::field_manager(plugin),
            report_manager: plan::report_field_manager(plugin),
            fence,
        }
    }

    /// Runs one write request, only while the [`WriteFence`] is open.
    async fn write<T>(
        &self,
        action: impl FnOnce() -> String,
        fut: impl Future<Output = kube::Result<T>>,
    ) -> Result<T> {
        if !self.fence.is_open() {
            return Err(Error::NotLeader { action: action() });
        }
        request(action, fut).await
    }

    fn parent_api(&self, obj: &DynamicObject) -> Api<DynamicObject> {
        match obj.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &self.parent),
            None => Api::all_with(self.client.clone(), &self.parent),
        }
    }

    fn child_api(
        &self,
        ar: &ApiResource,
        namespaced: bool,
        namespace: Option<&str>,
    ) -> Api<DynamicObject> {
        match (namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), ns, ar),
            _ => Api::all_with(self.client.clone(), ar),
        }
    }

    /// Writes one desired child under the ownership rules ([`crate::ownership`]).
    ///
    /// `observed` says whether the child is among the parent's observed children (which
    /// only ever holds objects this parent controls): then it is applied directly.
    /// Otherwise it is most likely new, and is created by a create-only apply (one
    /// request; see [`CREATE_ONLY`]). Only if its name is taken (409) is the object read:
    /// controlled by this parent (a cache that lags), it is applied; consenting to
    /// adoption, adopted; anything else is an [`OwnershipConflict`] and nothing is
    /// written.
    pub async fn apply_child(
        &self,
        kinds: &ChildKinds,
        parent: &DynamicObject,
        child: &PlannedChild,
        observed: bool,
    ) -> Result<ChildOutcome> {
        let (kind, ar) = &kinds.kinds[child.kind_index];
        let ns = child
            .manifest
            .pointer("/metadata/namespace")
            .and_then(Value::as_str);
        let api = self.child_api(ar, kind.namespaced, ns);
        let action = || format!("apply {} {:?}", kind.kind, child.name);
        if observed {
            return self.apply_owned(&api, child, action).await;
        }
        let create = || format!("create {} {:?}", kind.kind, child.name);
        let taken = match self.create_child(&api, child, create).await {
            Err(e) if is_status(&e, 409) => e,
            created => return created,
        };
        let existing = request(
            || format!("read {} {:?}", kind.kind, child.name),
            api.get_opt(&child.name),
        )
        .await?;
        // Taken a moment ago, gone now: a conflict, retried soon.
        let Some(existing) = existing else {
            return Err(taken);
        };
        let parent_uid = parent.metadata.uid.as_deref().unwrap_or_default();
        let adoption = ownership::adoption_ref(&self.parent_kind, &parent.name_any());
        match ownership::ownership(&existing.metadata, parent_uid, &adoption) {
            Ownership::Controlled => self.apply_owned(&api, child, action).await,
            Ownership::Adoptable => {
                self.apply_owned(&api, child, action).await?;
                Ok(ChildOutcome::Adopted)
            }
            Ownership::Foreign { controller } => Ok(ChildOutcome::Conflict(OwnershipConflict {
                kind: kind.kind.clone(),
                name: child.name.clone(),
                controller,
                adoption,
            })),
        }
    }

    /// Creates a child with a create-only apply: the same request as
    /// [`Self::apply_owned`]'s (so the object is owned exactly as an apply owns it), with
    /// the [`CREATE_ONLY`] resourceVersion. An object of that name, whoever it is, is
    /// answered with 409 and left untouched.
    async fn create_child(
        &self,
        api: &Api<DynamicObject>,
        child: &PlannedChild,
        action: impl FnOnce() -> String,
    ) -> Result<ChildOutcome> {
        let mut manifest = child.manifest.clone();
        manifest["metadata"]["resourceVersion"] = json!(CREATE_ONLY);
        let written = self
            .write(
                action,
                api.patch(
                    &child.name,
                    &PatchParams::apply(&self.manager),
                    &Patch::Apply(&manifest),
                ),
            )
            .await?;
        Ok(ChildOutcome::Applied {
            resource_version: written.metadata.resource_version,
        })
    }

    /// Server-side applies, with force, a child this parent controls (or is adopting),
    /// with the plugin's field manager.
    async fn apply_owned(
        &self,
        api: &Api<DynamicObject>,
        child: &PlannedChild,
        action: impl FnOnce() -> String,
    ) -> Result<ChildOutcome> {
        let params = PatchParams::apply(&self.manager).force();
        let written = self
            .write(
                action,
                api.patch(&child.name, &params, &Patch::Apply(&child.manifest)),
            )
            .await?;
        Ok(ChildOutcome::Applied {
            resource_version: written.metadata.resource_version,
        })
    }

    /// Deletes an observed child that is no longer desired, only if it is still the
    /// same object (UID precondition). Already gone is fine.
    pub async fn prune_child(&self, kinds: &ChildKinds, child: &ObservedChild) -> Result<()> {
        let (kind, ar) = &kinds.kinds[child.kind_index as usize];
        let field = |p: &str| child.object.pointer(p).and_then(Value::as_str);
        let name = field("/metadata/name").unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: field("/metadata/uid").map(String::from),
                resource_version: None,
            }),
            propagation_policy: Some(PropagationPolicy::Background),
            ..DeleteParams::default()
        };
        let api = self.child_api(ar, kind.namespaced, field("/metadata/namespace"));
        match self
            .write(
                || format!("prune {} {name:?}", kind.kind),
                api.delete(name, &params),
            )
            .await
        {
            Ok(_) => Ok(()),
            // Gone already, or another object by now (the UID precondition failed).
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Writes the parent's status through `/status` with server-side apply and the
    /// plugin's field manager.
    ///
    /// The patch carries the resourceVersion of the parent the status was computed
    /// from: if the parent changed since (a newer status, a new spec), the API server
    /// answers 409 and nothing is written, so a status computed from a stale cache can
    /// never overwrite a newer one.
    ///
    /// Returns the parent as written.
    pub async fn write_status(
        &self,
        parent: &DynamicObject,
        status: &Value,
    ) -> Result<DynamicObject> {
        self.apply_status(parent, status, &self.manager).await
    }

    /// Writes only `status.conditions` (a failure report), with the plugin's report
    /// field manager and the same resourceVersion precondition as [`Self::write_status`]:
    /// the plugin's status fields are neither written nor removed.
    pub async fn write_conditions(
        &self,
        parent: &DynamicObject,
        conditions: &Value,
    ) -> Result<DynamicObject> {
        self.apply_status(
            parent,
            &json!({ "conditions": conditions }),
            &self.report_manager,
        )
        .await
    }

    async fn apply_status(
        &self,
        parent: &DynamicObject,
        status: &Value,
        manager: &str,
    ) -> Result<DynamicObject> {
        let patch = json!({
            "apiVersion": self.parent.api_version,
            "kind": self.parent.kind,
            "metadata": {
                "name": parent.name_any(),
                "resourceVersion": parent.metadata.resource_version,
            },
            "status": status,
        });
        self.write(
            || "write status".into(),
            self.parent_api(parent).patch_status(
                &parent.name_any(),
                &PatchParams::apply(manager).force(),
                &Patch::Apply(&patch),
            ),
        )
        .await
    }

    /// Adds `finalizer` to the parent. The merge patch carries the resourceVersion read,
    /// so a concurrent change makes it fail (and retry) instead of being overwritten.
    /// Returns the parent as written, none if it is gone.
    pub async fn add_finalizer(
        &self,
        parent: &DynamicObject,
        finalizer: &str,
    ) -> Result<Option<DynamicObject>> {
        let mut next = parent.metadata.finalizers.clone().unwrap_or_default();
        next.push(finalizer.to_string());
        self.replace_finalizers(parent, next).await
    }

    /// Removes `finalizer` from the parent, the same way.
    pub async fn remove_finalizer(
        &self,
        parent: &DynamicObject,
        finalizer: &str,
    ) -> Result<Option<DynamicObject>> {
        let next: Vec<String> = parent
            .finalizers()
            .iter()
            .filter(|f| *f != finalizer)
            .cloned()
            .collect();
        self.replace_finalizers(parent, next).await
    }

    async fn replace_finalizers(
        &self,
        parent: &DynamicObject,
        next: Vec<String>,
    ) -> Result<Option<DynamicObject>> {
        let patch = json!({"metadata": {"finalizers": next, "resourceVersion": parent.metadata.resource_version}});
        match self
            .write(
                || "update finalizers".into(),
                self.parent_api(parent).patch(
                    &parent.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                ),
            )
            .await
        {
            Ok(written) => Ok(Some(written)),
            Err(e) if is_status(&e, 404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Posts an event on the parent. Best effort: failures are logged.
    pub async fn publish(&self, parent: &DynamicObject, event: &Event) {
        let ev = KubeEvent {
            type_: match event.type_ {
                EventType::Normal => KubeEventType::Normal,
                EventType::Warning => KubeEventType::Warning,
            },
            reason: event.reason.clone(),
            note: Some(event.message.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        let reference = parent.object_ref(&self.parent);
        if let Err(e) = self
            .write(
                || format!("post event {}", event.reason),
                self.recorder.publish(&ev, &reference),
            )
            .await
        {
            tracing::warn!(reason = %event.reason, "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake_api::{self, Call};
    use super::*;
    use http::Method;

    fn configmaps() -> ChildKinds {
        ChildKinds::new(&[KindRef {
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
            namespaced: true,
        }])
    }

    fn widget_kind() -> KindRef {
        KindRef {
            group: "test.capstan.dev".into(),
            version: "v1".into(),
            kind: "Widget".into(),
            plural: "widgets".into(),
            namespaced: true,
        }
    }

    fn parent() -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "test.capstan.dev/v1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": "ns", "uid": "uid-w", "resourceVersion": "42"},
            "spec": {}, "status": {"uuid": "x"},
        }))
        .unwrap()
    }

    fn child(name: &str) -> PlannedChild {
        PlannedChild {
            kind_index: 0,
            name: name.into(),
            manifest: json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "ns",
                    "ownerReferences": [{"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
                        "name": "w", "uid": "uid-w", "controller": true}]},
                "data": {"message": "hello"},
            }),
        }
    }

    fn fake(
        handler: impl Fn(&Call) -> (u16, Value) + Send + Sync + 'static,
    ) -> (ClusterWrites, fake_api::Calls) {
        let (client, calls) = fake_api::client(handler);
        (
            ClusterWrites::new(client, &widget_kind(), "widget", WriteFence::default()),
            calls,
        )
    }

    fn existing(owner_uid: Option<&str>, annotations: Value) -> Value {
        let owners = owner_uid.map(|uid| {
            json!([{"apiVersion": "test.capstan.dev/v1", "kind": "Widget", "name": "other",
                    "uid": uid, "controller": true}])
        });
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "c", "namespace": "ns", "uid": "uid-c", "resourceVersion": "5",
                            "ownerReferences": owners, "annotations": annotations},
               "data": {"k": "mine"}})
    }

    fn is_create_only(call: &Call) -> bool {
        call.body["metadata"]["resourceVersion"] == CREATE_ONLY
    }

    /// A handler that behaves like the API server towards `c`, which exists as `existing`
    /// (or not): a create-only apply creates it when absent and is refused with 409 when
    /// present; any other apply writes it.
    fn server(existing: Option<Value>) -> impl Fn(&Call) -> (u16, Value) + Send + Sync + 'static {
        move |call: &Call| match (&call.method, &existing) {
            (&Method::GET, Some(obj)) => (200, obj.clone()),
            (&Method::GET, None) => fake_api::status(404, "NotFound", "not found"),
            (&Method::PATCH, Some(_)) if is_create_only(call) => fake_api::status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            ),
            (&Method::PATCH, None) if is_create_only(call) => {
                (201, fake_api::applied(&call.body, json!([])).1)
            }
            (&Method::PATCH, _) => fake_api::applied(&call.body, json!([])),
            _ => fake_api::status(405, "MethodNotAllowed", "unexpected"),
        }
    }

    const CM: &str = "/api/v1/namespaces/ns/configmaps/c";

    #[tokio::test]
    async fn an_object_the_parent_does_not_control_is_read_and_never_written() {
        for obj in [
            existing(None, json!({})),
            existing(Some("uid-other"), json!({})),
            existing(
                Some("uid-other"),
                json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/w"}),
            ),
            existing(
                None,
                json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/another"}),
            ),
        ] {
            let (writes, calls) = fake(server(Some(obj)));
            let outcome = writes
                .apply_child(&configmaps(), &parent(), &child("c"), false)
                .await
                .unwrap();
            assert!(matches!(outcome, ChildOutcome::Conflict(_)), "{outcome:?}");
            assert_eq!(
                calls.summary(),
                [format!("PATCH {CM}"), format!("GET {CM}")]
            );
            assert!(
                is_create_only(&calls.all()[0]),
                "the only write is create-only, refused for an existing object"
            );
        }
    }

    #[tokio::test]
    async fn an_absent_child_is_created_in_one_request_as_an_apply_would() {
        let (writes, calls) = fake(server(None));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert_eq!(
            outcome,
            ChildOutcome::Applied {
                resource_version: Some("7".into())
            }
        );
        assert_eq!(calls.summary(), [format!("PATCH {CM}")]);
        let create = &calls.all()[0];
        assert!(
            create.has_query("fieldManager=capstan%2Fwidget"),
            "{}",
            create.query
        );
        assert!(!create.has_query("force=true"), "{}", create.query);
        let mut expected = child("c").manifest;
        expected["metadata"]["resourceVersion"] = json!(CREATE_ONLY);
        assert_eq!(
            create.body, expected,
            "the same fields as an apply, and the create-only precondition"
        );
    }

    #[tokio::test]
    async fn a_taken_name_is_adopted_if_it_consents_and_applied_if_controlled() {
        let consenting = existing(
            None,
            json!({"capstan.dev/allow-adoption-by": "widgets.test.capstan.dev/w"}),
        );
        let (writes, calls) = fake(server(Some(consenting)));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert_eq!(outcome, ChildOutcome::Adopted);
        let all = calls.all();
        assert_eq!(
            calls.summary(),
            [
                format!("PATCH {CM}"),
                format!("GET {CM}"),
                format!("PATCH {CM}")
            ]
        );
        assert!(all[2].has_query("force=true") && !is_create_only(&all[2]));
        assert_eq!(all[2].body, child("c").manifest);

        let (writes, calls) = fake(server(Some(existing(Some("uid-w"), json!({})))));
        let outcome = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap();
        assert!(matches!(outcome, ChildOutcome::Applied { .. }));
        let all = calls.all();
        assert_eq!(all.len(), 3, "{:?}", calls.summary());
        assert!(all[2].has_query("force=true") && !is_create_only(&all[2]));
    }

    #[tokio::test]
    async fn a_name_taken_then_freed_is_a_conflict_retried_soon() {
        let (writes, calls) = fake(|call: &Call| match call.method {
            Method::PATCH => fake_api::status(409, "Conflict", "the object has been modified"),
            _ => fake_api::status(404, "NotFound", "not found"),
        });
        let err = writes
            .apply_child(&configmaps(), &parent(), &child("c"), false)
            .await
            .unwrap_err();
        assert_eq!(err.class(), ErrorClass::Conflict, "{err}");
        assert_eq!(
            calls.summary(),
            [format!("PATCH {CM}"), format!("GET {CM}")]
        );
    }

    #[tokio::test]
    async fn an_observed_child_is_applied_without_a_read() {
        let (writes, calls) = fake(server(Some(existing(Some("uid-w"), json!({})))));
        writes
            .apply_child(&configmaps(), &parent(), &child("c"), true)
            .await
            .unwrap();
        assert_eq!(calls.summary(), [format!("PATCH {CM}")]);
        let apply = &calls.all()[0];
        assert!(apply.has_query("force=true") && !is_create_only(apply));
    }

    #[tokio::test]
    async fn status_writes_carry_the_resource_version_and_reports_touch_only_conditions() {
        let (writes, calls) = fake(|call: &Call| fake_api::applied(&call.body, json!([])));
        writes
            .write_status(&parent(), &json!({"uuid": "x", "conditions": []}))
            .await
            .unwrap();
        writes
            .write_conditions(&parent(), &json!([{"type": "Ready", "status": "False"}]))
            .await
            .unwrap();
        let all = calls.all();
        assert_eq!(
            all[0].path,
            "/apis/test.capstan.dev/v1/namespaces/ns/widgets/w/status"
        );
        assert_eq!(all[0].body["metadata"]["resourceVersion"], "42");
        assert!(all[0].has_query("fieldManager=capstan%2Fwidget"));
        assert_eq!(all[1].body["metadata"]["resourceVersion"], "42");
        assert!(
            all[1].has_query("fieldManager=capstan%2Fwidget%2Freport"),
            "{}",
            all[1].query
        );
        let keys: Vec<&String> = all[1].body["status"].as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["conditions"],
            "a report never carries the plugin's fields"
        );
    }

    #[tokio::test]
    async fn a_stale_status_write_is_a_conflict_and_a_refusal_is_permanent() {
        let (writes, _) =
            fake(|_: &Call| fake_api::status(409, "Conflict", "the object has been modified"));
        let err = writes
            .write_status(&parent(), &json!({}))
            .await
            .unwrap_err();
        assert_eq!((err.code(), err.class()), (Some(409), ErrorClass::Conflict));
        let (writes, _) =
            fake(|_: &Call| fake_api::status(422, "Invalid", "spec.x: Invalid value"));
        let err = writes
            .apply_child(&configmaps(), &parent(), &child("c"), true)
            .await
            .unwrap_err();
        assert_eq!(
            (err.code(), err.class()),
            (Some(422), ErrorClass::Permanent)
        );
        assert!(err.to_string().contains("spec.x: Invalid value"), "{err}");
    }

    #[tokio::test]
    async fn prune_deletes_with_the_uid_precondition_and_tolerates_gone_or_replaced() {
        for answer in [200, 404, 409] {
            let (writes, calls) = fake(move |_: &Call| match answer {
                200 => (200, json!({"kind": "Status", "status": "Success"})),
                code => fake_api::status(code, "x", "y"),
            });
            let observed = ObservedChild {
                kind_index: 0,
                object: json!({"metadata": {"name": "c", "namespace": "ns", "uid": "uid-c"}}),
            };
            writes.prune_child(&configmaps(), &observed).await.unwrap();
            let all = calls.all();
            assert_eq!(all[0].method, Method::DELETE);
            assert_eq!(all[0].body["preconditions"]["uid"], "uid-c");
        }
    }

    #[tokio::test]
    async fn a_shut_fence_lets_nothing_through() {
        let (client, calls) =
            fake_api::client(|call: &Call| fake_api::applied(&call.body, json!([])));
        let fence = WriteFence::for_leader_election();
        let writes = ClusterWrites::new(client, &widget_kind(), "widget", fence);
        let err = writes
            .apply_child(&configmaps(), &parent(), &child("c"), true)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotLeader { .. }), "{err}");
        assert!(writes.write_status(&parent(), &json!({})).await.is_err());
        assert!(writes.remove_finalizer(&parent(), "f").await.is_err());
        writes.publish(&parent(), &plan::warning("X", "y")).await;
        assert!(calls.all().is_empty(), "{:?}", calls.summary());
    }

    #[test]
    fn errors_are_classified_by_status_code() {
        assert_eq!(classify(Some(409)), ErrorClass::Conflict);
        for code in [400, 403, 404, 405, 410, 422] {
            assert_eq!(classify(Some(code)), ErrorClass::Permanent, "{code}");
        }
        for code in [408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(Some(code)), ErrorClass::Transient, "{code}");
        }
        assert_eq!(classify(None), ErrorClass::Transient);
        let timeout = Error::Timeout {
            action: "apply".into(),
            timeout: API_TIMEOUT,
        };
        assert_eq!(timeout.class(), ErrorClass::Transient);
        assert_eq!(timeout.code(), None);
    }

    #[test]
    fn a_conflict_names_the_object_and_the_way_to_hand_it_over() {
        let c = OwnershipConflict {
            kind: "ConfigMap".into(),
            name: "precious".into(),
            controller: None,
            adoption: "widgets.test.capstan.dev/w".into(),
        };
        let text = c.to_string();
        assert!(
            text.contains("ConfigMap \"precious\" already exists"),
            "{text}"
        );
        assert!(
            text.contains("capstan.dev/allow-adoption-by=widgets.test.capstan.dev/w"),
            "{text}"
        );
        let owned = OwnershipConflict {
            controller: Some("Widget/other".into()),
            ..c
        };
        assert!(owned.to_string().contains("controlled by Widget/other"));
    }
}
