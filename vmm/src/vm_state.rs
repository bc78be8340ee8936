//! The KVM state of the VM itself, beside its vCPUs': the PIT, the clock
//! and the three parts of the in-kernel irqchip (the two PICs and the
//! IOAPIC) that `vm::create_vm` makes. GSI routes are not here: KVM cannot
//! read them back; they are rebuilt from the devices' state.
//!
//! As for [`crate::vcpu::state`], the structure sizes are recorded and a
//! mismatch refused by name: kvm-bindings would zero-fill it silently.

use std::mem::size_of;

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::vcpu::state::{size_mismatch, KvmSizes};

#[derive(Debug, thiserror::Error)]
pub enum VmStateError {
    #[error("KVM_GET_{part} failed: {source}")]
    Get {
        part: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_SET_{part} failed: {source}")]
    Set {
        part: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("the saved {part} is {saved} bytes, this VMM's is {here} bytes: refused")]
    SizeMismatch {
        part: String,
        saved: usize,
        here: usize,
    },
}

/// This build's sizes of the structures a [`VmState`] holds.
pub fn vm_sizes() -> KvmSizes {
    [
        ("pit_state2", size_of::<kvm_pit_state2>()),
        ("clock_data", size_of::<kvm_clock_data>()),
        ("irqchip", size_of::<kvm_irqchip>()),
    ]
    .into_iter()
    .map(|(part, size)| (part.to_owned(), size))
    .collect()
}

/// The VM's KVM state.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The structure sizes this state was saved with.
    pub sizes: KvmSizes,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmState")
            .field("clock", &self.clock.clock)
            .finish_non_exhaustive()
    }
}

fn chip(vm: &VmFd, chip_id: u32, part: &'static str) -> Result<kvm_irqchip, VmStateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(|source| VmStateError::Get { part, source })?;
    Ok(chip)
}

impl vm_state::SectionState for VmState {
    const KIND: &'static str = "vm";
    const VERSION: u32 = 1;
}

impl VmState {
    /// Reads the state of `vm`, whose vCPUs are all paused. `paused_clock`
    /// is the clock read when they were paused (`Vm::pause`): the guest's
    /// time stood still since, a fresh read would count the pause.
    pub fn capture(vm: &VmFd, paused_clock: Option<kvm_clock_data>) -> Result<Self, VmStateError> {
        let get = |part| move |source| VmStateError::Get { part, source };
        let pit = vm.get_pit2().map_err(get("PIT2"))?;
        let clock = match paused_clock {
            Some(clock) => clock,
            None => vm.get_clock().map_err(get("CLOCK"))?,
        };
        Ok(VmState {
            sizes: vm_sizes(),
            pit,
            clock,
            pic_master: chip(vm, KVM_IRQCHIP_PIC_MASTER, "IRQCHIP (PIC master)")?,
            pic_slave: chip(vm, KVM_IRQCHIP_PIC_SLAVE, "IRQCHIP (PIC slave)")?,
            ioapic: chip(vm, KVM_IRQCHIP_IOAPIC, "IRQCHIP (IOAPIC)")?,
        })
    }

    /// Checks that this state fits this build, before anything is written.
    pub fn check(&self) -> Result<(), VmStateError> {
        match size_mismatch(&self.sizes, &vm_sizes()) {
            Some((part, saved, here)) => Err(VmStateError::SizeMismatch { part, saved, here }),
            None => Ok(()),
        }
    }

    /// Writes this state into `vm` (with its irqchip and PIT made), after
    /// every vCPU's state and before anything injects an interrupt, which
    /// the irqchips' state would otherwise overwrite.
    pub fn restore(&self, vm: &VmFd) -> Result<(), VmStateError> {
        self.check()?;
        let set = |part| move |source| VmStateError::Set { part, source };
        vm.set_pit2(&self.pit).map_err(set("PIT2"))?;
        // Without KVM_CLOCK_REALTIME, KVM sets the clock to exactly this
        // value: the guest's time resumes where it stopped.
        let clock = kvm_clock_data {
            flags: 0,
            ..self.clock
        };
        vm.set_clock(&clock).map_err(set("CLOCK"))?;
        for (chip, part) in [
            (&self.pic_master, "IRQCHIP (PIC master)"),
            (&self.pic_slave, "IRQCHIP (PIC slave)"),
            (&self.ioapic, "IRQCHIP (IOAPIC)"),
        ] {
            vm.set_irqchip(chip).map_err(set(part))?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "vm_state_tests.rs"]
mod tests;
