//! What runs now, read back from the observed children: the configuration the observed
//! StatefulSet and CronJob were built from, so that a refused change can leave them
//! exactly as they are. Derived from observed state only, never from memory.

use capstan_sdk::{Context, Error};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::cluster::Cluster;
use crate::spec::{Config, Version, official_image};

/// Annotation on the StatefulSet: the PostgreSQL version it runs, as in the spec.
pub const VERSION_ANNOTATION: &str = "db.example.com/version";
/// Annotation on the StatefulSet: `spec.storage` as written when it was created. The
/// API server rewrites the claim template's quantity into canonical form, so the
/// annotation keeps the user's spelling and the manifest stays byte-for-byte the same.
pub const STORAGE_ANNOTATION: &str = "db.example.com/storage";
/// Name of the StatefulSet's volume claim template.
pub const DATA_VOLUME: &str = "data";

/// The observed child of kind `K` named `name`. Present but not a valid `K` is
/// [`Error::Retry`]: treating it as absent could replace what it holds.
pub fn child<K>(ctx: &Context, name: &str) -> Result<Option<K>, Error>
where
    K: k8s_openapi::Resource + DeserializeOwned,
{
    let Some(raw) = ctx
        .raw_children(K::API_VERSION, K::KIND)
        .find(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
    else {
        return Ok(None);
    };
    serde_json::from_value(raw.clone())
        .map(Some)
        .map_err(|e| Error::retry(format!("observed {} {name} is malformed: {e}", K::KIND)))
}

/// The running cluster as observed.
#[derive(Debug, Clone, Default)]
pub struct Running {
    /// The StatefulSet, if there is one.
    pub statefulset: Option<StatefulSet>,
    /// The configuration it (and the dump CronJob) were built from.
    pub config: Option<Config>,
    /// The requested size of the dumps claim, if there is one, as the API server has it.
    pub dumps_storage: Option<String>,
}

impl Running {
    /// Reads the observed StatefulSet, CronJob and dumps claim of `cluster`.
    pub fn observe(ctx: &Context, cluster: &Cluster) -> Result<Self, Error> {
        let statefulset = child::<StatefulSet>(ctx, cluster.name())?;
        let config = match &statefulset {
            Some(sts) => {
                let schedule = child::<CronJob>(ctx, &cluster.dump_job())?.map(|c| c.spec.schedule);
                Some(config_of(sts, schedule)?)
            }
            None => None,
        };
        let dumps_storage = child::<PersistentVolumeClaim>(ctx, &cluster.dumps())?
            .and_then(|pvc| pvc.spec?.resources?.requests?.remove("storage"))
            .map(|q| q.0);
        Ok(Running {
            statefulset,
            config,
            dumps_storage,
        })
    }
}

/// The configuration a StatefulSet was built from: version and storage from its
/// annotations (else its image and claim template), replicas from its spec.
fn config_of(sts: &StatefulSet, schedule: Option<String>) -> Result<Config, Error> {
    let name = sts.metadata.name.as_deref().unwrap_or_default();
    let annotation = |key: &str| {
        sts.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .cloned()
    };
    let spec = &sts.spec;
    let image = spec
        .template
        .spec
        .as_ref()
        .and_then(|pod| pod.containers.first()?.image.clone());
    let image_tag = || Some(image.as_deref()?.rsplit_once(':')?.1.to_string());
    let version_text = annotation(VERSION_ANNOTATION).or_else(image_tag);
    let version = version_text
        .as_deref()
        .and_then(Version::parse)
        .ok_or_else(|| {
            Error::retry(format!(
                "StatefulSet {name}: cannot tell which PostgreSQL version it runs (annotation {VERSION_ANNOTATION} and image tag are {version_text:?})"
            ))
        })?;
    let claim_storage = || {
        spec.volume_claim_templates
            .as_ref()?
            .iter()
            .find(|t| t.metadata.name.as_deref() == Some(DATA_VOLUME))?
            .spec
            .as_ref()?
            .resources
            .as_ref()?
            .requests
            .as_ref()?
            .get("storage")
            .map(|q| q.0.clone())
    };
    let storage = annotation(STORAGE_ANNOTATION)
        .or_else(claim_storage)
        .ok_or_else(|| {
            Error::retry(format!(
                "StatefulSet {name}: cannot tell its volume size (no annotation {STORAGE_ANNOTATION} and no claim template {DATA_VOLUME:?})"
            ))
        })?;
    // The official image of its version is the default, not a choice to keep.
    let image = image.filter(|image| *image != official_image(&version));
    Ok(Config {
        replicas: spec.replicas.unwrap_or(1),
        version,
        storage,
        schedule,
        image,
    })
}
