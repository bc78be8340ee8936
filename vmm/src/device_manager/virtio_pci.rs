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
use super::hotplug_controller::HOTPLUG_SLOTS;
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
    /// A restored BAR could not be served where the guest had put it.
    #[error("BAR {bar} at {addr:#x}: {source}")]
    RestoredBar {
        bar: u8,
        addr: u64,
        source: Box<VirtioPciSetupError>,
    },
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

/// Where a function's BARs are served: BAR 0 and the shared memory BAR
/// (the configuration holds where the guest put them; the two differ
/// while the guest has decoding off).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedBars {
    pub bar0: u64,
    pub shm: Option<u64>,
}

/// One placed function as [`PciDeviceManager::functions`] lists it.
pub struct PlacedFunction {
    pub id: String,
    pub at: PciAddress,
    pub transport: Arc<Mutex<VirtioPciDevice>>,
    pub bars: ServedBars,
}

/// A function that goes from one slot of its segment's bus to another
/// (segment by index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMove {
    pub segment: usize,
    pub from: u8,
    pub to: u8,
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
        for (bar, to, e) in self.place_bars(placer) {
            virtio_devices::warn_limited!(
                "{}: BAR {bar} moved to {to:#x}, not followed: {e}",
                self.id
            );
        }
    }

    /// Serves each BAR where the function's configuration (decoding on)
    /// puts it; returns the moves that could not be made (BAR, address,
    /// why), each BAR then staying where it was.
    fn place_bars(&mut self, placer: &Placer) -> Vec<(u8, u64, VirtioPciSetupError)> {
        let (bar0, shm, enabled) = {
            let d = lock(&self.dev);
            (
                d.bar_address(0),
                d.bar_address(usize::from(SHM_BAR)),
                d.memory_enabled(),
            )
        };
        let mut failed = Vec::new();
        if !enabled {
            return failed;
        }
        if let Some(to) = bar0.filter(|&a| a != self.bar0) {
            if let Err(e) = self.move_bar0(placer, to) {
                failed.push((0, to, e));
            }
        }
        let current = self.shm.as_ref().map(|(slot, _, _)| slot.guest_addr());
        if let Some(to) = shm.filter(|&a| Some(a) != current) {
            if let Err(e) = self.move_shm(placer, to) {
                failed.push((SHM_BAR, to, e));
            }
        }
        failed
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

    /// Before a restore serves the BARs where the saved VM served them:
    /// takes out of the way (bus range, ioeventfds, addresses, the memory
    /// slot) each BAR served elsewhere now, so functions can swap places;
    /// returns where each of those goes.
    fn park_moving(
        &mut self,
        placer: &Placer,
        bar0: u64,
        shm: Option<u64>,
    ) -> Result<(Option<u64>, Option<u64>), VirtioPciSetupError> {
        let bar0 = Some(bar0).filter(|&a| a != self.bar0);
        if bar0.is_some() {
            self.ioevents(&placer.vm, self.bar0, false)
                .map_err(VirtioPciSetupError::Kvm)?;
            placer.mmio.remove(self.bar0);
            lock(&placer.space).free(self.bar0_area, self.bar0, BAR0_SIZE);
        }
        let mut shm_to = None;
        if let Some((slot, bar_size, area)) = self.shm.as_mut() {
            let from = slot.guest_addr();
            shm_to = shm.filter(|&a| a != from);
            if shm_to.is_some() {
                slot.park()?;
                lock(&placer.space).free(*area, from, *bar_size);
            }
        }
        Ok((bar0, shm_to))
    }

    /// Puts the BARs [`Placed::park_moving`] took out where they go.
    fn unpark(
        &mut self,
        placer: &Placer,
        bar0: Option<u64>,
        shm: Option<u64>,
    ) -> Result<(), VirtioPciSetupError> {
        let restored = |bar, addr, e: VirtioPciSetupError| VirtioPciSetupError::RestoredBar {
            bar,
            addr,
            source: Box::new(e),
        };
        if let Some(to) = bar0 {
            let area = lock(&placer.space)
                .claim_pci(self.segment, to, BAR0_SIZE)
                .map_err(|e| restored(0, to, e.into()))?;
            let handler = Arc::new(Mutex::new(Bar0(self.dev.clone())));
            if let Err(e) = placer.mmio.insert(handler, to, BAR0_SIZE) {
                lock(&placer.space).free(area, to, BAR0_SIZE);
                return Err(restored(0, to, VirtioPciSetupError::Bus(e.to_string())));
            }
            self.bar0 = to;
            self.bar0_area = area;
            self.ioevents(&placer.vm, to, true)
                .map_err(|e| restored(0, to, VirtioPciSetupError::Kvm(e)))?;
        }
        if let (Some(to), Some((slot, bar_size, area))) = (shm, self.shm.as_mut()) {
            let claimed = lock(&placer.space)
                .claim_pci(self.segment, to, *bar_size)
                .map_err(|e| restored(SHM_BAR, to, e.into()))?;
            if let Err(e) = slot.unpark_at(to) {
                lock(&placer.space).free(claimed, to, *bar_size);
                return Err(restored(SHM_BAR, to, e.into()));
            }
            *area = claimed;
            lock(&self.dev).set_shm_base(to);
        }
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

/// The MMIO bus holds each segment's ECAM, whose root holds the functions'
/// config spaces, which hold the placer, which holds the MMIO bus: a cycle
/// that kept every device (its threads, image locks, sockets) alive after
/// its VM went. Taking the functions and the ECAMs off the bus breaks it.
impl Drop for PciDeviceManager {
    fn drop(&mut self) {
        for (i, s) in self.segments.iter_mut().enumerate() {
            for (slot, placed) in std::mem::take(&mut s.functions) {
                lock(&s.root).remove(slot);
                lock(&placed).unplug(&self.placer);
            }
            self.placer.mmio.remove(pci_ecam_start(segment_number(i)));
        }
    }
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

    /// Every function: id, address, transport and where its BARs are
    /// served, segment by segment, slot by slot.
    pub fn functions(&self) -> Vec<PlacedFunction> {
        let mut all = Vec::new();
        for (segment, s) in self.segments.iter().enumerate() {
            for (slot, p) in &s.functions {
                let p = lock(p);
                all.push(PlacedFunction {
                    id: p.id.clone(),
                    at: PciAddress {
                        segment: segment_number(segment),
                        slot: *slot,
                    },
                    transport: p.dev.clone(),
                    bars: ServedBars {
                        bar0: p.bar0,
                        shm: p.shm.as_ref().map(|(slot, _, _)| slot.guest_addr()),
                    },
                });
            }
        }
        all
    }

    /// Where each function goes for a restore, checked: the same
    /// segment, a slot of the bus, no two functions in one slot. Returns
    /// the moves; Err is (id, why).
    pub fn plan_reslot(
        &self,
        wanted: &BTreeMap<String, PciAddress>,
    ) -> Result<Vec<SlotMove>, (String, String)> {
        let mut moves = Vec::new();
        for (index, s) in self.segments.iter().enumerate() {
            let mut taken = std::collections::BTreeSet::new();
            for (slot, p) in &s.functions {
                let id = lock(p).id.clone();
                let to = match wanted.get(&id) {
                    Some(at) if usize::from(at.segment) != index => {
                        return Err((
                            id,
                            format!(
                                "saved on PCI segment {}, this VM has it on {index}",
                                at.segment
                            ),
                        ))
                    }
                    Some(at) => at.slot,
                    None => *slot,
                };
                if !HOTPLUG_SLOTS.contains(&to) || !taken.insert(to) {
                    return Err((id, format!("slot {to} is not a free device slot")));
                }
                if to != *slot {
                    moves.push(SlotMove {
                        segment: index,
                        from: *slot,
                        to,
                    });
                }
            }
        }
        Ok(moves)
    }

    /// Moves functions between slots as [`Self::plan_reslot`] planned (no
    /// guest has run yet: only the configuration cycles' target changes).
    pub fn apply_reslot(&mut self, moves: &[SlotMove]) {
        let mut lifted = Vec::new();
        for &SlotMove {
            segment: index,
            from,
            to,
        } in moves
        {
            let s = &mut self.segments[index];
            let function = lock(&s.root).remove(from);
            if let (Some(function), Some(placed)) = (function, s.functions.remove(&from)) {
                lifted.push((index, to, function, placed));
            }
        }
        for (index, to, function, placed) in lifted {
            let s = &mut self.segments[index];
            let added = lock(&s.root).add_at(to, function);
            debug_assert!(added, "plan_reslot checked slot {to} is free");
            s.functions.insert(to, placed);
        }
    }

    /// Whether [`Self::place_all_restored`] can put every function's BARs
    /// where `wanted` says, changing nothing: each BAR aligned to its size,
    /// in its segment's window, and apart from every other. Err is (id, why).
    pub fn check_served(
        &self,
        wanted: &BTreeMap<String, ServedBars>,
    ) -> Result<(), (String, String)> {
        let windows = lock(&self.placer.space).pci_windows().to_vec();
        let mut ranges: Vec<(u64, u64, String)> = Vec::new();
        for (index, s) in self.segments.iter().enumerate() {
            let Some(w) = windows.get(index) else {
                continue;
            };
            for p in s.functions.values() {
                let p = lock(p);
                let Some(want) = wanted.get(&p.id) else {
                    continue;
                };
                let mut bars = vec![(0u8, want.bar0, BAR0_SIZE, w.mmio32)];
                if let (Some(addr), Some((_, size, _))) = (want.shm, p.shm.as_ref()) {
                    bars.push((SHM_BAR, addr, *size, w.mmio64));
                }
                for (bar, addr, size, (start, len)) in bars {
                    let inside = addr.is_multiple_of(size)
                        && addr >= start
                        && addr.checked_add(size).is_some_and(|end| end <= start + len);
                    if !inside {
                        return Err((
                            p.id.clone(),
                            format!("BAR {bar} at {addr:#x}: not a {size:#x}-aligned place in PCI segment {index}'s window"),
                        ));
                    }
                    if let Some((_, _, other)) = ranges
                        .iter()
                        .find(|(a, s, _)| addr < a + s && *a < addr + size)
                    {
                        return Err((
                            p.id.clone(),
                            format!("BAR {bar} at {addr:#x} overlaps {other}'s"),
                        ));
                    }
                    ranges.push((addr, size, p.id.clone()));
                }
            }
        }
        Ok(())
    }

    /// Serves each function's BARs where `wanted` (by id: BAR 0, shared
    /// memory BAR) says the saved VM served them: bus range, ioeventfds,
    /// the shared memory's KVM slot and the device's idea of its base.
    /// Every BAR that moves is taken out of the way first, so functions can
    /// swap places. Err is (id, why); the manager is then part-placed (a
    /// failed restore drops the VM).
    pub fn place_all_restored(
        &self,
        wanted: &BTreeMap<String, ServedBars>,
    ) -> Result<(), (String, VirtioPciSetupError)> {
        let all: Vec<Arc<Mutex<Placed>>> = self
            .segments
            .iter()
            .flat_map(|s| s.functions.values().cloned())
            .collect();
        let mut moving = Vec::new();
        for p in all {
            let mut placed = lock(&p);
            let Some(want) = wanted.get(&placed.id) else {
                continue;
            };
            let to = placed
                .park_moving(&self.placer, want.bar0, want.shm)
                .map_err(|e| (placed.id.clone(), e))?;
            if to != (None, None) {
                drop(placed);
                moving.push((p, to));
            }
        }
        for (p, (bar0, shm)) in moving {
            let mut placed = lock(&p);
            placed
                .unpark(&self.placer, bar0, shm)
                .map_err(|e| (placed.id.clone(), e))?;
        }
        Ok(())
    }

    /// The MSI routes every function's vectors go through.
    #[cfg(test)]
    pub(crate) fn router(&self) -> &Arc<GsiRouter> {
        &self.router
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
#[path = "virtio_pci_tests.rs"]
mod tests;
