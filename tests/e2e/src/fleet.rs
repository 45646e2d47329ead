//! Many parents of the shipped and test kinds driven through faults (killed replicas,
//! API server restarts, shard moves): requests retried until the API server answers,
//! and a survey of what converged, shared by the fault and sharding suites.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::{Client, ResourceExt};

use crate::objects::{postgres_kind, ready_condition, test_kind, uuid_kind};

/// The label of the Widget test plugin's children.
pub const WIDGET_LABEL: &str = "capstan.dev/plugin=widget";

/// The Widget test kind.
pub fn widget_kind() -> ApiResource {
    test_kind("Widget", "widgets")
}

/// Runs `request` until it succeeds, for up to `timeout`: for requests made while the
/// API server restarts or sheds load. A create answered 409 counts as done: an earlier
/// attempt went through and only its answer was lost.
pub async fn retried<T, F, Fut>(what: &str, timeout: Duration, mut request: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match request().await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 && what.starts_with("create") => {
                return Ok(());
            }
            Err(e) if Instant::now() > deadline => return Err(e).context(what.to_string()),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// How many parents of each kind a namespace should hold, and how many children each
/// Widget makes.
#[derive(Debug, Clone, Copy)]
pub struct Fleet {
    /// Uuids.
    pub uuids: usize,
    /// Widgets.
    pub widgets: usize,
    /// PostgreSQLClusters (none: the kind is not listed, its CRD may be absent).
    pub postgres: usize,
    /// ConfigMaps per Widget, named `<widget>-<i>`.
    pub children: usize,
}

/// What a survey found.
#[derive(Debug, Default)]
pub struct Survey {
    /// Parents that converged.
    pub converged: usize,
    /// The parents that did not (and missing ones), by kind and name.
    pub not_converged: Vec<String>,
    /// Widget children beyond the wanted ones, or controlled by no Widget.
    pub duplicate_children: usize,
}

impl Survey {
    /// Every parent converged and no child is duplicated.
    pub fn converged(&self) -> bool {
        self.not_converged.is_empty() && self.duplicate_children == 0
    }

    /// One line: counts, and the first few parents that did not converge.
    pub fn summary(&self) -> String {
        let some: Vec<&String> = self.not_converged.iter().take(5).collect();
        format!(
            "{} parents converged, {} not (e.g. {some:?}), {} duplicate children",
            self.converged,
            self.not_converged.len(),
            self.duplicate_children
        )
    }
}

/// Converged: a Uuid has a UUID; a Widget is Ready for its generation and controls
/// exactly its `children` ConfigMaps, each with `message`; a PostgreSQLCluster is
/// Running. Fewer parents than `fleet` counts as not converged.
pub async fn survey(client: &Client, ns: &str, message: &str, fleet: &Fleet) -> Result<Survey> {
    let list = |ar: ApiResource| {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar);
        async move { Ok::<_, kube::Error>(api.list(&ListParams::default()).await?.items) }
    };
    let uuids = list(uuid_kind()).await?;
    let widgets = list(widget_kind()).await?;
    let pgs = if fleet.postgres > 0 {
        list(postgres_kind()).await?
    } else {
        Vec::new()
    };
    let cms = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(WIDGET_LABEL))
        .await?
        .items;
    let mut children: BTreeMap<String, Vec<&ConfigMap>> = BTreeMap::new();
    let mut orphans = 0;
    for cm in &cms {
        match cm
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true))
        {
            Some(owner) => children.entry(owner.uid.clone()).or_default().push(cm),
            None => orphans += 1,
        }
    }
    let status =
        |o: &DynamicObject, field: &str| o.data.pointer(&format!("/status/{field}")).cloned();
    let mut s = Survey::default();
    let mut verdict = |name: String, ok: bool| {
        if ok {
            s.converged += 1;
        } else {
            s.not_converged.push(name);
        }
    };
    for u in &uuids {
        let ok = status(u, "uuid").is_some_and(|v| v.as_str().is_some_and(|s| s.len() == 36));
        verdict(format!("Uuid {}", u.name_any()), ok);
    }
    let mut widget_uids = BTreeSet::new();
    let mut excess = 0;
    for w in &widgets {
        let name = w.name_any();
        let uid = w.metadata.uid.clone().unwrap_or_default();
        let mine = children.get(&uid).map(Vec::as_slice).unwrap_or_default();
        excess += mine.len().saturating_sub(fleet.children);
        let want: BTreeSet<String> = (0..fleet.children).map(|i| format!("{name}-{i}")).collect();
        let have: BTreeSet<String> = mine.iter().map(|c| c.name_any()).collect();
        let data_ok = mine.iter().all(|c| {
            c.data
                .as_ref()
                .and_then(|d| d.get("message"))
                .map(String::as_str)
                == Some(message)
        });
        let ready = ready_condition(w).is_some_and(|r| r.0 == "True");
        let current =
            status(w, "observedGeneration").and_then(|g| g.as_i64()) == w.metadata.generation;
        verdict(
            format!("Widget {name}"),
            ready && current && have == want && data_ok,
        );
        widget_uids.insert(uid);
    }
    for pg in &pgs {
        let running = status(pg, "phase").is_some_and(|p| p == "Running");
        verdict(format!("PostgreSQLCluster {}", pg.name_any()), running);
    }
    let expected = fleet.uuids + fleet.widgets + fleet.postgres;
    let seen = uuids.len() + widgets.len() + pgs.len();
    if seen < expected {
        s.not_converged
            .push(format!("{} parents missing", expected - seen));
    }
    let foreign: usize = children
        .iter()
        .filter(|(uid, _)| !widget_uids.contains(*uid))
        .map(|(_, c)| c.len())
        .sum();
    s.duplicate_children = excess + orphans + foreign;
    Ok(s)
}

/// Surveys every second until every parent of `fleet` converged with `message`, for up
/// to `timeout`; returns the last survey either way (a survey the API server could not
/// answer counts as nothing converged).
pub async fn converge(
    client: &Client,
    ns: &str,
    message: &str,
    fleet: &Fleet,
    timeout: Duration,
) -> Survey {
    let started = Instant::now();
    loop {
        match survey(client, ns, message, fleet).await {
            Ok(s) if s.converged() || started.elapsed() > timeout => return s,
            Err(e) if started.elapsed() > timeout => {
                return Survey {
                    not_converged: vec![format!("no survey: {e:#}")],
                    ..Survey::default()
                };
            }
            _ => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}
