//! Every Kubernetes API call a reconcile makes (its reads of children come from the
//! shared caches of [`super::children`]): server-side apply under the ownership rules
//! ([`apply`]), pruning with a UID precondition ([`prune`]), the parent's status and
//! finalizers ([`parent`]) and events ([`events`]). Every request has a timeout and
//! passes the write fence, and errors keep kube's error (and with it the HTTP status) so
//! the pipeline can tell permanent from transient failures ([`error`]).

mod apply;
mod error;
mod events;
#[cfg(test)]
mod fixtures;
mod parent;
mod prune;
mod writer;

use std::future::Future;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::events::{Recorder, Reporter};

#[cfg(test)]
pub use apply::CREATE_ONLY;
pub use apply::{ChildKinds, ChildOutcome, OwnershipConflict};
pub use error::{Error, ErrorClass, Result};
pub use writer::{Acted, Wave, Writer};

use super::kinds::api_resource;
use super::leader::WriteFence;
use crate::contract::KindRef;
use crate::plan;

/// How long one API request may take before it counts as failed (transient).
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

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

impl ClusterWrites {
    /// Cluster access for parents of kind `parent`, reconciled by `plugin`.
    pub fn new(client: Client, parent: &KindRef, plugin: &str, fence: WriteFence) -> Self {
        // The events' reporting controller is the plugin's field manager.
        let reporter = Reporter {
            controller: plan::field_manager(plugin),
            instance: None,
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

    /// The same access, its events naming this replica `instance` as their reporting
    /// instance (the Pod's name in a cluster).
    pub fn reporting_as(mut self, instance: Option<&str>) -> Self {
        let reporter = Reporter {
            controller: self.manager.clone(),
            instance: instance.map(String::from),
        };
        self.recorder = Recorder::new(self.client.clone(), reporter);
        self
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
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::fixtures::{child, configmaps, parent, widget_kind};
    use super::*;
    use crate::operator::fake_api::{self, Call};

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
        let err = writes
            .write_status(&parent(), &json!({}))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotLeader { .. }), "{err}");
        let err = writes.remove_finalizer(&parent(), "f").await.unwrap_err();
        assert!(matches!(err, Error::NotLeader { .. }), "{err}");
        writes.publish(&parent(), &plan::warning("X", "y")).await;
        assert!(calls.all().is_empty(), "{:?}", calls.summary());
    }
}
