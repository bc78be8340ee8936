//! Places virtio devices on bus 0 of a PCI segment through the virtio-PCI
//! transport, at boot and while the guest runs:
//!
//! - BAR 0 (registers, MSI-X) in the 32-bit window on the MMIO bus, with an
//!   ioeventfd per queue notify address;
//! - BAR 2, the shared memory BAR (DAX window, pmem), in the 64-bit window,
//!   backed by a KVM memory slot;
//! - MSI-X vectors as irqfds on routed GSIs;
//! - each segment's host bridge and its hot-plug slots described in the DSDT
//!   (`pci_segment`).
//!
//! When the guest moves a BAR (Linux does when it assigns resources to a
//! hot-plugged function), everything registered there moves with it: the
//! bus range, the ioeventfds, the KVM slot. Removing a function gives back
//! its slot, addresses, GSIs and memory slot.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use virtio_devices::transport::common::Activator;
use virtio_devices::transport::pci::device::{VirtioPciDevice, VirtioPciError, BAR0_SIZE, SHM_BAR};
use virtio_devices::VirtioDevice;
use vm_memory::GuestMemoryAtomic;

use super::address_space::{AddressError, AddressSpace, Area, MemorySlot, SlotError, SlotNumbers};
use super::gsi_routing::{GsiError, GsiRouter, IrqfdMsi};
use super::pci_root::{PciFunction, PciRoot, PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_SIZE};
pub use super::pci_segment::PciAddress;
use crate::arch::x86_64::layout::{pci_ecam_start, DEVICE_MEMORY_ALIGN, PCI_ECAM_SIZE};
use crate::bus::{Bus, BusDevice};
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum VirtioPciSetupError {
    #[error("bus 0 of PCI segment {0} is full (31 device slots)")]
    BusFull(u16),
    #[error("PCI segment {segment} does not exist (the VM has {count})")]
    NoSegment { segment: u16, count: u16 },
    #[error("PCI address space: {0}")]
    Address(#[from] AddressError),
    #[error("shared memory BAR: {0}")]
    MemorySlot(#[from] SlotError),
    #[error("virtio-PCI device: {0}")]
    Device(#[from] VirtioPciError),
    #[error("virtio-PCI ioeventfd: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("PCI: {0}")]
    Bus(String),
    #[error("MSI-X routing: {0}")]
    Gsi(GsiError),
    #[error("a device with {queues} queues needs more MSI-X vectors than a u16 counts")]
    TooManyQueues { queues: usize },
}

/// A segment's index as its number: the segments are made from a u16 count
/// (`--platform num_pci_segments`).
fn segment_number(index: usize) -> u16 {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "there are at most num_pci_segments (a u16) segments, so every index fits"
    )]
    let number = index as u16;
    number
}

/// The host memory behind a device's shared memory BAR.
pub struct ShmBacking {
    pub size: u64,
    pub host_addr: u64,
    /// Keeps the mapping alive for as long as the guest can see it.
    pub owner: Box<dyn Send + Sync>,
}

/// What the transport needs to place and move functions.
struct Placer {
    vm: Arc<VmFd>,
    mmio: Arc<Bus>,
    space: Arc<Mutex<AddressSpace>>,
}

/// One function on a bus and what is registered for it.
struct Placed {
    id: String,
    /// The segment whose windows its BARs must stay in.
    segment: u16,
    dev: Arc<Mutex<VirtioPciDevice>>,
    bar0: u64,
    bar0_area: Area,
    /// BAR 2: the memory slot and the BAR's (power-of-two) size and area.
    shm: Option<(MemorySlot, u64, Area)>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Placed {
    fn ioevents(&self, vm: &VmFd, bar0: u64, register: bool) -> Result<(), kvm_ioctls::Error> {
        let dev = lock(&self.dev);
        for (evt, offset, _queue) in dev.queue_notifiers() {
            let addr = IoEventAddress::Mmio(bar0 + offset);
            if register {
                vm.register_ioevent(evt, &addr, NoDatamatch)?;
            } else {
                vm.unregister_ioevent(evt, &addr, NoDatamatch)?;
            }
        }
        Ok(())
    }

    /// After a configuration write: with decoding on, wherever the guest
    /// has put a BAR is where the VMM must serve it. A move the VMM cannot
    /// follow (outside the windows, over another device) is logged and the
    /// BAR keeps being served where it was.
    fn follow_bars(&mut self, placer: &Placer) {
        let (bar0, shm, enabled) = {
            let d = lock(&self.dev);
            (
                d.bar_address(0),
                d.bar_address(usize::from(SHM_BAR)),
                d.memory_enabled(),
            )
        };
        if !enabled {
            return;
        }
        if let Some(to) = bar0.filter(|&a| a != self.bar0) {
            if let Err(e) = self.move_bar0(placer, to) {
                virtio_devices::warn_limited!(
                    "{}: BAR 0 moved to {to:#x}, not followed: {e}",
                    self.id
                );
            }
        }
        let current = self.shm.as_ref().map(|(slot, _, _)| slot.guest_addr());
        if let Some(to) = shm.filter(|&a| Some(a) != current) {
            if let Err(e) = self.move_shm(placer, to) {
                virtio_devices::warn_limited!(
                    "{}: BAR 2 moved to {to:#x}, not followed: {e}",
                    self.id
                );
            }
        }
    }

    fn move_bar0(&mut self, placer: &Placer, to: u64) -> Result<(), VirtioPciSetupError> {
        let from = self.bar0;
        let area = lock(&placer.space).claim_pci(self.segment, to, BAR0_SIZE)?;
        let handler = placer.mmio.remove(from);
        let handler = handler.unwrap_or_else(|| Arc::new(Mutex::new(Bar0(self.dev.clone()))) as _);
        if let Err(e) = placer.mmio.insert(handler.clone(), to, BAR0_SIZE) {
            let _ = placer.mmio.insert(handler, from, BAR0_SIZE);
            lock(&placer.space).free(area, to, BAR0_SIZE);
            return Err(VirtioPciSetupError::Bus(e.to_string()));
        }
        lock(&placer.space).free(self.bar0_area, from, BAR0_SIZE);
        let moved = self
            .ioevents(&placer.vm, from, false)
            .and_then(|()| self.ioevents(&placer.vm, to, true));
        self.bar0 = to;
        self.bar0_area = area;
        virtio_devices::info_limited!("{}: BAR 0 moved {from:#x} -> {to:#x}", self.id);
        // Without its ioeventfds a queue notify becomes an MMIO exit the
        // transport still serves (slower, not lost).
        moved.map_err(VirtioPciSetupError::Kvm)
    }

    fn move_shm(&mut self, placer: &Placer, to: u64) -> Result<(), VirtioPciSetupError> {
        let Some((slot, bar_size, old_area)) = self.shm.as_mut() else {
            return Ok(());
        };
        let from = slot.guest_addr();
        let area = lock(&placer.space).claim_pci(self.segment, to, *bar_size)?;
        if let Err(e) = slot.move_to(to) {
            lock(&placer.space).free(area, to, *bar_size);
            return Err(e.into());
        }
        lock(&placer.space).free(*old_area, from, *bar_size);
        *old_area = area;
        lock(&self.dev).set_shm_base(to);
        virtio_devices::info_limited!("{}: BAR 2 moved {from:#x} -> {to:#x}", self.id);
        Ok(())
    }

    /// Takes everything registered for the function away.
    fn unplug(&mut self, placer: &Placer) {
        if let Err(e) = self.ioevents(&placer.vm, self.bar0, false) {
            tracing::warn!(device = %self.id, "{}: unregistering its ioeventfds: {e}", self.id);
        }
        placer.mmio.remove(self.bar0);
        let mut space = lock(&placer.space);
        space.free(self.bar0_area, self.bar0, BAR0_SIZE);
        if let Some(shm) = self.shm.take() {
            release_shm(&mut space, shm);
        }
    }
}

/// Unregisters a shared memory BAR's slot, then gives its range back (KVM
/// lets go of the memory before its owner unmaps it).
fn release_shm(space: &mut AddressSpace, (slot, bar_size, area): (MemorySlot, u64, Area)) {
    let addr = slot.guest_addr();
    drop(slot);
    space.free(area, addr, bar_size);
}

struct ConfigSpace {
    placed: Arc<Mutex<Placed>>,
    placer: Arc<Placer>,
}

impl PciFunction for ConfigSpace {
    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        let dev = lock(&self.placed).dev.clone();
        lock(&dev).read_config(offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        let mut placed = lock(&self.placed);
        let moved = lock(&placed.dev).write_config(offset, data);
        placed.follow_bars(&self.placer);
        moved
    }
}

struct Bar0(Arc<Mutex<VirtioPciDevice>>);

impl BusDevice for Bar0 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        lock(&self.0).read_bar0(offset, data);
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        lock(&self.0).write_bar0(offset, data);
    }
}

/// One PCI segment: its bus 0 and the functions placed on it, by slot.
struct Segment {
    root: Arc<Mutex<PciRoot>>,
    functions: BTreeMap<u8, Arc<Mutex<Placed>>>,
}

pub struct PciDeviceManager {
    /// Segment 0 first; as many as the address space has windows for.
    segments: Vec<Segment>,
    router: Arc<GsiRouter>,
    placer: Arc<Placer>,
    slots: Arc<Mutex<SlotNumbers>>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    activator: Arc<dyn Activator>,
}

impl PciDeviceManager {
    /// A bus 0 for each segment `space` has windows for, reached through
    /// its ECAM range, and segment 0's through ports 0xCF8/0xCFC too.
    pub fn new(
        vm: &Arc<VmFd>,
        pio: &Bus,
        mmio: &Arc<Bus>,
        mem: &GuestMemoryAtomic<GuestMemoryMmap>,
        space: Arc<Mutex<AddressSpace>>,
        slots: Arc<Mutex<SlotNumbers>>,
        activator: Arc<dyn Activator>,
    ) -> Result<Self, VirtioPciSetupError> {
        let router = GsiRouter::new(vm.clone()).map_err(VirtioPciSetupError::Gsi)?;
        let count = lock(&space).pci_windows().len().max(1);
        let bus_err = |e: crate::bus::BusError| VirtioPciSetupError::Bus(e.to_string());
        let mut segments = Vec::with_capacity(count);
        for segment in (0..count).map(segment_number) {
            let root = Arc::new(Mutex::new(PciRoot::new()));
            let ecam = super::pci_root::PciEcam::new(root.clone());
            mmio.insert(
                Arc::new(Mutex::new(ecam)),
                pci_ecam_start(segment),
                PCI_ECAM_SIZE,
            )
            .map_err(bus_err)?;
            segments.push(Segment {
                root,
                functions: BTreeMap::new(),
            });
        }
        // Type 1 configuration cycles reach segment 0 only, as on real
        // hardware.
        let io = super::pci_root::PciConfigIo::new(segments[0].root.clone());
        pio.insert(
            Arc::new(Mutex::new(io)),
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_SIZE,
        )
        .map_err(bus_err)?;
        Ok(PciDeviceManager {
            segments,
            router,
            placer: Arc::new(Placer {
                vm: vm.clone(),
                mmio: mmio.clone(),
                space,
            }),
            slots,
            mem: mem.clone(),
            activator,
        })
    }

    /// How many segments the VM has.
    pub fn segment_count(&self) -> u16 {
        segment_number(self.segments.len())
    }

    /// Puts `device` (named `id`) in a free slot of `segment`, its BARs in
    /// that segment's windows, its shared memory (if any) in BAR 2, and
    /// returns where it went.
    pub fn add(
        &mut self,
        id: &str,
        segment: u16,
        mut device: Box<dyn VirtioDevice>,
        shm: Option<ShmBacking>,
    ) -> Result<PciAddress, VirtioPciSetupError> {
        if usize::from(segment) >= self.segments.len() {
            return Err(VirtioPciSetupError::NoSegment {
                segment,
                count: self.segment_count(),
            });
        }
        let (mmio32, mmio64) = (Area::PciMmio32(segment), Area::PciMmio64(segment));
        let placer = &self.placer;
        let bar0 = lock(&placer.space).allocate(mmio32, BAR0_SIZE, BAR0_SIZE)?;
        let mut placed_shm = None;
        if let Some(b) = shm {
            // A BAR is a power of two aligned to its size; at least 2 MiB so
            // the guest can map it with PMD pages.
            let bar_size = b.size.next_power_of_two().max(DEVICE_MEMORY_ALIGN);
            let allocated = lock(&placer.space).allocate(mmio64, bar_size, bar_size);
            let slot = allocated
                .map_err(VirtioPciSetupError::from)
                .and_then(|addr| {
                    // SAFETY: `owner` keeps the mapping alive as long as the slot,
                    // which the caller's contract for ShmBacking promises.
                    unsafe {
                        MemorySlot::new(&placer.vm, &self.slots, addr, b.size, b.host_addr, b.owner)
                    }
                    .map_err(|e| {
                        lock(&placer.space).free(mmio64, addr, bar_size);
                        e.into()
                    })
                });
            match slot {
                Ok(slot) => placed_shm = Some((slot, bar_size, mmio64)),
                Err(e) => {
                    lock(&placer.space).free(mmio32, bar0, BAR0_SIZE);
                    return Err(e);
                }
            }
        }
        let shm_bar = placed_shm
            .as_ref()
            .map(|(slot, size, _)| (slot.guest_addr(), *size));
        if let Some((addr, _)) = shm_bar {
            device.set_shm_base(addr);
        }
        // One MSI-X vector per queue and one for configuration changes.
        let queues = device.queue_max_sizes().len();
        let vectors =
            u16::try_from(queues + 1).map_err(|_| VirtioPciSetupError::TooManyQueues { queues })?;
        let built = IrqfdMsi::new(self.router.clone(), vectors)
            .map_err(VirtioPciSetupError::Gsi)
            .and_then(|msi| {
                Ok(VirtioPciDevice::new(
                    device,
                    self.mem.clone(),
                    bar0,
                    shm_bar,
                    vectors,
                    Arc::new(msi),
                )?)
            });
        let placed = Arc::new(Mutex::new(Placed {
            id: id.to_string(),
            segment,
            dev: match built {
                Ok(mut dev) => {
                    dev.set_activator(self.activator.clone());
                    Arc::new(Mutex::new(dev))
                }
                Err(e) => {
                    let mut space = lock(&placer.space);
                    space.free(mmio32, bar0, BAR0_SIZE);
                    if let Some(shm) = placed_shm {
                        release_shm(&mut space, shm);
                    }
                    return Err(e);
                }
            },
            bar0,
            bar0_area: mmio32,
            shm: placed_shm,
        }));
        match self.plug(segment, &placed) {
            Ok(slot) => {
                self.segments[usize::from(segment)]
                    .functions
                    .insert(slot, placed);
                Ok(PciAddress { segment, slot })
            }
            Err(e) => {
                lock(&placed).unplug(placer);
                Err(e)
            }
        }
    }

    /// Registers a built function: ioeventfds, bus range, a slot on
    /// `segment`'s bus.
    fn plug(&self, segment: u16, placed: &Arc<Mutex<Placed>>) -> Result<u8, VirtioPciSetupError> {
        let p = lock(placed);
        p.ioevents(&self.placer.vm, p.bar0, true)
            .map_err(VirtioPciSetupError::Kvm)?;
        self.placer
            .mmio
            .insert(Arc::new(Mutex::new(Bar0(p.dev.clone()))), p.bar0, BAR0_SIZE)
            .map_err(|e| VirtioPciSetupError::Bus(e.to_string()))?;
        drop(p);
        let config = ConfigSpace {
            placed: placed.clone(),
            placer: self.placer.clone(),
        };
        lock(&self.segments[usize::from(segment)].root)
            .add(Arc::new(Mutex::new(config)))
            .ok_or(VirtioPciSetupError::BusFull(segment))
    }

    /// Where the function named `id` is.
    pub fn address_of(&self, id: &str) -> Option<PciAddress> {
        self.segments.iter().enumerate().find_map(|(segment, s)| {
            s.functions
                .iter()
                .find(|(_, p)| lock(p).id == id)
                .map(|(slot, _)| PciAddress {
                    segment: segment_number(segment),
                    slot: *slot,
                })
        })
    }

    /// Every function's id and address, segment by segment, slot by slot.
    pub fn addresses(&self) -> Vec<(String, PciAddress)> {
        let mut all = Vec::new();
        for (segment, s) in self.segments.iter().enumerate() {
            for (slot, p) in &s.functions {
                let at = PciAddress {
                    segment: segment_number(segment),
                    slot: *slot,
                };
                all.push((lock(p).id.clone(), at));
            }
        }
        all
    }

    /// Takes the function at `at` off its bus; returns its id. The device
    /// itself goes when the last reference (a vCPU mid-access) drops.
    pub fn remove(&mut self, at: PciAddress) -> Option<String> {
        let segment = self.segments.get_mut(usize::from(at.segment))?;
        let placed = segment.functions.remove(&at.slot)?;
        lock(&segment.root).remove(at.slot);
        let mut p = lock(&placed);
        p.unplug(&self.placer);
        Some(p.id.clone())
    }

    /// Each segment's host bridge: its bus, ECAM range, windows and
    /// hot-plug slots.
    pub fn append_aml(&self, sink: &mut Vec<u8>) {
        let space = lock(&self.placer.space);
        for (segment, windows) in space.pci_windows().iter().enumerate() {
            super::pci_segment::host_bridge_aml(segment_number(segment), windows, sink);
        }
    }
}

#[cfg(test)]
mod tests {
    use kvm_ioctls::Kvm;
    use virtio_devices::pmem::{Pmem, PmemBacking};
    use virtio_devices::transport::pci::device::DEVICE_CFG_OFFSET;
    use vm_memory::GuestAddress;

    use super::*;
    use crate::arch::x86_64::layout;

    const RAM: u64 = 1 << 20;

    struct Rig {
        vm: Arc<VmFd>,
        pio: Bus,
        mmio: Arc<Bus>,
        space: Arc<Mutex<AddressSpace>>,
        slots: Arc<Mutex<SlotNumbers>>,
        pci: PciDeviceManager,
    }

    fn rig() -> Rig {
        rig_with(1)
    }

    fn rig_with(segments: u16) -> Rig {
        let kvm = Kvm::new().expect("/dev/kvm");
        let vm = Arc::new(kvm.create_vm().unwrap());
        vm.create_irq_chip().unwrap();
        let mem =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), narrow::usize_of(RAM))]).unwrap();
        let (pio, mmio) = (Bus::new(), Arc::new(Bus::new()));
        let space = Arc::new(Mutex::new(AddressSpace::new(RAM, 0, segments)));
        let slots = SlotNumbers::new(
            u32::try_from(kvm.check_extension_int(kvm_ioctls::Cap::NrMemslots)).unwrap(),
        );
        let pci = PciDeviceManager::new(
            &vm,
            &pio,
            &mmio,
            &GuestMemoryAtomic::new(mem),
            space.clone(),
            slots.clone(),
            Arc::new(virtio_devices::transport::common::Inline),
        )
        .unwrap();
        Rig {
            vm,
            pio,
            mmio,
            space,
            slots,
            pci,
        }
    }

    fn add_pmem(rig: &mut Rig, id: &str) -> PciAddress {
        add_pmem_on(rig, id, 0).unwrap()
    }

    fn add_pmem_on(
        rig: &mut Rig,
        id: &str,
        segment: u16,
    ) -> Result<PciAddress, VirtioPciSetupError> {
        let backing = PmemBacking::open(&std::env::temp_dir(), Some(4 << 20), false).unwrap();
        let device = Pmem::new(id.into(), &backing, 0).unwrap();
        let shm = ShmBacking {
            size: backing.size(),
            host_addr: backing.host_addr(),
            owner: Box::new(backing),
        };
        rig.pci.add(id, segment, Box::new(device), Some(shm))
    }

    /// The ECAM address of `at`'s configuration space.
    fn ecam(at: PciAddress) -> u64 {
        pci_ecam_start(at.segment) + (u64::from(at.slot) << 15)
    }

    /// A config write through ECAM, as the guest's would arrive.
    fn cfg_write(rig: &Rig, slot: PciAddress, reg: u64, value: u32) {
        assert!(rig.mmio.write(ecam(slot) + reg, &value.to_le_bytes()));
    }

    fn move_bars(rig: &Rig, slot: PciAddress, bar0: u64, bar2: u64) {
        cfg_write(rig, slot, 0x04, 0); // decoding off, as Linux moves 64-bit BARs
        cfg_write(rig, slot, 0x10, narrow::low_u32(bar0));
        cfg_write(rig, slot, 0x14, (bar0 >> 32) as u32);
        cfg_write(rig, slot, 0x18, narrow::low_u32(bar2));
        cfg_write(rig, slot, 0x1c, (bar2 >> 32) as u32);
        cfg_write(rig, slot, 0x04, 0x6); // memory + bus master on
    }

    /// The pmem config's `start`, read through BAR 0 where the bus has it.
    fn pmem_start(rig: &Rig, bar0: u64) -> Option<u64> {
        let mut b = [0u8; 4];
        let mut start = 0u64;
        for half in 0..2 {
            if !rig.mmio.read(bar0 + DEVICE_CFG_OFFSET + half * 4, &mut b) {
                return None;
            }
            start |= u64::from(u32::from_le_bytes(b)) << (32 * half);
        }
        Some(start)
    }

    /// A 4 MiB memory slot at `addr`, which KVM refuses where one exists.
    fn probe_slot(rig: &Rig, addr: u64) -> Result<MemorySlot, SlotError> {
        let host = PmemBacking::open(&std::env::temp_dir(), Some(4 << 20), false).unwrap();
        let host_addr = host.host_addr();
        // SAFETY: the mapping is owned by the slot.
        unsafe {
            MemorySlot::new(
                &rig.vm,
                &rig.slots,
                addr,
                4 << 20,
                host_addr,
                Box::new(host),
            )
        }
    }

    #[test]
    fn moved_bars_take_bus_range_ioeventfds_and_memory_slot_along_and_removal_frees_all() {
        let mut rig = rig();
        let shm_start = layout::device_memory_start(RAM, 0);
        let a = add_pmem(&mut rig, "pmem-a");
        let b = add_pmem(&mut rig, "pmem-b");
        assert_eq!((a.slot, b.slot), (1, 2));
        let a_bar0 = layout::PCI_MMIO32_START;
        let b_bar0 = a_bar0 + BAR0_SIZE;
        assert_eq!(pmem_start(&rig, a_bar0), Some(shm_start));
        assert_eq!(pmem_start(&rig, b_bar0), Some(shm_start + (4 << 20)));

        // The guest moves device a: everything follows.
        let (new_bar0, new_bar2) = (a_bar0 + 0x10_0000, shm_start + (64 << 20));
        move_bars(&rig, a, new_bar0, new_bar2);
        assert_eq!(
            pmem_start(&rig, a_bar0),
            None,
            "nothing left at the old BAR 0"
        );
        assert_eq!(
            pmem_start(&rig, new_bar0),
            Some(new_bar2),
            "config start follows BAR 2"
        );
        // The ioeventfds moved: registering one at the old notify address
        // works again, at the new one KVM says it is taken.
        let probe = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        let notify = virtio_devices::transport::pci::device::NOTIFY_OFFSET;
        let at = |addr| IoEventAddress::Mmio(addr + notify);
        rig.vm
            .register_ioevent(&probe, &at(a_bar0), NoDatamatch)
            .unwrap();
        rig.vm
            .unregister_ioevent(&probe, &at(a_bar0), NoDatamatch)
            .unwrap();
        assert!(rig
            .vm
            .register_ioevent(&probe, &at(new_bar0), NoDatamatch)
            .is_err());
        // KVM has the memory at the new place only.
        assert!(probe_slot(&rig, shm_start).is_ok());
        assert!(probe_slot(&rig, new_bar2).is_err());
        // The old guest range of BAR 2 is free in the allocator too.
        let free_again = lock(&rig.space)
            .allocate(Area::PciMmio64(0), 4 << 20, 4 << 20)
            .unwrap();
        assert_eq!(free_again, shm_start);
        lock(&rig.space).free(Area::PciMmio64(0), free_again, 4 << 20);

        // A move onto device b's BAR 0 is refused: a stays where it is.
        move_bars(&rig, a, b_bar0, new_bar2);
        assert_eq!(pmem_start(&rig, new_bar0), Some(new_bar2));
        assert_eq!(
            pmem_start(&rig, b_bar0),
            Some(shm_start + (4 << 20)),
            "b untouched"
        );
        // ...and so is a BAR outside the windows.
        move_bars(&rig, a, new_bar0, 0x1000_0000);
        assert_eq!(pmem_start(&rig, new_bar0), Some(new_bar2));

        // Removal: the bus range, the addresses and the KVM slot all go.
        assert_eq!(rig.pci.address_of("pmem-a"), Some(a));
        assert_eq!(rig.pci.remove(a).as_deref(), Some("pmem-a"));
        assert_eq!(rig.pci.address_of("pmem-a"), None);
        assert_eq!(pmem_start(&rig, new_bar0), None);
        assert!(rig
            .vm
            .register_ioevent(&probe, &at(new_bar0), NoDatamatch)
            .is_ok());
        let mut cfg = [0u8; 4];
        rig.mmio.read(ecam(a), &mut cfg);
        assert_eq!(cfg, [0xff; 4], "slot {a} is empty");
        assert_eq!(
            lock(&rig.space).claim_pci(0, new_bar0, BAR0_SIZE).ok(),
            Some(Area::PciMmio32(0))
        );
        let again = probe_slot(&rig, new_bar2);
        assert!(
            again.is_ok(),
            "KVM still has a slot at {new_bar2:#x}: {:?}",
            again.err()
        );
        // The freed slot number is used by the next device.
        assert_eq!(add_pmem(&mut rig, "pmem-c"), a);
    }

    /// Reads the 32-bit config register `reg` of (bus 0, `slot`) through
    /// the legacy ports.
    fn cf8_read(rig: &Rig, slot: u8, reg: u32) -> u32 {
        let address = (1u32 << 31) | u32::from(slot) << 11 | reg;
        assert!(rig.pio.write(PCI_CONFIG_IO_PORT, &address.to_le_bytes()));
        let mut v = [0u8; 4];
        assert!(rig.pio.read(PCI_CONFIG_IO_PORT + 4, &mut v));
        u32::from_le_bytes(v)
    }

    #[test]
    fn each_segment_has_its_own_bus_ecam_and_windows() {
        let mut rig = rig_with(2);
        let windows = lock(&rig.space).pci_windows().to_vec();
        let on0 = add_pmem_on(&mut rig, "zero", 0).unwrap();
        let on1 = add_pmem_on(&mut rig, "one", 1).unwrap();
        let again1 = add_pmem_on(&mut rig, "one-b", 1).unwrap();
        assert_eq!(on0.to_string(), "0000:00:01.0");
        assert_eq!(on1.to_string(), "0001:00:01.0", "slots are per segment");
        assert_eq!(again1.to_string(), "0001:00:02.0");
        assert!(matches!(
            add_pmem_on(&mut rig, "nowhere", 2),
            Err(VirtioPciSetupError::NoSegment {
                segment: 2,
                count: 2
            })
        ));
        // Segment 1's BARs are in segment 1's windows: BAR 0 at the start
        // of its 32-bit window, the shared memory at the start of its
        // 64-bit one.
        assert_eq!(
            pmem_start(&rig, windows[1].mmio32.0),
            Some(windows[1].mmio64.0)
        );
        assert_eq!(
            pmem_start(&rig, windows[0].mmio32.0),
            Some(windows[0].mmio64.0)
        );
        // Each segment's ECAM reaches its own functions: vendor 0x1af4,
        // device 0x105b (pmem) in slot 1 of both, the bridge in slot 0.
        let read = |addr: u64| {
            let mut v = [0u8; 4];
            assert!(rig.mmio.read(addr, &mut v));
            u32::from_le_bytes(v)
        };
        assert_eq!(read(ecam(on0)), 0x105b_1af4);
        assert_eq!(read(ecam(on1)), 0x105b_1af4);
        assert_eq!(
            read(pci_ecam_start(1)),
            0x0d57_8086,
            "segment 1's host bridge"
        );
        // The legacy ports reach segment 0 only: its slot 2 is empty while
        // segment 1's is taken.
        assert_eq!(cf8_read(&rig, 1, 0), 0x105b_1af4);
        assert_eq!(cf8_read(&rig, 2, 0), u32::MAX);
        assert_eq!(read(ecam(again1)), 0x105b_1af4);
        // The guest cannot move a segment 1 BAR into segment 0's window.
        let into0 = windows[0].mmio32.0 + 0x10_0000;
        move_bars(&rig, on1, into0, windows[1].mmio64.0);
        assert_eq!(pmem_start(&rig, into0), None, "not followed");
        assert_eq!(
            pmem_start(&rig, windows[1].mmio32.0),
            Some(windows[1].mmio64.0)
        );
        // Within its own windows it follows.
        let (bar0, bar2) = (
            windows[1].mmio32.0 + 0x10_0000,
            windows[1].mmio64.0 + (1 << 30),
        );
        move_bars(&rig, on1, bar0, bar2);
        assert_eq!(pmem_start(&rig, bar0), Some(bar2));
        // Addresses by id, and removal by segment and slot.
        assert_eq!(rig.pci.address_of("one"), Some(on1));
        assert_eq!(
            rig.pci.addresses(),
            vec![
                ("zero".to_string(), on0),
                ("one".to_string(), on1),
                ("one-b".to_string(), again1)
            ]
        );
        let wrong = PciAddress {
            segment: 1,
            slot: 5,
        };
        assert_eq!(rig.pci.remove(wrong), None);
        assert_eq!(rig.pci.remove(on1).as_deref(), Some("one"));
        assert_eq!(read(ecam(on1)), u32::MAX);
        assert_eq!(read(ecam(on0)), 0x105b_1af4, "segment 0 untouched");
        assert_eq!(
            add_pmem_on(&mut rig, "one-c", 1).unwrap(),
            on1,
            "slot reused"
        );
        // Both bridges are in the DSDT.
        let mut aml = Vec::new();
        rig.pci.append_aml(&mut aml);
        assert!(aml.windows(8).any(|w| w == b"_SB_PCI0"));
        assert!(aml.windows(8).any(|w| w == b"_SB_PC01"));
    }
}
