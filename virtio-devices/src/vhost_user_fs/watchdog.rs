//! A deadline on a run of vhost-user exchanges with the daemon.
//!
//! A socket timeout is not enough: the vhost crate treats the `EAGAIN` that
//! `SO_RCVTIMEO` produces as "try again" and reads again, so a daemon that
//! accepts the connection and then stops answering would hold the calling
//! thread (the VMM's control thread at boot and hot-plug, a vCPU at
//! activation) for ever. The watchdog instead shuts the socket down when the
//! deadline passes: the blocked read sees end-of-file, the call fails, and
//! the caller reports a timeout. The connection is then gone for good, as it
//! should be with a daemon that stopped answering.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Shuts `fd` down unless dropped within its deadline.
pub struct Watchdog {
    done: Arc<(Mutex<bool>, Condvar)>,
    fired: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Arms the deadline `timeout` from now on `socket` (a duplicate of the
    /// connection's fd: it keeps the socket open, and its number taken, for
    /// as long as the watchdog can fire).
    pub fn arm(socket: OwnedFd, timeout: Duration) -> std::io::Result<Self> {
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        let fired = Arc::new(AtomicBool::new(false));
        let (d, f) = (done.clone(), fired.clone());
        let thread = std::thread::Builder::new()
            .name("vhost-watchdog".into())
            .spawn(move || {
                let deadline = Instant::now() + timeout;
                let (lock, cvar) = &*d;
                let mut finished = lock.lock().unwrap_or_else(|e| e.into_inner());
                while !*finished {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        f.store(true, Ordering::SeqCst);
                        // SAFETY: `socket` is owned by this thread, so the
                        // fd is open; shutdown only changes the socket's
                        // state, it frees nothing.
                        unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_RDWR) };
                        return;
                    }
                    finished = cvar
                        .wait_timeout(finished, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            })?;
        Ok(Watchdog {
            done,
            fired,
            thread: Some(thread),
        })
    }

    /// Whether the deadline passed and the socket was shut down.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cvar) = &*self.done;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cvar.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_read_the_peer_never_answers_ends_at_the_deadline() {
        let (mut a, _b) = UnixStream::pair().unwrap();
        let dog = Watchdog::arm(a.try_clone().unwrap().into(), Duration::from_millis(50)).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(a.read(&mut buf).unwrap(), 0, "shut down: end of file");
        assert!(dog.fired());
    }

    #[test]
    fn dropped_in_time_it_leaves_the_socket_alone() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let dog = Watchdog::arm(a.try_clone().unwrap().into(), Duration::from_secs(60)).unwrap();
        drop(dog); // returns at once, not after the minute
        std::io::Write::write_all(&mut b, b"x").unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(a.read(&mut buf).unwrap(), 1);
    }
}
