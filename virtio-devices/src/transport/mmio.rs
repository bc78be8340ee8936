//! virtio-MMIO, version 2 (virtio 1.2 §4.2.2), with the shared memory
//! region registers (SHMSel, SHMLen, SHMBase).
//!
//! The VMM places the 4 KiB register page on its MMIO bus, registers one
//! ioeventfd per queue on QueueNotify and an irqfd for the interrupt, and
//! describes the device in the DSDT (`LNRO0005`) so Linux's `virtio_mmio`
//! module finds it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivatedQueue, Interrupt, VirtioDevice, VirtioInterrupt};
use crate::GuestMemoryMmap;

/// Size of the register page.
pub const MMIO_REGION_SIZE: u64 = 0x1000;
const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
/// Vendor id reported to the driver ("DAXV").
const VENDOR_ID: u32 = 0x5658_4144;

mod reg {
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const SHM_SEL: u64 = 0x0ac;
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    pub const SHM_BASE_LOW: u64 = 0x0b8;
    pub const SHM_BASE_HIGH: u64 = 0x0bc;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// InterruptStatus bits.
const INT_USED_RING: u32 = 1;
const INT_CONFIG: u32 = 2;

/// The interrupt of one MMIO device: a status word the driver reads and
/// acknowledges, and the irqfd wired to its IOAPIC line.
pub struct MmioInterrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl MmioInterrupt {
    pub fn new(irqfd: EventFd) -> Self {
        MmioInterrupt { status: AtomicU32::new(0), irqfd }
    }
}

impl VirtioInterrupt for MmioInterrupt {
    fn trigger(&self, interrupt: Interrupt) -> std::io::Result<()> {
        let bit = match interrupt {
            Interrupt::Queue(_) => INT_USED_RING,
            Interrupt::Config => INT_CONFIG,
        };
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irqfd.write(1)
    }

    /// None: the driver reads InterruptStatus to learn why it was
    /// interrupted, so a signal that bypasses the VMM would be ignored. A
    /// vhost-user device relays its backend's signals through `trigger`.
    fn notifier(&self, _interrupt: Interrupt) -> Option<EventFd> {
        None
    }
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<MmioInterrupt>,
    queues: Vec<Queue>,
    kicks: Vec<EventFd>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    shm_sel: u32,
    config_generation: u32,
    activated: bool,
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        irqfd: EventFd,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::new();
        let mut kicks = Vec::new();
        for &max in device.queue_max_sizes() {
            let q = Queue::new(max).map_err(|e| std::io::Error::other(format!("queue of size {max}: {e:?}")))?;
            queues.push(q);
            kicks.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(MmioTransport {
            device,
            mem,
            interrupt: Arc::new(MmioInterrupt::new(irqfd)),
            queues,
            kicks,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            shm_sel: 0,
            config_generation: 0,
            activated: false,
        })
    }

    /// (eventfd, offset of QueueNotify, queue index): the VMM registers each
    /// as an ioeventfd with datamatch so a notification never leaves KVM.
    pub fn queue_notifiers(&self) -> Vec<(&EventFd, u64, u32)> {
        self.kicks.iter().enumerate().map(|(i, fd)| (fd, reg::QUEUE_NOTIFY, i as u32)).collect()
    }

    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may change only before the queue is enabled.
    fn configurable_queue(&mut self) -> Option<&mut Queue> {
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            return None;
        }
        self.selected_queue().filter(|q| !q.ready())
    }

    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        // Registers below the config space are 32 bits wide and aligned.
        if data.len() != 4 || offset % 4 != 0 {
            log::debug!("virtio-mmio: {}-byte read at {offset:#x} ignored", data.len());
            data.fill(0);
            return;
        }
        let value = match offset {
            reg::MAGIC => MAGIC,
            reg::VERSION => VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status.load(Ordering::SeqCst),
            reg::STATUS => self.status,
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH | reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => self.read_shm(offset),
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// The selected region's length and base; an id with no region reads
    /// length (and base) all ones.
    fn read_shm(&self, offset: u64) -> u32 {
        let region = self.device.shm_regions().into_iter().find(|r| u32::from(r.id) == self.shm_sel);
        let (len, base) = region.map_or((u64::MAX, u64::MAX), |r| (r.len, r.guest_addr));
        match offset {
            reg::SHM_LEN_LOW => len as u32,
            reg::SHM_LEN_HIGH => (len >> 32) as u32,
            reg::SHM_BASE_LOW => base as u32,
            _ => (base >> 32) as u32,
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.device.write_config(offset - reg::CONFIG, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            log::debug!("virtio-mmio: {}-byte write at {offset:#x} ignored", data.len());
            return;
        };
        if offset % 4 != 0 {
            return;
        }
        let v = u32::from_le_bytes(bytes);
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => self.write_driver_features(v),
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => {
                if let Some(q) = self.configurable_queue() {
                    q.set_size(v as u16);
                }
            }
            reg::QUEUE_READY => {
                if let Some(q) = self.configurable_queue() {
                    q.set_ready(v == 1);
                }
            }
            reg::QUEUE_DESC_LOW => self.set_queue_addr(|q| q.set_desc_table_address(Some(v), None)),
            reg::QUEUE_DESC_HIGH => self.set_queue_addr(|q| q.set_desc_table_address(None, Some(v))),
            reg::QUEUE_DRIVER_LOW => self.set_queue_addr(|q| q.set_avail_ring_address(Some(v), None)),
            reg::QUEUE_DRIVER_HIGH => self.set_queue_addr(|q| q.set_avail_ring_address(None, Some(v))),
            reg::QUEUE_DEVICE_LOW => self.set_queue_addr(|q| q.set_used_ring_address(Some(v), None)),
            reg::QUEUE_DEVICE_HIGH => self.set_queue_addr(|q| q.set_used_ring_address(None, Some(v))),
            reg::QUEUE_NOTIFY => {
                // Reached only when no ioeventfd caught the write.
                if let Some(kick) = self.kicks.get(v as usize) {
                    let _ = kick.write(1);
                }
            }
            reg::INTERRUPT_ACK => {
                self.interrupt.status.fetch_and(!v, Ordering::SeqCst);
            }
            reg::STATUS => self.write_status(v),
            reg::SHM_SEL => self.shm_sel = v,
            _ => log::debug!("virtio-mmio: write {v:#x} to read-only or unknown register {offset:#x}"),
        }
    }

    fn set_queue_addr(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.configurable_queue() {
            f(q);
        }
    }

    fn write_driver_features(&mut self, v: u32) {
        // Features are negotiated between DRIVER and FEATURES_OK only.
        if self.status & VIRTIO_CONFIG_S_DRIVER == 0 || self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            return;
        }
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v),
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32),
            _ => {}
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let new_bits = v & !self.status;
        // The driver may only add bits, in order.
        if v & self.status != self.status {
            log::debug!("virtio-mmio: status {v:#x} clears bits of {:#x}; ignored", self.status);
            return;
        }
        if new_bits & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            let valid = self.driver_features & !offered == 0 && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !valid {
                // Leaving FEATURES_OK clear tells the driver the set was refused.
                log::warn!(
                    "virtio-mmio: driver features {:#x} refused (offered {offered:#x}, VERSION_1 required)",
                    self.driver_features
                );
                self.status = v & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
            self.device.ack_features(self.driver_features);
        }
        self.status = v;
        if new_bits & VIRTIO_CONFIG_S_DRIVER_OK != 0 && !self.activated {
            self.activate();
        }
    }

    fn activate(&mut self) {
        if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            self.fail("DRIVER_OK without FEATURES_OK");
            return;
        }
        let mem = self.mem.memory();
        let mut activated = Vec::new();
        for (i, q) in self.queues.iter().enumerate() {
            if !q.ready() {
                continue;
            }
            if !q.is_valid(&*mem) {
                self.fail(&format!("queue {i} is not valid (addresses, alignment or size)"));
                return;
            }
            let kick = match self.kicks[i].try_clone() {
                Ok(k) => k,
                Err(e) => return self.fail(&format!("cloning queue {i}'s eventfd: {e}")),
            };
            // The device gets its own copy of the queue state; the transport
            // keeps the registers the driver reads back.
            let queue = match Queue::try_from(q.state()) {
                Ok(queue) => queue,
                Err(e) => return self.fail(&format!("queue {i}: {e:?}")),
            };
            activated.push(ActivatedQueue { index: i as u16, queue, kick });
        }
        match self.device.activate(self.mem.clone(), self.interrupt.clone(), activated) {
            Ok(()) => self.activated = true,
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// Tells the driver the device is broken until it resets it.
    fn fail(&mut self, why: &str) {
        log::error!("virtio-mmio device type {}: {why}", self.device.device_type());
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        let _ = self.interrupt.trigger(Interrupt::Config);
    }

    fn reset(&mut self) {
        if self.activated && !self.device.reset() {
            log::warn!("virtio-mmio device type {} cannot be reset", self.device.device_type());
            self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            return;
        }
        self.activated = false;
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.driver_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.shm_sel = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub fn is_activated(&self) -> bool {
        self.activated
    }
}

#[cfg(test)]
#[path = "mmio_tests.rs"]
mod tests;
