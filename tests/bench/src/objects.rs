//! The benchmark's objects in the cluster: CRDs, one namespace per measurement, parents
//! created with concurrency, and a watch that counts the parents that converged.

use std::collections::HashSet;
use std::hash::BuildHasher as _;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{Error, Result};

/// Parents created at once: enough to keep the API server busy, not so many that
/// creation itself times out.
const CREATE_CONCURRENCY: usize = 32;

/// The Uuid kind (demo.operator/v1), as the end-to-end tests name it.
pub use capstan_e2e::objects::uuid_kind;

/// The Widget test kind (test.capstan.dev/v1).
pub fn widget_kind() -> ApiResource {
    capstan_e2e::objects::test_kind("Widget", "widgets")
}

/// Installs the CRD of each plugin (as `capstan crd` prints it) with the host's own
/// field manager, and waits until each is established: the parents are created before
/// the operator under test starts.
///
/// The CRD goes in without its `spec.conversion`: the bench creates no parent of a
/// converting kind, and the host it starts points the webhook at itself. The stanza
/// `capstan crd` prints names the in-cluster Service, and an earlier test's host may
/// have left the live CRD on its URL; the API server refuses a webhook with both
/// ("exactly one of url or service is required"), which once failed CI here.
pub async fn install_crds(client: &Client, capstan: &Path, plugins: &[&Path]) -> Result<()> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for plugin in plugins {
        let out = std::process::Command::new(capstan)
            .arg("crd")
            .arg(plugin)
            .output()
            .map_err(|e| Error::Setup(format!("run {} crd: {e}", capstan.display())))?;
        if !out.status.success() {
            return Err(Error::Setup(format!(
                "capstan crd {}: {}",
                plugin.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let mut crd: CustomResourceDefinition = serde_yaml_ng::from_slice(&out.stdout)
            .map_err(|e| Error::Setup(format!("the CRD of {}: {e}", plugin.display())))?;
        crd.spec.conversion = None;
        let name = crd.name_any();
        api.patch(
            &name,
            &PatchParams::apply("capstan").force(),
            &Patch::Apply(&crd),
        )
        .await
        .map_err(|e| Error::api(format!("apply CRD {name}"), e))?;
        let established = |crd: &CustomResourceDefinition| {
            crd.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = api
                .get(&name)
                .await
                .map_err(|e| Error::api(format!("get CRD {name}"), e))?;
            if established(&now) {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Setup(format!("CRD {name} not established in 30 s")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Applies what `capstan rbac --plugins DIR --plugin-identities NAMESPACE` prints for
/// `plugins`, but the host's own ClusterRole (the benchmark's capstan runs as the
/// cluster's admin): each plugin's ServiceAccount in `namespace`, its ClusterRole and
/// binding. Returns the ClusterRoles and bindings made, to delete them with
/// [`delete_cluster_rbac`].
pub async fn apply_plugin_identities(
    client: &Client,
    capstan: &Path,
    plugins: &Path,
    namespace: &str,
) -> Result<Vec<String>> {
    let out = std::process::Command::new(capstan)
        .arg("rbac")
        .arg("--plugins")
        .arg(plugins)
        .args(["--plugin-identities", namespace])
        .output()
        .map_err(|e| Error::Setup(format!("run {} rbac: {e}", capstan.display())))?;
    if !out.status.success() {
        return Err(Error::Setup(format!(
            "capstan rbac: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let objects: Vec<Value> = serde_yaml_ng::Deserializer::from_slice(&out.stdout)
        .map(serde::Deserialize::deserialize)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Setup(format!("what capstan rbac printed: {e}")))?;
    let mut cluster_scoped = Vec::new();
    for object in objects.iter().skip(1) {
        let (group, version) = match object["apiVersion"].as_str().unwrap_or_default() {
            v if v.contains('/') => v.split_once('/').unwrap(),
            v => ("", v),
        };
        let kind = object["kind"].as_str().unwrap_or_default();
        let plural = match kind {
            "ServiceAccount" => "serviceaccounts",
            "Role" => "roles",
            "RoleBinding" => "rolebindings",
            "ClusterRole" => "clusterroles",
            "ClusterRoleBinding" => "clusterrolebindings",
            other => return Err(Error::Setup(format!("capstan rbac printed a {other}"))),
        };
        let ar = ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: object["apiVersion"].as_str().unwrap_or_default().into(),
            kind: kind.into(),
            plural: plural.into(),
        };
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => {
                cluster_scoped.push(format!("{plural}/{name}"));
                Api::all_with(client.clone(), &ar)
            }
        };
        api.patch(
            name,
            &PatchParams::apply("capstan-bench").force(),
            &Patch::Apply(object),
        )
        .await
        .map_err(|e| Error::api(format!("apply {kind} {name}"), e))?;
    }
    Ok(cluster_scoped)
}

/// Deletes the ClusterRoles and ClusterRoleBindings (`plural/name`) that
/// [`apply_plugin_identities`] made.
pub async fn delete_cluster_rbac(client: &Client, made: &[String]) {
    for entry in made {
        let Some((plural, name)) = entry.split_once('/') else {
            continue;
        };
        let kind = match plural {
            "clusterroles" => "ClusterRole",
            _ => "ClusterRoleBinding",
        };
        let ar = ApiResource {
            group: "rbac.authorization.k8s.io".into(),
            version: "v1".into(),
            api_version: "rbac.authorization.k8s.io/v1".into(),
            kind: kind.into(),
            plural: plural.into(),
        };
        let _ = Api::<DynamicObject>::all_with(client.clone(), &ar)
            .delete(name, &DeleteParams::default())
            .await;
    }
}

/// A namespace of one measurement.
pub struct BenchNamespace {
    /// Its name.
    pub name: String,
    client: Client,
}

impl BenchNamespace {
    /// Creates `bench-<what>-<random>`, whose Pods all go to kwok's fake nodes (its
    /// annotations give them the node selector `type=kwok` and the toleration of the
    /// taint kwok's nodes carry beside a real node; docs/control-plane.md): a benchmark's
    /// hundreds of Pods never run for real.
    pub async fn create(client: &Client, what: &str) -> Result<Self> {
        let suffix =
            std::collections::hash_map::RandomState::new().hash_one(Instant::now()) % 0xff_ffff;
        let name = format!("bench-{what}-{suffix:x}");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {
            "name": name,
            "annotations": {
                "scheduler.alpha.kubernetes.io/node-selector": "type=kwok",
                "scheduler.alpha.kubernetes.io/defaultTolerations":
                    r#"[{"key":"kwok.x-k8s.io/node","operator":"Equal","value":"fake","effect":"NoSchedule"}]"#,
            },
        }}))
        .expect("a valid namespace");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .map_err(|e| Error::api(format!("create namespace {name}"), e))?;
        Ok(BenchNamespace {
            name,
            client: client.clone(),
        })
    }

    /// An API of kind `ar` in the namespace.
    pub fn api(&self, ar: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.name, ar)
    }

    /// Deletes the namespace and waits (bounded) until it is gone, so that its objects
    /// do not weigh on the next measurement. Not being gone in time is not an error.
    pub async fn delete(self, timeout: Duration) -> Result<()> {
        let api = Api::<Namespace>::all(self.client.clone());
        match api.delete(&self.name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(Error::api(format!("delete namespace {}", self.name), e)),
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match api.get_opt(&self.name).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) | Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
        eprintln!(
            "bench: namespace {} still terminating after {timeout:?}; going on",
            self.name
        );
        Ok(())
    }
}

/// Creates parents `<prefix>-0` … `<prefix>-{n-1}` of kind `ar` with `spec`, many at a
/// time; returns how long that took.
pub async fn create_parents(
    api: &Api<DynamicObject>,
    ar: &ApiResource,
    prefix: &str,
    n: usize,
    spec: &Value,
) -> Result<Duration> {
    let started = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": ar.api_version, "kind": ar.kind,
                "metadata": {"name": format!("{prefix}-{i}")}, "spec": spec,
            }))
            .expect("a valid object");
            async move {
                api.create(&PostParams::default(), &obj)
                    .await
                    .map_err(|e| Error::api(format!("create {}", obj.name_any()), e))
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    Ok(started.elapsed())
}

/// A watch over the objects of one API, counting those that satisfy a predicate.
pub struct Converged {
    count: watch::Receiver<usize>,
    task: JoinHandle<()>,
}

impl Converged {
    /// Starts watching `api` and returns once the first list is in, so that a process
    /// started afterwards is timed from a known state.
    pub async fn watch(
        api: Api<DynamicObject>,
        done: impl Fn(&DynamicObject) -> bool + Send + 'static,
    ) -> Result<Self> {
        let (tx, mut count) = watch::channel(usize::MAX);
        let task = tokio::spawn(async move {
            let mut converged = HashSet::new();
            let mut listing = HashSet::new();
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Init) => listing.clear(),
                    Ok(watcher::Event::InitApply(o)) => {
                        if done(&o) {
                            listing.insert(o.name_any());
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        converged = std::mem::take(&mut listing);
                        tx.send_replace(converged.len());
                    }
                    Ok(watcher::Event::Apply(o)) => {
                        if done(&o) {
                            converged.insert(o.name_any());
                        } else {
                            converged.remove(&o.name_any());
                        }
                        tx.send_replace(converged.len());
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        converged.remove(&o.name_any());
                        tx.send_replace(converged.len());
                    }
                    Err(e) => {
                        eprintln!("bench: watch failed (retrying): {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
        count
            .wait_for(|n| *n != usize::MAX)
            .await
            .map_err(|_| Error::Setup("the watch ended before its first list".into()))?;
        Ok(Converged { count, task })
    }

    /// How many converged now.
    pub fn now(&self) -> usize {
        *self.count.borrow()
    }

    /// Waits until at least `n` converged; `alive` is asked every 100 ms and fails the
    /// wait (say, because the process under test exited). On a timeout, says how many
    /// made it.
    pub async fn wait_for(
        &mut self,
        n: usize,
        timeout: Duration,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let reached =
                tokio::time::timeout(Duration::from_millis(100), self.count.wait_for(|c| *c >= n))
                    .await
                    .map(|r| r.is_ok());
            match reached {
                Ok(true) => return Ok(()),
                Ok(false) => return Err(Error::Setup("the watch ended".into())),
                Err(_) => {}
            }
            alive()?;
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("{n} converged objects"),
                    after: timeout,
                    reached: self.now(),
                });
            }
        }
    }
}

impl Drop for Converged {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A Uuid has its UUID.
pub fn has_uuid(obj: &DynamicObject) -> bool {
    obj.data
        .pointer("/status/uuid")
        .and_then(Value::as_str)
        .is_some_and(|u| !u.is_empty())
}

/// A parent is Ready=True for its current generation.
pub fn is_ready(obj: &DynamicObject) -> bool {
    let generation = obj.metadata.generation;
    let observed = obj
        .data
        .pointer("/status/observedGeneration")
        .and_then(Value::as_i64);
    let ready = obj
        .data
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
    ready && observed == generation
}

/// A Widget is Ready and its plugin has seen all its ConfigMaps (a reconcile after they
/// were applied and reached the host's cache): the steady state.
pub fn widget_settled(obj: &DynamicObject) -> bool {
    let count = obj.data.pointer("/spec/count").and_then(Value::as_u64);
    let seen = obj
        .data
        .pointer("/status/observedConfigMaps")
        .and_then(Value::as_array)
        .map(|a| a.len() as u64);
    is_ready(obj) && count.is_some() && seen == count
}
