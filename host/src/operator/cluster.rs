//! Every Kubernetes API call a reconcile makes: listing owned children, server-side
//! apply, pruning with a UID precondition, status, finalizers and events.

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions,
    PropagationPolicy,
};
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

use super::reconcile::Failure;
use crate::contract::{Event, EventType, KindRef, ObservedChild};
use crate::plan::{FIELD_MANAGER, PlannedChild};

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

    /// Every declared kind with its `ApiResource`.
    pub fn iter(&self) -> impl Iterator<Item = &(KindRef, ApiResource)> {
        self.kinds.iter()
    }
}

/// Cluster access for one plugin's reconciles.
#[derive(Clone)]
pub struct ClusterWrites {
    client: Client,
    parent: ApiResource,
    recorder: Recorder,
}

fn api_error(what: String) -> impl FnOnce(kube::Error) -> Failure {
    move |e| Failure::Api(format!("{what}: {}", short(&e)))
}

/// A kube error without the noise of its debug form.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.reason),
        other => other.to_string(),
    }
}

impl ClusterWrites {
    /// Cluster access for parents of kind `parent`.
    pub fn new(client: Client, parent: &KindRef, plugin: &str) -> Self {
        let reporter = Reporter {
            controller: format!("capstan/{plugin}"),
            instance: std::env::var("POD_NAME").ok(),
        };
        ClusterWrites {
            recorder: Recorder::new(client.clone(), reporter),
            parent: api_resource(parent),
            client,
        }
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

    /// Objects of the declared child kinds in the parent's namespace whose controller
    /// ownerReference carries the parent's UID (managedFields dropped: noise to a plugin).
    pub async fn observed_children(
        &self,
        parent: &DynamicObject,
        kinds: &ChildKinds,
    ) -> Result<Vec<ObservedChild>, Failure> {
        let uid = parent.metadata.uid.as_deref().unwrap_or_default();
        let ns = parent.metadata.namespace.as_deref();
        let mut observed = Vec::new();
        for (index, (kind, ar)) in kinds.iter().enumerate() {
            let list = self
                .child_api(ar, kind.namespaced, ns)
                .list(&ListParams::default())
                .await
                .map_err(api_error(format!("cannot list {kind}")))?;
            for mut child in list.items {
                let controlled = child
                    .metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.controller == Some(true) && o.uid == uid);
                if !controlled {
                    continue;
                }
                child.metadata.managed_fields = None;
                let mut object =
                    serde_json::to_value(&child).map_err(|e| Failure::Api(e.to_string()))?;
                if let Some(o) = object.as_object_mut() {
                    o.insert("apiVersion".into(), json!(ar.api_version));
                    o.insert("kind".into(), json!(ar.kind));
                }
                observed.push(ObservedChild {
                    kind_index: index as u32,
                    object,
                });
            }
        }
        Ok(observed)
    }

    /// Server-side applies one child with field manager `capstan`, forcing conflicts.
    pub async fn apply_child(
        &self,
        kinds: &ChildKinds,
        child: &PlannedChild,
    ) -> Result<(), Failure> {
        let (kind, ar) = &kinds.kinds[child.kind_index];
        let ns = child
            .manifest
            .pointer("/metadata/namespace")
            .and_then(Value::as_str);
        self.child_api(ar, kind.namespaced, ns)
            .patch(
                &child.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&child.manifest),
            )
            .await
            .map_err(api_error(format!(
                "cannot apply {} {:?}",
                kind.kind, child.name
            )))?;
        Ok(())
    }

    /// Deletes an observed child that is no longer desired, only if it is still the
    /// same object (UID precondition). Already gone is fine.
    pub async fn prune_child(
        &self,
        kinds: &ChildKinds,
        child: &ObservedChild,
    ) -> Result<(), Failure> {
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
        match self
            .child_api(ar, kind.namespaced, field("/metadata/namespace"))
            .delete(name, &params)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(api_error(format!("cannot prune {} {name:?}", kind.kind))(e)),
        }
    }

    /// Writes the parent's whole status through `/status` with server-side apply.
    pub async fn write_status(
        &self,
        parent: &DynamicObject,
        status: &Value,
    ) -> Result<(), Failure> {
        let patch = json!({
            "apiVersion": self.parent.api_version,
            "kind": self.parent.kind,
            "status": status,
        });
        self.parent_api(parent)
            .patch_status(
                &parent.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
            .map_err(api_error("cannot write status".into()))?;
        Ok(())
    }

    /// Adds `finalizer` to the parent. The merge patch carries the resourceVersion read,
    /// so a concurrent change makes it fail (and retry) instead of being overwritten.
    pub async fn add_finalizer(
        &self,
        parent: &DynamicObject,
        finalizer: &str,
    ) -> Result<(), Failure> {
        let mut next = parent.metadata.finalizers.clone().unwrap_or_default();
        next.push(finalizer.to_string());
        self.replace_finalizers(parent, next).await
    }

    /// Removes `finalizer` from the parent, the same way.
    pub async fn remove_finalizer(
        &self,
        parent: &DynamicObject,
        finalizer: &str,
    ) -> Result<(), Failure> {
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
    ) -> Result<(), Failure> {
        let patch = json!({"metadata": {"finalizers": next, "resourceVersion": parent.metadata.resource_version}});
        match self
            .parent_api(parent)
            .patch(
                &parent.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(api_error("cannot update finalizers".into())(e)),
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
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::warn!(reason = %event.reason, "cannot post event: {}", short(&e));
        }
    }
}
