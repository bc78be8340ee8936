//! Rate-limited logging for messages a guest can trigger.
//!
//! A hostile guest can repeat a malformed request, a refused feature set or
//! a BAR move as fast as it can exit to the VMM; logging each one would let
//! it flood the host's logs (and disk). Each call site gets a limiter that
//! logs at most one message per [`PERIOD`] and, with the next one it lets
//! through, how many it held back (as the daemon's cap warnings do).
//!
//! ```ignore
//! virtio_devices::warn_limited!("virtio-pmem: bad request: {e}");
//! ```
//!
//! The macros keep one limiter per call site, for the whole process (one
//! VMM runs one VM). Where a limiter should be per device instead, keep a
//! [`RateLimitedLog`] in the device and call [`RateLimitedLog::warn`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use log::Level;

/// At most one message per call site per period.
pub const PERIOD: Duration = Duration::from_secs(10);

/// Logs at most one message per period; counts the ones it held back.
pub struct RateLimitedLog {
    period: Duration,
    state: Mutex<State>,
}

struct State {
    /// When the last message was logged.
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

    /// Logs `message()` at `level` unless a message was logged within the
    /// period (then `message` is not even formatted); returns whether it
    /// logged.
    pub fn log(&self, level: Level, message: impl FnOnce() -> String) -> bool {
        self.log_at(Instant::now(), level, message)
    }

    pub fn warn(&self, message: impl FnOnce() -> String) -> bool {
        self.log(Level::Warn, message)
    }

    pub fn error(&self, message: impl FnOnce() -> String) -> bool {
        self.log(Level::Error, message)
    }

    pub fn info(&self, message: impl FnOnce() -> String) -> bool {
        self.log(Level::Info, message)
    }

    /// [`Self::log`] as if the time were `now` (the tests' clock).
    pub fn log_at(&self, now: Instant, level: Level, message: impl FnOnce() -> String) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.period)
        {
            state.suppressed = state.suppressed.saturating_add(1);
            return false;
        }
        let suppressed = std::mem::take(&mut state.suppressed);
        state.last = Some(now);
        drop(state);
        if suppressed > 0 {
            log::log!(
                level,
                "{} ({suppressed} similar messages suppressed in the last {}s)",
                message(),
                self.period.as_secs()
            );
        } else {
            log::log!(level, "{}", message());
        }
        true
    }

    /// Messages held back since the last one logged.
    pub fn suppressed(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .suppressed
    }
}

/// `log!` through a limiter of this call site's own (see the module).
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMITER: $crate::log_limit::RateLimitedLog =
            $crate::log_limit::RateLimitedLog::new($crate::log_limit::PERIOD);
        LIMITER.log($level, || format!($($arg)+));
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
/// count the messages a device path produced.
#[cfg(any(test, feature = "test-util"))]
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
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(log.log_at(t0, Level::Warn, || "bad request 0".into()));
        for i in 1..=4u64 {
            let at = t0 + Duration::from_secs(i);
            assert!(!log.log_at(at, Level::Warn, || unreachable!("held back")));
        }
        assert_eq!(log.suppressed(), 4);
        // Just short of the period: still held back.
        let almost = t0 + Duration::from_millis(9999);
        assert!(!log.log_at(almost, Level::Warn, || unreachable!("held back")));
        // A period after the last one logged: logged, with the count.
        let later = t0 + Duration::from_secs(10);
        assert!(log.log_at(later, Level::Warn, || "bad request 6".into()));
        assert_eq!(log.suppressed(), 0);
        // And the period starts again from there.
        assert!(
            !log.log_at(later + Duration::from_secs(1), Level::Warn, || {
                unreachable!("held back")
            })
        );
        assert_eq!(
            capture::take(),
            vec![
                (Level::Warn, "bad request 0".to_string()),
                (
                    Level::Warn,
                    "bad request 6 (5 similar messages suppressed in the last 10s)".to_string()
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
        }
        let logged = capture::take();
        assert_eq!(
            logged,
            vec![
                (Level::Warn, "first site 0".to_string()),
                (Level::Error, "second site 0".to_string()),
            ]
        );
    }
}
