//! Capstan: a Kubernetes operator host that runs operators as sandboxed WebAssembly
//! components.
//!
//! A plugin (a `wasm32-wasip2` component implementing `wit/capstan.wit`) reconciles one
//! custom resource kind as a pure function of what the host observed. The host loads it
//! ([`plugin`]), calls it in a fresh sandboxed instance, validates what it returns
//! ([`validate`]), turns it into the writes to make ([`plan`]) and, in `capstan run`,
//! applies them to the cluster.
#![deny(unsafe_code)]

pub mod contract;
pub mod convert;
pub mod diff;
pub mod oci;
pub mod operator;
pub mod ownership;
pub mod plan;
pub mod plugin;
pub mod rbac;
pub mod render;
pub mod shard;
pub mod signature;
pub mod validate;
