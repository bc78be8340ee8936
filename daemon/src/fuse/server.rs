//! One FUSE request in, one reply out: parses the request from its
//! descriptor chain, calls the filesystem, and writes the reply. A request
//! that cannot be parsed or served gets an errno; nothing here panics on
//! guest input.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use vm_memory::ByteValued;

use super::abi::{self, init, opcode, InHeader, OutHeader};
use super::chain::{Reader, Writer};
use crate::dax::DaxMapper;
use crate::passthrough::{
    component, errno_error, CachePolicy, Caller, PassthroughFs, SetattrRequest,
};

/// Largest request body other than WRITE data (names, xattr values).
const MAX_BODY: usize = 128 * 1024;
/// Largest WRITE the guest is told it may send.
pub const MAX_WRITE: u32 = 1 << 20;

/// What the server has done, for logs and metrics.
#[derive(Default)]
pub struct ServerStats {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    /// READ/WRITE that went through the queue (not through DAX).
    pub fuse_reads: AtomicU64,
    pub fuse_read_bytes: AtomicU64,
    pub fuse_writes: AtomicU64,
    pub fuse_write_bytes: AtomicU64,
}

pub struct Server {
    pub fs: PassthroughFs,
    pub dax: DaxMapper,
    pub stats: ServerStats,
}

/// The request body after the header (except WRITE data), with a cursor.
struct Body {
    buf: Vec<u8>,
    pos: usize,
}

impl Body {
    fn obj<T: ByteValued + Default>(&mut self) -> io::Result<T> {
        let end = self
            .pos
            .checked_add(size_of::<T>())
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let mut v = T::default();
        v.as_mut_slice().copy_from_slice(&self.buf[self.pos..end]);
        self.pos = end;
        Ok(v)
    }

    /// The next NUL-terminated string (without the NUL).
    fn cstr(&mut self) -> io::Result<&[u8]> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        self.pos += len + 1;
        Ok(&rest[..len])
    }

    fn name(&mut self) -> io::Result<CString> {
        component(self.cstr()?)
    }

    fn bytes(&mut self, n: usize) -> io::Result<&[u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
}

/// A reply: the payload pieces after the out header, or nothing at all
/// (FORGET), or an errno.
enum Reply {
    Data(Vec<u8>),
    /// The payload was written straight into guest memory after the header.
    Direct(usize),
    None,
}

fn data<T: ByteValued>(v: T) -> Reply {
    Reply::Data(v.as_slice().to_vec())
}

fn pad8(n: usize) -> usize {
    n.next_multiple_of(8)
}

impl Server {
    pub fn new(fs: PassthroughFs, dax: DaxMapper) -> Self {
        Server {
            fs,
            dax,
            stats: ServerStats::default(),
        }
    }

    /// Serves one request; returns the bytes written to the guest's buffers.
    pub fn handle(&self, mut r: Reader, mut w: Writer) -> usize {
        self.stats.requests.fetch_add(1, Relaxed);
        let Ok(hdr) = r.read_obj::<InHeader>() else {
            log::warn!("request too short for a FUSE header; dropped");
            return 0;
        };
        let result = self.dispatch(&hdr, &mut r, &mut w);
        let (error, payload) = match result {
            Ok(Reply::None) => return 0,
            Ok(Reply::Data(d)) => (0, Some(d)),
            Ok(Reply::Direct(n)) => {
                return match Self::write_header(&mut w, hdr.unique, 0, n) {
                    Ok(()) => size_of::<OutHeader>() + n,
                    Err(_) => 0,
                };
            }
            Err(e) => {
                self.stats.errors.fetch_add(1, Relaxed);
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                log::debug!("opcode {} nodeid {}: errno {errno}", hdr.opcode, hdr.nodeid);
                (errno, None)
            }
        };
        let len = payload.as_ref().map_or(0, Vec::len);
        if len + size_of::<OutHeader>() > w.available() {
            log::warn!(
                "opcode {}: reply buffer too small ({} bytes)",
                hdr.opcode,
                w.available()
            );
            let _ = Self::write_header(&mut w, hdr.unique, libc::ERANGE, 0);
            return if w.available() >= size_of::<OutHeader>() {
                size_of::<OutHeader>()
            } else {
                0
            };
        }
        if Self::write_header(&mut w, hdr.unique, error, len).is_err() {
            return 0;
        }
        if let Some(d) = payload {
            if w.write_at(size_of::<OutHeader>(), &d).is_err() {
                return 0;
            }
        }
        size_of::<OutHeader>() + len
    }

    fn write_header(w: &mut Writer, unique: u64, errno: i32, payload: usize) -> io::Result<()> {
        let len = u32::try_from(size_of::<OutHeader>() + payload)
            .map_err(|_| errno_error(libc::EINVAL))?;
        w.write_at(
            0,
            OutHeader {
                len,
                error: -errno,
                unique,
            }
            .as_slice(),
        )
    }

    fn entry(&self, (nodeid, st): (u64, libc::stat64)) -> abi::EntryOut {
        let t = self.fs.cache.timeout();
        let mut attr = self.fs.attr_of(nodeid, &st);
        if self.fs.is_submount(nodeid, &st) {
            attr.flags |= abi::ATTR_SUBMOUNT;
        }
        abi::EntryOut {
            nodeid,
            generation: 0,
            entry_valid: t.as_secs(),
            attr_valid: t.as_secs(),
            entry_valid_nsec: t.subsec_nanos(),
            attr_valid_nsec: t.subsec_nanos(),
            attr,
        }
    }

    fn attr_out(&self, attr: abi::Attr) -> abi::AttrOut {
        let t = self.fs.cache.timeout();
        abi::AttrOut {
            attr_valid: t.as_secs(),
            attr_valid_nsec: t.subsec_nanos(),
            dummy: 0,
            attr,
        }
    }

    fn open_flags(&self) -> u32 {
        match self.fs.cache {
            CachePolicy::Never => abi::FOPEN_DIRECT_IO,
            CachePolicy::Auto => 0,
            CachePolicy::Always => abi::FOPEN_KEEP_CACHE,
        }
    }

    fn dispatch(&self, h: &InHeader, r: &mut Reader, w: &mut Writer) -> io::Result<Reply> {
        let body_len = (h.len as usize)
            .checked_sub(size_of::<InHeader>())
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        if body_len > r.available() {
            return Err(errno_error(libc::EINVAL));
        }
        if h.opcode == opcode::WRITE {
            return self.write(h, r, body_len);
        }
        if body_len > MAX_BODY {
            return Err(errno_error(libc::E2BIG));
        }
        let mut b = Body {
            buf: r.read_bytes(body_len)?,
            pos: 0,
        };
        let caller = Caller {
            uid: h.uid,
            gid: h.gid,
        };
        let fs = &self.fs;
        let n = h.nodeid;
        Ok(match h.opcode {
            opcode::INIT => self.init(&mut b)?,
            opcode::DESTROY => {
                fs.reset();
                Reply::Data(Vec::new())
            }
            opcode::LOOKUP => match fs.lookup(n, &b.name()?) {
                Ok(found) => data(self.entry(found)),
                // A negative entry (nodeid 0) lets the guest cache "not there"
                // for the entry timeout instead of asking again.
                Err(e)
                    if e.raw_os_error() == Some(libc::ENOENT)
                        && !self.fs.cache.timeout().is_zero() =>
                {
                    let t = self.fs.cache.timeout();
                    data(abi::EntryOut {
                        entry_valid: t.as_secs(),
                        entry_valid_nsec: t.subsec_nanos(),
                        ..Default::default()
                    })
                }
                Err(e) => return Err(e),
            },
            opcode::FORGET => {
                fs.forget(n, b.obj::<abi::ForgetIn>()?.nlookup);
                Reply::None
            }
            opcode::BATCH_FORGET => {
                let count = b.obj::<abi::BatchForgetIn>()?.count;
                for _ in 0..count {
                    let one = b.obj::<abi::ForgetOne>()?;
                    fs.forget(one.nodeid, one.nlookup);
                }
                Reply::None
            }
            opcode::INTERRUPT => Reply::None,
            opcode::GETATTR => data(self.attr_out(fs.getattr(n)?)),
            opcode::SETATTR => {
                let s = b.obj::<abi::SetattrIn>()?;
                let req = SetattrRequest {
                    valid: s.valid,
                    fh: s.fh,
                    size: s.size,
                    atime: (s.atime, s.atimensec),
                    mtime: (s.mtime, s.mtimensec),
                    mode: s.mode,
                    uid: s.uid,
                    gid: s.gid,
                };
                data(self.attr_out(fs.setattr(n, &req)?))
            }
            opcode::READLINK => Reply::Data(fs.readlink(n)?),
            opcode::SYMLINK => {
                let name = b.name()?;
                let target = CString::new(b.cstr()?).map_err(|_| errno_error(libc::EINVAL))?;
                data(self.entry(fs.symlink(n, &name, &target, caller)?))
            }
            opcode::MKNOD => {
                let a = b.obj::<abi::MknodIn>()?;
                data(self.entry(fs.mknod(n, &b.name()?, a.mode, a.rdev, caller)?))
            }
            opcode::MKDIR => {
                let a = b.obj::<abi::MkdirIn>()?;
                data(self.entry(fs.mkdir(n, &b.name()?, a.mode | libc::S_IFDIR, caller)?))
            }
            opcode::UNLINK => {
                fs.unlink(n, &b.name()?, 0)?;
                Reply::Data(Vec::new())
            }
            opcode::RMDIR => {
                fs.unlink(n, &b.name()?, libc::AT_REMOVEDIR)?;
                Reply::Data(Vec::new())
            }
            opcode::RENAME | opcode::RENAME2 => {
                let (newdir, flags) = if h.opcode == opcode::RENAME {
                    (b.obj::<abi::RenameIn>()?.newdir, 0)
                } else {
                    let a = b.obj::<abi::Rename2In>()?;
                    (a.newdir, a.flags)
                };
                let old = b.name()?;
                fs.rename(n, &old, newdir, &b.name()?, flags)?;
                Reply::Data(Vec::new())
            }
            opcode::LINK => {
                let old = b.obj::<abi::LinkIn>()?.oldnodeid;
                data(self.entry(fs.link(old, n, &b.name()?)?))
            }
            opcode::OPEN => {
                let a = b.obj::<abi::OpenIn>()?;
                let kill = a.open_flags & abi::OPEN_KILL_SUIDGID != 0;
                data(abi::OpenOut {
                    fh: fs.open(n, a.flags, kill)?,
                    open_flags: self.open_flags(),
                    backing_id: 0,
                })
            }
            opcode::CREATE => {
                let a = b.obj::<abi::CreateIn>()?;
                let kill = a.open_flags & abi::OPEN_KILL_SUIDGID != 0;
                let (entry, fh) = fs.create(n, &b.name()?, a.mode, a.flags, kill, caller)?;
                let mut out = self.entry(entry).as_slice().to_vec();
                out.extend_from_slice(
                    abi::OpenOut {
                        fh,
                        open_flags: self.open_flags(),
                        backing_id: 0,
                    }
                    .as_slice(),
                );
                Reply::Data(out)
            }
            opcode::READ => self.read(n, &mut b, w)?,
            opcode::STATFS => {
                let s = fs.statfs(n)?;
                data(abi::Kstatfs {
                    blocks: s.f_blocks,
                    bfree: s.f_bfree,
                    bavail: s.f_bavail,
                    files: s.f_files,
                    ffree: s.f_ffree,
                    bsize: s.f_bsize as u32,
                    namelen: s.f_namemax as u32,
                    frsize: s.f_frsize as u32,
                    ..Default::default()
                })
            }
            opcode::RELEASE | opcode::RELEASEDIR => {
                fs.release(b.obj::<abi::ReleaseIn>()?.fh, n)?;
                Reply::Data(Vec::new())
            }
            opcode::FLUSH => {
                fs.flush(n, b.obj::<abi::FlushIn>()?.fh)?;
                Reply::Data(Vec::new())
            }
            opcode::FSYNC | opcode::FSYNCDIR => {
                let a = b.obj::<abi::FsyncIn>()?;
                fs.fsync(n, a.fh, a.fsync_flags & 1 != 0)?;
                Reply::Data(Vec::new())
            }
            opcode::SETXATTR => {
                let a = b.obj::<abi::SetxattrIn>()?;
                let name = CString::new(b.cstr()?).map_err(|_| errno_error(libc::EINVAL))?;
                fs.setxattr(n, &name, b.bytes(a.size as usize)?, a.flags)?;
                Reply::Data(Vec::new())
            }
            opcode::GETXATTR | opcode::LISTXATTR => {
                let size = b.obj::<abi::GetxattrIn>()?.size;
                let (len, value) = if h.opcode == opcode::GETXATTR {
                    let name = CString::new(b.cstr()?).map_err(|_| errno_error(libc::EINVAL))?;
                    fs.getxattr(n, &name, size)?
                } else {
                    fs.listxattr(n, size)?
                };
                if size == 0 {
                    data(abi::GetxattrOut {
                        size: len,
                        padding: 0,
                    })
                } else {
                    Reply::Data(value)
                }
            }
            opcode::REMOVEXATTR => {
                let name = CString::new(b.cstr()?).map_err(|_| errno_error(libc::EINVAL))?;
                fs.removexattr(n, &name)?;
                Reply::Data(Vec::new())
            }
            opcode::OPENDIR => data(abi::OpenOut {
                fh: fs.opendir(n)?,
                open_flags: 0,
                backing_id: 0,
            }),
            opcode::READDIR | opcode::READDIRPLUS => {
                self.readdir(h.opcode == opcode::READDIRPLUS, n, &mut b, w)?
            }
            opcode::FALLOCATE => {
                let a = b.obj::<abi::FallocateIn>()?;
                fs.fallocate(n, a.fh, a.mode, a.offset, a.length)?;
                Reply::Data(Vec::new())
            }
            opcode::LSEEK => {
                let a = b.obj::<abi::LseekIn>()?;
                data(abi::LseekOut {
                    offset: fs.lseek(n, a.fh, a.offset, a.whence)?,
                })
            }
            opcode::SYNCFS => {
                fs.syncfs()?;
                Reply::Data(Vec::new())
            }
            opcode::SETUPMAPPING => {
                let a = b.obj::<abi::SetupmappingIn>()?;
                self.dax.setup_mapping(fs, n, &a)?;
                Reply::Data(Vec::new())
            }
            opcode::REMOVEMAPPING => {
                let count = b.obj::<abi::RemovemappingIn>()?.count;
                let mut ranges = Vec::new();
                for _ in 0..count.min(crate::dax::MAX_REMOVEMAPPING_ENTRIES + 1) {
                    ranges.push(b.obj::<abi::RemovemappingOne>()?);
                }
                self.dax.remove_mappings(count, &ranges)?;
                Reply::Data(Vec::new())
            }
            // ACCESS: the guest checks permissions itself (virtio-fs mounts
            // with default_permissions); locks stay local to the guest.
            _ => return Err(errno_error(libc::ENOSYS)),
        })
    }

    fn init(&self, b: &mut Body) -> io::Result<Reply> {
        let mut raw = [0u8; size_of::<abi::InitIn>()];
        let given = b.buf.len().min(raw.len());
        if given < abi::INIT_IN_COMPAT_SIZE {
            return Err(errno_error(libc::EINVAL));
        }
        raw[..given].copy_from_slice(&b.buf[..given]);
        let mut a = abi::InitIn::default();
        a.as_mut_slice().copy_from_slice(&raw);
        if a.major < abi::KERNEL_VERSION
            || (a.major == abi::KERNEL_VERSION && a.minor < abi::MIN_KERNEL_MINOR_VERSION)
        {
            log::error!(
                "guest FUSE {}.{} is too old (need 7.{})",
                a.major,
                a.minor,
                abi::MIN_KERNEL_MINOR_VERSION
            );
            return Err(errno_error(libc::EPROTO));
        }
        if a.major > abi::KERNEL_VERSION {
            // The guest retries with our major version.
            return Ok(data(abi::InitOut {
                major: abi::KERNEL_VERSION,
                ..Default::default()
            }));
        }
        let offered = u64::from(a.flags)
            | if a.flags as u64 & init::INIT_EXT != 0 {
                u64::from(a.flags2) << 32
            } else {
                0
            };
        let mut wanted = init::ASYNC_READ
            | init::BIG_WRITES
            | init::ATOMIC_O_TRUNC
            | init::DO_READDIRPLUS
            | init::READDIRPLUS_AUTO
            | init::PARALLEL_DIROPS
            | init::MAX_PAGES
            | init::HANDLE_KILLPRIV_V2
            | init::INIT_EXT;
        match self.fs.cache {
            CachePolicy::Auto => wanted |= init::AUTO_INVAL_DATA,
            CachePolicy::Always => wanted |= init::CACHE_SYMLINKS,
            CachePolicy::Never => {}
        }
        let policy = self.fs.policy.current();
        if self.dax.available() {
            wanted |= init::MAP_ALIGNMENT | init::HAS_INODE_DAX;
        }
        if self.fs.announce_submounts {
            wanted |= init::SUBMOUNTS;
        }
        let enabled = offered & wanted;
        self.fs.reset();
        self.fs.set_submounts(enabled & init::SUBMOUNTS != 0);
        self.fs
            .set_killpriv_v2(enabled & init::HANDLE_KILLPRIV_V2 != 0);
        let minor = a.minor.min(abi::KERNEL_MINOR_VERSION);
        log::info!(
            "FUSE INIT: guest 7.{}, serving 7.{minor}, flags {enabled:#x}",
            a.minor
        );
        let out = abi::InitOut {
            major: abi::KERNEL_VERSION,
            minor,
            max_readahead: a.max_readahead,
            flags: enabled as u32,
            max_background: 64,
            congestion_threshold: 48,
            max_write: MAX_WRITE,
            time_gran: 1,
            max_pages: (MAX_WRITE / 4096) as u16,
            map_alignment: if enabled & init::MAP_ALIGNMENT != 0 {
                policy.map_alignment_log2()
            } else {
                0
            },
            flags2: (enabled >> 32) as u32,
            ..Default::default()
        };
        let mut bytes = out.as_slice().to_vec();
        if a.minor < 23 {
            bytes.truncate(abi::INIT_OUT_COMPAT_SIZE);
        }
        Ok(Reply::Data(bytes))
    }

    fn read(&self, nodeid: u64, b: &mut Body, w: &mut Writer) -> io::Result<Reply> {
        let a = b.obj::<abi::ReadIn>()?;
        let room = w
            .available()
            .checked_sub(size_of::<OutHeader>())
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let size = (a.size as usize).min(room);
        let iovs = w.iovecs(size_of::<OutHeader>(), size)?;
        let n = self.fs.read_into(nodeid, a.fh, a.offset, &iovs)?;
        self.stats.fuse_reads.fetch_add(1, Relaxed);
        self.stats.fuse_read_bytes.fetch_add(n as u64, Relaxed);
        Ok(Reply::Direct(n))
    }

    fn write(&self, h: &InHeader, r: &mut Reader, body_len: usize) -> io::Result<Reply> {
        let a = r.read_obj::<abi::WriteIn>()?;
        let size = a.size as usize;
        if size > body_len.saturating_sub(size_of::<abi::WriteIn>()) || a.size > MAX_WRITE {
            return Err(errno_error(libc::EINVAL));
        }
        let iovs = r.iovecs(size)?;
        let kill = a.write_flags & abi::WRITE_KILL_SUIDGID != 0;
        let n = self.fs.write_from(h.nodeid, a.fh, a.offset, &iovs, kill)?;
        self.stats.fuse_writes.fetch_add(1, Relaxed);
        self.stats.fuse_write_bytes.fetch_add(n as u64, Relaxed);
        Ok(data(abi::WriteOut {
            size: n as u32,
            padding: 0,
        }))
    }

    fn readdir(&self, plus: bool, nodeid: u64, b: &mut Body, w: &Writer) -> io::Result<Reply> {
        let a = b.obj::<abi::ReadIn>()?;
        let room = w
            .available()
            .saturating_sub(size_of::<OutHeader>())
            .min(a.size as usize);
        let fixed = size_of::<abi::Dirent>() + if plus { size_of::<abi::EntryOut>() } else { 0 };
        let mut used = 0usize;
        let mut fits = |e: &crate::passthrough::DirEntry| {
            let need = pad8(fixed + e.name.len());
            if used + need > room {
                return false;
            }
            used += need;
            true
        };
        let mut out = Vec::new();
        let push = |out: &mut Vec<u8>, e: &crate::passthrough::DirEntry| {
            let d = abi::Dirent {
                ino: e.ino,
                off: e.next_offset,
                namelen: e.name.len() as u32,
                typ: u32::from(e.kind),
            };
            out.extend_from_slice(d.as_slice());
            out.extend_from_slice(&e.name);
            out.resize(pad8(out.len()), 0);
        };
        if plus {
            for p in self.fs.readdirplus(nodeid, a.fh, a.offset, &mut fits)? {
                let entry = p.lookup.map(|l| self.entry(l)).unwrap_or_default();
                out.extend_from_slice(entry.as_slice());
                push(&mut out, &p.entry);
            }
        } else {
            for e in self.fs.readdir(nodeid, a.fh, a.offset, &mut fits)? {
                push(&mut out, &e);
            }
        }
        Ok(Reply::Data(out))
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "security_tests.rs"]
mod security_tests;
