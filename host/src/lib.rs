//! Capstan: a Kubernetes operator host that runs operators as sandboxed WebAssembly
//! components.
//!
//! A plugin (a `wasm32-wasip2` component implementing `wit/capstan.wit`) reconciles one
//! custom resource kind as a pure function of what the host observed. The host loads it
//! ([`plugin`]), calls it in a fresh sandboxed instance, validates what it returns
//! ([`validate`]), turns it into the writes to make ([`plan`]) and, in `capstan run`,
//! applies them to the cluster. Every front door goes through one [`engine`]: Observe
//! a parent's world, Decide a plan, Act on it.
#![deny(unsafe_code)]

pub mod author;
pub mod contract;
pub mod convert;
pub mod diff;
pub mod engine;
#[cfg(test)]
mod fixtures;
pub mod grant;
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

/// An error chain as one line, without repeating itself: how every command reports a
/// failure.
pub fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in std::iter::successors(Some(err), |e| e.source()) {
        let text = cause.to_string().replace('\n', " ");
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}
