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
//! #     use capstan_sdk::testing::observe_for;
//! #     let ctx = observe_for::<Greeter>(
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
mod related;
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
pub use info::{FailurePolicy, KindRef, PluginInfo};
pub use k8s_openapi;
pub use related::Related;
pub use serde_json;

/// Everything a plugin usually needs.
pub mod prelude {
    pub use crate::{
        Condition, ConditionStatus, Context, Desired, Error, Event, FailurePolicy, Finalized,
        KindRef, Plugin, PluginInfo, Related,
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
    /// was set. Return [`Finalized::wave`]s to delete children in order, then
    /// [`Finalized::done`]. The default reports done at once.
    fn finalize(ctx: &Context) -> Result<Finalized, Error> {
        let _ = ctx;
        Ok(Finalized::done())
    }

    /// Which related objects this parent needs (only [`Context::parent`] and what
    /// derives from it are set in `ctx`). Called before each `reconcile` and
    /// `finalize` of a plugin that declares related kinds ([`PluginInfo::related`]);
    /// the host reconciles the parent again when one of them changes. The default
    /// asks for none.
    fn customize(ctx: &Context) -> Result<Vec<Related>, Error> {
        let _ = ctx;
        Ok(Vec::new())
    }

    /// Admission: may a parent become `new` (`old` is `None` on create)? `Ok` allows
    /// it, with warnings `kubectl` prints; `Err` refuses it with a one-line message.
    /// Called only when [`PluginInfo::validates`] was set. The default allows all.
    fn validate(
        old: Option<&serde_json::Value>,
        new: &serde_json::Value,
    ) -> Result<Vec<String>, String> {
        let _ = (old, new);
        Ok(Vec::new())
    }

    /// Conversion: `object` (any version the CRD serves) as `to_version` of the same
    /// group. Must be lossless both ways. Called only when [`PluginInfo::converts`] was
    /// set. The default refuses.
    fn convert(object: serde_json::Value, to_version: &str) -> Result<serde_json::Value, String> {
        let _ = object;
        Err(format!(
            "this plugin does not convert (asked for {to_version})"
        ))
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

            fn customize(
                parent: ::std::string::String,
            ) -> ::core::result::Result<
                ::std::vec::Vec<$crate::bindings::capstan::plugin::types::RelatedRequest>,
                $crate::bindings::capstan::plugin::types::Error,
            > {
                $crate::__private::customize::<$plugin>(parent)
            }

            fn validate(
                old: ::core::option::Option<::std::string::String>,
                new: ::std::string::String,
            ) -> ::core::result::Result<
                ::std::vec::Vec<::std::string::String>,
                ::std::string::String,
            > {
                $crate::__private::validate::<$plugin>(old, new)
            }

            fn convert(
                object: ::std::string::String,
                to_version: ::std::string::String,
            ) -> ::core::result::Result<::std::string::String, ::std::string::String> {
                $crate::__private::convert::<$plugin>(object, to_version)
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
        let info = P::describe();
        let ctx = Context::from_wit(info.clone(), observed).map_err(error)?;
        P::finalize(&ctx)
            .and_then(|f| f.into_wit(&info))
            .map_err(error)
    }

    pub fn customize<P: Plugin>(parent: String) -> Result<Vec<wit::RelatedRequest>, wit::Error> {
        let info = P::describe();
        let ctx = Context::of_parent(info.clone(), &parent).map_err(error)?;
        P::customize(&ctx)
            .and_then(|requests| {
                requests
                    .into_iter()
                    .map(|r| r.into_wit(&info))
                    .collect::<Result<Vec<_>, Error>>()
            })
            .map_err(error)
    }

    fn json(text: &str, what: &str) -> Result<serde_json::Value, String> {
        serde_json::from_str(text)
            .map_err(|e| format!("the host sent {what} that is not JSON: {e}"))
    }

    pub fn validate<P: Plugin>(old: Option<String>, new: String) -> Result<Vec<String>, String> {
        let old = old.map(|o| json(&o, "an old object")).transpose()?;
        let new = json(&new, "an object")?;
        P::validate(old.as_ref(), &new)
    }

    pub fn convert<P: Plugin>(object: String, to_version: String) -> Result<String, String> {
        let object = json(&object, "an object")?;
        P::convert(object, &to_version).map(|o| o.to_string())
    }
}
