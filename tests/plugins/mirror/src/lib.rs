//! Test plugin `mirror` (test.capstan.dev/v1 Mirror), of contract 0.2.0: copies a value
//! from a user's ConfigMap named in its spec into its status, lists the Pods of the
//! StatefulSet it keeps, and tears down in waves (the Service, then the StatefulSet).
//! `spec.mode` makes its `customize` misbehave, for the hostile tests.

use capstan_sdk::k8s_openapi::api::apps::v1::StatefulSet;
use capstan_sdk::k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use capstan_sdk::prelude::*;
use serde::Deserialize;
use serde_json::json;

#[path = "../../test_crd.rs"]
mod test_crd;

/// The Mirror spec.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MirrorSpec {
    /// The ConfigMap whose `data.value` the status copies.
    pub config_map: Option<String>,
    /// Replicas of the StatefulSet (none: no StatefulSet and no Service).
    pub replicas: Option<i32>,
    /// Put the StatefulSet's Pods on kwok's simulated nodes.
    pub kwok: bool,
    /// A misbehaviour of `customize`: too-many (100 000 requests), other-namespace (a
    /// name that reaches into kube-system), loop (never returns).
    pub mode: String,
}

/// The label the StatefulSet's Pods carry: its parent's name.
const INSTANCE: &str = "mirror.test.capstan.dev/instance";

/// The plugin.
pub struct Mirror;

impl Plugin for Mirror {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "mirror",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("test.capstan.dev", "v1", "Mirror", "mirrors"),
        )
        .child(KindRef::of::<Service>())
        .child(KindRef::of::<StatefulSet>())
        .related(KindRef::of::<ConfigMap>())
        .related(KindRef::of::<Pod>())
        .with_finalizer()
        .crd_json(&test_crd::crd("Mirror", "mirrors"))
    }

    fn customize(ctx: &Context) -> Result<Vec<Related>, Error> {
        let spec: MirrorSpec = ctx.spec()?;
        match spec.mode.as_str() {
            "too-many" => {
                return Ok((0..100_000)
                    .map(|i| Related::named::<ConfigMap>(&format!("cm-{i}")))
                    .collect());
            }
            "other-namespace" => {
                return Ok(vec![Related::named::<ConfigMap>(
                    "kube-system/extension-apiserver-authentication",
                )]);
            }
            "loop" => loop {
                std::hint::black_box(0);
            },
            _ => {}
        }
        let mut requests = vec![Related::labelled::<Pod>([(INSTANCE, ctx.name())])];
        if let Some(name) = &spec.config_map {
            requests.push(Related::named::<ConfigMap>(name));
        }
        Ok(requests)
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let spec: MirrorSpec = ctx.spec()?;
        let value = spec
            .config_map
            .as_deref()
            .and_then(|name| ctx.related_named::<ConfigMap>(name))
            .and_then(|cm| cm.data?.get("value").cloned());
        let mut pods: Vec<String> = ctx
            .related::<Pod>()
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        pods.sort();
        let mut desired = Desired::new();
        if let Some(replicas) = spec.replicas {
            let name = ctx.name();
            let mut pod_spec = json!({"containers": [{"name": "main", "image": "pause:3.10"}]});
            if spec.kwok {
                pod_spec["nodeSelector"] = json!({"type": "kwok"});
                pod_spec["tolerations"] = json!([{"key": "kwok.x-k8s.io/node",
                    "operator": "Exists", "effect": "NoSchedule"}]);
            }
            desired.child(&json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name},
                "spec": {"clusterIP": "None", "selector": {INSTANCE: name}}}))?;
            desired.child(&json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {"name": name},
                "spec": {"replicas": replicas, "serviceName": name,
                    "selector": {"matchLabels": {INSTANCE: name}},
                    "template": {"metadata": {"labels": {INSTANCE: name}}, "spec": pod_spec}}}))?;
        }
        desired.status(&json!({"value": value, "pods": pods}))?;
        Ok(desired)
    }

    fn finalize(ctx: &Context) -> Result<Finalized, Error> {
        let name = ctx.name();
        if ctx.child::<Service>(name).is_some() {
            return Ok(Finalized::wave().delete::<Service>(name));
        }
        if ctx.child::<StatefulSet>(name).is_some() {
            return Ok(Finalized::wave().delete::<StatefulSet>(name));
        }
        Ok(Finalized::done())
    }
}

capstan_sdk::export_plugin!(Mirror);

#[cfg(test)]
mod tests {
    use super::*;
    use capstan_sdk::testing::observe_related_for;

    fn parent(spec: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "test.capstan.dev/v1", "kind": "Mirror",
            "metadata": {"name": "m", "namespace": "ns"}, "spec": spec})
    }

    #[test]
    fn status_copies_the_config_maps_value_and_lists_the_pods() {
        let ctx = observe_related_for::<Mirror>(
            parent(json!({"configMap": "app"})),
            vec![],
            vec![
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app"}, "data": {"value": "42"}}),
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-1"}}),
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-0"}}),
            ],
        );
        let desired = Mirror::reconcile(&ctx).unwrap();
        assert_eq!(
            desired.status_value().unwrap(),
            &json!({"value": "42", "pods": ["m-0", "m-1"]})
        );
    }

    #[test]
    fn teardown_goes_service_then_statefulset_then_done() {
        let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "m"}});
        let sts =
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "m"}});
        let step = |children: Vec<serde_json::Value>| {
            Mirror::finalize(&observe_related_for::<Mirror>(
                parent(json!({})),
                children,
                vec![],
            ))
            .unwrap()
        };
        let first = step(vec![svc.clone(), sts.clone()]);
        assert_eq!(
            first.deletes(),
            [("v1".into(), "Service".into(), "m".into())]
        );
        let second = step(vec![sts]);
        assert_eq!(
            second.deletes(),
            [("apps/v1".into(), "StatefulSet".into(), "m".into())]
        );
        let last = step(vec![]);
        assert!(last.is_done() && last.deletes().is_empty());
    }
}
