//! Helpers shared by the end-to-end tests: a client for the local control plane, a
//! temporary namespace per test, polling with a timeout, and the `capstan` operator
//! process under test.
//!
//! The tests need a real cluster: `cargo xtask test` starts one and sets `KUBECONFIG`.
//! Without it they fail with a message saying so; they never skip.

pub mod control_plane;
pub mod fleet;
pub mod node;
pub mod objects;
pub mod operator;
pub mod registry;

use std::future::Future;
use std::hash::BuildHasher as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};

/// A client for the cluster the test command started (`KUBECONFIG`).
pub async fn client() -> Client {
    let Some(path) = std::env::var_os("KUBECONFIG") else {
        panic!(
            "no cluster: KUBECONFIG is not set. Run the end-to-end tests with `cargo xtask test`, which starts a local control plane"
        );
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read KUBECONFIG {}: {e}",
            std::path::Path::new(&path).display()
        )
    });
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("usable kubeconfig");
    let client = Client::try_from(config).expect("client");
    client.apiserver_version().await.unwrap_or_else(|e| {
        panic!("no cluster: the API server in KUBECONFIG does not answer: {e}")
    });
    client
}

/// A namespace that lives as long as the test; deleted (in the background) on drop.
pub struct TestNamespace {
    /// Its name.
    pub name: String,
    client: Client,
}

/// The label of kwok's fake nodes, which a kwok namespace's node selector names.
pub const KWOK_NODE_LABEL: &str = "type=kwok";

/// A namespace named `name` whose Pods all go to kwok's fake nodes, where nothing runs:
/// the PodNodeSelector admission plugin gives each of its Pods the node selector
/// `type=kwok`, and PodTolerationRestriction the toleration of the taint kwok's nodes
/// carry beside a real node (`kwok.x-k8s.io/node=fake:NoSchedule`).
///
/// For tests whose Pods must not run for real (images that do not exist here, hundreds
/// of replicas); on a cluster without a real node it changes nothing.
pub fn kwok_namespace(name: &str) -> Namespace {
    serde_json::from_value(serde_json::json!({"metadata": {
        "name": name,
        "annotations": {
            "scheduler.alpha.kubernetes.io/node-selector": KWOK_NODE_LABEL,
            "scheduler.alpha.kubernetes.io/defaultTolerations":
                r#"[{"key":"kwok.x-k8s.io/node","operator":"Equal","value":"fake","effect":"NoSchedule"}]"#,
        },
    }}))
    .expect("a valid Namespace")
}

impl TestNamespace {
    /// Creates `<prefix>-<random>`, whose Pods go wherever the scheduler puts them (the
    /// real node, when the cluster has one).
    pub async fn new(client: &Client, prefix: &str) -> Self {
        let name = random_name(prefix);
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Self::create(client, name, ns).await
    }

    /// Creates `<prefix>-<random>` as a [`kwok_namespace`]: its Pods never run.
    pub async fn kwok(client: &Client, prefix: &str) -> Self {
        let name = random_name(prefix);
        let ns = kwok_namespace(&name);
        Self::create(client, name, ns).await
    }

    async fn create(client: &Client, name: String, ns: Namespace) -> Self {
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        TestNamespace {
            name,
            client: client.clone(),
        }
    }
}

fn random_name(prefix: &str) -> String {
    let suffix = format!(
        "{:x}",
        std::collections::hash_map::RandomState::new().hash_one(Instant::now()) % 0xffffff
    );
    format!("{prefix}-{suffix}")
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let api = Api::<Namespace>::all(self.client.clone());
        let name = self.name.clone();
        // Best effort, without blocking the runtime the test is dropped in.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = api.delete(&name, &DeleteParams::background()).await;
            });
        }
    }
}

/// Polls `check` every 200 ms until it returns `Some`, or fails after `timeout` with
/// `what` and the last error seen.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let start = Instant::now();
    let mut last = String::from("condition not met");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks that `check` keeps returning true for the whole of `period` (for "nothing
/// happens" assertions, which are only meaningful over a span of time).
pub async fn holds_for<F, Fut>(what: &str, period: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let start = Instant::now();
    while start.elapsed() < period {
        if !check().await.with_context(|| what.to_string())? {
            bail!("{what} stopped holding after {:?}", start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

// Helpers for the control-plane smoke tests (tests/smoke.rs), usable by any test.

impl TestNamespace {
    /// Deletes the namespace and waits until the namespace controller has removed it
    /// with everything in it (unlike the best-effort delete on drop, which a test's
    /// runtime may cancel when the test returns).
    pub async fn delete(self, timeout: Duration) -> Result<()> {
        let api = Api::<Namespace>::all(self.client.clone());
        match api.delete(&self.name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("delete namespace {}", self.name)),
        }
        let what = format!("namespace {} to be gone", self.name);
        wait_for(&what, timeout, || async {
            match api.get_opt(&self.name).await? {
                Some(_) => Ok(None),
                None => Ok(Some(())),
            }
        })
        .await
    }
}

/// Runs `test` with a client and a fresh namespace named `<prefix>-<random>`, then
/// deletes the namespace (waiting up to `cleanup` for it to be gone) whether the test
/// passed or not. The test's own error wins over a cleanup error.
pub async fn in_test_namespace<T>(
    prefix: &str,
    cleanup: Duration,
    test: impl AsyncFnOnce(Client, String) -> Result<T>,
) -> Result<T> {
    let client = client().await;
    let namespace = TestNamespace::new(&client, prefix).await;
    run_then_delete(client, namespace, cleanup, test).await
}

/// The one namespace whose reads (get, list, watch), not only writes, the local
/// cluster's audit log records (the policy in `xtask/src/cluster/components.rs`).
pub const AUDIT_READS_NAMESPACE: &str = "capstan-audit-reads";

/// [`in_test_namespace`] in [`AUDIT_READS_NAMESPACE`], made anew (one test at a time
/// may use it: a leftover of an earlier run is deleted first).
pub async fn in_audited_namespace<T>(
    cleanup: Duration,
    test: impl AsyncFnOnce(Client, String) -> Result<T>,
) -> Result<T> {
    let client = client().await;
    let api = Api::<Namespace>::all(client.clone());
    if api.get_opt(AUDIT_READS_NAMESPACE).await?.is_some() {
        TestNamespace {
            name: AUDIT_READS_NAMESPACE.into(),
            client: client.clone(),
        }
        .delete(cleanup)
        .await?;
    }
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": AUDIT_READS_NAMESPACE}}))?;
    let namespace = TestNamespace::create(&client, AUDIT_READS_NAMESPACE.into(), ns).await;
    run_then_delete(client, namespace, cleanup, test).await
}

/// [`in_test_namespace`] with a [`kwok_namespace`]: the test's Pods never run.
pub async fn in_kwok_namespace<T>(
    prefix: &str,
    cleanup: Duration,
    test: impl AsyncFnOnce(Client, String) -> Result<T>,
) -> Result<T> {
    let client = client().await;
    let namespace = TestNamespace::kwok(&client, prefix).await;
    run_then_delete(client, namespace, cleanup, test).await
}

async fn run_then_delete<T>(
    client: Client,
    namespace: TestNamespace,
    cleanup: Duration,
    test: impl AsyncFnOnce(Client, String) -> Result<T>,
) -> Result<T> {
    let outcome = test(client, namespace.name.clone()).await;
    let deleted = namespace.delete(cleanup).await;
    let value = outcome?;
    deleted?;
    Ok(value)
}

/// A client for the same cluster as [`client`], authenticated only by `token` (e.g. a
/// ServiceAccount token from the TokenRequest API) instead of the admin certificate.
pub async fn client_with_token(token: &str) -> Result<Client> {
    let mut config = kube::Config::infer().await.context("read KUBECONFIG")?;
    // Replacing auth_info drops the admin client certificate along with everything else.
    config.auth_info = serde_json::from_value(serde_json::json!({ "token": token }))?;
    Client::try_from(config).context("build a token client")
}

/// Whether `err` is the API server's 403 Forbidden.
pub fn is_forbidden(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.is_forbidden())
}

/// Whether `err` is the API server's 404 Not Found.
pub fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.is_not_found())
}

/// A short-lived token for `service_account` in `ns`, from the TokenRequest API.
pub async fn service_account_token(
    client: &Client,
    ns: &str,
    service_account: &str,
) -> Result<String> {
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(serde_json::json!({"spec": {"expirationSeconds": 3600}}))?;
    let response =
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), ns)
            .create_token_request(service_account, &PostParams::default(), &request)
            .await
            .context("TokenRequest")?;
    response
        .status
        .and_then(|s| s.token)
        .context("TokenRequest without a token")
}
