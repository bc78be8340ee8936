//! The device manager: the VM's virtio devices, built at boot from the
//! configuration, added and removed while the guest runs (ACPI PCI
//! hot-plug), with their guest addresses, KVM memory slots and bus places.
//! It owns the transports ([`virtio_pci`] on the PCI segments of
//! [`pci_segment`] and [`pci_root`], [`virtio_mmio`]), the guest-physical
//! space devices take ([`address_space`]), the MSI routes ([`gsi_routing`]),
//! the thread that activates devices ([`activator`]) and the ACPI PCI
//! hot-plug controller the guest sees ([`hotplug_controller`]).
//!
//! A hot-plugged device goes through:
//! `add_fs`/`add_pmem`/`add_disk`/`add_net` → [`PciDeviceManager::add`] (slot, BARs, memory slot,
//! ioeventfds) → [`PciHotplugController::announce_add`] + GED interrupt → the guest's
//! `acpiphp` scans the slot and binds the driver. A removal:
//! [`DeviceManager::request_removal`] → `PCID` bit + GED interrupt → the
//! guest unbinds and calls `_EJ0` → [`EjectRequests`] wakes the control
//! thread → [`DeviceManager::complete_ejects`] takes the device away (the
//! window's mappings and the daemon connection go with it).

pub mod activator;
pub mod address_space;
pub mod gsi_routing;
mod host_files;
pub mod hotplug_controller;
mod net_tap;
pub mod pci_root;
pub mod pci_segment;
pub mod state;
pub mod virtio_mmio;
pub mod virtio_pci;

use std::os::fd::OwnedFd;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use virtio_devices::vsock::SocketName;

use kvm_ioctls::{Cap, Kvm, VmFd};
use virtio_devices::net::TapError;
use virtio_devices::pmem::{Pmem, PmemBacking};
use virtio_devices::rng::Rng;
use virtio_devices::vhost_user_fs::memory_table::DaemonMemory;
use virtio_devices::vhost_user_fs::window::{DaxWindow, GuestPrefaulter, WindowObserver};
use virtio_devices::vhost_user_fs::{FsDeviceConfig, VhostUserFs};
use virtio_devices::{DeviceCounters, VirtioDevice};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryRegion};

use crate::arch::x86_64::layout;
use crate::bus::Bus;
use crate::bus::BusError;
use crate::config::{
    DiskConfig, FsConfig, MemoryConfig, NetConfig, PmemConfig, Transport, VmConfig, VsockConfig,
};
use crate::device_manager::activator::DeviceActivator;
use crate::device_manager::address_space::{
    AddressError, AddressSpace, Area, MemorySlot, SlotError, SlotNumbers,
};
use crate::device_manager::hotplug_controller::{EjectRequests, PciHotplugController};
use crate::device_manager::virtio_mmio::{MmioDeviceManager, VirtioMmioError};
use crate::device_manager::virtio_pci::{
    PciAddress, PciDeviceManager, ShmBacking, VirtioPciSetupError,
};
use crate::legacy::ged::{GedHandle, EVENT_PCI_HOTPLUG};
use crate::memory::{GuestMemoryMmap, GuestRegionMmap};

/// The files mapped in each fs device's DAX window, by device id, then by
/// (dev, ino), as a local migration's sender passes them.
pub type WindowFiles =
    std::collections::BTreeMap<String, std::collections::HashMap<(u64, u64), std::fs::File>>;

/// How long a restored fs device waits for its daemon's socket, trying
/// every 100 ms: Cloud Hypervisor's `CONNECT_TIMEOUT` for vhost-user.
pub const RESTORE_DAEMON_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// What failed in making, placing, hot-plugging or removing a device, or in
/// giving the devices new RAM.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    /// The thread the devices' activations run on could not start.
    #[error("device setup: the device activator thread: {0}")]
    Activator(#[source] std::io::Error),
    /// The PCI segments (config ports, ECAM ranges) could not be set up.
    #[error(transparent)]
    PciSegments(VirtioPciSetupError),
    /// The hot-plug controller could not be made or put on the I/O bus.
    #[error("device setup: the PCI hot-plug controller: {0}")]
    HotplugController(#[source] std::io::Error),
    #[error("device setup: {0}")]
    HotplugPorts(#[source] BusError),
    // A device's backend could not be opened; each names its own field.
    #[error(transparent)]
    Pmem(#[from] virtio_devices::pmem::PmemError),
    /// Device `id` could not copy the fd of its host file or socket.
    #[error("{id}: duplicating its host file's descriptor: {source}")]
    HostFd { id: String, source: std::io::Error },
    /// The pmem device `id` could not keep its own handle on its file.
    #[error("pmem {id}: duplicating the file's descriptor: {source}")]
    PmemFile { id: String, source: std::io::Error },
    #[error(transparent)]
    Rng(#[from] virtio_devices::rng::RngError),
    #[error(transparent)]
    Disk(#[from] virtio_devices::block::DiskError),
    #[error(transparent)]
    Vsock(#[from] virtio_devices::vsock::BackendError),
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error(transparent)]
    Fs(#[from] virtio_devices::vhost_user_fs::FsError),
    /// Device `id` found no place on virtio-PCI.
    #[error("{id}: {source}")]
    PciPlace {
        id: String,
        source: VirtioPciSetupError,
    },
    /// Device `id` found no place on virtio-MMIO.
    #[error("{id}: {source}")]
    MmioPlace { id: String, source: VirtioMmioError },
    /// No guest addresses for the shared memory of MMIO device `id`.
    #[error("{id}: {source}")]
    MmioShmAddress { id: String, source: AddressError },
    /// KVM refused the memory slot of MMIO device `id`'s shared memory.
    #[error("device setup: {id}: {source}")]
    MmioShmSlot { id: String, source: SlotError },
    /// KVM refused the memory slot of new RAM.
    #[error("device setup: RAM at {addr:#x}+{size:#x}: {source}")]
    RamSlot {
        addr: u64,
        size: u64,
        source: SlotError,
    },
    /// New RAM overlaps the guest memory there is.
    #[error("device setup: RAM at {addr:#x}+{size:#x}: {source}")]
    RamRegion {
        addr: u64,
        size: u64,
        source: vm_memory::GuestRegionCollectionError,
    },
    /// A daemon did not take new RAM into its memory table.
    #[error("device setup: RAM at {addr:#x}+{size:#x}: {source}")]
    RamDaemon {
        addr: u64,
        size: u64,
        source: virtio_devices::vhost_user_fs::FsError,
    },
    /// A hot-plug asked for virtio-MMIO, which has no hot-plug.
    #[error("hot-plug: {id}: hot-plug is over virtio-PCI only (transport=mmio has no hot-plug)")]
    HotplugOverMmio { id: String },
    /// A hot-plug reused the id of a device the guest has not ejected yet.
    #[error(
        "hot-plug: {id}: a device with this id is still at {at} (its removal waits for the guest to eject it)"
    )]
    IdStillPlaced { id: String, at: PciAddress },
    /// A removal named no hot-pluggable device.
    #[error(
        "hot-plug: {id}: not a hot-pluggable device (only virtio-PCI fs, pmem, disk, vsock and net devices can be removed from a running VM)"
    )]
    NotHotpluggable { id: String },
    /// A removal named the virtio-rng device, which stays.
    #[error("hot-plug: _rng: the virtio-rng device cannot be removed")]
    RngNotRemovable,
    /// Pausing, saving or restoring the devices (names the device).
    #[error(transparent)]
    State(#[from] state::DevicesStateError),
    /// The guest could not be told about slot `at` (the GED interrupt).
    #[error("hot-plug: telling the guest about {at}: {source}")]
    Announce {
        at: PciAddress,
        source: std::io::Error,
    },
}

impl DeviceManagerError {
    /// A hot-plug or removal the VM's state refuses (as opposed to one that
    /// failed): the API answers it with 409 Conflict.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            DeviceManagerError::IdStillPlaced { .. }
                | DeviceManagerError::NotHotpluggable { .. }
                | DeviceManagerError::RngNotRemovable
        )
    }
}

/// Makes the DAX window observer of the fs device with the given id.
pub type ObserverFactory = dyn Fn(&str) -> Arc<dyn WindowObserver>;

/// What the VMM keeps of one fs device while the VM runs: enough to report
/// on it and to reach its daemon's control socket.
#[derive(Clone)]
pub struct FsDeviceInfo {
    pub id: String,
    pub window: Option<Arc<DaxWindow>>,
    pub failed: Arc<AtomicBool>,
    pub control_socket: Option<std::path::PathBuf>,
    /// The daemon's memory table, for RAM added while the guest runs.
    pub memory: DaemonMemory,
}

/// Where a hot-plugged device landed, as Cloud Hypervisor reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDeviceInfo {
    pub id: String,
    /// `SSSS:00:DD.0`: segment, bus 0, slot.
    pub bdf: String,
}

impl PciDeviceInfo {
    fn new(id: &str, at: PciAddress) -> Self {
        PciDeviceInfo {
            id: id.to_string(),
            bdf: at.to_string(),
        }
    }
}

pub struct DeviceManager {
    vm: Arc<VmFd>,
    mmio: Arc<Bus>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    space: Arc<Mutex<AddressSpace>>,
    slots: Arc<Mutex<SlotNumbers>>,
    mmio_devices: MmioDeviceManager,
    pci: PciDeviceManager,
    hotplug: Arc<Mutex<PciHotplugController>>,
    ejects: Arc<EjectRequests>,
    ged: GedHandle,
    fs: Vec<FsDeviceInfo>,
    /// Each net device's tap (a copy of its fd), by device id: a local
    /// migration passes it to the new VMM (our tap is single-queue, so the
    /// new VMM cannot open it by name while this one holds it). Dropped
    /// with its device; None while a migration's switch closed it.
    taps: Vec<(String, Option<OwnedFd>)>,
    /// Each blk device's open image, by device id (a copy of its fd): a
    /// local migration passes it to the new VMM, its lock with it (the
    /// new VMM could not lock a writable image this one holds). Dropped
    /// with its device.
    disk_images: Vec<(String, OwnedFd)>,
    /// The vsock device's listening socket (a copy of its fd), by device
    /// id: a local migration passes it to the new VMM, which serves it
    /// (the path cannot be bound twice); and whether the device removes the
    /// socket's name when it goes. Dropped with its device; no fd while a
    /// migration's switch released the socket.
    vsock_listener: Option<(String, Option<OwnedFd>, SocketName)>,
    /// Each device's counters for `vm.counters`, by device id.
    counters: Vec<(String, Arc<DeviceCounters>)>,
    /// Memory slots of virtio-MMIO devices, kept until the VM goes.
    mmio_memory: Vec<MemorySlot>,
    /// Memory slots of RAM added by hot-plug (never removed).
    hotplugged_ram: Vec<MemorySlot>,
    /// Where the devices' activations and resets run (not on vCPUs).
    activator: DeviceActivator,
    /// Maps new DAX ranges into the guest's view (None until the vCPUs
    /// exist, or where KVM cannot).
    prefaulter: Option<Arc<dyn GuestPrefaulter>>,
    /// How long an fs device being built waits for its daemon's socket:
    /// None (a boot or a hot-plug: the daemon must be there) or, on a
    /// restore, [`RESTORE_DAEMON_PATIENCE`].
    daemon_patience: Option<std::time::Duration>,
    /// A local migration's passed DAX window files, by fs device id, for
    /// each device to map its window again from when it is restored.
    window_files: WindowFiles,
}

impl DeviceManager {
    /// The PCI segments (config ports, ECAM ranges), the hot-plug
    /// controller on `pio`, and no device yet.
    #[allow(clippy::too_many_arguments)] // each is a different piece of the VM
    pub fn new(
        kvm: &Kvm,
        vm: &Arc<VmFd>,
        pio: &Bus,
        mmio: &Arc<Bus>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        memory: &MemoryConfig,
        pci_segments: u16,
        ged: GedHandle,
    ) -> Result<Self, DeviceManagerError> {
        let (ram_size, hotplug_size) = (memory.size, memory.hotplug_size.unwrap_or(0));
        let space = Arc::new(Mutex::new(AddressSpace::new(
            ram_size,
            hotplug_size,
            pci_segments,
        )));
        // A negative answer (an error) counts as no slots.
        let limit = u32::try_from(kvm.check_extension_int(Cap::NrMemslots)).unwrap_or(0);
        let slots = SlotNumbers::new(limit);
        let activator = DeviceActivator::start().map_err(DeviceManagerError::Activator)?;
        let pci = PciDeviceManager::new(
            vm,
            pio,
            mmio,
            &mem,
            space.clone(),
            slots.clone(),
            activator.activator(),
        )
        .map_err(DeviceManagerError::PciSegments)?;
        let hotplug = PciHotplugController::new(pci_segments)
            .map_err(DeviceManagerError::HotplugController)?;
        let ejects = hotplug.eject_requests();
        let hotplug = Arc::new(Mutex::new(hotplug));
        pio.insert(
            hotplug.clone(),
            u64::from(crate::device_manager::hotplug_controller::PCI_HOTPLUG_PORT),
            crate::device_manager::hotplug_controller::PCI_HOTPLUG_PORT_COUNT,
        )
        .map_err(DeviceManagerError::HotplugPorts)?;
        Ok(DeviceManager {
            vm: vm.clone(),
            mmio: mmio.clone(),
            mem,
            space,
            slots,
            mmio_devices: MmioDeviceManager::new(),
            pci,
            hotplug,
            ejects,
            ged,
            fs: Vec::new(),
            taps: Vec::new(),
            disk_images: Vec::new(),
            vsock_listener: None,
            counters: Vec::new(),
            prefaulter: None,
            daemon_patience: None,
            window_files: WindowFiles::new(),
            mmio_memory: Vec::new(),
            hotplugged_ram: Vec::new(),
            activator,
        })
    }

    /// From now on an fs device waits up to [`RESTORE_DAEMON_PATIENCE`] for
    /// its daemon's socket. On a restore or an incoming migration the
    /// operator starts a fresh daemon on the same socket path once the old
    /// one has handed over its state and exited (Cloud Hypervisor's model
    /// and retry period), so the socket may not be there yet.
    /// `window_files`: what a local migration's sender passed of each fs
    /// device's DAX window (none for a snapshot's restore).
    pub fn wait_for_daemons(&mut self, window_files: WindowFiles) {
        self.daemon_patience = Some(RESTORE_DAEMON_PATIENCE);
        self.window_files = window_files;
    }

    /// The devices the configuration asks for, before the guest starts.
    pub fn add_boot_devices(
        &mut self,
        config: &VmConfig,
        observe: Option<&ObserverFactory>,
    ) -> Result<(), DeviceManagerError> {
        if let Some(r) = &config.rng {
            let device = Rng::new("_rng".into(), &r.src)?;
            self.place("_rng", Box::new(device), r.transport, r.pci_segment, None)?;
            tracing::info!("rng: virtio-rng from {}", r.src.display());
        }
        for p in &config.pmem {
            self.add_pmem_device(p)?;
        }
        for f in &config.fs {
            self.add_fs_device(f, observe)?;
        }
        for d in &config.disks {
            self.add_disk_device(d)?;
        }
        if let Some(v) = &config.vsock {
            self.add_vsock_device(v)?;
        }
        for n in &config.net {
            self.add_net_device(n)?;
        }
        Ok(())
    }

    /// The DSDT entries of the devices: virtio-MMIO devices, the PCI host
    /// bridges with their slots, the hot-plug controller.
    pub fn append_aml(&self, sink: &mut Vec<u8>) {
        sink.extend_from_slice(self.mmio_devices.aml());
        self.pci.append_aml(sink);
        PciHotplugController::append_aml(sink, self.pci.segment_count());
    }

    /// Where each virtio-PCI device is, by id.
    pub fn pci_addresses(&self) -> Vec<(String, PciAddress)> {
        self.pci.addresses()
    }

    pub fn fs_devices(&self) -> &[FsDeviceInfo] {
        &self.fs
    }

    /// Each net device's id and tap.
    pub fn net_taps(&self) -> impl Iterator<Item = (&str, std::os::fd::BorrowedFd<'_>)> {
        self.taps
            .iter()
            .filter_map(|(id, fd)| Some((id.as_str(), std::os::fd::AsFd::as_fd(fd.as_ref()?))))
    }

    /// The counters of every device that keeps them, by device id.
    pub fn device_counters(&self) -> &[(String, Arc<DeviceCounters>)] {
        &self.counters
    }

    /// Puts `device` on `transport` (on PCI, on `segment`); on PCI returns
    /// where it went.
    fn place(
        &mut self,
        id: &str,
        device: Box<dyn VirtioDevice>,
        transport: Transport,
        segment: u16,
        shm: Option<ShmBacking>,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let counters = device.counters();
        let slot = self.place_on_transport(id, device, transport, segment, shm)?;
        if let Some(c) = counters {
            self.counters.push((id.to_string(), c));
        }
        Ok(slot)
    }

    fn place_on_transport(
        &mut self,
        id: &str,
        device: Box<dyn VirtioDevice>,
        transport: Transport,
        segment: u16,
        shm: Option<ShmBacking>,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        match transport {
            Transport::Pci => {
                let at = self.pci.add(id, segment, device, shm).map_err(|source| {
                    DeviceManagerError::PciPlace {
                        id: id.to_string(),
                        source,
                    }
                })?;
                Ok(Some(at))
            }
            Transport::Mmio => {
                let mut device = device;
                if let Some(b) = shm {
                    let addr = self
                        .space
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .allocate(Area::MmioDeviceMemory, b.size, layout::DEVICE_MEMORY_ALIGN)
                        .map_err(|source| DeviceManagerError::MmioShmAddress {
                            id: id.to_string(),
                            source,
                        })?;
                    // SAFETY: `owner` keeps the mapping for the life of the slot.
                    let slot = unsafe {
                        MemorySlot::new(&self.vm, &self.slots, addr, b.size, b.host_addr, b.owner)
                    }
                    .map_err(|source| DeviceManagerError::MmioShmSlot {
                        id: id.to_string(),
                        source,
                    })?;
                    device.set_shm_base(addr);
                    self.mmio_memory.push(slot);
                }
                self.mmio_devices
                    .add(
                        id,
                        &self.vm,
                        &self.mmio,
                        &self.mem,
                        device,
                        self.activator.activator(),
                    )
                    .map_err(|source| DeviceManagerError::MmioPlace {
                        id: id.to_string(),
                        source,
                    })?;
                Ok(None)
            }
        }
    }

    /// Opens and maps the pmem backing file and puts a virtio-pmem device
    /// for it on its transport.
    fn add_pmem_device(
        &mut self,
        p: &PmemConfig,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let backing = PmemBacking::open(&p.file, p.size, p.discard_writes)?;
        let (size, host_addr) = (backing.size(), backing.host_addr());
        let device = Pmem::new(p.id.clone(), &backing, 0).map_err(|source| {
            DeviceManagerError::PmemFile {
                id: p.id.clone(),
                source,
            }
        })?;
        let device = Box::new(device);
        let shm = ShmBacking {
            size,
            host_addr,
            owner: Box::new(backing),
        };
        let slot = self.place(&p.id, device, p.transport, p.pci_segment, Some(shm))?;
        tracing::info!(device = %p.id, "pmem {}: {size} bytes of {}", p.id, p.file.display());
        Ok(slot)
    }

    /// Gives every DAX window, now and hot-plugged later, what maps its new
    /// ranges into the guest's view.
    pub fn set_guest_prefaulter(&mut self, prefaulter: Arc<dyn GuestPrefaulter>) {
        for w in self.fs.iter().filter_map(|f| f.window.as_ref()) {
            w.set_guest_prefaulter(prefaulter.clone());
        }
        self.prefaulter = Some(prefaulter);
    }

    /// Connects the fs device to its daemon and puts it, with its DAX
    /// window (if any), on its transport.
    fn add_fs_device(
        &mut self,
        f: &FsConfig,
        observe: Option<&ObserverFactory>,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let cfg = FsDeviceConfig {
            id: f.id.clone(),
            tag: f.tag.clone(),
            socket: f.socket.clone(),
            num_request_queues: f.num_queues,
            queue_size: f.queue_size,
            dax: f.dax,
            cache_size: f.cache_size,
        };
        let mut device = match self.daemon_patience {
            Some(patience) => VhostUserFs::connect_retrying(&cfg, patience)?,
            None => VhostUserFs::connect(&cfg)?,
        };
        if let Some(files) = self.window_files.remove(&f.id) {
            device.set_window_files(files);
        }
        let window = device.window().cloned();
        let info = FsDeviceInfo {
            id: f.id.clone(),
            window: window.clone(),
            failed: device.failed_flag(),
            control_socket: f.control_socket.clone(),
            memory: device.daemon_memory(),
        };
        let shm = window.map(|w| {
            w.set_prefault(f.dax_prefault);
            if let Some(p) = &self.prefaulter {
                w.set_guest_prefaulter(p.clone());
            }
            if let Some(observe) = observe {
                w.set_observer(observe(&f.id));
            }
            tracing::info!(device = %f.id, "fs {}: DAX window of {} bytes", f.id, w.size());
            ShmBacking {
                size: w.size(),
                host_addr: w.host_addr(),
                owner: Box::new(w),
            }
        });
        let slot = self.place(&f.id, Box::new(device), f.transport, f.pci_segment, shm)?;
        self.fs.push(info);
        Ok(slot)
    }

    fn hotplug_only_over_pci(transport: Transport, id: &str) -> Result<(), DeviceManagerError> {
        match transport {
            Transport::Pci => Ok(()),
            Transport::Mmio => Err(DeviceManagerError::HotplugOverMmio { id: id.to_string() }),
        }
    }

    /// Refuses an id that a device still being ejected holds.
    fn id_is_free(&self, id: &str) -> Result<(), DeviceManagerError> {
        match self.pci.address_of(id) {
            Some(at) => Err(DeviceManagerError::IdStillPlaced {
                id: id.to_string(),
                at,
            }),
            None => Ok(()),
        }
    }

    /// Hot-plugs an fs device into the running guest.
    pub fn hotplug_fs(
        &mut self,
        f: &FsConfig,
        observe: Option<&ObserverFactory>,
    ) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.hotplug(&f.id, f.transport, |dm| dm.add_fs_device(f, observe))
    }

    /// Hot-plugs a pmem device into the running guest.
    pub fn hotplug_pmem(&mut self, p: &PmemConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.hotplug(&p.id, p.transport, |dm| dm.add_pmem_device(p))
    }

    /// Hot-plugs a disk into the running guest.
    pub fn hotplug_disk(&mut self, d: &DiskConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.hotplug(&d.id, d.transport, |dm| dm.add_disk_device(d))
    }

    /// Hot-plugs the vsock device into the running guest.
    pub fn hotplug_vsock(&mut self, v: &VsockConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.hotplug(&v.id, v.transport, |dm| dm.add_vsock_device(v))
    }

    /// Hot-plugs a net device into the running guest.
    pub fn hotplug_net(&mut self, n: &NetConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.hotplug(&n.id, n.transport, |dm| dm.add_net_device(n))
    }

    /// What every hot-plug does around `add` (which puts the device on
    /// its transport): refuse MMIO and an id still in use, then tell the
    /// guest about the new slot.
    fn hotplug(
        &mut self,
        id: &str,
        transport: Transport,
        add: impl FnOnce(&mut Self) -> Result<Option<PciAddress>, DeviceManagerError>,
    ) -> Result<PciDeviceInfo, DeviceManagerError> {
        Self::hotplug_only_over_pci(transport, id)?;
        self.id_is_free(id)?;
        let slot = add(self)?.expect("a PCI device has a slot");
        self.announce(slot, true)?;
        Ok(PciDeviceInfo::new(id, slot))
    }

    fn announce(&self, at: PciAddress, add: bool) -> Result<(), DeviceManagerError> {
        {
            let mut hp = self.hotplug.lock().unwrap_or_else(|e| e.into_inner());
            if add {
                hp.announce_add(at.segment, at.slot);
            } else {
                hp.announce_remove(at.segment, at.slot);
            }
        }
        self.ged
            .raise(EVENT_PCI_HOTPLUG)
            .map_err(|source| DeviceManagerError::Announce { at, source })
    }

    /// Asks the guest to eject the device named `id`; it goes when the
    /// guest has let go of it ([`Self::complete_ejects`]).
    pub fn request_removal(&self, id: &str) -> Result<(), DeviceManagerError> {
        let slot = self
            .pci
            .address_of(id)
            .ok_or_else(|| DeviceManagerError::NotHotpluggable { id: id.to_string() })?;
        if id == "_rng" {
            return Err(DeviceManagerError::RngNotRemovable);
        }
        self.announce(slot, false)
    }

    /// Readable when the guest has ejected a device.
    pub fn eject_requests(&self) -> &Arc<EjectRequests> {
        &self.ejects
    }

    /// The KVM slots of RAM added while the guest runs.
    pub(crate) fn hotplugged_ram_slots(&self) -> &[MemorySlot] {
        &self.hotplugged_ram
    }

    /// Gives `region` (new guest RAM) to KVM and to every device: the
    /// memory they share, and each running vhost-user daemon's table, in
    /// that order of risk so that a failure undoes what was done and
    /// leaves the guest's memory as it was.
    pub fn add_ram_region(
        &mut self,
        region: Arc<GuestRegionMmap>,
    ) -> Result<(), DeviceManagerError> {
        let (addr, size) = (region.start_addr().0, region.len());
        // SAFETY: `owner` keeps the mapping alive for the life of the slot.
        let slot = unsafe {
            MemorySlot::new(
                &self.vm,
                &self.slots,
                addr,
                size,
                region.as_ptr() as u64,
                Box::new(region.clone()),
            )
        }
        .map_err(|source| DeviceManagerError::RamSlot { addr, size, source })?;
        let before = self.mem.memory().clone();
        let after = before
            .insert_region(region.clone())
            .map_err(|source| DeviceManagerError::RamRegion { addr, size, source })?;
        let daemons: Vec<&FsDeviceInfo> = self.fs.iter().filter(|f| f.memory.alive()).collect();
        for (i, f) in daemons.iter().enumerate() {
            if let Err(source) = f.memory.add_region(&after, &region) {
                for done in &daemons[..i] {
                    if let Err(e) = done.memory.remove_region(&before, &region) {
                        tracing::warn!("fs {}: taking back RAM at {addr:#x}: {e}", done.id);
                    }
                }
                return Err(DeviceManagerError::RamDaemon { addr, size, source });
            }
        }
        let told = daemons.len();
        self.mem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(after);
        self.hotplugged_ram.push(slot);
        tracing::info!("RAM: {size} bytes added at {addr:#x} ({told} daemon(s) told)");
        Ok(())
    }

    /// Removes the devices the guest ejected; returns their ids.
    pub fn complete_ejects(&mut self) -> Vec<String> {
        let mut gone = Vec::new();
        for (segment, slot) in self.ejects.take() {
            let at = PciAddress { segment, slot };
            let Some(id) = self.pci.remove(at) else {
                continue; // an empty slot: nothing to do
            };
            self.fs.retain(|f| f.id != id);
            self.taps.retain(|(t, _)| *t != id);
            self.disk_images.retain(|(d, _)| *d != id);
            if self.vsock_listener.as_ref().is_some_and(|(v, ..)| *v == id) {
                self.vsock_listener = None;
            }
            self.counters.retain(|(c, _)| *c != id);
            tracing::info!("{id}: ejected by the guest from {at}, removed");
            gone.push(id);
        }
        gone
    }
}

#[cfg(test)]
#[path = "device_manager_tests.rs"]
pub(crate) mod tests;
