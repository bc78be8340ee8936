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

/// Raises the open-file limit: every inode the guest holds is an open fd.
/// `wanted` None means as high as the system allows (`fs.nr_open`).
/// Returns the soft limit now in force.
pub fn raise_nofile_limit(wanted: Option<u64>) -> io::Result<u64> {
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(1 << 20);
    let target = wanted.unwrap_or(nr_open).min(nr_open);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    let raised = libc::rlimit { rlim_cur: target, rlim_max: lim.rlim_max.max(target) };
    // SAFETY: as above; raising the hard limit needs CAP_SYS_RESOURCE, so
    // fall back to the current hard limit without it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let capped = libc::rlimit { rlim_cur: target.min(lim.rlim_max), rlim_max: lim.rlim_max };
        // SAFETY: as above.
        cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &capped) })?;
        return Ok(capped.rlim_cur);
    }
    Ok(raised.rlim_cur)
}
