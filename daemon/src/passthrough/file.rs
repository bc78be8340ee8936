//! Open files: OPEN/CREATE, READ/WRITE straight between the host file and
//! guest memory (`preadv`/`pwritev` on iovecs that point into the guest's
//! buffers, or a copy to or from a file mapped where a buffer lies in the
//! DAX window), FLUSH, FSYNC, FALLOCATE, LSEEK, and the filesystem-wide STATFS
//! and SYNCFS.

use std::ffi::CStr;
use std::io;
use std::os::fd::AsRawFd;

use super::{copy, cvt, cvt_count, errno_error, Caller, PassthroughFs};

/// The open flags of a guest's OPEN or CREATE that reach `openat`: the
/// access mode, and what only changes how the file is written or waited on.
/// `O_CREAT`/`O_EXCL` are the daemon's own to set (CREATE) or drop (OPEN);
/// `O_TRUNC` is acted on by CREATE only (see the OPEN handler).
pub(super) const GUEST_OPEN_FLAGS: i32 = libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_EXCL
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_NONBLOCK
    | libc::O_DSYNC
    | libc::O_SYNC
    | libc::O_NOATIME
    | libc::O_CLOEXEC;

/// Flags that change *what* is opened: `O_PATH` (the kernel then ignores
/// `O_CREAT|O_EXCL`, so CREATE would "open" an existing FIFO, device,
/// directory or symlink and chown it), `O_DIRECTORY`, `O_TMPFILE`. A guest
/// kernel never sends them (an `O_PATH` open does not reach the file
/// system; `O_TMPFILE` is FUSE_TMPFILE), so they are refused, not dropped.
const REFUSED_OPEN_FLAGS: i32 = libc::O_PATH | libc::O_DIRECTORY | libc::O_TMPFILE;

/// The guest's open flags as the daemon passes them on: EINVAL for a
/// refused flag; anything else outside [`GUEST_OPEN_FLAGS`] is dropped, as
/// open(2) ignores unknown bits (Linux sends `O_LARGEFILE`, `__FMODE_EXEC`,
/// `O_NOCTTY`, `FASYNC`; the daemon adds `O_NOFOLLOW` itself and never
/// opens with `O_DIRECT`).
fn guest_open_flags(flags: u32) -> io::Result<i32> {
    // The wire carries open(2)'s int flags as unsigned bits.
    let flags = flags.cast_signed();
    if flags & REFUSED_OPEN_FLAGS != 0 {
        return Err(errno_error(libc::EINVAL));
    }
    Ok(flags & GUEST_OPEN_FLAGS)
}

impl PassthroughFs {
    /// OPEN: only regular files are ever opened (directories go through
    /// OPENDIR); a device node, FIFO or socket is refused without being
    /// opened, so the guest cannot reach a host device or block a thread.
    /// `kill_priv`: the guest asked (FUSE_OPEN_KILL_SUIDGID) that an
    /// `O_TRUNC` clear setuid/setgid as an unprivileged open would.
    pub fn open(&self, nodeid: u64, flags: u32, kill_priv: bool) -> io::Result<u64> {
        let flags = guest_open_flags(flags)?;
        let inode = self.inode(nodeid)?;
        if !inode.is_reg() {
            return Err(errno_error(if inode.is_dir() {
                libc::EISDIR
            } else {
                libc::ELOOP
            }));
        }
        let file = if kill_priv && self.killpriv_v2() && flags & libc::O_TRUNC != 0 {
            crate::caps::without_fsetid(|| self.reopen(&inode, flags))?
        } else {
            self.reopen(&inode, flags)?
        };
        self.add_handle(file, nodeid, flags)
    }

    /// CREATE: a new regular file in `parent`, opened; returns its lookup
    /// and handle. The file is created with `O_EXCL`, so nothing that
    /// already exists is opened by this call. When the guest did not ask for
    /// `O_EXCL` and the name exists, the existing entry is opened as OPEN
    /// would (regular files only): `MKNOD` then `CREATE` of a device node
    /// gets an error, never the device (virtiofsd's CVE-2020-35517 class).
    /// The guest's flags pass [`guest_open_flags`] first: with `O_PATH` the
    /// `O_CREAT|O_EXCL` above would mean nothing.
    pub fn create(
        &self,
        parent: u64,
        name: &CStr,
        mode: u32,
        flags: u32,
        kill_priv: bool,
        caller: Caller,
    ) -> io::Result<((u64, libc::stat64), u64)> {
        let flags = guest_open_flags(flags)?;
        let dir = self.inode(parent)?;
        let created = super::openat(
            dir.fd.as_raw_fd(),
            name,
            flags | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            mode & 0o7777,
        );
        match created {
            Ok(fd) => {
                if let Err(e) = self.chown_new_entry(dir.fd.as_raw_fd(), name, caller) {
                    crate::warn_limited!(
                        "giving a new file to uid {} gid {}: {e}",
                        caller.uid,
                        caller.gid
                    );
                }
                let entry = self.lookup(parent, name)?;
                match self.add_handle(fd.into(), entry.0, flags) {
                    Ok(fh) => Ok((entry, fh)),
                    Err(e) => {
                        self.forget(entry.0, 1);
                        Err(e)
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && flags & libc::O_EXCL == 0 => {
                let entry = self.lookup(parent, name)?;
                match self.open(
                    entry.0,
                    (flags & !(libc::O_CREAT | libc::O_EXCL)).cast_unsigned(),
                    kill_priv,
                ) {
                    Ok(fh) => Ok((entry, fh)),
                    Err(e) => {
                        self.forget(entry.0, 1);
                        Err(e)
                    }
                }
            }
            Err(e) => Err(e),
        }
    }

    /// READ: from the handle's file at `offset` into `targets` in order
    /// (guest RAM, or a file the guest mapped in its DAX window); stops at
    /// the end of the file. Returns the bytes read.
    pub fn read_into(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        targets: &[IoTarget],
    ) -> io::Result<usize> {
        let h = self.handle(fh, nodeid)?;
        transfer(targets, offset, |t, at| match t {
            IoTarget::Memory(iovs) => preadv(&h.file, iovs, at),
            IoTarget::File { file, offset, len } => {
                copy::copy_range(&h.file, at, file, *offset, *len)
            }
        })
    }

    /// WRITE: from `targets` in order into the handle's file at `offset`;
    /// returns the bytes written. `kill_priv`: the guest asked
    /// (FUSE_WRITE_KILL_SUIDGID) that the write clear setuid/setgid and file
    /// capabilities as a local unprivileged write does.
    pub fn write_from(
        &self,
        nodeid: u64,
        fh: u64,
        offset: u64,
        targets: &[IoTarget],
        kill_priv: bool,
    ) -> io::Result<usize> {
        let h = self.handle(fh, nodeid)?;
        let write = || {
            transfer(targets, offset, |t, at| match t {
                IoTarget::Memory(iovs) => pwritev(&h.file, iovs, at),
                IoTarget::File { file, offset, len } => {
                    copy::copy_range(file, *offset, &h.file, at, *len)
                }
            })
        };
        if kill_priv && self.killpriv_v2() {
            crate::caps::without_fsetid(write)
        } else {
            write()
        }
    }

    /// FLUSH: what close() would do on the host (e.g. NFS writes back),
    /// without giving up the handle.
    pub fn flush(&self, nodeid: u64, fh: u64) -> io::Result<()> {
        let h = self.handle(fh, nodeid)?;
        // SAFETY: dup of an fd we own; the duplicate is closed at once.
        let dup = cvt(unsafe { libc::dup(h.file.as_raw_fd()) })?;
        // SAFETY: `dup` is ours.
        cvt(unsafe { libc::close(dup) })?;
        Ok(())
    }

    pub fn fsync(&self, nodeid: u64, fh: u64, datasync: bool) -> io::Result<()> {
        let h = self.handle(fh, nodeid)?;
        let fd = h.file.as_raw_fd();
        // SAFETY: plain syscalls on an fd we own.
        cvt(unsafe {
            if datasync {
                libc::fdatasync(fd)
            } else {
                libc::fsync(fd)
            }
        })?;
        Ok(())
    }

    pub fn fallocate(
        &self,
        nodeid: u64,
        fh: u64,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        let h = self.handle(fh, nodeid)?;
        let (offset, len) = (i64::try_from(offset), i64::try_from(len));
        let (Ok(offset), Ok(len)) = (offset, len) else {
            return Err(errno_error(libc::EINVAL));
        };
        // The guest's mode bits are fallocate(2)'s int flags, unsigned on the wire.
        let mode = mode.cast_signed();
        // SAFETY: plain syscall on an fd we own.
        cvt(unsafe { libc::fallocate64(h.file.as_raw_fd(), mode, offset, len) })?;
        Ok(())
    }

    pub fn lseek(&self, nodeid: u64, fh: u64, offset: u64, whence: u32) -> io::Result<u64> {
        let h = self.handle(fh, nodeid)?;
        // The guest keeps the file position itself; only data/hole
        // queries need the host.
        let whence = i32::try_from(whence)
            .ok()
            .filter(|&w| w == libc::SEEK_DATA || w == libc::SEEK_HOLE)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let offset = i64::try_from(offset).map_err(|_| errno_error(libc::EINVAL))?;
        // SAFETY: plain syscall; a shared file position is not relied upon
        // (reads and writes use explicit offsets).
        cvt_count(unsafe { libc::lseek64(h.file.as_raw_fd(), offset, whence) })
    }

    pub fn statfs(&self, nodeid: u64) -> io::Result<libc::statvfs64> {
        let inode = self.inode(nodeid)?;
        // SAFETY: all-zero is a valid statvfs64 for the call to overwrite.
        let mut st: libc::statvfs64 = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is writable; fstatvfs works on O_PATH fds.
        cvt(unsafe { libc::fstatvfs64(inode.fd.as_raw_fd(), &mut st) })?;
        Ok(st)
    }

    pub fn syncfs(&self) -> io::Result<()> {
        let root = self.inode(crate::fuse::abi::ROOT_ID)?;
        let dir = self.reopen(&root, libc::O_RDONLY | libc::O_DIRECTORY)?;
        // SAFETY: plain syscall on an fd we own.
        cvt(unsafe { libc::syncfs(dir.as_raw_fd()) })?;
        Ok(())
    }

    /// Opens the file behind `nodeid` for a DAX mapping.
    /// The file to map for a SETUPMAPPING, and its host identity.
    /// The host identity (st_dev, st_ino) of node `nodeid`, a regular
    /// file, as a SETUPMAPPING of it needs; EINVAL for anything else.
    pub fn mapping_key(&self, nodeid: u64) -> io::Result<(u64, u64)> {
        let inode = self.inode(nodeid)?;
        if !inode.is_reg() {
            return Err(errno_error(libc::EINVAL));
        }
        Ok(inode.key())
    }

    pub fn open_for_mapping(
        &self,
        nodeid: u64,
        writable: bool,
    ) -> io::Result<(std::fs::File, (u64, u64))> {
        let inode = self.inode(nodeid)?;
        if !inode.is_reg() {
            return Err(errno_error(libc::EINVAL));
        }
        let file = self.reopen(
            &inode,
            if writable {
                libc::O_RDWR
            } else {
                libc::O_RDONLY
            },
        )?;
        Ok((file, inode.key()))
    }

    /// A file mapped in the DAX window, opened to be copied to (`write`)
    /// or from by one request's window-buffer I/O; takes one of
    /// `--max-handles`' slots while open (ENFILE past it). EFAULT where the
    /// node is no longer that file.
    pub fn open_mapped(&self, nodeid: u64, key: (u64, u64), write: bool) -> io::Result<MappedFd> {
        let efault = || errno_error(libc::EFAULT);
        let inode = self.inode(nodeid).map_err(|_| efault())?;
        if inode.key() != key || !inode.is_reg() {
            return Err(efault());
        }
        let slot = self.charge_window_fd()?;
        let file = self.reopen(
            &inode,
            if write {
                libc::O_WRONLY
            } else {
                libc::O_RDONLY
            },
        )?;
        let size = u64::try_from(super::stat_fd(file.as_raw_fd())?.st_size).unwrap_or(0);
        Ok(MappedFd {
            file,
            size,
            _slot: slot,
        })
    }
}

/// A file mapped in the DAX window, open for one request's window-buffer
/// I/O: every stretch of the request in that file shares it.
pub struct MappedFd {
    file: std::fs::File,
    /// Its size when opened.
    size: u64,
    _slot: super::WindowFdSlot,
}

impl MappedFd {
    /// `len` bytes at `offset` of this file as a target; EFAULT unless
    /// they all lie inside it: a window page past a file's end is not file
    /// data (the guest sees zeros or a fault there), and copying into it
    /// would grow the file.
    pub fn target(self: &std::sync::Arc<Self>, offset: u64, len: u64) -> io::Result<IoTarget> {
        let efault = || errno_error(libc::EFAULT);
        let len_usize = usize::try_from(len).map_err(|_| efault())?;
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(efault());
        }
        Ok(IoTarget::File {
            file: self.clone(),
            offset,
            len: len_usize,
        })
    }
}

impl std::ops::Deref for MappedFd {
    type Target = std::fs::File;

    fn deref(&self) -> &std::fs::File {
        &self.file
    }
}

/// Where a READ's data goes or a WRITE's comes from, in order.
pub enum IoTarget {
    /// Guest RAM: iovecs into the daemon's mapping of guest memory.
    Memory(Vec<libc::iovec>),
    /// A stretch of a file the guest mapped in its DAX window: the window's
    /// pages are that file's page cache, so copying to or from the file is
    /// reading or writing the guest's buffer.
    File {
        /// Shared by every stretch of the request in that file.
        file: std::sync::Arc<MappedFd>,
        offset: u64,
        len: usize,
    },
}

/// Moves a request's bytes target by target, the file offset advancing
/// from `offset` by what each `step` moved; stops at a short step (the end
/// of the file). An error after some bytes moved answers those bytes, as a
/// short read or write, instead of hiding them behind the error.
fn transfer(
    targets: &[IoTarget],
    offset: u64,
    mut step: impl FnMut(&IoTarget, u64) -> io::Result<usize>,
) -> io::Result<usize> {
    let mut done = 0usize;
    for t in targets {
        let at = offset
            .checked_add(done as u64)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let n = match step(t, at) {
            Ok(n) => n,
            Err(_) if done > 0 => break,
            Err(e) => return Err(e),
        };
        done += n;
        if n < t.len() {
            break;
        }
    }
    Ok(done)
}

fn iov_total(iovs: &[libc::iovec]) -> usize {
    iovs.iter().map(|v| v.iov_len).sum()
}

impl IoTarget {
    /// Bytes this target holds or wants.
    fn len(&self) -> usize {
        match self {
            IoTarget::Memory(iovs) => iov_total(iovs),
            IoTarget::File { len, .. } => *len,
        }
    }
}

fn iov_count(iovs: &[libc::iovec]) -> io::Result<i32> {
    i32::try_from(iovs.len()).map_err(|_| errno_error(libc::EINVAL))
}

fn file_offset(offset: u64) -> io::Result<i64> {
    i64::try_from(offset).map_err(|_| errno_error(libc::EINVAL))
}

fn preadv(file: &std::fs::File, iovs: &[libc::iovec], offset: u64) -> io::Result<usize> {
    let (count, offset) = (iov_count(iovs)?, file_offset(offset)?);
    // SAFETY: each iovec points into the guest memory mapping, which stays
    // mapped for this request; the kernel writes at most iov_len bytes to
    // each. No Rust reference aliases guest memory.
    cvt_count(unsafe { libc::preadv64(file.as_raw_fd(), iovs.as_ptr(), count, offset) })
}

fn pwritev(file: &std::fs::File, iovs: &[libc::iovec], offset: u64) -> io::Result<usize> {
    let (count, offset) = (iov_count(iovs)?, file_offset(offset)?);
    // SAFETY: as in preadv; the kernel only reads the buffers.
    cvt_count(unsafe { libc::pwritev64(file.as_raw_fd(), iovs.as_ptr(), count, offset) })
}
