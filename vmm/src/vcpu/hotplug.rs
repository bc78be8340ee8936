//! `vm.resize` of the vCPUs: starting hot-added vCPUs (or waking the
//! parked thread of one ejected before: KVM cannot destroy a vCPU), asking
//! the guest to eject removed ones, and parking them once it has. The
//! guest's side is `vcpu::hotplug_controller`; this runs on the VMM's control
//! thread, never on a vCPU.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use vm_state::SectionState;

use kvm_bindings::CpuId;
use kvm_ioctls::VmFd;

use crate::bus::Bus;
use crate::bus::BusError;
use crate::config::CpusConfig;
use crate::exit::ExitHandle;
use crate::legacy::ged::{GedHandle, EVENT_CPU_HOTPLUG};
use crate::memory::GuestMemoryMmap;
use crate::vcpu::hotplug_controller::{
    CpuHotplugController, CpuHotplugRegisters, CpuHotplugState, VcpuResizeError, VcpuResizePlan,
    CPU_HOTPLUG_PORT, CPU_HOTPLUG_PORT_COUNT,
};
use crate::vcpu::{RunningVcpus, Vcpu, VcpuError, VcpuSetup};

/// A vCPU that has a thread, and whether the guest ejected it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuPresence {
    pub index: u32,
    pub ejected: bool,
}

/// The `vcpus` section of a snapshot: which vCPUs exist (KVM cannot
/// destroy one, so an ejected vCPU is restored too, parked) and the CPU
/// hot-plug registers. Each vCPU's own state is a section of its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpusState {
    pub vcpus: Vec<VcpuPresence>,
    pub registers: CpuHotplugRegisters,
}

impl SectionState for VcpusState {
    const KIND: &'static str = "vcpus";
    const VERSION: u32 = 1;
}

impl VcpusState {
    /// Checks the section against the configuration it is restored with,
    /// before anything is built: every vCPU a possible one of `cpus`, each
    /// once, vCPU 0 among them and not ejected, one register slot per
    /// possible vCPU. Err names the field.
    pub fn check(&self, cpus: &CpusConfig) -> Result<(), String> {
        let max = cpus.max_vcpus;
        let mut seen = std::collections::BTreeSet::new();
        for v in &self.vcpus {
            if v.index >= max {
                return Err(format!(
                    "vcpus: vCPU {} is above cpus.max_vcpus={max}",
                    v.index
                ));
            }
            if !seen.insert(v.index) {
                return Err(format!("vcpus: vCPU {} is listed twice", v.index));
            }
        }
        if !self.vcpus.iter().any(|v| v.index == 0 && !v.ejected) {
            return Err("vcpus: vCPU 0 is missing or ejected".to_string());
        }
        if self.registers.slots.len() != narrow::usize_of(u64::from(max)) {
            return Err(format!(
                "registers.slots: {} saved, cpus.max_vcpus={max}",
                self.registers.slots.len()
            ));
        }
        // What the guest is told must match the vCPUs that exist: a CPU it
        // sees present with no vCPU behind it would never come online.
        let r = &self.registers;
        for cpu in (0..max).filter(|&i| r.present(i)) {
            if !self.vcpus.iter().any(|v| v.index == cpu && !v.ejected) {
                return Err(format!(
                    "registers.slots: vCPU {cpu} is present to the guest but has no vCPU"
                ));
            }
        }
        // (One ejected but present is caught above: present, no vCPU.)
        for v in self.vcpus.iter().filter(|v| !v.ejected) {
            if !r.present(v.index) && !r.ejected.contains(&v.index) {
                return Err(format!(
                    "vcpus: vCPU {} runs but is neither present to the guest nor being ejected",
                    v.index
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VcpuHotplugError {
    /// The count asked for cannot be had (a bound, or a removal pending).
    #[error(transparent)]
    Resize(#[from] VcpuResizeError),
    #[error("a hot-added vCPU: {0}")]
    Vcpu(#[from] VcpuError),
    #[error("CPU hot-plug registers: {0}")]
    Registers(#[from] BusError),
    #[error("CPU hot-plug: {0}")]
    Io(#[from] std::io::Error),
}

/// What making a vCPU after boot takes, kept from the boot.
pub struct VcpuHotplug {
    state: Arc<CpuHotplugState>,
    /// The register device on the I/O bus (its selector is part of a snapshot).
    controller: Arc<Mutex<CpuHotplugController>>,
    cpus: CpusConfig,
    base_cpuid: CpuId,
    tsc_deadline: bool,
}

/// What a new vCPU thread is wired to.
pub struct VcpuWiring<'a> {
    pub vm: &'a VmFd,
    pub mem: &'a GuestMemoryMmap,
    pub pio: &'a Arc<Bus>,
    pub mmio: &'a Arc<Bus>,
    pub exit: &'a Arc<ExitHandle>,
}

/// Puts the CPU hot-plug registers on `pio` and appends their AML and the
/// processor devices to `aml`; returns the register device.
pub fn install(
    cpus: &CpusConfig,
    pio: &Bus,
    aml: &mut Vec<u8>,
) -> Result<Arc<Mutex<CpuHotplugController>>, VcpuHotplugError> {
    let state = CpuHotplugState::new(cpus.boot_vcpus, cpus.max_vcpus)?;
    let controller = Arc::new(Mutex::new(CpuHotplugController::new(state)));
    pio.insert(
        controller.clone(),
        u64::from(CPU_HOTPLUG_PORT),
        CPU_HOTPLUG_PORT_COUNT,
    )?;
    crate::vcpu::hotplug_controller::append_aml(cpus, aml);
    Ok(controller)
}

impl VcpuHotplug {
    /// `base_cpuid` and `tsc_deadline`: what the boot vCPUs were given.
    pub fn new(
        controller: Arc<Mutex<CpuHotplugController>>,
        cpus: &CpusConfig,
        base_cpuid: &CpuId,
        tsc_deadline: bool,
    ) -> Self {
        let state = lock(&controller).state();
        VcpuHotplug {
            state,
            controller,
            cpus: cpus.clone(),
            base_cpuid: base_cpuid.clone(),
            tsc_deadline,
        }
    }

    /// Brings the guest to `desired` vCPUs: added ones run at once and the
    /// guest is told; removed ones go when the guest ejects them. Whether
    /// anything changed.
    pub fn resize(
        &self,
        desired: u32,
        vcpus: &mut RunningVcpus,
        w: &VcpuWiring,
        ged: &GedHandle,
    ) -> Result<bool, VcpuHotplugError> {
        match self.state.plan_resize(desired)? {
            VcpuResizePlan::Unchanged => return Ok(false),
            VcpuResizePlan::Add(new) => {
                for index in new {
                    if !vcpus.readd(index) {
                        let setup = VcpuSetup {
                            topology: self.cpus.effective_topology(),
                            base_cpuid: &self.base_cpuid,
                            tsc_deadline: self.tsc_deadline,
                            entry: 0,
                            mem: w.mem,
                        };
                        let vcpu = Vcpu::new(w.vm, index, &setup)?;
                        vcpus.spawn(vcpu, w.pio.clone(), w.mmio.clone(), w.exit.clone())?;
                    }
                    self.state.announce_add(index);
                }
            }
            VcpuResizePlan::Remove(gone) => gone.for_each(|i| self.state.announce_remove(i)),
        }
        ged.raise(EVENT_CPU_HOTPLUG)?;
        Ok(true)
    }

    /// Readable when the guest has ejected a vCPU.
    pub fn eject_eventfd(&self) -> &vmm_sys_util::eventfd::EventFd {
        self.state.eventfd()
    }

    /// Parks the vCPUs the guest ejected; returns their indexes.
    pub fn complete_ejects(&self, vcpus: &RunningVcpus) -> Vec<u32> {
        let ejected = self.state.take_ejected();
        for &cpu in &ejected {
            vcpus.eject(cpu);
            self.state.removal_done(cpu);
            tracing::info!(
                vcpu = cpu,
                "vCPU {cpu}: ejected by the guest, its thread parked"
            );
        }
        ejected
    }

    /// The vCPUs the guest has (those being removed included).
    pub fn present(&self) -> u32 {
        self.state.present()
    }

    /// The CPU hot-plug registers, for a snapshot.
    pub fn save_registers(&self) -> CpuHotplugRegisters {
        lock(&self.controller).save()
    }

    /// Puts saved CPU hot-plug registers back (a restore).
    pub fn restore_registers(&self, saved: &CpuHotplugRegisters) -> Result<(), String> {
        lock(&self.controller).restore(saved)
    }
}

fn lock(c: &Mutex<CpuHotplugController>) -> MutexGuard<'_, CpuHotplugController> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(boot: u32, max: u32) -> CpusConfig {
        CpusConfig {
            boot_vcpus: boot,
            max_vcpus: max,
            topology: None,
        }
    }

    /// The section of these vCPUs, each present to the guest unless ejected.
    fn section(vcpus: &[(u32, bool)], slots: usize) -> VcpusState {
        let state = CpuHotplugState::new(0, u32::try_from(slots).unwrap()).unwrap();
        for &(index, ejected) in vcpus {
            if !ejected {
                state.announce_add(index);
            }
        }
        VcpusState {
            vcpus: vcpus
                .iter()
                .map(|&(index, ejected)| VcpuPresence { index, ejected })
                .collect(),
            registers: CpuHotplugController::new(state).save(),
        }
    }

    #[test]
    fn a_vcpus_section_that_does_not_fit_the_configuration_is_refused_by_field() {
        let c = cpus(1, 2);
        section(&[(0, false), (1, true)], 2).check(&c).unwrap();
        let e = |s: VcpusState| s.check(&c).unwrap_err();
        assert!(e(section(&[(0, false), (2, false)], 2)).contains("above cpus.max_vcpus=2"));
        assert!(e(section(&[(0, false), (0, false)], 2)).contains("listed twice"));
        assert!(e(section(&[(1, false)], 2)).contains("vCPU 0 is missing"));
        assert!(e(section(&[(0, true)], 2)).contains("vCPU 0 is missing or ejected"));
        assert!(e(section(&[(0, false)], 3)).starts_with("registers.slots: 3 saved"));

        let mut present_without_vcpu = section(&[(0, false), (1, false)], 2);
        present_without_vcpu.vcpus.pop();
        assert!(e(present_without_vcpu).contains("vCPU 1 is present to the guest but has no vCPU"));
        let mut ejected_but_present = section(&[(0, false), (1, false)], 2);
        ejected_but_present.vcpus[1].ejected = true;
        assert!(e(ejected_but_present).contains("vCPU 1 is present to the guest but has no vCPU"));
        let mut hidden = section(&[(0, false), (1, true)], 2);
        hidden.vcpus[1].ejected = false;
        assert!(e(hidden.clone()).contains("vCPU 1 runs but is neither present"));
        // Ejected by the guest, not yet parked by the VMM: fine.
        hidden.registers.ejected = vec![1];
        hidden.check(&c).unwrap();
    }
}
