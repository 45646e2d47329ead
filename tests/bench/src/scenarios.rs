//! The benchmark scenarios, each measured on the same control plane in one run: Uuid
//! (Capstan against the native controller), Widget scaling, memory, hot reload and
//! restart. Each prints its table and writes its JSON.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::Client;
use serde::Serialize;
use serde_json::json;

use crate::objects::{self, BenchNamespace, Converged};
use crate::process::{CapstanRun, Operator};
use crate::procfs;
use crate::report::{self, Table, against, mib, secs};
use crate::requests::RequestCounts;
use crate::{Error, Result};

/// What to measure with, and where results go.
#[derive(Debug, Clone)]
pub struct Config {
    /// The `capstan` binary.
    pub capstan: PathBuf,
    /// The `native-uuid` binary.
    pub native: PathBuf,
    /// The shipped plugins (`uuid.wasm`, `postgresql.wasm`).
    pub plugins: PathBuf,
    /// The test plugins (`widget.wasm`).
    pub test_plugins: PathBuf,
    /// Where the JSON results, logs and plugin directories go.
    pub out: PathBuf,
    /// Small sizes, one trial: every path in seconds, for `cargo xtask test`.
    pub quick: bool,
}

/// The sizes of one run.
struct Sizes {
    uuids: &'static [usize],
    widgets: &'static [usize],
    memory: (usize, usize),
    reload_trials: usize,
    /// (Uuids, Widgets) of the sharding scenario.
    shards: (usize, usize),
    /// Widgets of the shadow scenario.
    shadow: usize,
}

const FULL: Sizes = Sizes {
    uuids: &[1000, 5000],
    widgets: &[500, 1000, 2000],
    memory: (5000, 1000),
    reload_trials: 3,
    shards: (3000, 300),
    shadow: 1000,
};

const QUICK: Sizes = Sizes {
    uuids: &[50],
    widgets: &[30, 60],
    memory: (50, 30),
    reload_trials: 1,
    shards: (60, 15),
    shadow: 30,
};

/// The resources the Widget scenario's operator works on: the parents (and their
/// `/status`), their ConfigMaps, and events.
const WIDGET_RESOURCES: &[&str] = &["widgets", "configmaps", "events"];

/// How long the namespace of a finished measurement may take to go away.
const CLEANUP: Duration = Duration::from_secs(180);

/// One benchmark run.
pub struct Bench {
    client: Client,
    cfg: Config,
    sizes: &'static Sizes,
    control_plane: ControlPlane,
    /// The compiled-code cache of every capstan started (see [`Bench::restart`]).
    cache: PathBuf,
}

impl Bench {
    /// Prepares a run: installs the CRDs of the plugins measured.
    pub async fn new(client: Client, cfg: Config) -> Result<Self> {
        let plugins = [
            cfg.plugins.join("uuid.wasm"),
            cfg.plugins.join("postgresql.wasm"),
            cfg.test_plugins.join("widget.wasm"),
        ];
        let paths: Vec<&Path> = plugins.iter().map(PathBuf::as_path).collect();
        objects::install_crds(&client, &cfg.capstan, &paths).await?;
        let control_plane = ControlPlane::find().await;
        Ok(Bench {
            client,
            sizes: if cfg.quick { &QUICK } else { &FULL },
            cache: cfg.out.join("work/compiled"),
            control_plane,
            cfg,
        })
    }

    /// Runs every scenario in order; the restart comes first because it measures a cold
    /// compile cache and leaves it warm for the others.
    pub async fn run_all(&self) -> Result<()> {
        self.restart().await?;
        self.uuid().await?;
        self.widget().await?;
        self.memory().await?;
        self.hot_reload().await?;
        self.shards().await?;
        self.shadow().await?;
        self.identities().await
    }

    fn converge_timeout(&self, n: usize) -> Duration {
        Duration::from_secs(60) + Duration::from_millis(40) * n as u32
    }

    /// A fresh plugin directory holding `plugins`.
    fn plugin_dir(&self, name: &str, plugins: &[&Path]) -> Result<PathBuf> {
        let dir = self.cfg.out.join("work").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| setup("create", &dir, e))?;
        for p in plugins {
            let to = dir.join(p.file_name().expect("a plugin file"));
            std::fs::copy(p, &to).map_err(|e| setup("copy to", &to, e))?;
        }
        Ok(dir)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.cfg.out.join("work").join(format!("{name}.log"))
    }

    fn uuid_wasm(&self) -> PathBuf {
        self.cfg.plugins.join("uuid.wasm")
    }

    fn postgresql_wasm(&self) -> PathBuf {
        self.cfg.plugins.join("postgresql.wasm")
    }

    fn widget_wasm(&self) -> PathBuf {
        self.cfg.test_plugins.join("widget.wasm")
    }

    fn start_capstan(
        &self,
        plugins: &Path,
        ns: &BenchNamespace,
        name: &str,
        poll: Option<u64>,
    ) -> Result<Operator> {
        self.start_capstan_with(plugins, ns, name, poll, &[])
    }

    fn start_capstan_with(
        &self,
        plugins: &Path,
        ns: &BenchNamespace,
        name: &str,
        poll: Option<u64>,
        extra: &[String],
    ) -> Result<Operator> {
        Operator::capstan(&CapstanRun {
            bin: &self.cfg.capstan,
            plugins,
            namespace: &ns.name,
            cache_dir: &self.cache,
            poll_interval_ms: poll,
            log: &self.log(name),
            extra,
            identity: None,
        })
    }

    /// Sharding: the same Uuid and Widget parents served by one unsharded replica, then
    /// by three with `--shards`; convergence, and per replica CPU, peak memory, reconciles
    /// and watch bytes (what sharding divides; the API server bounds the throughput).
    pub async fn shards(&self) -> Result<()> {
        let load = procfs::load_average();
        let (uuids, widgets) = self.sizes.shards;
        let mut results = Vec::new();
        for replicas in [1usize, 3] {
            results.push(self.shards_once(uuids, widgets, replicas).await?);
        }
        let mut table = Table::new(
            &format!(
                "Sharding: {uuids} Uuids + {widgets} Widgets, 1 unsharded replica vs 3 with --shards"
            ),
            &[
                "replicas",
                "all buckets served",
                "converged",
                "parents/s",
                "replica",
                "CPU",
                "peak RSS",
                "reconciles",
                "parent watch",
                "child watch",
                "API server CPU",
            ],
        );
        for r in &results {
            for (i, p) in r.per_replica.iter().enumerate() {
                let first = i == 0;
                let once = |text: String| if first { text } else { String::new() };
                table.row(vec![
                    once(r.replicas.to_string()),
                    once(secs(r.split_seconds)),
                    once(secs(r.converge_seconds)),
                    once(format!(
                        "{:.0}",
                        (uuids + widgets) as f64 / r.converge_seconds
                    )),
                    p.identity.clone(),
                    secs(p.cpu_seconds),
                    mib(p.peak_rss_mib),
                    p.reconciles.to_string(),
                    format!("{:.2} MiB", p.parent_watch_bytes as f64 / 1048576.0),
                    format!("{:.2} MiB", p.child_watch_bytes as f64 / 1048576.0),
                    once(secs(r.apiserver_cpu_seconds)),
                ]);
            }
        }
        table.print();
        report::write_json(&self.cfg.out, "shards", self.cfg.quick, load, &results)
    }

    async fn shards_once(&self, uuids: usize, widgets: usize, replicas: usize) -> Result<Sharded> {
        let ns = BenchNamespace::create(&self.client, &format!("shards-{replicas}")).await?;
        let (uuid_kind, widget_kind) = (objects::uuid_kind(), objects::widget_kind());
        objects::create_parents(&ns.api(&uuid_kind), &uuid_kind, "u", uuids, &json!({})).await?;
        objects::create_parents(
            &ns.api(&widget_kind),
            &widget_kind,
            "w",
            widgets,
            &json!({"count": 2}),
        )
        .await?;
        let mut uuids_done = Converged::watch(ns.api(&uuid_kind), objects::has_uuid).await?;
        let mut widgets_done =
            Converged::watch(ns.api(&widget_kind), objects::widget_settled).await?;
        let dir = self.plugin_dir(
            &format!("shards-{replicas}"),
            &[&self.uuid_wasm(), &self.widget_wasm()],
        )?;
        let extra: Vec<String> = if replicas > 1 {
            ["--shards", "--leader-election-namespace", &ns.name]
                .iter()
                .map(|s| s.to_string())
                .collect()
        } else {
            Vec::new()
        };
        let identities: Vec<String> = (0..replicas).map(|i| format!("replica-{i}")).collect();
        let logs: Vec<PathBuf> = identities
            .iter()
            .map(|id| self.log(&format!("shards-{replicas}-{id}")))
            .collect();
        let mut ops = Vec::new();
        for (id, log) in identities.iter().zip(&logs) {
            ops.push(Operator::capstan(&CapstanRun {
                bin: &self.cfg.capstan,
                plugins: &dir,
                namespace: &ns.name,
                cache_dir: &self.cache,
                poll_interval_ms: None,
                log,
                extra: &extra,
                identity: Some(id),
            })?);
        }
        // Timed from when every replica serves its share, so that the figure is the
        // work, not the membership rounds of a cold start.
        for op in &mut ops {
            op.ready(Duration::from_secs(60)).await?;
        }
        let alive = |ops: &mut Vec<Operator>| ops.iter_mut().try_for_each(Operator::alive);
        let started = Instant::now();
        let before = self.control_plane.usage();
        let timeout = self.converge_timeout(uuids + 3 * widgets);
        // When the replicas together serve all 64 buckets (membership rounds).
        let split_seconds = loop {
            let mut served = 0.0;
            for op in &ops {
                served += op
                    .metrics()
                    .await?
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("capstan_shard_buckets ")?
                            .parse::<f64>()
                            .ok()
                    })
                    .unwrap_or(0.0);
            }
            if served >= 64.0 {
                break started.elapsed().as_secs_f64();
            }
            alive(&mut ops)?;
            if started.elapsed() > timeout {
                return Err(Error::Setup(
                    "the replicas never served all 64 buckets".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        uuids_done
            .wait_for(uuids, timeout, || alive(&mut ops))
            .await?;
        widgets_done
            .wait_for(widgets, timeout, || alive(&mut ops))
            .await?;
        let converge_seconds = started.elapsed().as_secs_f64();
        let after = self.control_plane.usage();
        let mut per_replica = Vec::new();
        for (op, id) in ops.iter().zip(&identities) {
            let metrics = op.metrics().await?;
            let value = |series: &str| -> u64 {
                metrics
                    .lines()
                    .filter(|l| l.starts_with(series))
                    .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                    .sum::<f64>() as u64
            };
            let usage = op.usage();
            per_replica.push(ShardReplica {
                identity: id.clone(),
                cpu_seconds: usage.cpu_seconds,
                peak_rss_mib: usage.peak_rss_mib,
                reconciles: value("capstan_reconciles_total{"),
                parent_watch_bytes: value("capstan_watch_bytes_total{watch=\"parents\"}"),
                child_watch_bytes: value("capstan_watch_bytes_total{watch=\"children\"}"),
            });
        }
        for op in &mut ops {
            op.kill();
        }
        ns.delete(CLEANUP).await?;
        Ok(Sharded {
            replicas,
            uuids,
            widgets,
            converge_seconds,
            split_seconds,
            apiserver_cpu_seconds: after.0 - before.0,
            etcd_cpu_seconds: after.1 - before.1,
            per_replica,
        })
    }

    /// Uuid: N pre-created parents until all have `status.uuid`, Capstan and the native
    /// controller one after the other.
    pub async fn uuid(&self) -> Result<()> {
        let load = procfs::load_average();
        let mut results = Vec::new();
        for &n in self.sizes.uuids {
            for subject in [Subject::Capstan, Subject::Native] {
                results.push(self.uuid_once(n, subject).await?);
            }
        }
        let mut table = Table::new(
            "Uuid: N pre-created parents until all have status.uuid",
            &[
                "N",
                "operator",
                "converged",
                "parents/s",
                "CPU",
                "peak RSS",
                "API server CPU",
                "etcd CPU",
                "Capstan/native",
            ],
        );
        for pair in results.chunks(2) {
            let ratio = pair[0].converge_seconds / pair[1].converge_seconds;
            for (i, r) in pair.iter().enumerate() {
                let ratio = match i {
                    0 => format!("{ratio:.2}x ({})", against(ratio, 1.15, self.cfg.quick)),
                    _ => String::new(),
                };
                table.row(vec![
                    r.n.to_string(),
                    r.subject.into(),
                    secs(r.converge_seconds),
                    format!("{:.0}", r.n as f64 / r.converge_seconds),
                    secs(r.cpu_seconds),
                    mib(r.peak_rss_mib),
                    secs(r.apiserver_cpu_seconds),
                    secs(r.etcd_cpu_seconds),
                    ratio,
                ]);
            }
        }
        table.print();
        report::write_json(&self.cfg.out, "uuid", self.cfg.quick, load, &results)
    }

    async fn uuid_once(&self, n: usize, subject: Subject) -> Result<Converge> {
        let ns = BenchNamespace::create(&self.client, &format!("uuid-{n}")).await?;
        let kind = objects::uuid_kind();
        let api = ns.api(&kind);
        let created = objects::create_parents(&api, &kind, "u", n, &json!({})).await?;
        let mut converged = Converged::watch(api, objects::has_uuid).await?;
        let name = format!("uuid-{n}-{}", subject.as_str());
        let before = self.control_plane.usage();
        let mut op = match subject {
            Subject::Capstan => {
                let dir = self.plugin_dir(&name, &[&self.uuid_wasm()])?;
                self.start_capstan(&dir, &ns, &name, None)?
            }
            Subject::Native => Operator::native(&self.cfg.native, &ns.name, &self.log(&name))?,
        };
        converged
            .wait_for(n, self.converge_timeout(n), || op.alive())
            .await?;
        let result = Converge::measure(subject, n, created, &op, &self.control_plane, before).await;
        op.kill();
        ns.delete(CLEANUP).await?;
        Ok(result)
    }

    /// Widget: N parents of two ConfigMaps each until all are Ready and have seen their
    /// children; host CPU and memory; CPU(2N)/CPU(N).
    pub async fn widget(&self) -> Result<()> {
        let load = procfs::load_average();
        let mut results: Vec<Converge> = Vec::new();
        for &n in self.sizes.widgets {
            let name = format!("widget-{n}");
            results.push(self.widget_once(n, &name, &[&self.widget_wasm()]).await?);
        }
        let mut table = Table::new(
            "Widget: N parents x 2 ConfigMaps until all Ready with their children seen",
            &[
                "N",
                "converged",
                "parents/s",
                "host CPU",
                "CPU(N)/CPU(N/2)",
                "peak RSS",
                "reconciles",
                "mean reconcile",
                "API server CPU",
                "etcd CPU",
                "API requests/parent",
                "by verb",
            ],
        );
        for (i, r) in results.iter().enumerate() {
            let requests = r
                .requests_per_parent()
                .map(|per| match r.n {
                    1000 => format!("{per:.2} ({})", against(per, 3.1, self.cfg.quick)),
                    _ => format!("{per:.2}"),
                })
                .unwrap_or_else(|| "not read".into());
            let ratio = i
                .checked_sub(1)
                .map(|j| &results[j])
                .filter(|half| half.n * 2 == r.n)
                .map(|half| {
                    let ratio = r.cpu_seconds / half.cpu_seconds;
                    format!("{ratio:.2} ({})", against(ratio, 2.2, self.cfg.quick))
                })
                .unwrap_or_default();
            let converged = match r.n {
                1000 => format!(
                    "{} ({})",
                    secs(r.converge_seconds),
                    against(r.converge_seconds, 15.0, self.cfg.quick)
                ),
                _ => secs(r.converge_seconds),
            };
            table.row(vec![
                r.n.to_string(),
                converged,
                format!("{:.0}", r.n as f64 / r.converge_seconds),
                secs(r.cpu_seconds),
                ratio,
                mib(r.peak_rss_mib),
                r.reconciles_text(),
                r.mean_reconcile_ms
                    .map(|ms| format!("{ms:.1} ms"))
                    .unwrap_or_default(),
                secs(r.apiserver_cpu_seconds),
                secs(r.etcd_cpu_seconds),
                requests,
                r.requests_by_verb_text(),
            ]);
        }
        table.print();
        report::write_json(&self.cfg.out, "widget", self.cfg.quick, load, &results)
    }

    /// N Widgets (two ConfigMaps each) converged by capstan serving `plugins`; the
    /// requests the API server answered for them meanwhile.
    async fn widget_once(&self, n: usize, name: &str, plugins: &[&Path]) -> Result<Converge> {
        self.widget_once_with(n, name, plugins, &[]).await
    }

    /// [`Self::widget_once`] with further `capstan run` flags.
    async fn widget_once_with(
        &self,
        n: usize,
        name: &str,
        plugins: &[&Path],
        extra: &[String],
    ) -> Result<Converge> {
        let ns = BenchNamespace::create(&self.client, name).await?;
        let kind = objects::widget_kind();
        let api = ns.api(&kind);
        let created = objects::create_parents(&api, &kind, "w", n, &json!({"count": 2})).await?;
        let mut converged = Converged::watch(api, objects::widget_settled).await?;
        let dir = self.plugin_dir(name, plugins)?;
        let requests_before =
            RequestCounts::read_settled(&self.client, WIDGET_RESOURCES, CLEANUP).await;
        let before = self.control_plane.usage();
        let mut op = self.start_capstan_with(&dir, &ns, name, None, extra)?;
        converged
            .wait_for(n, self.converge_timeout(3 * n), || op.alive())
            .await?;
        let mut result = Converge::measure(
            Subject::Capstan,
            n,
            created,
            &op,
            &self.control_plane,
            before,
        )
        .await;
        if let Some(before) = requests_before {
            result.api_requests = RequestCounts::read(&self.client, WIDGET_RESOURCES)
                .await
                .map(|after| after.since(&before));
        }
        op.kill();
        ns.delete(CLEANUP).await?;
        Ok(result)
    }

    /// Shadow mode: the same N Widgets converged without a shadow, then with the same
    /// plugin as `widget.next.wasm` (it agrees on every reconcile): what the shadow's
    /// extra call costs in host CPU and memory, and that it makes no API request.
    pub async fn shadow(&self) -> Result<()> {
        let load = procfs::load_average();
        let n = self.sizes.shadow;
        let widget = self.widget_wasm();
        let next = self.cfg.out.join("work").join("widget.next.wasm");
        std::fs::create_dir_all(self.cfg.out.join("work"))
            .map_err(|e| setup("create", &next, e))?;
        std::fs::copy(&widget, &next).map_err(|e| setup("copy to", &next, e))?;
        let without = self
            .widget_once(n, &format!("shadow-off-{n}"), &[&widget])
            .await?;
        let with = self
            .widget_once(n, &format!("shadow-on-{n}"), &[&widget, &next])
            .await?;
        let mut table = Table::new(
            "Shadow mode: N Widgets without and with a shadow version (the same plugin as widget.next.wasm)",
            &[
                "N",
                "shadow",
                "converged",
                "host CPU",
                "CPU with/without",
                "peak RSS",
                "reconciles",
                "shadow verdicts",
                "mean reconcile",
                "API requests/parent",
                "by verb",
            ],
        );
        for (label, r) in [("no", &without), ("yes", &with)] {
            let ratio = match label {
                "yes" => format!("{:.2}", with.cpu_seconds / without.cpu_seconds),
                _ => String::new(),
            };
            table.row(vec![
                r.n.to_string(),
                label.into(),
                secs(r.converge_seconds),
                secs(r.cpu_seconds),
                ratio,
                mib(r.peak_rss_mib),
                r.reconciles_text(),
                r.shadow_text(),
                r.mean_reconcile_ms
                    .map(|ms| format!("{ms:.1} ms"))
                    .unwrap_or_default(),
                r.requests_per_parent()
                    .map(|per| format!("{per:.2}"))
                    .unwrap_or_else(|| "not read".into()),
                r.requests_by_verb_text(),
            ]);
        }
        table.print();
        report::write_json(
            &self.cfg.out,
            "shadow",
            self.cfg.quick,
            load,
            &[without, with],
        )
    }

    /// One identity per plugin: the same N Widgets converged by capstan as the host,
    /// then with `--plugin-identities` (every request impersonates the plugin's
    /// account, whose RBAC `capstan rbac --plugin-identities` printed; the plugin's
    /// caches are its own): what that costs in time, host CPU, memory and requests.
    pub async fn identities(&self) -> Result<()> {
        let load = procfs::load_average();
        let n = self.sizes.shadow;
        let widget = self.widget_wasm();
        let accounts = BenchNamespace::create(&self.client, "accounts").await?;
        let dir = self.plugin_dir("identities-rbac", &[&widget])?;
        let made =
            objects::apply_plugin_identities(&self.client, &self.cfg.capstan, &dir, &accounts.name)
                .await?;
        let measured = async {
            let host = self
                .widget_once(n, &format!("identities-off-{n}"), &[&widget])
                .await?;
            let flag = format!("--plugin-identities={}", accounts.name);
            let own = self
                .widget_once_with(n, &format!("identities-on-{n}"), &[&widget], &[flag])
                .await?;
            Ok::<_, crate::Error>((host, own))
        }
        .await;
        objects::delete_cluster_rbac(&self.client, &made).await;
        accounts.delete(CLEANUP).await?;
        let (host, own) = measured?;
        let mut table = Table::new(
            "One identity per plugin: N Widgets as the host, then as the plugin's own account (--plugin-identities)",
            &[
                "N",
                "as",
                "converged",
                "time own/host",
                "host CPU",
                "CPU own/host",
                "peak RSS",
                "mean reconcile",
                "API requests/parent",
                "by verb",
            ],
        );
        for (label, r) in [("host", &host), ("plugin", &own)] {
            let ratio = |own: f64, host: f64| match label {
                "plugin" => format!("{:.2}", own / host),
                _ => String::new(),
            };
            table.row(vec![
                r.n.to_string(),
                label.into(),
                secs(r.converge_seconds),
                ratio(own.converge_seconds, host.converge_seconds),
                secs(r.cpu_seconds),
                ratio(own.cpu_seconds, host.cpu_seconds),
                mib(r.peak_rss_mib),
                r.mean_reconcile_ms
                    .map(|ms| format!("{ms:.1} ms"))
                    .unwrap_or_default(),
                r.requests_per_parent()
                    .map(|per| format!("{per:.2}"))
                    .unwrap_or_else(|| "not read".into()),
                r.requests_by_verb_text(),
            ]);
        }
        table.print();
        report::write_json(
            &self.cfg.out,
            "identities",
            self.cfg.quick,
            load,
            &[host, own],
        )
    }

    /// Memory: one capstan with both shipped plugins and the widget plugin, serving
    /// Uuids and Widgets at once; resident memory once all converged, and the peak.
    pub async fn memory(&self) -> Result<()> {
        let load = procfs::load_average();
        let (uuids, widgets) = self.sizes.memory;
        let ns = BenchNamespace::create(&self.client, "memory").await?;
        let (uuid, widget) = (objects::uuid_kind(), objects::widget_kind());
        objects::create_parents(&ns.api(&uuid), &uuid, "u", uuids, &json!({})).await?;
        objects::create_parents(
            &ns.api(&widget),
            &widget,
            "w",
            widgets,
            &json!({"count": 2}),
        )
        .await?;
        let mut uuids_done = Converged::watch(ns.api(&uuid), objects::has_uuid).await?;
        let mut widgets_done = Converged::watch(ns.api(&widget), objects::widget_settled).await?;
        let dir = self.plugin_dir(
            "memory",
            &[
                &self.uuid_wasm(),
                &self.postgresql_wasm(),
                &self.widget_wasm(),
            ],
        )?;
        let mut op = self.start_capstan(&dir, &ns, "memory", None)?;
        let timeout = self.converge_timeout(uuids + 3 * widgets);
        uuids_done.wait_for(uuids, timeout, || op.alive()).await?;
        widgets_done
            .wait_for(widgets, timeout, || op.alive())
            .await?;
        let converged = op.started.elapsed();
        // Steady state: what the host keeps once the burst is over.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let usage = op.usage();
        op.kill();
        ns.delete(CLEANUP).await?;
        let result = Memory {
            uuids,
            widgets,
            plugins: vec!["uuid", "postgresql", "widget"],
            converge_seconds: converged.as_secs_f64(),
            rss_mib: usage.rss_mib,
            peak_rss_mib: usage.peak_rss_mib,
            cpu_seconds: usage.cpu_seconds,
        };
        let mut table = Table::new(
            "Memory: one host serving uuid + postgresql + widget",
            &[
                "parents",
                "converged",
                "RSS after",
                "peak RSS",
                "goal 64 MiB",
            ],
        );
        table.row(vec![
            format!("{uuids} Uuid + {widgets} Widget"),
            secs(result.converge_seconds),
            mib(result.rss_mib),
            mib(result.peak_rss_mib),
            against(result.peak_rss_mib, 64.0, self.cfg.quick),
        ]);
        table.print();
        report::write_json(&self.cfg.out, "memory", self.cfg.quick, load, &[result])
    }

    /// Hot reload: from widget.wasm appearing in the directory of a running capstan
    /// (moved in, as docs/operator.md asks) to its pre-created parent being Ready, at the
    /// default poll interval and at 100 ms.
    pub async fn hot_reload(&self) -> Result<()> {
        let load = procfs::load_average();
        let mut results = Vec::new();
        for poll in [None, Some(100)] {
            for trial in 0..self.sizes.reload_trials {
                results.push(self.hot_reload_once(poll, trial).await?);
            }
        }
        let mut table = Table::new(
            "Hot reload: widget.wasm moved into the plugin directory until its parent is Ready",
            &["--poll-interval-ms", "trials", "min", "median", "max"],
        );
        for poll in [1000, 100] {
            let mut times: Vec<f64> = results
                .iter()
                .filter(|r: &&Reload| r.poll_interval_ms == poll)
                .map(|r| r.seconds)
                .collect();
            times.sort_by(f64::total_cmp);
            table.row(vec![
                match poll {
                    1000 => "1000 (default)".into(),
                    p => p.to_string(),
                },
                times.len().to_string(),
                secs(times[0]),
                secs(times[times.len() / 2]),
                secs(times[times.len() - 1]),
            ]);
        }
        table.print();
        report::write_json(&self.cfg.out, "hot-reload", self.cfg.quick, load, &results)
    }

    async fn hot_reload_once(&self, poll: Option<u64>, trial: usize) -> Result<Reload> {
        let ns = BenchNamespace::create(&self.client, "reload").await?;
        let kind = objects::widget_kind();
        let api = ns.api(&kind);
        objects::create_parents(&api, &kind, "w", 1, &json!({"count": 2})).await?;
        let mut ready = Converged::watch(api, objects::is_ready).await?;
        let name = format!("reload-{}-{trial}", poll.unwrap_or(1000));
        let dir = self.plugin_dir(&name, &[&self.uuid_wasm()])?;
        let mut op = self.start_capstan(&dir, &ns, &name, poll)?;
        op.ready(Duration::from_secs(60)).await?;
        // Past the first scan, into the steady polling.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let staged = dir.join(".widget.wasm.partial");
        std::fs::copy(self.widget_wasm(), &staged).map_err(|e| setup("copy to", &staged, e))?;
        let installed = dir.join("widget.wasm");
        let start = Instant::now();
        std::fs::rename(&staged, &installed).map_err(|e| setup("move to", &installed, e))?;
        ready
            .wait_for(1, Duration::from_secs(60), || op.alive())
            .await?;
        let seconds = start.elapsed().as_secs_f64();
        op.kill();
        ns.delete(CLEANUP).await?;
        Ok(Reload {
            poll_interval_ms: poll.unwrap_or(1000),
            seconds,
        })
    }

    /// Restart: a first start with an empty compile cache, then SIGKILL and a start with
    /// the cache warm; until `/readyz` is ok, and until a parent created while it was
    /// down is Ready.
    pub async fn restart(&self) -> Result<()> {
        let load = procfs::load_average();
        let _ = std::fs::remove_dir_all(&self.cache);
        let ns = BenchNamespace::create(&self.client, "restart").await?;
        let dir = self.plugin_dir(
            "restart",
            &[
                &self.uuid_wasm(),
                &self.postgresql_wasm(),
                &self.widget_wasm(),
            ],
        )?;
        let mut results = Vec::new();
        for (start, cache) in [("first start", "cold"), ("restart", "warm")] {
            let kind = objects::widget_kind();
            let api = ns.api(&kind);
            let name = format!("w-{}", results.len());
            objects::create_parents(&api, &kind, &name, 1, &json!({"count": 2})).await?;
            let wanted = format!("{name}-0");
            let mut ready = Converged::watch(api, move |o| {
                o.metadata.name.as_deref() == Some(wanted.as_str()) && objects::is_ready(o)
            })
            .await?;
            let mut op = self.start_capstan(&dir, &ns, &format!("restart-{cache}"), None)?;
            let to_ready = op.ready(Duration::from_secs(120)).await?;
            ready
                .wait_for(1, Duration::from_secs(120), || op.alive())
                .await?;
            let to_reconciled = op.started.elapsed();
            let usage = op.usage();
            op.kill();
            results.push(Restart {
                start,
                compile_cache: cache,
                ready_seconds: to_ready.as_secs_f64(),
                new_parent_ready_seconds: to_reconciled.as_secs_f64(),
                rss_mib: usage.rss_mib,
                peak_rss_mib: usage.peak_rss_mib,
            });
        }
        ns.delete(CLEANUP).await?;
        let mut table = Table::new(
            "Restart: uuid + postgresql + widget, a parent created while the host was down",
            &[
                "start",
                "compile cache",
                "/readyz ok",
                "new parent Ready",
                "RSS then",
                "peak RSS",
            ],
        );
        for r in &results {
            table.row(vec![
                r.start.into(),
                r.compile_cache.into(),
                secs(r.ready_seconds),
                secs(r.new_parent_ready_seconds),
                mib(r.rss_mib),
                mib(r.peak_rss_mib),
            ]);
        }
        table.print();
        report::write_json(&self.cfg.out, "restart", self.cfg.quick, load, &results)
    }
}

fn setup(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Setup(format!("{what} {}: {e}", path.display()))
}

/// The operator measured.
#[derive(Debug, Clone, Copy)]
enum Subject {
    Capstan,
    Native,
}

impl Subject {
    fn as_str(self) -> &'static str {
        match self {
            Subject::Capstan => "capstan",
            Subject::Native => "native",
        }
    }
}

/// N parents converged under one operator.
#[derive(Debug, Serialize)]
struct Converge {
    subject: &'static str,
    n: usize,
    /// Creating the parents (before the operator started).
    create_seconds: f64,
    /// From starting the operator until the last parent converged.
    converge_seconds: f64,
    /// The operator's CPU (user + system) until then.
    cpu_seconds: f64,
    /// Its peak resident memory.
    peak_rss_mib: f64,
    /// CPU the API server spent meanwhile.
    apiserver_cpu_seconds: f64,
    /// CPU etcd spent meanwhile.
    etcd_cpu_seconds: f64,
    /// capstan_reconciles_total by result (capstan only).
    reconciles: BTreeMap<String, u64>,
    /// capstan_status_writes_total (capstan only).
    status_writes: Option<u64>,
    /// capstan_shadow_reconciles_total by verdict (with a shadow version only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    shadow: BTreeMap<String, u64>,
    /// Mean of capstan_reconcile_duration_seconds (capstan only).
    mean_reconcile_ms: Option<f64>,
    /// Requests the API server answered meanwhile for the scenario's resources, by verb
    /// (from its `apiserver_request_total`; the Widget scenario only).
    #[serde(skip_serializing_if = "Option::is_none")]
    api_requests: Option<BTreeMap<String, u64>>,
}

impl Converge {
    async fn measure(
        subject: Subject,
        n: usize,
        created: Duration,
        op: &Operator,
        control_plane: &ControlPlane,
        before: (f64, f64),
    ) -> Self {
        let converged = op.started.elapsed();
        let usage = op.usage();
        let after = control_plane.usage();
        let metrics = match subject {
            Subject::Capstan => op.metrics().await.unwrap_or_default(),
            Subject::Native => String::new(),
        };
        let series = |name: &str| -> Vec<(String, f64)> {
            metrics
                .lines()
                .filter_map(|l| {
                    let rest = l.strip_prefix(name)?;
                    let (labels, value) = rest.rsplit_once(' ')?;
                    Some((labels.to_string(), value.parse().ok()?))
                })
                .collect()
        };
        let by_result = |name: &str| -> BTreeMap<String, u64> {
            series(name)
                .into_iter()
                .filter_map(|(labels, v)| {
                    let result = labels.split("result=\"").nth(1)?.split('"').next()?;
                    Some((result.to_string(), v as u64))
                })
                .collect()
        };
        let reconciles = by_result("capstan_reconciles_total{");
        let shadow = by_result("capstan_shadow_reconciles_total{");
        let total = |name: &str| -> Option<f64> {
            let values = series(name);
            (!values.is_empty()).then(|| values.iter().map(|(_, v)| v).sum())
        };
        let mean_reconcile_ms = total("capstan_reconcile_duration_seconds_sum{")
            .zip(total("capstan_reconcile_duration_seconds_count{"))
            .filter(|(_, count)| *count > 0.0)
            .map(|(sum, count)| sum / count * 1000.0);
        Converge {
            subject: subject.as_str(),
            n,
            create_seconds: created.as_secs_f64(),
            converge_seconds: converged.as_secs_f64(),
            cpu_seconds: usage.cpu_seconds,
            peak_rss_mib: usage.peak_rss_mib,
            apiserver_cpu_seconds: after.0 - before.0,
            etcd_cpu_seconds: after.1 - before.1,
            reconciles,
            shadow,
            status_writes: total("capstan_status_writes_total{").map(|v| v as u64),
            mean_reconcile_ms,
            api_requests: None,
        }
    }

    /// API requests per converged parent, all verbs.
    fn requests_per_parent(&self) -> Option<f64> {
        let requests = self.api_requests.as_ref()?;
        Some(requests.values().sum::<u64>() as f64 / self.n as f64)
    }

    fn shadow_text(&self) -> String {
        self.shadow
            .iter()
            .map(|(verdict, n)| format!("{verdict} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn requests_by_verb_text(&self) -> String {
        self.api_requests
            .iter()
            .flatten()
            .map(|(verb, n)| format!("{verb} {:.2}", *n as f64 / self.n as f64))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn reconciles_text(&self) -> String {
        self.reconciles
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[derive(Debug, Serialize)]
struct Memory {
    uuids: usize,
    widgets: usize,
    plugins: Vec<&'static str>,
    converge_seconds: f64,
    /// Resident memory 2 s after everything converged.
    rss_mib: f64,
    /// Peak resident memory (VmHWM).
    peak_rss_mib: f64,
    cpu_seconds: f64,
}

#[derive(Debug, Serialize)]
struct Sharded {
    replicas: usize,
    uuids: usize,
    widgets: usize,
    /// From every replica ready until every parent converged.
    converge_seconds: f64,
    /// From every replica ready until they served all 64 buckets together.
    split_seconds: f64,
    apiserver_cpu_seconds: f64,
    etcd_cpu_seconds: f64,
    per_replica: Vec<ShardReplica>,
}

#[derive(Debug, Serialize)]
struct ShardReplica {
    identity: String,
    /// CPU of the whole process, start included.
    cpu_seconds: f64,
    peak_rss_mib: f64,
    reconciles: u64,
    parent_watch_bytes: u64,
    child_watch_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Reload {
    poll_interval_ms: u64,
    /// From the file being moved in until its parent was Ready.
    seconds: f64,
}

#[derive(Debug, Serialize)]
struct Restart {
    start: &'static str,
    compile_cache: &'static str,
    /// From starting the process until `/readyz` answered ok.
    ready_seconds: f64,
    /// From starting the process until the parent created while it was down was Ready.
    new_parent_ready_seconds: f64,
    /// VmRSS then, in MiB: what a first start keeps of compiling.
    rss_mib: f64,
    /// VmHWM then, in MiB: a first start's peak is a compile's.
    peak_rss_mib: f64,
}

/// The API server and etcd of the cluster, found by the API server's port, for the CPU
/// they spend during a measurement (what bounds the operator's speed).
struct ControlPlane {
    apiserver: Option<u32>,
    etcd: Option<u32>,
}

impl ControlPlane {
    async fn find() -> Self {
        let port = kube::Config::infer()
            .await
            .ok()
            .and_then(|c| c.cluster_url.port_u16());
        let Some((apiserver, cmdline)) =
            port.and_then(|p| procfs::find_process_with(&format!("--secure-port={p}")))
        else {
            eprintln!(
                "bench: the API server's process is not on this machine; its CPU is not measured"
            );
            return ControlPlane {
                apiserver: None,
                etcd: None,
            };
        };
        let etcd = cmdline
            .split_whitespace()
            .find_map(|a| a.strip_prefix("--etcd-servers="))
            .and_then(|url| procfs::find_process(&format!("--listen-client-urls={url}")));
        ControlPlane {
            apiserver: Some(apiserver),
            etcd,
        }
    }

    /// CPU seconds so far of (API server, etcd); 0 for what is not found.
    fn usage(&self) -> (f64, f64) {
        let cpu = |pid: Option<u32>| pid.and_then(procfs::usage).map_or(0.0, |u| u.cpu_seconds);
        (cpu(self.apiserver), cpu(self.etcd))
    }
}
