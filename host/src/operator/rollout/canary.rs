//! Canary: with `capstan run --canary`, a new version placed beside the serving one
//! (`NAME.next.wasm`, as for shadow mode) serves a share of the parents, chosen by a
//! stable hash of their UID, and the share steps up on a schedule
//! (`--canary-steps`, `--canary-step-seconds`). While it serves, the failure rate of
//! its reconciles is compared with the serving version's over the same time; past the
//! bound (`--canary-max-failure-increase` points, once it has `--canary-min-reconciles`
//! reconciles, or at a step's end with any) it is **rolled back**: every parent goes
//! back to the serving version, which reconciles the ones the candidate served at once
//! and posts a `CanaryRolledBack` Warning event on each. Past the last step (100 %) the
//! candidate is *promoted*: it serves every parent until the files are renamed.
//!
//! Every replica (`--shards`) computes the same split from the UIDs; each judges the
//! reconciles it runs. The state is in memory: a restarted host starts the canary of a
//! file that is still there from the first step.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::contract::{KindRef, PluginInfo};
use crate::operator::metrics::{Metrics, Report};
use crate::plugin::Plugin;

/// How a canary proceeds (`capstan run --canary …`).
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryPolicy {
    /// The shares of parents the candidate serves, in percent, one per step, ascending,
    /// ending at 100.
    pub steps: Vec<u8>,
    /// How long each step lasts.
    pub step: Duration,
    /// How far the candidate's failure rate may exceed the serving version's, as a
    /// fraction (0.05: five percentage points).
    pub max_increase: f64,
    /// How many reconciles the candidate needs before it is judged within a step.
    pub min_reconciles: u64,
}

impl CanaryPolicy {
    /// A policy; says what is wrong with the flags otherwise.
    pub fn new(
        steps: Vec<u8>,
        step: Duration,
        max_increase_points: f64,
        min_reconciles: u64,
    ) -> Result<Self, String> {
        if steps.is_empty() {
            return Err("--canary-steps needs at least one step (100)".into());
        }
        if let Some(bad) = steps.iter().find(|s| **s == 0 || **s > 100) {
            return Err(format!(
                "--canary-steps: {bad} is not a share between 1 and 100 percent"
            ));
        }
        if steps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "--canary-steps must go up: {}",
                steps
                    .iter()
                    .map(u8::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
        if steps.last() != Some(&100) {
            return Err("--canary-steps must end at 100 (the candidate serves every parent before it is promoted)".into());
        }
        if step.is_zero() {
            return Err("--canary-step-seconds must be more than 0".into());
        }
        if !(0.0..=100.0).contains(&max_increase_points) {
            return Err(format!(
                "--canary-max-failure-increase {max_increase_points} is not between 0 and 100 points"
            ));
        }
        Ok(CanaryPolicy {
            steps,
            step,
            max_increase: max_increase_points / 100.0,
            min_reconciles: min_reconciles.max(1),
        })
    }
}

/// Which version reconciled a parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// The serving file's (`NAME.wasm`).
    Serving,
    /// The candidate's (`NAME.next.wasm`).
    Candidate,
}

impl Version {
    /// Its label in the metrics.
    pub fn label(self) -> &'static str {
        match self {
            Version::Serving => "serving",
            Version::Candidate => "candidate",
        }
    }
}

/// Where a canary is.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "phase", rename_all = "kebab-case")]
pub enum Phase {
    /// Serving the share of its current step.
    Stepping,
    /// Past the last step: serving every parent.
    Promoted,
    /// Serving no parent any more, for `reason`.
    RolledBack {
        /// Why, in one line.
        reason: String,
    },
    /// It cannot serve beside this serving version (another parent, child or related
    /// kind, or finalizer): it only shadows.
    Refused {
        /// Why, in one line.
        reason: String,
    },
}

/// Reconciles counted for one version.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Tally {
    /// Reconciles that ended well.
    pub ok: u64,
    /// Reconciles that failed (invalid answer, trap, deadline, memory, refused spec,
    /// apply errors, child conflicts); transient API trouble is not counted.
    pub failed: u64,
}

impl Tally {
    fn total(&self) -> u64 {
        self.ok + self.failed
    }

    fn rate(&self) -> f64 {
        match self.total() {
            0 => 0.0,
            n => self.failed as f64 / n as f64,
        }
    }
}

/// What `/plugins` shows of a canary.
#[derive(Debug, Clone, Serialize)]
pub struct CanaryReport {
    /// The candidate's file.
    pub file: String,
    /// Its sha256.
    pub sha256: String,
    /// Its phase (and why, rolled back or refused).
    #[serde(flatten)]
    pub phase: Phase,
    /// The share of parents it serves now, in percent.
    pub percent: u8,
    /// The step it is at (1-based) and how many there are.
    pub step: usize,
    /// How many steps there are.
    pub steps: usize,
    /// The serving version's reconciles since the canary started.
    pub serving: Tally,
    /// The candidate's.
    pub candidate: Tally,
    /// The candidate's last failure, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
}

struct State {
    phase: Phase,
    step: usize,
    step_started: Instant,
    serving: Tally,
    candidate: Tally,
    last_failure: Option<String>,
    /// The parents (UIDs) the candidate reconciled: after a rollback, each gets an
    /// event when the serving version reconciles it again.
    served: HashSet<String>,
    /// The serving version (sha256) the candidate was checked against.
    checked_against: Option<String>,
}

/// One candidate's canary, shared by the registry (which makes it when the file loads),
/// the controller's reconciles (which ask whom a parent goes to and count outcomes) and
/// its driver (which steps it up on the schedule).
pub struct Canary {
    policy: CanaryPolicy,
    file: String,
    sha256: String,
    state: Mutex<State>,
}

/// Shares are compared in basis points (1/100 of a percent).
const FULL: u64 = 10_000;

/// Where a parent falls in the split, 0 to 9 999: a hash of its UID that every replica
/// computes alike, and unrelated to the shard buckets (so that a 10 % canary is not one
/// replica's parents).
fn position(uid: &str) -> u64 {
    let digest = Sha256::new()
        .chain_update(b"capstan canary\0")
        .chain_update(uid.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first) % FULL
}

/// Whether the parent `uid` is among `percent` % of the parents.
pub fn in_share(uid: &str, percent: u8) -> bool {
    position(uid) < u64::from(percent) * (FULL / 100)
}

impl Canary {
    /// The canary of the candidate `file` (`sha256`), starting its first step now.
    pub fn new(policy: CanaryPolicy, file: &str, sha256: &str) -> Self {
        Canary {
            policy,
            file: file.to_string(),
            sha256: sha256.to_string(),
            state: Mutex::new(State {
                phase: Phase::Stepping,
                step: 0,
                step_started: Instant::now(),
                serving: Tally::default(),
                candidate: Tally::default(),
                last_failure: None,
                served: HashSet::new(),
                checked_against: None,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("canary lock")
    }

    /// The candidate's sha256.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// Checks the candidate against the serving version once per serving version: it
    /// can only serve parents beside it if both declare the same parent, child and
    /// related kinds (in the same order) and the same need for a finalizer. A serving
    /// version that changes starts the canary again from its first step.
    pub fn check(&self, serving: &Plugin, candidate: &PluginInfo) {
        let mut state = self.state();
        if state.checked_against.as_deref() == Some(serving.sha256()) {
            return;
        }
        let restarted = state.checked_against.is_some();
        state.checked_against = Some(serving.sha256().to_string());
        state.step = 0;
        state.step_started = Instant::now();
        state.serving = Tally::default();
        state.candidate = Tally::default();
        state.last_failure = None;
        state.served.clear();
        state.phase = match incompatibility(serving.info(), candidate) {
            Some(reason) => {
                warn!(plugin = %serving.info().name, candidate = %self.sha256, "the candidate cannot serve beside this version, it only shadows: {reason}");
                Phase::Refused { reason }
            }
            None => {
                if restarted {
                    info!(plugin = %serving.info().name, candidate = %self.sha256, "the serving version changed: the canary starts again");
                }
                Phase::Stepping
            }
        };
    }

    /// How long each step of its schedule lasts.
    pub fn step_length(&self) -> Duration {
        self.policy.step
    }

    /// The share of parents the candidate serves now, in percent.
    pub fn percent(&self) -> u8 {
        let state = self.state();
        match state.phase {
            Phase::Stepping => self.policy.steps[state.step],
            Phase::Promoted => 100,
            Phase::RolledBack { .. } | Phase::Refused { .. } => 0,
        }
    }

    /// Whether the candidate reconciles the parent `uid` now.
    pub fn serves(&self, uid: &str) -> bool {
        in_share(uid, self.percent())
    }

    /// Counts a reconcile of `uid` by `version` (`failure`: why it failed). Returns the
    /// reason when this one rolls the candidate back.
    pub fn record(&self, version: Version, uid: &str, failure: Option<&str>) -> Option<String> {
        let mut state = self.state();
        if version == Version::Candidate {
            // Also once it is judged: a reconcile under way at the rollback ends after
            // it, and what it wrote (a failure) must be undone like the others'.
            state.served.insert(uid.to_string());
        }
        if state.phase != Phase::Stepping {
            return None;
        }
        let tally = match version {
            Version::Serving => &mut state.serving,
            Version::Candidate => &mut state.candidate,
        };
        match failure {
            Some(_) => tally.failed += 1,
            None => tally.ok += 1,
        }
        if version == Version::Candidate
            && let Some(why) = failure
        {
            state.last_failure = Some(why.to_string());
        }
        let reason = self.exceeded(&state, self.policy.min_reconciles)?;
        state.phase = Phase::RolledBack {
            reason: reason.clone(),
        };
        Some(reason)
    }

    /// Why the candidate is past the bound, judged on at least `min` of its reconciles.
    fn exceeded(&self, state: &State, min: u64) -> Option<String> {
        let (candidate, serving) = (state.candidate, state.serving);
        if candidate.total() < min.max(1)
            || candidate.rate() <= serving.rate() + self.policy.max_increase
        {
            return None;
        }
        let last = state
            .last_failure
            .as_deref()
            .map(|why| format!("; its last failure: {why}"))
            .unwrap_or_default();
        Some(format!(
            "{:.0}% of its reconciles failed ({} of {}), against {:.0}% ({} of {}) for the serving version; the bound is {} points more{last}",
            candidate.rate() * 100.0,
            candidate.failed,
            candidate.total(),
            serving.rate() * 100.0,
            serving.failed,
            serving.total(),
            self.policy.max_increase * 100.0,
        ))
    }

    /// Moves the canary on at `now`: at the end of a step, a candidate past the bound
    /// (judged on any number of reconciles) is rolled back, else it goes to the next
    /// step, or is promoted after the last.
    pub fn advance(&self, now: Instant) -> Option<Transition> {
        let mut state = self.state();
        if state.phase != Phase::Stepping
            || now.saturating_duration_since(state.step_started) < self.policy.step
        {
            return None;
        }
        if let Some(reason) = self.exceeded(&state, 1) {
            state.phase = Phase::RolledBack {
                reason: reason.clone(),
            };
            return Some(Transition::RolledBack(reason));
        }
        state.step_started = now;
        if state.step + 1 < self.policy.steps.len() {
            state.step += 1;
            Some(Transition::Stepped(self.policy.steps[state.step]))
        } else {
            state.phase = Phase::Promoted;
            Some(Transition::Promoted)
        }
    }

    /// The parents (UIDs) the candidate reconciled and, after a rollback, that were not
    /// told yet: they go back to the serving version.
    pub fn served(&self) -> HashSet<String> {
        self.state().served.clone()
    }

    /// Whether it was rolled back.
    pub fn rolled_back(&self) -> bool {
        matches!(self.state().phase, Phase::RolledBack { .. })
    }

    /// After a rollback, the message for the parent `uid` if the candidate reconciled
    /// it and it was not told yet.
    pub fn rolled_back_notice(&self, uid: &str) -> Option<String> {
        let mut state = self.state();
        let Phase::RolledBack { reason } = &state.phase else {
            return None;
        };
        let message = format!(
            "the candidate version {} ({}) was rolled back: {reason}; the serving version reconciles this parent again",
            short(&self.sha256),
            self.file
        );
        state.served.remove(uid).then_some(message)
    }

    /// What `/plugins` shows.
    pub fn report(&self) -> CanaryReport {
        let percent = self.percent();
        let state = self.state();
        CanaryReport {
            file: self.file.clone(),
            sha256: self.sha256.clone(),
            phase: state.phase.clone(),
            percent,
            step: state.step + 1,
            steps: self.policy.steps.len(),
            serving: state.serving,
            candidate: state.candidate,
            last_failure: state.last_failure.clone(),
        }
    }
}

impl Report for Canary {
    fn report(&self) -> serde_json::Value {
        serde_json::to_value(Canary::report(self)).unwrap_or_default()
    }
}

/// A change of a canary's phase or step, for the log and the metrics.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// On to a step that serves this share, in percent.
    Stepped(u8),
    /// Past the last step.
    Promoted,
    /// Rolled back, for this reason.
    RolledBack(String),
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

/// Why `candidate` cannot serve parents beside `serving`, if it cannot.
fn incompatibility(serving: &PluginInfo, candidate: &PluginInfo) -> Option<String> {
    let list = |kinds: &[KindRef]| {
        kinds
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if serving.parent != candidate.parent {
        return Some(format!(
            "it reconciles {}, the serving version {}",
            candidate.parent, serving.parent
        ));
    }
    if serving.children != candidate.children {
        return Some(format!(
            "its child kinds are [{}], the serving version's [{}]",
            list(&candidate.children),
            list(&serving.children)
        ));
    }
    if serving.related != candidate.related {
        return Some(format!(
            "its related kinds are [{}], the serving version's [{}]",
            list(&candidate.related),
            list(&serving.related)
        ));
    }
    if serving.finalizer != candidate.finalizer {
        return Some("one version asks for a finalizer and the other does not".to_string());
    }
    None
}

/// Logs and counts a transition of the canary of `plugin`.
pub fn announce(metrics: &Metrics, plugin: &str, canary: &Canary, transition: &Transition) {
    let sha = short(canary.sha256());
    match transition {
        Transition::Stepped(percent) => {
            info!(%plugin, candidate = %sha, percent, "canary: the candidate now serves {percent}% of the parents");
        }
        Transition::Promoted => {
            info!(%plugin, candidate = %sha, "canary: the candidate is promoted and serves every parent; rename {} over the serving file to keep it", canary.file);
        }
        Transition::RolledBack(reason) => {
            warn!(%plugin, candidate = %sha, "canary: the candidate is rolled back, every parent goes back to the serving version: {reason}");
            metrics.canary_rolled_back(plugin);
        }
    }
    metrics.canary_share(plugin, canary.percent());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> CanaryPolicy {
        CanaryPolicy::new(vec![10, 50, 100], Duration::from_secs(60), 5.0, 10).unwrap()
    }

    #[test]
    fn the_split_is_stable_nested_and_close_to_the_share() {
        let uids: Vec<String> = (0..10_000).map(|i| format!("uid-{i}")).collect();
        let count = |p: u8| uids.iter().filter(|u| in_share(u, p)).count();
        assert_eq!(count(0), 0);
        assert_eq!(count(100), 10_000);
        let ten = count(10);
        assert!((800..1200).contains(&ten), "10 % of 10 000: {ten}");
        // A parent in a share stays in every larger one: a step up never moves a
        // parent back to the serving version.
        for u in &uids {
            if in_share(u, 10) {
                assert!(in_share(u, 50) && in_share(u, 100), "{u}");
            }
        }
        // Every replica, of any version, computes the same: the positions are pinned
        // (a change of the hash would move parents between versions mid-canary when
        // replicas of two host versions share them).
        for (uid, position) in [
            ("uid-0", 695),
            ("uid-1", 6472),
            ("5f362ddd-9692-4340-be0c-be76df9a45cd", 4378),
        ] {
            assert_eq!(super::position(uid), position, "{uid}");
        }
        assert!(in_share("uid-0", 7) && !in_share("uid-0", 6));
    }

    #[test]
    fn a_policy_is_checked_with_one_line_per_mistake() {
        let mk = |steps: Vec<u8>| CanaryPolicy::new(steps, Duration::from_secs(1), 5.0, 1);
        assert!(mk(vec![10, 100]).is_ok());
        assert!(mk(vec![]).unwrap_err().contains("at least one step"));
        assert!(mk(vec![0, 100]).unwrap_err().contains("between 1 and 100"));
        assert!(mk(vec![50, 10, 100]).unwrap_err().contains("must go up"));
        assert!(mk(vec![10, 50]).unwrap_err().contains("end at 100"));
        assert!(
            CanaryPolicy::new(vec![100], Duration::ZERO, 5.0, 1)
                .unwrap_err()
                .contains("more than 0")
        );
        assert!(
            CanaryPolicy::new(vec![100], Duration::from_secs(1), 120.0, 1)
                .unwrap_err()
                .contains("between 0 and 100")
        );
    }

    #[test]
    fn a_failing_candidate_is_rolled_back_once_it_has_enough_reconciles() {
        let canary = Canary::new(policy(), "w.next.wasm", "abc");
        for i in 0..50 {
            assert_eq!(
                canary.record(Version::Serving, &format!("s{i}"), None),
                None
            );
        }
        // Nine failures are not enough to judge (10 needed)...
        for i in 0..9 {
            let r = canary.record(Version::Candidate, &format!("c{i}"), Some("trap"));
            assert_eq!(r, None, "judged on {i} reconciles");
        }
        assert_eq!(canary.percent(), 10);
        // ...the tenth is.
        let reason = canary
            .record(Version::Candidate, "c9", Some("plugin output refused: x"))
            .expect("rolled back");
        assert!(
            reason.contains("100% of its reconciles failed (10 of 10)"),
            "{reason}"
        );
        assert!(reason.contains("0% (0 of 50)"), "{reason}");
        assert!(reason.contains("plugin output refused: x"), "{reason}");
        assert_eq!(canary.percent(), 0);
        assert!(!canary.serves("c0"));
        // Each parent it served is told once; others never.
        assert!(
            canary
                .rolled_back_notice("c3")
                .unwrap()
                .contains("rolled back")
        );
        assert_eq!(canary.rolled_back_notice("c3"), None);
        assert_eq!(canary.rolled_back_notice("s1"), None);
        // A reconcile of the candidate under way at the rollback, which ends after it:
        // not counted, but its parent goes back and is told like the others (CI run Q:
        // such a parent kept the candidate's failure until the next resync).
        assert_eq!(
            canary.record(Version::Candidate, "late", Some("trap")),
            None
        );
        assert!(canary.served().contains("late"));
        assert!(canary.rolled_back_notice("late").is_some());
        // Nothing counts any more, and nothing steps it up again.
        assert_eq!(canary.record(Version::Candidate, "c1", None), None);
        assert!(
            canary.report().candidate.total() == 10,
            "{:?}",
            canary.report().candidate
        );
        assert_eq!(
            canary.advance(Instant::now() + Duration::from_secs(3600)),
            None
        );
    }

    #[test]
    fn a_candidate_within_the_bound_steps_up_and_is_promoted() {
        let canary = Canary::new(policy(), "w.next.wasm", "abc");
        let start = Instant::now();
        // The serving version fails 10 %, the candidate at most 12.5 % at any point
        // once judged: within 5 points.
        for i in 0..100 {
            let failure = (i % 10 == 0).then_some("x");
            assert_eq!(
                canary.record(Version::Serving, &format!("s{i}"), failure),
                None
            );
        }
        for i in 0..25 {
            let failure = (i % 8 == 7).then_some("x");
            assert_eq!(
                canary.record(Version::Candidate, &format!("c{i}"), failure),
                None
            );
        }
        assert_eq!(
            canary.advance(start + Duration::from_secs(30)),
            None,
            "mid-step"
        );
        assert_eq!(
            canary.advance(start + Duration::from_secs(61)),
            Some(Transition::Stepped(50))
        );
        assert_eq!(canary.percent(), 50);
        assert_eq!(
            canary.advance(start + Duration::from_secs(122)),
            Some(Transition::Stepped(100))
        );
        assert_eq!(
            canary.advance(start + Duration::from_secs(183)),
            Some(Transition::Promoted)
        );
        assert_eq!(canary.percent(), 100);
        assert_eq!(canary.report().phase, Phase::Promoted);
    }

    #[test]
    fn at_a_steps_end_a_few_failures_are_enough_to_stop_it() {
        // Two parents in the share, each failing once (an invalid answer waits for a
        // new spec): fewer than the 10 reconciles a judgement needs within a step, yet
        // the step does not go up on them.
        let canary = Canary::new(policy(), "w.next.wasm", "abc");
        let start = Instant::now();
        canary.record(Version::Serving, "s", None);
        canary.record(Version::Candidate, "a", Some("refused"));
        canary.record(Version::Candidate, "b", Some("refused"));
        match canary.advance(start + Duration::from_secs(61)) {
            Some(Transition::RolledBack(reason)) => {
                assert!(reason.contains("(2 of 2)"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    fn info(children: &[&str], finalizer: bool) -> PluginInfo {
        let kind = |k: &str| KindRef {
            group: "example.com".into(),
            version: "v1".into(),
            kind: k.into(),
            plural: format!("{}s", k.to_lowercase()),
            namespaced: true,
        };
        PluginInfo {
            name: "w".into(),
            parent: kind("Widget"),
            children: children.iter().map(|c| kind(c)).collect(),
            finalizer,
            ..PluginInfo::default()
        }
    }

    #[test]
    fn a_candidate_that_declares_other_kinds_cannot_serve() {
        assert_eq!(
            incompatibility(&info(&["A"], false), &info(&["A"], false)),
            None
        );
        let why = incompatibility(&info(&["A"], false), &info(&["A", "B"], false)).unwrap();
        assert!(why.contains("child kinds"), "{why}");
        let why = incompatibility(&info(&["A"], false), &info(&["A"], true)).unwrap();
        assert!(why.contains("finalizer"), "{why}");
    }
}
