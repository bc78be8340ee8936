//! `--fd`: the vhost-user socket handed down already listening, as Kata
//! Containers starts virtiofsd (it binds and listens on the socket itself,
//! passes it as fd 3, and owns the socket file: the daemon never unlinks it).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use crate::passthrough::cvt;

fn socket_option(fd: RawFd, option: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    #[expect(clippy::cast_possible_truncation, reason = "an int is 4 bytes")]
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are writable and sized for an int option;
    // on an fd that is not a socket the call fails without writing.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(value)
}

fn type_name(socket_type: libc::c_int) -> String {
    match socket_type {
        libc::SOCK_DGRAM => "SOCK_DGRAM".into(),
        libc::SOCK_SEQPACKET => "SOCK_SEQPACKET".into(),
        libc::SOCK_RAW => "SOCK_RAW".into(),
        other => format!("type {other}"),
    }
}

/// Takes ownership of inherited `fd` once it is checked to be a listening
/// unix stream socket; it is then blocking (vhost-user-backend's accept
/// loop would spin on a non-blocking one) and close-on-exec (it goes into
/// nothing the daemon may start). Errors name `--fd` and what it is instead.
pub fn inherited(fd: RawFd) -> Result<UnixListener, String> {
    let err = |what: String| format!("--fd {fd}: {what}");
    if fd < 0 {
        return Err(err("not a file descriptor number".into()));
    }
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(err(format!(
            "not an open file descriptor ({}); pass the listening vhost-user socket as this fd",
            io::Error::last_os_error()
        )));
    }
    let domain = socket_option(fd, libc::SO_DOMAIN).map_err(|e| {
        err(if e.raw_os_error() == Some(libc::ENOTSOCK) {
            "not a socket; pass a listening unix stream socket".into()
        } else {
            format!("reading its socket domain: {e}")
        })
    })?;
    if domain != libc::AF_UNIX {
        return Err(err(format!(
            "not a unix socket (address family {domain}); pass a listening unix stream socket"
        )));
    }
    let socket_type = socket_option(fd, libc::SO_TYPE)
        .map_err(|e| err(format!("reading its socket type: {e}")))?;
    if socket_type != libc::SOCK_STREAM {
        return Err(err(format!(
            "a {} unix socket, not SOCK_STREAM; pass a listening unix stream socket",
            type_name(socket_type)
        )));
    }
    let listening = socket_option(fd, libc::SO_ACCEPTCONN)
        .map_err(|e| err(format!("reading whether it listens: {e}")))?;
    if listening == 0 {
        return Err(err(
            "the unix socket is not listening; bind it and listen(2) on it before passing it"
                .into(),
        ));
    }
    // SAFETY: `fd` is open, a socket, and from here on owned by this
    // process alone: the caller passed it to us (`--fd`) and nothing else
    // in the daemon knows its number.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let listener = UnixListener::from(owned);
    listener
        .set_nonblocking(false)
        .map_err(|e| err(format!("making it blocking: {e}")))?;
    // SAFETY: sets the close-on-exec flag of an fd this process owns.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) })
        .map_err(|e| err(format!("setting close-on-exec: {e}")))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, IntoRawFd};
    use std::os::unix::net::{UnixDatagram, UnixStream};

    use vmm_sys_util::tempdir::TempDir;

    use super::*;

    /// An fd this test hands over, as Kata hands its socket: no longer
    /// owned by anything else in the process.
    fn handed(fd: impl IntoRawFd) -> RawFd {
        fd.into_raw_fd()
    }

    fn close(fd: RawFd) {
        // SAFETY: closes an fd handed over above and refused, so still ours.
        unsafe { libc::close(fd) };
    }

    #[test]
    fn a_listening_unix_stream_socket_is_taken_blocking_and_close_on_exec() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("fs.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let fd = handed(listener);
        // SAFETY: clears FD_CLOEXEC on our own fd, as an exec'd child sees it.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
        let listener = inherited(fd).unwrap();
        assert_eq!(listener.as_raw_fd(), fd);
        // SAFETY: reads flags of an fd the listener owns.
        let (status, fd_flags) = unsafe {
            (
                libc::fcntl(fd, libc::F_GETFL),
                libc::fcntl(fd, libc::F_GETFD),
            )
        };
        assert_eq!(status & libc::O_NONBLOCK, 0, "blocking");
        assert_eq!(fd_flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let _client = UnixStream::connect(&path).unwrap();
        listener.accept().expect("serves the connection");
    }

    #[test]
    fn anything_else_is_refused_naming_the_fd_and_what_it_is() {
        let dir = TempDir::new().unwrap();
        let file = handed(std::fs::File::open(dir.as_path()).unwrap());
        let e = inherited(file).unwrap_err();
        assert!(e.starts_with(&format!("--fd {file}: not a socket")), "{e}");
        close(file);

        // Far above any fd this process has open (tests run in parallel:
        // a number just closed may be reused at once).
        let e = inherited(i32::MAX).unwrap_err();
        assert!(
            e.starts_with(&format!("--fd {}: not an open file descriptor", i32::MAX)),
            "{e}"
        );

        let datagram = handed(UnixDatagram::unbound().unwrap());
        let e = inherited(datagram).unwrap_err();
        assert!(
            e.starts_with(&format!("--fd {datagram}: a SOCK_DGRAM unix socket")),
            "{e}"
        );
        close(datagram);

        // Bound but never listened on: connecting would be refused.
        let (a, b) = UnixStream::pair().unwrap();
        let unlistening = handed(a);
        let e = inherited(unlistening).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "--fd {unlistening}: the unix socket is not listening"
            )),
            "{e}"
        );
        close(unlistening);
        drop(b);

        let tcp = handed(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let e = inherited(tcp).unwrap_err();
        assert!(
            e.starts_with(&format!("--fd {tcp}: not a unix socket")),
            "{e}"
        );
        close(tcp);

        let e = inherited(-1).unwrap_err();
        assert!(
            e.starts_with("--fd -1: not a file descriptor number"),
            "{e}"
        );
    }
}
