//! GETATTR and SETATTR, and the `fuse_attr` the guest sees (with
//! `FUSE_ATTR_DAX` as the [`super::DaxDecision`] answers).

use std::io;
use std::os::fd::AsRawFd;

use crate::fuse::abi::{setattr, Attr, ATTR_DAX};

use super::{cvt, errno_error, stat_fd, Inode, PassthroughFs};

/// What a SETATTR asks to change.
#[derive(Clone, Copy, Debug, Default)]
pub struct SetattrRequest {
    pub valid: u32,
    pub fh: u64,
    pub size: u64,
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The wire's attributes from a host `stat`. The times' seconds go as the
/// bits of the signed value (the guest reads them back as signed); the rest
/// fit the wire's fields on Linux.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "sizes and block counts are never negative; nanoseconds are below 10^9; \
              the low 32 bits of st_rdev are the kernel's 32-bit device encoding, the \
              wire's; link counts and block sizes fit 32 bits on every Linux file system"
)]
pub fn to_attr(st: &libc::stat64, flags: u32) -> Attr {
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime.cast_unsigned(),
        mtime: st.st_mtime.cast_unsigned(),
        ctime: st.st_ctime.cast_unsigned(),
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: st.st_nlink as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags,
    }
}

impl PassthroughFs {
    /// The attributes the guest sees for `nodeid` whose stat is `st`.
    pub fn attr_of(&self, nodeid: u64, st: &libc::stat64) -> Attr {
        let is_reg = st.st_mode & libc::S_IFMT == libc::S_IFREG;
        let dax = is_reg
            && self.dax.dax(
                nodeid,
                &|| self.path_of(nodeid),
                u64::try_from(st.st_size).unwrap_or(0),
            );
        if is_reg {
            let counter = if dax {
                &self.attrs_dax
            } else {
                &self.attrs_nodax
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        to_attr(st, if dax { ATTR_DAX } else { 0 })
    }

    pub fn getattr(&self, nodeid: u64) -> io::Result<Attr> {
        let inode = self.inode(nodeid)?;
        Ok(self.attr_of(nodeid, &stat_fd(inode.fd.as_raw_fd())?))
    }

    pub fn setattr(&self, nodeid: u64, req: &SetattrRequest) -> io::Result<Attr> {
        let inode = self.inode(nodeid)?;
        let handle = if req.valid & setattr::FH != 0 {
            Some(self.handle(req.fh, nodeid)?)
        } else {
            None
        };
        let proc_name = Self::proc_name(&inode);
        if req.valid & setattr::MODE != 0 {
            // Linux has no mode for a symlink (fchmodat's AT_SYMLINK_NOFOLLOW
            // answers the same).
            if inode.is_symlink() {
                return Err(errno_error(libc::EOPNOTSUPP));
            }
            // Through the O_PATH fd's proc link: resolving it yields the inode
            // itself, so a FIFO, socket or device node gets its mode changed
            // without ever being opened, and no path in the share is resolved.
            // SAFETY: the name is NUL-terminated and relative to /proc/self/fd;
            // the inode is not a symlink, so following the link changes it.
            cvt(unsafe {
                libc::fchmodat(
                    self.proc_self_fd(),
                    proc_name.as_ptr(),
                    req.mode & 0o7777,
                    0,
                )
            })?;
        }
        if req.valid & (setattr::UID | setattr::GID) != 0 {
            let uid = if req.valid & setattr::UID != 0 {
                req.uid
            } else {
                u32::MAX
            };
            let gid = if req.valid & setattr::GID != 0 {
                req.gid
            } else {
                u32::MAX
            };
            // SAFETY: empty path with AT_EMPTY_PATH acts on the O_PATH fd itself.
            cvt(unsafe {
                libc::fchownat(
                    inode.fd.as_raw_fd(),
                    c"".as_ptr(),
                    uid,
                    gid,
                    libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                )
            })?;
        }
        if req.valid & setattr::SIZE != 0 {
            let size = i64::try_from(req.size).map_err(|_| errno_error(libc::EFBIG))?;
            let file = match &handle {
                Some(h) => h.file.try_clone()?,
                None => {
                    if !inode.is_reg() {
                        return Err(errno_error(libc::EINVAL));
                    }
                    self.reopen(&inode, libc::O_WRONLY)?
                }
            };
            // SAFETY: plain syscall on an fd we own.
            let truncate = || cvt(unsafe { libc::ftruncate64(file.as_raw_fd(), size) });
            // FATTR_KILL_SUIDGID: truncate as an unprivileged caller would, so
            // the host clears setuid/setgid (FUSE_HANDLE_KILLPRIV_V2).
            if req.valid & setattr::KILL_SUIDGID != 0 && self.killpriv_v2() {
                crate::caps::without_fsetid(truncate)?;
            } else {
                truncate()?;
            }
        }
        if req.valid & (setattr::ATIME | setattr::MTIME) != 0 {
            self.set_times(&inode, req)?;
        }
        self.getattr(nodeid)
    }

    fn set_times(&self, inode: &Inode, req: &SetattrRequest) -> io::Result<()> {
        let ts = |set: u32, now: u32, (sec, nsec): (u64, u32)| {
            if req.valid & now != 0 {
                libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_NOW,
                }
            } else if req.valid & set != 0 {
                libc::timespec {
                    // The wire carries the signed seconds as unsigned bits.
                    tv_sec: sec.cast_signed(),
                    tv_nsec: libc::c_long::from(nsec),
                }
            } else {
                libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_OMIT,
                }
            }
        };
        let times = [
            ts(setattr::ATIME, setattr::ATIME_NOW, req.atime),
            ts(setattr::MTIME, setattr::MTIME_NOW, req.mtime),
        ];
        if inode.is_reg() || inode.is_dir() {
            let name = Self::proc_name(inode);
            // SAFETY: `times` holds two timespecs; the name is relative to
            // /proc/self/fd and names a file or directory (no symlink to follow).
            cvt(unsafe { libc::utimensat(self.proc_self_fd(), name.as_ptr(), times.as_ptr(), 0) })?;
            return Ok(());
        }
        // A symlink or special file: by name in its parent, not following it.
        let link = inode.link.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (parent, name) = link.ok_or_else(|| errno_error(libc::EOPNOTSUPP))?;
        let dir = self.inode(parent)?;
        // SAFETY: as above; AT_SYMLINK_NOFOLLOW changes the entry itself.
        cvt(unsafe {
            libc::utimensat(
                dir.fd.as_raw_fd(),
                name.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        Ok(())
    }
}
