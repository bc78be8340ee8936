//! A vCPU's state against real KVM, no guest kernel: distinctive values
//! set on one VM's vCPU come back from a second VM's vCPU restored from
//! the saved (and serialized) state; a state of other sizes is refused by
//! name.

use kvm_bindings::{kvm_msr_entry, kvm_pit_config, Msrs};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use super::*;
use crate::config::CpuTopology;
use crate::vcpu::Vcpu;

const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_TSC_AUX: u32 = 0xc000_0103;
const MSR_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_TSC: u32 = 0x10;
const APIC_TDCR: usize = 0x3e0;
const APIC_LVTT: usize = 0x320;

/// A VM as `vm::create_vm` makes it (irqchip, PIT), or None without KVM.
fn vm(kvm: &Kvm) -> VmFd {
    let vm = kvm.create_vm().unwrap();
    vm.set_tss_address(0xfffb_d000).unwrap();
    vm.create_irq_chip().unwrap();
    vm.create_pit2(kvm_pit_config::default()).unwrap();
    vm
}

fn kvm() -> Option<Kvm> {
    let kvm = Kvm::new().ok();
    if kvm.is_none() {
        eprintln!("no /dev/kvm; skipped");
    }
    kvm
}

/// vCPU 0 of `vm` with the host's CPUID (so that TSC_AUX exists).
fn vcpu(kvm: &Kvm, vm: &VmFd) -> VcpuFd {
    let fd = vm.create_vcpu(0).unwrap();
    let cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    fd.set_cpuid2(&cpuid).unwrap();
    fd
}

fn lapic_reg(lapic: &kvm_lapic_state, at: usize) -> u32 {
    let b = &lapic.regs[at..at + 4];
    u32::from_le_bytes([b[0], b[1], b[2], b[3]].map(|x| x.to_ne_bytes()[0]))
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, at: usize, value: u32) {
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        lapic.regs[at + i] = i8::from_ne_bytes([b]);
    }
}

fn msr(state: &VcpuState, index: u32) -> Option<u64> {
    state.msrs.iter().find(|m| m.index == index).map(|m| m.data)
}

const MSRS_SET: [(u32, u64); 3] = [
    (MSR_KERNEL_GS_BASE, 0xffff_8880_1234_5000),
    (MSR_TSC_AUX, 7),
    (MSR_SYSENTER_EIP, 0xffff_ffff_8100_0040),
];

/// Writes values no fresh vCPU has into registers of every kind.
fn set_distinctive_state(fd: &VcpuFd) {
    let mut regs = fd.get_regs().unwrap();
    regs.rax = 0x1234_5678_9abc_def0;
    regs.r15 = 0x0f0f_0f0f_0f0f_0f0f;
    regs.rip = 0x1000;
    fd.set_regs(&regs).unwrap();
    let mut sregs = fd.get_sregs().unwrap();
    sregs.gdt.base = 0x5000;
    sregs.gdt.limit = 0x7f;
    sregs.ds.base = 0x2_0000;
    sregs.ds.selector = 0x2000;
    fd.set_sregs(&sregs).unwrap();
    let mut lapic = fd.get_lapic().unwrap();
    set_lapic_reg(&mut lapic, APIC_TDCR, 0xb);
    set_lapic_reg(&mut lapic, APIC_LVTT, 0x1_0042); // masked, vector 0x42
    fd.set_lapic(&lapic).unwrap();
    let entries = MSRS_SET.map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    });
    let written = fd.set_msrs(&Msrs::from_entries(&entries).unwrap()).unwrap();
    assert_eq!(written, entries.len(), "KVM took the test's MSRs");
}

/// The state as JSON, without the TSC (it runs on between two reads).
fn comparable(state: &VcpuState) -> serde_json::Value {
    let mut state = state.clone();
    state.msrs.retain(|m| m.index != MSR_IA32_TSC);
    serde_json::to_value(&state).unwrap()
}

#[test]
fn a_vcpu_restored_into_a_second_vm_reads_back_what_was_saved() {
    let Some(kvm) = kvm() else { return };
    let vm1 = vm(&kvm);
    let caps = StateCaps::probe(&kvm, &vm1).unwrap();
    eprintln!(
        "host KVM: XSAVE2 {:?} bytes, XCRS {}, GET_TSC_KHZ {}, {} MSRs tried, {} listed by KVM",
        caps.xsave2_size,
        caps.xcrs,
        caps.tsc_khz,
        caps.msrs.len(),
        kvm.get_msr_index_list().unwrap().as_slice().len()
    );
    let fd1 = vcpu(&kvm, &vm1);
    set_distinctive_state(&fd1);
    let saved = VcpuState::capture(&fd1, &caps).unwrap();
    eprintln!("host KVM: {} of those MSRs read", saved.msrs.len());
    for (index, data) in MSRS_SET {
        assert_eq!(msr(&saved, index), Some(data), "MSR {index:#x} saved");
    }
    assert!(msr(&saved, MSR_IA32_TSC).is_some(), "the TSC is saved");
    // Through JSON, as a snapshot file carries it.
    let json = serde_json::to_string(&saved).unwrap();
    let loaded: VcpuState = serde_json::from_str(&json).unwrap();
    assert_eq!(comparable(&loaded), comparable(&saved), "serde round trip");

    let vm2 = vm(&kvm);
    let vcpu2 = Vcpu::restore(&vm2, 0, CpuTopology::flat(1), &caps, &loaded).unwrap();
    let again = VcpuState::capture(vcpu2.fd(), &caps).unwrap();
    assert_eq!(again.regs.rax, 0x1234_5678_9abc_def0);
    assert_eq!(again.regs.rip, 0x1000);
    assert_eq!(
        (again.sregs.gdt.base, again.sregs.ds.base),
        (0x5000, 0x2_0000)
    );
    assert_eq!(lapic_reg(&again.lapic, APIC_TDCR), 0xb);
    assert_eq!(lapic_reg(&again.lapic, APIC_LVTT), 0x1_0042);
    for (index, data) in MSRS_SET {
        assert_eq!(msr(&again, index), Some(data), "MSR {index:#x} restored");
    }
    assert_eq!(comparable(&again), comparable(&saved), "the whole state");
}

fn refused(vm: &VmFd, caps: &StateCaps, state: &VcpuState) -> String {
    match Vcpu::restore(vm, 0, CpuTopology::flat(1), caps, state) {
        Ok(_) => panic!("restored"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_state_of_other_sizes_is_refused_naming_the_part_before_a_vcpu_is_made() {
    let Some(kvm) = kvm() else { return };
    let vm1 = vm(&kvm);
    let caps = StateCaps::probe(&kvm, &vm1).unwrap();
    let saved = VcpuState::capture(&vcpu(&kvm, &vm1), &caps).unwrap();
    let vm2 = vm(&kvm);

    let mut other = saved.clone();
    *other.sizes.get_mut("lapic").unwrap() += 4;
    let e = refused(&vm2, &caps, &other);
    assert!(e.contains("saved lapic is 1028 bytes"), "{e}");

    let mut other = saved.clone();
    other.sizes.insert("kvm_future".to_owned(), 8);
    let e = refused(&vm2, &caps, &other);
    assert!(e.contains("kvm_future"), "{e}");

    // A host whose XSAVE area is larger than the saved one.
    let bigger = StateCaps {
        xsave2_size: Some(saved.xsave_len() + 64),
        ..caps.clone()
    };
    let e = refused(&vm2, &bigger, &saved);
    assert!(e.contains("xsave area"), "{e}");

    // Nothing was made: vCPU 0 can still be created from the right state.
    Vcpu::restore(&vm2, 0, CpuTopology::flat(1), &caps, &saved).unwrap();
}

#[test]
fn the_msr_filter_keeps_the_vcpu_state_and_leaves_mcg_ctl_and_counters() {
    for index in [
        MSR_IA32_TSC,
        MSR_KERNEL_GS_BASE,
        MSR_TSC_AUX,
        0x6e0,
        0x4b56_4d01,
        0xc001_0015,
    ] {
        assert!(msr_is_saved(index), "{index:#x}");
    }
    for index in [0x17b, 0xc001_0004, 0xc001_0201, 0x4000_0000] {
        assert!(!msr_is_saved(index), "{index:#x}");
    }
}
