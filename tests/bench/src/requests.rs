//! Requests the API server answered, from its own `apiserver_request_total` (its
//! `/metrics`): the benchmark counts the requests of the resources an operator works
//! on, by verb, between two readings.

use std::collections::BTreeMap;

use kube::Client;

/// `apiserver_request_total`, summed by verb, for some resources.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestCounts(pub BTreeMap<String, f64>);

impl RequestCounts {
    /// Reads the API server's counters of `resources` (plural names such as
    /// `configmaps`; every group and subresource of each); `None` when its `/metrics`
    /// cannot be read (no permission, not the API server).
    pub async fn read(client: &Client, resources: &[&str]) -> Option<Self> {
        let request = http::Request::get("/metrics").body(Vec::new()).ok()?;
        let text = client.request_text(request).await.ok()?;
        Some(Self::parse(&text, resources))
    }

    /// Like [`RequestCounts::read`], once the counters have stood still for a second (at
    /// most `max`): the garbage collector may still be at work on the objects of the
    /// previous measurement, whose requests are not the operator's.
    pub async fn read_settled(
        client: &Client,
        resources: &[&str],
        max: std::time::Duration,
    ) -> Option<Self> {
        let started = std::time::Instant::now();
        let mut last = Self::read(client, resources).await?;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let now = Self::read(client, resources).await?;
            if now == last || started.elapsed() >= max {
                return Some(now);
            }
            last = now;
        }
    }

    /// The counters of `resources` in a Prometheus text exposition.
    pub fn parse(text: &str, resources: &[&str]) -> Self {
        let mut by_verb = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let label = |name: &str| {
                labels
                    .split(',')
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix("=\""))
                    .and_then(|v| v.strip_suffix('"'))
            };
            let (Some(resource), Some(verb), Ok(value)) = (
                label("resource"),
                label("verb"),
                value.trim().parse::<f64>(),
            ) else {
                continue;
            };
            if resources.contains(&resource) {
                *by_verb.entry(verb.to_string()).or_default() += value;
            }
        }
        RequestCounts(by_verb)
    }

    /// The requests counted since `before`, by verb (verbs with none left out).
    pub fn since(&self, before: &RequestCounts) -> BTreeMap<String, u64> {
        self.0
            .iter()
            .map(|(verb, n)| {
                let earlier = before.0.get(verb).copied().unwrap_or(0.0);
                (verb.clone(), (n - earlier).max(0.0).round() as u64)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_summed_by_verb_for_the_resources_asked() {
        let text = r#"# HELP apiserver_request_total [STABLE] Counter of apiserver requests
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="configmaps",scope="resource",subresource="",verb="APPLY",version="v1"} 2000
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="configmaps",scope="resource",subresource="",verb="APPLY",version="v1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="test.capstan.dev",resource="widgets",scope="resource",subresource="status",verb="APPLY",version="v1"} 1000
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="configmaps",scope="resource",subresource="",verb="GET",version="v1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 77
apiserver_request_total_other{resource="configmaps",verb="GET"} 5
"#;
        let before = RequestCounts::parse("", &["configmaps", "widgets"]);
        let after = RequestCounts::parse(text, &["configmaps", "widgets"]);
        let since = after.since(&before);
        assert_eq!(since["APPLY"], 3003);
        assert_eq!(since["GET"], 4);
        assert!(!since.contains_key("PUT"), "leases are not asked for");
        assert_eq!(after.since(&after), BTreeMap::new());
    }
}
