//! A vCPU's state against real KVM, no guest kernel: distinctive values
//! set on one VM's vCPU come back from a second VM's vCPU restored from
//! the saved (and serialized) state; a state of other sizes is refused by
//! name; a parked vCPU thread saves under its seccomp filter; a pause
//! right after an `in` exit saves the completed instruction.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_msr_entry, kvm_pit_config, kvm_userspace_memory_region, Msrs};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use super::*;
use crate::bus::{Bus, BusDevice};
use crate::config::CpuTopology;
use crate::exit::ExitHandle;
use crate::vcpu::{RunningVcpus, Vcpu, VcpuError};

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

/// No CPU has this MSR: KVM fails its read and its write.
const MSR_NONE: u32 = 0xdead_0001;

/// KVM stops a KVM_GET_MSRS at the first MSR it cannot read: that one is
/// left out and the ones after it are still saved; a write KVM refuses is
/// an error naming the MSR.
#[test]
fn an_unreadable_msr_is_skipped_and_an_unwritable_one_named() {
    let Some(kvm) = kvm() else { return };
    let vm = vm(&kvm);
    let fd = vcpu(&kvm, &vm);
    set_distinctive_state(&fd);
    let read = capture_msrs(&fd, &[MSR_SYSENTER_EIP, MSR_NONE, MSR_KERNEL_GS_BASE]).unwrap();
    let indices: Vec<u32> = read.iter().map(|m| m.index).collect();
    assert_eq!(indices, [MSR_SYSENTER_EIP, MSR_KERNEL_GS_BASE]);
    assert_eq!(read[1].data, 0xffff_8880_1234_5000);

    let mut entries = read.clone();
    entries.insert(
        1,
        kvm_msr_entry {
            index: MSR_NONE,
            ..Default::default()
        },
    );
    let e = restore_msrs(&fd, &entries).unwrap_err();
    assert!(
        e.to_string()
            .contains("refused MSR 0xdead0001 (wrote 1 of 3)"),
        "{e}"
    );
}

const MSR_TSC_DEADLINE: u32 = 0x6e0;

/// KVM takes a TSC_DEADLINE write only while the LAPIC timer is in
/// TSC-deadline mode (and drops it otherwise): restored before the LAPIC,
/// an armed deadline would be lost.
#[test]
fn an_armed_tsc_deadline_survives_because_the_lapic_is_restored_first() {
    let Some(kvm) = kvm() else { return };
    let vm1 = vm(&kvm);
    let caps = StateCaps::probe(&kvm, &vm1).unwrap();
    let fd = vm1.create_vcpu(0).unwrap();
    let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    for e in cpuid.as_mut_slice().iter_mut().filter(|e| e.function == 1) {
        e.ecx |= 1 << 24; // TSC-deadline timer
    }
    fd.set_cpuid2(&cpuid).unwrap();
    let mut lapic = fd.get_lapic().unwrap();
    set_lapic_reg(&mut lapic, APIC_LVTT, (0b10 << 17) | 0x1_0042); // deadline mode, masked
    fd.set_lapic(&lapic).unwrap();
    let tsc = |fd: &VcpuFd| {
        let mut m = Msrs::from_entries(&[kvm_msr_entry {
            index: MSR_IA32_TSC,
            ..Default::default()
        }])
        .unwrap();
        fd.get_msrs(&mut m).unwrap();
        m.as_slice()[0].data
    };
    // Far beyond the test's time: the timer does not fire and clear it.
    let deadline = tsc(&fd) + (1 << 50);
    let entry = kvm_msr_entry {
        index: MSR_TSC_DEADLINE,
        data: deadline,
        ..Default::default()
    };
    assert_eq!(
        fd.set_msrs(&Msrs::from_entries(&[entry]).unwrap()).unwrap(),
        1
    );
    let saved = VcpuState::capture(&fd, &caps).unwrap();
    assert_eq!(msr(&saved, MSR_TSC_DEADLINE), Some(deadline), "armed");

    let vm2 = vm(&kvm);
    let vcpu2 = Vcpu::restore(&vm2, 0, CpuTopology::flat(1), &caps, &saved).unwrap();
    let again = VcpuState::capture(vcpu2.fd(), &caps).unwrap();
    assert_eq!(msr(&again, MSR_TSC_DEADLINE), Some(deadline), "still armed");
}

/// The request numbers added for the save, derived as the kernel does.
#[test]
fn the_save_requests_numbers_are_the_kernels() {
    use crate::seccomp_filters as f;
    use kvm_bindings::*;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iowr_nr};
    ioctl_ior_nr!(GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iowr_nr!(GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_ior_nr!(GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_iowr_nr!(GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
    ioctl_ior_nr!(GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_ior_nr!(GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_ior_nr!(GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_io_nr!(GET_TSC_KHZ, KVMIO, 0xa3);
    ioctl_ior_nr!(GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    ioctl_ior_nr!(GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_ior_nr!(GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
    assert_eq!(
        [
            f::KVM_GET_SREGS,
            f::KVM_GET_MSRS,
            f::KVM_GET_LAPIC,
            f::KVM_GET_CPUID2,
            f::KVM_GET_MP_STATE,
            f::KVM_GET_VCPU_EVENTS,
            f::KVM_GET_DEBUGREGS,
            f::KVM_GET_TSC_KHZ,
            f::KVM_GET_XSAVE,
            f::KVM_GET_XCRS,
            f::KVM_GET_XSAVE2,
        ],
        [
            GET_SREGS(),
            GET_MSRS(),
            GET_LAPIC(),
            GET_CPUID2(),
            GET_MP_STATE(),
            GET_VCPU_EVENTS(),
            GET_DEBUGREGS(),
            GET_TSC_KHZ(),
            GET_XSAVE(),
            GET_XCRS(),
            GET_XSAVE2(),
        ]
        .map(u64::from)
    );
}

/// A vCPU thread saves its state under the main thread's filter and its
/// own, as the VMM runs it; a refused request would end this test
/// process with SIGSYS.
#[test]
fn a_vcpu_thread_saves_its_state_under_its_seccomp_filters() {
    use crate::seccomp_filters::{all_for, VCPU, VMM};
    let Some(kvm) = kvm() else { return };
    let vm = vm(&kvm);
    let caps = StateCaps::probe(&kvm, &vm).unwrap();
    let fd = vcpu(&kvm, &vm);
    set_distinctive_state(&fd);
    let programs: Vec<_> = all_for(std::process::id())
        .into_iter()
        .filter(|(k, _)| [VMM, VCPU].contains(k))
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .collect();
    let state = std::thread::scope(|s| {
        s.spawn(|| {
            for p in &programs {
                seccomp::apply_filter(p).unwrap();
            }
            VcpuState::capture(&fd, &caps).unwrap()
        })
        .join()
        .unwrap()
    });
    assert_eq!(msr(&state, MSR_KERNEL_GS_BASE), Some(0xffff_8880_1234_5000));
}

/// Port 0x99: a read says it was reached, then answers 0x5a once the VM
/// is pausing, so that the pause lands right after an `in` exit, before
/// the next KVM_RUN.
struct PortThatWaitsForPause {
    control: Arc<crate::vcpu::VcpuControl>,
    reached: Arc<AtomicBool>,
}

impl BusDevice for PortThatWaitsForPause {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        self.reached.store(true, Ordering::SeqCst);
        while !self.control.pause.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        data.fill(0x5a);
    }
    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

/// Real-mode guest code at 0x1000: `in al, 0x99; hlt`.
const IN_THEN_HLT: [u8; 3] = [0xe4, 0x99, 0xf4];

/// A VM whose vCPU 0 runs [`IN_THEN_HLT`] in real mode from a fresh
/// anonymous mapping of `size` bytes (unmapped by the caller after the VM
/// is dropped).
fn vm_running_in_then_hlt(kvm: &Kvm, size: usize) -> (VmFd, VcpuFd, *mut libc::c_void) {
    let vm = vm(kvm);
    // SAFETY: a fresh anonymous mapping; the VM holding it as memory is
    // dropped before the caller unmaps it.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(host, libc::MAP_FAILED);
    // SAFETY: 0x1000 + 3 bytes lie inside the mapping made above.
    unsafe {
        std::ptr::copy_nonoverlapping(
            IN_THEN_HLT.as_ptr(),
            host.cast::<u8>().add(0x1000),
            IN_THEN_HLT.len(),
        );
    }
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: size as u64,
        userspace_addr: host as u64,
    };
    // SAFETY: the mapping outlives the VM (unmapped after it is dropped).
    unsafe { vm.set_user_memory_region(region) }.unwrap();
    let fd = vcpu(kvm, &vm);
    let mut sregs = fd.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    fd.set_sregs(&sregs).unwrap();
    let mut regs = fd.get_regs().unwrap();
    regs.rip = 0x1000;
    regs.rax = 0x1111_1100;
    regs.rflags = 2;
    fd.set_regs(&regs).unwrap();
    (vm, fd, host)
}

/// The I/O bus with [`PortThatWaitsForPause`] at 0x99, and its flag.
fn bus_waiting_for_pause(vcpus: &RunningVcpus) -> (Arc<Bus>, Arc<AtomicBool>) {
    let pio = Arc::new(Bus::new());
    let reached = Arc::new(AtomicBool::new(false));
    let port = Arc::new(Mutex::new(PortThatWaitsForPause {
        control: vcpus.control.clone(),
        reached: reached.clone(),
    }));
    pio.insert(port, 0x99, 1).unwrap();
    (pio, reached)
}

/// Pauses once the vCPU has reached the port, saves, stops; vCPU 0's state.
fn pause_at_the_port_and_save(
    vcpus: &mut RunningVcpus,
    reached: &AtomicBool,
    caps: &Arc<StateCaps>,
) -> VcpuState {
    while !reached.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    vcpus.pause();
    let states = vcpus.save_state(caps).unwrap();
    vcpus.stop();
    let [(0, state)] = states.as_slice() else {
        panic!("one vCPU's state: {states:?}");
    };
    state.clone()
}

/// A vCPU paused right after an `in` exit: the state its thread saves has
/// the value in AL and RIP past the instruction (KVM completes the exit
/// only on the next KVM_RUN, which the thread makes before parking).
#[test]
fn a_pause_after_an_in_exit_saves_the_completed_instruction() {
    let Some(kvm) = kvm() else { return };
    const SIZE: usize = 0x10000;
    let (vm, fd, host) = vm_running_in_then_hlt(&kvm, SIZE);
    let caps = Arc::new(StateCaps::probe(&kvm, &vm).unwrap());
    let mut vcpus = RunningVcpus::default();
    let (pio, reached) = bus_waiting_for_pause(&vcpus);
    let exit = Arc::new(ExitHandle::new().unwrap());
    let vcpu = Vcpu { index: 0, fd };
    vcpus.spawn(vcpu, pio, Arc::new(Bus::new()), exit).unwrap();
    let state = pause_at_the_port_and_save(&mut vcpus, &reached, &caps);
    drop(vm);
    // SAFETY: the mapping made above; its VM is gone.
    unsafe { libc::munmap(host, SIZE) };
    assert_eq!(state.regs.rax, 0x1111_115a, "AL holds the port's answer");
    assert_eq!(state.regs.rip, 0x1002, "RIP is past the `in`");
}

/// Everything a vCPU thread does for a snapshot, on the thread itself
/// under the main thread's and the vCPU's filters (kill mode), as the VMM
/// runs it: the exit completed before parking (KVM_RUN with
/// immediate_exit), the park, the mailbox, every GET of the state, the
/// reply, the wake-up at stop. A refused call would end this test process
/// with SIGSYS.
#[test]
fn a_parked_vcpu_thread_saves_for_a_snapshot_under_its_seccomp_filters() {
    use crate::seccomp_filters::{all_for, VCPU, VMM};
    let Some(kvm) = kvm() else { return };
    const SIZE: usize = 0x10000;
    let (vm, fd, host) = vm_running_in_then_hlt(&kvm, SIZE);
    let caps = Arc::new(StateCaps::probe(&kvm, &vm).unwrap());
    let programs: Vec<_> = all_for(std::process::id())
        .into_iter()
        .filter(|(k, _)| [VMM, VCPU].contains(k))
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .collect();
    let mut vcpus = RunningVcpus::default();
    let (pio, reached) = bus_waiting_for_pause(&vcpus);
    let mmio = Arc::new(Bus::new());
    let (control, slot) = (
        vcpus.control.clone(),
        Arc::new(crate::vcpu::VcpuSlot::default()),
    );
    let thread_slot = slot.clone();
    crate::signals::install_kick_handler();
    let handle = std::thread::spawn(move || {
        for p in &programs {
            seccomp::apply_filter(p).unwrap();
        }
        let mut vcpu = Vcpu { index: 0, fd };
        assert!(vcpu.run(&pio, &mmio, &control, &thread_slot).is_none());
    });
    vcpus.threads.push(crate::vcpu::VcpuThread {
        index: 0,
        handle,
        slot,
    });
    let state = pause_at_the_port_and_save(&mut vcpus, &reached, &caps);
    drop(vm);
    // SAFETY: the mapping made above; its VM is gone.
    unsafe { libc::munmap(host, SIZE) };
    assert_eq!(
        state.regs.rip, 0x1002,
        "the save ran on the filtered thread"
    );
}

#[test]
fn the_state_is_saved_only_while_paused() {
    let vcpus = RunningVcpus::default();
    let caps = Arc::new(StateCaps {
        xsave2_size: None,
        xcrs: false,
        tsc_khz: false,
        msrs: Vec::new(),
    });
    assert!(matches!(vcpus.save_state(&caps), Err(VcpuError::NotPaused)));
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
