//! The VMM's logger fed by virtio-queue itself: a guest writing an invalid
//! queue size in a loop makes virtio-queue log `error!` per write; through
//! [`SiteLimitedLogger`] that is one line per period, not one per write.
//! (Its own test binary: it installs the process's logger.)

use std::sync::{Arc, Mutex};

use log::{Log, Metadata, Record};
use virtio_devices::dependency_log::SiteLimitedLogger;
use virtio_devices::log_limit::PERIOD;
use virtio_queue::{Queue, QueueT};

/// Keeps every line it is given, shared with the test.
struct Lines(Arc<Mutex<Vec<String>>>);

impl Log for Lines {
    fn enabled(&self, _: &Metadata) -> bool {
        true
    }
    fn log(&self, r: &Record) {
        self.0
            .lock()
            .unwrap()
            .push(format!("{}: {}", r.target(), r.args()));
    }
    fn flush(&self) {}
}

#[test]
fn ten_thousand_invalid_queue_sizes_log_one_line() {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let logger = SiteLimitedLogger::new(Lines(lines.clone()), &["virtio_devices"], PERIOD);
    log::set_logger(Box::leak(Box::new(logger))).unwrap();
    log::set_max_level(log::LevelFilter::Trace);
    let mut queue = Queue::new(256).unwrap();
    let started = std::time::Instant::now();
    for _ in 0..10_000 {
        // Not a power of two: virtio-queue refuses it and logs an error.
        queue.set_size(3);
    }
    // One line per period the loop took (one, on any machine that runs
    // 10,000 calls within 10 s).
    let periods = started.elapsed().as_secs() / PERIOD.as_secs();
    let lines = lines.lock().unwrap();
    assert!(!lines.is_empty());
    assert!(lines.len() as u64 <= 1 + periods, "{lines:?}");
    assert!(
        lines[0].starts_with("virtio_queue") && lines[0].contains("invalid size: 3"),
        "{lines:?}"
    );
}
