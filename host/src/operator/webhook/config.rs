//! What the API server is told about the webhook: the host's
//! `ValidatingWebhookConfiguration` (one webhook per validating plugin) and the
//! `spec.conversion` of each converting plugin's CRD, both written with server-side
//! apply under the field manager [`FIELD_MANAGER`].

use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::contract::{FailurePolicy, PluginInfo};

/// The field manager of everything the webhook writes. It is not the one `--install-crds`
/// applies CRDs with: that apply, which does not mention `spec.conversion`, then leaves
/// the conversion this one set alone instead of removing it.
pub const FIELD_MANAGER: &str = "capstan-webhook";

/// Why the API server was not told about the webhook.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Applying the ValidatingWebhookConfiguration failed.
    #[error("cannot apply ValidatingWebhookConfiguration {name}: {source}")]
    Validating {
        /// Its name.
        name: String,
        /// kube's error, with the status code when the server answered.
        #[source]
        source: kube::Error,
    },
    /// Applying a CRD's conversion failed.
    #[error("cannot set the conversion webhook of CRD {name}: {source}")]
    Conversion {
        /// The CRD.
        name: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

/// How the API server reaches the webhook server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// At this base URL (`https://127.0.0.1:9443`): a host outside the cluster.
    Url(String),
    /// Through a Service in the cluster.
    Service {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// Its port.
        port: u16,
    },
}

impl Reach {
    /// The names the serving certificate must hold for the API server to accept it:
    /// the URL's host, or the Service's DNS names.
    pub fn names(&self) -> Vec<String> {
        match self {
            Reach::Url(url) => {
                let host = url
                    .parse::<http::Uri>()
                    .ok()
                    .and_then(|u| u.host().map(String::from))
                    .unwrap_or_default();
                vec![
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_string(),
                ]
            }
            Reach::Service {
                namespace, name, ..
            } => vec![
                format!("{name}.{namespace}.svc"),
                format!("{name}.{namespace}.svc.cluster.local"),
                format!("{name}.{namespace}"),
                name.clone(),
            ],
        }
    }

    /// A `clientConfig` for `path`, trusting `ca_bundle` (PEM).
    pub fn client_config(&self, path: &str, ca_bundle: &str) -> Value {
        let ca_bundle = base64::engine::general_purpose::STANDARD.encode(ca_bundle);
        match self {
            Reach::Url(url) => json!({
                "url": format!("{}{path}", url.trim_end_matches('/')),
                "caBundle": ca_bundle,
            }),
            Reach::Service {
                namespace,
                name,
                port,
            } => json!({
                "service": {"namespace": namespace, "name": name, "port": port, "path": path},
                "caBundle": ca_bundle,
            }),
        }
    }
}

/// The name of the CRD of a plugin's parent kind, which also keys its webhook paths.
pub fn resource_name(info: &PluginInfo) -> String {
    format!("{}.{}", info.parent.plural, info.parent.group)
}

/// The path of a plugin's validating webhook. The failure policy is part of it, so that
/// a request for a plugin this host does not serve (not loaded yet, or gone) is
/// answered as the API server was told.
pub fn validate_path(info: &PluginInfo, policy: FailurePolicy) -> String {
    format!(
        "/validate/{}/{}",
        policy.as_str().to_lowercase(),
        resource_name(info)
    )
}

/// The path of a plugin's conversion webhook.
pub fn convert_path(info: &PluginInfo) -> String {
    format!("/convert/{}", resource_name(info))
}

/// The API server's wait for an answer (`timeoutSeconds`, 1 to 30) for a plugin whose
/// calls end at `deadline`: the deadline rounded up, plus a second for the rest of the
/// request, so that the host's answer (allowed, refused, or its failure policy) always
/// arrives before the API server gives up.
pub fn timeout_seconds(deadline: Duration) -> u32 {
    let whole = deadline.as_millis().div_ceil(1000) as u32;
    (whole + 1).clamp(1, 30)
}

/// How long the host gives a review before it answers by the failure policy itself:
/// half a second short of what the API server waits.
pub fn answer_within(timeout_seconds: u32) -> Duration {
    Duration::from_millis(u64::from(timeout_seconds) * 1000 - 500)
}

/// The API server waits 30 s for a conversion webhook.
pub const CONVERSION_TIMEOUT_SECONDS: u32 = 30;

/// The match condition that keeps the API server from calling the webhook about a
/// parent that is being deleted (CEL; `object` is the new object of a CREATE or UPDATE).
pub const DELETING_SKIPPED: &str = "!has(object.metadata.deletionTimestamp)";

/// One entry of the configuration's `webhooks`, for a plugin that validates with
/// `policy` and whose calls end at `deadline`. Only parents in `namespace` when the
/// host watches one namespace.
///
/// The rule names the plugin's own version, with `matchPolicy: Equivalent`: a change
/// made through any other version the CRD serves is converted to it first, so that
/// `validate` always sees the version the plugin reconciles, and every version is
/// covered.
pub fn validating_webhook(
    info: &PluginInfo,
    policy: FailurePolicy,
    deadline: Duration,
    reach: &Reach,
    ca_bundle: &str,
    namespace: Option<&str>,
) -> Value {
    let parent = &info.parent;
    let mut webhook = json!({
        "name": format!("validate.{}", resource_name(info)),
        "clientConfig": reach.client_config(&validate_path(info, policy), ca_bundle),
        "rules": [{
            "apiGroups": [parent.group],
            "apiVersions": [parent.version],
            "resources": [parent.plural],
            "operations": ["CREATE", "UPDATE"],
            "scope": if parent.namespaced { "Namespaced" } else { "Cluster" },
        }],
        "matchPolicy": "Equivalent",
        // A parent being deleted is never sent: its updates can only take finalizers
        // away, and must pass also when this host is gone and the policy is Fail.
        "matchConditions": [{
            "name": "not-being-deleted",
            "expression": DELETING_SKIPPED,
        }],
        "failurePolicy": policy.as_str(),
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": timeout_seconds(deadline),
    });
    if let (Some(namespace), true) = (namespace, parent.namespaced) {
        webhook["namespaceSelector"] =
            json!({"matchLabels": {"kubernetes.io/metadata.name": namespace}});
    }
    webhook
}

/// The host's ValidatingWebhookConfiguration named `name` with `webhooks` (as applied:
/// the entries it no longer lists are removed), owned by `owner` (an owner reference,
/// from [`owner_reference`]) when there is one.
pub fn validating_configuration(name: &str, webhooks: Vec<Value>, owner: Option<&Value>) -> Value {
    let mut body = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "capstan"}},
        "webhooks": webhooks,
    });
    if let Some(owner) = owner {
        body["metadata"]["ownerReferences"] = json!([owner]);
    }
    body
}

/// The owner reference to the ClusterRole `name`, which must exist: the garbage
/// collector deletes the configuration once that ClusterRole is gone. Neither
/// `controller` nor `blockOwnerDeletion` (which would need rights on the ClusterRole's
/// finalizers): the configuration only goes with it.
pub async fn owner_reference(client: &Client, name: &str) -> Result<Value, kube::Error> {
    let role = Api::<ClusterRole>::all(client.clone()).get(name).await?;
    Ok(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "name": name,
        "uid": role.metadata.uid.unwrap_or_default(),
    }))
}

/// The part of a converting plugin's CRD the webhook applies: `spec.conversion`.
pub fn conversion(info: &PluginInfo, reach: &Reach, ca_bundle: &str) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": resource_name(info)},
        "spec": {"conversion": {
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": reach.client_config(&convert_path(info), ca_bundle),
                "conversionReviewVersions": ["v1"],
            },
        }},
    })
}

/// Applies the ValidatingWebhookConfiguration `body` (from [`validating_configuration`]).
pub async fn apply_validating(client: &Client, body: &Value) -> Result<(), ConfigError> {
    let name = body["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    api.patch(&name, &apply_params(), &Patch::Apply(body))
        .await
        .map(drop)
        .map_err(|source| ConfigError::Validating { name, source })
}

/// Applies a CRD's conversion `body` (from [`conversion`]).
///
/// The API server wants exactly one of `url` and `service` in a `clientConfig`. When the
/// CRD names the other one (a host that moved into the cluster or out of it, deploy/'s
/// CRD, a `kubectl patch`), server-side apply would keep it, since another manager may
/// own it, and the apply would be refused; so it is first replaced with a merge patch.
pub async fn apply_conversion(client: &Client, body: &Value) -> Result<(), ConfigError> {
    let name = body["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let fail = |source| ConfigError::Conversion {
        name: name.clone(),
        source,
    };
    if let Some(current) = api.get_opt(&name).await.map_err(fail)? {
        let current = serde_json::to_value(&current).unwrap_or_default();
        if let Some(patch) = replacing_patch(&current, body) {
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            api.patch(&name, &params, &Patch::Merge(&patch))
                .await
                .map_err(fail)?;
        }
    }
    api.patch(&name, &apply_params(), &Patch::Apply(body))
        .await
        .map(drop)
        .map_err(fail)
}

/// The merge patch that sets the conversion `desired` (from [`conversion`]) on the CRD
/// `current` and removes the reach it does not use, if `current` names one.
fn replacing_patch(current: &Value, desired: &Value) -> Option<Value> {
    let path = "/spec/conversion/webhook/clientConfig";
    let now = current.pointer(path)?.as_object()?;
    let wanted = desired.pointer(path)?.as_object()?;
    let stale: Vec<&String> = ["url", "service"]
        .iter()
        .filter_map(|k| now.get_key_value(*k).map(|(k, _)| k))
        .filter(|k| !wanted.contains_key(k.as_str()))
        .collect();
    if stale.is_empty() {
        return None;
    }
    let mut client_config = wanted.clone();
    for key in stale {
        client_config.insert(key.clone(), Value::Null);
    }
    let mut patch = json!({"spec": desired["spec"].clone()});
    patch["spec"]["conversion"]["webhook"]["clientConfig"] = Value::Object(client_config);
    Some(patch)
}

/// Gives up the webhook's ownership of CRD `name`'s conversion (a new version of its
/// plugin no longer converts): the API server then defaults it back to `None`.
pub async fn release_conversion(client: &Client, name: &str) -> Result<(), ConfigError> {
    let body = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
    });
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    match api.patch(name, &apply_params(), &Patch::Apply(&body)).await {
        Ok(_) => Ok(()),
        // The CRD is gone: nothing to release.
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(source) => Err(ConfigError::Conversion {
            name: name.to_string(),
            source,
        }),
    }
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::KindRef;

    fn ticket() -> PluginInfo {
        PluginInfo {
            name: "ticket".into(),
            parent: KindRef {
                group: "test.capstan.dev".into(),
                version: "v1".into(),
                kind: "Ticket".into(),
                plural: "tickets".into(),
                namespaced: true,
            },
            validation: Some(FailurePolicy::Fail),
            conversion: true,
            ..Default::default()
        }
    }

    #[test]
    fn the_api_server_waits_longer_than_the_plugin_runs() {
        assert_eq!(timeout_seconds(Duration::from_millis(2000)), 3);
        assert_eq!(timeout_seconds(Duration::from_millis(2001)), 4);
        assert_eq!(timeout_seconds(Duration::from_millis(1)), 2);
        assert_eq!(timeout_seconds(Duration::from_secs(120)), 30, "at most 30");
        for ms in [1, 500, 999, 1000, 2000, 2500, 28_000] {
            let deadline = Duration::from_millis(ms);
            let wait = timeout_seconds(deadline);
            assert!(answer_within(wait) > deadline, "{ms} ms");
            assert!(answer_within(wait) < Duration::from_secs(wait.into()));
        }
    }

    #[test]
    fn a_validating_webhook_covers_create_and_update_of_the_parent() {
        let reach = Reach::Url("https://127.0.0.1:9443".into());
        let hook = validating_webhook(
            &ticket(),
            FailurePolicy::Fail,
            Duration::from_millis(2000),
            &reach,
            "PEM",
            Some("ns1"),
        );
        assert_eq!(hook["name"], "validate.tickets.test.capstan.dev");
        assert_eq!(
            hook["clientConfig"]["url"],
            "https://127.0.0.1:9443/validate/fail/tickets.test.capstan.dev"
        );
        assert_eq!(hook["clientConfig"]["caBundle"], "UEVN");
        assert_eq!(hook["rules"][0]["apiGroups"], json!(["test.capstan.dev"]));
        assert_eq!(hook["rules"][0]["resources"], json!(["tickets"]));
        assert_eq!(hook["rules"][0]["operations"], json!(["CREATE", "UPDATE"]));
        assert_eq!(hook["matchPolicy"], "Equivalent");
        assert_eq!(
            hook["matchConditions"],
            json!([{"name": "not-being-deleted", "expression": DELETING_SKIPPED}])
        );
        assert_eq!(hook["failurePolicy"], "Fail");
        assert_eq!(hook["sideEffects"], "None");
        assert_eq!(hook["admissionReviewVersions"], json!(["v1"]));
        assert_eq!(hook["timeoutSeconds"], 3);
        assert_eq!(
            hook["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            "ns1"
        );
        let everywhere = validating_webhook(
            &ticket(),
            FailurePolicy::Ignore,
            Duration::from_millis(2000),
            &reach,
            "PEM",
            None,
        );
        assert!(everywhere.get("namespaceSelector").is_none());
        assert_eq!(everywhere["failurePolicy"], "Ignore");
        assert!(
            everywhere["clientConfig"]["url"]
                .as_str()
                .unwrap()
                .contains("/validate/ignore/")
        );
    }

    #[test]
    fn in_cluster_the_service_is_named_and_the_certificate_holds_its_dns_names() {
        let reach = Reach::Service {
            namespace: "capstan-system".into(),
            name: "capstan-webhook".into(),
            port: 443,
        };
        let conversion = conversion(&ticket(), &reach, "PEM");
        assert_eq!(conversion["metadata"]["name"], "tickets.test.capstan.dev");
        let spec = &conversion["spec"]["conversion"];
        assert_eq!(spec["strategy"], "Webhook");
        assert_eq!(spec["webhook"]["conversionReviewVersions"], json!(["v1"]));
        assert_eq!(
            spec["webhook"]["clientConfig"]["service"],
            json!({"namespace": "capstan-system", "name": "capstan-webhook", "port": 443,
                   "path": "/convert/tickets.test.capstan.dev"})
        );
        assert!(
            reach
                .names()
                .contains(&"capstan-webhook.capstan-system.svc".to_string())
        );
        assert_eq!(
            Reach::Url("https://127.0.0.1:9443/".into()).names(),
            vec!["127.0.0.1".to_string()]
        );
        assert_eq!(
            Reach::Url("https://[::1]:9443".into()).names(),
            vec!["::1".to_string()]
        );
    }

    #[test]
    fn a_crd_that_names_the_other_reach_is_patched_to_drop_it_first() {
        let service = Reach::Service {
            namespace: "capstan-system".into(),
            name: "capstan-webhook".into(),
            port: 443,
        };
        let url = Reach::Url("https://127.0.0.1:9443".into());
        let in_cluster = conversion(&ticket(), &service, "PEM");
        let outside = conversion(&ticket(), &url, "PEM");
        // A host outside the cluster, after deploy/ (or an in-cluster host) named the Service.
        let patch = replacing_patch(&in_cluster, &outside).expect("service is stale");
        let client_config = &patch["spec"]["conversion"]["webhook"]["clientConfig"];
        assert_eq!(client_config["service"], Value::Null);
        assert_eq!(
            client_config["url"],
            "https://127.0.0.1:9443/convert/tickets.test.capstan.dev"
        );
        assert_eq!(client_config["caBundle"], "UEVN");
        assert_eq!(patch["spec"]["conversion"]["strategy"], "Webhook");
        // And the other way round.
        let back = replacing_patch(&outside, &in_cluster).expect("url is stale");
        let client_config = &back["spec"]["conversion"]["webhook"]["clientConfig"];
        assert_eq!(client_config["url"], Value::Null);
        assert_eq!(client_config["service"]["name"], "capstan-webhook");
        // Same reach (a new CA, another port), no conversion yet: the apply alone does.
        let moved = conversion(&ticket(), &Reach::Url("https://127.0.0.1:9444".into()), "X");
        assert_eq!(replacing_patch(&outside, &moved), None);
        let none = json!({"spec": {"conversion": {"strategy": "None"}}});
        assert_eq!(replacing_patch(&none, &outside), None);
    }
}
