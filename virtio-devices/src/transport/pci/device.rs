//! A virtio device as a modern (1.x) PCI function: configuration space with
//! the virtio capabilities, BAR 0 holding the common/ISR/device/notify
//! structures and the MSI-X table and PBA, and BAR 2 (64-bit, prefetchable)
//! holding the device's shared memory regions, one `cfg_type 8` capability each.

use std::sync::atomic::{AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use crate::device::{Interrupt, SharedMemoryRegion, VirtioDevice, VirtioInterrupt};
use crate::transport::common::VirtioState;
use crate::GuestMemoryMmap;
use pci::configuration::{BarKind, PciConfigError, PciConfiguration, PciIds};
use pci::msix::{Delivery, MsixConfig, MsixEntry, MsixUpdate, VIRTIO_MSI_NO_VECTOR};

pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
/// Modern device ids are 0x1040 + the virtio device type.
const VIRTIO_PCI_DEVICE_ID_BASE: u16 = 0x1040;

// BAR 0 layout.
pub const COMMON_CFG_OFFSET: u64 = 0x0000;
const COMMON_CFG_SIZE: u64 = 0x38;
pub const ISR_OFFSET: u64 = 0x1000;
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
const DEVICE_CFG_SIZE: u64 = 0x1000;
pub const NOTIFY_OFFSET: u64 = 0x3000;
/// Each queue notifies at NOTIFY_OFFSET + index * multiplier.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
pub const MSIX_PBA_OFFSET: u64 = 0x6000;
pub const BAR0_SIZE: u64 = 0x8000;
pub const SHM_BAR: u8 = 2;
/// Shared memory BARs are at least this aligned so the guest can use 2 MiB pages.
pub const SHM_BAR_MIN_ALIGN: u64 = 2 << 20;

// virtio_pci_cap cfg_type values.
const CAP_COMMON: u8 = 1;
const CAP_NOTIFY: u8 = 2;
const CAP_ISR: u8 = 3;
const CAP_DEVICE: u8 = 4;
const CAP_PCI_CFG: u8 = 5;
const CAP_SHARED_MEMORY: u8 = 8;
const PCI_CAP_ID_VNDR: u8 = 0x09;
const PCI_CAP_ID_MSIX: u8 = 0x11;

const ISR_QUEUE: u8 = 1;
const ISR_CONFIG: u8 = 2;

/// Delivers MSI messages to the guest (an irqfd routed to each vector, or
/// KVM_SIGNAL_MSI).
pub trait MsiSender: Send + Sync {
    fn send(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()>;
    /// The driver reprogrammed table entry `vector`: re-route it.
    fn update(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()> {
        let _ = (vector, entry);
        Ok(())
    }
    /// An eventfd that raises `vector` when written, with no VMM thread in
    /// the way (a KVM irqfd), if this sender has one.
    fn notifier(&self, vector: u16) -> Option<EventFd> {
        let _ = vector;
        None
    }
    /// Whether `vector` is masked. A notifier written while its vector is
    /// masked must not reach the guest; it fires once the vector is unmasked.
    fn set_masked(&self, vector: u16, masked: bool) -> std::io::Result<()> {
        let _ = (vector, masked);
        Ok(())
    }
    /// Whether a notifier write is held back on masked `vector` (taken:
    /// the caller records it in the PBA, so a saved state keeps it).
    fn take_pending(&self, vector: u16) -> bool {
        let _ = vector;
        false
    }
}

/// The interrupt of a virtio-PCI function: the vector chosen for each queue
/// and for config changes, and the MSI-X state deciding delivery.
pub struct PciInterrupt {
    pub(super) msix: Arc<Mutex<MsixConfig>>,
    pub(super) isr: AtomicU8,
    pub(super) config_vector: AtomicU16,
    pub(super) queue_vectors: Vec<AtomicU16>,
    pub(super) sender: Arc<dyn MsiSender>,
}

impl PciInterrupt {
    fn vector_for(&self, interrupt: Interrupt) -> u16 {
        match interrupt {
            Interrupt::Config => self.config_vector.load(Ordering::SeqCst),
            Interrupt::Queue(i) => self
                .queue_vectors
                .get(usize::from(i))
                .map_or(VIRTIO_MSI_NO_VECTOR, |v| v.load(Ordering::SeqCst)),
        }
    }
}

impl VirtioInterrupt for PciInterrupt {
    fn trigger(&self, interrupt: Interrupt) -> std::io::Result<()> {
        let bit = if interrupt == Interrupt::Config {
            ISR_CONFIG
        } else {
            ISR_QUEUE
        };
        self.isr.fetch_or(bit, Ordering::SeqCst);
        let vector = self.vector_for(interrupt);
        if vector == VIRTIO_MSI_NO_VECTOR {
            return Ok(()); // no INTx here: the driver must assign a vector
        }
        let delivery = self
            .msix
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .trigger(vector);
        match delivery {
            Delivery::Deliver(entry) => self.sender.send(vector, entry),
            Delivery::Pending | Delivery::Dropped => Ok(()),
        }
    }

    /// The irqfd of the vector the driver gave `interrupt`, so a vhost-user
    /// backend can raise it straight through KVM. With MSI-X the driver never
    /// reads the ISR for a queue interrupt, so bypassing `trigger` loses
    /// nothing; masking is kept by the sender (see `MsiSender::set_masked`).
    /// None without a vector: then only `trigger` can reach the guest.
    ///
    /// The vector is read now: a device asks at activation, after the driver
    /// has assigned vectors (Linux assigns them before DRIVER_OK and never
    /// changes them while the device runs).
    fn notifier(&self, interrupt: Interrupt) -> Option<EventFd> {
        match self.vector_for(interrupt) {
            VIRTIO_MSI_NO_VECTOR => None,
            vector => self.sender.notifier(vector),
        }
    }
}

pub struct VirtioPciDevice {
    pub(super) config: PciConfiguration,
    pub(super) state: VirtioState,
    pub(super) interrupt: Arc<PciInterrupt>,
    pub(super) device_interrupt: Arc<dyn VirtioInterrupt>,
    msix_cap: usize,
    pci_cfg_cap: usize,
    pub(super) device_feature_select: u32,
    pub(super) driver_feature_select: u32,
    pub(super) queue_select: u16,
    pub(super) config_generation: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum VirtioPciError {
    #[error("PCI configuration: {0}")]
    Config(#[from] PciConfigError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Writes a virtio_pci_cap body (after id and next): cap_len, cfg_type, bar,
/// id, padding, offset, length, then `extra`.
fn virtio_cap(cfg_type: u8, bar: u8, id: u8, offset: u32, length: u32, extra: &[u8]) -> Vec<u8> {
    let mut body = vec![
        u8::try_from(16 + extra.len()).expect("a virtio capability is under 256 bytes"),
        cfg_type,
        bar,
        id,
        0,
        0,
    ];
    body.extend_from_slice(&offset.to_le_bytes());
    body.extend_from_slice(&length.to_le_bytes());
    body.extend_from_slice(extra);
    body
}

/// The ids of a modern-only virtio device of type `device_type`.
fn pci_ids(device_type: u32) -> PciIds {
    PciIds {
        vendor: VIRTIO_PCI_VENDOR_ID,
        device: VIRTIO_PCI_DEVICE_ID_BASE
            + u16::try_from(device_type).expect("virtio device types fit 16 bits"),
        subsystem_vendor: VIRTIO_PCI_VENDOR_ID,
        subsystem: 0x40,
        class: 0xff, // unclassified; the driver matches on ids
        subclass: 0,
        prog_if: 0,
        revision: 1, // modern-only device
    }
}

/// BAR 0 (registers, MSI-X) and, for a device with shared memory, the
/// prefetchable shared-memory BAR.
fn add_bars(
    config: &mut PciConfiguration,
    bar0: u64,
    shm_bar: Option<(u64, u64)>,
) -> Result<(), PciConfigError> {
    config.add_bar(
        0,
        bar0,
        BAR0_SIZE,
        BarKind::Mem64 {
            prefetchable: false,
        },
    )?;
    if let Some((addr, size)) = shm_bar {
        config.add_bar(
            usize::from(SHM_BAR),
            addr,
            size.max(SHM_BAR_MIN_ALIGN),
            BarKind::Mem64 { prefetchable: true },
        )?;
    }
    Ok(())
}

/// The capabilities that say where in BAR 0 the common configuration, the
/// ISR, the device configuration and the notifications of `queues` queues
/// are.
fn add_virtio_caps(config: &mut PciConfiguration, queues: usize) -> Result<(), PciConfigError> {
    let vendor = |config: &mut PciConfiguration, body: Vec<u8>| {
        config.add_capability(PCI_CAP_ID_VNDR, &body, &[]).map(drop)
    };
    vendor(
        config,
        virtio_cap(
            CAP_COMMON,
            0,
            0,
            const { narrow::u32_of(COMMON_CFG_OFFSET) },
            const { narrow::u32_of(COMMON_CFG_SIZE) },
            &[],
        ),
    )?;
    vendor(
        config,
        virtio_cap(CAP_ISR, 0, 0, const { narrow::u32_of(ISR_OFFSET) }, 1, &[]),
    )?;
    vendor(
        config,
        virtio_cap(
            CAP_DEVICE,
            0,
            0,
            const { narrow::u32_of(DEVICE_CFG_OFFSET) },
            const { narrow::u32_of(DEVICE_CFG_SIZE) },
            &[],
        ),
    )?;
    let notify_len = narrow::sat_u32(queues).max(1) * NOTIFY_OFF_MULTIPLIER;
    vendor(
        config,
        virtio_cap(
            CAP_NOTIFY,
            0,
            0,
            const { narrow::u32_of(NOTIFY_OFFSET) },
            notify_len,
            &NOTIFY_OFF_MULTIPLIER.to_le_bytes(),
        ),
    )
}

/// One shared-memory capability per region, each at its offset from the
/// shared-memory BAR at `bar_addr` (64-bit offset and length: the high
/// halves follow the standard body).
fn add_shm_caps(
    config: &mut PciConfiguration,
    bar_addr: u64,
    regions: &[SharedMemoryRegion],
) -> Result<(), PciConfigError> {
    for r in regions {
        let offset = r.guest_addr - bar_addr;
        let mut extra = Vec::new();
        extra.extend_from_slice(&((offset >> 32) as u32).to_le_bytes());
        extra.extend_from_slice(&((r.len >> 32) as u32).to_le_bytes());
        let body = virtio_cap(
            CAP_SHARED_MEMORY,
            SHM_BAR,
            r.id,
            narrow::low_u32(offset),
            narrow::low_u32(r.len),
            &extra,
        );
        config.add_capability(PCI_CAP_ID_VNDR, &body, &[])?;
    }
    Ok(())
}

/// The PCI configuration access capability; returns its offset.
fn add_pci_cfg_cap(config: &mut PciConfiguration) -> Result<usize, PciConfigError> {
    // Bar, offset and length are writable, then the data window.
    let pci_cfg_writable = [
        0, 0, 0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        0xff, 0xff,
    ];
    config.add_capability(
        PCI_CAP_ID_VNDR,
        &virtio_cap(CAP_PCI_CFG, 0, 0, 0, 0, &[0; 4]),
        &pci_cfg_writable,
    )
}

/// The MSI-X capability for `msix_vectors` vectors, table and PBA in BAR 0;
/// returns its offset.
fn add_msix_cap(config: &mut PciConfiguration, msix_vectors: u16) -> Result<usize, PciConfigError> {
    let mut msix_body = Vec::new();
    msix_body.extend_from_slice(&(msix_vectors - 1).to_le_bytes()); // table size - 1; enable/mask start clear
    msix_body.extend_from_slice(&const { narrow::u32_of(MSIX_TABLE_OFFSET) }.to_le_bytes()); // BIR 0
    msix_body.extend_from_slice(&const { narrow::u32_of(MSIX_PBA_OFFSET) }.to_le_bytes());
    config.add_capability(PCI_CAP_ID_MSIX, &msix_body, &[0, 0, 0, 0xc0])
}

impl VirtioPciDevice {
    /// `bar0` must be aligned to BAR0_SIZE; `shm_bar` (address, size) to its
    /// size and at least 2 MiB; the device's regions are laid out in it by id
    /// order, each at its offset from the BAR base given by `shm_offsets`.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        bar0: u64,
        shm_bar: Option<(u64, u64)>,
        msix_vectors: u16,
        sender: Arc<dyn MsiSender>,
    ) -> Result<Self, VirtioPciError> {
        let queues = device.queue_max_sizes().len();
        let mut config = PciConfiguration::new(pci_ids(device.device_type()));
        add_bars(&mut config, bar0, shm_bar)?;
        add_virtio_caps(&mut config, queues)?;
        if let Some((bar_addr, _)) = shm_bar {
            add_shm_caps(&mut config, bar_addr, &device.shm_regions())?;
        }
        let pci_cfg_cap = add_pci_cfg_cap(&mut config)?;
        let msix_cap = add_msix_cap(&mut config, msix_vectors)?;
        let interrupt = Arc::new(PciInterrupt {
            msix: Arc::new(Mutex::new(MsixConfig::new(msix_vectors))),
            isr: AtomicU8::new(0),
            config_vector: AtomicU16::new(VIRTIO_MSI_NO_VECTOR),
            queue_vectors: (0..queues)
                .map(|_| AtomicU16::new(VIRTIO_MSI_NO_VECTOR))
                .collect(),
            sender,
        });
        Ok(VirtioPciDevice {
            config,
            state: VirtioState::new(device, mem)?,
            device_interrupt: interrupt.clone(),
            interrupt,
            msix_cap,
            pci_cfg_cap,
            device_feature_select: 0,
            driver_feature_select: 0,
            queue_select: 0,
            config_generation: 0,
        })
    }

    /// (eventfd, offset in BAR 0, queue index) to register as ioeventfds.
    pub fn queue_notifiers(&self) -> Vec<(&EventFd, u64, u16)> {
        self.state
            .kicks()
            .iter()
            .enumerate()
            .map(|(i, fd)| {
                (
                    fd,
                    NOTIFY_OFFSET + i as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
                    narrow::sat_u16(i),
                )
            })
            .collect()
    }

    pub fn bar_address(&self, index: usize) -> Option<u64> {
        self.config.bar_address(index)
    }

    pub fn status(&self) -> u32 {
        self.state.status()
    }

    /// Where activations and resets run (see `transport::common`).
    pub fn set_activator(&mut self, activator: Arc<dyn crate::transport::common::Activator>) {
        self.state.set_activator(activator);
    }

    /// Whether the driver has memory decoding on (BARs are live).
    pub fn memory_enabled(&self) -> bool {
        self.config.memory_enabled()
    }

    /// The VMM moved the shared memory BAR's backing to `base`.
    pub fn set_shm_base(&mut self, base: u64) {
        self.state.device().set_shm_base(base);
    }

    pub fn is_activated(&self) -> bool {
        self.state.is_activated()
    }

    // ---- configuration space ----

    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        let window = self.pci_cfg_cap as u64 + 16;
        if offset >= window && offset < window + 4 {
            return self.read_pci_cfg_window(data);
        }
        self.config.read(offset, data);
    }

    /// Returns the BAR index the driver moved, if any (the VMM moves what it
    /// mapped there).
    pub fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        let window = self.pci_cfg_cap as u64 + 16;
        if offset >= window && offset < window + 4 {
            self.write_pci_cfg_window(data);
            return None;
        }
        let moved = self.config.write(offset, data);
        let ctl_reg = self.msix_cap as u64 & !3;
        if offset & !3 == ctl_reg {
            let control = (self.config.read_reg(self.msix_cap / 4) >> 16) as u16;
            let updates = self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .set_message_control(control);
            self.apply(updates);
        }
        moved
    }

    /// The pci_cfg_data window: a BAR 0 access at the offset and length the
    /// driver put in the capability.
    fn pci_cfg_access(&self) -> Option<(u64, usize)> {
        let reg = |o: usize| self.config.read_reg((self.pci_cfg_cap + o) / 4);
        // Layout: id, next, cap_len, cfg_type, bar (byte 4), id, padding, offset (8), length (12), data (16).
        let cap_bar = (reg(4) & 0xff) as u8;
        let offset = u64::from(reg(8));
        let length = reg(12) as usize;
        (cap_bar == 0 && matches!(length, 1 | 2 | 4)).then_some((offset, length))
    }

    fn read_pci_cfg_window(&self, data: &mut [u8]) {
        data.fill(0);
        if let Some((offset, len)) = self.pci_cfg_access() {
            let mut buf = [0u8; 4];
            self.read_bar0_const(offset, &mut buf[..len]);
            let n = len.min(data.len());
            data[..n].copy_from_slice(&buf[..n]);
        }
    }

    fn write_pci_cfg_window(&mut self, data: &[u8]) {
        if let Some((offset, len)) = self.pci_cfg_access() {
            if data.len() >= len {
                self.write_bar0(offset, &data[..len]);
            }
        }
    }

    /// Applies what an MSI-X write changed: routes first, then each
    /// vector's mask, then the interrupts that were pending on a vector just
    /// unmasked (so they go out through a live route and an armed irqfd).
    pub(super) fn apply(&self, updates: Vec<MsixUpdate>) {
        let sender = &self.interrupt.sender;
        let warn = |what: &dyn std::fmt::Debug, e: std::io::Error| {
            crate::warn_limited!("virtio-pci: MSI-X {what:?}: {e}")
        };
        for u in &updates {
            if let MsixUpdate::Entry(vector) = *u {
                let entry = self
                    .interrupt
                    .msix
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(vector);
                if let Some(Err(e)) = entry.map(|e| sender.update(vector, e)) {
                    warn(u, e);
                }
            }
        }
        {
            // Under the lock, so no trigger sees a mask the sender has not.
            let msix = self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for vector in 0..msix.vectors() {
                if let Err(e) = sender.set_masked(vector, msix.masked(vector)) {
                    warn(&("mask", vector), e);
                }
            }
        }
        for u in &updates {
            if let MsixUpdate::DeliverPending(vector, entry) = *u {
                if let Err(e) = sender.send(vector, entry) {
                    warn(u, e);
                }
            }
        }
    }

    // ---- BAR 0 ----

    fn read_bar0_const(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        match offset {
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_SIZE).contains(&o) => {
                self.state.device().read_config(o - DEVICE_CFG_OFFSET, data)
            }
            o if (MSIX_TABLE_OFFSET..MSIX_PBA_OFFSET).contains(&o) => self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read_table(o - MSIX_TABLE_OFFSET, data),
            o if (MSIX_PBA_OFFSET..BAR0_SIZE).contains(&o) => self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read_pba(o - MSIX_PBA_OFFSET, data),
            o if o < COMMON_CFG_SIZE => self.read_common(o, data),
            _ => {}
        }
    }

    pub fn read_bar0(&mut self, offset: u64, data: &mut [u8]) {
        if offset == ISR_OFFSET {
            // Reading the ISR acknowledges it.
            data.fill(0);
            if let Some(b) = data.first_mut() {
                *b = self.interrupt.isr.swap(0, Ordering::SeqCst);
            }
            return;
        }
        self.read_bar0_const(offset, data);
    }

    pub fn write_bar0(&mut self, offset: u64, data: &[u8]) {
        match offset {
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_SIZE).contains(&o) => self
                .state
                .device()
                .write_config(o - DEVICE_CFG_OFFSET, data),
            o if (NOTIFY_OFFSET..MSIX_TABLE_OFFSET).contains(&o) => {
                // Reached only when no ioeventfd caught the write.
                let index = (o - NOTIFY_OFFSET) / u64::from(NOTIFY_OFF_MULTIPLIER);
                if let Some(kick) = self.state.kicks().get(narrow::usize_of(index)) {
                    let _ = kick.write(1);
                }
            }
            o if (MSIX_TABLE_OFFSET..MSIX_PBA_OFFSET).contains(&o) => {
                let updates = self
                    .interrupt
                    .msix
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write_table(o - MSIX_TABLE_OFFSET, data);
                self.apply(updates);
            }
            o if o < COMMON_CFG_SIZE => self.write_common(o, data),
            _ => {}
        }
    }

    // ---- common configuration (virtio 1.2 §4.1.4.3) ----

    fn read_common(&self, offset: u64, data: &mut [u8]) {
        let q = self.state.queue(u32::from(self.queue_select));
        let value: u64 = match (offset, data.len()) {
            (0x00, 4) => u64::from(self.device_feature_select),
            (0x04, 4) => match self.device_feature_select {
                0 => self.state.device().features() & 0xffff_ffff,
                1 => self.state.device().features() >> 32,
                _ => 0,
            },
            (0x08, 4) => u64::from(self.driver_feature_select),
            (0x0c, 4) => match self.driver_feature_select {
                0 => self.state.driver_features() & 0xffff_ffff,
                1 => self.state.driver_features() >> 32,
                _ => 0,
            },
            (0x10, 2) => u64::from(self.interrupt.config_vector.load(Ordering::SeqCst)),
            (0x12, 2) => self.state.device().queue_max_sizes().len() as u64,
            (0x14, 1) => u64::from(self.state.status().to_le_bytes()[0]),
            (0x15, 1) => u64::from(self.config_generation),
            (0x16, 2) => u64::from(self.queue_select),
            (0x18, 2) => q.map_or(0, |q| u64::from(q.size())),
            (0x1a, 2) => self
                .interrupt
                .queue_vectors
                .get(usize::from(self.queue_select))
                .map_or(u64::from(VIRTIO_MSI_NO_VECTOR), |v| {
                    u64::from(v.load(Ordering::SeqCst))
                }),
            (0x1c, 2) => q.map_or(0, |q| u64::from(q.ready())),
            (0x1e, 2) => u64::from(self.queue_select), // queue_notify_off
            (0x20 | 0x28 | 0x30, 8) | (0x20 | 0x24 | 0x28 | 0x2c | 0x30 | 0x34, 4) => {
                let Some(q) = q else { return };
                let full = match offset & !7 {
                    0x20 => q.desc_table(),
                    0x28 => q.avail_ring(),
                    _ => q.used_ring(),
                };
                if data.len() == 4 && offset % 8 == 4 {
                    full >> 32
                } else {
                    full & if data.len() == 4 {
                        0xffff_ffff
                    } else {
                        u64::MAX
                    }
                }
            }
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes()[..data.len()]);
    }

    fn write_common(&mut self, offset: u64, data: &[u8]) {
        let mut buf = [0u8; 8];
        if data.len() > 8 {
            return;
        }
        buf[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(buf);
        let sel = u32::from(self.queue_select);
        match (offset, data.len()) {
            (0x00, 4) => self.device_feature_select = narrow::low_u32(v),
            (0x08, 4) => self.driver_feature_select = narrow::low_u32(v),
            (0x0c, 4) => self
                .state
                .write_driver_features(self.driver_feature_select, narrow::low_u32(v)),
            (0x10, 2) => self
                .interrupt
                .config_vector
                .store(self.checked_vector(narrow::low_u16(v)), Ordering::SeqCst),
            (0x14, 1) => {
                self.state
                    .write_status(narrow::low_u32(v), &self.device_interrupt);
                if v == 0 && self.state.status() == 0 {
                    self.reset_registers();
                }
            }
            (0x16, 2) => self.queue_select = narrow::low_u16(v),
            (0x18, 2) => {
                if let Some(q) = self.state.configurable_queue(sel) {
                    q.set_size(narrow::low_u16(v));
                }
            }
            (0x1a, 2) => {
                let vector = self.checked_vector(narrow::low_u16(v));
                if let Some(slot) = self
                    .interrupt
                    .queue_vectors
                    .get(usize::from(self.queue_select))
                {
                    slot.store(vector, Ordering::SeqCst);
                }
            }
            (0x1c, 2) => {
                if let Some(q) = self.state.configurable_queue(sel) {
                    q.set_ready(v == 1);
                }
            }
            (0x20 | 0x24 | 0x28 | 0x2c | 0x30 | 0x34, 4) | (0x20 | 0x28 | 0x30, 8) => {
                let Some(q) = self.state.configurable_queue(sel) else {
                    return;
                };
                let (lo, hi) = match (data.len(), offset % 8) {
                    (8, _) => (Some(narrow::low_u32(v)), Some((v >> 32) as u32)),
                    (_, 0) => (Some(narrow::low_u32(v)), None),
                    _ => (None, Some(narrow::low_u32(v))),
                };
                set_queue_address(q, offset & !7, lo, hi);
            }
            _ => tracing::debug!(
                "virtio-pci: {}-byte write {v:#x} to common config {offset:#x} ignored",
                data.len()
            ),
        }
    }

    /// A vector past the table reads back as NO_VECTOR, which tells the
    /// driver the assignment failed.
    fn checked_vector(&self, vector: u16) -> u16 {
        let count = self
            .interrupt
            .msix
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .vectors();
        if vector < count {
            vector
        } else {
            VIRTIO_MSI_NO_VECTOR
        }
    }

    fn reset_registers(&mut self) {
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.queue_select = 0;
        self.interrupt.isr.store(0, Ordering::SeqCst);
        self.interrupt
            .config_vector
            .store(VIRTIO_MSI_NO_VECTOR, Ordering::SeqCst);
        for v in &self.interrupt.queue_vectors {
            v.store(VIRTIO_MSI_NO_VECTOR, Ordering::SeqCst);
        }
        self.config_generation = self.config_generation.wrapping_add(1);
    }
}

fn set_queue_address(q: &mut Queue, which: u64, lo: Option<u32>, hi: Option<u32>) {
    match which {
        0x20 => q.set_desc_table_address(lo, hi),
        0x28 => q.set_avail_ring_address(lo, hi),
        _ => q.set_used_ring_address(lo, hi),
    }
}

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;
