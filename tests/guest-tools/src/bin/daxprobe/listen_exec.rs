//! `daxprobe listen-exec SOCKET PROG ARGS...`: starts a virtio-fs daemon
//! the way Kata's Go runtime does (virtiofsd.go `Start`): it binds and
//! listens on the unix socket itself (`net.ListenUnix`: a listening,
//! non-blocking stream socket), hands it to the daemon as fd 3
//! (`cmd.ExtraFiles`), and the daemon is told `--fd=3`. Here the socket is
//! made and then this process becomes PROG (exec), so the daemon's pid is
//! the one that started it.

use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;

use super::fail;

pub fn listen_exec(socket: &str, prog: &str, args: &[&str]) -> ! {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    listener
        .set_nonblocking(true)
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    let fd = listener.into_raw_fd();
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
