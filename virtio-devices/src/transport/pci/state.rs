//! The virtio-PCI transport's saved state: configuration space (with the
//! BAR addresses the guest chose), MSI-X table, the common configuration's
//! selectors and vectors, and what every transport saves
//! ([`crate::transport::state`]).
//!
//! Restoring routes every programmed MSI-X vector again through the
//! transport's [`MsiSender`](super::device::MsiSender) (KVM's routing
//! table is write-only: the VMM rebuilds it from the restored tables) and
//! sets each vector's mask, before a running device is activated, so the
//! device finds its vectors' notifiers as they were.

use std::sync::atomic::Ordering;

use pci::msix::{MsixEntry, MsixUpdate, VIRTIO_MSI_NO_VECTOR};
use pci::state::{MsixState, PciConfigurationState};
use serde::{Deserialize, Serialize};

use super::device::VirtioPciDevice;
use crate::device_state::DeviceStateError;
use crate::transport::state::{
    CheckedVirtio, TransportState, TransportStateError, VirtioRegisters,
};

/// The virtio-PCI transport's own registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciRegisters {
    pub config: PciConfigurationState,
    pub msix: MsixState,
    pub virtio: VirtioRegisters,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub queue_select: u16,
    pub config_generation: u8,
    pub config_vector: u16,
    pub queue_vectors: Vec<u16>,
    pub isr: u8,
}

pub type PciTransportState = TransportState<PciRegisters>;

/// An entry as MSI-X starts it: masked, nothing programmed. Such entries
/// were never routed.
fn untouched(entry: &MsixEntry) -> bool {
    *entry
        == MsixEntry {
            control: 1,
            ..Default::default()
        }
}

impl VirtioPciDevice {
    pub fn pause(&mut self) -> Result<(), TransportStateError> {
        self.state.pause()
    }

    pub fn resume(&mut self) -> Result<(), TransportStateError> {
        self.state.resume()
    }

    /// The transport's state; the transport must be paused.
    pub fn save(&mut self) -> Result<PciTransportState, TransportStateError> {
        let s = self.state.save()?;
        let msix = {
            let mut msix = self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // A backend's notifier write held back on a masked vector is
            // pending: into the PBA with it, or the snapshot loses it.
            for vector in 0..msix.vectors() {
                if msix.masked(vector) && self.interrupt.sender.take_pending(vector) {
                    msix.trigger(vector);
                }
            }
            msix.save()
        };
        Ok(TransportState {
            registers: PciRegisters {
                config: self.config.save(),
                msix,
                virtio: s.registers,
                device_feature_select: self.device_feature_select,
                driver_feature_select: self.driver_feature_select,
                queue_select: self.queue_select,
                config_generation: self.config_generation,
                config_vector: self.interrupt.config_vector.load(Ordering::SeqCst),
                queue_vectors: self
                    .interrupt
                    .queue_vectors
                    .iter()
                    .map(|v| v.load(Ordering::SeqCst))
                    .collect(),
                isr: self.interrupt.isr.load(Ordering::SeqCst),
            },
            queues: s.queues,
            acked_features: s.acked_features,
            device: s.device,
        })
    }

    /// Restores `state` onto this freshly built function: every part is
    /// checked first (a refused field changes nothing), then the device's
    /// own part, the configuration space, the MSI-X table and its routes,
    /// the vectors, and last the activation of a device that was running.
    /// The caller moves what it registered at the BARs (see
    /// [`VirtioPciDevice::bar_address`]).
    pub fn restore(&mut self, state: &PciTransportState) -> Result<(), TransportStateError> {
        let r = &state.registers;
        let (checked, vectors) = self.checked(state)?;
        self.state.device().restore_state(&state.device)?;

        self.config.restore(&r.config)?;
        let routed: Vec<MsixUpdate> = {
            let mut msix = self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            msix.restore(&r.msix)?;
            (0..vectors)
                .filter(|&v| msix.entry(v).is_some_and(|e| !untouched(&e)))
                .map(MsixUpdate::Entry)
                .collect()
        };
        // Routes, then every vector's mask (attaching the unmasked ones).
        self.apply(routed);
        self.interrupt
            .config_vector
            .store(r.config_vector, Ordering::SeqCst);
        for (slot, v) in self.interrupt.queue_vectors.iter().zip(&r.queue_vectors) {
            slot.store(*v, Ordering::SeqCst);
        }
        self.interrupt.isr.store(r.isr, Ordering::SeqCst);
        self.device_feature_select = r.device_feature_select;
        self.driver_feature_select = r.driver_feature_select;
        self.queue_select = r.queue_select;
        self.config_generation = r.config_generation;
        self.state.apply(
            checked,
            &r.virtio,
            state.acked_features,
            &self.device_interrupt,
        )
    }

    /// Whether [`VirtioPciDevice::restore`] would take `state`, changing
    /// nothing (the device's own part is checked by the device when it
    /// restores it).
    pub fn check_restore(&self, state: &PciTransportState) -> Result<(), TransportStateError> {
        self.checked(state).map(drop)
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

    fn checked(
        &self,
        state: &PciTransportState,
    ) -> Result<(CheckedVirtio, u16), TransportStateError> {
        let r = &state.registers;
        self.config.check_state(&r.config)?;
        let vectors = {
            let msix = self
                .interrupt
                .msix
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            msix.check_state(&r.msix)?;
            msix.vectors()
        };
        let vector_ok = |v: u16| v < vectors || v == VIRTIO_MSI_NO_VECTOR;
        if !vector_ok(r.config_vector) {
            return Err(TransportStateError::Invalid {
                field: "registers.config_vector".into(),
                reason: format!("{} is past the {vectors} MSI-X vectors", r.config_vector),
            });
        }
        if r.queue_vectors.len() != self.interrupt.queue_vectors.len() {
            return Err(TransportStateError::Invalid {
                field: "registers.queue_vectors".into(),
                reason: format!(
                    "{} entries, this device has {} queues",
                    r.queue_vectors.len(),
                    self.interrupt.queue_vectors.len()
                ),
            });
        }
        if let Some(i) = r.queue_vectors.iter().position(|&v| !vector_ok(v)) {
            return Err(TransportStateError::Invalid {
                field: format!("registers.queue_vectors[{i}]"),
                reason: format!("{} is past the {vectors} MSI-X vectors", r.queue_vectors[i]),
            });
        }
        Ok((self.state.check(state, &r.virtio)?, vectors))
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
