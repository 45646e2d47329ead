//! The front doors agree: what `capstan render` and `capstan plan --live` show for a
//! parent is what `capstan run` writes for it. For every sample of the shipped plugins
//! (crds/samples), the parent's first reconcile runs against the fake API server; the
//! same parent is rendered as `capstan render` renders it and planned live against a
//! second fake API server holding only the parent, as `capstan plan --live` plans it.
//! All three decide on the same world, their plugin's clock and random pinned alike
//! (as `capstan check` and replays pin them): the children created, their dry runs and
//! the rendered children must be the same objects, and the status the same.

use std::collections::BTreeMap;

use http::Method;
use serde_json::{Value, json};

use super::fake_api::{Call, Store};
use super::pipeline_tests::{NS, Scenario, load_file};
use super::preview;
use crate::contract::Observed;
use crate::diff::Outcome;
use crate::engine::World;
use crate::plugin::Pinned;
use crate::render;

/// The shipped plugins' samples: (plugin, sample file under crds/samples).
const SAMPLES: &[(&str, &str)] = &[
    ("uuid", "uuid.yaml"),
    ("postgresql", "postgresqlcluster.yaml"),
    ("database", "database.yaml"),
    ("database", "database-mysql.yaml"),
];

/// The sample's parent, in the tests' namespace.
fn sample(file: &str) -> Value {
    let path = crate::fixtures::root().join("crds/samples").join(file);
    let mut parent = render::read_one(&path).unwrap();
    parent["metadata"]["namespace"] = json!(NS);
    parent
}

/// The clock and random every call of the three front doors reads.
const PINNED: Pinned = Pinned {
    at: 1_796_601_600, // 2026-12-07T00:00:00Z
    seed: 33,
};

/// The children a list of requests wrote, by path: server-side applies outside the
/// parents' collection.
fn child_writes(calls: &[Call], parents: &str) -> BTreeMap<String, Value> {
    calls
        .iter()
        .filter(|c| c.method == Method::PATCH && !c.path.starts_with(parents))
        .map(|c| (c.path.clone(), c.body.clone()))
        .collect()
}

/// A planned child as the host creates it: applied with the create-only
/// resourceVersion, unless the plugin set one itself.
fn as_created(manifest: &Value) -> Value {
    let mut manifest = manifest.clone();
    let meta = &mut manifest["metadata"];
    if meta.get("resourceVersion").is_none() {
        meta["resourceVersion"] = json!(super::cluster::CREATE_ONLY);
    }
    manifest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_and_plan_show_what_run_writes_for_every_shipped_sample() {
    let mut children_compared = 0;
    for (name, file) in SAMPLES {
        let at = format!("{name} {file}");
        let (sandbox, plugin) = load_file(crate::fixtures::plugin(name));
        let pods = plugin.info().related.first().map(|kind| {
            let mut feed = super::related::Feed::new(kind);
            feed.list([]);
            feed
        });
        let s = Scenario::configured((sandbox, plugin), pods.as_ref(), |ctx| {
            ctx.with_pinned(PINNED)
        });
        let parent = s.store.create(&s.parents, sample(file));
        let path = format!(
            "{}/{}",
            s.parents,
            parent["metadata"]["name"].as_str().unwrap()
        );

        // `capstan run`: the parent's first reconcile.
        let mark = s.mark();
        s.reconcile(&path).await;
        let run = s.calls.all()[mark..].to_vec();
        let created = child_writes(&run, &s.parents);
        children_compared += created.len();
        let status = run
            .iter()
            .find(|c| c.method == Method::PATCH && c.path == format!("{path}/status"))
            .map(|c| c.body["status"].clone())
            .unwrap_or_else(|| panic!("{at}: the first reconcile writes the status"));

        // `capstan render` of the parent as the reconcile saw it, with no children.
        let rendered = {
            let plugin = s.plugin.clone();
            let observed = Observed {
                parent,
                children: Vec::new(),
                related: Vec::new(),
            };
            tokio::task::spawn_blocking(move || {
                render::render_world(&plugin, &World::pinned(observed, PINNED))
            })
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{at}: {e}"))
            .plan
        };
        let rendered_children: BTreeMap<String, Value> = rendered
            .children
            .iter()
            .map(|child| {
                let kind = &s.plugin.info().children[child.kind_index];
                let collection =
                    super::fake_api::path(&kind.api_version(), &kind.plural, Some(NS), "");
                (
                    format!("{collection}/{}", child.name),
                    as_created(&child.manifest),
                )
            })
            .collect();
        assert_eq!(
            rendered_children.keys().collect::<Vec<_>>(),
            created.keys().collect::<Vec<_>>(),
            "{at}: render and run name the same children"
        );
        for (key, manifest) in &rendered_children {
            assert_eq!(
                manifest, &created[key],
                "{at}: {key} as rendered and as run"
            );
        }
        assert_eq!(
            rendered.status, status,
            "{at}: the status as rendered and as run"
        );

        // `capstan plan --live` against a cluster that holds only the parent: every
        // child would be created, by the same requests as a dry run.
        let live = Store::new();
        live.create(&s.parents, sample(file));
        let (client, calls) = live.client();
        let outcomes = preview::plan_live(&client, &s.plugin, Some(NS), Some(PINNED))
            .await
            .unwrap_or_else(|e| panic!("{at}: {e}"));
        assert_eq!(outcomes.len(), 1, "{at}: one parent planned");
        let Outcome::Changes { children, .. } = &outcomes[0].outcome else {
            panic!("{at}: plan fails: {:?}", outcomes[0].outcome);
        };
        assert_eq!(children.len(), created.len(), "{at}: {children:?}");
        let calls = calls.all();
        let writes: Vec<&Call> = calls
            .iter()
            .filter(|c| c.method != Method::GET && !c.path.contains("/events"))
            .collect();
        assert!(
            writes.iter().all(|c| c.has_query("dryRun=All")),
            "{at}: plan writes nothing: {writes:?}"
        );
        assert_eq!(
            child_writes(&calls, &s.parents),
            created,
            "{at}: plan's dry runs and run's writes"
        );
    }
    // The Uuid plugin writes only a status; the others create children.
    assert!(
        children_compared >= 5,
        "{children_compared} children compared"
    );
}
