//! What the instances' agents report back: each patches its own key of the ConfigMap
//! `<name>-report` (a child of the cluster) with one line, its role, timeline and WAL
//! position, and for the primary each streaming standby's replay lag in bytes:
//!
//! ```text
//! epoch=3 role=primary timeline=2 lsn=0/5000060 lag=demo-0:0,demo-2:8192
//! epoch=3 role=standby timeline=2 lsn=0/5000060
//! ```
//!
//! They do so with the Pods' service account, which a Role child lets `get` and `patch`
//! that one ConfigMap and nothing else (the host refuses a Role that grants more). The
//! host observes the ConfigMap like any child: a report is a change of a child, so the
//! cluster is reconciled with it. The plugin uses the reports for what its decisions
//! do not depend on: the LSNs in the failover and switchover events, the replay lag in
//! the status, and `Degraded` for a standby that lags. Failover itself never waits for
//! a report (the agents compare positions among themselves), so a missing or stale one
//! changes nothing but what is shown.

use std::collections::BTreeMap;

use capstan_sdk::{Context, Error};
use k8s_openapi::api::core::v1::ConfigMap;
use serde::{Deserialize, Serialize};

use crate::cluster::Cluster;
use crate::observed;

/// Replay lag beyond which a ready standby makes the cluster `Degraded`: one WAL
/// segment (16 MiB).
pub const LAG_LIMIT: u64 = 16 << 20;

/// One instance's last report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The epoch its agent had adopted.
    pub epoch: u64,
    /// `primary` or `standby`.
    pub role: String,
    /// Its PostgreSQL timeline.
    pub timeline: u64,
    /// A primary's WAL end, a standby's replay position.
    pub lsn: String,
    /// A primary's streaming standbys and their replay lag in bytes.
    pub lags: BTreeMap<String, u64>,
}

impl Report {
    /// Parses one line; none when it is not a report (an agent of another version, a
    /// hand edit): it is left out, never an error.
    pub fn parse(line: &str) -> Option<Self> {
        let mut report = Report::default();
        for field in line.split_whitespace() {
            let (key, value) = field.split_once('=')?;
            match key {
                "epoch" => report.epoch = value.parse().ok()?,
                "role" if value == "primary" || value == "standby" => report.role = value.into(),
                "timeline" => report.timeline = value.parse().ok()?,
                "lsn" if is_lsn(value) => report.lsn = value.into(),
                "lag" => {
                    for entry in value.split(',').filter(|e| !e.is_empty()) {
                        let (name, bytes) = entry.rsplit_once(':')?;
                        // -1: streaming, but no replay position yet.
                        if let Ok(bytes) = bytes.parse::<u64>() {
                            report.lags.insert(name.into(), bytes);
                        }
                    }
                }
                _ => {}
            }
        }
        (!report.role.is_empty() && !report.lsn.is_empty()).then_some(report)
    }
}

/// `X/Y`, two hexadecimal numbers: PostgreSQL's text form of an LSN.
fn is_lsn(value: &str) -> bool {
    value.split_once('/').is_some_and(|(a, b)| {
        !a.is_empty()
            && !b.is_empty()
            && a.len() <= 8
            && b.len() <= 8
            && a.chars().chain(b.chars()).all(|c| c.is_ascii_hexdigit())
    })
}

/// The reports of a cluster's instances, by instance name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reports(pub BTreeMap<String, Report>);

/// One instance in the status (`status.instances`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    /// The instance.
    pub name: String,
    /// `primary` or `standby`, as its agent reported.
    pub role: String,
    /// Its timeline.
    pub timeline: u64,
    /// Its WAL position (a primary's end, a standby's replay).
    pub lsn: String,
    /// How far a standby's replay is behind the primary, in bytes, as the primary
    /// last reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_lag_bytes: Option<u64>,
}

impl Reports {
    /// The reports in the observed ConfigMap `<name>-report`, of the instances
    /// `0..instances` only.
    pub fn observe(ctx: &Context, cluster: &Cluster, instances: i32) -> Result<Self, Error> {
        let Some(config_map) = observed::child::<ConfigMap>(ctx, &cluster.reports())? else {
            return Ok(Reports::default());
        };
        let wanted =
            |name: &str| crate::topology::ordinal(cluster, name).is_some_and(|o| o < instances);
        Ok(Reports(
            config_map
                .data
                .unwrap_or_default()
                .into_iter()
                .filter(|(name, _)| wanted(name))
                .filter_map(|(name, line)| Some((name, Report::parse(&line)?)))
                .collect(),
        ))
    }

    /// The report of the primary `primary`, if it reports as one.
    fn primary(&self, primary: &str) -> Option<&Report> {
        self.0.get(primary).filter(|r| r.role == "primary")
    }

    /// The standbys whose replay the primary reports more than [`LAG_LIMIT`] behind,
    /// with their lag.
    pub fn lagging(&self, primary: &str) -> Vec<(String, u64)> {
        self.primary(primary)
            .map(|p| {
                p.lags
                    .iter()
                    .filter(|(_, lag)| **lag > LAG_LIMIT)
                    .map(|(name, lag)| (name.clone(), *lag))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every instance's report, for the status, with the lags the primary `primary`
    /// reports.
    pub fn status(&self, primary: &str) -> Vec<InstanceStatus> {
        let lags = self.primary(primary).map(|p| &p.lags);
        self.0
            .iter()
            .map(|(name, r)| InstanceStatus {
                name: name.clone(),
                role: r.role.clone(),
                timeline: r.timeline,
                lsn: r.lsn.clone(),
                replay_lag_bytes: (r.role == "standby")
                    .then(|| lags.and_then(|l| l.get(name)).copied())
                    .flatten(),
            })
            .collect()
    }

    /// The WAL positions last reported by `names`, for an event: `demo-1 at 0/5000060
    /// (timeline 2)`, or that there is no report.
    pub fn positions(&self, names: &[&str]) -> String {
        let list: Vec<String> = names
            .iter()
            .map(|name| match self.0.get(*name) {
                Some(r) => format!("{name} at {} (timeline {})", r.lsn, r.timeline),
                None => format!("{name} not reported"),
            })
            .collect();
        format!("last reported WAL positions: {}", list.join(", "))
    }
}

/// Bytes, for a message: `20.3 MiB`.
pub fn bytes(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_parsed_and_anything_else_left_out() {
        let primary =
            Report::parse("epoch=3 role=primary timeline=2 lsn=0/5000060 lag=pg-0:0,pg-2:20000000")
                .unwrap();
        assert_eq!(primary.epoch, 3);
        assert_eq!(primary.timeline, 2);
        assert_eq!(primary.lags["pg-2"], 20_000_000);
        let standby = Report::parse("epoch=3 role=standby timeline=2 lsn=0/4FFF000").unwrap();
        assert_eq!(standby.lsn, "0/4FFF000");
        assert!(standby.lags.is_empty());
        // Streaming without a replay position yet: no lag, not an error.
        let early =
            Report::parse("epoch=1 role=primary timeline=1 lsn=0/3000000 lag=pg-1:-1").unwrap();
        assert!(early.lags.is_empty());
        for bad in [
            "",
            "role=primary",
            "epoch=x role=primary timeline=1 lsn=0/1",
            "epoch=1 role=leader timeline=1 lsn=0/1",
            "epoch=1 role=standby timeline=1 lsn=; DROP TABLE",
            "epoch=1 role=standby timeline=1 lsn=0/123456789",
            "garbage",
        ] {
            assert_eq!(Report::parse(bad), None, "{bad:?}");
        }
    }

    fn reports(lines: &[(&str, &str)]) -> Reports {
        Reports(
            lines
                .iter()
                .map(|(n, l)| (n.to_string(), Report::parse(l).unwrap()))
                .collect(),
        )
    }

    #[test]
    fn a_standby_lags_only_as_its_primary_reports_it() {
        let r = reports(&[
            (
                "pg-0",
                "epoch=1 role=primary timeline=1 lsn=0/9000000 lag=pg-1:0,pg-2:20000000",
            ),
            ("pg-1", "epoch=1 role=standby timeline=1 lsn=0/9000000"),
            ("pg-2", "epoch=1 role=standby timeline=1 lsn=0/7000000"),
        ]);
        assert_eq!(r.lagging("pg-0"), vec![("pg-2".to_string(), 20_000_000)]);
        // Another instance named primary (a failover under way): its report is a
        // standby's, so no lag is judged.
        assert!(r.lagging("pg-1").is_empty());
        let status = r.status("pg-0");
        assert_eq!(status[2].replay_lag_bytes, Some(20_000_000));
        assert_eq!(status[0].replay_lag_bytes, None, "the primary has no lag");
        assert_eq!(
            r.positions(&["pg-1", "pg-3"]),
            "last reported WAL positions: pg-1 at 0/9000000 (timeline 1), pg-3 not reported"
        );
    }
}
