//! A whole VM to a snapshot directory and back, as Cloud Hypervisor lays
//! the directory out (`config.json`, `state.json`, `memory-ranges`, each
//! mode 0600): [`Vm::snapshot`] of a paused VM, [`Vm::restore`] into a new
//! one that comes back paused, and [`Vm::check_snapshottable`], asked
//! before the VM is paused.
//!
//! Each part's state is a section of the state document, saved and
//! restored by the code that owns it: `vcpus` and `vcpu/N`
//! ([`crate::vcpu`]), `vm` ([`crate::vm_state`]), `memory` and
//! `memory-hotplug` ([`crate::memory`]), `legacy` ([`crate::legacy::state`]),
//! `devices` ([`crate::device_manager::state`]). This module only orders
//! them (the restore's order is said in its `restore` submodule) and reads
//! and writes the files. Snapshot and restore run on the VMM's main thread:
//! only its seccomp filter lets files be opened.

mod restore;
mod restore_taps;

pub(crate) use restore::RestoredBase;
pub use restore_taps::{RestoreTaps, RestoreTapsError};

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vm_state::{StateDocument, StateError};

use crate::config::json::vm_config_to_json;
use crate::config::VmConfig;
use crate::device_manager::state::SwitchRelease;
use crate::device_manager::DeviceManagerError;
use crate::legacy::state::LegacyStateError;
use crate::memory::snapshot::{
    join_regions, write_memory_ranges, MemoryLayoutState, MemorySnapshotError, RamRegionState,
    RegionOrigin,
};
use crate::vcpu::hotplug::{VcpuPresence, VcpusState};
use crate::vcpu::VcpuError;
use crate::vm::{Vm, VmError};
use crate::vm_state::{VmState, VmStateError};

pub const CONFIG_FILE: &str = "config.json";
pub const STATE_FILE: &str = "state.json";
pub const MEMORY_FILE: &str = "memory-ranges";

/// Section names in `state.json`.
pub const VCPUS_SECTION: &str = "vcpus";
pub const VM_SECTION: &str = "vm";
pub const MEMORY_SECTION: &str = "memory";
pub const MEMORY_HOTPLUG_SECTION: &str = "memory-hotplug";
pub const LEGACY_SECTION: &str = "legacy";
pub const DEVICES_SECTION: &str = "devices";

/// The section of vCPU `index`'s own state.
pub fn vcpu_section(index: u32) -> String {
    format!("vcpu/{index}")
}

/// Why a snapshot or a restore failed; every variant names the file,
/// section or field.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot: the VM is running; pause it first (vm.pause)")]
    NotPaused,
    /// A migration's switch asked for before the VM's state was saved.
    #[error("migration switch: the VM must be paused and its state saved first")]
    NotSaved,
    #[error("{}: not a directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Directory {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {what}: {source}", path.display())]
    File {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
    #[error("{file}: {source}")]
    State {
        file: &'static str,
        source: StateError,
    },
    #[error("snapshot: {component} cannot be saved yet: {reason}")]
    NotSnapshottable { component: String, reason: String },
    #[error("state.json: {section}: {reason}")]
    Section { section: String, reason: String },
    #[error("state.json: vcpus: {0}")]
    Vcpus(#[from] VcpuError),
    #[error("state.json: vm: {0}")]
    VmState(#[from] VmStateError),
    #[error("{0}")]
    Memory(#[from] MemorySnapshotError),
    #[error("state.json: {0}")]
    Legacy(#[from] LegacyStateError),
    #[error("snapshot: the configuration given does not describe this VM: device {id} {reason}")]
    ConfigMismatch { id: String, reason: &'static str },
    #[error("restore: building the VM: {0}")]
    Build(#[from] VmError),
    /// A device cannot be carried, paused, saved or restored; `context`
    /// says which step, the source names the device.
    #[error("{context} {source}")]
    Devices {
        context: &'static str,
        source: Box<DeviceManagerError>,
    },
}

pub(crate) fn state_error(source: StateError) -> SnapshotError {
    SnapshotError::State {
        file: STATE_FILE,
        source,
    }
}

/// The rng device's id (it has no configurable one).
pub const RNG_ID: &str = "_rng";

/// The ids of the virtio devices `config` describes.
pub fn config_device_ids(config: &VmConfig) -> Vec<String> {
    let rng = config.rng.iter().map(|_| RNG_ID.to_string());
    let pmem = config.pmem.iter().map(|p| p.id.clone());
    let fs = config.fs.iter().map(|f| f.id.clone());
    let disks = config.disks.iter().map(|d| d.id.clone());
    let vsock = config.vsock.iter().map(|v| v.id.clone());
    let net = config.net.iter().map(|n| n.id.clone());
    rng.chain(pmem)
        .chain(fs)
        .chain(disks)
        .chain(vsock)
        .chain(net)
        .collect()
}

/// The devices saved are the ones `config` describes (a restore builds
/// the VM from it): checked at the snapshot, where the mistake is made,
/// rather than found at the restore.
fn check_config_devices(config: &VmConfig, saved: &[String]) -> Result<(), SnapshotError> {
    let described = config_device_ids(config);
    if let Some(id) = saved.iter().find(|id| !described.contains(id)) {
        return Err(SnapshotError::ConfigMismatch {
            id: id.clone(),
            reason: "is in the VM but not in the configuration",
        });
    }
    if let Some(id) = described.into_iter().find(|id| !saved.contains(id)) {
        return Err(SnapshotError::ConfigMismatch {
            id,
            reason: "is in the configuration but not in the VM",
        });
    }
    Ok(())
}

/// `dir` exists and is a directory; the error names it.
fn check_dir(dir: &Path) -> Result<(), SnapshotError> {
    let meta = std::fs::metadata(dir).map_err(|source| SnapshotError::Directory {
        path: dir.to_path_buf(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(SnapshotError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    Ok(())
}

/// `path` created (or emptied) for reading and writing, mode 0600
/// whatever it had; a symlink in its place is refused.
///
/// Made in two opens to fit the main thread's seccomp filter, which lets
/// a file be created only for appending and never truncated on open
/// (`seccomp_filters::VMM_OPEN_FLAGS`): created (if missing) for
/// appending, then opened read-write and emptied with ftruncate (append
/// mode would ignore `memory-ranges`' positioned writes).
fn create_private(path: &Path) -> Result<File, SnapshotError> {
    let err = |what| {
        move |source| SnapshotError::File {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let created = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(err("creating"))?;
    created
        .set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(err("making it private (0600)"))?;
    drop(created);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(err("opening"))?;
    file.set_len(0).map_err(err("emptying"))?;
    Ok(file)
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    let mut file = create_private(path)?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|source| SnapshotError::File {
            path: path.to_path_buf(),
            what: "writing",
            source,
        })
}

impl Vm {
    /// Asked before pausing for a snapshot: names the first part that
    /// cannot be carried.
    pub fn check_snapshottable(&self) -> Result<(), SnapshotError> {
        if self.caps.is_none() {
            return Err(SnapshotError::NotSnapshottable {
                component: "the vCPUs".to_string(),
                reason: "this host's KVM did not list the MSRs to save (see the log at boot)"
                    .to_string(),
            });
        }
        self.devices
            .check_movable()
            .map_err(|source| SnapshotError::Devices {
                context: "snapshot: device",
                source: Box::new(source),
            })
    }

    /// The VM must be paused (else an error saying so). Writes
    /// DIR/config.json (`config`, as `vm.info` reports it), DIR/state.json
    /// (the state document) and DIR/memory-ranges (guest RAM, sparse),
    /// mode 0600; DIR must exist and be a directory. The DAX windows and
    /// pmem are never written: they are the host's files.
    pub fn snapshot(&mut self, config: &VmConfig, dir: &Path) -> Result<(), SnapshotError> {
        if !self.vcpus.paused() {
            return Err(SnapshotError::NotPaused);
        }
        check_dir(dir)?;
        self.check_snapshottable()?;
        // state.json is written last: a snapshot that fails part-way must
        // not leave an earlier one's state beside this one's memory.
        let state_path = dir.join(STATE_FILE);
        match std::fs::remove_file(&state_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(SnapshotError::File {
                    path: state_path,
                    what: "removing the earlier snapshot's",
                    source: e,
                })
            }
            _ => {}
        }
        // check_snapshottable saw the vCPU capabilities.
        let mut doc = self.state_document(config)?;
        let mut layout = self.memory_layout()?;
        let all_ram = join_regions(self.mem.clone(), &self.hotplugged_ram)?;
        let ranges = create_private(&dir.join(MEMORY_FILE))?;
        write_memory_ranges(&all_ram, &mut layout, &ranges)?;
        ranges.sync_all().map_err(|source| SnapshotError::File {
            path: dir.join(MEMORY_FILE),
            what: "writing",
            source,
        })?;
        doc.put(MEMORY_SECTION, &layout).map_err(state_error)?;

        let config_json = serde_json::to_vec_pretty(&vm_config_to_json(config)).map_err(|e| {
            SnapshotError::Config {
                path: dir.join(CONFIG_FILE),
                reason: e.to_string(),
            }
        })?;
        write_private(&dir.join(CONFIG_FILE), &config_json)?;
        write_private(&state_path, &doc.to_json().map_err(state_error)?)?;
        tracing::info!(
            "snapshot: {} vCPU(s), {} RAM region(s) written to {}",
            self.vcpus.threads().len(),
            layout.regions.len(),
            dir.display()
        );
        Ok(())
    }

    /// A local migration's source, once the state document is built: see
    /// [`DeviceManager::release_backends`](crate::device_manager::DeviceManager::release_backends).
    pub(crate) fn release_backends(&mut self) {
        self.devices.release_backends();
    }

    /// A migration over the network, at the switch: once the VM is paused
    /// and its state document built ([`Self::state_document`], which pauses
    /// the devices), and before the receiving VMM builds its devices, the
    /// devices let go of what the receiver opens itself by the
    /// configuration's names: each disk image's lock (the image stays
    /// open), each tap opened by name (`tap=NAME`: closed, so a tap this
    /// VMM created goes; taps passed as fds stay), the vsock socket (its
    /// file removed if still this VM's, its listener closed; open host
    /// connections stay until this VMM goes, or go on if the migration
    /// fails). Keep what it returns: should the migration fail, give it to
    /// [`Self::reclaim_after_switch`] before resuming the VM. If a device
    /// cannot let go, those before it take theirs back and the error names
    /// it. See [`DeviceManager::release_for_switch`](crate::device_manager::DeviceManager::release_for_switch).
    pub fn release_for_switch(&mut self) -> Result<SwitchRelease, SnapshotError> {
        if !self.vcpus.paused() || !self.devices_paused {
            return Err(SnapshotError::NotSaved);
        }
        self.devices
            .release_for_switch()
            .map_err(|source| SnapshotError::Devices {
                context: "migration switch:",
                source: Box::new(source),
            })
    }

    /// The migration failed after [`Self::release_for_switch`]: every
    /// device takes back what it let go of (a disk's lock, exclusive when
    /// writable, shared when read-only; its tap, opened by name again and
    /// given its configured address if it was created again; the vsock
    /// socket, bound again), so that the VM, resumed, works as before. All
    /// are tried; the error lists those that could not, by device id and
    /// file, tap or socket: a disk whose lock another process took runs on
    /// WITHOUT it (logged as an error too), a net device without its tap,
    /// the vsock device without its socket.
    pub fn reclaim_after_switch(&mut self, released: SwitchRelease) -> Result<(), SnapshotError> {
        self.devices
            .reclaim_after_switch(released)
            .map_err(|source| SnapshotError::Devices {
                context: "migration failed, taking back:",
                source: Box::new(source),
            })
    }

    /// The state document of a paused VM (what `state.json` holds, and a
    /// local migration's `State`) but its memory section, which the caller
    /// adds: a snapshot's, whose table lists what `memory-ranges` holds,
    /// or a migration's, with none (memory travels as fds). Pauses and
    /// saves the devices first (which must be those `config` describes);
    /// guest RAM is final once it returns.
    pub(crate) fn state_document(
        &mut self,
        config: &VmConfig,
    ) -> Result<StateDocument, SnapshotError> {
        if !self.vcpus.paused() {
            return Err(SnapshotError::NotPaused);
        }
        let Some(caps) = self.caps.clone() else {
            return Err(SnapshotError::NotSnapshottable {
                component: "the vCPUs".to_string(),
                reason: "no vCPU state capabilities".to_string(),
            });
        };
        // The devices stop serving (their queues' positions kept) before
        // anything is read, so nothing writes guest RAM or raises an
        // interrupt meanwhile; they serve again at resume.
        if !self.devices_paused {
            self.devices
                .pause_devices()
                .map_err(|source| SnapshotError::Devices {
                    context: "snapshot: pausing device",
                    source: Box::new(source),
                })?;
            self.devices_paused = true;
        }
        let mut doc = StateDocument::new(env!("CARGO_PKG_VERSION"));
        // First: saving a vhost-user device stops its rings, after which
        // its daemon neither writes guest RAM nor raises an interrupt, so
        // the vCPUs' LAPICs, the irqchips and RAM read below are final.
        let devices = self
            .devices
            .save_devices()
            .map_err(|source| SnapshotError::Devices {
                context: "snapshot: saving device",
                source: Box::new(source),
            })?;
        let saved_ids: Vec<String> = devices.devices.iter().map(|d| d.id.clone()).collect();
        check_config_devices(config, &saved_ids)?;
        doc.put(DEVICES_SECTION, &devices).map_err(state_error)?;
        let states = self.vcpus.save_state(&caps)?;
        let vcpus = VcpusState {
            vcpus: self
                .vcpus
                .threads()
                .into_iter()
                .map(|(index, ejected)| VcpuPresence { index, ejected })
                .collect(),
            registers: self.vcpu_hotplug.save_registers(),
        };
        doc.put(VCPUS_SECTION, &vcpus).map_err(state_error)?;
        for (index, state) in &states {
            doc.put(&vcpu_section(*index), state).map_err(state_error)?;
        }
        let vm_state = VmState::capture(&self.vm, self.paused_clock)?;
        doc.put(VM_SECTION, &vm_state).map_err(state_error)?;

        doc.put(MEMORY_HOTPLUG_SECTION, &self.ram.save())
            .map_err(state_error)?;
        let legacy = {
            let serial = self
                .serial
                .as_ref()
                .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()));
            crate::legacy::state::save(serial.as_deref(), &self.ged)
        };
        doc.put(LEGACY_SECTION, &legacy).map_err(state_error)?;
        Ok(doc)
    }

    /// Guest RAM's layout: boot RAM on slots 0.. as `register_with_kvm`
    /// gives them, then each hot-plugged region (its number is the
    /// layout's; KVM's slot for it may differ after a restore).
    pub(crate) fn memory_layout(&self) -> Result<MemoryLayoutState, MemorySnapshotError> {
        let boot = MemoryLayoutState::of_boot_memory(&self.mem)?;
        let first = boot.regions.len();
        let mut regions = boot.regions;
        for (i, region) in self.hotplugged_ram.iter().enumerate() {
            let slot = u32::try_from(first + i)
                .map_err(|_| MemorySnapshotError::TooManyRegions { count: first + i })?;
            regions.push(RamRegionState::of(region, slot, RegionOrigin::Hotplug));
        }
        MemoryLayoutState::new(regions)
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
pub(crate) mod tests;

#[cfg(test)]
#[path = "switch_tests.rs"]
mod switch_tests;
