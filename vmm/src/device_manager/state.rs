//! The devices' part of a snapshot or a migration: every virtio device's
//! transport state by device id, where it sits (PCI segment and slot, or
//! virtio-MMIO register page), and the PCI hot-plug controller's
//! registers.
//!
//! A restore runs on a device manager built from the same configuration
//! (the saved one, which holds the hot-plugged devices too), after the
//! KVM irqchip was restored and before any vCPU runs. Everything that can
//! be checked is checked before anything is applied: the same device ids
//! on the same transports (PCI segment, MMIO register page), each
//! transport's state against its device, the slots, the hot-plug
//! registers. Then each PCI function goes back to its saved slot (the
//! configuration lists devices by kind, so one hot-plugged before a device
//! of another kind is built in another slot), its BARs are served where
//! the saved VM served them, which is where the guest put them unless it
//! had decoding off (functions may swap places; a shared memory BAR's KVM
//! slot and the device's base move with it), and last each transport is
//! restored (MSI-X tables and, from them, KVM's write-only GSI routes; a
//! running device activated with its saved queue positions). A device
//! whose own state fails to restore at that point leaves the manager
//! part-restored: the caller drops the whole VM.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use virtio_devices::device_state::DeviceStateError;
use virtio_devices::transport::mmio::MmioTransport;
use virtio_devices::transport::pci::device::VirtioPciDevice;
use virtio_devices::transport::pci::state::PciTransportState;
use virtio_devices::transport::state::{MmioTransportState, TransportStateError};

use super::hotplug_controller::HotplugControllerState;
use super::virtio_pci::{PciAddress, ServedBars, VirtioPciSetupError};
use super::{DeviceManager, DeviceManagerError};

/// What went wrong pausing, saving or restoring the devices; every
/// variant names the device (or the hot-plug field).
#[derive(Debug, thiserror::Error)]
pub enum DevicesStateError {
    #[error("{id}: cannot be moved: {source}")]
    NotMovable {
        id: String,
        source: DeviceStateError,
    },
    #[error("{id}: {step}: {source}")]
    Transport {
        id: String,
        step: &'static str,
        source: TransportStateError,
    },
    /// The saved devices are not this VM's (another id, place or transport).
    #[error("{id}: {reason}")]
    Layout { id: String, reason: String },
    #[error("{id}: placing the restored BARs: {source}")]
    Placement {
        id: String,
        source: VirtioPciSetupError,
    },
    #[error("pci_hotplug.{field}: {reason}")]
    Hotplug { field: String, reason: String },
    /// A migration's switch: device `id` could not let go of its host side
    /// (those released before it took theirs back).
    #[error("{source}")]
    Release {
        id: String,
        source: DeviceStateError,
    },
    /// A failed migration's devices could not all take their host side
    /// back (the others did); each names its device and the file, tap or
    /// socket.
    #[error("{}", join_failures(failed))]
    Reclaim { failed: Vec<DeviceStateError> },
}

fn join_failures(failed: &[DeviceStateError]) -> String {
    let all: Vec<String> = failed.iter().map(ToString::to_string).collect();
    all.join("; ")
}

/// What a migration's switch let go of ([`DeviceManager::release_for_switch`]):
/// the devices, by id, whose host side [`DeviceManager::reclaim_after_switch`]
/// takes back should the migration fail.
#[derive(Debug)]
#[must_use = "a failed migration takes the devices' host side back with it"]
pub struct SwitchRelease {
    devices: Vec<String>,
}

impl SwitchRelease {
    /// The ids of the devices that let go of something.
    pub fn device_ids(&self) -> &[String] {
        &self.devices
    }
}

/// Where a device sits and its transport's state.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "lowercase", deny_unknown_fields)]
pub enum SavedTransport {
    Pci {
        segment: u16,
        slot: u8,
        /// Where the VMM served the BARs.
        bars: ServedBars,
        state: PciTransportState,
    },
    Mmio {
        base: u64,
        state: MmioTransportState,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedDevice {
    pub id: String,
    pub transport: SavedTransport,
}

/// The devices section of the state document.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesState {
    pub devices: Vec<SavedDevice>,
    pub pci_hotplug: HotplugControllerState,
}

impl vm_state::SectionState for DevicesState {
    const KIND: &'static str = "devices";
    const VERSION: u32 = 1;
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One device's transport, whichever it is.
enum Placed {
    Pci {
        id: String,
        at: PciAddress,
        bars: ServedBars,
        dev: Arc<Mutex<VirtioPciDevice>>,
    },
    Mmio {
        id: String,
        base: u64,
        dev: Arc<Mutex<MmioTransport>>,
    },
}

impl Placed {
    fn id(&self) -> &str {
        match self {
            Placed::Pci { id, .. } | Placed::Mmio { id, .. } => id,
        }
    }

    fn place(&self) -> String {
        match self {
            Placed::Pci { at, .. } => format!("virtio-PCI {at}"),
            Placed::Mmio { base, .. } => format!("virtio-MMIO at {base:#x}"),
        }
    }

    fn transport_error(
        &self,
        step: &'static str,
        source: TransportStateError,
    ) -> DevicesStateError {
        DevicesStateError::Transport {
            id: self.id().to_string(),
            step,
            source,
        }
    }

    fn pause(&self) -> Result<(), DevicesStateError> {
        match self {
            Placed::Pci { dev, .. } => lock(dev).pause(),
            Placed::Mmio { dev, .. } => lock(dev).pause(),
        }
        .map_err(|e| self.transport_error("pause", e))
    }

    fn resume(&self) -> Result<(), DevicesStateError> {
        match self {
            Placed::Pci { dev, .. } => lock(dev).resume(),
            Placed::Mmio { dev, .. } => lock(dev).resume(),
        }
        .map_err(|e| self.transport_error("resume", e))
    }

    fn release_backend(&self) {
        match self {
            Placed::Pci { dev, .. } => lock(dev).release_backend(),
            Placed::Mmio { dev, .. } => lock(dev).release_backend(),
        }
    }

    fn release_for_switch(&self) -> Result<bool, DeviceStateError> {
        match self {
            Placed::Pci { dev, .. } => lock(dev).release_for_switch(),
            Placed::Mmio { dev, .. } => lock(dev).release_for_switch(),
        }
    }

    fn reclaim_after_switch(&self) -> Result<Option<OwnedFd>, DeviceStateError> {
        match self {
            Placed::Pci { dev, .. } => lock(dev).reclaim_after_switch(),
            Placed::Mmio { dev, .. } => lock(dev).reclaim_after_switch(),
        }
    }

    fn check_movable(&self) -> Result<(), DevicesStateError> {
        match self {
            Placed::Pci { dev, .. } => lock(dev).check_movable(),
            Placed::Mmio { dev, .. } => lock(dev).check_movable(),
        }
        .map_err(|source| DevicesStateError::NotMovable {
            id: self.id().to_string(),
            source,
        })
    }

    fn save(&self) -> Result<SavedDevice, DevicesStateError> {
        let transport = match self {
            Placed::Pci { dev, at, bars, .. } => SavedTransport::Pci {
                segment: at.segment,
                slot: at.slot,
                bars: *bars,
                state: lock(dev)
                    .save()
                    .map_err(|e| self.transport_error("save", e))?,
            },
            Placed::Mmio { dev, base, .. } => SavedTransport::Mmio {
                base: *base,
                state: lock(dev)
                    .save()
                    .map_err(|e| self.transport_error("save", e))?,
            },
        };
        Ok(SavedDevice {
            id: self.id().to_string(),
            transport,
        })
    }

    /// Whether `saved` is this device's, at this place, on this transport,
    /// with a state its transport takes (nothing is changed).
    fn check(&self, saved: &SavedTransport) -> Result<(), DevicesStateError> {
        let mismatch = |saved_at: String| DevicesStateError::Layout {
            id: self.id().to_string(),
            reason: format!(
                "saved on {saved_at}, this VM has it on {}: not the same device layout",
                self.place()
            ),
        };
        let checked = match (self, saved) {
            (
                Placed::Pci { at, dev, bars, .. },
                SavedTransport::Pci {
                    segment,
                    slot,
                    bars: saved_bars,
                    state,
                },
            ) => {
                if bars.shm.is_some() != saved_bars.shm.is_some() {
                    return Err(DevicesStateError::Layout {
                        id: self.id().to_string(),
                        reason: "a shared memory BAR in one of the saved state and this VM only"
                            .into(),
                    });
                }
                // The slot may differ: the configuration lists devices by
                // kind, hot-plugged ones after the boot ones, so a device
                // hot-plugged before one of another kind is built in another
                // slot; the restore puts it back in its own.
                if at.segment != *segment {
                    return Err(mismatch(format!(
                        "virtio-PCI {}",
                        PciAddress {
                            segment: *segment,
                            slot: *slot
                        }
                    )));
                }
                lock(dev).check_restore(state)
            }
            (Placed::Mmio { base, dev, .. }, SavedTransport::Mmio { base: b, state }) => {
                if base != b {
                    return Err(mismatch(format!("virtio-MMIO at {b:#x}")));
                }
                lock(dev).check_restore(state)
            }
            (_, SavedTransport::Pci { segment, slot, .. }) => {
                return Err(mismatch(format!(
                    "virtio-PCI {}",
                    PciAddress {
                        segment: *segment,
                        slot: *slot
                    }
                )))
            }
            (_, SavedTransport::Mmio { base, .. }) => {
                return Err(mismatch(format!("virtio-MMIO at {base:#x}")))
            }
        };
        checked.map_err(|e| self.transport_error("restore", e))
    }
}

impl DeviceManager {
    /// Every device's transport: virtio-PCI functions segment by segment
    /// and slot by slot, then virtio-MMIO devices in the order added.
    fn placed_devices(&self) -> Vec<Placed> {
        let mut all: Vec<Placed> = self
            .pci
            .functions()
            .into_iter()
            .map(|f| Placed::Pci {
                id: f.id,
                at: f.at,
                bars: f.bars,
                dev: f.transport,
            })
            .collect();
        all.extend(self.mmio_devices.placed().iter().map(|p| Placed::Mmio {
            id: p.id.clone(),
            base: p.base,
            dev: p.transport.clone(),
        }));
        all
    }

    /// Checked before anything is paused: Err names the first device that
    /// cannot be carried and why.
    pub fn check_movable(&self) -> Result<(), DeviceManagerError> {
        for p in self.placed_devices() {
            p.check_movable()?;
        }
        Ok(())
    }

    /// A local migration's source, once the devices' state is saved: each
    /// device lets go of a backend that serves one VMM at a time (an fs
    /// device's daemon), so a fresh one can serve the receiving VMM. The
    /// devices do not serve again here.
    pub fn release_backends(&mut self) {
        for p in self.placed_devices() {
            p.release_backend();
        }
    }

    /// A migration over the network, at the switch (the devices paused and
    /// saved): each device lets go of the host side that the receiving VMM
    /// opens itself by its configured name (see
    /// `VirtioDevice::release_for_switch`: a disk image's lock, a tap
    /// opened by name, the vsock's socket), and this manager closes its own
    /// copies of those fds (a tap goes with its last fd). Taps passed as
    /// fds stay. If a device cannot, those released before it take theirs
    /// back and the error names it.
    pub fn release_for_switch(&mut self) -> Result<SwitchRelease, DeviceManagerError> {
        let mut devices = Vec::new();
        for p in self.placed_devices() {
            match p.release_for_switch() {
                Ok(false) => {}
                Ok(true) => {
                    self.set_host_copy(p.id(), None);
                    devices.push(p.id().to_string());
                }
                Err(source) => {
                    for undo in self.reclaim_devices(&devices) {
                        tracing::error!("{undo} (after a failed release for a migration's switch)");
                    }
                    return Err(DevicesStateError::Release {
                        id: p.id().to_string(),
                        source,
                    }
                    .into());
                }
            }
        }
        Ok(SwitchRelease { devices })
    }

    /// The migration failed: every device [`Self::release_for_switch`]
    /// released takes its host side back (before the VM is resumed). All
    /// are tried; the error lists those that could not, by device and file,
    /// tap or socket (a disk then runs on without its lock, a net device
    /// without its tap, the vsock device without its socket).
    pub fn reclaim_after_switch(
        &mut self,
        released: SwitchRelease,
    ) -> Result<(), DeviceManagerError> {
        let failed = self.reclaim_devices(&released.devices);
        if failed.is_empty() {
            Ok(())
        } else {
            for e in &failed {
                tracing::error!("after a failed migration: {e}");
            }
            Err(DevicesStateError::Reclaim { failed }.into())
        }
    }

    /// Takes back the host side of the devices `ids`; the failures.
    fn reclaim_devices(&mut self, ids: &[String]) -> Vec<DeviceStateError> {
        let mut failed = Vec::new();
        for p in self.placed_devices() {
            if !ids.iter().any(|id| id == p.id()) {
                continue;
            }
            match p.reclaim_after_switch() {
                Ok(Some(fd)) => self.set_host_copy(p.id(), Some(fd)),
                Ok(None) => {}
                Err(e) => failed.push(e),
            }
        }
        failed
    }

    /// This manager's copy of device `id`'s tap or vsock listener (a local
    /// migration passes them): closed while a switch released the
    /// device's, the new one's once it is back. Disks keep theirs: the
    /// image stays open, only its lock goes.
    fn set_host_copy(&mut self, id: &str, fd: Option<OwnedFd>) {
        if let Some((_, copy)) = self.taps.iter_mut().find(|(t, _)| t == id) {
            *copy = fd;
        } else if let Some((_, copy, _)) = self.vsock_listener.as_mut().filter(|(v, ..)| v == id) {
            *copy = fd;
        }
    }

    /// Stops every device serving (queue positions kept). If one cannot
    /// pause, those paused before it are resumed and the error names it.
    pub fn pause_devices(&mut self) -> Result<(), DeviceManagerError> {
        let devices = self.placed_devices();
        for (i, p) in devices.iter().enumerate() {
            if let Err(e) = p.pause() {
                for done in devices[..i].iter().rev() {
                    if let Err(undo) = done.resume() {
                        tracing::error!("{undo} (after a failed pause)");
                    }
                }
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Lets every device serve again; tries them all, returns the first
    /// failure.
    pub fn resume_devices(&mut self) -> Result<(), DeviceManagerError> {
        let mut first = None;
        for p in self.placed_devices() {
            if let Err(e) = p.resume() {
                tracing::error!("{e}");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Every device's state by id, and the hot-plug controller's; the
    /// devices must be paused.
    pub fn save_devices(&mut self) -> Result<DevicesState, DeviceManagerError> {
        let devices = self
            .placed_devices()
            .iter()
            .map(Placed::save)
            .collect::<Result<Vec<_>, _>>()?;
        let pci_hotplug = lock(&self.hotplug).save();
        Ok(DevicesState {
            devices,
            pci_hotplug,
        })
    }

    /// Restores `state` onto this manager, built from the same
    /// configuration; see the module's note for the order and what is
    /// checked first.
    pub fn restore_devices(&mut self, state: &DevicesState) -> Result<(), DeviceManagerError> {
        let devices = self.placed_devices();
        let mut saved: BTreeMap<&str, &SavedTransport> = BTreeMap::new();
        for d in &state.devices {
            if saved.insert(&d.id, &d.transport).is_some() {
                return Err(layout(&d.id, "saved twice").into());
            }
        }
        for p in &devices {
            let s = saved
                .remove(p.id())
                .ok_or_else(|| layout(p.id(), "in this VM but not in the saved state"))?;
            p.check(s)?;
        }
        if let Some(id) = saved.keys().next() {
            return Err(layout(id, "in the saved state but not in this VM's configuration").into());
        }
        let wanted: BTreeMap<String, PciAddress> = state
            .devices
            .iter()
            .filter_map(|d| match d.transport {
                SavedTransport::Pci { segment, slot, .. } => {
                    Some((d.id.clone(), PciAddress { segment, slot }))
                }
                SavedTransport::Mmio { .. } => None,
            })
            .collect();
        let reslot = self
            .pci
            .plan_reslot(&wanted)
            .map_err(|(id, reason)| DevicesStateError::Layout { id, reason })?;
        let served: BTreeMap<String, ServedBars> = state
            .devices
            .iter()
            .filter_map(|d| match d.transport {
                SavedTransport::Pci { bars, .. } => Some((d.id.clone(), bars)),
                SavedTransport::Mmio { .. } => None,
            })
            .collect();
        self.pci
            .check_served(&served)
            .map_err(|(id, reason)| DevicesStateError::Layout { id, reason })?;
        lock(&self.hotplug)
            .restore(&state.pci_hotplug)
            .map_err(|(field, reason)| DevicesStateError::Hotplug { field, reason })?;
        self.pci.apply_reslot(&reslot);
        // BARs first: a device is activated (below) with its shared memory
        // where the guest will look for it.
        self.pci
            .place_all_restored(&served)
            .map_err(|(id, source)| DevicesStateError::Placement { id, source })?;
        let by_id: BTreeMap<&str, &SavedTransport> = state
            .devices
            .iter()
            .map(|d| (d.id.as_str(), &d.transport))
            .collect();
        for p in &devices {
            match (p, by_id[p.id()]) {
                (Placed::Pci { dev, .. }, SavedTransport::Pci { state, .. }) => lock(dev)
                    .restore(state)
                    .map_err(|e| p.transport_error("restore", e))?,
                (Placed::Mmio { dev, .. }, SavedTransport::Mmio { state, .. }) => lock(dev)
                    .restore(state)
                    .map_err(|e| p.transport_error("restore", e))?,
                // Checked above: each device's saved transport is its own.
                _ => return Err(layout(p.id(), "transport changed while restoring").into()),
            }
        }
        Ok(())
    }
}

fn layout(id: &str, reason: &str) -> DevicesStateError {
    DevicesStateError::Layout {
        id: id.to_string(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
