//! The one `bindgen!` of the plugin world, and conversions to the plain types of
//! [`crate::contract`]. Nothing outside [`crate::plugin`] sees the generated types.

use crate::contract;

/// The contract version this host speaks, as in `wit/capstan.wit`.
pub const CONTRACT_VERSION: &str = "0.1.0";

// Exports are async: every call runs on a fiber that yields to the sandbox runtime at
// each epoch tick, so that a host-side timeout can end it whatever the guest does
// (busy loop, WASI sleep, poll). The `log` import stays synchronous: it never blocks.
wasmtime::component::bindgen!({
    world: "plugin",
    path: "../wit",
    exports: { default: async },
});

pub use self::capstan::plugin::log::{Host as LogHost, Level};
use self::capstan::plugin::types as wit;

/// What a plugin observes, as the WIT interface carries it.
pub type WitObserved = wit::Observed;

impl From<wit::KindRef> for contract::KindRef {
    fn from(k: wit::KindRef) -> Self {
        contract::KindRef {
            group: k.group,
            version: k.version,
            kind: k.kind,
            plural: k.plural,
            namespaced: k.namespaced,
        }
    }
}

impl From<wit::PluginInfo> for contract::PluginInfo {
    fn from(info: wit::PluginInfo) -> Self {
        contract::PluginInfo {
            name: info.name,
            version: info.version,
            parent: info.parent.into(),
            children: info.children.into_iter().map(Into::into).collect(),
            finalizer: info.finalizer,
            resync_seconds: info.resync_seconds,
            crd: info.crd,
        }
    }
}

/// Serializes the observed state into the JSON texts the contract carries.
pub fn observed_to_wit(observed: &contract::Observed) -> wit::Observed {
    wit::Observed {
        parent: observed.parent.to_string(),
        children: observed
            .children
            .iter()
            .map(|c| wit::ObservedChild {
                kind_index: c.kind_index,
                object: c.object.to_string(),
            })
            .collect(),
    }
}

fn event(e: wit::Event) -> contract::Event {
    contract::Event {
        type_: match e.type_ {
            wit::EventType::Normal => contract::EventType::Normal,
            wit::EventType::Warning => contract::EventType::Warning,
        },
        reason: e.reason,
        message: e.message,
    }
}

impl From<wit::Desired> for contract::Desired {
    fn from(d: wit::Desired) -> Self {
        contract::Desired {
            children: d.children,
            status: d.status,
            conditions: d
                .conditions
                .into_iter()
                .map(|c| contract::Condition {
                    type_: c.type_,
                    status: match c.status {
                        wit::ConditionStatus::True => contract::ConditionStatus::True,
                        wit::ConditionStatus::False => contract::ConditionStatus::False,
                        wit::ConditionStatus::Unknown => contract::ConditionStatus::Unknown,
                    },
                    reason: c.reason,
                    message: c.message,
                })
                .collect(),
            events: d.events.into_iter().map(event).collect(),
            requeue_after_seconds: d.requeue_after_seconds,
        }
    }
}

impl From<wit::FinalizeResult> for contract::FinalizeResult {
    fn from(f: wit::FinalizeResult) -> Self {
        contract::FinalizeResult {
            done: f.done,
            events: f.events.into_iter().map(event).collect(),
            requeue_after_seconds: f.requeue_after_seconds,
        }
    }
}

impl From<wit::Error> for contract::PluginError {
    fn from(e: wit::Error) -> Self {
        match e {
            wit::Error::Invalid(m) => contract::PluginError::Invalid(m),
            wit::Error::Retry(m) => contract::PluginError::Retry(m),
        }
    }
}
