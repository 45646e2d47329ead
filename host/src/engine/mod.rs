//! One reconcile in three seams, shared by every front door (`capstan run`, `render`,
//! `plan`, `test`, shadow and canary):
//!
//! - **Observe** ([`observe`]): a parent's [`World`] — the parent, the children it
//!   controls, the related objects its `customize` selects, and the instant it is
//!   decided at — from one of several sources: the operator's caches, files, a live
//!   LIST. Related objects are selected in one place, whatever the source.
//! - **Decide** ([`decide()`]): one function from a plugin and a world to a [`Plan`]:
//!   the plugin's answer, validated and turned into the writes to make, the status, the
//!   events and the requeue. Nothing is written.
//! - **Act**: the operator's writer applies a plan under the ownership rules
//!   (`operator::reconcile` and `operator::cluster`); `capstan plan --live` dry-runs it.
//!
//! docs/internals.md draws the seams with the file of each.
//!
//! [`Plan`]: crate::plan::Plan

pub mod decide;
pub mod observe;

pub use decide::{DecideError, decide, finalize};
pub use observe::{ObserveError, RelatedSource, Selected, World};

/// Runs an engine step to its end on this thread, for callers that run no async code
/// (the command line, `capstan test`, tests). Give the step
/// [`Plugin::on_this_thread`](crate::plugin::Plugin::on_this_thread) for the plugin's
/// calls to run on this thread too, as the blocking calls do; they run under their
/// deadline either way.
pub fn blocking<F: std::future::Future>(step: F) -> F::Output {
    futures::executor::block_on(step)
}
