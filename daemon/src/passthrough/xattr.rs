//! Extended attributes: off unless `--xattr` asks for them (as virtiofsd),
//! and then with the guest's names mapped so none can grant a host privilege.
//!
//! Mapping (`--xattr`): the guest's `user.*` names are the host's `user.*`;
//! every other guest name — `security.capability`, `security.selinux`,
//! `trusted.*`, `system.*`, and `user.virtiofs.*` itself — is stored on the
//! host as `user.virtiofs.<name>`, which the host kernel gives no meaning.
//! Listing maps back and hides the host's own `security.*`/`trusted.*`
//! attributes. So a guest sees its file capabilities and labels round-trip,
//! and the host never executes a file with capabilities a guest set. This is
//! the rule virtiofsd's documentation recommends (`--xattrmap`
//! `:prefix:all::user.virtiofs.:` with `user.` passed through).
//!
//! Every call works on an fd the daemon opened for it (regular files and
//! directories only, through `/proc/self/fd`), held, with the inode, until
//! the call returns: no path is resolved, so a concurrent FORGET and LOOKUP
//! cannot redirect the call to another file.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::AsRawFd;

use super::{cvt, cvt_count, errno_error, PassthroughFs};
use crate::limits::{Cap, XATTR_LIST_MAX};

/// `--xattr`: whether extended attributes are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrMode {
    /// Every xattr request answers ENOSYS; the guest's kernel then stops
    /// asking and applications get EOPNOTSUPP.
    Off,
    /// Served, with the mapping above.
    Mapped,
}

/// Host prefix for guest names that are not plain `user.*`.
const MAPPED_PREFIX: &[u8] = b"user.virtiofs.";

/// The host name for the guest's `name`.
pub fn to_host(name: &[u8]) -> Vec<u8> {
    if name.starts_with(b"user.") && !name.starts_with(MAPPED_PREFIX) {
        return name.to_vec();
    }
    [MAPPED_PREFIX, name].concat()
}

/// The guest name for the host's `name`, or None when it is hidden.
pub fn to_guest(name: &[u8]) -> Option<&[u8]> {
    if let Some(rest) = name.strip_prefix(MAPPED_PREFIX) {
        return (!rest.is_empty()).then_some(rest);
    }
    name.starts_with(b"user.").then_some(name)
}

impl PassthroughFs {
    /// An fd for an xattr call on `nodeid`; the caller keeps it (and so the
    /// inode) for the whole call.
    fn xattr_fd(&self, nodeid: u64) -> io::Result<std::fs::File> {
        if self.xattr == XattrMode::Off {
            return Err(errno_error(libc::ENOSYS));
        }
        let inode = self.inode(nodeid)?;
        if !inode.is_reg() && !inode.is_dir() {
            // Symlinks and special files: user.* is not allowed on them by
            // Linux either, and opening them is never done.
            return Err(errno_error(libc::EPERM));
        }
        self.reopen(&inode, libc::O_RDONLY | libc::O_NONBLOCK)
    }

    fn host_name(name: &CStr) -> io::Result<CString> {
        CString::new(to_host(name.to_bytes())).map_err(|_| errno_error(libc::EINVAL))
    }

    pub fn setxattr(&self, nodeid: u64, name: &CStr, value: &[u8], flags: u32) -> io::Result<()> {
        let file = self.xattr_fd(nodeid)?;
        if value.len() > self.limits.max_xattr_size as usize {
            self.caps
                .hit(Cap::XattrSize, u64::from(self.limits.max_xattr_size));
            return Err(errno_error(libc::E2BIG));
        }
        let host = Self::host_name(name)?;
        // setxattr(2)'s int flags, unsigned on the wire.
        let flags = flags.cast_signed();
        // SAFETY: `host` is NUL-terminated and `value` readable for its length.
        cvt(unsafe {
            libc::fsetxattr(
                file.as_raw_fd(),
                host.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                flags,
            )
        })?;
        Ok(())
    }

    /// GETXATTR; with `size` 0 the guest asks only for the length. Returns
    /// the value's length and (when `size` > 0) the value. The buffer is
    /// never larger than `--max-xattr-size`, whatever the guest asks.
    pub fn getxattr(&self, nodeid: u64, name: &CStr, size: u32) -> io::Result<(u32, Vec<u8>)> {
        let file = self.xattr_fd(nodeid)?;
        let host = Self::host_name(name)?;
        let mut buf = vec![0u8; size.min(self.limits.max_xattr_size) as usize];
        // SAFETY: `buf` is writable for its length (a null pointer is fine with length 0).
        let n: usize = cvt_count(unsafe {
            libc::fgetxattr(
                file.as_raw_fd(),
                host.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        })?;
        if size == 0 && n > self.limits.max_xattr_size as usize {
            self.caps
                .hit(Cap::XattrSize, u64::from(self.limits.max_xattr_size));
            return Err(errno_error(libc::E2BIG));
        }
        buf.truncate(n);
        // Linux caps a value at XATTR_SIZE_MAX (64 KiB).
        let len = u32::try_from(n).map_err(|_| errno_error(libc::E2BIG))?;
        Ok((len, buf))
    }

    /// LISTXATTR: the host's names, mapped and filtered; answered like
    /// GETXATTR (ERANGE when the guest's buffer is too small).
    pub fn listxattr(&self, nodeid: u64, size: u32) -> io::Result<(u32, Vec<u8>)> {
        let file = match self.xattr_fd(nodeid) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return Ok((0, Vec::new())),
            Err(e) => return Err(e),
        };
        let mut buf = vec![0u8; XATTR_LIST_MAX as usize];
        // SAFETY: `buf` is writable for its length.
        let n: usize = cvt_count(unsafe {
            libc::flistxattr(file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
        })?;
        let mut out = Vec::new();
        for host in buf[..n].split(|&b| b == 0).filter(|s| !s.is_empty()) {
            if let Some(guest) = to_guest(host) {
                out.extend_from_slice(guest);
                out.push(0);
            }
        }
        if size != 0 && out.len() > size as usize {
            return Err(errno_error(libc::ERANGE));
        }
        // At most the XATTR_LIST_MAX bytes the host listed.
        let len = u32::try_from(out.len()).map_err(|_| errno_error(libc::E2BIG))?;
        Ok((len, out))
    }

    pub fn removexattr(&self, nodeid: u64, name: &CStr) -> io::Result<()> {
        let file = self.xattr_fd(nodeid)?;
        let host = Self::host_name(name)?;
        // SAFETY: `host` is NUL-terminated.
        cvt(unsafe { libc::fremovexattr(file.as_raw_fd(), host.as_ptr()) })?;
        Ok(())
    }
}
