//! A native kube-rs Uuid controller: the baseline `cargo xtask bench` compares Capstan
//! with. It does exactly what Capstan does for a Uuid, without the sandbox: the same
//! parent watch (managedFields dropped, spec or deletion changes only), the same
//! concurrency, the UUID generated only when absent, and the same status written through
//! `/status` with server-side apply, its own field manager and the resourceVersion
//! precondition, skipped when unchanged.

use std::hash::{BuildHasher, DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use capstan_bench::native::{self, FIELD_MANAGER};
use clap::Parser;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Serve Uuids (demo.operator/v1) natively, as Capstan's Uuid plugin does.
#[derive(Debug, Parser)]
struct Args {
    /// Watch only this namespace.
    #[arg(long, short = 'n')]
    namespace: String,
    /// Parents reconciled at once (Capstan's `--concurrency`).
    #[arg(long, default_value_t = 4)]
    concurrency: u16,
    /// Reconcile unchanged parents this often, in seconds (Capstan's default).
    #[arg(long, default_value_t = 300)]
    resync_seconds: u64,
}

/// Why a reconcile did not complete.
#[derive(Debug, thiserror::Error)]
enum Error {
    /// The API server refused or failed the status write.
    #[error("write status: {0}")]
    Api(#[source] kube::Error),
    /// No secure random numbers for the UUID.
    #[error("random source: {0}")]
    Random(getrandom::Error),
}

struct Context {
    client: Client,
    resource: ApiResource,
    resync: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = Client::try_default()
        .await
        .context("a client from KUBECONFIG")?;
    let resource = capstan_bench::objects::uuid_kind();
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &args.namespace, &resource);
    let writer = Writer::new(resource.clone());
    let reader = writer.as_reader();
    let parents = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear()),
    )
    .applied_objects()
    .predicate_filter(spec_or_deletion, PredicateConfig::default());
    let ctx = Arc::new(Context {
        client,
        resource: resource.clone(),
        resync: Duration::from_secs(args.resync_seconds),
    });
    Controller::for_stream_with(parents, reader, resource)
        .with_config(ControllerConfig::default().concurrency(args.concurrency))
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
    Ok(())
}

async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    if obj.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // Capstan hands the parent to the plugin as JSON; so does this.
    let parent = serde_json::to_value(&*obj).expect("an object serializes");
    let mut random = None;
    let status = native::uuid_status(
        &parent,
        || match native::uuid_v4() {
            Ok(u) => u,
            Err(e) => {
                random = Some(e);
                String::new()
            }
        },
        &native::now(),
    );
    if let Some(e) = random {
        return Err(Error::Random(e));
    }
    if obj.data.get("status") != Some(&status) {
        let patch = json!({
            "apiVersion": ctx.resource.api_version,
            "kind": ctx.resource.kind,
            "metadata": {"name": obj.name_any(), "resourceVersion": obj.metadata.resource_version},
            "status": status,
        });
        let api = Api::<DynamicObject>::namespaced_with(
            ctx.client.clone(),
            obj.namespace().as_deref().unwrap_or_default(),
            &ctx.resource,
        );
        match api
            .patch_status(
                &obj.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {}
            // The cache was behind (Capstan: retry after about 0.5 s).
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Ok(Action::requeue(jittered(Duration::from_millis(500), 0.5)));
            }
            Err(e) => return Err(Error::Api(e)),
        }
    }
    Ok(Action::requeue(jittered(ctx.resync.mul_f64(0.9), 0.2)))
}

fn error_policy(_obj: Arc<DynamicObject>, err: &Error, _ctx: Arc<Context>) -> Action {
    eprintln!("native-uuid: {err}");
    Action::requeue(Duration::from_secs(1))
}

/// `d` stretched by a random fraction of up to `spread`.
fn jittered(d: Duration, spread: f64) -> Duration {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    d.mul_f64(1.0 + spread * (bits >> 11) as f64 / (1u64 << 53) as f64)
}

/// Capstan's predicate: a new object, a new generation or the start of deletion.
fn spec_or_deletion(obj: &DynamicObject) -> Option<u64> {
    let mut h = DefaultHasher::new();
    obj.metadata.uid.hash(&mut h);
    obj.metadata.generation.hash(&mut h);
    obj.metadata.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}
