//! One watch per kind, shared by every controller that needs it: the pool behind the
//! child caches and the related caches. A kind's cache and the task that feeds it start
//! with the first [`Hold`] on it and stop with the last, so that a plugin reloaded
//! without a kind stops its watch, and one reloaded with it lists the kind again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use kube::Client;
use tokio::task::JoinHandle;

use super::identity::PluginIdentities;
use crate::contract::KindRef;

/// The key of `plugin`'s cache of `kind` in a pool, and the client it reads with:
/// without `identities`, one cache of the kind (`apiVersion/kind`) for every plugin,
/// read as the host; with them, the plugin's own (`plugin apiVersion/kind`), every
/// request of which is made as its ServiceAccount, so that the API server bounds what
/// each plugin's caches hold and no cache is shared across plugins.
pub fn reader(
    client: &Client,
    identities: Option<&PluginIdentities>,
    plugin: &str,
    kind: &KindRef,
) -> (String, Client) {
    let kind = format!("{}/{}", kind.api_version(), kind.kind);
    match identities {
        Some(identities) => (
            format!("{plugin} {kind}"),
            identities.client_of(client, plugin),
        ),
        None => (kind, client.clone()),
    }
}

/// The running caches of one sort (children or related objects), by kind
/// (`apiVersion/kind`).
pub struct WatchPool<C> {
    running: Arc<Mutex<HashMap<String, Running<C>>>>,
    /// What the pool holds, for the log (`child`, `related`).
    what: &'static str,
}

/// A running cache: the task that feeds it from its watch, and how many holds on it
/// live.
struct Running<C> {
    cache: Arc<C>,
    task: JoinHandle<()>,
    holds: usize,
}

/// A hold on the cache of one kind: the kind is watched while any hold on it lives.
pub struct Hold<C> {
    cache: Arc<C>,
    key: String,
    pool: Weak<Mutex<HashMap<String, Running<C>>>>,
    what: &'static str,
}

impl<C> WatchPool<C> {
    /// An empty pool of `what` caches.
    pub fn new(what: &'static str) -> Self {
        WatchPool {
            running: Arc::default(),
            what,
        }
    }

    /// A hold on the cache of `key`; `start` makes the cache and its watch task when
    /// none runs yet.
    pub fn hold(&self, key: String, start: impl FnOnce() -> (Arc<C>, JoinHandle<()>)) -> Hold<C> {
        let mut running = self.running.lock().expect("watch pool lock");
        let entry = running.entry(key.clone()).or_insert_with(|| {
            let (cache, task) = start();
            Running {
                cache,
                task,
                holds: 0,
            }
        });
        entry.holds += 1;
        Hold {
            cache: entry.cache.clone(),
            key,
            pool: Arc::downgrade(&self.running),
            what: self.what,
        }
    }

    /// Whether `check` holds for every cache running.
    pub fn all(&self, check: impl Fn(&C) -> bool) -> bool {
        self.running
            .lock()
            .expect("watch pool lock")
            .values()
            .all(|r| check(&r.cache))
    }

    /// The kinds watched now, sorted.
    #[cfg(test)]
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .running
            .lock()
            .expect("watch pool lock")
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    }
}

impl<C> Drop for WatchPool<C> {
    fn drop(&mut self) {
        for running in self.running.lock().expect("watch pool lock").values() {
            running.task.abort();
        }
    }
}

impl<C> Hold<C> {
    /// The cache. It keeps what it holds after the watch stops, but is no longer fed.
    pub fn cache(&self) -> &Arc<C> {
        &self.cache
    }
}

impl<C> Drop for Hold<C> {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let mut running = pool.lock().expect("watch pool lock");
        let Some(entry) = running.get_mut(&self.key) else {
            return;
        };
        entry.holds -= 1;
        if entry.holds == 0 {
            entry.task.abort();
            running.remove(&self.key);
            tracing::info!(kind = %self.key, "no plugin declares {} as a {} kind: its watch stopped", self.key, self.what);
        }
    }
}
