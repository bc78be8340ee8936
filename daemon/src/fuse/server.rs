//! The FUSE server: what serving a guest's requests owns — the
//! passthrough filesystem, the DAX window's mapper, the DAX policy and the
//! request counters — and the pieces every reply is built from. The
//! requests themselves are parsed, dispatched and answered by
//! [`super::handlers`] ([`Server::handle`]).

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use control_protocol::{DaemonStats, WindowLocation};
use vhost::vhost_user::Backend;
use vm_memory::ByteValued;

use super::abi;
use crate::dax::DaxMapper;
use crate::limits::Cap;
use crate::passthrough::{component, errno_error, CachePolicy, PassthroughFs};
use crate::policy::DaxPolicy;

/// The guest's page size (x86-64), the only block size its DAX writeback
/// accepts.
const GUEST_PAGE_SIZE: u32 = 4096;

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
    pub(super) fs: PassthroughFs,
    pub(super) dax: DaxMapper,
    /// The DAX policy: FUSE_INIT's alignment, the control socket's swaps;
    /// `fs` asks it per file through `DaxDecision`.
    pub(super) policy: Arc<DaxPolicy>,
    pub(super) stats: ServerStats,
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
    /// `dax` reports the window's use to `policy` (they were made so).
    pub fn new(fs: PassthroughFs, dax: DaxMapper, policy: Arc<DaxPolicy>) -> Self {
        // Until the guest's INIT, the alignment INIT would announce now.
        dax.begin_session(policy.current().map_alignment_log2());
        Server {
            fs,
            dax,
            policy,
            stats: ServerStats::default(),
        }
    }

    /// The daemon's migratable state ([`crate::migration`]).
    pub fn save_state(&self) -> Result<Vec<u8>, crate::migration::MigrationError> {
        crate::migration::save(&self.fs, &self.dax, &self.policy)
    }

    /// Loads a migrated state into this daemon, which serves no session yet.
    pub fn load_state(&self, blob: &[u8]) -> Result<(), crate::migration::MigrationError> {
        crate::migration::load(blob, &self.fs, &self.dax, &self.policy)
    }

    /// What the server, its filesystem and its DAX window have done and
    /// hold, and the policy in force: the control socket's `stats`.
    pub fn report(&self) -> DaemonStats {
        let (s, d, fs) = (&self.stats, &self.dax.stats, &self.fs);
        let (map_latency_buckets, map_latency_sum_us) = d.map_latency();
        let policy = self.policy.current();
        DaemonStats {
            requests: s.requests.load(Relaxed),
            errors: s.errors.load(Relaxed),
            fuse_reads: s.fuse_reads.load(Relaxed),
            fuse_read_bytes: s.fuse_read_bytes.load(Relaxed),
            fuse_writes: s.fuse_writes.load(Relaxed),
            fuse_write_bytes: s.fuse_write_bytes.load(Relaxed),
            setupmappings: d.setupmappings.load(Relaxed),
            removemappings: d.removemappings.load(Relaxed),
            dax_failures: d.failures.load(Relaxed),
            inodes: fs.inode_count() as u64,
            policy_generation: policy.generation,
            file_attrs_dax: fs.attrs_dax.load(Relaxed),
            file_attrs_nodax: fs.attrs_nodax.load(Relaxed),
            handles: fs.handle_count() as u64,
            cap_refusals: Cap::ALL
                .iter()
                .map(|&c| (c.name().to_string(), fs.caps.get(c)))
                .collect(),
            map_latency_buckets,
            map_latency_sum_us,
            map_alignment: self.dax.map_alignment(),
            host_fs: self.policy.host_fs.describe(),
            adaptive: self.policy.adaptive.stats(),
            window_truncations: d.truncations.load(Relaxed),
            window_truncated_bytes: d.truncated_bytes.load(Relaxed),
            window_location: self.dax.location(),
            window_buffer_ios: d.window_buffer_ios.load(Relaxed),
            window_buffer_bytes: d.window_buffer_bytes.load(Relaxed),
            window_buffer_refusals: d.window_buffer_refusals.load(Relaxed),
            map_stages: d.map_stages(),
            map_fds_reused: d.fds_reused.load(Relaxed),
        }
    }

    /// The VMM's backend request channel (SET_BACKEND_REQ_FD): from now on
    /// SETUPMAPPING and REMOVEMAPPING reach the VMM, and INIT offers DAX.
    pub fn connect_vmm_channel(&self, backend: Backend) {
        self.dax.set_backend(backend);
    }

    /// The DAX window's size, as GET_SHMEM_CONFIG declares it to the VMM.
    pub fn window_size(&self) -> u64 {
        self.dax.window_size()
    }

    /// Where the VMM placed the window in guest-physical memory; refused
    /// (and the old place kept) when it is empty, unaligned or wraps.
    pub fn set_window_location(&self, loc: WindowLocation) -> Result<(), String> {
        self.dax.set_location(loc)
    }

    /// The VMM found `len` window bytes of a mapped file truncated on the host.
    pub fn count_window_truncation(&self, len: u64) {
        self.dax.count_truncation(len);
    }

    /// A request was served by its queue's thread because the worker pool's
    /// queue was full at `depth`.
    pub fn count_worker_queue_full(&self, depth: u64) {
        self.fs.caps.hit(Cap::WorkerQueue, depth);
    }

    /// `attr` as the guest may be given it where a DAX window is offered:
    /// a regular file's `blksize` is the guest's page size. FUSE makes
    /// `blksize` the guest inode's block size, and the guest's DAX
    /// writeback (`msync`, `fsync` of a file written through a mapping)
    /// refuses an inode whose block size is not its page size with `EIO`
    /// and a kernel warning (`dax_writeback_mapping_range`): a file on a
    /// huge-page tmpfs (2 MiB) could not be synced through the window.
    fn for_guest(&self, mut attr: abi::Attr) -> abi::Attr {
        if self.dax.window_size() > 0 && attr.mode & libc::S_IFMT == libc::S_IFREG {
            attr.blksize = GUEST_PAGE_SIZE;
        }
        attr
    }

    pub(super) fn entry(&self, (nodeid, st): (u64, libc::stat64)) -> abi::EntryOut {
        let t = self.fs.cache.timeout();
        let mut attr = self.for_guest(self.fs.attr_of(nodeid, &st));
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
            attr: self.for_guest(attr),
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

#[cfg(test)]
#[path = "mapping_tests.rs"]
mod mapping_tests;
