//! [`Vm::restore`]: a VM built from a snapshot directory, in the order
//! KVM and the devices need:
//!
//! 1. every file and section is read and checked before anything is made
//!    (an unknown section version, a section nothing restores, a vCPU list
//!    that does not fit the configuration, a `memory-ranges` shorter or
//!    longer than its table are refused here);
//! 2. guest RAM is made as laid out and filled from `memory-ranges`, before
//!    any device exists: a vhost-user device sends its memory table to its
//!    daemon when it is made, and that memory must hold the guest's data;
//! 3. the VM is built as a boot builds it ([`Platform::build`]), with the
//!    hot-plugged regions at their addresses;
//! 4. each vCPU is made with its saved state instead of the boot's
//!    registers, then the VM's state (PIT, clock, irqchips): the vCPUs'
//!    LAPICs first, then the IOAPIC and PICs that route into them;
//! 5. only then what may inject an interrupt: the devices (MSI-X tables
//!    and GSI routes, BARs where the guest moved them, queue positions),
//!    the UART (it raises a pending interrupt again), the hot-plug
//!    registers;
//! 6. the vCPU threads start parked: the VM is paused until `resume`.

use std::path::Path;
use std::sync::Arc;

use vm_state::StateDocument;

use super::{
    check_dir, state_error, vcpu_section, RestoreTaps, SnapshotError, CONFIG_FILE, DEVICES_SECTION,
    LEGACY_SECTION, MEMORY_FILE, MEMORY_HOTPLUG_SECTION, MEMORY_SECTION, RNG_ID, STATE_FILE,
    VCPUS_SECTION, VM_SECTION,
};
use crate::config::json::vm_config_from_json;
use crate::config::VmConfig;
use crate::device_manager::state::DevicesState;
use crate::device_manager::{ObserverFactory, WindowFiles};
use crate::legacy::state::LegacyState;
use crate::memory::hotplug::{RamHotplug, RamHotplugState};
use crate::memory::snapshot::{
    join_regions, populate, read_memory_ranges, restore_guest_memory_parts, MemoryLayoutState,
    RegionOrigin,
};
use crate::memory::GuestRegionMmap;
use crate::step_times::StepTimes;
use crate::vcpu::hotplug::VcpusState;
use crate::vcpu::hotplug_controller::{CpuHotplugController, CpuHotplugState};
use crate::vcpu::state::VcpuState;
use crate::vcpu::Vcpu;
use crate::vm::{Platform, VcpuToStart, Vm, VmBase};
use crate::vm_state::VmState;

/// Every section of a snapshot's state document, taken and decoded.
struct Sections {
    vcpus: VcpusState,
    vcpu_states: Vec<VcpuState>,
    vm: VmState,
    memory: MemoryLayoutState,
    memory_hotplug: RamHotplugState,
    legacy: LegacyState,
    devices: DevicesState,
}

impl Sections {
    /// Takes every section from `doc`; refused if one is missing, of an
    /// unknown kind or version, or left over, or if the vCPUs or memory do
    /// not fit `config`.
    fn take(mut doc: StateDocument, config: &mut VmConfig) -> Result<Self, SnapshotError> {
        let vcpus: VcpusState = doc.take(VCPUS_SECTION).map_err(state_error)?;
        vcpus
            .check(&config.cpus)
            .map_err(|reason| SnapshotError::Section {
                section: VCPUS_SECTION.to_string(),
                reason,
            })?;
        let vcpu_states = vcpus
            .vcpus
            .iter()
            .map(|v| doc.take(&vcpu_section(v.index)))
            .collect::<Result<Vec<VcpuState>, _>>()
            .map_err(state_error)?;
        let sections = Sections {
            vcpus,
            vcpu_states,
            vm: doc.take(VM_SECTION).map_err(state_error)?,
            memory: doc.take(MEMORY_SECTION).map_err(state_error)?,
            memory_hotplug: doc.take(MEMORY_HOTPLUG_SECTION).map_err(state_error)?,
            legacy: doc.take(LEGACY_SECTION).map_err(state_error)?,
            devices: doc.take(DEVICES_SECTION).map_err(state_error)?,
        };
        doc.finish().map_err(state_error)?;
        sections.vm.check()?;
        sections.settle_rng(config);
        sections.check_hotplug(config)?;
        let boot_size: u64 = sections
            .memory
            .regions
            .iter()
            .filter(|r| r.origin == RegionOrigin::Boot)
            .map(|r| r.length)
            .sum();
        if boot_size != config.memory.size {
            return Err(SnapshotError::Section {
                section: MEMORY_SECTION.to_string(),
                reason: format!(
                    "regions: {boot_size} bytes of boot RAM, but {CONFIG_FILE} has memory.size={}",
                    config.memory.size
                ),
            });
        }
        Ok(sections)
    }
}

impl Sections {
    /// The hot-plug sections put back onto throw-away controllers of this
    /// configuration: what would refuse them after the VM is built refuses
    /// them now, before anything is.
    fn check_hotplug(&self, config: &VmConfig) -> Result<(), SnapshotError> {
        let section = |name: &str| {
            let name = name.to_string();
            move |reason| SnapshotError::Section {
                section: name,
                reason,
            }
        };
        RamHotplug::new(&config.memory)
            .restore(&self.memory_hotplug, &self.hotplugged_ranges())
            .map_err(section(MEMORY_HOTPLUG_SECTION))?;
        let cpus =
            CpuHotplugState::new(config.cpus.boot_vcpus, config.cpus.max_vcpus).map_err(|e| {
                SnapshotError::Section {
                    section: VCPUS_SECTION.to_string(),
                    reason: format!("registers: {e}"),
                }
            })?;
        CpuHotplugController::new(cpus)
            .restore(&self.vcpus.registers)
            .map_err(section(VCPUS_SECTION))
    }

    /// The hot-plugged RAM regions of the layout, (gpa, length).
    fn hotplugged_ranges(&self) -> Vec<(u64, u64)> {
        self.memory
            .regions
            .iter()
            .filter(|r| r.origin == RegionOrigin::Hotplug)
            .map(|r| (r.gpa, r.length))
            .collect()
    }

    /// What `config.json` cannot say: Cloud Hypervisor's VmConfig has no
    /// way to leave the rng device out (no `rng` means the default one), so
    /// a VM saved without one is restored without one. Every other device
    /// is checked against the saved ones by the device manager, by id.
    fn settle_rng(&self, config: &mut VmConfig) {
        if config.rng.is_some() && !self.devices.devices.iter().any(|d| d.id == RNG_ID) {
            config.rng = None;
        }
    }
}

/// The most `config.json` may hold: far more than any configuration.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The most `state.json` may hold: far more than the largest VM's state
/// (a vCPU's is tens of KiB).
pub const MAX_STATE_BYTES: u64 = 256 << 20;

/// `path` opened for reading if it is a regular file (a FIFO or a device
/// in its place is refused, not waited on or read without end).
fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// The file `name` of `dir`, refused above `limit` bytes before it is read.
fn read_file(dir: &Path, name: &str, limit: u64) -> Result<Vec<u8>, SnapshotError> {
    use std::io::Read;
    let path = dir.join(name);
    let err = |what, source| SnapshotError::File {
        path: dir.join(name),
        what,
        source,
    };
    let file = open_regular(&path).map_err(|e| err("opening", e))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| err("reading", e))?;
    if bytes.len() as u64 > limit {
        return Err(SnapshotError::File {
            path,
            what: "reading",
            source: std::io::Error::other(format!("larger than the {limit} bytes a restore reads")),
        });
    }
    Ok(bytes)
}

/// What a restored VM is built on: the KVM VM with boot RAM (filled),
/// and the hot-plugged RAM regions at their addresses.
pub(crate) struct RestoredBase {
    pub base: VmBase,
    pub hotplugged: Vec<Arc<GuestRegionMmap>>,
}

impl Vm {
    /// Builds the VM from DIR/config.json and restores every part; the VM
    /// comes back PAUSED (vCPU threads parked). Returns the config read
    /// from DIR. `prefault`: fault all of guest RAM in before it runs.
    pub fn restore(
        dir: &Path,
        prefault: bool,
        taps: RestoreTaps,
        observe: Option<&ObserverFactory>,
    ) -> Result<(VmConfig, Vm), SnapshotError> {
        check_dir(dir)?;
        let config_path = dir.join(CONFIG_FILE);
        let config_value: serde_json::Value =
            serde_json::from_slice(&read_file(dir, CONFIG_FILE, MAX_CONFIG_BYTES)?).map_err(
                |e| SnapshotError::Config {
                    path: config_path.clone(),
                    reason: e.to_string(),
                },
            )?;
        let mut config = vm_config_from_json(&config_value).map_err(|e| SnapshotError::Config {
            path: config_path.clone(),
            reason: e.to_string(),
        })?;
        // The net devices given new taps with the request are built on
        // them instead of opening their taps by name.
        taps.hand_to(&mut config)
            .map_err(|e| SnapshotError::Config {
                path: config_path.clone(),
                reason: e.to_string(),
            })?;
        let doc = StateDocument::from_json(&read_file(dir, STATE_FILE, MAX_STATE_BYTES)?)
            .map_err(state_error)?;
        let vm = Vm::restore_document(
            &mut config,
            doc,
            |config, layout| {
                let ram = restore_guest_memory_parts(&config.memory, layout)?;
                let all_ram = join_regions(ram.boot.clone(), &ram.hotplugged)?;
                let ranges_path = dir.join(MEMORY_FILE);
                let ranges = open_regular(&ranges_path).map_err(|source| SnapshotError::File {
                    path: ranges_path,
                    what: "opening",
                    source,
                })?;
                read_memory_ranges(&ranges, layout, &all_ram)?;
                drop(ranges);
                let base = VmBase::new(config, ram.boot)?;
                if prefault {
                    populate(&all_ram)?;
                    base.prefault_resident();
                }
                Ok(RestoredBase {
                    base,
                    hotplugged: ram.hotplugged,
                })
            },
            observe,
            WindowFiles::new(),
        )?;
        tracing::info!("restored from {} (paused)", dir.display());
        Ok((config, vm))
    }

    /// Builds a VM from `config` and the state document `doc` (a
    /// snapshot's `state.json`, or a local migration's `State`), on the
    /// KVM VM and guest RAM from `make_base` (given the memory section,
    /// after every section was read and checked); the VM comes back PAUSED. `config` may be
    /// settled by the saved devices (see `Sections::settle_rng`).
    /// `window_files`: the files a local migration's sender passed for each
    /// fs device's DAX window (none for a snapshot).
    pub(crate) fn restore_document(
        config: &mut VmConfig,
        doc: StateDocument,
        make_base: impl FnOnce(&VmConfig, &MemoryLayoutState) -> Result<RestoredBase, SnapshotError>,
        observe: Option<&ObserverFactory>,
        window_files: WindowFiles,
    ) -> Result<Vm, SnapshotError> {
        let mut took = StepTimes::start();
        let s = Sections::take(doc, config)?;
        took.step("sections");
        let config = &*config;
        let built = make_base(config, &s.memory)?;
        let added = s.hotplugged_ranges();
        took.step("ram");

        let mut platform = Platform::build(
            config,
            built.base,
            built.hotplugged,
            observe,
            Some(window_files),
        )?;
        took.step("platform");
        let Some(caps) = platform.caps.clone() else {
            return Err(SnapshotError::NotSnapshottable {
                component: "the vCPUs".to_string(),
                reason: "this host's KVM did not list the MSRs to restore".to_string(),
            });
        };
        let topology = config.cpus.effective_topology();
        let mut vcpus = Vec::with_capacity(s.vcpu_states.len());
        for (presence, state) in s.vcpus.vcpus.iter().zip(&s.vcpu_states) {
            let vcpu = Vcpu::restore(&platform.vm, presence.index, topology, &caps, state)?;
            vcpus.push(VcpuToStart {
                vcpu,
                ejected: presence.ejected,
            });
        }
        took.step("vcpus");
        s.vm.restore(&platform.vm)?;
        // After the irqchips (a device's pending interrupt would be lost
        // under them) and before any vCPU runs: MSI-X tables and from
        // them KVM's GSI routes, BARs where the guest put them, queues.
        platform
            .devices
            .restore_devices(&s.devices)
            .map_err(|source| SnapshotError::Devices {
                context: "state.json: devices: device",
                source: Box::new(source),
            })?;
        took.step("devices");
        {
            let mut serial = platform
                .serial
                .as_ref()
                .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
            crate::legacy::state::restore(&s.legacy, serial.as_deref_mut(), &platform.ged)?;
        }
        platform
            .ram
            .restore(&s.memory_hotplug, &added)
            .map_err(|reason| SnapshotError::Section {
                section: MEMORY_HOTPLUG_SECTION.to_string(),
                reason,
            })?;
        platform
            .cpu_hotplug
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restore(&s.vcpus.registers)
            .map_err(|reason| SnapshotError::Section {
                section: VCPUS_SECTION.to_string(),
                reason,
            })?;
        let (vcpu_count, regions) = (vcpus.len(), s.memory.regions.len());
        let vm = Vm::start(platform, config, vcpus, Some(s.vm.clock))?;
        took.step("threads");
        tracing::info!("restored {vcpu_count} vCPU(s), {regions} RAM region(s) (paused) in {took}");
        Ok(vm)
    }
}
