//! virtio-MMIO, version 2 (virtio 1.2 §4.2.2), with the shared memory
//! region registers (SHMSel, SHMLen, SHMBase).
//!
//! The VMM places the 4 KiB register page on its MMIO bus, registers one
//! ioeventfd per queue on QueueNotify and an irqfd for the interrupt, and
//! describes the device in the DSDT (`LNRO0005`) so Linux's `virtio_mmio`
//! module finds it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use super::common::VirtioState;
use crate::device::{Interrupt, VirtioDevice, VirtioInterrupt};
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
    pub(super) status: AtomicU32,
    irqfd: EventFd,
}

impl MmioInterrupt {
    pub fn new(irqfd: EventFd) -> Self {
        MmioInterrupt {
            status: AtomicU32::new(0),
            irqfd,
        }
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
    pub(super) state: VirtioState,
    pub(super) interrupt: Arc<MmioInterrupt>,
    /// The same interrupt, as the device sees it.
    pub(super) device_interrupt: Arc<dyn VirtioInterrupt>,
    pub(super) device_features_sel: u32,
    pub(super) driver_features_sel: u32,
    pub(super) queue_sel: u32,
    pub(super) shm_sel: u32,
    pub(super) config_generation: u32,
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        irqfd: EventFd,
    ) -> std::io::Result<Self> {
        let interrupt = Arc::new(MmioInterrupt::new(irqfd));
        Ok(MmioTransport {
            state: VirtioState::new(device, mem)?,
            device_interrupt: interrupt.clone(),
            interrupt,
            device_features_sel: 0,
            driver_features_sel: 0,
            queue_sel: 0,
            shm_sel: 0,
            config_generation: 0,
        })
    }

    /// (eventfd, offset of QueueNotify, queue index): the VMM registers each
    /// as an ioeventfd with datamatch so a notification never leaves KVM.
    pub fn queue_notifiers(&self) -> Vec<(&EventFd, u64, u32)> {
        self.state
            .kicks()
            .iter()
            .enumerate()
            .map(|(i, fd)| (fd, reg::QUEUE_NOTIFY, narrow::sat_u32(i)))
            .collect()
    }

    /// The device (waits while an activation or reset runs on it).
    pub fn device(&self) -> std::sync::MutexGuard<'_, Box<dyn VirtioDevice>> {
        self.state.device()
    }

    /// Where activations and resets run (see `transport::common`).
    pub fn set_activator(&mut self, activator: Arc<dyn crate::transport::common::Activator>) {
        self.state.set_activator(activator);
    }

    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.state.device().read_config(offset - reg::CONFIG, data);
            return;
        }
        // Registers below the config space are 32 bits wide and aligned.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            tracing::debug!(
                "virtio-mmio: {}-byte read at {offset:#x} ignored",
                data.len()
            );
            data.fill(0);
            return;
        }
        let value = match offset {
            reg::MAGIC => MAGIC,
            reg::VERSION => VERSION,
            reg::DEVICE_ID => self.state.device().device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => narrow::low_u32(self.state.device().features()),
                1 => (self.state.device().features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self
                .state
                .queue(self.queue_sel)
                .map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => self
                .state
                .queue(self.queue_sel)
                .map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status.load(Ordering::SeqCst),
            reg::STATUS => self.state.status(),
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH | reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => {
                self.read_shm(offset)
            }
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// The selected region's length and base; an id with no region reads
    /// length (and base) all ones.
    fn read_shm(&self, offset: u64) -> u32 {
        let region = self
            .state
            .device()
            .shm_regions()
            .into_iter()
            .find(|r| u32::from(r.id) == self.shm_sel);
        let (len, base) = region.map_or((u64::MAX, u64::MAX), |r| (r.len, r.guest_addr));
        match offset {
            reg::SHM_LEN_LOW => narrow::low_u32(len),
            reg::SHM_LEN_HIGH => (len >> 32) as u32,
            reg::SHM_BASE_LOW => narrow::low_u32(base),
            _ => (base >> 32) as u32,
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.state.device().write_config(offset - reg::CONFIG, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::debug!(
                "virtio-mmio: {}-byte write at {offset:#x} ignored",
                data.len()
            );
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        let v = u32::from_le_bytes(bytes);
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => self
                .state
                .write_driver_features(self.driver_features_sel, v),
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => {
                if let Some(q) = self.state.configurable_queue(self.queue_sel) {
                    q.set_size(narrow::low_u16(u64::from(v)));
                }
            }
            reg::QUEUE_READY => {
                if let Some(q) = self.state.configurable_queue(self.queue_sel) {
                    q.set_ready(v == 1);
                }
            }
            reg::QUEUE_DESC_LOW => self.set_queue_addr(|q| q.set_desc_table_address(Some(v), None)),
            reg::QUEUE_DESC_HIGH => {
                self.set_queue_addr(|q| q.set_desc_table_address(None, Some(v)))
            }
            reg::QUEUE_DRIVER_LOW => {
                self.set_queue_addr(|q| q.set_avail_ring_address(Some(v), None))
            }
            reg::QUEUE_DRIVER_HIGH => {
                self.set_queue_addr(|q| q.set_avail_ring_address(None, Some(v)))
            }
            reg::QUEUE_DEVICE_LOW => {
                self.set_queue_addr(|q| q.set_used_ring_address(Some(v), None))
            }
            reg::QUEUE_DEVICE_HIGH => {
                self.set_queue_addr(|q| q.set_used_ring_address(None, Some(v)))
            }
            reg::QUEUE_NOTIFY => {
                // Reached only when no ioeventfd caught the write.
                if let Some(kick) = self.state.kicks().get(v as usize) {
                    let _ = kick.write(1);
                }
            }
            reg::INTERRUPT_ACK => {
                self.interrupt.status.fetch_and(!v, Ordering::SeqCst);
            }
            reg::STATUS => {
                self.state.write_status(v, &self.device_interrupt);
                if v == 0 {
                    self.reset_registers();
                }
            }
            reg::SHM_SEL => self.shm_sel = v,
            _ => tracing::debug!(
                "virtio-mmio: write {v:#x} to read-only or unknown register {offset:#x}"
            ),
        }
    }

    fn set_queue_addr(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.state.configurable_queue(self.queue_sel) {
            f(q);
        }
    }

    /// The transport's own registers after a device reset.
    fn reset_registers(&mut self) {
        if self.state.status() != 0 {
            return; // the device refused the reset
        }
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.shm_sel = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
    }

    pub fn status(&self) -> u32 {
        self.state.status()
    }

    pub fn is_activated(&self) -> bool {
        self.state.is_activated()
    }
}

#[cfg(test)]
#[path = "mmio_tests.rs"]
mod tests;
