//! The checks every SHMEM_MAP passes before anything is mapped: the
//! request's region, length, bounds, alignment and flags, and the passed
//! fd's type. The daemon is not trusted; a refused request changes nothing.

use std::os::fd::RawFd;

use dax_abi::DAX_SHM_REGION_ID;
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};

use super::{DaxWindow, FailureReason, FileKey, RequestError};

/// What SHMEM_MAP learns of the passed fd.
pub(super) struct FdInfo {
    pub size: u64,
    /// (st_dev, st_ino).
    pub file: FileKey,
    /// Its host page size where `st_blksize` names a huge page (a
    /// huge-page tmpfs, hugetlbfs), else 0 ([`super::prefault::host_page`]).
    pub host_page: u64,
}

impl DaxWindow {
    /// Checks a request's region, length, bounds, alignment and flags;
    /// returns the end offset in the window.
    pub(super) fn check(&self, req: &VhostUserMMap) -> Result<u64, RequestError> {
        let (shmid, fd_offset, shm_offset, len, flags) =
            (req.shmid, req.fd_offset, req.shm_offset, req.len, req.flags);
        let einval = |reason, msg: String| RequestError::new(reason, libc::EINVAL, msg);
        if shmid != DAX_SHM_REGION_ID {
            return Err(einval(
                FailureReason::UnknownRegion,
                format!("shmid {shmid}: this device has only region {DAX_SHM_REGION_ID}"),
            ));
        }
        if len == 0 {
            return Err(einval(FailureReason::ZeroLength, "len is 0".into()));
        }
        let end = shm_offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or_else(|| {
                einval(
                    FailureReason::OutOfBounds,
                    format!(
                        "shm_offset {shm_offset:#x} + len {len:#x} exceeds the {:#x}-byte window",
                        self.size
                    ),
                )
            })?;
        if fd_offset
            .checked_add(len)
            .is_none_or(|e| i64::try_from(e).is_err())
        {
            return Err(einval(
                FailureReason::OutOfBounds,
                format!("fd_offset {fd_offset:#x} + len {len:#x} overflows off_t"),
            ));
        }
        for (name, v) in [
            ("fd_offset", fd_offset),
            ("shm_offset", shm_offset),
            ("len", len),
        ] {
            if v % self.page_size != 0 {
                return Err(einval(
                    FailureReason::Misaligned,
                    format!(
                        "{name} {v:#x} is not a multiple of the host page size {:#x}",
                        self.page_size
                    ),
                ));
            }
        }
        if VhostUserMMapFlags::from_bits(flags).is_none() {
            return Err(einval(
                FailureReason::BadFlags,
                format!("flags {flags:#x}: only WRITABLE (1) is defined"),
            ));
        }
        Ok(end)
    }

    /// Checks the fd's type: the daemon maps only regular files of its
    /// share, so anything else (a block device, a memfd is fine: it is a
    /// regular file) is refused. Returns the file's identity and size.
    pub(super) fn check_fd(fd: RawFd) -> Result<FdInfo, RequestError> {
        // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid, writable stat; an invalid fd just fails.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(RequestError::new(
                FailureReason::BadFd,
                libc::EBADF,
                format!("fstat on the passed fd: {e}"),
            ));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(RequestError::new(
                FailureReason::BadFd,
                libc::EBADF,
                format!(
                    "the passed fd is not a regular file (mode {:#o})",
                    st.st_mode
                ),
            ));
        }
        Ok(FdInfo {
            size: u64::try_from(st.st_size).unwrap_or(0),
            file: (st.st_dev, st.st_ino),
            host_page: super::prefault::host_page(u64::try_from(st.st_blksize).unwrap_or(0)),
        })
    }
}
