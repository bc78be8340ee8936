//! FUSE_SETUPMAPPING and FUSE_REMOVEMAPPING: the guest asks for a file
//! range in its DAX window; the daemon opens the file and asks the VMM,
//! over the vhost-user backend request channel, to map it (SHMEM_MAP with
//! the fd) or to unmap it (SHMEM_UNMAP). The VMM checks and performs the
//! mmap; this side checks what it can first so a bad guest request is
//! refused without a round trip.
//!
//! What the VMM did — each range it mapped, each it unmapped, after its
//! answer — is reported to the [`WindowUse`] the mapper was given (the
//! adaptive policy), never what the guest merely asked for. The mapping
//! alignment is fixed per FUSE session ([`DaxMapper::begin_session`]): what
//! INIT announced holds until the next INIT, whatever the policy becomes.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use control_protocol::{StageTotal, WindowLocation};
// What the VMM agrees on: the window's region id, and the buckets of its
// own map histogram, which this one mirrors.
use dax_abi::{DAX_SHM_REGION_ID as WINDOW_SHMID, MAP_LATENCY_BUCKETS_US as LATENCY_BUCKETS_US};
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};
use vhost::vhost_user::{Backend, VhostUserFrontendReqHandler};

use super::kept_fds::KeptFds;
use super::window_map::{FilePiece, MappedFile, WindowMap};

use crate::fuse::abi::{
    RemovemappingOne, SetupmappingIn, SETUPMAPPING_FLAG_READ, SETUPMAPPING_FLAG_WRITE,
};
use crate::passthrough::{errno_error, PassthroughFs};

/// The guest sends at most a page of entries per REMOVEMAPPING.
pub const MAX_REMOVEMAPPING_ENTRIES: u32 = 4096 / 16;
/// log2 of the alignment a mapper checks before its first session: a page.
const PAGE_SHIFT: u16 = 12;

/// Told what the VMM did to the window: only ranges it acknowledged.
pub trait WindowUse: Send + Sync {
    /// Window bytes `[moffset, moffset + len)` now map file `nodeid`.
    fn mapped(&self, nodeid: u64, moffset: u64, len: u64);
    /// Window bytes `[moffset, moffset + len)` are unmapped.
    fn unmapped(&self, moffset: u64, len: u64);
}

#[derive(Default)]
pub struct DaxStats {
    pub setupmappings: AtomicU64,
    pub removemappings: AtomicU64,
    pub failures: AtomicU64,
    /// Window ranges the VMM reported truncated on the host, and bytes.
    pub truncations: AtomicU64,
    pub truncated_bytes: AtomicU64,
    /// READ/WRITE with a buffer in the window: served, their window bytes,
    /// refused.
    pub window_buffer_ios: AtomicU64,
    pub window_buffer_bytes: AtomicU64,
    pub window_buffer_refusals: AtomicU64,
    /// SETUPMAPPINGs that passed a descriptor kept from an earlier range
    /// of the same file instead of opening it ([`super::kept_fds`]).
    pub fds_reused: AtomicU64,
    /// SHMEM_MAP round trips as the daemon sees them: request sent, VMM
    /// checks, mmaps and pre-faults, ack received.
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    latency_sum_us: AtomicU64,
    /// Per [`MapStage`]: how many SETUPMAPPINGs reached it, and their µs.
    stage_counts: [AtomicU64; MapStage::ALL.len()],
    stage_sums_us: [AtomicU64; MapStage::ALL.len()],
}

/// Where a SETUPMAPPING's time goes in the daemon, stage by stage; each
/// is summed and counted (two relaxed atomic adds), so the trace costs a
/// clock read per stage and nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapStage {
    /// The checks and the file's open (or a kept descriptor's reuse).
    Open,
    /// SHMEM_MAP sent to the VMM until its ack is in.
    ShmemMap,
    /// After the ack: the window's record and the adaptive policy told.
    Record,
    /// The whole request: popped from the queue until its reply is on the
    /// used ring and the guest signalled (`backend.rs`).
    Served,
}

impl MapStage {
    pub const ALL: [MapStage; 4] = [
        MapStage::Open,
        MapStage::ShmemMap,
        MapStage::Record,
        MapStage::Served,
    ];

    /// The name the daemon's stats give it.
    pub fn as_str(self) -> &'static str {
        match self {
            MapStage::Open => "open",
            MapStage::ShmemMap => "shmem_map",
            MapStage::Record => "record",
            MapStage::Served => "served",
        }
    }
}

impl DaxStats {
    pub fn record_stage(&self, stage: MapStage, took: std::time::Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.stage_counts[stage as usize].fetch_add(1, Relaxed);
        self.stage_sums_us[stage as usize].fetch_add(us, Relaxed);
    }

    /// Every stage's count and sum, in [`MapStage::ALL`]'s order.
    pub fn map_stages(&self) -> Vec<StageTotal> {
        MapStage::ALL
            .iter()
            .map(|&s| StageTotal {
                stage: s.as_str().to_string(),
                count: self.stage_counts[s as usize].load(Relaxed),
                sum_us: self.stage_sums_us[s as usize].load(Relaxed),
            })
            .collect()
    }

    fn record_map(&self, took: std::time::Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.latency_buckets[bucket].fetch_add(1, Relaxed);
        self.latency_sum_us.fetch_add(us, Relaxed);
    }

    /// Cumulative counts per bucket bound (None: +Inf), and the sum in µs.
    pub fn map_latency(&self) -> (Vec<(Option<u64>, u64)>, u64) {
        let mut cumulative = 0;
        let bounds = LATENCY_BUCKETS_US.iter().map(|&b| Some(b)).chain([None]);
        let buckets = bounds
            .zip(&self.latency_buckets)
            .map(|(le, n)| {
                cumulative += n.load(Relaxed);
                (le, cumulative)
            })
            .collect();
        (buckets, self.latency_sum_us.load(Relaxed))
    }
}

pub struct DaxMapper {
    /// Set when the VMM hands over the backend request channel.
    backend: Mutex<Option<Backend>>,
    window_size: u64,
    window: Mutex<WindowState>,
    /// Told each range the VMM mapped or unmapped.
    window_use: Arc<dyn WindowUse>,
    pub stats: DaxStats,
}

/// Where the window is, what this daemon mapped in it, and the alignment
/// of this FUSE session.
struct WindowState {
    /// From the VMM ([`control_protocol::WINDOW_LOCATION`]); None until it says.
    location: Option<WindowLocation>,
    mapped: WindowMap,
    /// Descriptors of files with a range in `mapped`, for their next range.
    kept: KeptFds,
    /// log2 of the mapping alignment the guest was told at INIT.
    map_alignment_log2: u16,
}

impl DaxMapper {
    /// `window_use` hears of every range the VMM maps or unmaps.
    pub fn new(window_size: u64, window_use: Arc<dyn WindowUse>) -> Self {
        DaxMapper {
            backend: Mutex::new(None),
            window_size,
            window: Mutex::new(WindowState {
                location: None,
                mapped: WindowMap::default(),
                kept: KeptFds::default(),
                map_alignment_log2: PAGE_SHIFT,
            }),
            window_use,
            stats: DaxStats::default(),
        }
    }

    fn window(&self) -> std::sync::MutexGuard<'_, WindowState> {
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the window's guest-physical placement from the VMM. Refused
    /// (and the old one kept) when it is empty, unaligned or wraps.
    pub fn set_location(&self, loc: WindowLocation) -> Result<(), String> {
        const PAGE: u64 = 4096;
        if loc.size == 0 || !loc.gpa.is_multiple_of(PAGE) || !loc.size.is_multiple_of(PAGE) {
            return Err(format!(
                "gpa {:#x} and size {:#x} must be non-zero multiples of {PAGE}",
                loc.gpa, loc.size
            ));
        }
        if loc.gpa.checked_add(loc.size).is_none() {
            return Err(format!(
                "gpa {:#x} + size {:#x} overflows 64 bits",
                loc.gpa, loc.size
            ));
        }
        self.window().location = Some(loc);
        Ok(())
    }

    /// The VMM found `len` window bytes of a mapped file truncated on the host.
    pub fn count_truncation(&self, len: u64) {
        self.stats.truncations.fetch_add(1, Relaxed);
        self.stats.truncated_bytes.fetch_add(len, Relaxed);
    }

    pub fn location(&self) -> Option<WindowLocation> {
        self.window().location
    }

    /// A new FUSE session: the guest maps afresh before it uses the window,
    /// so nothing recorded for the old one may serve a request.
    pub fn forget_mappings(&self) {
        let mut w = self.window();
        w.mapped.clear();
        w.kept.clear();
    }

    /// The guest forgot node `nodeid`: a descriptor kept for it goes now,
    /// whatever its ranges (a guest evicting an inode unmaps them first).
    pub fn node_forgotten(&self, nodeid: u64) {
        let mut w = self.window();
        if !w.kept.is_empty() {
            w.kept.forget_node(nodeid);
        }
    }

    /// A new FUSE session whose INIT announced mappings aligned to
    /// `2^map_alignment_log2` bytes: every SETUPMAPPING until the next one
    /// is checked against it (a policy swapped meanwhile waits for the
    /// guest to remount). The old session's mappings are forgotten.
    pub fn begin_session(&self, map_alignment_log2: u16) {
        let mut w = self.window();
        w.mapped.clear();
        w.kept.clear();
        w.map_alignment_log2 = map_alignment_log2;
    }

    /// This session's alignment (log2) and every range recorded as mapped:
    /// the window's part of the daemon's migratable state.
    pub fn window_record(&self) -> (u16, Vec<(u64, u64, MappedFile)>) {
        let w = self.window();
        (w.map_alignment_log2, w.mapped.entries())
    }

    /// Installs a migrated record (checked by [`crate::migration`]) in
    /// place of whatever was recorded: the guest's session goes on. The
    /// window's use hears of each range as if it were mapped now.
    pub fn load_window_record(&self, map_alignment_log2: u16, ranges: &[(u64, u64, MappedFile)]) {
        let mut w = self.window();
        w.mapped.clear();
        w.kept.clear();
        w.map_alignment_log2 = map_alignment_log2;
        for &(start, len, file) in ranges {
            w.mapped.insert(start, len, file);
        }
        drop(w);
        for &(start, len, file) in ranges {
            self.window_use.mapped(file.nodeid, start, len);
        }
    }

    /// Has the VMM map every range of a migrated record again (a restored
    /// or migrated guest finds its window as it left it): one SHMEM_MAP per
    /// range, same window offset, length, file offset and access, each
    /// waiting for the VMM's answer. Call before [`Self::load_window_record`].
    /// The first range whose file cannot be opened or whose map the VMM
    /// refuses stops the replay; the error names the file by `path_of`
    /// (its path relative to the share) and the window offset.
    pub fn replay_mappings(
        &self,
        fs: &PassthroughFs,
        ranges: &[(u64, u64, MappedFile)],
        path_of: impl Fn(u64) -> String,
    ) -> Result<(), String> {
        if ranges.is_empty() {
            return Ok(());
        }
        let backend = self.backend().map_err(|_| {
            "the VMM gave no backend request channel to map the window's ranges again".to_string()
        })?;
        for &(start, len, f) in ranges {
            let name = || path_of(f.nodeid);
            let (file, key) = fs
                .open_for_mapping(f.nodeid, f.writable)
                .map_err(|e| format!("{}: opening it to map it again: {e}", name()))?;
            if key != f.key {
                return Err(format!(
                    "{}: is no longer the file mapped at window offset {start:#x}",
                    name()
                ));
            }
            let flags = if f.writable {
                VhostUserMMapFlags::WRITABLE
            } else {
                VhostUserMMapFlags::empty()
            };
            let msg = VhostUserMMap {
                shmid: WINDOW_SHMID,
                fd_offset: f.foffset,
                shm_offset: start,
                len,
                flags: flags.bits(),
                ..Default::default()
            };
            backend.shmem_map(&msg, &file).map_err(|e| {
                format!(
                    "{}: the VMM refused to map {len:#x} bytes at window offset {start:#x} again: {e}",
                    name()
                )
            })?;
        }
        Ok(())
    }

    /// The mapping alignment of this session, bytes.
    pub fn map_alignment(&self) -> u64 {
        1 << self.window().map_alignment_log2
    }

    /// The files behind window bytes `[offset, offset + len)`; EFAULT when
    /// any of it is not mapped (or, for `write`, not mapped writable).
    pub fn resolve(&self, offset: u64, len: u64, write: bool) -> io::Result<Vec<FilePiece>> {
        self.window()
            .mapped
            .resolve(offset, len, write)
            .ok_or_else(|| errno_error(libc::EFAULT))
    }

    pub fn set_backend(&self, backend: Backend) {
        *self.backend.lock().unwrap_or_else(|p| p.into_inner()) = Some(backend);
    }

    /// Whether a window can be used: the VMM gave us the request channel.
    pub fn available(&self) -> bool {
        self.backend
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    pub fn window_size(&self) -> u64 {
        self.window_size
    }

    fn backend(&self) -> io::Result<Backend> {
        self.backend
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| errno_error(libc::ENOSYS))
    }

    fn check_range(&self, moffset: u64, len: u64, align: u64) -> io::Result<()> {
        let end = moffset
            .checked_add(len)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        if len == 0
            || end > self.window_size
            || !moffset.is_multiple_of(align)
            || !len.is_multiple_of(align)
        {
            return Err(errno_error(libc::EINVAL));
        }
        Ok(())
    }

    /// Checks the range against the window and this session's alignment,
    /// opens the file and has the VMM map it.
    pub fn setup_mapping(
        &self,
        fs: &PassthroughFs,
        nodeid: u64,
        a: &SetupmappingIn,
    ) -> io::Result<()> {
        let r = self.try_setup(fs, nodeid, a);
        if r.is_err() {
            self.stats.failures.fetch_add(1, Relaxed);
        }
        r
    }

    fn try_setup(&self, fs: &PassthroughFs, nodeid: u64, a: &SetupmappingIn) -> io::Result<()> {
        let entered = std::time::Instant::now();
        let align = self.map_alignment();
        self.check_range(a.moffset, a.len, align)?;
        if !a.foffset.is_multiple_of(align)
            || a.foffset
                .checked_add(a.len)
                .is_none_or(|e| i64::try_from(e).is_err())
        {
            return Err(errno_error(libc::EINVAL));
        }
        if a.flags & !(SETUPMAPPING_FLAG_READ | SETUPMAPPING_FLAG_WRITE) != 0 {
            return Err(errno_error(libc::EINVAL));
        }
        let writable = a.flags & SETUPMAPPING_FLAG_WRITE != 0;
        // The node first: one the guest forgot, or that is no regular
        // file, is refused before any kept descriptor is looked at.
        let key = fs.mapping_key(nodeid)?;
        let kept = self.window().kept.get(nodeid, key, writable);
        let (file, key, opened_now) = match kept {
            Some(file) => {
                self.stats.fds_reused.fetch_add(1, Relaxed);
                (file, key, false)
            }
            None => {
                let (file, key) = fs.open_for_mapping(nodeid, writable)?;
                (std::sync::Arc::new(file), key, true)
            }
        };
        let opened = std::time::Instant::now();
        self.stats.record_stage(MapStage::Open, opened - entered);
        let flags = if writable {
            VhostUserMMapFlags::WRITABLE
        } else {
            VhostUserMMapFlags::empty()
        };
        let msg = VhostUserMMap {
            shmid: WINDOW_SHMID,
            fd_offset: a.foffset,
            shm_offset: a.moffset,
            len: a.len,
            flags: flags.bits(),
            ..Default::default()
        };
        self.backend()?.shmem_map(&msg, &*file).map_err(|e| {
            crate::warn_limited!(
                "SHMEM_MAP of {:#x} bytes at window offset {:#x} refused: {e}",
                a.len,
                a.moffset
            );
            errno_error(libc::EIO)
        })?;
        let acked = std::time::Instant::now();
        self.stats.record_map(acked - opened);
        self.stats.record_stage(MapStage::ShmemMap, acked - opened);
        self.stats.setupmappings.fetch_add(1, Relaxed);
        let mapped = MappedFile {
            nodeid,
            key,
            foffset: a.foffset,
            writable,
        };
        let mut w = self.window();
        w.mapped.insert(a.moffset, a.len, mapped);
        // Kept only for a node still there: a FORGET that raced this map
        // either went before this look (nothing kept) or drops it after,
        // as it takes this lock once the node is gone.
        if opened_now && fs.mapping_key(nodeid).is_ok_and(|k| k == key) {
            let w = &mut *w;
            w.kept.keep(&w.mapped, nodeid, key, writable, file);
        }
        drop(w);
        self.window_use.mapped(nodeid, a.moffset, a.len);
        self.stats.record_stage(MapStage::Record, acked.elapsed());
        Ok(())
    }

    /// Unmaps every range (trying all of them); the first failure is the answer.
    pub fn remove_mappings(&self, count: u32, ranges: &[RemovemappingOne]) -> io::Result<()> {
        if count == 0 || count > MAX_REMOVEMAPPING_ENTRIES || ranges.len() != count as usize {
            self.stats.failures.fetch_add(1, Relaxed);
            return Err(errno_error(libc::EINVAL));
        }
        let backend = self.backend()?;
        let mut result = Ok(());
        for one in ranges {
            let r = self.check_range(one.moffset, one.len, 4096).and_then(|()| {
                // Forgotten whether or not the VMM unmaps it: after a
                // refusal the window's state there is not known. A file
                // whose last range this was needs no descriptor kept.
                let mut w = self.window();
                w.mapped.remove(one.moffset, one.len);
                let w = &mut *w;
                w.kept.retain_mapped(&w.mapped);
                let msg = VhostUserMMap {
                    shmid: WINDOW_SHMID,
                    shm_offset: one.moffset,
                    len: one.len,
                    ..Default::default()
                };
                backend.shmem_unmap(&msg).map_err(|e| {
                    crate::warn_limited!(
                        "SHMEM_UNMAP of {:#x} bytes at window offset {:#x} refused: {e}",
                        one.len,
                        one.moffset
                    );
                    errno_error(libc::EIO)
                })?;
                self.window_use.unmapped(one.moffset, one.len);
                Ok(())
            });
            match r {
                Ok(()) => {
                    self.stats.removemappings.fetch_add(1, Relaxed);
                }
                Err(e) => {
                    self.stats.failures.fetch_add(1, Relaxed);
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
        }
        result
    }
}

#[cfg(test)]
impl DaxMapper {
    /// Descriptors kept for the next range of a file now.
    pub(crate) fn kept_fds(&self) -> usize {
        self.window().kept.len()
    }

    /// Records `[moffset, moffset + len)` as mapping `file`, as an
    /// acknowledged SETUPMAPPING does.
    pub(crate) fn record_mapping(&self, moffset: u64, len: u64, file: MappedFile) {
        self.window().mapped.insert(moffset, len, file);
    }
}
