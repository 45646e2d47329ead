//! The registry's tests: loading, claims, shadows, canary staging and releases, with
//! a fake API server and the test plugins.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::contract::KindRef;
use crate::operator::fake_api;
use crate::operator::finalizers::ForceRelease;
use crate::operator::leader::WriteFence;
use crate::plugin::SandboxConfig;
use serde_json::json;

/// A registry of `dir` against an API server that knows nothing (the controllers'
/// watches fail and retry; nothing here needs them).
fn registry(dir: &Path, metrics: Arc<Metrics>, sandbox: Sandbox) -> PluginRegistry {
    let (client, _) = fake_api::client(|_| fake_api::status(404, "NotFound", "none"));
    registry_of(client, dir, metrics, sandbox)
}

/// [`registry`] against the API server of `client`.
fn registry_of(
    client: kube::Client,
    dir: &Path,
    metrics: Arc<Metrics>,
    sandbox: Sandbox,
) -> PluginRegistry {
    PluginRegistry::new(
        client,
        sandbox,
        metrics,
        RegistryOptions {
            dir: dir.to_path_buf(),
            poll_interval: Duration::from_secs(1),
            install_crds: false,
            controller: ControllerOptions {
                identities: None,
                namespace: Some("ns".into()),
                default_resync: Duration::from_secs(300),
                concurrency: 1,
                fence: WriteFence::default(),
                shard: None,
                force_release: ForceRelease::default(),
                instance: None,
            },
            pending_releases: PendingReleases::default(),
            webhooks: None,
            canary: None,
            source: PluginSource::files_only(),
        },
    )
}

/// Copies `plugin` into `dir` as `name`, old enough to load at the first scan.
fn install(dir: &Path, name: &str, plugin: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::copy(crate::fixtures::test_plugin(plugin), &path).unwrap();
    dated(&path, 60);
    path
}

/// Writes `bytes` to `dir/name`, old enough to load at the first scan (a loader in the
/// test makes the plugin of them).
fn write_old(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    dated(&path, 60);
    path
}

/// Sets the modification time of `path` to `age` seconds ago.
fn dated(path: &Path, age: u64) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(age))
        .unwrap();
}

/// A fake API server holding one Guard `g` in `ns` with the host's finalizer: it lists
/// it, and takes merge patches of its finalizers.
fn guard_server() -> (kube::Client, fake_api::Calls) {
    let guard = json!({
        "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
        "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "resourceVersion": "2",
                     "finalizers": [crate::operator::finalizers::FINALIZER]},
    });
    fake_api::client(
        move |call: &fake_api::Call| match (&call.method, call.path.as_str()) {
            (&http::Method::GET, "/apis/test.capstan.dev/v1/namespaces/ns/guards") => (
                200,
                json!({"apiVersion": "test.capstan.dev/v1", "kind": "GuardList",
                       "metadata": {"resourceVersion": "2"}, "items": [guard.clone()]}),
            ),
            (&http::Method::PATCH, "/apis/test.capstan.dev/v1/namespaces/ns/guards/g") => {
                let mut written = guard.clone();
                written["metadata"]["finalizers"] = call.body["metadata"]["finalizers"].clone();
                (200, written)
            }
            _ => fake_api::status(404, "NotFound", "none"),
        },
    )
}

/// Whether `file` serves, and its last error, as `/plugins` says.
fn state(metrics: &Metrics, file: &Path) -> (bool, Option<String>) {
    let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    plugins
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["file"] == file.display().to_string())
        .map_or((false, None), |p| {
            (p["serving"] == true, p["error"].as_str().map(String::from))
        })
}

/// A loader that compiles `slow` only once `first` serves (or gives up after a
/// minute: then `waited` stays false), and every other file at once.
fn held_back(
    sandbox: Sandbox,
    metrics: Arc<Metrics>,
    slow: PathBuf,
    first: PathBuf,
    waited: Arc<AtomicBool>,
) -> Loader {
    Arc::new(move |bytes: &[u8], path: &Path| {
        if path == slow {
            let until = Instant::now() + Duration::from_secs(60);
            while Instant::now() < until {
                if state(&metrics, &first).0 {
                    waited.store(true, Ordering::SeqCst);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        sandbox.load_bytes_blocking(bytes, path)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_compile_does_not_hold_back_another_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let slow = install(dir.path(), "a-slow.wasm", "guard");
    let fast = install(dir.path(), "b-fast.wasm", "widget");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let waited = Arc::new(AtomicBool::new(false));
    let load = held_back(
        sandbox.clone(),
        metrics.clone(),
        slow.clone(),
        fast.clone(),
        waited.clone(),
    );
    let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
    registry.scan().await;
    assert!(
        waited.load(Ordering::SeqCst),
        "b-fast served while a-slow was still compiling"
    );
    assert_eq!(state(&metrics, &slow), (true, None));
    assert_eq!(state(&metrics, &fast), (true, None));
    registry.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_file_is_the_shadow_of_its_namesake_not_a_second_claimant() {
    let dir = tempfile::tempdir().unwrap();
    let serving = install(dir.path(), "widget.wasm", "widget");
    let next = install(dir.path(), "widget.next.wasm", "widget");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut registry = registry(dir.path(), metrics.clone(), sandbox);
    registry.scan().await;
    assert_eq!(state(&metrics, &serving), (true, None));
    let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    assert_eq!(
        plugins.as_array().unwrap().len(),
        1,
        "the shadow is no plugin file of its own: {plugins}"
    );
    assert_eq!(
        plugins[0]["shadow"]["file"],
        next.display().to_string(),
        "{plugins}"
    );
    let slot = registry.staging.slot(&serving);
    assert!(slot.get().is_some(), "its controller calls it");
    // Removed: the slot empties and /plugins no longer lists it.
    std::fs::remove_file(&next).unwrap();
    registry.scan().await;
    assert!(slot.get().is_none());
    let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    assert!(plugins[0].get("shadow").is_none(), "{plugins}");
    registry.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_canary_a_next_file_is_a_candidate_and_a_new_one_starts_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let serving = install(dir.path(), "widget.wasm", "widget");
    let next = install(dir.path(), "widget.next.wasm", "widget-broken");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let registry = registry(dir.path(), metrics.clone(), sandbox);
    let policy = CanaryPolicy::new(vec![10, 100], Duration::from_secs(60), 5.0, 1).unwrap();
    let mut registry = registry.with_canary(policy);
    registry.scan().await;
    let slot = registry.staging.slot(&serving);
    let (_, canary) = slot.canary().expect("a candidate, with its canary");
    assert_eq!(canary.percent(), 10);
    let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    assert_eq!(plugins[0]["canary"]["phase"], "stepping", "{plugins}");
    assert_eq!(plugins[0]["canary"]["file"], next.display().to_string());
    // Rolled back; a new file is a new candidate, from its first step.
    canary.record(
        crate::operator::rollout::canary::Version::Candidate,
        "u",
        Some("x"),
    );
    assert_eq!(canary.percent(), 0);
    install(dir.path(), "widget.next.wasm", "widget");
    registry.scan().await;
    let (_, fresh) = slot.canary().unwrap();
    assert_ne!(fresh.sha256(), canary.sha256());
    assert_eq!(fresh.percent(), 10);
    // Removed: no candidate, nothing in /plugins.
    std::fs::remove_file(&next).unwrap();
    registry.scan().await;
    assert!(slot.canary().is_none());
    let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    assert!(plugins[0].get("canary").is_none(), "{plugins}");
    registry.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_file_by_name_wins_a_kind_even_when_it_compiles_last() {
    let dir = tempfile::tempdir().unwrap();
    let first = install(dir.path(), "a-widget.wasm", "widget");
    let second = install(dir.path(), "b-widget.wasm", "widget");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let waited = Arc::new(AtomicBool::new(false));
    let load = held_back(
        sandbox.clone(),
        metrics.clone(),
        first.clone(),
        second.clone(),
        waited.clone(),
    );
    let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
    registry.scan().await;
    assert!(waited.load(Ordering::SeqCst), "b-widget was serving first");
    assert_eq!(state(&metrics, &first), (true, None));
    let (serving, error) = state(&metrics, &second);
    assert!(!serving, "the later file gives the kind up");
    assert!(
        error.is_some_and(|e| e.contains("keeping") && e.contains("a-widget.wasm, refusing")),
        "and says why"
    );
    registry.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_version_of_another_kind_releases_the_finalizers_of_the_old_kind() {
    let (client, calls) = guard_server();
    let dir = tempfile::tempdir().unwrap();
    let file = install(dir.path(), "p.wasm", "guard");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let registry = registry(dir.path(), metrics.clone(), sandbox);
    let mut registry = registry.with_client(client);
    registry.scan().await;
    assert_eq!(state(&metrics, &file), (true, None));
    // The same file, now the widget plugin: it reconciles Widgets, no Guard any more.
    std::fs::remove_file(&file).unwrap();
    install(dir.path(), "p.wasm", "widget");
    registry.scan().await;
    let released = |calls: &fake_api::Calls| {
        calls.all().iter().any(|c| {
            c.method == http::Method::PATCH
                && c.path.ends_with("/guards/g")
                && c.body["metadata"]["finalizers"] == json!([])
        })
    };
    let until = Instant::now() + Duration::from_secs(30);
    while !(released(&calls) && metrics.orphaned_finalizers("Guard.test.capstan.dev") == Some(0))
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(released(&calls), "the Guard's finalizer is released");
    assert_eq!(
        metrics.orphaned_finalizers("Guard.test.capstan.dev"),
        Some(0)
    );
    registry.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_registry_resumes_the_releases_an_earlier_one_left_undone() {
    let (client, calls) = guard_server();
    let dir = tempfile::tempdir().unwrap();
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let registry = registry(dir.path(), metrics.clone(), sandbox);
    let registry = registry.with_client(client);
    // What a registry stopped for a change of buckets left undone.
    let guard_kind = KindRef {
        group: "test.capstan.dev".into(),
        version: "v1".into(),
        kind: "Guard".into(),
        plural: "guards".into(),
        namespaced: true,
    };
    let pending = registry.opts.pending_releases.clone();
    pending.insert(&guard_kind, "guard");
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let running = tokio::spawn(registry.run_until(stopped));
    let until = Instant::now() + Duration::from_secs(30);
    while !pending.all().is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    running.await.unwrap();
    assert!(pending.all().is_empty(), "the release was resumed and done");
    assert!(
        calls
            .all()
            .iter()
            .any(|c| c.method == http::Method::PATCH
                && c.body["metadata"]["finalizers"] == json!([])),
        "the Guard's finalizer is released"
    );
}

/// A plugin, natively, that declares what a hostile plugin would: a parent kind built
/// into Kubernetes (`Lease`), whose writes it validates and refuses
/// (`validates(Fail)`).
struct LeaseGuard;

impl crate::plugin::Native for LeaseGuard {
    fn describe(&self) -> crate::contract::PluginInfo {
        crate::contract::PluginInfo {
            name: "lease-guard".into(),
            version: "0.1.0".into(),
            parent: KindRef::namespaced("coordination.k8s.io", "v1", "Lease", "leases"),
            children: vec![KindRef::namespaced("", "v1", "ConfigMap", "configmaps")],
            finalizer: true,
            validation: Some(crate::contract::FailurePolicy::Fail),
            contract: "0.2.0".into(),
            ..Default::default()
        }
    }

    fn reconcile(
        &self,
        _: &crate::contract::Observed,
    ) -> std::result::Result<crate::contract::Desired, crate::contract::PluginError> {
        Ok(crate::contract::Desired {
            children: Vec::new(),
            status: None,
            conditions: Vec::new(),
            events: Vec::new(),
            requeue_after_seconds: None,
        })
    }

    fn validate(
        &self,
        _: Option<&serde_json::Value>,
        _: &serde_json::Value,
    ) -> std::result::Result<Vec<String>, String> {
        Err("every Lease write is refused".into())
    }
}

/// A loader that gives the native [`LeaseGuard`] for any file.
fn lease_guard() -> Loader {
    Arc::new(|_: &[u8], _: &Path| Ok(crate::plugin::Plugin::native(LeaseGuard)))
}

/// Writes the limits file of `plugin` (its `[grant]` included), with a time that moves
/// (a second file written within one mtime tick is still seen as a change).
fn write_limits(plugin: &Path, text: &str, age: u64) {
    let file = crate::plugin::limits::file_of(plugin);
    std::fs::write(&file, text).unwrap();
    dated(&file, age);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_of_a_built_in_kind_is_refused_at_load_until_granted() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_old(dir.path(), "lease-guard.wasm", b"a plugin");
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(lease_guard());
    registry.scan().await;
    let (serving, error) = state(&metrics, &file);
    assert!(!serving, "a plugin of Leases serves without a grant");
    let error = error.expect("the refusal is shown in /plugins");
    assert!(
        error.contains("parent kind Lease.coordination.k8s.io/v1 is built into Kubernetes")
            && error.contains("parents = [\"Lease.coordination.k8s.io\"]")
            && !error.contains('\n'),
        "{error}"
    );

    // Granting the kind alone leaves its Fail webhook refused.
    write_limits(
        &file,
        "[grant]\nparents = [\"Lease.coordination.k8s.io\"]\n",
        50,
    );
    registry.scan().await;
    let (serving, error) = state(&metrics, &file);
    assert!(!serving);
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("admission = true")),
        "{error:?}"
    );

    // Granted both, it serves (this registry has no webhook: the plugin is served and
    // its changes are checked by reconcile only).
    write_limits(
        &file,
        "[grant]\nparents = [\"Lease.coordination.k8s.io\"]\nadmission = true\n",
        40,
    );
    registry.scan().await;
    assert_eq!(state(&metrics, &file), (true, None));

    // The grant taken back: the plugin stops serving.
    write_limits(&file, "timeout-ms = 500\n", 30);
    registry.scan().await;
    let (serving, error) = state(&metrics, &file);
    assert!(!serving, "the plugin serves after its grant was taken back");
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("built into Kubernetes")),
        "{error:?}"
    );
    registry.shutdown().await;
}

/// A well-behaved native plugin of a custom kind.
struct Custom;

impl crate::plugin::Native for Custom {
    fn describe(&self) -> crate::contract::PluginInfo {
        crate::contract::PluginInfo {
            name: "lease-guard".into(),
            version: "0.1.0".into(),
            parent: KindRef::namespaced("example.com", "v1", "App", "apps"),
            children: vec![KindRef::namespaced("", "v1", "ConfigMap", "configmaps")],
            contract: "0.2.0".into(),
            ..Default::default()
        }
    }

    fn reconcile(
        &self,
        _: &crate::contract::Observed,
    ) -> std::result::Result<crate::contract::Desired, crate::contract::PluginError> {
        LeaseGuard.reconcile(&crate::contract::Observed {
            parent: json!({}),
            children: vec![],
            related: vec![],
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_version_beyond_the_serving_files_grant_is_not_shadowed() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["app.wasm", "app.next.wasm"] {
        write_old(dir.path(), name, name.as_bytes());
    }
    // The serving version reconciles a custom kind; its next version, Leases.
    let load: Loader = Arc::new(|bytes: &[u8], _: &Path| {
        Ok(match bytes {
            b"app.wasm" => crate::plugin::Plugin::native(Custom),
            _ => crate::plugin::Plugin::native(LeaseGuard),
        })
    });
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
    registry.scan().await;
    let serving = dir.path().join("app.wasm");
    assert_eq!(state(&metrics, &serving), (true, None));
    assert!(
        registry.staging.slot(&serving).get().is_none(),
        "a next version of a built-in kind shadows a plugin granted nothing"
    );
    registry.shutdown().await;
}

/// A plugin of a custom kind that reads Secrets, which its grant does not allow.
struct SecretReader;

impl crate::plugin::Native for SecretReader {
    fn describe(&self) -> crate::contract::PluginInfo {
        crate::contract::PluginInfo {
            related: vec![KindRef::namespaced("", "v1", "Secret", "secrets")],
            ..Custom.describe()
        }
    }

    fn reconcile(
        &self,
        observed: &crate::contract::Observed,
    ) -> std::result::Result<crate::contract::Desired, crate::contract::PluginError> {
        Custom.reconcile(observed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parents_of_a_refused_plugins_kind_are_told_why_and_built_in_objects_never() {
    let dir = tempfile::tempdir().unwrap();
    let app = write_old(dir.path(), "app.wasm", b"app");
    write_old(dir.path(), "lease-guard.wasm", b"lease-guard");
    let (client, calls) = fake_api::client(|call: &fake_api::Call| {
        match (call.method.as_str(), call.path.as_str()) {
            ("GET", "/apis/example.com/v1/namespaces/ns/apps") => (
                200,
                json!({"apiVersion": "example.com/v1", "kind": "AppList",
                       "metadata": {"resourceVersion": "5"},
                       "items": [{"apiVersion": "example.com/v1", "kind": "App",
                                  "metadata": {"name": "a", "namespace": "ns", "uid": "uid-a",
                                               "resourceVersion": "4"}}]}),
            ),
            ("PATCH", _) | ("POST", _) => (201, call.body.clone()),
            _ => fake_api::status(404, "NotFound", "none"),
        }
    });
    let load: Loader = Arc::new(|bytes: &[u8], _: &Path| {
        Ok(match bytes {
            b"app" => crate::plugin::Plugin::native(SecretReader),
            _ => crate::plugin::Plugin::native(LeaseGuard),
        })
    });
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut registry = registry_of(client, dir.path(), metrics.clone(), sandbox).with_loader(load);
    registry.scan().await;
    let (serving, refusal) = state(&metrics, &app);
    assert!(!serving);
    let refusal = refusal.expect("refused");
    let status = "/apis/example.com/v1/namespaces/ns/apps/a/status";
    let told = wait_until(Duration::from_secs(10), || {
        calls
            .all()
            .into_iter()
            .find(|c| c.method == "PATCH" && c.path == status)
    })
    .await
    .expect("the parent is told");
    let ready = told.ready_condition().expect("a Ready condition");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "PluginRefused");
    assert_eq!(
        ready["message"],
        refusal.as_str(),
        "the line /plugins shows"
    );
    assert!(
        wait_until(Duration::from_secs(10), || calls.all().into_iter().find(
            |c| c.method == "POST"
                && c.path.ends_with("/events")
                && c.body["reason"] == "PluginRefused"
        ))
        .await
        .is_some(),
        "and a Warning event: {:?}",
        calls.summary()
    );
    // The refused Lease plugin's kind is built in: nothing is read or written of it.
    assert!(
        calls.all().iter().all(|c| !c.path.contains("leases")),
        "{:?}",
        calls.summary()
    );
    registry.shutdown().await;
}

/// Polls `check` until it gives a value, for at most `within`.
async fn wait_until<T>(within: Duration, check: impl Fn() -> Option<T>) -> Option<T> {
    let until = Instant::now() + within;
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if Instant::now() > until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_secret_labels_in_the_grant_start_the_plugins_watches_again() {
    let dir = tempfile::tempdir().unwrap();
    let app = write_old(dir.path(), "app.wasm", b"app");
    write_limits(&app, "[grant.secrets]\nlabels = { team = \"a\" }\n", 50);
    let load: Loader =
        Arc::new(|_: &[u8], _: &Path| Ok(crate::plugin::Plugin::native(SecretReader)));
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
    registry.scan().await;
    assert_eq!(state(&metrics, &app), (true, None));
    assert_eq!(registry.caches.related.watched(), ["v1/Secret {team=a}"]);
    write_limits(&app, "[grant.secrets]\nlabels = { team = \"b\" }\n", 40);
    registry.scan().await;
    assert_eq!(state(&metrics, &app), (true, None));
    assert_eq!(
        registry.caches.related.watched(),
        ["v1/Secret {team=b}"],
        "the API server is asked for the newly granted Secrets only"
    );
    registry.shutdown().await;
}
