//! One FUSE request in, one reply out: parses the request from its
//! descriptor chain, calls the filesystem, and writes the reply. A request
//! that cannot be parsed or served gets an errno; nothing here panics on
//! guest input.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use vm_memory::ByteValued;

use super::abi::{self, init, opcode, InHeader, OutHeader};
use super::chain::{Reader, Writer};
use super::handlers::Request;
use crate::dax::{window_io, DaxMapper};
use crate::passthrough::{component, errno_error, CachePolicy, Caller, PassthroughFs};
use crate::policy::DaxPolicy;

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
    /// The DAX policy: FUSE_INIT's alignment, the control socket's swaps;
    /// `fs` asks it per file through `DaxDecision`.
    pub policy: Arc<DaxPolicy>,
    pub stats: ServerStats,
}

/// The request body after the header (except WRITE data), with a cursor.
pub(super) struct Body {
    buf: Vec<u8>,
    pos: usize,
}

impl Body {
    pub(super) fn obj<T: ByteValued + Default>(&mut self) -> io::Result<T> {
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
    pub(super) fn cstr(&mut self) -> io::Result<&[u8]> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        self.pos += len + 1;
        Ok(&rest[..len])
    }

    pub(super) fn name(&mut self) -> io::Result<CString> {
        component(self.cstr()?)
    }

    pub(super) fn bytes(&mut self, n: usize) -> io::Result<&[u8]> {
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
pub(super) enum Reply {
    Data(Vec<u8>),
    /// The payload was written straight into guest memory after the header.
    Direct(usize),
    None,
}

pub(super) fn data<T: ByteValued>(v: T) -> Reply {
    Reply::Data(v.as_slice().to_vec())
}

fn pad8(n: usize) -> usize {
    n.next_multiple_of(8)
}

impl Server {
    pub fn new(fs: PassthroughFs, dax: DaxMapper, policy: Arc<DaxPolicy>) -> Self {
        Server {
            fs,
            dax,
            policy,
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

    pub(super) fn entry(&self, (nodeid, st): (u64, libc::stat64)) -> abi::EntryOut {
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

    pub(super) fn attr_out(&self, attr: abi::Attr) -> abi::AttrOut {
        let t = self.fs.cache.timeout();
        abi::AttrOut {
            attr_valid: t.as_secs(),
            attr_valid_nsec: t.subsec_nanos(),
            dummy: 0,
            attr,
        }
    }

    pub(super) fn open_flags(&self) -> u32 {
        match self.fs.cache {
            CachePolicy::Never | CachePolicy::Metadata => abi::FOPEN_DIRECT_IO,
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
        let b = Body {
            buf: r.read_bytes(body_len)?,
            pos: 0,
        };
        let Some(handler) = super::handlers::handler(h.opcode) else {
            return Err(errno_error(libc::ENOSYS));
        };
        handler(
            self,
            &mut Request {
                opcode: h.opcode,
                nodeid: h.nodeid,
                caller: Caller {
                    uid: h.uid,
                    gid: h.gid,
                },
                body: b,
                out: w,
            },
        )
    }

    pub(super) fn init(&self, b: &mut Body) -> io::Result<Reply> {
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
        // Not ATOMIC_O_TRUNC: with it the guest sends O_TRUNC inside OPEN,
        // and the host file is truncated before the guest's VFS checks that
        // nobody executes it (ETXTBSY) — a running program's text was cut
        // under it. Without it the guest checks first and truncates by SETATTR.
        let mut wanted = init::ASYNC_READ
            | init::BIG_WRITES
            | init::PARALLEL_DIROPS
            | init::MAX_PAGES
            | init::INIT_EXT;
        if self.fs.readdirplus {
            wanted |= init::DO_READDIRPLUS | init::READDIRPLUS_AUTO;
        }
        if self.fs.offer_killpriv_v2 {
            wanted |= init::HANDLE_KILLPRIV_V2;
        }
        match self.fs.cache {
            CachePolicy::Auto => wanted |= init::AUTO_INVAL_DATA,
            CachePolicy::Always => wanted |= init::CACHE_SYMLINKS,
            CachePolicy::Never | CachePolicy::Metadata => {}
        }
        let policy = self.policy.current();
        if self.dax.available() {
            wanted |= init::MAP_ALIGNMENT | init::HAS_INODE_DAX;
        }
        if self.fs.announce_submounts {
            wanted |= init::SUBMOUNTS;
        }
        let enabled = offered & wanted;
        self.fs.reset();
        self.dax.forget_mappings();
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

    pub(super) fn read(&self, nodeid: u64, b: &mut Body, w: &mut Writer) -> io::Result<Reply> {
        let a = b.obj::<abi::ReadIn>()?;
        let room = w
            .available()
            .checked_sub(size_of::<OutHeader>())
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let size = (a.size as usize).min(room);
        let bufs = w.bufs(size_of::<OutHeader>(), size, self.dax.location())?;
        let targets = window_io::targets(&self.fs, &self.dax, bufs, true)?;
        let n = self.fs.read_into(nodeid, a.fh, a.offset, &targets)?;
        self.stats.fuse_reads.fetch_add(1, Relaxed);
        self.stats.fuse_read_bytes.fetch_add(n as u64, Relaxed);
        self.policy.adaptive.fuse_read(nodeid, a.offset, n as u64);
        Ok(Reply::Direct(n))
    }

    fn write(&self, h: &InHeader, r: &mut Reader, body_len: usize) -> io::Result<Reply> {
        let a = r.read_obj::<abi::WriteIn>()?;
        let size = a.size as usize;
        if size > body_len.saturating_sub(size_of::<abi::WriteIn>()) || a.size > MAX_WRITE {
            return Err(errno_error(libc::EINVAL));
        }
        let bufs = r.bufs(size, self.dax.location())?;
        let targets = window_io::targets(&self.fs, &self.dax, bufs, false)?;
        let kill = a.write_flags & abi::WRITE_KILL_SUIDGID != 0;
        let n = self
            .fs
            .write_from(h.nodeid, a.fh, a.offset, &targets, kill)?;
        self.stats.fuse_writes.fetch_add(1, Relaxed);
        self.stats.fuse_write_bytes.fetch_add(n as u64, Relaxed);
        Ok(data(abi::WriteOut {
            size: n as u32,
            padding: 0,
        }))
    }

    pub(super) fn readdir(
        &self,
        plus: bool,
        nodeid: u64,
        b: &mut Body,
        w: &Writer,
    ) -> io::Result<Reply> {
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

#[cfg(test)]
#[path = "posix_tests.rs"]
mod posix_tests;
