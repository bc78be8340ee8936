//! `vm.resize` of the vCPUs: starting hot-added vCPUs (or waking the
//! parked thread of one ejected before: KVM cannot destroy a vCPU), asking
//! the guest to eject removed ones, and parking them once it has. The
//! guest's side is `vcpu::hotplug_controller`; this runs on the VMM's control
//! thread, never on a vCPU.

use std::sync::Arc;

use kvm_bindings::CpuId;
use kvm_ioctls::VmFd;

use crate::bus::Bus;
use crate::bus::BusError;
use crate::config::CpusConfig;
use crate::exit::ExitHandle;
use crate::legacy::ged::{GedHandle, EVENT_CPU_HOTPLUG};
use crate::memory::GuestMemoryMmap;
use crate::vcpu::hotplug_controller::{
    CpuHotplugController, CpuHotplugState, VcpuResizeError, VcpuResizePlan, CPU_HOTPLUG_PORT,
    CPU_HOTPLUG_PORT_COUNT,
};
use crate::vcpu::{RunningVcpus, Vcpu, VcpuError, VcpuSetup};

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
/// processor devices to `aml`.
pub fn install(
    cpus: &CpusConfig,
    pio: &Bus,
    aml: &mut Vec<u8>,
) -> Result<Arc<CpuHotplugState>, VcpuHotplugError> {
    let state = CpuHotplugState::new(cpus.boot_vcpus, cpus.max_vcpus)?;
    pio.insert(
        Arc::new(std::sync::Mutex::new(CpuHotplugController::new(
            state.clone(),
        ))),
        u64::from(CPU_HOTPLUG_PORT),
        CPU_HOTPLUG_PORT_COUNT,
    )?;
    crate::vcpu::hotplug_controller::append_aml(cpus, aml);
    Ok(state)
}

impl VcpuHotplug {
    /// `base_cpuid` and `tsc_deadline`: what the boot vCPUs were given.
    pub fn new(
        state: Arc<CpuHotplugState>,
        cpus: &CpusConfig,
        base_cpuid: &CpuId,
        tsc_deadline: bool,
    ) -> Self {
        VcpuHotplug {
            state,
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
}
