//! `--install-crds`: the CRD a plugin ships, applied before its controller starts.
//!
//! A plugin installs its CRD when the CRD is absent, and updates it only when the CRD is
//! its own: labelled `capstan.dev/plugin: <its name>` (every CRD the host installs is),
//! or written by an earlier host under the host's field manager and labelled by no
//! other plugin. Any other CRD of the same name (another operator's, one an
//! administrator installed) is left as it is, conversion webhook included: the plugin
//! serves the kind as that CRD defines it, unless it converts, which is then refused
//! (the host never points another's CRD at its conversion webhook).

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tracing::{info, warn};

use crate::plan::{HOST_FIELD_MANAGER, PLUGIN_LABEL};
use crate::plugin::Plugin;

/// Why a plugin's CRD could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// `--install-crds` is on and the plugin ships no CRD.
    #[error("plugin {plugin} ships no CRD")]
    NoCrd {
        /// The plugin.
        plugin: String,
    },
    /// The CRD the plugin ships is not JSON, or names no CRD.
    #[error("the CRD of plugin {plugin} is not a CRD: {reason}")]
    NotACrd {
        /// The plugin.
        plugin: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The API server refused or failed the CRD's read or apply.
    #[error("cannot apply CRD {name}: {source}")]
    Apply {
        /// The CRD's name.
        name: String,
        /// kube's error, with the status code when the server answered.
        #[source]
        source: kube::Error,
    },
    /// Waiting for the CRD to be established failed.
    #[error("cannot wait for CRD {name}: {source}")]
    Wait {
        /// The CRD's name.
        name: String,
        /// What went wrong.
        #[source]
        source: kube::runtime::wait::Error,
    },
    /// The plugin converts, and the CRD of its kind is not its own: the host does not
    /// point another's CRD at its webhook.
    #[error(
        "plugin {plugin} converts {name}, and that CRD is not its own ({whose}): an administrator hands it over with the label {PLUGIN_LABEL}={plugin}"
    )]
    NotItsOwn {
        /// The plugin.
        plugin: String,
        /// The CRD's name.
        name: String,
        /// Whose it is, as far as the host can tell.
        whose: String,
    },
    /// The CRD was applied but not established in time.
    #[error("CRD {name} not established after {timeout:?}")]
    NotEstablished {
        /// The CRD's name.
        name: String,
        /// How long the host waited.
        timeout: Duration,
    },
}

/// How long the host waits for an installed CRD to be served.
const CRD_ESTABLISHED: Duration = Duration::from_secs(30);

/// Whose a CRD in the cluster is, as far as installing a plugin's CRD goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Owner {
    /// No such CRD: the plugin installs it.
    Absent,
    /// Labelled with the plugin's name, or installed by an earlier host and labelled
    /// by no plugin: the plugin updates it.
    Plugin,
    /// Anyone else's: left alone. The label's value (none: unlabelled).
    Other(Option<String>),
}

/// Whose `existing` is, for the plugin `plugin`.
pub(super) fn owner(existing: Option<&CustomResourceDefinition>, plugin: &str) -> Owner {
    let Some(crd) = existing else {
        return Owner::Absent;
    };
    let label = crd
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(PLUGIN_LABEL));
    match label {
        Some(owner) if owner == plugin => Owner::Plugin,
        Some(owner) => Owner::Other(Some(owner.clone())),
        None => {
            let by_host = crd.metadata.managed_fields.iter().flatten().any(|entry| {
                entry.manager.as_deref() == Some(HOST_FIELD_MANAGER)
                    && entry.operation.as_deref() == Some("Apply")
            });
            if by_host {
                Owner::Plugin
            } else {
                Owner::Other(None)
            }
        }
    }
}

/// How `owner` reads in a message.
fn whose(owner: &Option<String>) -> String {
    owner
        .as_ref()
        .map_or("not installed by Capstan".to_string(), |other| {
            format!("labelled {PLUGIN_LABEL}={other}")
        })
}

/// The CRD `name` as the API server has it, and whose it is for `plugin`.
async fn look_up(
    api: &Api<CustomResourceDefinition>,
    name: &str,
    plugin: &str,
) -> Result<(Option<CustomResourceDefinition>, Owner), CrdError> {
    let existing = api.get_opt(name).await.map_err(|source| CrdError::Apply {
        name: name.to_string(),
        source,
    })?;
    let owner = owner(existing.as_ref(), plugin);
    Ok((existing, owner))
}

/// The refusal of a converting `plugin` whose CRD `name` is another's.
fn not_its_own(plugin: &str, name: String, label: &Option<String>) -> CrdError {
    CrdError::NotItsOwn {
        plugin: plugin.to_string(),
        name,
        whose: whose(label),
    }
}

/// Whether the converting `plugin` may have the CRD of its kind pointed at the host's
/// conversion webhook: the CRD is absent (it is created with the conversion in place)
/// or the plugin's own ([`owner`]). Without `--install-crds`; with it, [`install`]
/// decides the same in its one read of the CRD.
pub(super) async fn may_convert(client: &Client, plugin: &Plugin) -> Result<(), CrdError> {
    let info = plugin.info();
    let name = format!("{}.{}", info.parent.plural, info.parent.group);
    match look_up(&Api::all(client.clone()), &name, &info.name).await? {
        (_, Owner::Absent | Owner::Plugin) => Ok(()),
        (_, Owner::Other(label)) => Err(not_its_own(&info.name, name, &label)),
    }
}

/// Applies the plugin's CRD, labelled as its own, and waits until the API server serves
/// it, when the CRD is absent or the plugin's own ([`owner`]); leaves any other CRD of
/// that name alone, with a warning, unless the plugin converts (`conversion`): that
/// is refused ([`CrdError::NotItsOwn`]). A CRD that does not exist yet is created with
/// `conversion` (the webhook's, for a plugin that converts); one that exists keeps the
/// conversion the webhook keeps up to date, whatever the shipped manifest says.
pub(super) async fn install(
    client: &Client,
    plugin: &Plugin,
    conversion: Option<serde_json::Value>,
) -> Result<(), CrdError> {
    let info = plugin.info();
    let Some(crd) = &info.crd else {
        return Err(CrdError::NoCrd {
            plugin: info.name.clone(),
        });
    };
    let not_a_crd = |reason: String| CrdError::NotACrd {
        plugin: info.name.clone(),
        reason,
    };
    let mut crd: serde_json::Value =
        serde_json::from_str(crd).map_err(|e| not_a_crd(e.to_string()))?;
    let name = crd
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .filter(|name| !name.is_empty())
        .ok_or_else(|| not_a_crd("it has no metadata.name".into()))?
        .to_string();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let (existing, owner) = look_up(&api, &name, &info.name).await?;
    match owner {
        Owner::Absent | Owner::Plugin => {}
        // A converting plugin is refused, as without --install-crds (`may_convert`).
        Owner::Other(label) if conversion.is_some() => {
            return Err(not_its_own(&info.name, name, &label));
        }
        Owner::Other(label) => {
            let whose = whose(&label);
            warn!(crd = %name, plugin = %info.name, "the CRD exists and is not this plugin's ({whose}): left as it is, the plugin serves the kind it defines");
            return Ok(());
        }
    }
    crd["metadata"]["labels"][PLUGIN_LABEL] = serde_json::json!(info.name);
    if let Some(conversion) = conversion {
        match (&existing, crd["spec"].as_object_mut()) {
            (None, _) => crd["spec"]["conversion"] = conversion,
            // The webhook's (its URL or Service and CA), not the shipped manifest's.
            (Some(_), Some(spec)) => drop(spec.remove("conversion")),
            (Some(_), None) => {}
        }
    }
    api.patch(
        &name,
        &PatchParams::apply(HOST_FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .map_err(|source| CrdError::Apply {
        name: name.clone(),
        source,
    })?;
    let established = kube::runtime::wait::await_condition(
        api,
        &name,
        kube::runtime::wait::conditions::is_crd_established(),
    );
    match tokio::time::timeout(CRD_ESTABLISHED, established).await {
        Ok(Ok(_)) => {}
        Ok(Err(source)) => return Err(CrdError::Wait { name, source }),
        Err(_) => {
            return Err(CrdError::NotEstablished {
                name,
                timeout: CRD_ESTABLISHED,
            });
        }
    }
    info!(crd = %name, "CRD installed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    fn crd(label: Option<&str>, manager: Option<&str>) -> CustomResourceDefinition {
        let mut crd = CustomResourceDefinition::default();
        if let Some(label) = label {
            crd.metadata.labels = Some([(PLUGIN_LABEL.to_string(), label.to_string())].into());
        }
        if let Some(manager) = manager {
            crd.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
                manager: Some(manager.into()),
                operation: Some("Apply".into()),
                ..Default::default()
            }]);
        }
        crd
    }

    /// A native plugin of Widgets shipping its CRD, converting or not.
    struct Shipping(bool);

    impl crate::plugin::Native for Shipping {
        fn describe(&self) -> crate::contract::PluginInfo {
            crate::contract::PluginInfo {
                name: "widget".into(),
                parent: crate::contract::KindRef::namespaced("test.capstan.dev", "v1", "Widget", "widgets"),
                crd: Some(r#"{"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "widgets.test.capstan.dev"}, "spec": {}}"#.into()),
                conversion: self.0,
                ..Default::default()
            }
        }

        fn reconcile(
            &self,
            _: &crate::contract::Observed,
        ) -> Result<crate::contract::Desired, crate::contract::PluginError> {
            Err(crate::contract::PluginError::Invalid("not called".into()))
        }
    }

    #[tokio::test]
    async fn another_plugins_crd_is_neither_written_nor_converted() {
        use crate::operator::fake_api;
        let theirs = serde_json::json!({"apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.test.capstan.dev", "labels": {PLUGIN_LABEL: "thief"}}});
        let (client, calls) = fake_api::client(move |call: &fake_api::Call| match call.method {
            http::Method::GET => (200, theirs.clone()),
            _ => fake_api::status(500, "InternalError", "nothing is written here"),
        });
        let plain = Plugin::native(Shipping(false));
        install(&client, &plain, None).await.unwrap();
        let converting = Plugin::native(Shipping(true));
        for refused in [
            install(
                &client,
                &converting,
                Some(serde_json::json!({"strategy": "Webhook"})),
            )
            .await,
            may_convert(&client, &converting).await,
        ] {
            let err = refused.unwrap_err().to_string();
            assert!(
                err.contains("plugin widget converts widgets.test.capstan.dev")
                    && err.contains("labelled capstan.dev/plugin=thief"),
                "{err}"
            );
        }
        assert!(
            calls.all().iter().all(|c| c.method == http::Method::GET),
            "one read each, no write: {:?}",
            calls.summary()
        );
        assert_eq!(calls.all().len(), 3);
    }

    #[test]
    fn a_plugin_updates_only_a_crd_that_is_absent_or_its_own() {
        assert_eq!(owner(None, "widget"), Owner::Absent);
        assert_eq!(
            owner(Some(&crd(Some("widget"), None)), "widget"),
            Owner::Plugin
        );
        // Installed by a host before CRDs were labelled.
        assert_eq!(
            owner(Some(&crd(None, Some(HOST_FIELD_MANAGER))), "widget"),
            Owner::Plugin
        );
        // Another plugin's, even when the host's field manager wrote it.
        assert_eq!(
            owner(
                Some(&crd(Some("thief"), Some(HOST_FIELD_MANAGER))),
                "widget"
            ),
            Owner::Other(Some("thief".into()))
        );
        // An administrator's or another operator's.
        assert_eq!(
            owner(
                Some(&crd(None, Some("kubectl-client-side-apply"))),
                "widget"
            ),
            Owner::Other(None)
        );
        assert_eq!(owner(Some(&crd(None, None)), "widget"), Owner::Other(None));
    }
}
