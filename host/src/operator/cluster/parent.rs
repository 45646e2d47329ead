//! Writes to the parent itself: its status (the plugin's fields, and the failure
//! reports that touch only the conditions) and its finalizers, each under the
//! resourceVersion it was computed from.

use kube::ResourceExt;
use kube::api::{DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use super::{ClusterWrites, Result, is_status};

impl ClusterWrites {
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
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::operator::cluster::ErrorClass;
    use crate::operator::cluster::fixtures::{child, configmaps, fake, parent};
    use crate::operator::fake_api::{self, Call};

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
}
