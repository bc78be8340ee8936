//! SIGINT and SIGTERM are blocked in every thread and read from a signalfd
//! by the main loop, so a stop request is handled like any other VM exit.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};

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
            return Ok(Some(signo as i32));
        }
        Ok(None)
    }
}
