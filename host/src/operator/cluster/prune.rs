//! Deleting a child that is no longer desired, only while it is still the object the
//! parent observed (UID precondition).

use kube::api::{DeleteParams, Preconditions, PropagationPolicy};
use serde_json::Value;

use super::{ChildKinds, ClusterWrites, Result, is_status};
use crate::contract::ObservedChild;

impl ClusterWrites {
    /// Deletes an observed child that is no longer desired, only if it is still the
    /// same object (UID precondition). Already gone is fine. What the child owns is
    /// deleted in the background.
    pub async fn prune_child(&self, kinds: &ChildKinds, child: &ObservedChild) -> Result<()> {
        self.delete_child(kinds, child, PropagationPolicy::Background)
            .await
    }

    /// Deletes an observed child, only if it is still the same object (UID
    /// precondition), with `propagation` for what it owns (a teardown wave deletes in
    /// the foreground: the child stays, being deleted, until what it owns is gone).
    pub async fn delete_child(
        &self,
        kinds: &ChildKinds,
        child: &ObservedChild,
        propagation: PropagationPolicy,
    ) -> Result<()> {
        let (kind, ar) = &kinds.kinds[child.kind_index as usize];
        let field = |p: &str| child.object.pointer(p).and_then(Value::as_str);
        let name = field("/metadata/name").unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: field("/metadata/uid").map(String::from),
                resource_version: None,
            }),
            propagation_policy: Some(propagation),
            ..DeleteParams::default()
        };
        let api = self.child_api(ar, kind.namespaced, field("/metadata/namespace"));
        match self
            .write(
                || format!("delete {} {name:?}", kind.kind),
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
}

#[cfg(test)]
mod tests {
    use http::Method;
    use serde_json::json;

    use crate::contract::ObservedChild;
    use crate::operator::cluster::fixtures::{configmaps, fake};
    use crate::operator::fake_api::{self, Call};

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
}
