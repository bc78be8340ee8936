//! The VMM's chain for dependencies' `log` records, end to end: virtio-queue
//! logs `error!` per invalid queue size; [`SiteLimitedLogger`] around
//! tracing-log's bridge lets one record per period reach the `tracing`
//! subscriber, under virtio-queue's own target, where the VMM's line
//! filter ([`stderr::Levels`]) shows it. (Its own test binary: it installs
//! the process's logger and subscriber.)

use std::sync::{Arc, Mutex};

use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use virtio_devices::dependency_log::SiteLimitedLogger;
use virtio_devices::log_limit::{stderr, PERIOD};
use virtio_queue::{Queue, QueueT};

/// Keeps `LEVEL target: text` of each event its filter lets through.
struct Seen(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> Layer<S> for Seen {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        use tracing_log::NormalizeEvent;
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let line = format!(
            "{} {}: {}",
            meta.level(),
            meta.target(),
            stderr::message_of(event)
        );
        self.0.lock().unwrap().push(line);
    }
}

#[test]
fn ten_thousand_invalid_queue_sizes_reach_tracing_as_one_event() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let levels = stderr::Levels::parse("warn", "warn", &["virtio_devices"]);
    let max = levels.max_level();
    let subscriber = tracing_subscriber::registry().with(Seen(seen.clone()).with_filter(levels));
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let bridge = SiteLimitedLogger::new(stderr::LogTracer::new(), &["virtio_devices"], PERIOD);
    log::set_logger(Box::leak(Box::new(bridge))).unwrap();
    log::set_max_level(stderr::as_log(max));
    let mut queue = Queue::new(256).unwrap();
    let started = std::time::Instant::now();
    for _ in 0..10_000 {
        // Not a power of two: virtio-queue refuses it and logs an error.
        queue.set_size(3);
    }
    // One event per period the loop took (one, on any machine that runs
    // 10,000 calls within 10 s).
    let periods = started.elapsed().as_secs() / PERIOD.as_secs();
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty());
    assert!(seen.len() as u64 <= 1 + periods, "{seen:?}");
    assert!(
        seen[0].starts_with("ERROR virtio_queue") && seen[0].contains("invalid size: 3"),
        "{seen:?}"
    );
}
