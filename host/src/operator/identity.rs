//! Each plugin's own identity (`--plugin-identities NAMESPACE`): the requests the host
//! makes on a plugin's behalf — the watches of its parents, children and related
//! objects, every write of its reconciles (children applied and pruned, status,
//! events, finalizers) and the release of its finalizers once it is gone — are made
//! as the plugin's ServiceAccount `capstan-plugin-<plugin>` in NAMESPACE, through
//! impersonation
//! (`Impersonate-User: system:serviceaccount:NAMESPACE:capstan-plugin-<plugin>`).
//! The API server then authorizes each of them against that account's RBAC, which
//! `capstan rbac --plugin-identities NAMESPACE` prints from the plugin's declarations:
//! a plugin's bug, or a bug in the host's own checks, cannot write outside its grant.
//!
//! So no cache is shared across plugins then: each plugin's child and related kinds
//! are watched for it alone ([`super::watch_pool::reader`]), at the cost of one watch
//! per plugin and kind instead of one per kind (docs/performance.md). What is left to
//! the host's own identity is its own: its Lease, its webhook's Secret and
//! configuration, and the CRDs it installs (docs/security.md).

use http::{HeaderValue, Request};
use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::client::Body;
use serde_json::json;

use crate::contract::{KindRef, PluginInfo};

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

impl PluginIdentities {
    /// Whether `info`'s account may make the requests its controller makes for it
    /// (namespaced kinds in `namespace` when the host watches one): asked of the API
    /// server as the account (SelfSubjectAccessReview, which every authenticated user
    /// may ask), so that a plugin whose account is missing or short of rights is
    /// refused at load, in one line, instead of serving with watches that fail.
    pub async fn check_access(
        &self,
        client: &Client,
        info: &PluginInfo,
        namespace: Option<&str>,
    ) -> Result<(), String> {
        let plugin = self.client_of(client, &info.name);
        let reviews: Api<SelfSubjectAccessReview> = Api::all(plugin);
        for (kind, verbs) in needed(info) {
            for verb in verbs {
                let review: SelfSubjectAccessReview = serde_json::from_value(json!({
                    "spec": {"resourceAttributes": {
                        "group": kind.group,
                        "resource": kind.resource,
                        "verb": verb,
                        "namespace": if kind.namespaced { namespace } else { None },
                    }}
                }))
                .expect("a SelfSubjectAccessReview");
                let answer = reviews
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|e| {
                        format!(
                            "cannot ask whether {} may {verb} {}: {e}",
                            self.user(&info.name),
                            kind.resource
                        )
                    })?;
                if !answer.status.is_some_and(|s| s.allowed) {
                    let group = match kind.group.as_str() {
                        "" => String::new(),
                        g => format!(".{g}"),
                    };
                    return Err(format!(
                        "plugin {}: its account {} may not {verb} {}{group}: grant it what `capstan rbac --plugins DIR --plugin-identities {}` prints (docs/security.md)",
                        info.name,
                        self.user(&info.name),
                        kind.resource,
                        self.namespace,
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A resource a plugin's requests touch.
struct Needed {
    group: String,
    resource: String,
    namespaced: bool,
}

/// What `info`'s controller asks of the API server as the plugin, by resource: the
/// rules of `rbac::plugin_identity`, less those only a rare path needs (finalizers).
fn needed(info: &PluginInfo) -> Vec<(Needed, &'static [&'static str])> {
    let of = |kind: &KindRef, suffix: &str| Needed {
        group: kind.group.clone(),
        resource: format!("{}{suffix}", kind.plural),
        namespaced: kind.namespaced,
    };
    let mut needed: Vec<(Needed, &'static [&'static str])> = vec![
        (of(&info.parent, ""), &["list", "watch", "patch"]),
        (of(&info.parent, "/status"), &["patch"]),
    ];
    for child in &info.children {
        needed.push((
            of(child, ""),
            &["list", "watch", "create", "patch", "delete"],
        ));
    }
    for related in &info.related {
        needed.push((of(related, ""), &["list", "watch"]));
    }
    needed.push((
        Needed {
            group: "events.k8s.io".into(),
            resource: "events".into(),
            namespaced: true,
        },
        &["create"],
    ));
    needed
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

    fn widget() -> PluginInfo {
        let kind = |group: &str, kind: &str, plural: &str| KindRef {
            group: group.into(),
            version: "v1".into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
        };
        PluginInfo {
            name: "widget".into(),
            parent: kind("test.capstan.dev", "Widget", "widgets"),
            children: vec![kind("", "ConfigMap", "configmaps")],
            related: vec![kind("", "Secret", "secrets")],
            ..PluginInfo::default()
        }
    }

    #[tokio::test]
    async fn a_plugin_whose_account_lacks_a_right_is_refused_in_one_line() {
        // The API server allows everything but watching Secrets.
        let (client, calls) = fake_api::client(|call: &fake_api::Call| {
            let attributes = &call.body["spec"]["resourceAttributes"];
            let allowed = !(attributes["resource"] == "secrets" && attributes["verb"] == "watch");
            let mut answer = call.body.clone();
            answer["status"] = json!({"allowed": allowed});
            (201, answer)
        });
        let identities = PluginIdentities::new("capstan-system");
        let refused = identities
            .check_access(&client, &widget(), Some("prod"))
            .await
            .unwrap_err();
        assert_eq!(
            refused,
            "plugin widget: its account system:serviceaccount:capstan-system:capstan-plugin-widget may not watch secrets: grant it what `capstan rbac --plugins DIR --plugin-identities capstan-system` prints (docs/security.md)"
        );
        let all = calls.all();
        assert!(all.iter().all(|c| {
            c.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
                && c.headers
                    .get("impersonate-user")
                    .and_then(|v| v.to_str().ok())
                    == Some("system:serviceaccount:capstan-system:capstan-plugin-widget")
                && c.body["spec"]["resourceAttributes"]["namespace"] == "prod"
        }));
        // Everything allowed: served.
        let (client, _) = fake_api::client(|call: &fake_api::Call| {
            let mut answer = call.body.clone();
            answer["status"] = json!({"allowed": true});
            (201, answer)
        });
        identities
            .check_access(&client, &widget(), None)
            .await
            .unwrap();
    }
}
