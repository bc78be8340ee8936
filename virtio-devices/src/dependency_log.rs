//! A logger that rate-limits dependency crates' records per call site.
//!
//! Our own messages a guest can trigger go through [`crate::log_limit`]'s
//! macros. The crates we build on log too, and a guest can make some of
//! them do it per register write or kick: virtio-queue logs `error!` for an
//! invalid queue size, misaligned ring addresses, a queue used before it is
//! valid and an impossible available index. [`SiteLimitedLogger`] wraps the
//! process's `log` logger (in the VMM, tracing-log's bridge to `tracing`,
//! which our own crates log through directly) and lets through at most one record per call site
//! (target, file, line) of a crate that is not ours every
//! [`crate::log_limit::PERIOD`]; the next one it lets through says how many
//! it held back. Records from our own crates pass untouched: they are
//! limited where they are written, and the rest (start-up, API errors) must
//! not be lost.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use log::{Log, Metadata, Record};

/// Call sites tracked one by one; records from further sites share one
/// limiter, so a crate with endless distinct targets cannot grow the table.
pub const MAX_SITES: usize = 4096;

/// One call site's limiter state.
#[derive(Clone, Copy)]
struct Site {
    /// When its last record was let through.
    last: Instant,
    /// Records held back since.
    suppressed: u64,
}

/// Every call site's state, and the one shared by sites past [`MAX_SITES`].
struct Sites {
    by_key: HashMap<u64, Site>,
    overflow: Option<Site>,
}

/// Wraps `inner`: records from crates not named in `own` are let through at
/// most once per `period` per call site (see the module).
pub struct SiteLimitedLogger<L> {
    inner: L,
    own: &'static [&'static str],
    period: Duration,
    sites: Mutex<Sites>,
}

impl<L: Log> SiteLimitedLogger<L> {
    /// `own`: the crate names (as in a record's target, `virtio_devices`)
    /// whose records pass untouched.
    pub fn new(inner: L, own: &'static [&'static str], period: Duration) -> Self {
        SiteLimitedLogger {
            inner,
            own,
            period,
            sites: Mutex::new(Sites {
                by_key: HashMap::new(),
                overflow: None,
            }),
        }
    }

    fn is_own(&self, target: &str) -> bool {
        let krate = target.split("::").next().unwrap_or(target);
        self.own.contains(&krate)
    }

    /// Whether a record from the site `key` goes out at `now`, and if so how
    /// many from that site were held back before it.
    fn admit(&self, key: u64, now: Instant) -> Option<u64> {
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        let Sites { by_key, overflow } = &mut *sites;
        let len = by_key.len();
        let slot = match by_key.get_mut(&key) {
            Some(site) => Some(site),
            None if len < MAX_SITES => {
                by_key.insert(
                    key,
                    Site {
                        last: now,
                        suppressed: 0,
                    },
                );
                return Some(0);
            }
            None => overflow.as_mut(),
        };
        let Some(site) = slot else {
            *overflow = Some(Site {
                last: now,
                suppressed: 0,
            });
            return Some(0);
        };
        if now.saturating_duration_since(site.last) < self.period {
            site.suppressed = site.suppressed.saturating_add(1);
            return None;
        }
        site.last = now;
        Some(std::mem::take(&mut site.suppressed))
    }

    /// [`Log::log`] as if the time were `now` (the tests' clock).
    pub fn log_at(&self, now: Instant, record: &Record) {
        if !self.inner.enabled(record.metadata()) {
            return;
        }
        if self.is_own(record.target()) {
            return self.inner.log(record);
        }
        match self.admit(site_key(record), now) {
            None => {}
            Some(0) => self.inner.log(record),
            Some(suppressed) => self.inner.log(
                &Record::builder()
                    .metadata(record.metadata().clone())
                    .args(format_args!(
                        "{} ({suppressed} similar messages suppressed in the last {}s)",
                        record.args(),
                        self.period.as_secs()
                    ))
                    .module_path(record.module_path())
                    .file(record.file())
                    .line(record.line())
                    .build(),
            ),
        }
    }
}

/// A call site's identity: its target, file and line, hashed (no allocation
/// per record; two sites sharing a hash only share a limiter).
fn site_key(record: &Record) -> u64 {
    let mut h = DefaultHasher::new();
    record.target().hash(&mut h);
    record.file().hash(&mut h);
    record.line().hash(&mut h);
    h.finish()
}

impl<L: Log> Log for SiteLimitedLogger<L> {
    fn enabled(&self, metadata: &Metadata) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        self.log_at(Instant::now(), record);
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use log::Level;

    /// Keeps every line it is given.
    #[derive(Default)]
    struct Lines(Mutex<Vec<String>>);

    impl Log for Lines {
        fn enabled(&self, m: &Metadata) -> bool {
            m.level() <= Level::Info
        }
        fn log(&self, r: &Record) {
            self.0
                .lock()
                .unwrap()
                .push(format!("{}: {}", r.target(), r.args()));
        }
        fn flush(&self) {}
    }

    const OWN: &[&str] = &["vmm", "virtio_devices"];
    const PERIOD: Duration = crate::log_limit::PERIOD;

    fn logger() -> SiteLimitedLogger<Lines> {
        SiteLimitedLogger::new(Lines::default(), OWN, PERIOD)
    }

    fn emit(
        logger: &SiteLimitedLogger<Lines>,
        now: Instant,
        level: Level,
        target: &str,
        line: u32,
        text: &str,
    ) {
        logger.log_at(
            now,
            &Record::builder()
                .level(level)
                .target(target)
                .file(Some("src/queue.rs"))
                .line(Some(line))
                .args(format_args!("{text}"))
                .build(),
        );
    }

    fn lines(logger: &SiteLimitedLogger<Lines>) -> Vec<String> {
        logger.inner.0.lock().unwrap().clone()
    }

    #[test]
    fn a_burst_from_one_dependency_site_is_one_line_then_the_count_held_back() {
        let logger = logger();
        let t0 = Instant::now();
        for i in 0..10_000u32 {
            let at = t0 + Duration::from_micros(u64::from(i));
            let text = format!("virtio queue with invalid size: {i}");
            emit(&logger, at, Level::Error, "virtio_queue::queue", 368, &text);
        }
        assert_eq!(
            lines(&logger),
            ["virtio_queue::queue: virtio queue with invalid size: 0"]
        );
        emit(
            &logger,
            t0 + PERIOD + Duration::from_secs(1),
            Level::Error,
            "virtio_queue::queue",
            368,
            "virtio queue with invalid size: 3",
        );
        assert_eq!(
            lines(&logger)[1],
            "virtio_queue::queue: virtio queue with invalid size: 3 \
             (9999 similar messages suppressed in the last 10s)"
        );
        assert_eq!(lines(&logger).len(), 2);
    }

    #[test]
    fn each_dependency_site_has_its_own_limit_and_our_crates_pass_untouched() {
        let logger = logger();
        let t0 = Instant::now();
        for _ in 0..100 {
            emit(
                &logger,
                t0,
                Level::Error,
                "virtio_queue::queue",
                368,
                "size",
            );
            emit(
                &logger,
                t0,
                Level::Error,
                "virtio_queue::queue",
                386,
                "desc",
            );
            emit(&logger, t0, Level::Warn, "vm_superio::serial", 1, "uart");
        }
        for _ in 0..3 {
            emit(&logger, t0, Level::Warn, "vmm::vm", 1, "ours");
            emit(&logger, t0, Level::Warn, "virtio_devices", 2, "top");
        }
        assert_eq!(
            lines(&logger),
            [
                "virtio_queue::queue: size",
                "virtio_queue::queue: desc",
                "vm_superio::serial: uart",
                "vmm::vm: ours",
                "virtio_devices: top",
                "vmm::vm: ours",
                "virtio_devices: top",
                "vmm::vm: ours",
                "virtio_devices: top",
            ]
        );
    }

    #[test]
    fn records_the_logger_would_drop_are_neither_shown_nor_counted() {
        let logger = logger();
        let t0 = Instant::now();
        emit(&logger, t0, Level::Debug, "virtio_queue::queue", 1, "quiet");
        emit(&logger, t0, Level::Error, "virtio_queue::queue", 1, "first");
        assert_eq!(lines(&logger), ["virtio_queue::queue: first"]);
    }

    #[test]
    fn sites_past_the_table_share_one_limit() {
        let logger = logger();
        let t0 = Instant::now();
        for line in 0..u32::try_from(MAX_SITES).unwrap() + 1000 {
            emit(&logger, t0, Level::Error, "some_crate", line, "x");
        }
        // Every tracked site once, then one line for all the sites beyond.
        assert_eq!(lines(&logger).len(), MAX_SITES + 1);
        assert!(logger.sites.lock().unwrap().by_key.len() <= MAX_SITES);
    }
}
