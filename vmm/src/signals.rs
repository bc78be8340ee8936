//! The VMM's signals. SIGINT and SIGTERM are blocked in every thread and
//! read from a signalfd by the main loop, so a stop request is handled like
//! any other VM exit. The kick signal interrupts a blocking KVM ioctl on one
//! thread: a vCPU's KVM_RUN (to park or stop it) and a pre-fault's
//! KVM_PRE_FAULT_MEMORY (when its timer fires).
//!
//! A stop signal always ends the process: when one arrives, a watchdog
//! thread gives the teardown [`STOP_GRACE`] (or until a second stop
//! signal), then exits without waiting for it, so a device thread or a
//! vCPU that does not stop cannot keep the VMM alive.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Once;
use std::time::Duration;

/// How long the VMM tears the VM down after a stop signal before it exits
/// regardless: longer than a device thread's own stop bound
/// (`virtio_devices::event_loop::STOP_TIMEOUT`), so a normal teardown
/// always finishes.
pub const STOP_GRACE: Duration = Duration::from_secs(15);
/// The exit status when the teardown did not finish in time.
pub const STOP_GRACE_EXPIRED: i32 = 1;

/// The signal that kicks a vCPU thread out of KVM_RUN (and a pre-fault
/// out of KVM_PRE_FAULT_MEMORY).
pub(crate) fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the kick signal's handler (once per process): without one the
/// signal would end the process instead of interrupting the ioctl.
pub(crate) fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The handler does nothing: its only job is to make KVM_RUN return EINTR.
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick) {
            tracing::error!("installing the vCPU kick handler: {e}; stopping a VM will wait for its vCPUs to exit");
        }
    });
}

pub struct StopSignals {
    fd: File,
}

impl StopSignals {
    /// Must run before any other thread starts, so that all inherit the mask.
    pub fn block() -> std::io::Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t; the calls only write into it and
        // change this thread's mask; the signalfd result is checked.
        let fd = unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signalfd(-1, &set, libc::SFD_CLOEXEC)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh signalfd owned by nobody else.
        let fd = unsafe { File::from_raw_fd(fd) };
        Ok(StopSignals { fd })
    }

    /// Waits until one of `other_fds` is readable or a stop signal arrives;
    /// returns the signal.
    pub fn wait(&self, other_fds: &[i32]) -> std::io::Result<Option<i32>> {
        let mut fds = vec![libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        fds.extend(other_fds.iter().map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `fds` is a valid array of `fds.len()` pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            };
        }
        if fds[0].revents & libc::POLLIN != 0 {
            let mut info = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
            (&self.fd).read_exact(&mut info)?;
            let signo = u32::from_ne_bytes(info[0..4].try_into().expect("4 bytes"));
            let signo = i32::try_from(signo).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("signalfd gave signal number {signo}"),
                )
            })?;
            self.arm_watchdog(signo);
            return Ok(Some(signo));
        }
        Ok(None)
    }

    /// After stop signal `signo`: the process exits once [`STOP_GRACE`]
    /// has passed or another stop signal arrives, whatever the teardown
    /// is doing.
    fn arm_watchdog(&self, signo: i32) {
        let fd = match self.fd.try_clone() {
            Ok(fd) => fd,
            Err(e) => return tracing::error!("stop watchdog: {e}; the teardown is not bounded"),
        };
        watch_teardown(fd, signo, STOP_GRACE, |why| {
            eprintln!("dax-vmm: {why}; exiting without finishing the teardown");
            // SAFETY: _exit ends the process at once; nothing of this
            // process's memory is used afterwards.
            unsafe { libc::_exit(STOP_GRACE_EXPIRED) }
        });
    }
}

/// Starts the thread that calls `expire` when `grace` has passed or a
/// second stop signal can be read from `signals`.
fn watch_teardown(
    signals: File,
    signo: i32,
    grace: Duration,
    expire: impl FnOnce(String) + Send + 'static,
) {
    let spawned = std::thread::Builder::new()
        .name("stop-watchdog".into())
        .spawn(move || {
            let mut fd = libc::pollfd {
                fd: signals.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let end = std::time::Instant::now() + grace;
            loop {
                let left = end.saturating_duration_since(std::time::Instant::now());
                // Rounded up, so an early wake-up polls again.
                let ms = libc::c_int::try_from(left.as_millis().saturating_add(1))
                    .unwrap_or(libc::c_int::MAX);
                // SAFETY: one valid pollfd for the duration of the call.
                let n = unsafe { libc::poll(&mut fd, 1, ms) };
                if n > 0 {
                    return expire(format!("a second stop signal after signal {signo}"));
                }
                if n == 0 || left.is_zero() {
                    return expire(format!(
                        "the VM did not stop within {grace:?} of signal {signo}"
                    ));
                }
                // EINTR: poll again for what is left.
            }
        });
    if let Err(e) = spawned {
        tracing::error!("stop watchdog: {e}; the teardown is not bounded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, OwnedFd};
    use vmm_sys_util::signal::Killable;

    /// After a stop signal the watchdog ends the process when the grace
    /// runs out (here: tells the test), whatever the teardown does.
    #[test]
    fn the_watchdog_fires_when_the_teardown_outlasts_the_grace() {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned only here.
        let (read_end, write_end) =
            unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (tx, rx) = std::sync::mpsc::channel();
        watch_teardown(read_end, 15, Duration::from_millis(10), move |why| {
            tx.send(why).unwrap();
        });
        // A bound for a hang, not a speed figure.
        let why = rx.recv_timeout(Duration::from_secs(60)).expect("fired");
        assert_eq!(why, "the VM did not stop within 10ms of signal 15");
        drop(write_end);
    }

    /// A second stop signal (anything readable on the signalfd) ends it
    /// at once, without waiting for the grace.
    #[test]
    fn a_second_stop_signal_ends_the_wait() {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned only here.
        let (read_end, mut write_end) =
            unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let (tx, rx) = std::sync::mpsc::channel();
        watch_teardown(read_end, 2, Duration::from_secs(3600), move |why| {
            tx.send(why).unwrap();
        });
        std::io::Write::write_all(&mut write_end, &[1]).unwrap();
        let why = rx.recv_timeout(Duration::from_secs(60)).expect("fired");
        assert_eq!(why, "a second stop signal after signal 2");
    }

    /// The kick interrupts a blocking syscall on the thread it is sent to
    /// (EINTR, as KVM_RUN returns it) and leaves the process running.
    #[test]
    fn a_kick_interrupts_a_blocking_call_on_its_thread() {
        install_kick_handler();
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned only here.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let reader = std::thread::spawn(move || {
            let mut byte = 0u8;
            // SAFETY: reads at most one byte into `byte`, which outlives the call.
            let n = unsafe { libc::read(read_end.as_raw_fd(), (&raw mut byte).cast(), 1) };
            (n, std::io::Error::last_os_error().raw_os_error())
        });
        // The reader may not be in read(2) yet: kick until it has returned
        // (nothing is ever written, so only a kick ends the read).
        while !reader.is_finished() {
            reader.kill(kick_signal()).expect("pthread_kill");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (n, errno) = reader.join().expect("reader thread");
        assert_eq!((n, errno), (-1, Some(libc::EINTR)));
        drop(write_end);
    }
}
