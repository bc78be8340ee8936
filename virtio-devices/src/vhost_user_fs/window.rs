//! The DAX cache window: a range of host address space, reserved when the
//! device is created (aligned for huge mappings) and registered with KVM as
//! guest memory, into which the backend's SHMEM_MAP requests map file ranges
//! with `MAP_FIXED`.
//!
//! Where nothing is mapped the window shows its scratch ([`super::scratch`]):
//! readable and writable, never `PROT_NONE` (KVM could not serve it), one
//! page of its own per window page, its cost capped and counted
//! ([`DaxWindow::stray_bytes`]).
//!
//! The window keeps a descriptor of every file it maps and follows its size
//! ([`super::mapped_files`], [`super::file_watch`]): a file shrunk on the
//! host gets the scratch shown over its vanished pages
//! ([`DaxWindow::repair_truncated`]) before a guest access there can hang a
//! vCPU; pages a new mapping shows past its file's end are guarded until
//! touched (`window/guard.rs`). Every window of the VMM draws its mappings
//! from one budget ([`super::map_budget`]) and its inotify watches from
//! another ([`super::watch_budget`]).
//!
//! The window is never `munmap`ed while the device lives, so the address
//! range cannot be handed to another mapping in this process while KVM still
//! translates guest addresses into it.
//!
//! Every request comes from the daemon, which is not trusted: it is checked
//! (region id, zero length, overflow, bounds, page alignment, flags, fd type)
//! before any mmap, and a refused request changes nothing.
//!
//! Here: the reservation and the map path; the checks are in
//! `window/checks.rs`. Giving ranges back
//! (SHMEM_UNMAP, a reset) and the estimate of the guest's reclaiming are in
//! `window/reclaim.rs`, pre-faulting new mappings in `window/prefault.rs`,
//! truncated files in `window/repair.rs`, pages past a file's end in
//! `window/guard.rs`, the record of what is mapped where (saved, replayed
//! and verified across a restore or a migration) in `window/record.rs`.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dax_abi::{GUEST_RANGE_SIZE, MAX_WINDOW_SIZE};
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};

use super::file_watch::{FileKey, FileWatch};
use super::map_budget::{vmas_for, MapBudget};
use super::mapped_files::{MappedFiles, MappedPiece, MappedRanges};
use super::metrics::{DaxMetrics, FailureReason, MapStage, StageClock};
use super::scratch::Scratch;
use super::watch_budget::WatchBudget;

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("reserving {size} bytes of address space for the DAX window: {source}")]
    Reserve { size: u64, source: std::io::Error },
    #[error("the DAX window size must be a non-zero multiple of the host page size ({page} bytes), got {size}")]
    Size { size: u64, page: u64 },
    #[error("the DAX window size {size} is over the limit of {MAX_WINDOW_SIZE} bytes ({} GiB)", MAX_WINDOW_SIZE >> 30)]
    TooLarge { size: u64 },
    #[error("no mapping left for another DAX window: the windows use {used} of the {limit} mappings vm.max_map_count leaves them")]
    MapBudget { used: usize, limit: usize },
}

/// A refused or failed request, with what the backend is told.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub reason: FailureReason,
    pub message: String,
    pub errno: i32,
}

impl RequestError {
    fn new(reason: FailureReason, errno: i32, message: String) -> Self {
        RequestError {
            reason,
            message,
            errno,
        }
    }
}

/// One thing the window did, for whoever watches it (the API's event stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowEvent {
    Map {
        offset: u64,
        len: u64,
        fd_offset: u64,
        writable: bool,
        took: Duration,
    },
    Unmap {
        offset: u64,
        len: u64,
    },
    /// Every mapping dropped at once (device reset, daemon gone).
    Reset,
    /// A mapped file shrank on the host: its vanished pages at
    /// `[offset, offset + len)` show the scratch now.
    Truncated {
        offset: u64,
        len: u64,
    },
    Refused {
        request: &'static str,
        reason: FailureReason,
        offset: u64,
        len: u64,
    },
}

/// Told of every [`WindowEvent`] on the thread that caused it; must not block.
pub trait WindowObserver: Send + Sync {
    fn event(&self, event: &WindowEvent);
}

/// Puts guest-physical pages into KVM's page tables ahead of the guest's
/// first touch (`KVM_PRE_FAULT_MEMORY`, which the VMM owns).
pub trait GuestPrefaulter: Send + Sync {
    /// Maps what it can of `[gpa, gpa + len)`; returns how many bytes from
    /// `gpa` on are now mapped.
    fn prefault(&self, gpa: u64, len: u64) -> std::io::Result<u64>;

    /// False once it has found it cannot work (the window then fills only
    /// the VMM's page tables).
    fn available(&self) -> bool {
        true
    }
}

/// Default cap on separate mappings in one window. Each mapping is a VMA of
/// this process, and a split range up to three; Linux refuses new mappings
/// past `vm.max_map_count` (65530 by default), after which the VMM's own
/// allocations and thread stacks would fail. 16384 ranges, at most ~32k
/// VMAs, leaves the rest for the VMM; a guest using 2 MiB ranges needs one
/// per 2 MiB of window (512 per GiB).
pub const DEFAULT_MAX_MAPPINGS: usize = 16384;

pub struct DaxWindow {
    host_addr: u64,
    size: u64,
    page_size: u64,
    max_mappings: usize,
    mapped: Mutex<Mappings>,
    /// Shown where nothing is mapped (see the module's comment).
    scratch: Scratch,
    /// Shared by every window of the VMM.
    budget: Arc<MapBudget>,
    /// Follows the mapped files' sizes, to tell of those that shrank.
    file_watch: FileWatch,
    pub metrics: DaxMetrics,
    observer: OnceLock<Arc<dyn WindowObserver>>,
    /// Pre-fault each new mapping ([`Self::prefault`]).
    prefault: std::sync::atomic::AtomicBool,
    /// Where the guest sees the window (0 until placed), for the prefaulter.
    guest_base: std::sync::atomic::AtomicU64,
    /// The file and the end offset of the last map: a map that continues it
    /// is part of a sequential read.
    last_map: Mutex<Option<((u64, u64), u64)>>,
    reclaim_pressure: reclaim::ReclaimPressure,
    guest_prefaulter: OnceLock<Arc<dyn GuestPrefaulter>>,
    /// A pre-fault left for after the daemon's ack
    /// ([`Self::map_deferring_prefault`]).
    deferred_prefault: Mutex<Vec<prefault::Deferred>>,
    /// Scratch ranges a map hid, to empty after the daemon's ack
    /// ([`Self::run_deferred_prefault`]).
    deferred_scratch: Mutex<Vec<(u64, u64)>>,
    /// Re-establishing a saved window ([`record`]): a map identical to
    /// one in place is a no-op, one over a different mapping is refused.
    replaying: std::sync::atomic::AtomicBool,
}

/// What is mapped, under one lock: the merged ranges (the per-window cap),
/// each mapping's file, and the window's charge against the budget.
#[derive(Default)]
struct Mappings {
    ranges: MappedRanges,
    files: MappedFiles,
    /// File pages past the file's end, `PROT_NONE` until touched
    /// ([`guard`]); each a VMA of its own, charged to the budget.
    guarded: guard::Guards,
    /// VMAs taken from [`DaxWindow::budget`].
    charge: usize,
}

/// Alignment of the window in host-virtual space: 1 GiB for windows of
/// 1 GiB or more, else 2 MiB, so file pages the host cache holds as large
/// folios can be mapped (and by KVM, into the guest) with PMD/PUD entries.
fn host_alignment(size: u64) -> u64 {
    if size >= 1 << 30 {
        1 << 30
    } else {
        GUEST_RANGE_SIZE
    }
}

/// Reserves `size` bytes of address space aligned to `align`.
fn reserve_aligned(size: u64, align: u64) -> std::io::Result<u64> {
    let span = size
        .checked_add(align)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
    let base = reserve(span)?;
    let start = base.next_multiple_of(align);
    let (head, tail) = (start - base, base + span - (start + size));
    // SAFETY: both pieces lie inside the reservation just made, which no
    // one else knows of; what stays is [start, start + size).
    unsafe {
        if head > 0 {
            libc::munmap(base as *mut libc::c_void, narrow::usize_of(head));
        }
        if tail > 0 {
            libc::munmap((start + size) as *mut libc::c_void, narrow::usize_of(tail));
        }
    }
    Ok(start)
}

fn host_page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096)
}

/// Reserves `len` bytes of address space (anonymous, `PROT_NONE`) where
/// the kernel chooses.
fn reserve(len: u64) -> std::io::Result<u64> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: without MAP_FIXED the kernel picks a fresh range; nothing
    // existing is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            narrow::usize_of(len),
            libc::PROT_NONE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p as u64)
}

impl DaxWindow {
    /// Reserves `size` bytes of address space; nothing is mapped yet.
    /// Draws on the VMM's one mapping budget ([`MapBudget::process`]).
    pub fn new(size: u64) -> Result<Self, WindowError> {
        Self::with_budget(size, MapBudget::process())
    }

    /// Whether a window of `size` bytes may be made: a non-zero multiple of
    /// the host page size, at most [`MAX_WINDOW_SIZE`]; checked before
    /// anything is reserved. Any size the daemon may announce (a policy's
    /// `cache_size`) passes. Returns the host page size.
    pub fn check_size(size: u64) -> Result<u64, WindowError> {
        let page_size = host_page_size();
        if size == 0 || !size.is_multiple_of(page_size) || usize::try_from(size).is_err() {
            return Err(WindowError::Size {
                size,
                page: page_size,
            });
        }
        if size > MAX_WINDOW_SIZE {
            return Err(WindowError::TooLarge { size });
        }
        Ok(page_size)
    }

    /// A window drawing its mappings from `budget`.
    pub fn with_budget(size: u64, budget: Arc<MapBudget>) -> Result<Self, WindowError> {
        Self::with_budgets(size, budget, WatchBudget::process())
    }

    /// A window drawing its mappings from `budget` and its inotify watches
    /// from `watches`.
    pub fn with_budgets(
        size: u64,
        budget: Arc<MapBudget>,
        watches: Arc<WatchBudget>,
    ) -> Result<Self, WindowError> {
        let page_size = Self::check_size(size)?;
        let reserve = |source| WindowError::Reserve { size, source };
        // The scratch and the budget first: neither needs undoing if the
        // reservation fails, but the charge is given back.
        let scratch = Scratch::new(size).map_err(reserve)?;
        let charge = vmas_for(0);
        if !budget.recharge(0, charge) {
            return Err(WindowError::MapBudget {
                used: budget.used(),
                limit: budget.limit(),
            });
        }
        let host_addr = reserve_aligned(size, host_alignment(size)).map_err(|source| {
            budget.recharge(charge, 0);
            reserve(source)
        })?;
        let window = DaxWindow {
            host_addr,
            size,
            page_size,
            max_mappings: DEFAULT_MAX_MAPPINGS,
            mapped: Mutex::new(Mappings {
                charge,
                ..Mappings::default()
            }),
            scratch,
            budget,
            file_watch: FileWatch::new(watches),
            metrics: DaxMetrics::default(),
            observer: OnceLock::new(),
            prefault: std::sync::atomic::AtomicBool::new(false),
            guest_base: std::sync::atomic::AtomicU64::new(0),
            last_map: Mutex::new(None),
            reclaim_pressure: reclaim::ReclaimPressure::default(),
            guest_prefaulter: OnceLock::new(),
            deferred_prefault: Mutex::default(),
            deferred_scratch: Mutex::default(),
            replaying: std::sync::atomic::AtomicBool::new(false),
        };
        // (On failure, dropping the window gives the reservation back.)
        window.show_scratch(0, size).map_err(reserve)?;
        Ok(window)
    }

    pub fn host_addr(&self) -> u64 {
        self.host_addr
    }

    /// Sets the cap on separate mappings (default [`DEFAULT_MAX_MAPPINGS`]).
    pub fn set_max_mappings(&mut self, max: usize) {
        self.max_mappings = max.max(1);
    }

    /// Refuses a request that would leave more than `max_mappings` ranges.
    /// `guard`: a map whose tail lies past its file's end ([`guard`]).
    fn check_count(
        &self,
        mapped: &mut Mappings,
        start: u64,
        end: u64,
        map: bool,
        guard: bool,
    ) -> Result<(), RequestError> {
        let after = mapped.ranges.count_after(start, end, map);
        if after > self.max_mappings && after > mapped.ranges.0.len() {
            return Err(RequestError::new(
                FailureReason::TooManyMappings,
                libc::ENOSPC,
                format!(
                    "{} of window offset {start:#x}..{end:#x} would leave {after} separate mappings, over the cap of {}",
                    if map { "mapping" } else { "unmapping" },
                    self.max_mappings
                ),
            ));
        }
        // The VMM-wide budget counts every mmap, merged or not.
        let charge = vmas_for(mapped.files.count_after(start, end, map))
            + mapped.guarded.count_after(start, end, guard);
        if charge > mapped.charge && !self.budget.recharge(mapped.charge, charge) {
            return Err(RequestError::new(
                FailureReason::TooManyMappings,
                libc::ENOSPC,
                format!(
                    "{} of window offset {start:#x}..{end:#x} needs {} more of the {} mappings vm.max_map_count leaves the VMM's DAX windows, and {} are in use",
                    if map { "mapping" } else { "unmapping" },
                    charge - mapped.charge,
                    self.budget.limit(),
                    self.budget.used()
                ),
            ));
        }
        mapped.charge = mapped.charge.max(charge);
        Ok(())
    }

    /// Gives back what the window no longer needs of the budget.
    fn settle_charge(&self, mapped: &mut Mappings) {
        let charge = vmas_for(mapped.files.len()) + mapped.guarded.len();
        if charge < mapped.charge {
            self.budget.recharge(mapped.charge, charge);
            mapped.charge = charge;
        }
    }

    /// Where the transport placed the window in guest-physical memory; 0
    /// until it has.
    pub fn guest_base(&self) -> u64 {
        self.guest_base.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Sets who hears of every map and unmap; only the first call counts.
    pub fn set_observer(&self, observer: Arc<dyn WindowObserver>) {
        let _ = self.observer.set(observer);
    }

    fn notify(&self, event: WindowEvent) {
        if let Some(o) = self.observer.get() {
            o.event(&event);
        }
    }

    /// Mapped files followed now, and how many of them have an inotify
    /// watch (the others are read every tick).
    pub fn watched_files(&self) -> (usize, usize) {
        self.file_watch.followed()
    }

    /// Files left without an inotify watch because the VMM's watch budget
    /// was spent.
    pub fn watch_refusals(&self) -> u64 {
        self.file_watch.refused()
    }

    /// 2 MiB guest ranges with something mapped in them now.
    pub fn mapped_guest_ranges(&self) -> u64 {
        self.mapped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ranges
            .ranges_touched(GUEST_RANGE_SIZE)
    }

    /// Bytes of the window's file mappings resident in host memory now
    /// (`mincore`): file pages the guest can reach without a fault. The
    /// ranges are read under the lock, the pages without it, so maps and
    /// unmaps are not held up; a range unmapped meanwhile shows the
    /// scratch, still inside the window (valid for mincore).
    pub fn resident_bytes(&self) -> std::io::Result<u64> {
        // In chunks, so a large range needs no large vector.
        const CHUNK: u64 = 1 << 30;
        let ranges: Vec<(u64, u64)> = {
            let mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
            mapped.ranges.0.iter().map(|(&s, &e)| (s, e)).collect()
        };
        let mut resident = 0;
        let mut vec = Vec::new();
        for (start, end) in ranges {
            let mut off = start;
            while off < end {
                let len = CHUNK.min(end - off);
                vec.resize(narrow::usize_of(len.div_ceil(self.page_size)), 0u8);
                // SAFETY: [host_addr + off, + len) lies inside the window this
                // process reserved; `vec` has one byte per page of it.
                let r = unsafe {
                    libc::mincore(
                        (self.host_addr + off) as *mut libc::c_void,
                        narrow::usize_of(len),
                        vec.as_mut_ptr(),
                    )
                };
                if r != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                resident += vec.iter().filter(|&&b| b & 1 != 0).count() as u64 * self.page_size;
                off += len;
            }
        }
        Ok(resident)
    }

    /// SHMEM_MAP: maps `req.len` bytes of `fd` from `req.fd_offset` at
    /// `req.shm_offset` in the window, shared, read-only or read-write.
    pub fn map(&self, req: &VhostUserMMap, fd: &dyn AsRawFd) -> Result<(), RequestError> {
        self.map_and_prefault(req, fd, false)
    }

    /// As [`Self::map`], but the new range's pre-fault is left for
    /// [`Self::run_deferred_prefault`], which the device worker calls once
    /// the daemon has its ack: the SETUPMAPPING round trip (and the guest's
    /// wait for it) no longer includes the pre-fault, and a guest touch that
    /// races it is served by KVM either way.
    pub fn map_deferring_prefault(
        &self,
        req: &VhostUserMMap,
        fd: &dyn AsRawFd,
    ) -> Result<(), RequestError> {
        self.map_and_prefault(req, fd, true)
    }

    fn map_and_prefault(
        &self,
        req: &VhostUserMMap,
        fd: &dyn AsRawFd,
        defer: bool,
    ) -> Result<(), RequestError> {
        let started = Instant::now();
        self.metrics.map_started(started);
        let mut clock = StageClock::start(&self.metrics);
        let result = self.map_checked(req, fd.as_raw_fd(), defer, &mut clock);
        let (offset, len) = (req.shm_offset, req.len);
        match &result {
            // Already in place (a daemon's replay after the VMM mapped the
            // range from passed descriptors, which counted it): nothing was
            // mapped, nothing is counted again.
            Ok(false) => {}
            Ok(true) => {
                if self.replaying.load(std::sync::atomic::Ordering::SeqCst) {
                    self.metrics
                        .restored_ranges
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let took = started.elapsed();
                self.metrics.record_map(took);
                let writable = VhostUserMMapFlags::from_bits_truncate(req.flags)
                    .contains(VhostUserMMapFlags::WRITABLE);
                self.notify(WindowEvent::Map {
                    offset,
                    len,
                    fd_offset: req.fd_offset,
                    writable,
                    took,
                });
                clock.lap(MapStage::Notify);
            }
            Err(e) => {
                self.metrics.record_failure(e.reason);
                self.notify(WindowEvent::Refused {
                    request: "map",
                    reason: e.reason,
                    offset,
                    len,
                });
            }
        }
        result.map(|_| ())
    }

    /// Ok(false): the identical mapping was in place during a replay.
    fn map_checked(
        &self,
        req: &VhostUserMMap,
        fd: RawFd,
        defer: bool,
        clock: &mut StageClock,
    ) -> Result<bool, RequestError> {
        let end = self.check(req)?;
        clock.lap(MapStage::Check);
        let info = Self::check_fd(fd)?;
        clock.lap(MapStage::Fstat);
        let (shm_offset, len, fd_offset) = (req.shm_offset, req.len, req.fd_offset);
        // Fits: check() refused an fd_offset + len past off_t.
        let file_offset = libc::off_t::try_from(fd_offset).map_err(|_| {
            RequestError::new(
                FailureReason::OutOfBounds,
                libc::EINVAL,
                format!("fd_offset {fd_offset:#x} overflows off_t"),
            )
        })?;
        let writable = VhostUserMMapFlags::from_bits_truncate(req.flags)
            .contains(VhostUserMMapFlags::WRITABLE);
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // Held across the mmap so the range bookkeeping matches the mappings.
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let wanted = MappedPiece {
            start: shm_offset,
            end,
            file: info.file,
            fd_offset,
            writable,
        };
        if self.replaying.load(std::sync::atomic::Ordering::SeqCst)
            && record::in_place(&mapped.files, &wanted)?
        {
            return Ok(false);
        }
        // A descriptor of its own for a file not mapped yet (or mapped
        // only read-only so far and now writable), kept while it is, to
        // notice it shrinking ([`Self::repair_truncated`]) and to pass on
        // in a local migration.
        let own = if mapped.files.keeps_for(info.file, writable) {
            None
        } else {
            Some(dup_cloexec(fd).map_err(|e| {
                RequestError::new(
                    FailureReason::BadFd,
                    e.raw_os_error().unwrap_or(libc::EMFILE),
                    format!("keeping a descriptor of the mapped file: {e}"),
                )
            })?)
        };
        clock.lap(MapStage::KeepFd);
        // Pages past the file's end are guarded, not left for KVM to fault.
        let tail = guard::tail_past_eof(shm_offset, len, fd_offset, info.size, self.page_size);
        self.check_count(&mut mapped, shm_offset, end, true, tail.is_some())?;
        let addr = self.host_addr + shm_offset;
        // SAFETY: [addr, addr + len) lies inside the reserved window (checked
        // above), which this process owns and no Rust reference points into;
        // MAP_FIXED replaces only pages of the window. fd_offset + len fits
        // off_t (checked). A failing mmap leaves the old mapping in place.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                narrow::usize_of(len),
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                file_offset,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            self.settle_charge(&mut mapped);
            return Err(RequestError::new(
                FailureReason::MapFailed,
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("mmap of {len:#x} bytes at window offset {shm_offset:#x}: {e}"),
            ));
        }
        clock.lap(MapStage::Mmap);
        super::scratch::dont_dump(addr, len);
        // The scratch under the new mapping is hidden now: free it, after
        // the ack where the worker runs one (the guest cannot reach the
        // hidden pages meanwhile).
        if defer {
            self.defer_scratch_forget(shm_offset, end);
        } else {
            self.forget_scratch(shm_offset, end);
        }
        clock.lap(MapStage::Scratch);
        let replaced = mapped.ranges.insert(shm_offset, end);
        mapped.guarded.remove(shm_offset, end);
        mapped.files.insert(
            shm_offset,
            end,
            info.file,
            own,
            info.size,
            fd_offset,
            writable,
            Some(&self.file_watch),
        );
        self.metrics
            .bytes_mapped
            .fetch_add(len - replaced, std::sync::atomic::Ordering::Relaxed);
        if let Some(from) = tail {
            self.guard_tail(&mut mapped, from, end, writable);
        }
        self.settle_charge(&mut mapped);
        let reclaiming = self.reclaim_pressure.on_map();
        // Outside the lock: it may read the file. A concurrent unmap of the
        // range only leaves the scratch populated instead.
        drop(mapped);
        clock.lap(MapStage::Record);
        let job = prefault::Deferred {
            addr,
            shm_offset,
            len,
            fd_offset,
            file_size: info.size,
            step: prefault::step_for(info.host_page),
        };
        self.prefault_new_mapping(job, info.file, reclaiming, defer);
        clock.lap(MapStage::QueuePrefault);
        Ok(true)
    }
}

/// A close-on-exec duplicate of `fd`.
fn dup_cloexec(fd: RawFd) -> std::io::Result<File> {
    // SAFETY: no pointers; an invalid fd just fails.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `new` is a fresh descriptor no one else owns.
    Ok(unsafe { File::from_raw_fd(new) })
}

impl Drop for DaxWindow {
    fn drop(&mut self) {
        // SAFETY: the window is this object's own reservation; KVM no longer
        // uses it once the device (and so the VM) is gone.
        unsafe {
            libc::munmap(
                self.host_addr as *mut libc::c_void,
                narrow::usize_of(self.size),
            )
        };
        let mapped = self.mapped.get_mut().unwrap_or_else(|p| p.into_inner());
        self.budget.recharge(mapped.charge, 0);
    }
}

mod checks;
mod guard;
mod prefault;
mod reclaim;
pub mod record;
mod repair;

#[cfg(test)]
#[path = "window_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "window_hostile_tests.rs"]
mod hostile_tests;

#[cfg(test)]
#[path = "window_watch_tests.rs"]
mod watch_tests;

#[cfg(test)]
#[path = "window_record_tests.rs"]
mod record_tests;
