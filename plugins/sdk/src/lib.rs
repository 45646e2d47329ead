//! Write Capstan plugins: Kubernetes reconcilers that run as sandboxed WebAssembly
//! components inside the Capstan host.
//!
//! A plugin reconciles one custom resource kind. It is a pure function of what the host
//! observed — the parent object and the children it controls — and returns the children
//! it wants, its status, conditions and events. The host does every API call: it applies
//! the children with server-side apply (adding the namespace, the controller
//! ownerReference and its labels), deletes the children no longer wanted, and writes the
//! status through the `/status` subresource.
//!
//! Implement [`Plugin`] and call [`export_plugin!`]. Build with
//! `cargo build --target wasm32-wasip2 --release` (or `cargo component build --release`);
//! the crate must have `crate-type = ["cdylib", "rlib"]`.
//!
//! # Example
//!
//! A plugin that keeps one ConfigMap per `Greeting` and reports how many it made:
//!
//! ```
//! use capstan_sdk::prelude::*;
//! use capstan_sdk::k8s_openapi::api::core::v1::ConfigMap;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Deserialize)]
//! struct GreetingSpec {
//!     message: String,
//! }
//!
//! #[derive(Serialize)]
//! struct GreetingStatus {
//!     greeted: bool,
//! }
//!
//! struct Greeter;
//!
//! impl Plugin for Greeter {
//!     fn describe() -> PluginInfo {
//!         PluginInfo::new(
//!             "greeter",
//!             env!("CARGO_PKG_VERSION"),
//!             KindRef::namespaced("example.com", "v1", "Greeting", "greetings"),
//!         )
//!         .child(KindRef::of::<ConfigMap>())
//!     }
//!
//!     fn reconcile(ctx: &Context) -> Result<Desired, Error> {
//!         let spec: GreetingSpec = ctx.spec()?;
//!         let mut desired = Desired::new();
//!         desired.child(&serde_json::json!({
//!             "apiVersion": "v1",
//!             "kind": "ConfigMap",
//!             "metadata": { "name": format!("{}-greeting", ctx.name()) },
//!             "data": { "message": spec.message },
//!         }))?;
//!         desired.status(&GreetingStatus { greeted: true })?;
//!         Ok(desired)
//!     }
//! }
//!
//! capstan_sdk::export_plugin!(Greeter);
//!
//! # fn main() {
//! #     use capstan_sdk::testing::observe;
//! #     let ctx = observe(
//! #         serde_json::json!({"apiVersion": "example.com/v1", "kind": "Greeting",
//! #             "metadata": {"name": "hi", "namespace": "default"},
//! #             "spec": {"message": "hello"}}),
//! #         vec![],
//! #     );
//! #     let desired = Greeter::reconcile(&ctx).unwrap();
//! #     assert_eq!(desired.children().len(), 1);
//! # }
//! ```

mod context;
mod desired;
mod info;
pub mod log;
pub mod random;
pub mod testing;

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "plugin",
        path: "wit",
        pub_export_macro: true,
        export_macro_name: "__export_world",
        default_bindings_module: "capstan_sdk::bindings",
    });
}

pub use context::Context;
pub use desired::{Condition, ConditionStatus, Desired, Event, EventType, Finalized};
pub use info::{KindRef, PluginInfo};
pub use k8s_openapi;
pub use serde_json;

/// Everything a plugin usually needs.
pub mod prelude {
    pub use crate::{
        Condition, ConditionStatus, Context, Desired, Error, Event, Finalized, KindRef, Plugin,
        PluginInfo,
    };
}

/// Why a reconcile or finalize failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The spec is wrong; nothing changes until it does. The host applies nothing, sets
    /// `Ready=False` with this message, posts a Warning event and waits for a new spec.
    Invalid(String),
    /// A transient failure; the host retries with exponential backoff.
    Retry(String),
}

impl Error {
    /// An [`Error::Invalid`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }

    /// An [`Error::Retry`].
    pub fn retry(message: impl Into<String>) -> Self {
        Error::Retry(message.into())
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Invalid(m) => write!(f, "invalid: {m}"),
            Error::Retry(m) => write!(f, "retry: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// A Capstan plugin. Implement it on a unit struct and export it with [`export_plugin!`].
pub trait Plugin {
    /// What the plugin reconciles and may create. Must return the same value every time.
    fn describe() -> PluginInfo;

    /// Computes the desired state from the observed one. Must be idempotent: generate
    /// things such as passwords only when they are absent from what was observed.
    fn reconcile(ctx: &Context) -> Result<Desired, Error>;

    /// Cleans up before the parent is deleted; called only if [`PluginInfo::finalizer`]
    /// was set. The default reports done at once.
    fn finalize(ctx: &Context) -> Result<Finalized, Error> {
        let _ = ctx;
        Ok(Finalized::done())
    }
}

/// Exports a [`Plugin`] implementation as the component's `capstan:plugin/reconciler`.
///
/// Use it once per plugin crate, at the crate root: `capstan_sdk::export_plugin!(MyPlugin);`
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        #[doc(hidden)]
        pub struct __CapstanExport;

        impl $crate::bindings::exports::capstan::plugin::reconciler::Guest for __CapstanExport {
            fn describe() -> $crate::bindings::capstan::plugin::types::PluginInfo {
                $crate::__private::describe::<$plugin>()
            }

            fn reconcile(
                observed: $crate::bindings::capstan::plugin::types::Observed,
            ) -> ::core::result::Result<
                $crate::bindings::capstan::plugin::types::Desired,
                $crate::bindings::capstan::plugin::types::Error,
            > {
                $crate::__private::reconcile::<$plugin>(observed)
            }

            fn finalize(
                observed: $crate::bindings::capstan::plugin::types::Observed,
            ) -> ::core::result::Result<
                $crate::bindings::capstan::plugin::types::FinalizeResult,
                $crate::bindings::capstan::plugin::types::Error,
            > {
                $crate::__private::finalize::<$plugin>(observed)
            }
        }

        // Only components export the contract: in a native build (unit and integration
        // tests) the export names, such as `capstan:plugin/reconciler@0.1.0#describe`,
        // are not valid linker symbols and would break linking the cdylib.
        #[cfg(target_arch = "wasm32")]
        $crate::bindings::__export_world!(__CapstanExport with_types_in $crate::bindings);
    };
}

#[doc(hidden)]
pub mod __private {
    use crate::bindings::capstan::plugin::types as wit;
    use crate::{Context, Error, Plugin};

    fn error(e: Error) -> wit::Error {
        match e {
            Error::Invalid(m) => wit::Error::Invalid(m),
            Error::Retry(m) => wit::Error::Retry(m),
        }
    }

    pub fn describe<P: Plugin>() -> wit::PluginInfo {
        P::describe().into_wit()
    }

    pub fn reconcile<P: Plugin>(observed: wit::Observed) -> Result<wit::Desired, wit::Error> {
        let ctx = Context::from_wit(P::describe(), observed).map_err(error)?;
        P::reconcile(&ctx).map(|d| d.into_wit()).map_err(error)
    }

    pub fn finalize<P: Plugin>(observed: wit::Observed) -> Result<wit::FinalizeResult, wit::Error> {
        let ctx = Context::from_wit(P::describe(), observed).map_err(error)?;
        P::finalize(&ctx).map(|f| f.into_wit()).map_err(error)
    }
}
