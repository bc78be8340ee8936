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
//! 5. only then what may inject an interrupt (the UART raises a pending
//!    one again), and the hot-plug registers;
//! 6. the vCPU threads start parked: the VM is paused until `resume`.

use std::path::Path;

use vm_state::StateDocument;

use super::{
    check_dir, state_error, vcpu_section, virtio_devices_of, SnapshotError, VirtioDevicesState,
    CONFIG_FILE, LEGACY_SECTION, MEMORY_FILE, MEMORY_HOTPLUG_SECTION, MEMORY_SECTION, RNG_ID,
    STATE_FILE, VCPUS_SECTION, VIRTIO_SECTION, VM_SECTION,
};
use crate::config::json::vm_config_from_json;
use crate::config::VmConfig;
use crate::device_manager::ObserverFactory;
use crate::legacy::state::LegacyState;
use crate::memory::hotplug::RamHotplugState;
use crate::memory::snapshot::{
    join_regions, populate, read_memory_ranges, restore_guest_memory_parts, MemoryLayoutState,
    RegionOrigin,
};
use crate::vcpu::hotplug::VcpusState;
use crate::vcpu::state::VcpuState;
use crate::vcpu::Vcpu;
use crate::vm::{Platform, VcpuToStart, Vm};
use crate::vm_state::VmState;

/// Every section of a snapshot's state document, taken and decoded.
struct Sections {
    vcpus: VcpusState,
    vcpu_states: Vec<VcpuState>,
    vm: VmState,
    memory: MemoryLayoutState,
    memory_hotplug: RamHotplugState,
    legacy: LegacyState,
    virtio: VirtioDevicesState,
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
            virtio: doc.take(VIRTIO_SECTION).map_err(state_error)?,
        };
        doc.finish().map_err(state_error)?;
        sections.vm.check()?;
        sections.check_virtio(config)?;
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
    /// `config`'s virtio devices are the saved ones; the rng device the
    /// configuration gains by default is dropped when the VM had none.
    /// No virtio device's state is restored by this build yet: a snapshot
    /// that lists one is refused by the device's name.
    fn check_virtio(&self, config: &mut VmConfig) -> Result<(), SnapshotError> {
        let saved = &self.virtio.devices;
        if config.rng.is_some() && !saved.iter().any(|d| d.id == RNG_ID) {
            config.rng = None;
        }
        if let Some(d) = saved.first() {
            return Err(SnapshotError::Section {
                section: VIRTIO_SECTION.to_string(),
                reason: format!(
                    "device {} ({}): its state cannot be restored by this build",
                    d.id, d.kind
                ),
            });
        }
        if let Some((id, kind)) = virtio_devices_of(config).first() {
            return Err(SnapshotError::Config {
                path: CONFIG_FILE.into(),
                reason: format!("device {id} ({kind}) was not in the snapshot"),
            });
        }
        Ok(())
    }
}

fn read_file(dir: &Path, name: &str) -> Result<Vec<u8>, SnapshotError> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|source| SnapshotError::File {
        path,
        what: "reading",
        source,
    })
}

impl Vm {
    /// Builds the VM from DIR/config.json and restores every part; the VM
    /// comes back PAUSED (vCPU threads parked). Returns the config read
    /// from DIR. `prefault`: fault all of guest RAM in before it runs.
    pub fn restore(
        dir: &Path,
        prefault: bool,
        observe: Option<&ObserverFactory>,
    ) -> Result<(VmConfig, Vm), SnapshotError> {
        check_dir(dir)?;
        let config_path = dir.join(CONFIG_FILE);
        let config_value: serde_json::Value = serde_json::from_slice(&read_file(dir, CONFIG_FILE)?)
            .map_err(|e| SnapshotError::Config {
                path: config_path.clone(),
                reason: e.to_string(),
            })?;
        let mut config = vm_config_from_json(&config_value).map_err(|e| SnapshotError::Config {
            path: config_path.clone(),
            reason: e.to_string(),
        })?;
        let doc = StateDocument::from_json(&read_file(dir, STATE_FILE)?).map_err(state_error)?;
        let s = Sections::take(doc, &mut config)?;

        let ram = restore_guest_memory_parts(&config.memory, &s.memory)?;
        let all_ram = join_regions(ram.boot.clone(), &ram.hotplugged)?;
        let ranges_path = dir.join(MEMORY_FILE);
        let ranges = std::fs::File::open(&ranges_path).map_err(|source| SnapshotError::File {
            path: ranges_path,
            what: "opening",
            source,
        })?;
        read_memory_ranges(&ranges, &s.memory, &all_ram)?;
        drop(ranges);
        if prefault {
            populate(&all_ram)?;
        }
        let added: Vec<(u64, u64)> = s
            .memory
            .regions
            .iter()
            .filter(|r| r.origin == RegionOrigin::Hotplug)
            .map(|r| (r.gpa, r.length))
            .collect();

        let mut platform = Platform::build(&config, ram.boot, ram.hotplugged, observe)?;
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
        s.vm.restore(&platform.vm)?;
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
        tracing::info!(
            "restored {} vCPU(s), {} RAM region(s) from {} (paused)",
            vcpus.len(),
            s.memory.regions.len(),
            dir.display()
        );
        let vm = Vm::start(platform, &config, vcpus, Some(s.vm.clock))?;
        Ok((config, vm))
    }
}
