//! Extended attributes, through `/proc/self/fd/<n>` (the working
//! directory) because the `f*xattr` calls do not take `O_PATH` fds. Only on
//! regular files and directories: following the proc link of a symlink
//! would act on its target.

use std::ffi::CStr;
use std::io;

use super::{cvt, errno_error, PassthroughFs};

impl PassthroughFs {
    fn xattr_name(&self, nodeid: u64) -> io::Result<std::ffi::CString> {
        let inode = self.inode(nodeid)?;
        if !inode.is_reg() && !inode.is_dir() {
            return Err(errno_error(libc::ENOTSUP));
        }
        Ok(Self::proc_name(&inode))
    }

    pub fn setxattr(&self, nodeid: u64, name: &CStr, value: &[u8], flags: u32) -> io::Result<()> {
        let path = self.xattr_name(nodeid)?;
        // SAFETY: both strings are NUL-terminated, `value` is readable for
        // its length; the path is relative to /proc/self/fd.
        cvt(unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags as i32) })?;
        Ok(())
    }

    /// GETXATTR; with `size` 0 the guest asks only for the length. Returns
    /// the value's length and (when `size` > 0) the value.
    pub fn getxattr(&self, nodeid: u64, name: &CStr, size: u32) -> io::Result<(u32, Vec<u8>)> {
        let path = self.xattr_name(nodeid)?;
        let mut buf = vec![0u8; size as usize];
        // SAFETY: `buf` is writable for its length (a null pointer is fine with length 0).
        let n = cvt(unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
        buf.truncate(n as usize);
        Ok((n as u32, buf))
    }

    /// LISTXATTR, answered like GETXATTR.
    pub fn listxattr(&self, nodeid: u64, size: u32) -> io::Result<(u32, Vec<u8>)> {
        let Ok(path) = self.xattr_name(nodeid) else { return Ok((0, Vec::new())) };
        let mut buf = vec![0u8; size as usize];
        // SAFETY: as in getxattr.
        let n = cvt(unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
        buf.truncate(n as usize);
        Ok((n as u32, buf))
    }

    pub fn removexattr(&self, nodeid: u64, name: &CStr) -> io::Result<()> {
        let path = self.xattr_name(nodeid)?;
        // SAFETY: NUL-terminated strings.
        cvt(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) })?;
        Ok(())
    }
}
