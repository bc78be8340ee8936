//! Rate-limited logging for messages a guest can trigger: a refused
//! SHMEM_MAP, a malformed request, a failed chown of a new entry can each
//! be repeated as fast as the guest can send requests. Each call site gets
//! a limiter that logs at most one message per [`PERIOD`] and, with the
//! next one it lets through, how many it held back (the cap warnings of
//! [`crate::limits`] use the same limiter).
//!
//! ```ignore
//! daemon::warn_limited!("SHMEM_MAP refused: {e}");
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use log::Level;

/// At most one message per call site per period.
pub const PERIOD: Duration = Duration::from_secs(10);

/// Logs at most one message per interval; counts the ones it held back.
pub struct RateLimitedLog {
    interval: Duration,
    /// When the last message was logged, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    pub const fn new(interval: Duration) -> Self {
        RateLimitedLog {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Logs a warning `message(suppressed_since_last)` unless one was logged
    /// within the interval; returns whether it logged.
    pub fn warn(&self, message: impl FnOnce(u64) -> String) -> bool {
        self.log(Level::Warn, message)
    }

    /// [`Self::warn`] at `level`.
    pub fn log(&self, level: Level, message: impl FnOnce(u64) -> String) -> bool {
        self.log_at(Instant::now(), level, message)
    }

    /// [`Self::log`] as if the time were `now` (the tests' clock).
    pub fn log_at(&self, now: Instant, level: Level, message: impl FnOnce(u64) -> String) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .0
            .is_some_and(|last| now.saturating_duration_since(last) < self.interval)
        {
            state.1 = state.1.saturating_add(1);
            return false;
        }
        let suppressed = std::mem::take(&mut state.1);
        state.0 = Some(now);
        drop(state);
        log::log!(level, "{}", message(suppressed));
        true
    }

    /// Messages held back since the last one logged.
    pub fn suppressed(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

/// `message`, with how many like it were held back if any were.
pub fn with_suppressed(message: String, suppressed: u64) -> String {
    if suppressed == 0 {
        return message;
    }
    format!(
        "{message} ({suppressed} similar messages suppressed in the last {}s)",
        PERIOD.as_secs()
    )
}

/// `log!` through a limiter of this call site's own (see the module).
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMITER: $crate::log_limit::RateLimitedLog =
            $crate::log_limit::RateLimitedLog::new($crate::log_limit::PERIOD);
        LIMITER.log($level, |suppressed| {
            $crate::log_limit::with_suppressed(format!($($arg)+), suppressed)
        });
    }};
}

/// `log::warn!`, rate-limited per call site.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::log_limit::Level::Warn, $($arg)+) };
}

/// `log::error!`, rate-limited per call site.
#[macro_export]
macro_rules! error_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::log_limit::Level::Error, $($arg)+) };
}

/// `log::info!`, rate-limited per call site.
#[macro_export]
macro_rules! info_limited {
    ($($arg:tt)+) => { $crate::log_limited!($crate::log_limit::Level::Info, $($arg)+) };
}

/// A logger for tests that keeps what each thread logged, so a test can
/// count the messages a request produced.
#[cfg(test)]
pub mod capture {
    use std::cell::RefCell;

    thread_local! {
        static RECORDS: RefCell<Vec<(log::Level, String)>> = const { RefCell::new(Vec::new()) };
    }

    struct Capture;

    impl log::Log for Capture {
        fn enabled(&self, _: &log::Metadata) -> bool {
            true
        }

        fn log(&self, record: &log::Record) {
            RECORDS.with(|r| {
                r.borrow_mut()
                    .push((record.level(), record.args().to_string()))
            });
        }

        fn flush(&self) {}
    }

    /// Installs the logger (once per process) and forgets what this thread
    /// logged so far.
    pub fn start() {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            log::set_logger(&Capture).expect("no other logger in the test binary");
            log::set_max_level(log::LevelFilter::Trace);
        });
        RECORDS.with(|r| r.borrow_mut().clear());
    }

    /// What this thread logged since [`start`], in order.
    pub fn take() -> Vec<(log::Level, String)> {
        RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_per_period_then_the_count_of_those_held_back() {
        capture::start();
        let log = RateLimitedLog::new(PERIOD);
        let t0 = Instant::now();
        assert!(log.log_at(t0, Level::Warn, |n| with_suppressed("first".into(), n)));
        for i in 1..=4u64 {
            let at = t0 + Duration::from_secs(i);
            assert!(!log.log_at(at, Level::Warn, |_| unreachable!("held back")));
        }
        assert_eq!(log.suppressed(), 4);
        let later = t0 + PERIOD;
        assert!(log.log_at(later, Level::Error, |n| with_suppressed("again".into(), n)));
        assert_eq!(log.suppressed(), 0);
        assert_eq!(
            capture::take(),
            vec![
                (Level::Warn, "first".to_string()),
                (
                    Level::Error,
                    "again (4 similar messages suppressed in the last 10s)".to_string()
                ),
            ]
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
        assert_eq!(
            capture::take(),
            vec![
                (Level::Warn, "first site 0".to_string()),
                (Level::Error, "second site 0".to_string()),
                (Level::Info, "third site 0".to_string()),
            ]
        );
    }
}
