//! What the daemon does to itself before it serves a guest: open the shared
//! directory and `/proc/self/fd`, optionally `chroot` into the share, and
//! make `/proc/self/fd` the working directory (the xattr calls name inodes
//! by their fd number relative to it).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::passthrough::{cvt, openat};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sandbox {
    /// chroot into the shared directory (needs CAP_SYS_CHROOT).
    Chroot,
    /// No confinement beyond the daemon's own path handling.
    None,
}

pub struct Opened {
    pub root: OwnedFd,
    pub proc_self_fd: OwnedFd,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("--shared-dir {path}: {source}")]
    SharedDir { path: String, source: io::Error },
    #[error("opening /proc/self/fd: {0} (is /proc mounted?)")]
    Proc(io::Error),
    #[error("--sandbox chroot: {0} (run as root, or use --sandbox none)")]
    Chroot(io::Error),
}

pub fn enter(shared_dir: &Path, mode: Sandbox) -> Result<Opened, SandboxError> {
    let shown = shared_dir.display().to_string();
    let c = CString::new(shared_dir.as_os_str().as_bytes())
        .map_err(|_| SandboxError::SharedDir { path: shown.clone(), source: io::Error::from_raw_os_error(libc::EINVAL) })?;
    let root = openat(libc::AT_FDCWD, &c, libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|source| SandboxError::SharedDir { path: shown, source })?;
    let proc_self_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH | libc::O_DIRECTORY, 0).map_err(SandboxError::Proc)?;
    if mode == Sandbox::Chroot {
        // SAFETY: plain syscalls with NUL-terminated paths / owned fds.
        cvt(unsafe { libc::fchdir(root.as_raw_fd()) }).map_err(SandboxError::Chroot)?;
        // SAFETY: as above.
        cvt(unsafe { libc::chroot(c".".as_ptr()) }).map_err(SandboxError::Chroot)?;
    }
    // SAFETY: as above.
    cvt(unsafe { libc::fchdir(proc_self_fd.as_raw_fd()) }).map_err(SandboxError::Proc)?;
    // New files get exactly the mode the guest asked for (it applied its umask).
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0) };
    Ok(Opened { root, proc_self_fd })
}
