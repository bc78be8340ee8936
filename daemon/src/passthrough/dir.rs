//! Directory operations: creating, removing, renaming and linking entries,
//! and listing a directory (READDIR / READDIRPLUS).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::AsRawFd;

use super::{cvt, cvt_count, errno_error, Caller, PassthroughFs};

/// One directory entry as getdents64 returned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    /// Offset of the entry after this one (what the guest sends back to continue).
    pub next_offset: u64,
    pub kind: u8,
    pub name: Vec<u8>,
}

/// An entry for READDIRPLUS: the entry and, unless it is `.` or `..`, its
/// lookup (nodeid and stat), which counts as a reference the guest holds.
pub struct DirEntryPlus {
    pub entry: DirEntry,
    pub lookup: Option<(u64, libc::stat64)>,
}

impl PassthroughFs {
    fn new_entry(
        &self,
        parent: u64,
        name: &CStr,
        caller: Caller,
        make: impl FnOnce(i32) -> i32,
    ) -> io::Result<(u64, libc::stat64)> {
        let dir = self.inode(parent)?;
        cvt(make(dir.fd.as_raw_fd()))?;
        if let Err(e) = self.chown_new_entry(dir.fd.as_raw_fd(), name, caller) {
            crate::warn_limited!(
                "giving a new entry to uid {} gid {}: {e}",
                caller.uid,
                caller.gid
            );
        }
        self.lookup(parent, name)
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &CStr,
        mode: u32,
        caller: Caller,
    ) -> io::Result<(u64, libc::stat64)> {
        // SAFETY: `name` is a NUL-terminated single component.
        self.new_entry(parent, name, caller, |dfd| unsafe {
            libc::mkdirat(dfd, name.as_ptr(), mode)
        })
    }

    pub fn mknod(
        &self,
        parent: u64,
        name: &CStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> io::Result<(u64, libc::stat64)> {
        // SAFETY: as for mkdir.
        self.new_entry(parent, name, caller, |dfd| unsafe {
            libc::mknodat(dfd, name.as_ptr(), mode, u64::from(rdev))
        })
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &CStr,
        target: &CStr,
        caller: Caller,
    ) -> io::Result<(u64, libc::stat64)> {
        // SAFETY: both strings are NUL-terminated. The target is stored, not
        // resolved: the daemon never follows symlinks.
        self.new_entry(parent, name, caller, |dfd| unsafe {
            libc::symlinkat(target.as_ptr(), dfd, name.as_ptr())
        })
    }

    pub fn unlink(&self, parent: u64, name: &CStr, flags: i32) -> io::Result<()> {
        let dir = self.inode(parent)?;
        // SAFETY: `name` is a NUL-terminated single component.
        cvt(unsafe { libc::unlinkat(dir.fd.as_raw_fd(), name.as_ptr(), flags) })?;
        Ok(())
    }

    pub fn rename(
        &self,
        olddir: u64,
        oldname: &CStr,
        newdir: u64,
        newname: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        let (od, nd) = (self.inode(olddir)?, self.inode(newdir)?);
        // SAFETY: names are NUL-terminated components relative to directory fds.
        cvt(unsafe {
            libc::renameat2(
                od.fd.as_raw_fd(),
                oldname.as_ptr(),
                nd.fd.as_raw_fd(),
                newname.as_ptr(),
                flags,
            )
        })?;
        // Keep the moved inode's name current for policy paths.
        if let Ok(fd) = super::openat(
            nd.fd.as_raw_fd(),
            newname,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        ) {
            if let Ok(st) = super::stat_fd(fd.as_raw_fd()) {
                self.relink((st.st_dev, st.st_ino), newdir, newname);
            }
        }
        Ok(())
    }

    fn relink(&self, key: (u64, u64), parent: u64, name: &CStr) {
        let map = self.inodes.read().unwrap_or_else(|p| p.into_inner());
        if let Some(inode) = map.by_key.get(&key).and_then(|id| map.by_id.get(id)) {
            *inode.link.lock().unwrap_or_else(|p| p.into_inner()) = Some((parent, name.to_owned()));
        }
    }

    pub fn link(
        &self,
        nodeid: u64,
        newparent: u64,
        newname: &CStr,
    ) -> io::Result<(u64, libc::stat64)> {
        let (inode, dir) = (self.inode(nodeid)?, self.inode(newparent)?);
        // Through the fd's proc link, not AT_EMPTY_PATH: that would need
        // CAP_DAC_READ_SEARCH, which the sandbox drops. Following a proc fd
        // link yields the inode the fd holds (a symlink itself, not its
        // target), so no path inside the share is resolved.
        let proc_name = Self::proc_name(&inode);
        // SAFETY: both names are NUL-terminated and relative to directory fds.
        cvt(unsafe {
            libc::linkat(
                self.proc_self_fd(),
                proc_name.as_ptr(),
                dir.fd.as_raw_fd(),
                newname.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        })?;
        self.lookup(newparent, newname)
    }

    pub fn readlink(&self, nodeid: u64) -> io::Result<Vec<u8>> {
        let inode = self.inode(nodeid)?;
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: `buf` is writable for its length; an empty path reads the
        // link the O_PATH fd refers to.
        let n: usize = cvt_count(unsafe {
            libc::readlinkat(
                inode.fd.as_raw_fd(),
                c"".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        })?;
        buf.truncate(n);
        Ok(buf)
    }

    pub fn opendir(&self, nodeid: u64) -> io::Result<u64> {
        let inode = self.inode(nodeid)?;
        if !inode.is_dir() {
            return Err(errno_error(libc::ENOTDIR));
        }
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let file = self.reopen(&inode, flags)?;
        self.add_handle(file, nodeid, flags)
    }

    /// Entries from `offset` on, as many as `fits` accepts (it sees each
    /// entry and answers whether it still fits in the reply).
    pub fn readdir(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        mut fits: impl FnMut(&DirEntry) -> bool,
    ) -> io::Result<Vec<DirEntry>> {
        let h = self.handle(fh, nodeid)?;
        let _guard = h.dir_lock.lock().unwrap_or_else(|p| p.into_inner());
        let fd = h.file.as_raw_fd();
        // The guest hands back d_off as it got it: an opaque cookie whose
        // bits are the kernel's signed offset.
        let offset = offset.cast_signed();
        // SAFETY: plain lseek on a directory fd we own; offsets are the
        // opaque d_off values getdents returned.
        cvt(unsafe { libc::lseek64(fd, offset, libc::SEEK_SET) })?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n: usize = cvt_count(unsafe {
                libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len())
            })?;
            if n == 0 {
                return Ok(out);
            }
            let mut pos = 0;
            while pos + 19 <= n {
                let ino = u64::from_ne_bytes(buf[pos..pos + 8].try_into().expect("8 bytes"));
                let off = u64::from_ne_bytes(buf[pos + 8..pos + 16].try_into().expect("8 bytes"));
                let reclen = usize::from(u16::from_ne_bytes([buf[pos + 16], buf[pos + 17]]));
                let kind = buf[pos + 18];
                if reclen == 0 || pos + reclen > n {
                    return Err(errno_error(libc::EIO));
                }
                let name_bytes = &buf[pos + 19..pos + reclen];
                let name = name_bytes[..name_bytes
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(name_bytes.len())]
                    .to_vec();
                let entry = DirEntry {
                    ino,
                    next_offset: off,
                    kind,
                    name,
                };
                if !fits(&entry) {
                    return Ok(out);
                }
                out.push(entry);
                pos += reclen;
            }
        }
    }

    /// READDIRPLUS: entries with lookups. An entry is looked up only once it
    /// is known to fit, so no reference is taken for an entry not sent.
    pub fn readdirplus(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        fits: impl FnMut(&DirEntry) -> bool,
    ) -> io::Result<Vec<DirEntryPlus>> {
        let entries = self.readdir(nodeid, fh, offset, fits)?;
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries {
            let lookup = if entry.name == b"." || entry.name == b".." {
                None
            } else {
                let name = CString::new(entry.name.clone()).map_err(|_| errno_error(libc::EIO))?;
                // An entry removed since getdents is simply sent without attributes.
                self.lookup(nodeid, &name).ok()
            };
            out.push(DirEntryPlus { entry, lookup });
        }
        Ok(out)
    }
}
