//! A transport's saved state, for a snapshot or a migration, and the
//! pause, resume, save and restore every transport does the same way.
//!
//! Pausing goes through the transport's activator, behind any activation
//! or reset the driver asked for before, so the device is paused in a
//! settled phase; the device hands back the positions of its running
//! queues. Saving (while paused) keeps those positions, the registers the
//! driver wrote, the features it acked and the device's own part.
//!
//! Restoring is done on a transport built again from the same
//! configuration, before any vCPU runs: every part is checked before any
//! is applied (a bad field is refused by name and nothing changes), then
//! the device restores its own part, the registers are set, and a device
//! that was running is activated with the saved queue positions, through
//! the same job DRIVER_OK runs, without the driver writing the status
//! again.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestAddressSpace;

use super::common::{lock, VirtioState, ACTIVE, FAILED};
use super::mmio::MmioTransport;
use crate::device::{ActivatedQueue, VirtioInterrupt};
use crate::device_state::{DeviceStateError, SavedQueue};

/// How long a pause or a restored activation may wait for the activator
/// (behind an activation that waits for a vhost-user daemon, itself bounded).
const ACTIVATOR_WAIT: Duration = Duration::from_secs(30);

/// Why a transport could not be paused, saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum TransportStateError {
    /// A saved field that does not fit this transport or its device.
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    /// The PCI configuration or MSI-X part (names its field).
    #[error("registers: {0}")]
    Pci(#[from] pci::state::PciStateError),
    #[error("device: {0}")]
    Device(#[from] DeviceStateError),
    #[error("the transport must be paused before it is saved")]
    NotPaused,
    #[error("{what}: the device's activator did not answer within {ACTIVATOR_WAIT:?}")]
    ActivatorTimeout { what: &'static str },
    #[error("the restored device failed to activate with its saved queues (its error is logged)")]
    Activation,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> TransportStateError {
    TransportStateError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// A queue's registers as the driver wrote them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueRegisters {
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

/// The registers every transport has: status, the driver's features, and
/// each queue's registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioRegisters {
    pub status: u32,
    pub driver_features: u64,
    /// The device had failed (the driver sees NEEDS_RESET until it resets).
    pub failed: bool,
    pub queues: Vec<QueueRegisters>,
}

/// One transport's state: its registers `R`, the positions of the queues
/// the device was running, the features the driver acked and the device's
/// own part.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportState<R> {
    pub registers: R,
    pub queues: Vec<SavedQueue>,
    pub acked_features: u64,
    pub device: serde_json::Value,
}

/// The virtio-MMIO transport's own registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioRegisters {
    pub virtio: VirtioRegisters,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub queue_sel: u32,
    pub shm_sel: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
}

pub type MmioTransportState = TransportState<MmioRegisters>;

/// What a checked state turns into: the queues' register view and, for a
/// device that was running, the queues to activate it with.
pub(super) struct CheckedVirtio {
    view: Vec<Queue>,
    activate: Option<Vec<ActivatedQueue>>,
}

/// Status bits a driver can have set.
const STATUS_BITS: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE
    | VIRTIO_CONFIG_S_DRIVER
    | VIRTIO_CONFIG_S_FEATURES_OK
    | VIRTIO_CONFIG_S_DRIVER_OK
    | VIRTIO_CONFIG_S_FAILED;

fn queue_registers(q: &Queue) -> QueueRegisters {
    QueueRegisters {
        size: q.size(),
        ready: q.ready(),
        desc_table: q.desc_table(),
        avail_ring: q.avail_ring(),
        used_ring: q.used_ring(),
    }
}

impl VirtioState {
    /// Runs `job` on the activator, behind whatever it was given before,
    /// and waits (bounded) for its answer.
    fn on_activator<T: Send + 'static>(
        &self,
        what: &'static str,
        job: impl FnOnce() -> T + Send + 'static,
        unanswered: impl FnOnce(T) + Send + 'static,
    ) -> Result<T, TransportStateError> {
        let (tx, rx) = mpsc::channel();
        self.activator.run(Box::new(move || {
            // Nobody waits any more (timed out): undo what was done.
            if let Err(mpsc::SendError(result)) = tx.send(job()) {
                unanswered(result);
            }
        }));
        rx.recv_timeout(ACTIVATOR_WAIT)
            .map_err(|_| TransportStateError::ActivatorTimeout { what })
    }

    /// Stops the device serving; keeps the positions of its queues.
    pub fn pause(&mut self) -> Result<(), TransportStateError> {
        if self.paused.is_some() {
            return Ok(());
        }
        let device = self.device.clone();
        let undo = self.device.clone();
        let queues = self.on_activator(
            "pause",
            move || lock(&device).pause(),
            move |paused| {
                if paused.is_ok() {
                    if let Err(e) = lock(&undo).resume() {
                        crate::error_limited!("virtio: resuming after a late pause: {e}");
                    }
                }
            },
        )??;
        self.paused = Some(queues);
        Ok(())
    }

    /// Lets the device serve again.
    pub fn resume(&mut self) -> Result<(), TransportStateError> {
        if self.paused.is_none() {
            return Ok(());
        }
        self.device().resume()?;
        self.paused = None;
        Ok(())
    }

    /// The registers, the paused queues' positions, the acked features and
    /// the device's own part.
    pub fn save(&mut self) -> Result<TransportState<VirtioRegisters>, TransportStateError> {
        let queues = self.paused.clone().ok_or(TransportStateError::NotPaused)?;
        let running = self.phase.load(Ordering::SeqCst) == ACTIVE;
        let activated = self.queues.iter().filter(|q| q.ready()).count();
        if running && queues.len() != activated {
            return Err(invalid(
                "queues",
                format!(
                    "the device gave back {} queue positions, {activated} queues were activated",
                    queues.len()
                ),
            ));
        }
        let device = self.device().save_state()?;
        let acked_features = if self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            self.driver_features
        } else {
            0
        };
        Ok(TransportState {
            registers: VirtioRegisters {
                status: self.status,
                driver_features: self.driver_features,
                failed: self.phase.load(Ordering::SeqCst) == FAILED,
                queues: self.queues.iter().map(queue_registers).collect(),
            },
            queues: if running { queues } else { Vec::new() },
            acked_features,
            device,
        })
    }

    /// Checks `state` against this transport and its device, changing
    /// nothing.
    pub(super) fn check<R>(
        &self,
        state: &TransportState<R>,
        registers: &VirtioRegisters,
    ) -> Result<CheckedVirtio, TransportStateError> {
        let field = |f: &str| format!("registers.virtio.{f}");
        if self.is_activated() || self.status != 0 {
            return Err(invalid(
                "registers.virtio.status",
                "the transport is in use: a state is restored onto a fresh one",
            ));
        }
        if registers.queues.len() != self.queues.len() {
            return Err(invalid(
                field("queues"),
                format!(
                    "{} queues, this device has {}",
                    registers.queues.len(),
                    self.queues.len()
                ),
            ));
        }
        let mut view = Vec::with_capacity(self.queues.len());
        for (i, (r, built)) in registers.queues.iter().zip(&self.queues).enumerate() {
            let q = Queue::try_from(QueueState {
                max_size: built.max_size(),
                size: r.size,
                ready: r.ready,
                desc_table: r.desc_table,
                avail_ring: r.avail_ring,
                used_ring: r.used_ring,
                ..Default::default()
            })
            .map_err(|e| invalid(field(&format!("queues[{i}]")), format!("{e:?}")))?;
            view.push(q);
        }
        let status = registers.status;
        if status & !STATUS_BITS != 0 {
            return Err(invalid(
                field("status"),
                format!("unknown bits in {status:#x}"),
            ));
        }
        let features_ok = status & VIRTIO_CONFIG_S_FEATURES_OK != 0;
        let driver_ok = status & VIRTIO_CONFIG_S_DRIVER_OK != 0;
        if driver_ok && !features_ok {
            return Err(invalid(field("status"), "DRIVER_OK without FEATURES_OK"));
        }
        let offered = self.device().features();
        if registers.driver_features & !offered != 0 {
            return Err(invalid(
                field("driver_features"),
                format!(
                    "{:#x} has bits the device does not offer ({offered:#x})",
                    registers.driver_features
                ),
            ));
        }
        let acked = if features_ok {
            registers.driver_features
        } else {
            0
        };
        if state.acked_features != acked {
            return Err(invalid(
                "acked_features",
                format!("{:#x}, the registers say {acked:#x}", state.acked_features),
            ));
        }
        let running = driver_ok && !registers.failed;
        if !running {
            if !state.queues.is_empty() {
                return Err(invalid(
                    "queues",
                    "queue positions for a device that was not running",
                ));
            }
            return Ok(CheckedVirtio {
                view,
                activate: None,
            });
        }
        let ready: Vec<usize> = (0..view.len()).filter(|&i| view[i].ready()).collect();
        if state.queues.len() != ready.len() {
            return Err(invalid(
                "queues",
                format!(
                    "{} queue positions for {} ready queues",
                    state.queues.len(),
                    ready.len()
                ),
            ));
        }
        let mem = self.mem.memory();
        let mut activated = Vec::with_capacity(ready.len());
        for (k, (saved, &index)) in state.queues.iter().zip(&ready).enumerate() {
            let name = format!("queues[{k}]");
            let queue = saved
                .to_queue()
                .map_err(|e| invalid(name.as_str(), e.to_string()))?;
            if queue_registers(&queue) != queue_registers(&view[index])
                || queue.max_size() != view[index].max_size()
            {
                return Err(invalid(
                    name,
                    format!("does not match the registers of queue {index}"),
                ));
            }
            if !queue.is_valid(&*mem) {
                return Err(invalid(
                    name,
                    "not valid in guest memory (addresses, alignment or size)",
                ));
            }
            let kick = self.kicks[index]
                .try_clone()
                .map_err(|e| invalid(name, format!("cloning its eventfd: {e}")))?;
            activated.push(ActivatedQueue {
                index: narrow::sat_u16(index),
                queue,
                kick,
            });
        }
        Ok(CheckedVirtio {
            view,
            activate: Some(activated),
        })
    }

    /// Applies a checked state (after the device restored its own part):
    /// registers, acked features, and a device that was running is
    /// activated with its saved queues; waits (bounded) for that.
    pub(super) fn apply(
        &mut self,
        checked: CheckedVirtio,
        registers: &VirtioRegisters,
        acked_features: u64,
        interrupt: &Arc<dyn VirtioInterrupt>,
    ) -> Result<(), TransportStateError> {
        self.queues = checked.view;
        self.status = registers.status;
        self.driver_features = registers.driver_features;
        if registers.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            self.device().ack_features(acked_features);
        }
        if registers.failed {
            self.phase.store(FAILED, Ordering::SeqCst);
        }
        let Some(activated) = checked.activate else {
            return Ok(());
        };
        self.start_activation(activated, interrupt);
        let phase = self.phase.clone();
        let settled =
            self.on_activator("activation", move || phase.load(Ordering::SeqCst), |_| ())?;
        if settled == ACTIVE {
            Ok(())
        } else {
            Err(TransportStateError::Activation)
        }
    }
}

impl MmioTransport {
    /// Whether [`MmioTransport::restore`] would take `state`, changing
    /// nothing (the device's own part is checked by the device when it
    /// restores it).
    pub fn check_restore(&self, state: &MmioTransportState) -> Result<(), TransportStateError> {
        self.state.check(state, &state.registers.virtio).map(drop)
    }

    /// Whether the device can be carried by a snapshot or a migration.
    pub fn check_movable(&self) -> Result<(), DeviceStateError> {
        self.state.device().check_movable()
    }

    /// See [`crate::device::VirtioDevice::release_backend`]: a local migration's source,
    /// once the state is sent.
    pub fn release_backend(&self) {
        self.state.device().release_backend();
    }

    /// See [`crate::device::VirtioDevice::release_for_switch`]: a migration's
    /// switch over the network, the device paused and saved.
    pub fn release_for_switch(&self) -> Result<bool, DeviceStateError> {
        self.state.device().release_for_switch()
    }

    /// See [`crate::device::VirtioDevice::reclaim_after_switch`]: that
    /// migration failed.
    pub fn reclaim_after_switch(&self) -> Result<Option<std::os::fd::OwnedFd>, DeviceStateError> {
        self.state.device().reclaim_after_switch()
    }

    pub fn pause(&mut self) -> Result<(), TransportStateError> {
        self.state.pause()
    }

    pub fn resume(&mut self) -> Result<(), TransportStateError> {
        self.state.resume()
    }

    /// The transport's state; the transport must be paused.
    pub fn save(&mut self) -> Result<MmioTransportState, TransportStateError> {
        let s = self.state.save()?;
        Ok(TransportState {
            registers: MmioRegisters {
                virtio: s.registers,
                device_features_sel: self.device_features_sel,
                driver_features_sel: self.driver_features_sel,
                queue_sel: self.queue_sel,
                shm_sel: self.shm_sel,
                config_generation: self.config_generation,
                interrupt_status: self.interrupt.status.load(Ordering::SeqCst),
            },
            queues: s.queues,
            acked_features: s.acked_features,
            device: s.device,
        })
    }

    /// Restores `state` onto this freshly built transport: checked first
    /// (nothing changes if a field is refused), then the device's own
    /// part, the registers, and the activation of a running device.
    pub fn restore(&mut self, state: &MmioTransportState) -> Result<(), TransportStateError> {
        let r = &state.registers;
        let checked = self.state.check(state, &r.virtio)?;
        self.state.device().restore_state(&state.device)?;
        self.device_features_sel = r.device_features_sel;
        self.driver_features_sel = r.driver_features_sel;
        self.queue_sel = r.queue_sel;
        self.shm_sel = r.shm_sel;
        self.config_generation = r.config_generation;
        self.interrupt
            .status
            .store(r.interrupt_status, Ordering::SeqCst);
        self.state.apply(
            checked,
            &r.virtio,
            state.acked_features,
            &self.device_interrupt,
        )
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
pub(crate) mod tests;
