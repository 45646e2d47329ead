//! Ordered teardown (`finalize`): a deleted cluster goes down in waves, each over
//! before the next starts, so that nothing runs against what is already gone.
//!
//! 1. The dump CronJob, the Services and their EndpointSlices: no dump starts against
//!    a primary that is stopping, and clients stop reaching the instances.
//! 2. The StatefulSet: the host deletes it in the foreground, so the wave lasts until
//!    its Pods have stopped (each with its fast-shutdown `preStop`).
//! 3. The credentials Secret, which the Pods read until they stop.
//!
//! Then done; what no wave names (the scripts and topology ConfigMaps, the
//! PodDisruptionBudget, the claim `<name>-dumps`) is garbage-collected through its
//! ownerReference once the cluster is gone. The instances' claims `data-<name>-<n>` are not the cluster's
//! children: the StatefulSet's retention policy keeps them.
//!
//! Each wave is derived from the observed children alone: it names those of its kinds
//! that are still there (a child being deleted still is), and a wave with none left is
//! skipped. The spec is not read, so an invalid spec never blocks a deletion.

use capstan_sdk::{Context, Finalized};
use k8s_openapi::Resource;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;

/// A child kind, as `(apiVersion, kind)`.
type Kind = (&'static str, &'static str);

/// The kinds each wave deletes, in order.
pub const WAVES: [&[Kind]; 3] = [
    &[
        (CronJob::API_VERSION, CronJob::KIND),
        (Service::API_VERSION, Service::KIND),
        (EndpointSlice::API_VERSION, EndpointSlice::KIND),
    ],
    &[(StatefulSet::API_VERSION, StatefulSet::KIND)],
    &[(Secret::API_VERSION, Secret::KIND)],
];

/// The next wave: the first one with an observed child left, or done.
pub fn next_wave(ctx: &Context) -> Finalized {
    for kinds in WAVES {
        let mut wave = Finalized::wave();
        for &(api_version, kind) in kinds {
            let mut names: Vec<&str> = ctx
                .raw_children(api_version, kind)
                .filter_map(|c| c.pointer("/metadata/name").and_then(Value::as_str))
                .collect();
            names.sort_unstable();
            for name in names {
                wave = wave.delete_raw(api_version, kind, name);
            }
        }
        if !wave.deletes().is_empty() {
            return wave;
        }
    }
    Finalized::done()
}
