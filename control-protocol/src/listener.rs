//! The unix socket both of our HTTP servers listen on — the VMM's API
//! (`--api-socket`) and a daemon's control socket — bound the same way:
//!
//! - mode 0600 from the start (umask), so nobody but the owner can connect
//!   in between, and chmod-ed again should another thread have raced the
//!   umask;
//! - bound and listening under `<path>.new`, then renamed into place, so
//!   whoever waits for the path to appear (an orchestrator polling for it)
//!   can connect at once instead of finding a socket bound but not yet
//!   listening (ECONNREFUSED). Where the longer name does not fit in a
//!   socket address, the path is bound directly;
//! - non-blocking, for an async runtime to take over.
//!
//! What to do with a file already at `path` is the caller's choice.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// A failed step (`bind`, `chmod 0600`, `rename into place`,
/// `set_nonblocking`) and why.
pub type BindError = (&'static str, std::io::Error);

/// Binds `path` as described above; `path` itself must not exist.
pub fn bind_owner_only(path: &Path) -> Result<UnixListener, BindError> {
    let mut staged = path.as_os_str().to_owned();
    staged.push(".new");
    let staged = PathBuf::from(staged);
    let _ = std::fs::remove_file(&staged);
    let (listener, bound) = match bind_0600(&staged) {
        Ok(l) => (l, staged.as_path()),
        Err(_) => (bind_0600(path).map_err(|e| ("bind", e))?, path),
    };
    std::fs::set_permissions(bound, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ("chmod 0600", e))?;
    if bound != path {
        std::fs::rename(bound, path).map_err(|e| ("rename into place", e))?;
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| ("set_nonblocking", e))?;
    Ok(listener)
}

/// Binds (and listens on) `path`, created 0600 (umask).
fn bind_0600(path: &Path) -> std::io::Result<UnixListener> {
    // SAFETY: umask only changes this process's file-creation mask; it is
    // restored right after the bind.
    let old = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    listener
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_appears_listening_and_owner_only() {
        let dir = std::env::temp_dir().join(format!("listener-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let _l = bind_owner_only(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!dir.join("api.sock.new").exists(), "renamed into place");
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        // A path too long for the staged name is bound directly.
        let long = dir.join("x".repeat(107 - dir.as_os_str().len() - 1));
        let _l2 = bind_owner_only(&long).unwrap();
        assert!(long.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
