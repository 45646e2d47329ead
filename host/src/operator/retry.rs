//! The host's one backoff scheme: backon's exponential delays (`min`, twice that, four
//! times … up to `max`), for the finalizer releases, failing parents and plugin files
//! that failed to load alike.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// `min`, twice that, four times … up to `max`, for as long as it takes; `jitter` adds
/// a random share of each delay (backon's), so that many retriers spread out.
pub fn delays(min: Duration, max: Duration, jitter: bool) -> impl Iterator<Item = Duration> {
    let builder = ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .without_max_times();
    let builder = if jitter {
        builder.with_jitter()
    } else {
        builder
    };
    builder.build()
}

/// The delay before attempt `attempt` (1: the first retry) of [`delays`] without
/// jitter: for a retrier that keeps only its count of failures.
pub fn nth(attempt: u32, min: Duration, max: Duration) -> Duration {
    delays(min, max, false)
        .nth(attempt.saturating_sub(1) as usize)
        .unwrap_or(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delays_double_up_to_the_longest() {
        let s = Duration::from_secs;
        let got: Vec<Duration> = (1..=8).map(|n| nth(n, s(1), s(60))).collect();
        assert_eq!(got, [s(1), s(2), s(4), s(8), s(16), s(32), s(60), s(60)]);
        assert_eq!(nth(10_000, s(1), s(300)), s(300));
        for d in delays(s(1), s(8), true).take(20) {
            assert!(d >= s(1) && d <= s(16), "{d:?}");
        }
    }
}
