use kvm_ioctls::Kvm;
use virtio_devices::pmem::{Pmem, PmemBacking};
use virtio_devices::transport::pci::device::DEVICE_CFG_OFFSET;
use vm_memory::GuestAddress;

use super::*;
use crate::arch::x86_64::layout;

const RAM: u64 = 1 << 20;

struct Rig {
    vm: Arc<VmFd>,
    pio: Bus,
    mmio: Arc<Bus>,
    space: Arc<Mutex<AddressSpace>>,
    slots: Arc<Mutex<SlotNumbers>>,
    pci: PciDeviceManager,
}

fn rig() -> Rig {
    rig_with(1)
}

fn rig_with(segments: u16) -> Rig {
    let kvm = Kvm::new().expect("/dev/kvm");
    let vm = Arc::new(kvm.create_vm().unwrap());
    vm.create_irq_chip().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), narrow::usize_of(RAM))]).unwrap();
    let (pio, mmio) = (Bus::new(), Arc::new(Bus::new()));
    let space = Arc::new(Mutex::new(AddressSpace::new(RAM, 0, segments)));
    let slots = SlotNumbers::new(
        u32::try_from(kvm.check_extension_int(kvm_ioctls::Cap::NrMemslots)).unwrap(),
    );
    let pci = PciDeviceManager::new(
        &vm,
        &pio,
        &mmio,
        &GuestMemoryAtomic::new(mem),
        space.clone(),
        slots.clone(),
        Arc::new(virtio_devices::transport::common::Inline),
    )
    .unwrap();
    Rig {
        vm,
        pio,
        mmio,
        space,
        slots,
        pci,
    }
}

fn add_pmem(rig: &mut Rig, id: &str) -> PciAddress {
    add_pmem_on(rig, id, 0).unwrap()
}

fn add_pmem_on(rig: &mut Rig, id: &str, segment: u16) -> Result<PciAddress, VirtioPciSetupError> {
    let backing = PmemBacking::open(&std::env::temp_dir(), Some(4 << 20), false).unwrap();
    let device = Pmem::new(id.into(), &backing, 0).unwrap();
    let shm = ShmBacking {
        size: backing.size(),
        host_addr: backing.host_addr(),
        owner: Box::new(backing),
    };
    rig.pci.add(id, segment, Box::new(device), Some(shm))
}

/// The ECAM address of `at`'s configuration space.
fn ecam(at: PciAddress) -> u64 {
    pci_ecam_start(at.segment) + (u64::from(at.slot) << 15)
}

/// A config write through ECAM, as the guest's would arrive.
fn cfg_write(rig: &Rig, slot: PciAddress, reg: u64, value: u32) {
    assert!(rig.mmio.write(ecam(slot) + reg, &value.to_le_bytes()));
}

fn move_bars(rig: &Rig, slot: PciAddress, bar0: u64, bar2: u64) {
    cfg_write(rig, slot, 0x04, 0); // decoding off, as Linux moves 64-bit BARs
    cfg_write(rig, slot, 0x10, narrow::low_u32(bar0));
    cfg_write(rig, slot, 0x14, (bar0 >> 32) as u32);
    cfg_write(rig, slot, 0x18, narrow::low_u32(bar2));
    cfg_write(rig, slot, 0x1c, (bar2 >> 32) as u32);
    cfg_write(rig, slot, 0x04, 0x6); // memory + bus master on
}

/// The pmem config's `start`, read through BAR 0 where the bus has it.
fn pmem_start(rig: &Rig, bar0: u64) -> Option<u64> {
    let mut b = [0u8; 4];
    let mut start = 0u64;
    for half in 0..2 {
        if !rig.mmio.read(bar0 + DEVICE_CFG_OFFSET + half * 4, &mut b) {
            return None;
        }
        start |= u64::from(u32::from_le_bytes(b)) << (32 * half);
    }
    Some(start)
}

/// A 4 MiB memory slot at `addr`, which KVM refuses where one exists.
fn probe_slot(rig: &Rig, addr: u64) -> Result<MemorySlot, SlotError> {
    let host = PmemBacking::open(&std::env::temp_dir(), Some(4 << 20), false).unwrap();
    let host_addr = host.host_addr();
    // SAFETY: the mapping is owned by the slot.
    unsafe {
        MemorySlot::new(
            &rig.vm,
            &rig.slots,
            addr,
            4 << 20,
            host_addr,
            Box::new(host),
        )
    }
}

#[test]
fn moved_bars_take_bus_range_ioeventfds_and_memory_slot_along_and_removal_frees_all() {
    let mut rig = rig();
    let shm_start = layout::device_memory_start(RAM, 0);
    let a = add_pmem(&mut rig, "pmem-a");
    let b = add_pmem(&mut rig, "pmem-b");
    assert_eq!((a.slot, b.slot), (1, 2));
    let a_bar0 = layout::PCI_MMIO32_START;
    let b_bar0 = a_bar0 + BAR0_SIZE;
    assert_eq!(pmem_start(&rig, a_bar0), Some(shm_start));
    assert_eq!(pmem_start(&rig, b_bar0), Some(shm_start + (4 << 20)));

    // The guest moves device a: everything follows.
    let (new_bar0, new_bar2) = (a_bar0 + 0x10_0000, shm_start + (64 << 20));
    move_bars(&rig, a, new_bar0, new_bar2);
    assert_eq!(
        pmem_start(&rig, a_bar0),
        None,
        "nothing left at the old BAR 0"
    );
    assert_eq!(
        pmem_start(&rig, new_bar0),
        Some(new_bar2),
        "config start follows BAR 2"
    );
    // The ioeventfds moved: registering one at the old notify address
    // works again, at the new one KVM says it is taken.
    let probe = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
    let notify = virtio_devices::transport::pci::device::NOTIFY_OFFSET;
    let at = |addr| IoEventAddress::Mmio(addr + notify);
    rig.vm
        .register_ioevent(&probe, &at(a_bar0), NoDatamatch)
        .unwrap();
    rig.vm
        .unregister_ioevent(&probe, &at(a_bar0), NoDatamatch)
        .unwrap();
    assert!(rig
        .vm
        .register_ioevent(&probe, &at(new_bar0), NoDatamatch)
        .is_err());
    // KVM has the memory at the new place only.
    assert!(probe_slot(&rig, shm_start).is_ok());
    assert!(probe_slot(&rig, new_bar2).is_err());
    // The old guest range of BAR 2 is free in the allocator too.
    let free_again = lock(&rig.space)
        .allocate(Area::PciMmio64(0), 4 << 20, 4 << 20)
        .unwrap();
    assert_eq!(free_again, shm_start);
    lock(&rig.space).free(Area::PciMmio64(0), free_again, 4 << 20);

    // A move onto device b's BAR 0 is refused: a stays where it is.
    move_bars(&rig, a, b_bar0, new_bar2);
    assert_eq!(pmem_start(&rig, new_bar0), Some(new_bar2));
    assert_eq!(
        pmem_start(&rig, b_bar0),
        Some(shm_start + (4 << 20)),
        "b untouched"
    );
    // ...and so is a BAR outside the windows.
    move_bars(&rig, a, new_bar0, 0x1000_0000);
    assert_eq!(pmem_start(&rig, new_bar0), Some(new_bar2));

    // Removal: the bus range, the addresses and the KVM slot all go.
    assert_eq!(rig.pci.address_of("pmem-a"), Some(a));
    assert_eq!(rig.pci.remove(a).as_deref(), Some("pmem-a"));
    assert_eq!(rig.pci.address_of("pmem-a"), None);
    assert_eq!(pmem_start(&rig, new_bar0), None);
    assert!(rig
        .vm
        .register_ioevent(&probe, &at(new_bar0), NoDatamatch)
        .is_ok());
    let mut cfg = [0u8; 4];
    rig.mmio.read(ecam(a), &mut cfg);
    assert_eq!(cfg, [0xff; 4], "slot {a} is empty");
    assert_eq!(
        lock(&rig.space).claim_pci(0, new_bar0, BAR0_SIZE).ok(),
        Some(Area::PciMmio32(0))
    );
    let again = probe_slot(&rig, new_bar2);
    assert!(
        again.is_ok(),
        "KVM still has a slot at {new_bar2:#x}: {:?}",
        again.err()
    );
    // The freed slot number is used by the next device.
    assert_eq!(add_pmem(&mut rig, "pmem-c"), a);
}

/// Reads the 32-bit config register `reg` of (bus 0, `slot`) through
/// the legacy ports.
fn cf8_read(rig: &Rig, slot: u8, reg: u32) -> u32 {
    let address = (1u32 << 31) | u32::from(slot) << 11 | reg;
    assert!(rig.pio.write(PCI_CONFIG_IO_PORT, &address.to_le_bytes()));
    let mut v = [0u8; 4];
    assert!(rig.pio.read(PCI_CONFIG_IO_PORT + 4, &mut v));
    u32::from_le_bytes(v)
}

#[test]
fn each_segment_has_its_own_bus_ecam_and_windows() {
    let mut rig = rig_with(2);
    let windows = lock(&rig.space).pci_windows().to_vec();
    let on0 = add_pmem_on(&mut rig, "zero", 0).unwrap();
    let on1 = add_pmem_on(&mut rig, "one", 1).unwrap();
    let again1 = add_pmem_on(&mut rig, "one-b", 1).unwrap();
    assert_eq!(on0.to_string(), "0000:00:01.0");
    assert_eq!(on1.to_string(), "0001:00:01.0", "slots are per segment");
    assert_eq!(again1.to_string(), "0001:00:02.0");
    assert!(matches!(
        add_pmem_on(&mut rig, "nowhere", 2),
        Err(VirtioPciSetupError::NoSegment {
            segment: 2,
            count: 2
        })
    ));
    // Segment 1's BARs are in segment 1's windows: BAR 0 at the start
    // of its 32-bit window, the shared memory at the start of its
    // 64-bit one.
    assert_eq!(
        pmem_start(&rig, windows[1].mmio32.0),
        Some(windows[1].mmio64.0)
    );
    assert_eq!(
        pmem_start(&rig, windows[0].mmio32.0),
        Some(windows[0].mmio64.0)
    );
    // Each segment's ECAM reaches its own functions: vendor 0x1af4,
    // device 0x105b (pmem) in slot 1 of both, the bridge in slot 0.
    let read = |addr: u64| {
        let mut v = [0u8; 4];
        assert!(rig.mmio.read(addr, &mut v));
        u32::from_le_bytes(v)
    };
    assert_eq!(read(ecam(on0)), 0x105b_1af4);
    assert_eq!(read(ecam(on1)), 0x105b_1af4);
    assert_eq!(
        read(pci_ecam_start(1)),
        0x0d57_8086,
        "segment 1's host bridge"
    );
    // The legacy ports reach segment 0 only: its slot 2 is empty while
    // segment 1's is taken.
    assert_eq!(cf8_read(&rig, 1, 0), 0x105b_1af4);
    assert_eq!(cf8_read(&rig, 2, 0), u32::MAX);
    assert_eq!(read(ecam(again1)), 0x105b_1af4);
    // The guest cannot move a segment 1 BAR into segment 0's window.
    let into0 = windows[0].mmio32.0 + 0x10_0000;
    move_bars(&rig, on1, into0, windows[1].mmio64.0);
    assert_eq!(pmem_start(&rig, into0), None, "not followed");
    assert_eq!(
        pmem_start(&rig, windows[1].mmio32.0),
        Some(windows[1].mmio64.0)
    );
    // Within its own windows it follows.
    let (bar0, bar2) = (
        windows[1].mmio32.0 + 0x10_0000,
        windows[1].mmio64.0 + (1 << 30),
    );
    move_bars(&rig, on1, bar0, bar2);
    assert_eq!(pmem_start(&rig, bar0), Some(bar2));
    // Addresses by id, and removal by segment and slot.
    assert_eq!(rig.pci.address_of("one"), Some(on1));
    assert_eq!(
        rig.pci.addresses(),
        vec![
            ("zero".to_string(), on0),
            ("one".to_string(), on1),
            ("one-b".to_string(), again1)
        ]
    );
    let wrong = PciAddress {
        segment: 1,
        slot: 5,
    };
    assert_eq!(rig.pci.remove(wrong), None);
    assert_eq!(rig.pci.remove(on1).as_deref(), Some("one"));
    assert_eq!(read(ecam(on1)), u32::MAX);
    assert_eq!(read(ecam(on0)), 0x105b_1af4, "segment 0 untouched");
    assert_eq!(
        add_pmem_on(&mut rig, "one-c", 1).unwrap(),
        on1,
        "slot reused"
    );
    // Both bridges are in the DSDT.
    let mut aml = Vec::new();
    rig.pci.append_aml(&mut aml);
    assert!(aml.windows(8).any(|w| w == b"_SB_PCI0"));
    assert!(aml.windows(8).any(|w| w == b"_SB_PC01"));
}
