//! Events on the parent, posted through kube's recorder (best effort).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::api::DynamicObject;
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType};

use super::ClusterWrites;
use crate::contract::{Event, EventType};

impl ClusterWrites {
    /// Posts an event on the parent. Best effort: failures are logged.
    pub async fn publish(&self, parent: &DynamicObject, event: &Event) {
        self.publish_about(parent, event, "Reconcile", None).await;
    }

    /// Posts an event on the parent about an `action` on a `related` object (a child a
    /// teardown wave deletes). The recorder counts repeats of one (type, reason, action,
    /// related) as a series: the related object keeps two waves apart.
    pub async fn publish_about(
        &self,
        parent: &DynamicObject,
        event: &Event,
        action: &str,
        related: Option<ObjectReference>,
    ) {
        let ev = KubeEvent {
            type_: match event.type_ {
                EventType::Normal => KubeEventType::Normal,
                EventType::Warning => KubeEventType::Warning,
            },
            reason: event.reason.clone(),
            note: Some(event.message.clone()),
            action: action.into(),
            secondary: related,
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
