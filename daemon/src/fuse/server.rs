//! The FUSE server: what serving a guest's requests owns — the
//! passthrough filesystem, the DAX window's mapper, the DAX policy and the
//! request counters — and the pieces every reply is built from. The
//! requests themselves are parsed, dispatched and answered by
//! [`super::handlers`] ([`Server::handle`]).

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use vm_memory::ByteValued;

use super::abi;
use crate::dax::DaxMapper;
use crate::passthrough::{component, errno_error, CachePolicy, PassthroughFs};
use crate::policy::DaxPolicy;

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
    pub(super) fn new(buf: Vec<u8>) -> Self {
        Body { buf, pos: 0 }
    }

    /// A struct an older guest may send shorter: at least `min` bytes of
    /// it, the fields it did not send zero. Takes what is there.
    pub(super) fn obj_at_least<T: ByteValued + Default>(&mut self, min: usize) -> io::Result<T> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        let given = rest.len().min(size_of::<T>());
        if given < min {
            return Err(errno_error(libc::EINVAL));
        }
        let mut v = T::default();
        v.as_mut_slice()[..given].copy_from_slice(&rest[..given]);
        self.pos += given;
        Ok(v)
    }

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

impl Server {
    pub fn new(fs: PassthroughFs, dax: DaxMapper, policy: Arc<DaxPolicy>) -> Self {
        Server {
            fs,
            dax,
            policy,
            stats: ServerStats::default(),
        }
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
