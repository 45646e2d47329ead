//! Each plugin's own identity (`--plugin-identities NAMESPACE`): the requests the host
//! makes on a plugin's behalf — its parents' watch, every write of its reconciles
//! (children applied and pruned, status, events, finalizers) — are made as the plugin's
//! ServiceAccount `capstan-plugin-<plugin>` in NAMESPACE, through impersonation
//! (`Impersonate-User: system:serviceaccount:NAMESPACE:capstan-plugin-<plugin>`). The
//! API server then authorizes each of them against that account's RBAC, which
//! `capstan rbac --plugin-identities NAMESPACE` prints from the plugin's declarations:
//! a plugin's bug, or a bug in the host's own checks, cannot write outside its grant.
//!
//! The shared caches of child and related kinds (one watch per kind, whatever the
//! plugins) still read with the host's identity; what they deliver to each plugin is
//! selected by the host (docs/security.md).

use http::{HeaderValue, Request};
use kube::Client;
use kube::client::Body;

/// The prefix of a plugin's ServiceAccount: `capstan-plugin-<plugin>`.
pub const SERVICE_ACCOUNT_PREFIX: &str = "capstan-plugin-";

/// Where the plugins' ServiceAccounts live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginIdentities {
    namespace: String,
}

impl PluginIdentities {
    /// The plugins' ServiceAccounts are in `namespace`.
    pub fn new(namespace: &str) -> Self {
        PluginIdentities {
            namespace: namespace.to_string(),
        }
    }

    /// The namespace of the accounts.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The ServiceAccount of `plugin`.
    pub fn service_account(plugin: &str) -> String {
        format!("{SERVICE_ACCOUNT_PREFIX}{plugin}")
    }

    /// The user the API server sees for `plugin`'s requests.
    pub fn user(&self, plugin: &str) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace,
            Self::service_account(plugin)
        )
    }

    /// `client` (sharing its connections, fence and retries), every request of which is
    /// made as `plugin`'s ServiceAccount.
    pub fn client_of(&self, client: &Client, plugin: &str) -> Client {
        impersonating(client, &self.user(plugin))
    }
}

/// `client`, every request of which carries `Impersonate-User: user`.
fn impersonating(client: &Client, user: &str) -> Client {
    let inner = client.clone();
    let user = HeaderValue::from_str(user).expect("a ServiceAccount's user name is a header value");
    let service = tower::service_fn(move |mut request: Request<Body>| {
        let inner = inner.clone();
        request
            .headers_mut()
            .insert("impersonate-user", user.clone());
        async move { inner.send(request).await }
    });
    Client::new(service, client.default_namespace().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::fake_api;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, PostParams};

    #[tokio::test]
    async fn every_request_of_a_plugins_client_names_its_account() {
        let (client, calls) = fake_api::client(|call: &fake_api::Call| (201, call.body.clone()));
        let identities = PluginIdentities::new("capstan-system");
        assert_eq!(
            identities.user("widget"),
            "system:serviceaccount:capstan-system:capstan-plugin-widget"
        );
        let widget = identities.client_of(&client, "widget");
        let api: Api<ConfigMap> = Api::namespaced(widget, "ns");
        let cm: ConfigMap =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "c"}})).unwrap();
        api.create(&PostParams::default(), &cm).await.unwrap();
        let _ = api.get("c").await;
        let all = calls.all();
        assert_eq!(all.len(), 2);
        for call in all {
            assert_eq!(
                call.headers
                    .get("impersonate-user")
                    .and_then(|v| v.to_str().ok()),
                Some("system:serviceaccount:capstan-system:capstan-plugin-widget"),
                "{} {}",
                call.method,
                call.path
            );
        }
        // The host's own client is untouched.
        let host: Api<ConfigMap> = Api::namespaced(client, "ns");
        host.create(&PostParams::default(), &cm).await.unwrap();
        assert!(
            calls
                .all()
                .last()
                .unwrap()
                .headers
                .get("impersonate-user")
                .is_none()
        );
    }
}
