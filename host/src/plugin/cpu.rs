//! A plugin's CPU share, and the sandbox's place below the host.
//!
//! **The share.** Each plugin may use so many cores of CPU for its calls, together: its
//! [`CpuBudget`] is a token bucket filled at that rate, up to a tenth of a second's
//! worth. A call runs in slices (a guest yields at every epoch tick), and each slice's
//! CPU time (the thread's, from the kernel) is charged to the bucket; a call of a plugin
//! whose bucket is empty waits, before its next slice, until the bucket has refilled to
//! zero. The wait counts against the call's deadline: a plugin that needs more CPU than
//! its share allows within its deadline is stopped there, like any slow plugin.
//!
//! **Below the host.** The sandbox's worker threads run at a lower OS priority (nice
//! [`SANDBOX_NICE`]) than the threads that serve watches and API requests: when the
//! cores are busy, the host's own work (and a fast call on a reconcile's thread) goes
//! first, and guests that burn CPU take what is left.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// How much CPU time a plugin may bank while idle, as a span of its share: a plugin
/// with a share of one core may burst a tenth of a second of CPU.
const BURST: Duration = Duration::from_millis(100);

/// The nice value of the sandbox's worker threads (0 is the host's; 19 the lowest).
pub const SANDBOX_NICE: i32 = 10;

/// One plugin's CPU share: a token bucket of CPU nanoseconds.
#[derive(Debug)]
pub struct CpuBudget {
    cores: f64,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    /// CPU nanoseconds that may still be spent (negative: owed).
    balance: f64,
    /// When `balance` was last refilled.
    at: Instant,
}

impl CpuBudget {
    /// A full bucket for a share of `cores`.
    pub fn new(cores: f64) -> Self {
        CpuBudget {
            cores,
            state: Mutex::new(Bucket {
                balance: Self::capacity(cores),
                at: Instant::now(),
            }),
        }
    }

    /// The share, in cores.
    pub fn cores(&self) -> f64 {
        self.cores
    }

    fn capacity(cores: f64) -> f64 {
        cores * BURST.as_nanos() as f64
    }

    /// How long a call must wait at `now` before it may run again (zero: it may).
    pub fn wait_at(&self, now: Instant) -> Duration {
        let mut bucket = self.state.lock().expect("cpu bucket lock");
        let refill = now.saturating_duration_since(bucket.at).as_nanos() as f64 * self.cores;
        bucket.balance = (bucket.balance + refill).min(Self::capacity(self.cores));
        bucket.at = bucket.at.max(now);
        if bucket.balance >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_nanos((-bucket.balance / self.cores) as u64)
        }
    }

    /// Charges `used` CPU time to the bucket.
    pub fn charge(&self, used: Duration) {
        let mut bucket = self.state.lock().expect("cpu bucket lock");
        bucket.balance -= used.as_nanos() as f64;
    }
}

/// `call`, charged to `budget` slice by slice, and held back while it is overdrawn.
pub fn metered<F: Future>(budget: std::sync::Arc<CpuBudget>, call: F) -> Metered<F> {
    Metered {
        budget,
        call: Box::pin(call),
        held: None,
    }
}

/// See [`metered`].
pub struct Metered<F> {
    budget: std::sync::Arc<CpuBudget>,
    call: Pin<Box<F>>,
    held: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<F: Future> Future for Metered<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        loop {
            if let Some(held) = &mut this.held {
                if held.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.held = None;
            }
            // tokio's clock: the same as the sleep's (and paused in tests).
            let wait = this.budget.wait_at(tokio::time::Instant::now().into_std());
            if wait.is_zero() {
                break;
            }
            this.held = Some(Box::pin(tokio::time::sleep(wait)));
        }
        let started = thread_cpu_time();
        let result = this.call.as_mut().poll(cx);
        this.budget
            .charge(thread_cpu_time().saturating_sub(started));
        result
    }
}

/// CPU time (user and system) the calling thread has used.
#[allow(unsafe_code)]
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is, and reads nothing else.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    if !ok {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Lowers the calling thread's scheduling priority to [`SANDBOX_NICE`] (on Linux the
/// nice value is per thread). Lowering needs no privilege; a failure is logged, and the
/// thread runs at the host's priority.
#[allow(unsafe_code)]
pub fn lower_this_threads_priority() {
    // SAFETY: gettid and setpriority take plain integers and touch no memory of ours.
    let result = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, SANDBOX_NICE)
    };
    if result != 0 {
        tracing::debug!(
            "cannot lower the priority of a sandbox thread: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn an_overdrawn_budget_holds_calls_back_for_the_debt_over_the_share() {
        let budget = CpuBudget::new(0.5);
        let t0 = Instant::now();
        assert_eq!(budget.wait_at(t0), Duration::ZERO, "a full bucket");
        // 50 ms banked (0.5 core x 100 ms); 70 ms spent: 20 ms owed, repaid at half a
        // core in 40 ms.
        budget.charge(70 * MS);
        assert_eq!(budget.wait_at(t0), 40 * MS);
        assert_eq!(budget.wait_at(t0 + 10 * MS), 30 * MS);
        assert_eq!(budget.wait_at(t0 + 40 * MS), Duration::ZERO);
        // Idle for long: no more than the burst is banked.
        assert_eq!(budget.wait_at(t0 + 10_000 * MS), Duration::ZERO);
        budget.charge(60 * MS);
        assert_eq!(budget.wait_at(t0 + 10_000 * MS), 20 * MS);
    }

    #[test]
    fn a_thread_that_spins_is_charged_its_cpu_and_one_that_sleeps_is_not() {
        let spin = |d: Duration| {
            let start = Instant::now();
            while start.elapsed() < d {
                std::hint::spin_loop();
            }
        };
        let before = thread_cpu_time();
        spin(30 * MS);
        let spun = thread_cpu_time() - before;
        let before = thread_cpu_time();
        std::thread::sleep(30 * MS);
        let slept = thread_cpu_time() - before;
        assert!(spun > slept, "spun {spun:?}, slept {slept:?}");
        assert!(slept < 10 * MS, "slept {slept:?}");
    }

    #[tokio::test]
    async fn a_metered_call_does_not_run_while_its_plugin_owes_cpu() {
        let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let call = {
            let ran = ran.clone();
            async move {
                ran.store(true, std::sync::atomic::Ordering::Relaxed);
                42
            }
        };
        // A minute owed at a tenth of a core: ten minutes held back.
        let budget = std::sync::Arc::new(CpuBudget::new(0.1));
        budget.charge(Duration::from_secs(60));
        let mut held = std::pin::pin!(metered(budget, call));
        assert!(futures::poll!(held.as_mut()).is_pending());
        assert!(
            !ran.load(std::sync::atomic::Ordering::Relaxed),
            "the call ran"
        );

        let budget = std::sync::Arc::new(CpuBudget::new(0.1));
        assert_eq!(metered(budget.clone(), async { 42 }).await, 42);
        assert!(
            budget.wait_at(Instant::now()).is_zero(),
            "a tiny call owes nothing"
        );
    }
}
