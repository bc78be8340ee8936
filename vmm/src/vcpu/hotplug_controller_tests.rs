use super::*;

fn select(dev: &mut CpuHotplugController, cpu: u32) {
    dev.write(SELECT_OFFSET, &cpu.to_le_bytes());
}

fn status(dev: &mut CpuHotplugController, cpu: u32) -> u8 {
    select(dev, cpu);
    let mut b = [0u8];
    dev.read(STATUS_OFFSET, &mut b);
    b[0]
}

/// What the guest's CSCN does for one CPU: read, acknowledge what it saw.
fn scan(dev: &mut CpuHotplugController, cpu: u32) -> u8 {
    let s = status(dev, cpu);
    dev.write(STATUS_OFFSET, &[s & (STATUS_INSERTING | STATUS_REMOVING)]);
    s
}

#[test]
fn plans_check_the_bounds_and_say_which_vcpus_change() {
    let state = CpuHotplugState::new(1, 4).unwrap();
    assert_eq!(state.present(), 1);
    assert_eq!(state.plan_resize(1), Ok(VcpuResizePlan::Unchanged));
    assert_eq!(state.plan_resize(3), Ok(VcpuResizePlan::Add(1..3)));
    assert_eq!(state.plan_resize(0), Err(VcpuResizeError::Zero { max: 4 }));
    let above = state.plan_resize(5).unwrap_err();
    assert_eq!(above, VcpuResizeError::AboveMax { desired: 5, max: 4 });
    assert_eq!(
        above.to_string(),
        "desired_vcpus=5 is above max_vcpus=4 (the hot-pluggable limit)"
    );
    for cpu in 1..3 {
        state.announce_add(cpu);
    }
    assert_eq!(state.present(), 3);
    assert_eq!(state.plan_resize(2), Ok(VcpuResizePlan::Remove(2..3)));
}

#[test]
fn an_add_is_announced_once_and_acknowledged() {
    let state = CpuHotplugState::new(1, 4).unwrap();
    let mut dev = CpuHotplugController::new(state.clone());
    assert_eq!(status(&mut dev, 0), STATUS_ENABLED);
    assert_eq!(status(&mut dev, 2), 0, "not present");
    state.announce_add(2);
    assert_eq!(scan(&mut dev, 2), STATUS_ENABLED | STATUS_INSERTING);
    assert_eq!(status(&mut dev, 2), STATUS_ENABLED, "acknowledged");
    // The selector reads back; an out-of-range CPU reads nothing.
    let mut b = [0u8; 4];
    dev.read(SELECT_OFFSET, &mut b);
    assert_eq!(u32::from_le_bytes(b), 2);
    assert_eq!(status(&mut dev, 99), 0);
    dev.write(STATUS_OFFSET, &[STATUS_EJECT]); // CPU 99: nothing happens
    assert!(state.take_ejected().is_empty());
}

#[test]
fn a_removal_waits_for_the_guests_eject_and_blocks_resizes_until_done() {
    let state = CpuHotplugState::new(3, 4).unwrap();
    let mut dev = CpuHotplugController::new(state.clone());
    assert_eq!(state.plan_resize(2), Ok(VcpuResizePlan::Remove(2..3)));
    state.announce_remove(2);
    assert_eq!(
        state.plan_resize(4),
        Err(VcpuResizeError::RemovalPending { cpu: 2 })
    );
    assert_eq!(
        state.plan_resize(3),
        Ok(VcpuResizePlan::Unchanged),
        "still present until ejected: the same count is a no-op"
    );
    assert_eq!(scan(&mut dev, 2), STATUS_ENABLED | STATUS_REMOVING);
    assert_eq!(status(&mut dev, 2), STATUS_ENABLED, "acknowledged");
    assert!(state.eventfd().read().is_err(), "nothing ejected yet");
    // The guest's _EJ0 (CEJ0): the CPU is gone at once for _STA.
    select(&mut dev, 2);
    dev.write(STATUS_OFFSET, &[STATUS_EJECT]);
    assert_eq!(status(&mut dev, 2), 0);
    assert_eq!(state.present(), 2);
    assert_eq!(state.eventfd().read().unwrap(), 1);
    assert_eq!(state.take_ejected(), vec![2]);
    assert!(state.take_ejected().is_empty());
    // Pending until the control thread has parked the vCPU.
    assert_eq!(
        state.plan_resize(4),
        Err(VcpuResizeError::RemovalPending { cpu: 2 })
    );
    state.removal_done(2);
    assert_eq!(state.plan_resize(4), Ok(VcpuResizePlan::Add(2..4)));
}

#[test]
fn the_guest_cannot_eject_a_vcpu_the_vmm_did_not_ask_to_remove() {
    let state = CpuHotplugState::new(2, 2).unwrap();
    let mut dev = CpuHotplugController::new(state.clone());
    for cpu in [0, 1] {
        select(&mut dev, cpu);
        dev.write(STATUS_OFFSET, &[STATUS_EJECT]);
    }
    assert!(state.take_ejected().is_empty());
    assert_eq!(state.present(), 2);
    // Nor CPU 0 even when asked (resizes never go below 1).
    state.announce_remove(0);
    select(&mut dev, 0);
    dev.write(STATUS_OFFSET, &[STATUS_EJECT]);
    assert!(state.take_ejected().is_empty());
    // Misplaced or mis-sized accesses do nothing.
    dev.write(STATUS_OFFSET, &[STATUS_EJECT, 0]);
    dev.write(SELECT_OFFSET, &[1]);
    let mut b = [0u8; 2];
    dev.read(STATUS_OFFSET, &mut b);
    assert_eq!(b, [0, 0]);
}

#[test]
fn the_aml_has_the_controller_and_a_device_per_possible_vcpu() {
    let cpus = CpusConfig::parse("boot=1,max=4").unwrap();
    let mut aml = Vec::new();
    append_aml(&cpus, &mut aml);
    let has = |name: &[u8]| aml.windows(name.len()).any(|w| w == name);
    for name in [
        &b"PRES"[..],
        b"CPUS",
        b"CPLK",
        b"CSEL",
        b"CPEN",
        b"CINS",
        b"CRMV",
        b"CEJ0",
        b"CSTA",
        b"CTFY",
        b"CSCN",
        b"ACPI0010",
        b"ACPI0007",
        b"C000",
        b"C003",
        b"_MAT",
    ] {
        assert!(has(name), "{}", String::from_utf8_lossy(name));
    }
    assert!(!has(b"C004"), "only max_vcpus devices");
    let count = |name: &[u8]| aml.windows(name.len()).filter(|w| *w == name).count();
    assert_eq!(count(b"_EJ0"), 3, "every vCPU but CPU 0 can be ejected");
    // _MAT of C003: an enabled Local APIC with uid 3 and APIC id 3
    // (BufferOp, length, ByteData 8, then the entry).
    assert!(has(&[0, 8, 3, 3, 1, 0, 0, 0]));
}

#[test]
fn the_tables_for_the_largest_vm_still_fit() {
    let cpus = CpusConfig::parse("boot=1,max=254").unwrap();
    let mut aml = Vec::new();
    append_aml(&cpus, &mut aml);
    crate::arch::x86_64::acpi::AcpiTables::build(&cpus, &aml, 1).unwrap();
}

/// The registers come back on a controller of the same VM shape, with a
/// pending eject signalled again; another shape or a stray vCPU number is
/// refused by field, changing nothing.
#[test]
fn saved_registers_come_back_or_are_refused_by_field() {
    let state = CpuHotplugState::new(2, 4).unwrap();
    let mut dev = CpuHotplugController::new(state.clone());
    state.announce_add(2);
    state.announce_remove(1);
    select(&mut dev, 1);
    dev.write(STATUS_OFFSET, &[STATUS_EJECT]);
    select(&mut dev, 3);
    let saved = dev.save();
    assert_eq!(saved.ejected, vec![1]);
    let json = serde_json::to_value(&saved).unwrap();
    let saved: CpuHotplugRegisters = serde_json::from_value(json).unwrap();

    let fresh_state = CpuHotplugState::new(2, 4).unwrap();
    let mut fresh = CpuHotplugController::new(fresh_state.clone());
    let before = fresh.save();
    let mut stray = saved.clone();
    stray.ejected = vec![4];
    assert!(fresh
        .restore(&stray)
        .unwrap_err()
        .starts_with("ejected: vCPU 4"));
    let small = CpuHotplugController::new(CpuHotplugState::new(1, 2).unwrap());
    assert!(fresh
        .restore(&small.save())
        .unwrap_err()
        .starts_with("slots: 2 saved"));
    assert_eq!(fresh.save(), before, "nothing changed");

    fresh.restore(&saved).unwrap();
    assert_eq!(fresh.save(), saved);
    assert_eq!(fresh_state.present(), 2, "vCPU 1 gone, vCPU 2 added");
    assert_eq!(
        fresh_state.take_ejected(),
        vec![1],
        "the eject is told again"
    );
}
