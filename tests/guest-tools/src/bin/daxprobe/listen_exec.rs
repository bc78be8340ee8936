//! `daxprobe listen-exec SOCKET PROG ARGS...`: starts a virtio-fs daemon
//! the way Kata's Go runtime does (virtiofsd.go `Start`): it binds and
//! listens on the unix socket itself (`net.ListenUnix`: a listening,
//! non-blocking stream socket), hands it to the daemon as fd 3
//! (`cmd.ExtraFiles`), and the daemon is told `--fd=3`. Here the socket is
//! made and then this process becomes PROG (exec), so the daemon's pid is
//! the one that started it.
//!
//! `daxprobe tap-exec TAP PROG ARGS...`: opens (creating) the tap TAP as
//! Kata's endpoints have it and execs PROG with it as fd 3, as an operator
//! hands a tap to `ch-remote restore ...,net_fds=[net0@[3]]`.

use std::os::fd::{IntoRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;

use super::fail;

pub fn listen_exec(socket: &str, prog: &str, args: &[&str]) -> ! {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    listener
        .set_nonblocking(true)
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    exec_with_fd3(listener.into_raw_fd(), prog, args)
}

pub fn tap_exec(tap: &str, prog: &str, args: &[&str]) -> ! {
    exec_with_fd3(super::kata_net::open_tap(tap).into_raw_fd(), prog, args)
}

/// Execs PROG with `fd` (which this process owns) as its fd 3.
fn exec_with_fd3(fd: RawFd, prog: &str, args: &[&str]) -> ! {
    // Go's ExtraFiles[0] is the child's fd 3, without close-on-exec.
    // SAFETY: dup2 of an fd this process owns onto 3; then fd 3 is ours.
    if fd != 3 && unsafe { libc::dup2(fd, 3) } != 3 {
        fail(format!("dup2: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: clearing FD_CLOEXEC on fd 3, which this process owns.
    if unsafe { libc::fcntl(3, libc::F_SETFD, 0) } != 0 {
        fail(format!("fcntl: {}", std::io::Error::last_os_error()));
    }
    if fd != 3 {
        // SAFETY: the original fd, now duplicated on 3, is not used again.
        unsafe { libc::close(fd) };
    }
    let err = std::process::Command::new(prog).args(args).exec();
    fail(format!("{prog}: {err}"))
}
