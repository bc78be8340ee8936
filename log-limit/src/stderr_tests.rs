use std::sync::{Arc, Mutex};

use tracing_subscriber::layer::SubscriberExt;

use super::*;

#[test]
fn timestamps_are_rfc_3339_utc_to_the_second() {
    assert_eq!(timestamp(0), "1970-01-01T00:00:00Z");
    assert_eq!(timestamp(1_767_323_045), "2026-01-02T03:04:05Z");
    assert_eq!(timestamp(951_868_799), "2000-02-29T23:59:59Z");
    assert_eq!(timestamp(4_107_542_400), "2100-03-01T00:00:00Z");
}

/// The line env_logger wrote: level padded to five, target, continuation
/// lines indented; colour only when asked for.
#[test]
fn lines_keep_env_loggers_format() {
    assert_eq!(
        format_line(
            1_767_323_045,
            Level::WARN,
            "virtio_devices::block::io",
            "bad\nnext",
            false
        ),
        "[2026-01-02T03:04:05Z WARN  virtio_devices::block::io] bad\n    next\n"
    );
    assert_eq!(
        format_line(0, Level::ERROR, "", "gone", false),
        "[1970-01-01T00:00:00Z ERROR] gone\n"
    );
    assert_eq!(
        format_line(0, Level::INFO, "vmm", "up", true),
        "\x1b[90m[\x1b[0m1970-01-01T00:00:00Z \x1b[32mINFO \x1b[0m vmm\x1b[90m]\x1b[0m up\n"
    );
}

/// Keeps `target: text` of each event its filter lets through.
struct Seen(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> Layer<S> for Seen {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let line = format!("{}: {}", meta.target(), message_of(event));
        self.0.lock().unwrap().push(line);
    }
}

fn seen_through(levels: Levels, emit: impl FnOnce()) -> Vec<String> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Seen(seen.clone()).with_filter(levels));
    tracing::subscriber::with_default(subscriber, emit);
    let lines = seen.lock().unwrap().clone();
    lines
}

const OWN: &[&str] = &["vmm", "virtio_devices"];

fn bridged(level: log::Level, target: &str, text: &str) {
    tracing_log::format_trace(
        &log::Record::builder()
            .args(format_args!("{text}"))
            .level(level)
            .target(target)
            .build(),
    )
    .unwrap();
}

/// `RUST_LOG`'s syntax as env_logger read it, our crates' events and the
/// records bridged from `log`, and not dependencies' own tracing events.
#[test]
fn levels_follow_rust_log_and_show_our_crates_and_bridged_records() {
    let lines = seen_through(
        Levels::parse("virtio_devices=debug,warn", "warn", OWN),
        || {
            tracing::debug!(target: "virtio_devices::net", device = "net0", "rx");
            tracing::debug!(target: "vmm::vcpu", "hidden: vmm is at warn");
            tracing::warn!(target: "vmm::vcpu", vcpu = 2, "kick");
            tracing::error!(target: "hyper_util::client", "a dependency's own event");
            bridged(log::Level::Error, "virtio_queue::queue", "invalid size: 3");
            bridged(
                log::Level::Info,
                "virtio_queue::queue",
                "hidden: below warn",
            );
        },
    );
    assert_eq!(
        lines,
        [
            "virtio_devices::net: rx device=net0",
            "vmm::vcpu: kick vcpu=2",
            "virtio_queue::queue: invalid size: 3",
        ]
    );
    let levels = Levels::parse("virtio_devices=debug,warn", "warn", OWN);
    assert_eq!(levels.max_level(), LevelFilter::DEBUG);
    // A spec that does not parse: the default.
    let levels = Levels::parse("vmm=loud", "info", OWN);
    assert_eq!(levels.max_level(), LevelFilter::INFO);
    assert_eq!(
        Levels::at(LevelFilter::ERROR, OWN).max_level(),
        LevelFilter::ERROR
    );
    assert_eq!(as_log(LevelFilter::OFF), log::LevelFilter::Off);
    assert_eq!(as_log(LevelFilter::TRACE), log::LevelFilter::Trace);
}
