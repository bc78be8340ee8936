//! The VM's KVM state against real KVM: an IOAPIC route, the PIC's mask,
//! a PIT counter and the clock set on one VM come back from a second one.

use kvm_bindings::kvm_pit_config;
use kvm_ioctls::Kvm;

use super::*;

/// A VM with the irqchip and PIT `vm::create_vm` makes, or None without KVM.
fn vm() -> Option<VmFd> {
    let Ok(kvm) = Kvm::new() else {
        eprintln!("no /dev/kvm; skipped");
        return None;
    };
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    vm.create_pit2(kvm_pit_config::default()).unwrap();
    Some(vm)
}

const ROUTE: u64 = 0x0100_0000_0001_a035; // to APIC 1, masked, vector 0x35
const PIC_MASTER_IMR: u8 = 0xb6;
const PIT_COUNT: u32 = 0x1234;
const CLOCK_NS: u64 = 0x7_0000_0000;

fn set_distinctive_state(vm: &VmFd) {
    let mut ioapic = kvm_irqchip {
        chip_id: KVM_IRQCHIP_IOAPIC,
        ..Default::default()
    };
    vm.get_irqchip(&mut ioapic).unwrap();
    // SAFETY: chip_id IOAPIC: the union holds the IOAPIC's state.
    unsafe { ioapic.chip.ioapic.redirtbl[5].bits = ROUTE };
    vm.set_irqchip(&ioapic).unwrap();
    let mut pic = kvm_irqchip {
        chip_id: KVM_IRQCHIP_PIC_MASTER,
        ..Default::default()
    };
    vm.get_irqchip(&mut pic).unwrap();
    // chip_id PIC_MASTER: the union holds a PIC's state.
    pic.chip.pic.imr = PIC_MASTER_IMR;
    vm.set_irqchip(&pic).unwrap();
    let mut pit = vm.get_pit2().unwrap();
    pit.channels[2].count = PIT_COUNT;
    pit.channels[2].mode = 2;
    vm.set_pit2(&pit).unwrap();
    vm.set_clock(&kvm_clock_data {
        clock: CLOCK_NS,
        ..Default::default()
    })
    .unwrap();
}

fn chips_json(state: &VmState) -> serde_json::Value {
    serde_json::to_value([&state.pic_master, &state.pic_slave, &state.ioapic]).unwrap()
}

#[test]
fn the_vm_state_restored_into_a_second_vm_reads_back_what_was_saved() {
    let Some(vm1) = vm() else { return };
    set_distinctive_state(&vm1);
    let paused_clock = vm1.get_clock().unwrap();
    let saved = VmState::capture(&vm1, Some(paused_clock)).unwrap();
    assert_eq!(
        saved.clock.clock, paused_clock.clock,
        "the clock read at pause"
    );
    let json = serde_json::to_string(&saved).unwrap();
    let loaded: VmState = serde_json::from_str(&json).unwrap();

    let vm2 = vm().unwrap();
    loaded.restore(&vm2).unwrap();
    let again = VmState::capture(&vm2, None).unwrap();
    // SAFETY: chip_id IOAPIC / PIC_MASTER: the union holds that chip.
    let (route, imr) = unsafe {
        (
            again.ioapic.chip.ioapic.redirtbl[5].bits,
            again.pic_master.chip.pic.imr,
        )
    };
    assert_eq!((route, imr), (ROUTE, PIC_MASTER_IMR));
    assert_eq!(chips_json(&again), chips_json(&saved), "all three chips");
    let (a, s) = (&again.pit.channels[2], &saved.pit.channels[2]);
    assert_eq!((a.count, a.mode), (PIT_COUNT, 2));
    assert_eq!(
        (a.count, a.mode, a.rw_mode, a.gate),
        (s.count, s.mode, s.rw_mode, s.gate)
    );
    // The clock restarts at the saved value (and runs on from there).
    assert!(again.clock.clock >= saved.clock.clock);
    assert!(saved.clock.clock >= CLOCK_NS);
}

#[test]
fn a_vm_state_of_other_sizes_is_refused_naming_the_part_before_anything_is_set() {
    let Some(vm1) = vm() else { return };
    let mut state = VmState::capture(&vm1, None).unwrap();
    *state.sizes.get_mut("irqchip").unwrap() += 8;
    let vm2 = vm().unwrap();
    set_distinctive_state(&vm2);
    let e = state.restore(&vm2).unwrap_err();
    assert!(e.to_string().contains("saved irqchip is"), "{e}");
    let untouched = VmState::capture(&vm2, None).unwrap();
    // SAFETY: chip_id IOAPIC: the union holds the IOAPIC's state.
    let route = unsafe { untouched.ioapic.chip.ioapic.redirtbl[5].bits };
    assert_eq!(route, ROUTE, "nothing was set");
}
