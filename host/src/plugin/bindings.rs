//! The `bindgen!` of each contract release the host runs, and conversions between their
//! types and the plain types of [`crate::contract`]. Nothing outside [`crate::plugin`]
//! sees the generated types.
//!
//! A release's interfaces carry its version in their names (`capstan:plugin/
//! reconciler@0.2.0`), so a component built for 0.1.0 and one built for 0.2.0 import and
//! export different interfaces: the linker holds both releases' `log`, and a loaded
//! plugin keeps the pre-instantiated bindings of its own release ([`Pre`]).

/// The contract release this host's SDKs build for, as in `wit/capstan.wit`.
pub const CONTRACT_VERSION: &str = "0.2.0";

/// Every release this host runs, newest first.
pub const CONTRACT_VERSIONS: &[&str] = &[CONTRACT_VERSION, v0_1::VERSION];

/// Contract 0.2.0 (`wit/capstan.wit`).
pub mod v0_2 {
    /// The release.
    pub const VERSION: &str = "0.2.0";

    // Exports are async: every call runs on a fiber that yields to the sandbox runtime
    // at each epoch tick, so that a host-side timeout can end it whatever the guest
    // does (busy loop, WASI sleep, poll). The `log` import stays synchronous.
    wasmtime::component::bindgen!({
        world: "plugin",
        path: "../wit/capstan.wit",
        exports: { default: async },
    });
}

/// Contract 0.1.0 (`wit/released/0.1.0.wit`), kept so that plugins built for it run
/// unchanged.
pub mod v0_1 {
    /// The release.
    pub const VERSION: &str = "0.1.0";

    wasmtime::component::bindgen!({
        world: "plugin",
        path: "../wit/released/0.1.0.wit",
        exports: { default: async },
    });
}

/// A plugin's pre-instantiated component, in the bindings of its release.
pub enum Pre<T: 'static> {
    /// Built for 0.1.0.
    V0_1(v0_1::PluginPre<T>),
    /// Built for 0.2.0.
    V0_2(v0_2::PluginPre<T>),
}

// Not derived: a derive would ask `T: Clone`, which the store's state is not.
impl<T: 'static> Clone for Pre<T> {
    fn clone(&self) -> Self {
        match self {
            Pre::V0_1(p) => Pre::V0_1(p.clone()),
            Pre::V0_2(p) => Pre::V0_2(p.clone()),
        }
    }
}

impl<T: 'static> Pre<T> {
    /// The release the plugin was built for.
    pub fn version(&self) -> &'static str {
        match self {
            Pre::V0_1(_) => v0_1::VERSION,
            Pre::V0_2(_) => v0_2::VERSION,
        }
    }
}

/// The conversions that are the same in every release: its types have the same shape
/// and names, in a module of their own.
macro_rules! common_conversions {
    ($wit:path) => {
        use $wit as wit;

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

        impl From<wit::Error> for contract::PluginError {
            fn from(e: wit::Error) -> Self {
                match e {
                    wit::Error::Invalid(m) => contract::PluginError::Invalid(m),
                    wit::Error::Retry(m) => contract::PluginError::Retry(m),
                }
            }
        }
    };
}

/// Conversions for 0.1.0 plugins: what 0.1.0 lacks is empty.
pub mod from_v0_1 {
    use crate::contract;

    common_conversions!(super::v0_1::capstan::plugin::types);

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
                related: Vec::new(),
                validation: None,
                conversion: false,
                contract: super::v0_1::VERSION.into(),
            }
        }
    }

    /// The observed state as 0.1.0 carries it: without related objects (a 0.1.0 plugin
    /// declares no related kind, so there are none).
    pub fn observed(observed: &contract::Observed) -> wit::Observed {
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

    impl From<wit::FinalizeResult> for contract::FinalizeResult {
        fn from(f: wit::FinalizeResult) -> Self {
            contract::FinalizeResult {
                done: f.done,
                events: f.events.into_iter().map(event).collect(),
                requeue_after_seconds: f.requeue_after_seconds,
                delete: Vec::new(),
            }
        }
    }
}

/// Conversions for 0.2.0 plugins.
pub mod from_v0_2 {
    use crate::contract;

    common_conversions!(super::v0_2::capstan::plugin::types);

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
                related: info.related.into_iter().map(Into::into).collect(),
                validation: info.validation.map(|p| match p {
                    wit::FailurePolicy::Fail => contract::FailurePolicy::Fail,
                    wit::FailurePolicy::Ignore => contract::FailurePolicy::Ignore,
                }),
                conversion: info.conversion,
                contract: super::v0_2::VERSION.into(),
            }
        }
    }

    /// The observed state as 0.2.0 carries it.
    pub fn observed(observed: &contract::Observed) -> wit::Observed {
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
            related: observed
                .related
                .iter()
                .map(|r| wit::RelatedObject {
                    kind_index: r.kind_index,
                    object: r.object.to_string(),
                })
                .collect(),
        }
    }

    impl From<wit::FinalizeResult> for contract::FinalizeResult {
        fn from(f: wit::FinalizeResult) -> Self {
            contract::FinalizeResult {
                done: f.done,
                events: f.events.into_iter().map(event).collect(),
                requeue_after_seconds: f.requeue_after_seconds,
                delete: f
                    .delete
                    .into_iter()
                    .map(|c| contract::ChildRef {
                        kind_index: c.kind_index,
                        name: c.name,
                    })
                    .collect(),
            }
        }
    }

    impl From<wit::RelatedRequest> for contract::RelatedRequest {
        fn from(r: wit::RelatedRequest) -> Self {
            contract::RelatedRequest {
                kind_index: r.kind_index,
                selector: match r.selector {
                    wit::Selector::Name(name) => contract::Selector::Name(name),
                    wit::Selector::Labels(labels) => contract::Selector::Labels(labels),
                },
            }
        }
    }
}
