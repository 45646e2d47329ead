//! Events on the parent, posted through kube's recorder (best effort).

use kube::Resource;
use kube::api::DynamicObject;
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType};

use super::ClusterWrites;
use crate::contract::{Event, EventType};

impl ClusterWrites {
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
