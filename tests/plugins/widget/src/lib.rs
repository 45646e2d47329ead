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
    /// foreign-owner, bad-status, invalid, retry, print; and the hostile ones of the
    /// sandbox suite: sleep, clock-poll, stdin, flood, file, socket, env, huge-alloc,
    /// stack, nested-json, big-status, many-children.
    pub mode: String,
    /// Ask for a requeue after this many seconds.
    pub requeue_seconds: Option<u32>,
}

/// The misbehaviour of a build made with `CAPSTAN_WIDGET_MODE` on every parent whose
/// spec asks for none: `cargo xtask plugins` builds `widget-broken.wasm` so, the "new
/// version" that regressed in the canary tests (and `widget-rebuilt.wasm`, a healthy
/// one with other bytes).
const BUILT_MODE: Option<&str> = option_env!("CAPSTAN_WIDGET_MODE");

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
        let mode = match spec.mode.as_str() {
            "" => BUILT_MODE.unwrap_or_default(),
            mode => mode,
        };
        match mode {
            // `rebuilt`: the same behaviour in other bytes (`widget-rebuilt.wasm`, a
            // healthy new version for the registry tests).
            "" | "rebuilt" => {}
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
            "foreign-owner" => {
                desired.child(&json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("{}-owned", ctx.name()), "ownerReferences": [{
                        "apiVersion": "v1", "kind": "Secret", "name": "someone-else",
                        "uid": "7e1f0c2a-5b8d-4f3e-9a6c-0d4b2e8f1a93", "controller": true}]}}))?;
            }
            "bad-status" => {
                desired.status(&json!(["not", "an", "object"]))?;
                return Ok(desired);
            }
            "invalid" => return Err(Error::invalid("spec.mode says this spec is invalid")),
            "retry" => return Err(Error::retry("spec.mode asks for a retry")),
            // Time spent outside wasm code: a WASI sleep, a clock polled in a loop.
            "sleep" => std::thread::sleep(std::time::Duration::from_secs(30)),
            "clock-poll" => {
                let start = std::time::Instant::now();
                while start.elapsed() < std::time::Duration::from_secs(30) {
                    std::hint::black_box(std::time::SystemTime::now());
                }
            }
            "stdin" => {
                let mut line = String::new();
                let n = std::io::stdin().read_line(&mut line).unwrap_or(0);
                capstan_sdk::info!("stdin gave {n} bytes");
            }
            "flood" => {
                let chunk = "x".repeat(1023);
                for _ in 0..(10 << 10) {
                    println!("{chunk}");
                }
            }
            // What the sandbox grants nothing of: each must fail inside the plugin.
            "file" => {
                let read = std::fs::read_to_string("/etc/passwd");
                return Err(Error::invalid(format!("file read: {}", outcome(&read))));
            }
            "socket" => {
                let connected = std::net::TcpStream::connect("127.0.0.1:80");
                return Err(Error::invalid(format!(
                    "socket connect: {}",
                    outcome(&connected)
                )));
            }
            "env" => {
                let vars = std::env::vars().count();
                let args = std::env::args().count();
                return Err(Error::invalid(format!(
                    "environment: {vars} variables, {args} arguments"
                )));
            }
            "huge-alloc" => {
                let big = vec![7u8; 1 << 30];
                std::hint::black_box(&big);
            }
            "stack" => {
                fn deeper(n: u64) -> u64 {
                    let pad = std::hint::black_box([n; 64]);
                    if n == u64::MAX {
                        0
                    } else {
                        deeper(n + 1) + pad[3]
                    }
                }
                std::hint::black_box(deeper(0));
            }
            "nested-json" => {
                // Deeper than any real status; built without recursion in the guest.
                let mut nested = json!(1);
                for _ in 0..1000 {
                    nested = json!({ "a": nested });
                }
                desired.status(&nested)?;
                return Ok(desired);
            }
            "big-status" => {
                desired.status(&json!({"blob": "x".repeat(20 << 20)}))?;
                return Ok(desired);
            }
            "many-children" => {
                for i in 0..100_000 {
                    desired.child(&json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": format!("{}-many-{i}", ctx.name())}}))?;
                }
                return Ok(desired);
            }
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

/// "ok" or the error, for the modes that report what the sandbox let them do.
fn outcome<T>(r: &std::io::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("refused ({e})"),
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
