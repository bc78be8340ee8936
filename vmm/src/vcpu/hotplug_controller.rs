//! ACPI CPU hot-plug, the way Cloud Hypervisor (and QEMU's modern CPU
//! hot-plug interface) signal it to a guest:
//!
//! - the MADT lists every possible vCPU (`max_vcpus`), the boot ones
//!   enabled and the others online-capable, so Linux counts them possible;
//! - the DSDT describes each as a processor device `\_SB_.CPUS.Cnnn` whose
//!   `_STA` asks this device whether it is there, whose `_MAT` gives its
//!   Local APIC, and (all but CPU 0) whose `_EJ0` tells this device the
//!   guest has let go of it;
//! - to add or remove CPUs the VMM marks them "inserting" or "removing"
//!   and raises the GED interrupt; the GED's `_EVT` calls `CSCN`, which
//!   walks the CPUs through the selector register and notifies each marked
//!   one: "device check" (1) to add, "eject request" (3) to remove, and
//!   acknowledges the mark by writing it back;
//! - on a device check Linux registers the CPU (offline: a guest brings it
//!   online itself, e.g. a udev rule writing `cpuN/online`); on an eject
//!   request Linux offlines the CPU and calls `_EJ0`: only then is the vCPU
//!   gone, and the VMM parks its thread ([`CpuHotplugState::take_ejected`]).
//!
//! Registers in I/O space at [`CPU_HOTPLUG_PORT`]: offset 0 the selected
//! CPU (32 bits, read/write), offset 4 its status (one byte): bit 0
//! enabled (read), bit 1 inserting and bit 2 removing (read; a 1 written
//! acknowledges), bit 3 eject (write).

use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::acpi::{local_apic_entry, LAPIC_ENABLED};
use crate::arch::x86_64::hotplug_aml::{
    self, PortController, RawAml, RegisterField, ScanFlag, SelectedDevice,
};
use crate::bus::BusDevice;
use crate::config::CpusConfig;
use serde::{Deserialize, Serialize};

/// QEMU's CPU hot-plug port; free on this platform's I/O bus.
pub const CPU_HOTPLUG_PORT: u16 = 0x0cd8;
pub const CPU_HOTPLUG_PORT_COUNT: u64 = 8;

const SELECT_OFFSET: u64 = 0;
const STATUS_OFFSET: u64 = 4;
const STATUS_ENABLED: u8 = 1 << 0;
const STATUS_INSERTING: u8 = 1 << 1;
const STATUS_REMOVING: u8 = 1 << 2;
const STATUS_EJECT: u8 = 1 << 3;

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuSlot {
    /// The vCPU exists and runs: `_STA` says present.
    present: bool,
    /// Added, and the guest has not been told yet.
    inserting: bool,
    /// To be removed, and the guest has not been told yet.
    removing: bool,
    /// Removal asked for; the vCPU goes when the guest ejects it.
    eject_awaited: bool,
}

/// What `vm.resize` is to do with the vCPUs.
#[derive(Debug, PartialEq, Eq)]
pub enum VcpuResizePlan {
    /// The guest has this count already (answered 204, as Cloud Hypervisor does).
    Unchanged,
    /// Start (or wake) these vCPUs and tell the guest.
    Add(std::ops::Range<u32>),
    /// Ask the guest to eject these vCPUs.
    Remove(std::ops::Range<u32>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VcpuResizeError {
    #[error("desired_vcpus=0 is invalid: expected 1 to max_vcpus={max}")]
    Zero { max: u32 },
    #[error("desired_vcpus={desired} is above max_vcpus={max} (the hot-pluggable limit)")]
    AboveMax { desired: u32, max: u32 },
    /// Cloud Hypervisor's `VcpuPendingRemovedVcpu`, which it answers 429
    /// (and Kata retries).
    #[error("vCPU {cpu} is still being removed: the guest has not ejected it yet")]
    RemovalPending { cpu: u32 },
}

/// Checks a `desired_vcpus` against the bounds `vm.resize` allows, 1 to
/// `max` (before boot as after).
pub fn check_vcpu_count(desired: u32, max: u32) -> Result<(), VcpuResizeError> {
    if desired == 0 {
        return Err(VcpuResizeError::Zero { max });
    }
    if desired > max {
        return Err(VcpuResizeError::AboveMax { desired, max });
    }
    Ok(())
}

/// The vCPUs' hot-plug state, shared by the register device (on the vCPU
/// that runs the guest's ACPI code) and the VMM's control thread.
pub struct CpuHotplugState {
    slots: Mutex<Vec<CpuSlot>>,
    /// vCPUs the guest ejected, for the control thread to park.
    ejected: Mutex<Vec<u32>>,
    evt: EventFd,
}

impl CpuHotplugState {
    /// `max` possible vCPUs of which the first `boot` are present.
    pub fn new(boot: u32, max: u32) -> std::io::Result<Arc<Self>> {
        let slots = (0..max)
            .map(|i| CpuSlot {
                present: i < boot,
                ..CpuSlot::default()
            })
            .collect();
        Ok(Arc::new(CpuHotplugState {
            slots: Mutex::new(slots),
            ejected: Mutex::new(Vec::new()),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        }))
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<CpuSlot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The vCPUs present (removals the guest has not done yet included).
    pub fn present(&self) -> u32 {
        slot_count(self.slots().iter().filter(|s| s.present).count())
    }

    /// Checks `desired` and says what reaching it takes; changes nothing.
    pub fn plan_resize(&self, desired: u32) -> Result<VcpuResizePlan, VcpuResizeError> {
        let slots = self.slots();
        check_vcpu_count(desired, slot_count(slots.len()))?;
        let present = slot_count(slots.iter().filter(|s| s.present).count());
        if desired == present {
            return Ok(VcpuResizePlan::Unchanged);
        }
        if let Some(cpu) = slots.iter().position(|s| s.eject_awaited) {
            return Err(VcpuResizeError::RemovalPending {
                cpu: slot_count(cpu),
            });
        }
        Ok(if desired > present {
            VcpuResizePlan::Add(present..desired)
        } else {
            VcpuResizePlan::Remove(desired..present)
        })
    }

    /// vCPU `cpu` runs: the next scan tells the guest.
    pub fn announce_add(&self, cpu: u32) {
        if let Some(s) = self.slots().get_mut(cpu as usize) {
            *s = CpuSlot {
                present: true,
                inserting: true,
                ..CpuSlot::default()
            };
        }
    }

    /// vCPU `cpu` is to go: the next scan asks the guest to eject it.
    pub fn announce_remove(&self, cpu: u32) {
        if let Some(s) = self.slots().get_mut(cpu as usize) {
            s.removing = true;
            s.eject_awaited = true;
        }
    }

    /// Readable when the guest has ejected a vCPU.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// The vCPUs ejected since the last call. Each stays "being removed"
    /// (a resize answers [`VcpuResizeError::RemovalPending`]) until
    /// [`Self::removal_done`].
    pub fn take_ejected(&self) -> Vec<u32> {
        let _ = self.evt.read();
        std::mem::take(&mut *self.ejected.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The thread of ejected vCPU `cpu` is parked.
    pub fn removal_done(&self, cpu: u32) {
        if let Some(s) = self.slots().get_mut(cpu as usize) {
            s.eject_awaited = false;
        }
    }
}

/// The register block on the I/O bus.
pub struct CpuHotplugController {
    selected: u32,
    state: Arc<CpuHotplugState>,
}

impl CpuHotplugController {
    pub fn new(state: Arc<CpuHotplugState>) -> Self {
        CpuHotplugController { selected: 0, state }
    }

    /// The slots' state this device reads and writes.
    pub fn state(&self) -> Arc<CpuHotplugState> {
        self.state.clone()
    }

    fn status(&self) -> u8 {
        let slots = self.state.slots();
        let Some(s) = slots.get(self.selected as usize) else {
            return 0;
        };
        [
            (s.present, STATUS_ENABLED),
            (s.inserting, STATUS_INSERTING),
            (s.removing, STATUS_REMOVING),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .fold(0, |acc, (_, bit)| acc | bit)
    }

    fn write_status(&mut self, value: u8) {
        let cpu = self.selected;
        let mut slots = self.state.slots();
        let Some(s) = slots.get_mut(cpu as usize) else {
            return;
        };
        if value & STATUS_INSERTING != 0 {
            s.inserting = false;
        }
        if value & STATUS_REMOVING != 0 {
            s.removing = false;
        }
        if value & STATUS_EJECT == 0 {
            return;
        }
        // Only a vCPU the VMM asked to remove goes (never CPU 0): a guest
        // cannot take away vCPUs on its own.
        if cpu == 0 || !s.eject_awaited || !s.present {
            virtio_devices::warn_limited!(
                "CPU hot-plug: the guest ejected vCPU {cpu}, which was not being removed; ignored"
            );
            return;
        }
        // Not present from now on: Linux reads _STA right after _EJ0.
        s.present = false;
        drop(slots);
        self.state
            .ejected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(cpu);
        if let Err(e) = self.state.evt.write(1) {
            virtio_devices::error_limited!("CPU hot-plug: signalling an eject: {e}");
        }
    }
}

/// The CPU hot-plug registers' part of a snapshot: every possible vCPU's
/// slot (present, and what the guest has not been told yet), the vCPUs the
/// guest ejected that the VMM has not parked yet, and the selector.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuHotplugRegisters {
    pub slots: Vec<CpuSlot>,
    pub ejected: Vec<u32>,
    pub selected: u32,
}

impl CpuHotplugRegisters {
    /// Whether the guest sees vCPU `index` present.
    pub fn present(&self, index: u32) -> bool {
        self.slots.get(index as usize).is_some_and(|s| s.present)
    }
}

impl CpuHotplugController {
    /// The registers and slots as they are now.
    pub fn save(&self) -> CpuHotplugRegisters {
        CpuHotplugRegisters {
            slots: self.state.slots().clone(),
            ejected: self
                .state
                .ejected
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            selected: self.selected,
        }
    }

    /// Puts saved registers back; refused (nothing changed) unless they
    /// hold one slot per possible vCPU of this VM, and name only those.
    pub fn restore(&mut self, saved: &CpuHotplugRegisters) -> Result<(), String> {
        let mut slots = self.state.slots();
        if saved.slots.len() != slots.len() {
            return Err(format!(
                "slots: {} saved, this VM has max_vcpus={}",
                saved.slots.len(),
                slots.len()
            ));
        }
        if let Some(cpu) = saved.ejected.iter().find(|&&c| c as usize >= slots.len()) {
            return Err(format!("ejected: vCPU {cpu} is not a possible vCPU"));
        }
        let mut ejected = saved.ejected.clone();
        ejected.sort_unstable();
        if let Some(w) = ejected.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("ejected: vCPU {} is listed twice", w[0]));
        }
        slots.copy_from_slice(&saved.slots);
        drop(slots);
        *self.state.ejected.lock().unwrap_or_else(|e| e.into_inner()) = saved.ejected.clone();
        self.selected = saved.selected;
        if !saved.ejected.is_empty() {
            // The control thread parks them when it sees the eventfd.
            self.state
                .evt
                .write(1)
                .map_err(|e| format!("ejected: {e}"))?;
        }
        Ok(())
    }
}

impl BusDevice for CpuHotplugController {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        match (offset, data.len()) {
            (SELECT_OFFSET, 4) => data.copy_from_slice(&self.selected.to_le_bytes()),
            (STATUS_OFFSET, 1) => data[0] = self.status(),
            _ => {}
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (SELECT_OFFSET, &[a, b, c, d]) => self.selected = u32::from_le_bytes([a, b, c, d]),
            (STATUS_OFFSET, &[v]) => self.write_status(v),
            _ => {}
        }
    }
}

fn cpu_name(cpu: u32) -> String {
    format!("C{cpu:03X}")
}

/// The DSDT's part: the register device `\_SB_.PRES` and the processor
/// container `\_SB_.CPUS` with a device per possible vCPU and the methods
/// `CSTA` (status), `CTFY` (notify one), `CEJ0` (eject one) and `CSCN`
/// (scan, called by the GED).
pub fn append_aml(cpus: &CpusConfig, sink: &mut Vec<u8>) {
    append_controller_aml(sink);
    let max = cpus.max_vcpus;
    let topology = cpus.effective_topology();
    let names: Vec<String> = (0..max).map(cpu_name).collect();
    let csta = hotplug_aml::status_method("CSTA", &REGISTERS);
    let ctfy = hotplug_aml::notify_method("CTFY", &names);
    let cej0 = cej0();
    let cscn = hotplug_aml::scan_method(
        "CSCN",
        &REGISTERS,
        names.len(),
        "CTFY",
        &[
            ScanFlag {
                flag: "\\_SB_.PRES.CINS",
                event: DEVICE_CHECK,
            },
            ScanFlag {
                flag: "\\_SB_.PRES.CRMV",
                event: EJECT_REQUEST,
            },
        ],
    );
    let devices: Vec<CpuDevice> = (0..max)
        .map(|c| CpuDevice {
            cpu: c,
            apic_id: topology.apic_id(c),
        })
        .collect();
    let hid = aml::Name::new("_HID".into(), &"ACPI0010");
    let cid = aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A05"));
    let mut children: Vec<&dyn Aml> = vec![&hid, &cid, &csta, &ctfy, &cej0, &cscn];
    children.extend(devices.iter().map(|d| d as &dyn Aml));
    aml::Device::new("\\_SB_.CPUS".into(), children).to_aml_bytes(sink);
}

/// ACPI's notifications: add the device, and ask the guest to eject it.
const DEVICE_CHECK: u8 = 1;
const EJECT_REQUEST: u8 = 3;

/// The registers the processor container's methods select a vCPU with.
const REGISTERS: SelectedDevice<'static> = SelectedDevice {
    lock: "\\_SB_.PRES.CPLK",
    select: "\\_SB_.PRES.CSEL",
    enabled: "\\_SB_.PRES.CPEN",
};

/// The controller's device, `\_SB_.PRES`: its ports and registers, and the
/// mutex its methods take.
fn append_controller_aml(sink: &mut Vec<u8>) {
    PortController {
        path: "\\_SB_.PRES",
        uid: "CPU Hotplug Controller",
        port: CPU_HOTPLUG_PORT,
        ports: const { narrow::u8_of(CPU_HOTPLUG_PORT_COUNT) },
        mutex: "CPLK",
        region: "PRST",
        fields: vec![
            RegisterField {
                access: aml::FieldAccessType::DWord,
                update: aml::FieldUpdateRule::WriteAsZeroes,
                entries: vec![aml::FieldEntry::Named(*b"CSEL", 32)],
            },
            RegisterField {
                access: aml::FieldAccessType::Byte,
                update: aml::FieldUpdateRule::WriteAsZeroes,
                entries: vec![
                    aml::FieldEntry::Reserved(32),
                    aml::FieldEntry::Named(*b"CPEN", 1),
                    aml::FieldEntry::Named(*b"CINS", 1),
                    aml::FieldEntry::Named(*b"CRMV", 1),
                    aml::FieldEntry::Named(*b"CEJ0", 1),
                    aml::FieldEntry::Reserved(4),
                ],
            },
        ],
    }
    .append_aml(&[], sink);
}

/// A number of vCPU slots, or a slot's index, as the u32 vCPUs are counted
/// in.
fn slot_count(n: usize) -> u32 {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "there is one slot per possible vCPU, at most MAX_VCPUS (254)"
    )]
    let n = n as u32;
    n
}

/// `CEJ0(cpu)`: the guest has let go of CPU `cpu`; the VMM may take it.
fn cej0() -> RawAml {
    let reg = aml::Path::new;
    let lock = || reg(REGISTERS.lock);
    RawAml::of(&aml::Method::new(
        "CEJ0".into(),
        1,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&reg(REGISTERS.select), &aml::Arg(0)),
            &aml::Store::new(&reg("\\_SB_.PRES.CEJ0"), &aml::ONE),
            &aml::Release::new(lock()),
        ],
    ))
}

/// One processor device inside `\_SB_.CPUS`.
struct CpuDevice {
    cpu: u32,
    apic_id: u32,
}

impl Aml for CpuDevice {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        // Linux takes the APIC id from _MAT, and only from an enabled
        // entry: the MADT's entry of a hot-pluggable vCPU is not.
        let mat = local_apic_entry(self.cpu, self.apic_id, LAPIC_ENABLED).to_vec();
        let sta = RawAml::of(&aml::Method::new(
            "_STA".into(),
            0,
            false,
            vec![&aml::Return::new(&aml::MethodCall::new(
                "CSTA".into(),
                vec![&self.cpu],
            ))],
        ));
        let ej0 = RawAml::of(&aml::Method::new(
            "_EJ0".into(),
            1,
            false,
            vec![&aml::MethodCall::new("CEJ0".into(), vec![&self.cpu])],
        ));
        let hid = aml::Name::new("_HID".into(), &"ACPI0007");
        let uid = aml::Name::new("_UID".into(), &self.cpu);
        let mat = aml::Name::new("_MAT".into(), &aml::BufferData::new(mat));
        let mut children: Vec<&dyn Aml> = vec![&hid, &uid, &sta, &mat];
        // CPU 0 cannot be removed: no _EJ0, so the guest never offers to.
        if self.cpu != 0 {
            children.push(&ej0);
        }
        aml::Device::new(cpu_name(self.cpu).as_str().into(), children).to_aml_bytes(sink);
    }
}

#[cfg(test)]
#[path = "hotplug_controller_tests.rs"]
mod tests;
