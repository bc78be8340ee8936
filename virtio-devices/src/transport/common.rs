//! What every virtio transport does the same way: the device status state
//! machine, feature negotiation, queue state before activation, activation,
//! reset. A transport maps its registers onto this.

use std::sync::Arc;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivatedQueue, Interrupt, VirtioDevice, VirtioInterrupt};
use crate::GuestMemoryMmap;

pub struct VirtioState {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    queues: Vec<Queue>,
    kicks: Vec<EventFd>,
    status: u32,
    driver_features: u64,
    activated: bool,
}

impl VirtioState {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::new();
        let mut kicks = Vec::new();
        for &max in device.queue_max_sizes() {
            let q = Queue::new(max)
                .map_err(|e| std::io::Error::other(format!("queue of size {max}: {e:?}")))?;
            queues.push(q);
            kicks.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(VirtioState {
            device,
            mem,
            queues,
            kicks,
            status: 0,
            driver_features: 0,
            activated: false,
        })
    }

    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    pub fn status(&self) -> u32 {
        if self.activated && self.device.needs_reset() {
            return self.status | VIRTIO_CONFIG_S_NEEDS_RESET;
        }
        self.status
    }

    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// One eventfd per queue; guest notifications arrive on them.
    pub fn kicks(&self) -> &[EventFd] {
        &self.kicks
    }

    pub fn queue(&self, index: u32) -> Option<&Queue> {
        self.queues.get(index as usize)
    }

    /// A queue whose registers the driver may still change: before
    /// DRIVER_OK and before the queue is enabled.
    pub fn configurable_queue(&mut self, index: u32) -> Option<&mut Queue> {
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            return None;
        }
        self.queues.get_mut(index as usize).filter(|q| !q.ready())
    }

    /// Half `select` (0 low, 1 high) of the features the driver wants;
    /// ignored outside the DRIVER..FEATURES_OK window.
    pub fn write_driver_features(&mut self, select: u32, value: u32) {
        if self.status & VIRTIO_CONFIG_S_DRIVER == 0
            || self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
        {
            return;
        }
        match select {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value),
            1 => {
                self.driver_features =
                    (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
            }
            _ => {}
        }
    }

    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// The driver wrote the status register. 0 resets the device.
    pub fn write_status(&mut self, v: u32, interrupt: &Arc<dyn VirtioInterrupt>) {
        if v == 0 {
            self.reset();
            return;
        }
        let new_bits = v & !self.status;
        // The driver may only add bits, in order.
        if v & self.status != self.status {
            log::debug!(
                "virtio: status {v:#x} clears bits of {:#x}; ignored",
                self.status
            );
            return;
        }
        if new_bits & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            let valid = self.driver_features & !offered == 0
                && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !valid {
                // Leaving FEATURES_OK clear tells the driver the set was refused.
                log::warn!(
                    "virtio: driver features {:#x} refused (offered {offered:#x}, VERSION_1 required)",
                    self.driver_features
                );
                self.status = v & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
            self.device.ack_features(self.driver_features);
        }
        self.status = v;
        if new_bits & VIRTIO_CONFIG_S_DRIVER_OK != 0 && !self.activated {
            self.activate(interrupt);
        }
    }

    fn activate(&mut self, interrupt: &Arc<dyn VirtioInterrupt>) {
        if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            return self.fail("DRIVER_OK without FEATURES_OK", interrupt);
        }
        let mem = self.mem.memory();
        let mut activated = Vec::new();
        for (i, q) in self.queues.iter().enumerate() {
            if !q.ready() {
                continue;
            }
            if !q.is_valid(&*mem) {
                return self.fail(
                    &format!("queue {i} is not valid (addresses, alignment or size)"),
                    interrupt,
                );
            }
            // The device gets its own copy of the queue state; the transport
            // keeps the registers the driver reads back.
            let queue = match Queue::try_from(q.state()) {
                Ok(queue) => queue,
                Err(e) => return self.fail(&format!("queue {i}: {e:?}"), interrupt),
            };
            let kick = match self.kicks[i].try_clone() {
                Ok(k) => k,
                Err(e) => {
                    return self.fail(&format!("cloning queue {i}'s eventfd: {e}"), interrupt)
                }
            };
            activated.push(ActivatedQueue {
                index: i as u16,
                queue,
                kick,
            });
        }
        match self
            .device
            .activate(self.mem.clone(), interrupt.clone(), activated)
        {
            Ok(()) => self.activated = true,
            Err(e) => self.fail(&e.to_string(), interrupt),
        }
    }

    /// Tells the driver the device is broken until it resets it.
    fn fail(&mut self, why: &str, interrupt: &Arc<dyn VirtioInterrupt>) {
        log::error!("virtio device type {}: {why}", self.device.device_type());
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        let _ = interrupt.trigger(Interrupt::Config);
    }

    /// Returns false (and sets NEEDS_RESET) when the device cannot be reset.
    fn reset(&mut self) -> bool {
        if self.activated && !self.device.reset() {
            log::warn!(
                "virtio device type {} cannot be reset",
                self.device.device_type()
            );
            self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            return false;
        }
        self.activated = false;
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.driver_features = 0;
        true
    }
}
