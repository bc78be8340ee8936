//! Guest-physical space for devices and the KVM memory slots behind it.
//!
//! [`AddressSpace`] hands out (and takes back, on hot-unplug or when the
//! guest moves a BAR) ranges in three areas: the 32-bit PCI window (BAR 0 of
//! each virtio-PCI function), the 64-bit PCI window (shared memory BARs) and,
//! above it, device memory of virtio-MMIO devices, which no PCI BAR may
//! overlap. [`MemorySlot`] is one KVM memory slot as a value: registered
//! when made, moved with [`MemorySlot::move_to`], unregistered when dropped,
//! before the mapping it keeps alive goes.

use std::sync::{Arc, Mutex};

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use crate::arch::x86_64::layout;

/// The areas device addresses come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Area {
    /// The 32-bit PCI window (non-prefetchable BARs).
    PciMmio32,
    /// The 64-bit prefetchable PCI window (shared memory BARs).
    PciMmio64,
    /// Shared memory of virtio-MMIO devices, outside every PCI window.
    MmioDeviceMemory,
}

#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error("no free {size:#x}-byte range aligned to {align:#x} in the {area:?} area")]
    Full { area: Area, size: u64, align: u64 },
    #[error("{start:#x}+{size:#x} is outside the PCI windows or overlaps another device")]
    Taken { start: u64, size: u64 },
}

/// Allocators for each [`Area`].
pub struct AddressSpace {
    mmio32: AddressAllocator,
    mmio64: AddressAllocator,
    mmio_device_memory: AddressAllocator,
}

impl AddressSpace {
    /// The areas for a VM with `ram_size` bytes of RAM and a memory hot-plug
    /// area of `hotplug_size`: the 64-bit PCI window starts above both,
    /// virtio-MMIO device memory right after it.
    pub fn new(ram_size: u64, hotplug_size: u64) -> Self {
        let pci64 = layout::device_memory_start(ram_size, hotplug_size);
        let alloc = |base, size| {
            AddressAllocator::new(base, size).expect("the layout's areas are valid ranges")
        };
        AddressSpace {
            mmio32: alloc(layout::PCI_MMIO32_START, layout::PCI_MMIO32_SIZE),
            mmio64: alloc(pci64, layout::PCI_MMIO64_SIZE),
            mmio_device_memory: alloc(
                pci64 + layout::PCI_MMIO64_SIZE,
                layout::MMIO_DEVICE_MEMORY_SIZE,
            ),
        }
    }

    fn area(&mut self, area: Area) -> &mut AddressAllocator {
        match area {
            Area::PciMmio32 => &mut self.mmio32,
            Area::PciMmio64 => &mut self.mmio64,
            Area::MmioDeviceMemory => &mut self.mmio_device_memory,
        }
    }

    /// The lowest free range of `size` bytes aligned to `align` (a power of two).
    pub fn allocate(&mut self, area: Area, size: u64, align: u64) -> Result<u64, AddressError> {
        self.area(area)
            .allocate(size, align, AllocPolicy::FirstMatch)
            .map(|r| r.start())
            .map_err(|_| AddressError::Full { area, size, align })
    }

    /// Takes exactly `[start, start + size)` in whichever PCI window holds
    /// it: where the guest put a BAR. (Linux may put a small prefetchable
    /// BAR in the 32-bit window.)
    pub fn claim_pci(&mut self, start: u64, size: u64) -> Result<Area, AddressError> {
        let taken = AddressError::Taken { start, size };
        let end = start
            .checked_add(size)
            .and_then(|e| e.checked_sub(1))
            .ok_or(AddressError::Taken { start, size })?;
        let range =
            RangeInclusive::new(start, end).map_err(|_| AddressError::Taken { start, size })?;
        for area in [Area::PciMmio32, Area::PciMmio64] {
            let a = self.area(area);
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
        let freed =
            RangeInclusive::new(start, start + size - 1).and_then(|r| self.area(area).free(&r));
        if let Err(e) = freed {
            log::warn!("device memory: freeing {start:#x}+{size:#x} in {area:?}: {e}");
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

    /// Moves the slot to `guest_addr` (the guest moved the BAR). KVM cannot
    /// move a slot in place: it is deleted and made again; if the new place
    /// is refused, the slot goes back where it was.
    pub fn move_to(&mut self, guest_addr: u64) -> Result<(), SlotError> {
        self.set(self.guest_addr, 0)?;
        if let Err(e) = self.set(guest_addr, self.size) {
            if let Err(back) = self.set(self.guest_addr, self.size) {
                log::error!(
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

impl Drop for MemorySlot {
    fn drop(&mut self) {
        if let Err(e) = self.set(self.guest_addr, 0) {
            // The number is not reused: KVM may still hold the slot.
            log::error!("KVM slot {}: deleting it: {e}", self.slot);
            return;
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
        let mut space = AddressSpace::new(512 << 20, 0);
        let a = space.allocate(Area::PciMmio32, 0x8000, 0x8000).unwrap();
        assert_eq!(a, layout::PCI_MMIO32_START);
        let b = space.allocate(Area::PciMmio32, 0x8000, 0x8000).unwrap();
        assert_eq!(b, a + 0x8000);
        // The guest moves b: the new place is claimed, the old one freed.
        let moved = b + 0x10_0000;
        assert_eq!(space.claim_pci(moved, 0x8000).unwrap(), Area::PciMmio32);
        space.free(Area::PciMmio32, b, 0x8000);
        assert!(
            space.claim_pci(a, 0x8000).is_err(),
            "a is still taken by its device"
        );
        assert_eq!(space.allocate(Area::PciMmio32, 0x8000, 0x8000).unwrap(), b);
        // Outside every window (the virtio-MMIO pages, RAM) nothing is claimed.
        assert!(space.claim_pci(layout::VIRTIO_MMIO_START, 0x1000).is_err());
        assert!(space.claim_pci(0x10_0000, 0x1000).is_err());
        assert!(space.claim_pci(u64::MAX - 0xfff, 0x1000).is_err());
        // A big shared memory BAR in the 64-bit window; virtio-MMIO device
        // memory lies past that window, where the guest cannot claim.
        let shm = space.allocate(Area::PciMmio64, 1 << 30, 1 << 30).unwrap();
        assert_eq!(shm, layout::device_memory_start(512 << 20, 0));
        let mmio_mem = space
            .allocate(Area::MmioDeviceMemory, 2 << 20, 2 << 20)
            .unwrap();
        assert_eq!(mmio_mem, shm + layout::PCI_MMIO64_SIZE);
        assert!(space.claim_pci(mmio_mem, 2 << 20).is_err());
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
