//! Which guest RAM pages changed since the last look, for a pre-copy live
//! migration: it sends RAM while the guest runs, then again the pages
//! written meanwhile, round after round.
//!
//! Two writers change guest RAM. The vCPUs: KVM logs their writes once
//! each RAM slot (boot and hot-plugged) is registered again with
//! `KVM_MEM_LOG_DIRTY_PAGES` — same slot number, address and host mapping,
//! so KVM changes only the flag — and `KVM_GET_DIRTY_LOG` returns a slot's
//! bitmap and clears it in one step. (Not `KVM_CLEAR_DIRTY_LOG` with
//! manual protect: that splits the clear from the read to shorten the time
//! KVM holds its MMU lock on very large slots, at the cost of a capability
//! to enable and a second ioctl per slot per round; the guests here are
//! small enough that the one-step read is the simpler correct choice.) And
//! the vhost-user daemons, which write replies and used rings into guest
//! RAM themselves: they set bits in a shared log
//! ([`SharedDirtyLog`]) that [`DirtyLog::collect`] takes back word by
//! word with an atomic swap.
//!
//! The bitmap covers guest-physical space from 0 to the end of the RAM
//! layout (boot RAM and the hot-plug area), sized from the configuration,
//! never from anything the guest controls; a layout above
//! [`MAX_LOG_SPAN`] is refused.

use std::sync::Arc;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use virtio_devices::vhost_user_fs::dirty_log::{
    DirtyLogError as SharedLogError, SharedDirtyLog, LOG_PAGE_SIZE, MAX_LOG_SPAN,
};
use virtio_devices::vhost_user_fs::memory_table::DaemonMemory;
use virtio_devices::vhost_user_fs::FsError;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::{GuestMemoryMmap, GuestRegionMmap};
use crate::arch::x86_64::layout::{ram_ranges, HOTPLUG_MEMORY_ALIGN};
use crate::config::MemoryConfig;
use crate::vm::Vm;

/// Bytes of guest memory one bit of the bitmap stands for.
pub const PAGE_SIZE: u64 = LOG_PAGE_SIZE;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error(
        "dirty log: memory.size {size} + memory.hotplug_size {hotplug} reach past the end of guest-physical space"
    )]
    LayoutOverflow { size: u64, hotplug: u64 },
    #[error(
        "dirty log: guest RAM spans {span:#x} bytes of guest-physical space, above the {MAX_LOG_SPAN:#x} a dirty-page bitmap covers"
    )]
    TooLarge { span: u64 },
    #[error("dirty log: KVM slot {slot} at {addr:#x}+{size:#x} lies outside guest RAM's span of {span:#x} bytes")]
    SlotOutside {
        slot: u32,
        addr: u64,
        size: u64,
        span: u64,
    },
    #[error("dirty log: KVM slot {slot}: {what}: {source}")]
    Kvm {
        slot: u32,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("dirty log: {0}")]
    Daemon(#[from] FsError),
    #[error("dirty log: {0}")]
    SharedLog(#[from] SharedLogError),
    #[error("dirty log: {0}")]
    Memory(#[from] super::MemoryError),
}

/// Bytes of guest-physical space guest RAM may take under `cfg`: from 0 to
/// the end of boot RAM or of the hot-plug area, whichever is higher.
pub fn ram_span(cfg: &MemoryConfig) -> Result<u64, DirtyLogError> {
    let hotplug = cfg.hotplug_size.unwrap_or(0);
    let overflow = || DirtyLogError::LayoutOverflow {
        size: cfg.size,
        hotplug,
    };
    let mut end = 0u64;
    for (addr, size) in ram_ranges(cfg.size) {
        end = end.max(addr.checked_add(size).ok_or_else(overflow)?);
    }
    if hotplug > 0 {
        let start = end
            .max(1 << 32)
            .checked_next_multiple_of(HOTPLUG_MEMORY_ALIGN)
            .ok_or_else(overflow)?;
        end = start.checked_add(hotplug).ok_or_else(overflow)?;
    }
    if end > MAX_LOG_SPAN {
        return Err(DirtyLogError::TooLarge { span: end });
    }
    Ok(end)
}

/// Dirty 4 KiB pages of guest-physical space `[0, span)`: page N is bit
/// N % 64 of word N / 64.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyPages {
    span: u64,
    words: Vec<u64>,
}

impl DirtyPages {
    /// No page dirty, for a span of `span` bytes (at most [`MAX_LOG_SPAN`]).
    pub(crate) fn new(span: u64) -> Result<Self, DirtyLogError> {
        if span > MAX_LOG_SPAN {
            return Err(DirtyLogError::TooLarge { span });
        }
        let words = usize::try_from(span.div_ceil(PAGE_SIZE).div_ceil(64))
            .map_err(|_| DirtyLogError::TooLarge { span })?;
        Ok(DirtyPages {
            span,
            words: vec![0; words],
        })
    }

    /// Bytes of guest-physical space the bitmap covers.
    pub fn span(&self) -> u64 {
        self.span
    }

    /// Whether the page holding guest-physical `gpa` is dirty (false past
    /// the span).
    pub fn is_dirty(&self, gpa: u64) -> bool {
        let page = gpa / PAGE_SIZE;
        usize::try_from(page / 64)
            .ok()
            .and_then(|w| self.words.get(w))
            .is_some_and(|word| word & (1 << (page % 64)) != 0)
    }

    /// Dirty pages.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    /// The bitmap, 64 pages a word.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Each run of dirty pages as `(gpa, length)`, in address order.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut page = 0u64;
        let pages = self.span.div_ceil(PAGE_SIZE);
        std::iter::from_fn(move || {
            // Skips clean words whole, then clean pages.
            while page < pages {
                let word = self.word_of(page);
                if word == 0 && page.is_multiple_of(64) {
                    page += 64;
                } else if word & (1 << (page % 64)) == 0 {
                    page += 1;
                } else {
                    break;
                }
            }
            if page >= pages {
                return None;
            }
            let first = page;
            while page < pages && self.word_of(page) & (1 << (page % 64)) != 0 {
                page += 1;
            }
            Some((first * PAGE_SIZE, (page - first) * PAGE_SIZE))
        })
    }

    fn word_of(&self, page: u64) -> u64 {
        usize::try_from(page / 64)
            .ok()
            .and_then(|w| self.words.get(w))
            .copied()
            .unwrap_or(0)
    }

    /// ORs in a slot's bitmap from KVM (bit i = page `first_page + i`).
    /// Bits past the span are dropped: [`DirtyLog::start`] checked that
    /// every slot lies inside it.
    fn merge_slot(&mut self, first_page: u64, slot_bits: &[u64]) {
        for (i, word) in (0u64..).zip(slot_bits) {
            let mut bits = *word;
            while bits != 0 {
                let bit = u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                self.set(first_page + i * 64 + bit);
            }
        }
    }

    /// Marks the page holding `gpa` (dropped past the span).
    #[cfg(test)]
    pub(crate) fn mark(&mut self, gpa: u64) {
        self.set(gpa / PAGE_SIZE);
    }

    fn set(&mut self, page: u64) {
        if let Some(word) = usize::try_from(page / 64)
            .ok()
            .and_then(|w| self.words.get_mut(w))
        {
            *word |= 1 << (page % 64);
        }
    }

    /// ORs in the daemons' log, clearing it word by word as it goes (an
    /// atomic swap: a bit a daemon sets meanwhile lands either in this
    /// round or in the log for the next one).
    fn merge_shared_log(&mut self, log: &SharedDirtyLog) {
        for (i, word) in self.words.iter_mut().enumerate() {
            match log.take_word(i) {
                Some(bits) => *word |= bits,
                None => break,
            }
        }
    }
}

/// One KVM memory slot of guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamSlot {
    pub slot: u32,
    pub guest_addr: u64,
    pub size: u64,
    pub host_addr: u64,
}

/// The KVM slots of boot RAM, numbered as [`super::register_with_kvm`]
/// registers them.
pub fn boot_slots(mem: &GuestMemoryMmap) -> Result<Vec<RamSlot>, super::MemoryError> {
    mem.iter()
        .enumerate()
        .map(|(slot, region)| {
            Ok(RamSlot {
                slot: u32::try_from(slot)
                    .map_err(|_| super::MemoryError::TooManyRegions { count: slot })?,
                guest_addr: region.start_addr().0,
                size: region.len(),
                host_addr: region.as_ptr() as u64,
            })
        })
        .collect()
}

impl RamSlot {
    /// Registers the slot with `flags` (again, to change only the flags).
    ///
    /// # Safety
    /// The host mapping must stay mapped while KVM holds the slot; a slot
    /// KVM holds already must be given with the same address, size and
    /// mapping.
    pub(super) unsafe fn set(&self, vm: &VmFd, flags: u32) -> Result<(), kvm_ioctls::Error> {
        let region = kvm_userspace_memory_region {
            slot: self.slot,
            flags,
            guest_phys_addr: self.guest_addr,
            memory_size: self.size,
            userspace_addr: self.host_addr,
        };
        // SAFETY: the caller's contract: the same mapping KVM holds already.
        unsafe { vm.set_user_memory_region(region) }
    }
}

/// The bitmap of what the VMM itself wrote into `region` (vm-memory marks
/// it on every write through the region), a bit per 4 KiB page from the
/// region's start: on x86-64 the host's base page, which is what
/// vm-memory sizes its pages by.
fn vmm_bitmap(region: &GuestRegionMmap) -> &vm_memory::bitmap::AtomicBitmap {
    let mapping: &vm_memory::MmapRegion<vm_memory::bitmap::AtomicBitmap> = region;
    mapping.bitmap()
}

/// Guest RAM's dirty pages being logged, from [`DirtyLog::start`] until
/// [`DirtyLog::stop`] (or drop).
pub struct DirtyLog {
    vm: Arc<VmFd>,
    slots: Vec<RamSlot>,
    span: u64,
    daemons: Vec<DaemonMemory>,
    shared: Option<Arc<SharedDirtyLog>>,
    /// Keeps every slot's mapping alive while this value may register it;
    /// their bitmaps hold what the VMM's devices wrote.
    mappings: (GuestMemoryMmap, Vec<Arc<GuestRegionMmap>>),
    stopped: bool,
}

impl DirtyLog {
    /// Starts logging every RAM slot of `vm` and every fs daemon's writes.
    /// Refused before anything changes when a daemon cannot log (it is
    /// named) or the layout is too large; a failure halfway undoes what
    /// was done.
    pub fn start(vm: &Vm) -> Result<DirtyLog, DirtyLogError> {
        let span = ram_span(vm.ram.boot_config())?;
        let mut slots = boot_slots(&vm.mem)?;
        slots.extend(vm.devices.hotplugged_ram_slots().iter().map(|s| RamSlot {
            slot: s.slot(),
            guest_addr: s.guest_addr(),
            size: s.size(),
            host_addr: s.host_addr(),
        }));
        let daemons = vm
            .devices
            .fs_devices()
            .iter()
            .map(|f| f.memory.clone())
            .collect();
        let mappings = (vm.mem.clone(), vm.hotplugged_ram.clone());
        // SAFETY: the slots are the VM's RAM slots as registered (boot RAM
        // by `register_with_kvm` in this order, hot-plugged RAM by its
        // `MemorySlot`), and `mappings` keeps each one's mapping alive for
        // as long as the returned value may register it.
        unsafe { Self::start_slots(vm.vm.clone(), slots, span, daemons, mappings) }
    }

    /// [`DirtyLog::start`] on explicit slots.
    ///
    /// # Safety
    /// Each slot must be registered with KVM as given, its mapping owned
    /// by `mappings`.
    unsafe fn start_slots(
        vm: Arc<VmFd>,
        slots: Vec<RamSlot>,
        span: u64,
        daemons: Vec<DaemonMemory>,
        mappings: (GuestMemoryMmap, Vec<Arc<GuestRegionMmap>>),
    ) -> Result<DirtyLog, DirtyLogError> {
        for s in &slots {
            if s.guest_addr
                .checked_add(s.size)
                .is_none_or(|end| end > span)
            {
                return Err(DirtyLogError::SlotOutside {
                    slot: s.slot,
                    addr: s.guest_addr,
                    size: s.size,
                    span,
                });
            }
        }
        // Refused before anything changes: pre-copy cannot be correct
        // without every daemon's writes.
        for d in &daemons {
            d.check_can_log()?;
        }
        // The VMM's own writes count from here on.
        for region in mappings.0.iter() {
            vmm_bitmap(region).reset();
        }
        for region in &mappings.1 {
            vmm_bitmap(region).reset();
        }
        let shared = if daemons.is_empty() {
            None
        } else {
            Some(Arc::new(SharedDirtyLog::new(span)?))
        };
        let mut log = DirtyLog {
            vm,
            slots: Vec::with_capacity(slots.len()),
            span,
            daemons: Vec::with_capacity(daemons.len()),
            shared,
            mappings,
            stopped: false,
        };
        for s in slots {
            // SAFETY: the caller's contract.
            unsafe { s.set(&log.vm, KVM_MEM_LOG_DIRTY_PAGES) }.map_err(|source| {
                DirtyLogError::Kvm {
                    slot: s.slot,
                    what: "turning its dirty log on",
                    source,
                }
            })?;
            // Registered with the flag: `stop` (from drop, on an error
            // below) takes it off again.
            log.slots.push(s);
        }
        if let Some(shared) = &log.shared {
            for d in daemons {
                d.start_dirty_log(shared)?;
                log.daemons.push(d);
            }
        }
        Ok(log)
    }

    /// Bytes of guest-physical space the bitmap covers.
    pub fn span(&self) -> u64 {
        self.span
    }

    /// The pages written since the last collect (or the start), by the
    /// vCPUs and by the daemons; reading clears them.
    pub fn collect(&mut self) -> Result<DirtyPages, DirtyLogError> {
        let mut dirty = DirtyPages::new(self.span)?;
        for s in &self.slots {
            let size =
                usize::try_from(s.size).map_err(|_| DirtyLogError::TooLarge { span: s.size })?;
            let bits =
                self.vm
                    .get_dirty_log(s.slot, size)
                    .map_err(|source| DirtyLogError::Kvm {
                        slot: s.slot,
                        what: "KVM_GET_DIRTY_LOG",
                        source,
                    })?;
            dirty.merge_slot(s.guest_addr / PAGE_SIZE, &bits);
        }
        if let Some(shared) = &self.shared {
            dirty.merge_shared_log(shared);
        }
        // What the VMM's own devices wrote (blk reads, net receives, used
        // rings): KVM sees none of it.
        for region in self.mappings.0.iter() {
            let bits = vmm_bitmap(region).get_and_reset();
            dirty.merge_slot(region.start_addr().0 / PAGE_SIZE, &bits);
        }
        for region in &self.mappings.1 {
            let bits = vmm_bitmap(region).get_and_reset();
            dirty.merge_slot(region.start_addr().0 / PAGE_SIZE, &bits);
        }
        Ok(dirty)
    }

    /// Stops logging: every slot back without the flag, every daemon told.
    /// Goes on past a failure and returns the first.
    pub fn stop(mut self) -> Result<(), DirtyLogError> {
        self.stop_all()
    }

    fn stop_all(&mut self) -> Result<(), DirtyLogError> {
        if std::mem::replace(&mut self.stopped, true) {
            return Ok(());
        }
        let mut first = None;
        for s in &self.slots {
            // SAFETY: registered by `start_slots` on the caller's contract;
            // `mappings` still holds the mapping.
            if let Err(source) = unsafe { s.set(&self.vm, 0) } {
                first.get_or_insert(DirtyLogError::Kvm {
                    slot: s.slot,
                    what: "turning its dirty log off",
                    source,
                });
            }
        }
        for d in &self.daemons {
            if let Err(e) = d.stop_dirty_log() {
                first.get_or_insert(e.into());
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        if let Err(e) = self.stop_all() {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
#[path = "dirty_log_tests.rs"]
mod tests;
