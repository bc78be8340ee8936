//! Guest-physical space for devices and the KVM memory slots behind it.
//!
//! [`AddressSpace`] hands out (and takes back, on hot-unplug or when the
//! guest moves a BAR) ranges in the PCI windows of each PCI segment (a
//! 32-bit window for BAR 0 of each virtio-PCI function, a 64-bit window for
//! shared memory BARs) and, above all of them, device memory of virtio-MMIO
//! devices, which no PCI BAR may overlap. The layout's two PCI windows are
//! split between the segments as Cloud Hypervisor splits them: equal parts,
//! 32-bit ones on 4 KiB and 64-bit ones on 4 GiB boundaries, the last
//! segment taking what the rounding leaves. [`MemorySlot`] is one KVM memory
//! slot as a value: registered when made, moved with
//! [`MemorySlot::move_to`], unregistered when dropped, before the mapping
//! it keeps alive goes.

use std::sync::{Arc, Mutex};

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use crate::arch::x86_64::layout;

/// The areas device addresses come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Area {
    /// A PCI segment's 32-bit window (non-prefetchable BARs).
    PciMmio32(u16),
    /// A PCI segment's 64-bit prefetchable window (shared memory BARs).
    PciMmio64(u16),
    /// Shared memory of virtio-MMIO devices, outside every PCI window.
    MmioDeviceMemory,
}

impl std::fmt::Display for Area {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Area::PciMmio32(s) => write!(f, "PCI segment {s}'s 32-bit window"),
            Area::PciMmio64(s) => write!(f, "PCI segment {s}'s 64-bit window"),
            Area::MmioDeviceMemory => write!(f, "virtio-MMIO device memory"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error("no free {size:#x}-byte range aligned to {align:#x} in the {area}")]
    Full { area: Area, size: u64, align: u64 },
    #[error("{start:#x}+{size:#x} is outside PCI segment {segment}'s windows or overlaps another device")]
    Taken { segment: u16, start: u64, size: u64 },
    #[error("PCI segment {0} does not exist")]
    NoSegment(u16),
}

/// One PCI segment's BAR windows, `(start, size)` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentWindows {
    pub mmio32: (u64, u64),
    pub mmio64: (u64, u64),
}

/// 32-bit windows start on this boundary, as in Cloud Hypervisor.
const MMIO32_SEGMENT_ALIGN: u64 = 4 << 10;
/// 64-bit windows start on this boundary, as in Cloud Hypervisor.
const MMIO64_SEGMENT_ALIGN: u64 = 4 << 30;

/// `[start, start + size)` in `parts` pieces of a multiple of `align` bytes
/// each, the last one taking the rest.
fn split(start: u64, size: u64, parts: u16, align: u64) -> Vec<(u64, u64)> {
    let parts = u64::from(parts.max(1));
    let each = size / (align * parts) * align;
    (0..parts)
        .map(|i| {
            let base = start + i * each;
            let len = if i + 1 == parts {
                start + size - base
            } else {
                each
            };
            (base, len)
        })
        .collect()
}

/// The BAR windows of each of `segments` PCI segments in a VM with
/// `ram_size` bytes of RAM.
pub fn segment_windows(ram_size: u64, hotplug_size: u64, segments: u16) -> Vec<SegmentWindows> {
    let mmio32 = split(
        layout::PCI_MMIO32_START,
        layout::PCI_MMIO32_SIZE,
        segments,
        MMIO32_SEGMENT_ALIGN,
    );
    let mmio64 = split(
        layout::device_memory_start(ram_size, hotplug_size),
        layout::PCI_MMIO64_SIZE,
        segments,
        MMIO64_SEGMENT_ALIGN,
    );
    mmio32
        .into_iter()
        .zip(mmio64)
        .map(|(mmio32, mmio64)| SegmentWindows { mmio32, mmio64 })
        .collect()
}

/// Allocators for each [`Area`].
pub struct AddressSpace {
    windows: Vec<SegmentWindows>,
    /// Per segment: its 32-bit and its 64-bit window.
    pci: Vec<(AddressAllocator, AddressAllocator)>,
    mmio_device_memory: AddressAllocator,
}

impl AddressSpace {
    /// The areas for a VM with `ram_size` bytes of RAM, a memory hot-plug
    /// area of `hotplug_size` and `pci_segments` PCI segments (at least
    /// one): the 64-bit PCI windows start above RAM and the hot-plug area,
    /// virtio-MMIO device memory right after the last of them.
    pub fn new(ram_size: u64, hotplug_size: u64, pci_segments: u16) -> Self {
        let alloc = |(base, size)| {
            AddressAllocator::new(base, size).expect("the layout's areas are valid ranges")
        };
        let windows = segment_windows(ram_size, hotplug_size, pci_segments);
        let pci = windows
            .iter()
            .map(|w| (alloc(w.mmio32), alloc(w.mmio64)))
            .collect();
        AddressSpace {
            windows,
            pci,
            mmio_device_memory: alloc((
                layout::device_memory_start(ram_size, hotplug_size) + layout::PCI_MMIO64_SIZE,
                layout::MMIO_DEVICE_MEMORY_SIZE,
            )),
        }
    }

    /// Each segment's windows, segment 0 first.
    pub fn pci_windows(&self) -> &[SegmentWindows] {
        &self.windows
    }

    fn area(&mut self, area: Area) -> Result<&mut AddressAllocator, AddressError> {
        let (s, bits64) = match area {
            Area::PciMmio32(s) => (s, false),
            Area::PciMmio64(s) => (s, true),
            Area::MmioDeviceMemory => return Ok(&mut self.mmio_device_memory),
        };
        let windows = self
            .pci
            .get_mut(usize::from(s))
            .ok_or(AddressError::NoSegment(s))?;
        Ok(if bits64 {
            &mut windows.1
        } else {
            &mut windows.0
        })
    }

    /// The lowest free range of `size` bytes aligned to `align` (a power of two).
    pub fn allocate(&mut self, area: Area, size: u64, align: u64) -> Result<u64, AddressError> {
        self.area(area)?
            .allocate(size, align, AllocPolicy::FirstMatch)
            .map(|r| r.start())
            .map_err(|_| AddressError::Full { area, size, align })
    }

    /// Takes exactly `[start, start + size)` in whichever of `segment`'s
    /// windows holds it: where the guest put a BAR of a function on that
    /// segment. (Linux may put a small prefetchable BAR in the 32-bit
    /// window.)
    pub fn claim_pci(&mut self, segment: u16, start: u64, size: u64) -> Result<Area, AddressError> {
        let taken = AddressError::Taken {
            segment,
            start,
            size,
        };
        let Some(end) = start.checked_add(size).and_then(|e| e.checked_sub(1)) else {
            return Err(taken);
        };
        let Ok(range) = RangeInclusive::new(start, end) else {
            return Err(taken);
        };
        for area in [Area::PciMmio32(segment), Area::PciMmio64(segment)] {
            let a = self.area(area)?;
            if a.base() <= range.start() && range.end() <= a.end() {
                // Alignment 1: the guest's BAR is aligned to its size already
                // (the BAR's read-only low bits make it so).
                return a
                    .allocate(size, 1, AllocPolicy::ExactMatch(start))
                    .map(|_| area)
                    .map_err(|_| taken);
            }
        }
        Err(taken)
    }

    /// Gives back a range from [`Self::allocate`] or [`Self::claim_pci`].
    pub fn free(&mut self, area: Area, start: u64, size: u64) {
        let freed = RangeInclusive::new(start, start + size - 1)
            .map_err(|e| e.to_string())
            .and_then(|r| {
                self.area(area)
                    .map_err(|e| e.to_string())?
                    .free(&r)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = freed {
            tracing::warn!("device memory: freeing {start:#x}+{size:#x} in the {area}: {e}");
        }
    }
}

/// KVM memory slot numbers for device memory (guest RAM has the ones below).
pub struct SlotNumbers {
    free: Vec<u32>,
    next: u32,
    limit: u32,
}

/// First KVM memory slot for device memory; guest RAM uses the slots below.
const DEVICE_SLOT_BASE: u32 = 100;

impl SlotNumbers {
    /// Slots up to `limit` (KVM_CAP_NR_MEMSLOTS).
    pub fn new(limit: u32) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(SlotNumbers {
            free: Vec::new(),
            next: DEVICE_SLOT_BASE,
            limit,
        }))
    }

    fn take(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        (self.next < self.limit).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("no free KVM memory slot (KVM allows {0})")]
    NoSlot(u32),
    #[error("KVM_SET_USER_MEMORY_REGION at {addr:#x}+{size:#x}: {source}")]
    Kvm {
        addr: u64,
        size: u64,
        source: kvm_ioctls::Error,
    },
}

/// `size` bytes of host memory at `host_addr` seen by the guest at
/// `guest_addr`, for as long as this value lives. `owner` is what keeps
/// the host mapping alive; it is dropped after KVM lets go of the slot.
pub struct MemorySlot {
    vm: Arc<VmFd>,
    numbers: Arc<Mutex<SlotNumbers>>,
    slot: u32,
    guest_addr: u64,
    size: u64,
    host_addr: u64,
    /// Taken out of the guest's view for a moment (see [`MemorySlot::park`]).
    parked: bool,
    _owner: Box<dyn Send + Sync>,
}

impl MemorySlot {
    /// Registers the slot.
    ///
    /// # Safety
    /// `[host_addr, host_addr + size)` must be mapped (or reserved
    /// PROT_NONE) for as long as `owner` lives.
    pub unsafe fn new(
        vm: &Arc<VmFd>,
        numbers: &Arc<Mutex<SlotNumbers>>,
        guest_addr: u64,
        size: u64,
        host_addr: u64,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Self, SlotError> {
        let slot = {
            let mut n = numbers.lock().unwrap_or_else(|e| e.into_inner());
            let limit = n.limit;
            n.take().ok_or(SlotError::NoSlot(limit))?
        };
        let me = MemorySlot {
            vm: vm.clone(),
            numbers: numbers.clone(),
            slot,
            guest_addr,
            size,
            host_addr,
            parked: false,
            _owner: owner,
        };
        // If this fails, dropping `me` deletes a slot that was never set
        // (harmless) and gives the number back.
        me.set(guest_addr, size)?;
        Ok(me)
    }

    fn set(&self, guest_addr: u64, size: u64) -> Result<(), SlotError> {
        let region = kvm_userspace_memory_region {
            slot: self.slot,
            flags: 0,
            guest_phys_addr: guest_addr,
            memory_size: size,
            userspace_addr: self.host_addr,
        };
        // SAFETY: the mapping is kept alive by `_owner` (the contract of
        // `new`) for as long as the slot is registered: `Drop` deletes the
        // slot before the owner is dropped.
        unsafe { self.vm.set_user_memory_region(region) }.map_err(|source| SlotError::Kvm {
            addr: guest_addr,
            size,
            source,
        })
    }

    pub fn guest_addr(&self) -> u64 {
        self.guest_addr
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// KVM's number for the slot.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Where the slot's memory is mapped in this process.
    pub fn host_addr(&self) -> u64 {
        self.host_addr
    }

    /// Moves the slot to `guest_addr` (the guest moved the BAR). KVM cannot
    /// move a slot in place: it is deleted and made again; if the new place
    /// is refused, the slot goes back where it was.
    pub fn move_to(&mut self, guest_addr: u64) -> Result<(), SlotError> {
        self.set(self.guest_addr, 0)?;
        if let Err(e) = self.set(guest_addr, self.size) {
            if let Err(back) = self.set(self.guest_addr, self.size) {
                tracing::error!(
                    "KVM slot {}: could not restore it at {:#x}: {back}",
                    self.slot,
                    self.guest_addr
                );
            }
            return Err(e);
        }
        self.guest_addr = guest_addr;
        Ok(())
    }
}

impl MemorySlot {
    /// Takes the slot out of KVM while devices swap places (a restore puts
    /// BARs back where the guest had them, which may be where another
    /// device sits now); [`MemorySlot::unpark_at`] puts it back.
    pub fn park(&mut self) -> Result<(), SlotError> {
        if !self.parked {
            self.set(self.guest_addr, 0)?;
            self.parked = true;
        }
        Ok(())
    }

    /// A parked slot registered again at `guest_addr`.
    pub fn unpark_at(&mut self, guest_addr: u64) -> Result<(), SlotError> {
        self.set(guest_addr, self.size)?;
        self.guest_addr = guest_addr;
        self.parked = false;
        Ok(())
    }
}

impl Drop for MemorySlot {
    fn drop(&mut self) {
        // A parked slot is not registered: only its number goes back.
        if !self.parked {
            if let Err(e) = self.set(self.guest_addr, 0) {
                // The number is not reused: KVM may still hold the slot.
                tracing::error!("KVM slot {}: deleting it: {e}", self.slot);
                return;
            }
        }
        self.numbers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ranges_are_handed_out_claimed_and_given_back() {
        let mut space = AddressSpace::new(512 << 20, 0, 1);
        let m32 = Area::PciMmio32(0);
        let a = space.allocate(m32, 0x8000, 0x8000).unwrap();
        assert_eq!(a, layout::PCI_MMIO32_START);
        let b = space.allocate(m32, 0x8000, 0x8000).unwrap();
        assert_eq!(b, a + 0x8000);
        // The guest moves b: the new place is claimed, the old one freed.
        let moved = b + 0x10_0000;
        assert_eq!(space.claim_pci(0, moved, 0x8000).unwrap(), m32);
        space.free(m32, b, 0x8000);
        assert!(
            space.claim_pci(0, a, 0x8000).is_err(),
            "a is still taken by its device"
        );
        assert_eq!(space.allocate(m32, 0x8000, 0x8000).unwrap(), b);
        // Outside every window (the virtio-MMIO pages, RAM) nothing is claimed.
        assert!(space
            .claim_pci(0, layout::VIRTIO_MMIO_START, 0x1000)
            .is_err());
        assert!(space.claim_pci(0, 0x10_0000, 0x1000).is_err());
        assert!(space.claim_pci(0, u64::MAX - 0xfff, 0x1000).is_err());
        // A big shared memory BAR in the 64-bit window; virtio-MMIO device
        // memory lies past that window, where the guest cannot claim.
        let shm = space
            .allocate(Area::PciMmio64(0), 1 << 30, 1 << 30)
            .unwrap();
        assert_eq!(shm, layout::device_memory_start(512 << 20, 0));
        let mmio_mem = space
            .allocate(Area::MmioDeviceMemory, 2 << 20, 2 << 20)
            .unwrap();
        assert_eq!(mmio_mem, shm + layout::PCI_MMIO64_SIZE);
        assert!(space.claim_pci(0, mmio_mem, 2 << 20).is_err());
        // There is no segment 1.
        assert!(matches!(
            space.allocate(Area::PciMmio32(1), 0x8000, 0x8000),
            Err(AddressError::NoSegment(1))
        ));
    }

    #[test]
    fn segments_split_the_windows_without_overlap() {
        let ram = 4 << 30;
        for n in [1, 2, 3, 7, crate::config::MAX_PCI_SEGMENTS] {
            let w = segment_windows(ram, 0, n);
            assert_eq!(w.len(), usize::from(n));
            for (kind, pick, start, size, align) in [
                (
                    "32-bit",
                    (|w: &SegmentWindows| w.mmio32) as fn(&SegmentWindows) -> (u64, u64),
                    layout::PCI_MMIO32_START,
                    layout::PCI_MMIO32_SIZE,
                    MMIO32_SEGMENT_ALIGN,
                ),
                (
                    "64-bit",
                    |w: &SegmentWindows| w.mmio64,
                    layout::device_memory_start(ram, 0),
                    layout::PCI_MMIO64_SIZE,
                    MMIO64_SEGMENT_ALIGN,
                ),
            ] {
                // Back to back, in segment order, covering the whole window.
                let mut next = start;
                for (i, seg) in w.iter().map(pick).enumerate() {
                    assert_eq!(seg.0, next, "{n} segments: {kind} window of {i}");
                    assert!(
                        seg.1 >= align,
                        "{n} segments: {kind} window of {i} is empty"
                    );
                    if i + 1 < w.len() {
                        assert_eq!(seg.1 % align, 0);
                    }
                    next = seg.0 + seg.1;
                }
                assert_eq!(
                    next,
                    start + size,
                    "{n} segments: the {kind} window is used up"
                );
            }
        }
        assert_eq!(
            segment_windows(ram, 0, 2)[1].mmio64,
            (
                layout::device_memory_start(ram, 0) + layout::PCI_MMIO64_SIZE / 2,
                layout::PCI_MMIO64_SIZE / 2
            )
        );
    }

    #[test]
    fn each_segment_allocates_and_claims_in_its_own_windows() {
        let mut space = AddressSpace::new(512 << 20, 0, 2);
        let w = space.pci_windows().to_vec();
        let a0 = space.allocate(Area::PciMmio32(0), 0x8000, 0x8000).unwrap();
        let a1 = space.allocate(Area::PciMmio32(1), 0x8000, 0x8000).unwrap();
        assert_eq!((a0, a1), (w[0].mmio32.0, w[1].mmio32.0));
        let s1 = space
            .allocate(Area::PciMmio64(1), 1 << 30, 1 << 30)
            .unwrap();
        assert_eq!(s1, w[1].mmio64.0);
        // A BAR of a segment 1 function moved into segment 0's window is
        // not followed: the guest's host bridge 1 does not decode there.
        let in_seg0 = w[0].mmio32.0 + 0x10_0000;
        assert!(matches!(
            space.claim_pci(1, in_seg0, 0x8000),
            Err(AddressError::Taken { segment: 1, .. })
        ));
        assert_eq!(
            space.claim_pci(0, in_seg0, 0x8000).unwrap(),
            Area::PciMmio32(0)
        );
        let in_seg1 = w[1].mmio64.0 + (2 << 30);
        assert_eq!(
            space.claim_pci(1, in_seg1, 1 << 30).unwrap(),
            Area::PciMmio64(1)
        );
        space.free(Area::PciMmio64(1), s1, 1 << 30);
        assert_eq!(
            space
                .allocate(Area::PciMmio64(1), 1 << 30, 1 << 30)
                .unwrap(),
            s1
        );
        assert_eq!(
            Area::PciMmio64(1).to_string(),
            "PCI segment 1's 64-bit window"
        );
    }

    #[test]
    fn slot_numbers_are_reused_and_capped() {
        let numbers = SlotNumbers::new(DEVICE_SLOT_BASE + 2);
        let mut n = numbers.lock().unwrap();
        assert_eq!(n.take(), Some(DEVICE_SLOT_BASE));
        assert_eq!(n.take(), Some(DEVICE_SLOT_BASE + 1));
        assert_eq!(n.take(), None);
        n.free.push(DEVICE_SLOT_BASE);
        assert_eq!(n.take(), Some(DEVICE_SLOT_BASE));
    }
}
