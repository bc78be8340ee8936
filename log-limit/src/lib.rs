//! Rate-limited logging for messages a guest can trigger.
//!
//! A hostile guest can repeat a malformed request, a refused feature set or
//! a BAR move as fast as it can exit to the VMM (or send requests to the
//! daemon); logging each one would let it flood the host's logs (and disk).
//! Each call site gets a limiter that logs at most one message per
//! [`PERIOD`] and, with the next one it lets through, how many it held back.
//! The VMM's devices and the daemon both log through this crate
//! (`virtio_devices::warn_limited!`, `daemon::warn_limited!` re-export it).
//!
//! ```ignore
//! log_limit::warn_limited!("virtio-pmem: bad request: {e}");
//! ```
//!
//! The macros keep one limiter per call site, for the whole process (one
//! VMM runs one VM), and log at the call site (its module is the record's
//! target). Where a limiter should be per device or per cap instead, keep a
//! [`RateLimitedLog`] there and log only what [`RateLimitedLog::admit`]
//! lets through.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use tracing::Level;

#[doc(hidden)]
pub mod __private {
    pub use tracing;
}

/// At most one message per call site per period.
pub const PERIOD: Duration = Duration::from_secs(10);

/// Lets at most one message through per period; counts the ones it held
/// back.
pub struct RateLimitedLog {
    period: Duration,
    state: Mutex<State>,
}

struct State {
    /// When the last message was let through.
    last: Option<Instant>,
    /// Messages held back since.
    suppressed: u64,
}

impl RateLimitedLog {
    pub const fn new(period: Duration) -> Self {
        RateLimitedLog {
            period,
            state: Mutex::new(State {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// Whether a message may be logged now: `Some(held back since the last
    /// one)`, or `None` if one was let through within the period (then the
    /// caller does not even format its message).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// [`Self::admit`] as if the time were `now` (the tests' clock).
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.period)
        {
            state.suppressed = state.suppressed.saturating_add(1);
            return None;
        }
        state.last = Some(now);
        Some(std::mem::take(&mut state.suppressed))
    }

    /// `message`, with how many like it were held back if any were.
    pub fn with_suppressed(&self, message: String, suppressed: u64) -> String {
        if suppressed == 0 {
            return message;
        }
        format!(
            "{message} ({suppressed} similar messages suppressed in the last {}s)",
            self.period.as_secs()
        )
    }

    /// Messages held back since the last one let through.
    pub fn suppressed(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .suppressed
    }
}

/// `tracing::event!` through a limiter of this call site's own (see the
/// module); `$level` is a [`Level`] constant.
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMITER: $crate::RateLimitedLog = $crate::RateLimitedLog::new($crate::PERIOD);
        if let ::std::option::Option::Some(suppressed) = LIMITER.admit() {
            $crate::__private::tracing::event!(
                $level,
                "{}",
                LIMITER.with_suppressed(::std::format!($($arg)+), suppressed)
            );
        }
    }};
}

/// `tracing::warn!`, rate-limited per call site.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::Level::WARN, $($arg)+) };
}

/// `tracing::error!`, rate-limited per call site.
#[macro_export]
macro_rules! error_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::Level::ERROR, $($arg)+) };
}

/// `tracing::info!`, rate-limited per call site.
#[macro_export]
macro_rules! info_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::Level::INFO, $($arg)+) };
}

/// A subscriber for tests that keeps what each thread logged, so a test
/// can count the messages a device path or a request produced.
#[cfg(any(test, feature = "test-util"))]
pub mod capture;

pub mod stderr;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_per_period_then_the_count_of_those_held_back() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.admit_at(t0), Some(0));
        for i in 1..=4u64 {
            let at = t0 + Duration::from_secs(i);
            assert_eq!(log.admit_at(at), None, "held back");
        }
        assert_eq!(log.suppressed(), 4);
        // Just short of the period: still held back.
        let almost = t0 + Duration::from_millis(9999);
        assert_eq!(log.admit_at(almost), None, "held back");
        // A period after the last one logged: let through, with the count.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(log.admit_at(later), Some(5));
        assert_eq!(log.suppressed(), 0);
        // And the period starts again from there.
        assert_eq!(log.admit_at(later + Duration::from_secs(1)), None);
        assert_eq!(
            log.with_suppressed("bad request 0".into(), 0),
            "bad request 0"
        );
        assert_eq!(
            log.with_suppressed("bad request 6".into(), 5),
            "bad request 6 (5 similar messages suppressed in the last 10s)"
        );
    }

    #[test]
    fn each_call_site_of_the_macros_has_its_own_limiter() {
        capture::start();
        for i in 0..3 {
            warn_limited!("first site {i}");
            error_limited!("second site {i}");
            info_limited!("third site {i}");
        }
        let logged = capture::take();
        assert_eq!(
            logged,
            vec![
                (Level::WARN, "first site 0".to_string()),
                (Level::ERROR, "second site 0".to_string()),
                (Level::INFO, "third site 0".to_string()),
            ]
        );
    }
}
