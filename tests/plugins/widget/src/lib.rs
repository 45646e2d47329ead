//! Test plugin `widget` (test.capstan.dev/v1 Widget): makes `spec.count` ConfigMaps and
//! optionally a Service per parent, and misbehaves on request (`spec.mode`) so that the
//! host's sandbox, validation and error paths can be tested end to end.

use capstan_sdk::prelude::*;
use serde::Deserialize;
use serde_json::json;

#[path = "../../test_crd.rs"]
mod test_crd;
use test_crd::crd;

/// The Widget spec.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WidgetSpec {
    /// How many ConfigMaps to keep (`<name>-0` … `<name>-{count-1}`).
    pub count: u32,
    /// Whether to keep a Service named after the parent.
    pub service: bool,
    /// Data written into every ConfigMap.
    pub message: String,
    /// A misbehaviour: trap, panic, loop, oom, undeclared-kind, other-namespace,
    /// foreign-owner, bad-status, invalid, retry, print.
    pub mode: String,
    /// Ask for a requeue after this many seconds.
    pub requeue_seconds: Option<u32>,
}

/// The plugin.
pub struct Widget;

impl Plugin for Widget {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "widget",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("test.capstan.dev", "v1", "Widget", "widgets"),
        )
        .child(KindRef::namespaced("", "v1", "ConfigMap", "configmaps"))
        .child(KindRef::namespaced("", "v1", "Service", "services"))
        .crd_json(&crd("Widget", "widgets"))
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let spec: WidgetSpec = ctx.spec()?;
        let mut desired = Desired::new();
        match spec.mode.as_str() {
            "" => {}
            "trap" => core::arch::wasm32_unreachable(),
            "panic" => panic!("widget asked to panic"),
            "loop" => loop {
                std::hint::black_box(0);
            },
            "oom" => {
                let mut hog: Vec<Vec<u8>> = Vec::new();
                loop {
                    hog.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hog);
                }
            }
            "undeclared-kind" => {
                desired.child(&json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": format!("{}-secret", ctx.name())}}))?;
            }
            "other-namespace" => {
                desired.child(&json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("{}-elsewhere", ctx.name()), "namespace": "kube-system"}}))?;
            }
            "bad-status" => {
                desired.status(&json!(["not", "an", "object"]))?;
                return Ok(desired);
            }
            "invalid" => return Err(Error::invalid("spec.mode says this spec is invalid")),
            "retry" => return Err(Error::retry("spec.mode asks for a retry")),
            "print" => {
                println!("hello from widget {}", ctx.name());
                capstan_sdk::warn!("widget {} logs a warning", ctx.name());
            }
            other => return Err(Error::invalid(format!("unknown spec.mode {other:?}"))),
        }
        for i in 0..spec.count {
            desired.child(&json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": format!("{}-{i}", ctx.name())},
                "data": {"index": i.to_string(), "message": spec.message},
            }))?;
        }
        if spec.service {
            desired.child(&json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": ctx.name()},
                "spec": {"selector": {"widget": ctx.name()}, "ports": [{"port": 80, "targetPort": 8080}]},
            }))?;
        }
        // What the host showed the plugin, so that tests can check what it observes.
        let mut observed: Vec<String> = ctx
            .children::<capstan_sdk::k8s_openapi::api::core::v1::ConfigMap>()
            .into_iter()
            .filter_map(|c| c.metadata.name)
            .collect();
        observed.sort();
        desired.status(&json!({"configMaps": spec.count, "service": spec.service, "observedConfigMaps": observed}))?;
        if let Some(s) = spec.requeue_seconds {
            desired.requeue_after(std::time::Duration::from_secs(u64::from(s)));
        }
        Ok(desired)
    }
}

capstan_sdk::export_plugin!(Widget);

#[cfg(not(target_arch = "wasm32"))]
mod core {
    pub mod arch {
        pub fn wasm32_unreachable() -> ! {
            std::process::abort()
        }
    }
}

#[cfg(target_arch = "wasm32")]
mod core {
    pub mod arch {
        pub fn wasm32_unreachable() -> ! {
            ::core::arch::wasm32::unreachable()
        }
    }
}
