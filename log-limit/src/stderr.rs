//! The line format of our binaries' stderr, and which lines it shows.
//!
//! The VMM, the daemon and the fleet agent wrote their logs with
//! env_logger before they moved to `tracing`; operators (and scripts) read
//! that format, so [`Lines`] keeps it:
//! `[2026-01-02T03:04:05Z WARN  virtio_devices::block::io] message`, the
//! level coloured as env_logger coloured it (`RUST_LOG_STYLE`: `always`,
//! `never`, or colour on a terminal). An event's structured fields
//! (`device`, `vcpu`, ...) follow its message as ` key=value`.
//!
//! [`Levels`] reads `RUST_LOG` as env_logger did (`warn`,
//! `virtio_devices=debug,warn`; a target matches by prefix). It shows our
//! own crates' events and the records dependencies log through `log`
//! (bridged by tracing-log); dependencies that emit `tracing` events of
//! their own (hyper-util, tower, h2, tonic) stay silent, as they were when
//! nothing collected them.

use std::fmt::{self, Write as _};
use std::io::{IsTerminal, Write as _};
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::{Interest, SetGlobalDefaultError};
use tracing::{Event, Level, Metadata, Subscriber};
pub use tracing_log::LogTracer;
use tracing_log::NormalizeEvent;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, Filter, Layer, SubscriberExt};

/// An event's message, then its fields as ` key=value` (a bridged `log`
/// record's `log.*` fields left out: the line shows its target already).
pub fn message_of(event: &Event<'_>) -> String {
    let mut text = Text::default();
    event.record(&mut text);
    text.message + &text.fields
}

#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message.push_str(value),
            name if name.starts_with("log.") => {}
            name => {
                let _ = write!(self.fields, " {name}={value}");
            }
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match field.name() {
            "message" => {
                let _ = write!(self.message, "{value:?}");
            }
            name if name.starts_with("log.") => {}
            name => {
                let _ = write!(self.fields, " {name}={value:?}");
            }
        }
    }
}

/// Whether `meta` is a `log` record bridged by tracing-log.
fn is_bridged(meta: &Metadata<'_>) -> bool {
    meta.fields().field("log.target").is_some()
}

/// Which events reach the line (see the module).
pub struct Levels {
    targets: Targets,
    own: &'static [&'static str],
}

impl Levels {
    /// `RUST_LOG` if it is set, else `default` (`warn`, `info`, ...).
    /// `own`: our crates' names as targets start (`virtio_devices`).
    pub fn from_env(default: &str, own: &'static [&'static str]) -> Self {
        let spec = std::env::var("RUST_LOG").ok();
        Self::parse(spec.as_deref().unwrap_or(default), default, own)
    }

    /// `spec` in `RUST_LOG`'s syntax; a spec that does not parse is
    /// reported on stderr and `default` used instead (env_logger ignored
    /// it too).
    pub fn parse(spec: &str, default: &str, own: &'static [&'static str]) -> Self {
        let targets = match Targets::from_str(if spec.trim().is_empty() {
            "error"
        } else {
            spec
        }) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("warning: invalid logging spec '{spec}' ({e}), ignoring it");
                Targets::from_str(default)
                    .unwrap_or_else(|_| Targets::new().with_default(Level::WARN))
            }
        };
        Levels { targets, own }
    }

    /// Every event at or above `level`, no `RUST_LOG` (the fleet agent's
    /// `--log-level`).
    pub fn at(level: LevelFilter, own: &'static [&'static str]) -> Self {
        Levels {
            targets: Targets::new().with_default(level),
            own,
        }
    }

    fn is_own(&self, target: &str) -> bool {
        let krate = target.split("::").next().unwrap_or(target);
        self.own.contains(&krate)
    }

    /// Whether an event of `meta` is shown.
    pub fn shows(&self, meta: &Metadata<'_>) -> bool {
        (is_bridged(meta) || self.is_own(meta.target()))
            && self.targets.would_enable(meta.target(), meta.level())
    }

    /// The most verbose level any target is shown at.
    pub fn max_level(&self) -> LevelFilter {
        self.targets
            .iter()
            .map(|(_, level)| level)
            .chain(self.targets.default_level())
            .max()
            .unwrap_or(LevelFilter::OFF)
    }
}

impl<S: Subscriber> Filter<S> for Levels {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        self.shows(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        // Bridged records share one callsite per level whatever their
        // target: decided record by record.
        if is_bridged(meta) {
            Interest::sometimes()
        } else if self.shows(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max_level())
    }
}

/// Writes each event to stderr as one env_logger line (see the module).
pub struct Lines {
    color: bool,
}

impl Lines {
    /// Coloured as `RUST_LOG_STYLE` says (on a terminal by default).
    pub fn from_env() -> Self {
        let color = match std::env::var("RUST_LOG_STYLE").as_deref() {
            Ok("always") => true,
            Ok("never") => false,
            _ => std::io::stderr().is_terminal(),
        };
        Lines { color }
    }
}

impl<S: Subscriber> Layer<S> for Lines {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        // A bridged record's own target, not tracing-log's callsite's.
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let line = format_line(
            now,
            *meta.level(),
            meta.target(),
            &message_of(event),
            self.color,
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// Makes [`Lines`] filtered by `levels` the process's subscriber; returns
/// the most verbose level it shows (the `log` bridge's maximum).
pub fn install(levels: Levels) -> Result<LevelFilter, SetGlobalDefaultError> {
    let max = levels.max_level();
    let subscriber = tracing_subscriber::registry().with(Lines::from_env().with_filter(levels));
    tracing::subscriber::set_global_default(subscriber)?;
    Ok(max)
}

/// Sends the records dependencies log through `log` to `tracing`, up to
/// `max` (the VMM wraps the bridge in its per-call-site limit instead).
pub fn bridge_log(max: LevelFilter) {
    let _ = tracing_log::LogTracer::builder()
        .with_max_level(as_log(max))
        .init();
}

/// `max` as the `log` crate's level filter.
pub fn as_log(max: LevelFilter) -> log::LevelFilter {
    match max.into_level() {
        None => log::LevelFilter::Off,
        Some(Level::ERROR) => log::LevelFilter::Error,
        Some(Level::WARN) => log::LevelFilter::Warn,
        Some(Level::INFO) => log::LevelFilter::Info,
        Some(Level::DEBUG) => log::LevelFilter::Debug,
        Some(_) => log::LevelFilter::Trace,
    }
}

/// One line as env_logger wrote it: header in brackets, then the text,
/// its continuation lines indented by four.
fn format_line(unix_secs: u64, level: Level, target: &str, text: &str, color: bool) -> String {
    let (open, close) = if color {
        ("\x1b[90m[\x1b[0m", "\x1b[90m]\x1b[0m")
    } else {
        ("[", "]")
    };
    let style = match level {
        _ if !color => "",
        Level::ERROR => "\x1b[1m\x1b[31m",
        Level::WARN => "\x1b[33m",
        Level::INFO => "\x1b[32m",
        Level::DEBUG => "\x1b[34m",
        _ => "\x1b[36m",
    };
    let reset = if color { "\x1b[0m" } else { "" };
    let mut line = format!(
        "{open}{} {style}{:<5}{reset}",
        timestamp(unix_secs),
        level.as_str()
    );
    if !target.is_empty() {
        let _ = write!(line, " {target}");
    }
    let _ = writeln!(line, "{close} {}", text.replace('\n', "\n    "));
    line
}

/// `unix_secs` as RFC 3339 in UTC to the second (`2026-01-02T03:04:05Z`).
fn timestamp(unix_secs: u64) -> String {
    let days = unix_secs / 86_400;
    let secs = unix_secs % 86_400;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm,
    // for dates from 1970 on).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
#[path = "stderr_tests.rs"]
mod tests;
