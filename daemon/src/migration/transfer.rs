//! SET_DEVICE_STATE_FD / CHECK_DEVICE_STATE on the daemon's side: the state
//! is written to (SAVE) or read from (LOAD) the front-end's descriptor on a
//! thread of its own, since the vhost-user handler must not block on it
//! (the front-end reads the SAVE blob and writes the LOAD blob only after
//! our reply). CHECK_DEVICE_STATE waits, bounded, for that thread's result.
//! A LOAD reads at most [`MAX_STATE_BYTES`]: one byte more is an error.

use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::Duration;

use super::MAX_STATE_BYTES;

/// How long CHECK_DEVICE_STATE waits for the transfer: the front-end has
/// read or written the whole blob before it asks, so only the daemon's own
/// work remains (a million inodes found again by path at most).
pub const CHECK_WAIT: Duration = Duration::from_secs(60);

/// The one transfer a daemon runs at a time, from SET_DEVICE_STATE_FD to
/// CHECK_DEVICE_STATE.
#[derive(Default)]
pub struct Transfers {
    pending: Mutex<Option<Receiver<Result<(), String>>>>,
}

impl Transfers {
    /// Runs `job` on its own thread; refused while another transfer waits
    /// for its CHECK_DEVICE_STATE.
    pub fn start(
        &self,
        what: &'static str,
        job: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> io::Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.is_some() {
            return Err(io::Error::other(
                "a device-state transfer is already under way",
            ));
        }
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name(format!("fs-state-{what}"))
            .spawn(move || {
                let result = job();
                if let Err(e) = &result {
                    tracing::error!("device state {what}: {e}");
                }
                let _ = tx.send(result);
            })?;
        *pending = Some(rx);
        Ok(())
    }

    /// The transfer's result, waiting at most `wait`; an error when none
    /// was started, when it failed, or when it did not finish in time.
    pub fn check(&self, wait: Duration) -> io::Result<()> {
        let Some(rx) = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return Err(io::Error::other("no device-state transfer was started"));
        };
        match rx.recv_timeout(wait) {
            Ok(result) => result.map_err(io::Error::other),
            Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the device-state transfer did not finish within {wait:?}"),
            )),
            Err(RecvTimeoutError::Disconnected) => {
                Err(io::Error::other("the device-state transfer's thread died"))
            }
        }
    }
}

/// SAVE: writes `blob` and closes `file` (the front-end reads to EOF).
pub fn write_blob(mut file: File, blob: &[u8]) -> Result<(), String> {
    file.write_all(blob)
        .map_err(|e| format!("writing {} bytes of state: {e}", blob.len()))
}

/// Bytes of a failed LOAD's reason written back on its descriptor at most.
pub const MAX_REASON_BYTES: usize = 1024;

/// LOAD: reads `file` to EOF, at most [`MAX_STATE_BYTES`].
pub fn read_blob(file: &mut File) -> Result<Vec<u8>, String> {
    let mut blob = Vec::new();
    let limit = u64::try_from(MAX_STATE_BYTES).unwrap_or(u64::MAX);
    file.take(limit.saturating_add(1))
        .read_to_end(&mut blob)
        .map_err(|e| format!("reading the state: {e}"))?;
    if blob.len() > MAX_STATE_BYTES {
        return Err(format!(
            "the state is longer than the limit of {MAX_STATE_BYTES} bytes"
        ));
    }
    Ok(blob)
}

/// A failed LOAD: its reason (which names the file it could not open as
/// the saved one) written back on the descriptor, at most
/// [`MAX_REASON_BYTES`], for a front-end that reads it (ours passes a
/// socket and reads after a failed CHECK_DEVICE_STATE; vhost-user's
/// CHECK reply carries no text). A front-end that passed a pipe cannot be
/// written to: that is no further error.
pub fn write_reason(file: &mut File, reason: &str) {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let _ = file.write_all(reason.as_bytes().get(..end).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn one_transfer_at_a_time_and_check_gives_its_result_once() {
        let t = Transfers::default();
        assert!(t.check(Duration::ZERO).is_err(), "nothing started");
        let (release, wait) = channel::<()>();
        t.start("test", move || {
            let _ = wait.recv();
            Err("it failed".into())
        })
        .unwrap();
        assert!(t.start("test", || Ok(())).is_err(), "a second one");
        release.send(()).unwrap();
        let err = t.check(CHECK_WAIT).unwrap_err().to_string();
        assert!(err.contains("it failed"), "{err}");
        assert!(t.check(Duration::ZERO).is_err(), "taken once");
        t.start("test", || Ok(())).unwrap();
        t.check(CHECK_WAIT).unwrap();
    }

    #[test]
    fn a_transfer_that_does_not_finish_is_an_error_after_the_bound() {
        let t = Transfers::default();
        let (release, wait) = channel::<()>();
        t.start("test", move || {
            let _ = wait.recv();
            Ok(())
        })
        .unwrap();
        let err = t.check(Duration::from_millis(10)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        release.send(()).unwrap();
    }

    #[test]
    fn a_load_longer_than_the_cap_is_refused_and_a_save_reaches_eof() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            let mut theirs = theirs;
            let chunk = vec![b' '; 1 << 20];
            for _ in 0..=(MAX_STATE_BYTES >> 20) {
                if theirs.write_all(&chunk).is_err() {
                    return;
                }
            }
        });
        let err = read_blob(&mut File::from(std::os::fd::OwnedFd::from(ours))).unwrap_err();
        assert!(err.contains("limit"), "{err}");
        writer.join().unwrap();

        let (ours, mut theirs) = UnixStream::pair().unwrap();
        write_blob(File::from(std::os::fd::OwnedFd::from(ours)), b"state").unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"state");
    }

    /// A failed load's reason goes back on a socket, cut at a character
    /// boundary within the bound; on a pipe's read end nothing happens.
    #[test]
    fn a_failed_loads_reason_goes_back_bounded() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut file = File::from(std::os::fd::OwnedFd::from(ours));
        let reason = format!("restore: {}: No such file or directory", "é".repeat(600));
        write_reason(&mut file, &reason);
        drop(file);
        let mut got = String::new();
        theirs.read_to_string(&mut got).unwrap();
        assert!(got.len() <= MAX_REASON_BYTES && got.len() >= MAX_REASON_BYTES - 1);
        assert!(reason.starts_with(&got));

        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two fds, owned below.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh fds nothing else owns.
        let (read_end, _write_end) = unsafe {
            (
                File::from(std::os::fd::OwnedFd::from_raw_fd(fds[0])),
                File::from(std::os::fd::OwnedFd::from_raw_fd(fds[1])),
            )
        };
        let mut read_end = read_end;
        write_reason(&mut read_end, "ignored");
    }
}
