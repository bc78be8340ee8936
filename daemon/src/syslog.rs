//! `--syslog`: log records go to the local syslog daemon over `/dev/log`,
//! as virtiofsd's do (Kata Containers starts it so, with stderr on
//! `/dev/null`), in the RFC 3164 form glibc's `syslog(3)` sends:
//! `<PRI>Mmm dd hh:mm:ss dax-virtiofsd[PID]: message`, facility `user`.
//!
//! The socket is connected once, before the sandbox: inside it there is no
//! `/dev/log` and the seccomp filter allows no `socket`/`connect`. Sending
//! then needs only `sendto`, which the filter allows. A record the socket
//! does not take (the syslog daemon restarted, its queue is full: sends
//! never block a serving thread) is written to stderr instead.
//!
//! PID is the daemon's pid as its starter knows it, taken when the socket
//! is connected: the namespace sandbox's serving process is pid 1 of its
//! own pid namespace.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;

use log_limit::stderr::{self, Levels};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Where the local syslog daemon listens.
pub const DEV_LOG: &str = "/dev/log";

/// The `user` facility (virtiofsd's), times 8 as PRI wants it.
const FACILITY_USER: u8 = 1 << 3;

/// The name records carry.
const NAME: &str = "dax-virtiofsd";

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

pub struct Syslog {
    socket: OwnedFd,
    /// A stream `/dev/log` (some syslog daemons): records are framed by a
    /// trailing NUL, as glibc does. A datagram is one record.
    stream: bool,
    pid: u32,
    level: LevelFilter,
}

impl Syslog {
    /// Connects to the syslog socket at `path`: a datagram socket, or a
    /// stream one if the path is that (`EPROTOTYPE`).
    pub fn connect(path: &Path, level: LevelFilter) -> io::Result<Syslog> {
        let datagram = UnixDatagram::unbound()?;
        let (socket, stream) = match datagram.connect(path) {
            Ok(()) => (OwnedFd::from(datagram), false),
            Err(e) if e.raw_os_error() == Some(libc::EPROTOTYPE) => {
                (OwnedFd::from(UnixStream::connect(path)?), true)
            }
            Err(e) => return Err(e),
        };
        // The first localtime_r reads the time zone (/etc/localtime, TZ);
        // done now, before the sandbox hides the file, later calls read none.
        let _ = timestamp(0);
        Ok(Syslog {
            socket,
            stream,
            pid: std::process::id(),
            level,
        })
    }

    /// One record as it goes on the wire.
    fn format(&self, level: Level, now: libc::time_t, message: &str) -> Vec<u8> {
        let severity: u8 = match level {
            Level::ERROR => 3,
            Level::WARN => 4,
            Level::INFO => 6,
            _ => 7,
        };
        let mut out = format!(
            "<{}>{} {NAME}[{}]: {message}",
            FACILITY_USER | severity,
            timestamp(now),
            self.pid
        )
        .into_bytes();
        if self.stream {
            out.push(0);
        }
        out
    }

    /// Sends one record without blocking; false if the socket did not take
    /// all of it.
    fn send(&self, record: &[u8]) -> bool {
        // SAFETY: sends from a buffer valid for its length on a socket this
        // logger owns; MSG_NOSIGNAL: a closed stream is an error, not SIGPIPE.
        let sent = unsafe {
            libc::send(
                self.socket.as_raw_fd(),
                record.as_ptr().cast(),
                record.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        usize::try_from(sent).is_ok_and(|n| n == record.len())
    }
}

/// `Mmm dd hh:mm:ss` in local time (RFC 3164's TIMESTAMP).
fn timestamp(now: libc::time_t) -> String {
    // SAFETY: all-zero is a valid `tm` for localtime_r to overwrite.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r is thread-safe.
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return "Jan  1 00:00:00".into();
    }
    let month = usize::try_from(tm.tm_mon)
        .ok()
        .and_then(|m| MONTHS.get(m))
        .unwrap_or(&"Jan");
    format!(
        "{month} {:>2} {:02}:{:02}:{:02}",
        tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec
    )
}

impl Syslog {
    /// Sends `message` at `level` if the level is shown; to stderr if the
    /// socket does not take it.
    fn record(&self, level: Level, message: &str) {
        if level > self.level {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| libc::time_t::try_from(d.as_secs()).unwrap_or(0));
        if !self.send(&self.format(level, now, message)) {
            let _ = writeln!(io::stderr(), "{NAME}: {level}: {message}");
        }
    }
}

impl<S: Subscriber> Layer<S> for Syslog {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        self.record(*event.metadata().level(), &stderr::message_of(event));
    }
}

/// Makes the syslog socket at `path` the process's logger; if it cannot be
/// connected, says so once on stderr and returns false (the caller logs to
/// stderr instead).
pub fn install(path: &Path, level: LevelFilter) -> bool {
    match Syslog::connect(path, level) {
        Ok(syslog) => {
            let shown = Levels::at(level, crate::OWN_CRATES);
            let subscriber = tracing_subscriber::registry().with(syslog.with_filter(shown));
            if tracing::subscriber::set_global_default(subscriber).is_err() {
                return false;
            }
            stderr::bridge_log(level);
            true
        }
        Err(e) => {
            eprintln!(
                "{NAME}: --syslog: {}: {e}; logging to stderr instead",
                path.display()
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixListener;

    use seccomp::{try_in_child, Outcome};
    use vmm_sys_util::tempdir::TempDir;

    use super::*;

    fn warning(logger: &Syslog, text: &str) {
        logger.record(Level::WARN, text);
    }

    /// `<12>Mmm dd hh:mm:ss dax-virtiofsd[PID]: text`, checked field by field.
    fn assert_rfc3164(record: &str, pid: u32, text: &str) {
        let rest = record.strip_prefix("<12>").expect(record);
        let (stamp, rest) = rest.split_at(15);
        assert!(MONTHS.contains(&&stamp[..3]), "{record}");
        let digits: String = stamp[4..].chars().filter(char::is_ascii_digit).collect();
        assert_eq!(digits.len(), 8, "{record}");
        assert_eq!(rest, format!(" dax-virtiofsd[{pid}]: {text}"));
    }

    /// The daemon logs from threads under its seccomp filter: a record must
    /// reach the socket connected before it, not kill the daemon.
    #[test]
    fn a_record_reaches_the_syslog_socket_under_the_serving_filter() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("log");
        let syslogd = UnixDatagram::bind(&path).unwrap();
        let logger = Syslog::connect(&path, LevelFilter::INFO).unwrap();
        let outcome = try_in_child(
            || {
                vec![seccomp::build(
                    "daemon",
                    &crate::seccomp_filter::serving(),
                    seccomp::Mode::Kill,
                )
                .unwrap()
                .unwrap()]
            },
            || {
                warning(&logger, "under the filter");
                0
            },
        );
        assert_eq!(outcome, Outcome::Returned(0));
        // The child has exited: what it sent is queued, or never will be.
        syslogd.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 512];
        let n = syslogd.recv(&mut buf).expect("a record on the socket");
        assert_rfc3164(
            std::str::from_utf8(&buf[..n]).unwrap(),
            std::process::id(),
            "under the filter",
        );
    }

    #[test]
    fn a_stream_syslog_socket_gets_nul_terminated_records_and_levels_are_filtered() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("log");
        let syslogd = UnixListener::bind(&path).unwrap();
        let logger = Syslog::connect(&path, LevelFilter::WARN).unwrap();
        let (mut conn, _) = syslogd.accept().unwrap();
        logger.record(Level::INFO, "below the level");
        warning(&logger, "one");
        drop(logger);
        let mut got = String::new();
        conn.read_to_string(&mut got).unwrap();
        let record = got.strip_suffix('\0').expect("NUL-terminated");
        assert_rfc3164(record, std::process::id(), "one");
    }

    #[test]
    fn a_missing_syslog_socket_is_an_error_naming_it() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("absent");
        let e = Syslog::connect(&path, LevelFilter::INFO).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!install(&path, LevelFilter::INFO));
    }
}
