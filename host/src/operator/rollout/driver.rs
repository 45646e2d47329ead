//! The canary's driver: steps the canary of a serving file up on its schedule and sends
//! back to the controller every parent whose version changes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use super::canary::{Canary, announce, in_share};
use super::slot::ShadowSlot;
use crate::operator::metrics::Metrics;
use crate::operator::parent::{CachedParent, ParentKind};
use crate::plugin::Plugin;

/// How often the driver looks at the schedule (at most: a shorter step is looked at
/// four times per step).
const TICK: Duration = Duration::from_secs(1);

/// Steps the canary of `slot` up on its schedule while the controller of `serving`
/// runs, and reconciles at once every parent whose version changes by sending it to
/// `trigger`: those a step moves into the share, and those the candidate served when it
/// is rolled back, replaced or removed (also when that happened between two looks: the
/// candidate's reconciles may roll it back before the driver ever saw it serve).
pub async fn drive(
    slot: ShadowSlot,
    serving: Plugin,
    parents: Store<CachedParent>,
    kind: ParentKind,
    trigger: tokio::sync::mpsc::UnboundedSender<ObjectRef<CachedParent>>,
    metrics: Arc<Metrics>,
) {
    let plugin = serving.info().name.clone();
    // The canary last looked at, and the share its parents were sent for.
    let mut last: Option<(Arc<Canary>, u8)> = None;
    // The parents sent back after the current canary's rollback.
    let mut sent_back: HashSet<String> = HashSet::new();
    loop {
        let tick = slot
            .canary()
            .map_or(TICK, |(_, c)| TICK.min(c.step_length() / 4));
        tokio::time::sleep(tick.max(Duration::from_millis(10))).await;
        let current = slot.canary().map(|(candidate, canary)| {
            canary.check(&serving, candidate.info());
            if let Some(transition) = canary.advance(Instant::now()) {
                announce(&metrics, &plugin, &canary, &transition);
            }
            metrics.canary_share(&plugin, canary.percent());
            canary
        });
        let same = |a: &Arc<Canary>| current.as_ref().is_some_and(|c| Arc::ptr_eq(a, c));
        // A candidate replaced or removed: what it served goes back.
        let gone = last
            .as_ref()
            .filter(|(old, _)| !same(old))
            .map(|(old, share)| (*share, old.served()));
        if gone.is_some() {
            sent_back.clear();
            if current.is_none() {
                metrics.canary_share(&plugin, 0);
            }
        }
        let (before, after) = match (&current, &last) {
            (Some(c), Some((old, share))) if Arc::ptr_eq(c, old) => (*share, c.percent()),
            (Some(c), _) => (0, c.percent()),
            (None, _) => (0, 0),
        };
        let rolled_back = current
            .as_ref()
            .filter(|c| c.rolled_back())
            .map(|c| c.served())
            .unwrap_or_default();
        for parent in parents.state() {
            let uid = parent.uid().unwrap_or_default();
            let moved = in_share(&uid, before) != in_share(&uid, after)
                || gone
                    .as_ref()
                    .is_some_and(|(share, served)| in_share(&uid, *share) || served.contains(&uid))
                || (rolled_back.contains(&uid) && sent_back.insert(uid.clone()));
            if moved
                && trigger
                    .send(ObjectRef::from_obj_with(&*parent, kind.clone()))
                    .is_err()
            {
                return;
            }
        }
        last = current.map(|c| {
            let share = c.percent();
            (c, share)
        });
    }
}
