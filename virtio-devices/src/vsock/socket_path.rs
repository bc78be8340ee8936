//! The hybrid vsock's listening socket on the host: bound at the path the
//! operator gave (`vsock.socket`, `vm.add-vsock`), and removed with the
//! device. Only a socket is ever removed: a stale one left by a VMM that
//! is gone (nothing accepts on it: a connect gets `ECONNREFUSED`) is
//! replaced at bind, and at removal only the socket this backend bound
//! (same device and inode) goes. Anything else at the path, a regular
//! file, a directory, a live socket, is refused by name and left alone.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::file_type::describe;

/// Why the socket path could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum SocketPathError {
    #[error("vsock socket={path}: {source}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
    #[error("vsock socket={path}: a process listens on it already")]
    InUse { path: String },
    #[error("vsock socket={path}: {what} is there, not a socket; it is left alone (remove it, or name another path)")]
    NotASocket { path: String, what: &'static str },
    #[error("vsock socket={path}: the passed socket {what}")]
    Passed { path: String, what: String },
    #[error(
        "vsock socket={path}: a socket is there and probing it failed ({source}); it is left alone"
    )]
    Unprobed {
        path: String,
        source: std::io::Error,
    },
}

/// Which socket file a backend bound: (device, inode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketId(u64, u64);

fn socket_id(path: &Path) -> std::io::Result<Option<SocketId>> {
    let m = std::fs::symlink_metadata(path)?;
    Ok(m.file_type()
        .is_socket()
        .then(|| SocketId(m.dev(), m.ino())))
}

/// Binds `path`. Something there already: a socket nothing listens on is
/// replaced; a live socket, or anything that is not a socket, is an error
/// naming the path and what is there.
pub fn bind(path: &Path) -> Result<(UnixListener, Option<SocketId>), SocketPathError> {
    let name = || path.display().to_string();
    let err = |source| SocketPathError::Bind {
        path: name(),
        source,
    };
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            let there = std::fs::symlink_metadata(path).map_err(err)?.file_type();
            if !there.is_socket() {
                return Err(SocketPathError::NotASocket {
                    path: name(),
                    what: describe(there),
                });
            }
            match connect_nonblocking(path) {
                // A full queue (EAGAIN) is a live listener too.
                Ok(_) => return Err(SocketPathError::InUse { path: name() }),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(SocketPathError::InUse { path: name() })
                }
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {}
                Err(source) => {
                    return Err(SocketPathError::Unprobed {
                        path: name(),
                        source,
                    })
                }
            }
            std::fs::remove_file(path).map_err(err)?;
            UnixListener::bind(path).map_err(err)?
        }
        Err(e) => return Err(err(e)),
    };
    // Not knowing it (the path already renamed away) only means the name
    // is not removed at the end.
    Ok((listener, socket_id(path).ok().flatten()))
}

/// Takes a listener another process bound at `path` and passed (a local
/// migration's sender), once it is checked to be one: a listening
/// `AF_UNIX` stream socket whose bound address is `path`. Its name is
/// the socket file there now (removed at the end like one bound here).
pub fn adopt(
    path: &Path,
    listener: UnixListener,
) -> Result<(UnixListener, Option<SocketId>), SocketPathError> {
    check_passed(path, &listener)?;
    Ok((listener, socket_id(path).ok().flatten()))
}

/// The checks of [`adopt`] alone.
pub fn check_passed(path: &Path, listener: &UnixListener) -> Result<(), SocketPathError> {
    let passed = |what: String| SocketPathError::Passed {
        path: path.display().to_string(),
        what,
    };
    let option = |name| {
        int_option(listener, name)
            .map_err(|e| passed(format!("cannot be probed ({e}); is it a socket?")))
    };
    let kind = option(libc::SO_TYPE)?;
    if kind != libc::SOCK_STREAM {
        return Err(passed(format!(
            "is of type {kind}, not a stream socket (SOCK_STREAM)"
        )));
    }
    // An AF_UNIX name, or an error: the address family is checked there.
    let address = listener
        .local_addr()
        .map_err(|e| passed(format!("has no unix address ({e})")))?;
    if option(libc::SO_ACCEPTCONN)? == 0 {
        return Err(passed("does not listen".to_string()));
    }
    match address.as_pathname() {
        Some(bound) if bound == path => {}
        Some(bound) => {
            return Err(passed(format!(
                "is bound at {}, not at the configured path",
                bound.display()
            )))
        }
        None => return Err(passed("is not bound at a path".to_string())),
    }
    Ok(())
}

/// `getsockopt(SOL_SOCKET, name)` for an int option.
fn int_option(socket: &impl AsRawFd, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .unwrap_or(libc::socklen_t::MAX);
    // SAFETY: an int-sized buffer and its length, for the call's duration.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            std::ptr::addr_of_mut!(value).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value)
}

/// Removes `path` if it still is the socket `bound` names (not a file the
/// operator put there since).
pub fn remove_if_bound(path: &Path, bound: Option<SocketId>) {
    if bound.is_some() && socket_id(path).ok().flatten() == bound {
        let _ = std::fs::remove_file(path);
    }
}

/// Connects to the unix listener `path` without blocking: a listener
/// whose queue is full refuses (EAGAIN) rather than stalling the device.
pub(super) fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    addr.sun_family = const { narrow::sa_family_of(libc::AF_UNIX) };
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = libc::c_char::from_ne_bytes([*src]);
    }
    // SAFETY: integer arguments; the fd is owned right below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // The path is NUL-terminated (zeroed tail); the length is the struct's.
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_un>())
        .unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `addr` is a valid sockaddr_un for the call's duration.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::tempdir::TempDir;

    fn refused(path: &Path) -> String {
        match bind(path) {
            Ok(_) => panic!("{} bound", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_regular_file_or_directory_at_the_path_is_refused_by_name_and_kept() {
        let dir = TempDir::new().unwrap();
        let file = dir.as_path().join("precious");
        std::fs::write(&file, b"keep me").unwrap();
        let e = refused(&file);
        assert_eq!(
            e,
            format!(
                "vsock socket={}: a regular file is there, not a socket; \
                 it is left alone (remove it, or name another path)",
                file.display()
            )
        );
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

        let sub = dir.as_path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(refused(&sub).contains("a directory is there"));
        assert!(sub.is_dir());

        let link = dir.as_path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(refused(&link).contains("a symbolic link is there"));
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    }

    #[test]
    fn a_stale_socket_is_replaced_a_live_one_refused_and_kept() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("s");
        drop(UnixListener::bind(&path).unwrap());
        let (live, id) = bind(&path).unwrap();
        assert!(id.is_some());
        let e = refused(&path);
        assert!(e.contains("listens on it already"), "{e}");
        assert_eq!(socket_id(&path).unwrap(), id, "the live socket is kept");
        drop(live);
    }

    #[test]
    fn only_the_socket_bound_is_removed_at_the_end() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("s");
        let (_listener, id) = bind(&path).unwrap();
        // The operator replaced the name with a file meanwhile: kept.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"new").unwrap();
        remove_if_bound(&path, id);
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        // Our own socket goes.
        std::fs::remove_file(&path).unwrap();
        let (_listener, id) = bind(&path).unwrap();
        remove_if_bound(&path, id);
        assert!(std::fs::symlink_metadata(&path).is_err());
    }
}
