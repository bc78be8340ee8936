//! The devices' state against the real KVM, between two device managers
//! on VMs of their own (no vCPU runs): what the guest programmed (moved
//! BARs, MSI-X tables, slots) comes back in a manager built from the same
//! configuration, and a state of another layout is refused by device id.
//! Each test is skipped where /dev/kvm cannot be opened.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use virtio_devices::device_state::{DeviceStateError, SavedQueue};
use virtio_devices::VirtioDevice;
use vm_memory::GuestMemoryAtomic;

use super::*;
use crate::config::json::vm_config_from_json;
use crate::config::Transport;
use crate::device_manager::address_space::MemorySlot;
use crate::device_manager::tests::{disk_body, slot_of, Rig, PCIU};
use crate::device_manager::virtio_pci::ShmBacking;
use crate::device_manager::PciDeviceInfo;
use crate::memory::GuestMemoryMmap;

/// The ECAM address of register `reg` of the function at `at`.
fn ecam(at: PciAddress, reg: u64) -> u64 {
    crate::arch::x86_64::layout::pci_ecam_start(at.segment) + (u64::from(at.slot) << 15) + reg
}

impl Rig {
    fn mmio_read(&self, addr: u64) -> Option<u32> {
        let mut b = [0u8; 4];
        self.dm
            .mmio
            .read(addr, &mut b)
            .then(|| u32::from_le_bytes(b))
    }

    fn mmio_write(&self, addr: u64, data: &[u8]) {
        assert!(self.dm.mmio.write(addr, data), "nothing at {addr:#x}");
    }

    fn at(&self, id: &str) -> PciAddress {
        self.dm.pci.address_of(id).expect("placed on PCI")
    }

    /// BAR 0 of the function at `at`, as its configuration says.
    fn bar0(&self, at: PciAddress) -> u64 {
        let lo = self.mmio_read(ecam(at, 0x10)).unwrap() & !0xf;
        let hi = self.mmio_read(ecam(at, 0x14)).unwrap();
        u64::from(lo) | u64::from(hi) << 32
    }

    /// The offset of the function's MSI-X capability, as a driver finds it.
    fn msix_cap(&self, at: PciAddress) -> u64 {
        let mut ptr = u64::from(self.mmio_read(ecam(at, 0x34)).unwrap() & 0xff);
        while ptr != 0 {
            let header = self.mmio_read(ecam(at, ptr)).unwrap();
            if header & 0xff == 0x11 {
                return ptr;
            }
            ptr = u64::from((header >> 8) & 0xff);
        }
        panic!("no MSI-X capability");
    }

    /// What a driver does with a function: moves BAR 0 to `bar0`, enables
    /// MSI-X and programs vector 0 (unmasked, data `data`) and vector 1
    /// (left masked).
    fn drive(&self, at: PciAddress, bar0: u64, data: u32) {
        self.mmio_write(ecam(at, 0x04), &0u32.to_le_bytes());
        self.mmio_write(ecam(at, 0x10), &narrow::low_u32(bar0).to_le_bytes());
        self.mmio_write(ecam(at, 0x14), &((bar0 >> 32) as u32).to_le_bytes());
        self.mmio_write(ecam(at, 0x04), &6u32.to_le_bytes());
        let cap = self.msix_cap(at);
        self.mmio_write(ecam(at, cap + 2), &0x8000u16.to_le_bytes());
        let table = bar0 + virtio_devices::transport::pci::device::MSIX_TABLE_OFFSET;
        for (vector, data, control) in [(0u64, data, 0u32), (1, data + 1, 1)] {
            let entry = table + vector * 16;
            self.mmio_write(entry, &0xfee0_0000u32.to_le_bytes());
            self.mmio_write(entry + 4, &0u32.to_le_bytes());
            self.mmio_write(entry + 8, &data.to_le_bytes());
            self.mmio_write(entry + 12, &control.to_le_bytes());
        }
    }
}

/// A device that can be paused and saved (the real devices' support is
/// their own; their tests are theirs), or, `movable: false`, one that
/// cannot.
struct Movable {
    id: &'static str,
    movable: bool,
    /// Where the device was last told its shared memory is.
    shm_base: Arc<Mutex<Option<u64>>>,
}

impl VirtioDevice for Movable {
    fn device_type(&self) -> u32 {
        2
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 16]
    }
    fn features(&self) -> u64 {
        1 << 32 // VIRTIO_F_VERSION_1
    }
    fn ack_features(&mut self, _: u64) {}
    fn read_config(&self, _: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn activate(
        &mut self,
        _: GuestMemoryAtomic<GuestMemoryMmap>,
        _: Arc<dyn virtio_devices::VirtioInterrupt>,
        _: Vec<virtio_devices::device::ActivatedQueue>,
    ) -> Result<(), virtio_devices::ActivateError> {
        Ok(())
    }
    fn reset(&mut self) -> bool {
        true
    }
    fn set_shm_base(&mut self, base: u64) {
        *self.shm_base.lock().unwrap() = Some(base);
    }
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        Ok(Vec::new())
    }
    fn resume(&mut self) -> Result<(), DeviceStateError> {
        Ok(())
    }
    fn save_state(&mut self) -> Result<Value, DeviceStateError> {
        Ok(json!({"id": self.id}))
    }
    fn restore_state(&mut self, state: &Value) -> Result<(), DeviceStateError> {
        match state["id"] == self.id {
            true => Ok(()),
            false => Err(DeviceStateError::Invalid {
                device: self.id.into(),
                field: "id".into(),
                reason: format!("{state}"),
            }),
        }
    }
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        match self.movable {
            true => Ok(()),
            false => Err(DeviceStateError::NotSupported {
                device: self.id.into(),
            }),
        }
    }
}

fn movable(id: &'static str) -> Box<dyn VirtioDevice> {
    Box::new(Movable {
        id,
        movable: true,
        shm_base: Arc::default(),
    })
}

/// What `add_boot_devices` would build from one configuration: dev0 on
/// PCI, dev1 on `dev1_transport`, then `extra` devices (hot-plugged ones,
/// as `vm.add-*` records them in the configuration) on PCI.
fn build_layout(rig: &mut Rig, dev1_transport: Transport, extra: &[&'static str]) {
    rig.dm
        .place("dev0", movable("dev0"), Transport::Pci, 0, None)
        .expect("dev0");
    rig.dm
        .place("dev1", movable("dev1"), dev1_transport, 0, None)
        .expect("dev1");
    for id in extra {
        rig.dm
            .place(id, movable(id), Transport::Pci, 0, None)
            .expect("extra device");
    }
}

/// dev2 hot-plugged into a running VM; returns where it went.
fn hotplug_dev2(rig: &mut Rig) -> PciDeviceInfo {
    rig.dm
        .hotplug("dev2", Transport::Pci, |dm| {
            dm.place("dev2", movable("dev2"), Transport::Pci, 0, None)
        })
        .expect("hot-plug")
}

/// Device `id` of a saved devices state as JSON.
fn saved_device<'a>(state: &'a mut Value, id: &str) -> &'a mut Value {
    state["devices"]
        .as_array_mut()
        .expect("devices")
        .iter_mut()
        .find(|d| d["id"] == id)
        .expect("saved device")
}

/// The devices' state, through the state document as a snapshot writes it.
fn through_document(state: &DevicesState) -> DevicesState {
    let mut doc = vm_state::StateDocument::new("test");
    doc.put("devices", state).expect("put");
    let bytes = doc.to_json().expect("to_json");
    let mut doc = vm_state::StateDocument::from_json(&bytes).expect("from_json");
    let back = doc.take("devices").expect("take");
    doc.finish().expect("finish");
    back
}

/// Saved on one VM, restored on another built from the same configuration
/// (the hot-plugged device included): the BAR the guest moved is served at
/// its new address only, the MSI-X table reads back there, KVM's GSI
/// routes are the same as before, and the hot-plug controller still has
/// the announcement the guest had not read.
#[test]
fn a_restored_device_manager_serves_moved_bars_and_the_same_gsi_routes() {
    let (Some(mut a), Some(mut b)) = (Rig::new("save-a"), Rig::new("save-b")) else {
        return;
    };
    build_layout(&mut a, Transport::Mmio, &[]);
    let plugged = hotplug_dev2(&mut a);
    let dev0 = a.at("dev0");
    let old_bar0 = a.bar0(dev0);
    let new_bar0 = old_bar0 + 0x10_0000;
    a.drive(dev0, new_bar0, 0x31);
    a.drive(a.at("dev2"), a.bar0(a.at("dev2")), 0x41);
    let routes = a.dm.pci.router().routes();
    assert!(
        routes.iter().any(|r| r.2 == [0xfee0_0000, 0, 0x31]),
        "vector 0 is routed: {routes:?}"
    );
    a.dm.check_movable().expect("movable");
    a.dm.pause_devices().expect("pause");
    let state = through_document(&a.dm.save_devices().expect("save"));
    a.dm.resume_devices().expect("resume");

    build_layout(&mut b, Transport::Mmio, &["dev2"]);
    assert_eq!(
        b.bar0(b.at("dev0")),
        old_bar0,
        "built where the VM first put it"
    );
    let routes_before = b.dm.pci.router().routes();
    assert_ne!(routes_before, routes);
    b.dm.restore_devices(&state).expect("restore");

    let entry0_data = virtio_devices::transport::pci::device::MSIX_TABLE_OFFSET + 8;
    assert_eq!(b.bar0(b.at("dev0")), new_bar0);
    assert_eq!(b.mmio_read(new_bar0 + entry0_data), Some(0x31));
    assert_eq!(
        b.mmio_read(old_bar0 + entry0_data),
        None,
        "nothing left at the old BAR 0"
    );
    assert_eq!(b.dm.pci.router().routes(), routes);
    assert_eq!(b.register(PCIU), 1 << slot_of(&plugged));
}

/// A state saved from another device layout is refused naming the device
/// that does not match, as is a state whose PCI configuration belongs to
/// another device; nothing is applied (the hot-plug controller keeps its
/// registers, the BARs stay).
#[test]
fn a_state_of_another_layout_is_refused_naming_the_device() {
    let Some(mut a) = Rig::new("layout-a") else {
        return;
    };
    build_layout(&mut a, Transport::Mmio, &[]);
    hotplug_dev2(&mut a);
    a.dm.pause_devices().expect("pause");
    let state = a.dm.save_devices().expect("save");
    let restore_onto = |name: &str, dev1: Transport, extra: &[&'static str], s: &DevicesState| {
        let mut rig = Rig::new(name).expect("/dev/kvm");
        build_layout(&mut rig, dev1, extra);
        let result = rig.dm.restore_devices(s).map_err(|e| e.to_string());
        (rig, result)
    };

    let (_, result) = restore_onto("layout-same", Transport::Mmio, &["dev2"], &state);
    result.expect("the same layout");
    let (_, result) = restore_onto("layout-pci", Transport::Pci, &["dev2"], &state);
    let e = result.expect_err("dev1 on PCI");
    assert!(e.starts_with("dev1: saved on virtio-MMIO"), "{e}");
    let (_, result) = restore_onto("layout-short", Transport::Mmio, &[], &state);
    let e = result.expect_err("no dev2");
    assert!(
        e.starts_with("dev2: in the saved state but not in this VM's configuration"),
        "{e}"
    );
    let (_, result) = restore_onto("layout-long", Transport::Mmio, &["dev2", "dev3"], &state);
    let e = result.expect_err("dev3 extra");
    assert!(
        e.starts_with("dev3: in this VM but not in the saved state"),
        "{e}"
    );

    let mut spoiled = serde_json::to_value(&state).unwrap();
    saved_device(&mut spoiled, "dev0")["transport"]["state"]["registers"]["config"]["regs"][0] =
        json!(0x1234_1af4);
    let spoiled: DevicesState = serde_json::from_value(spoiled).unwrap();
    let (d, result) = restore_onto("layout-spoiled", Transport::Mmio, &["dev2"], &spoiled);
    let e = result.expect_err("spoiled");
    assert!(e.starts_with("dev0: restore: "), "{e}");
    assert!(e.contains("regs[0]"), "{e}");
    assert_eq!(d.register(PCIU), 0, "hot-plug registers not applied");

    // BARs served where they cannot be: over another device, outside the
    // window. Refused before anything is applied.
    let mut spoiled = serde_json::to_value(&state).unwrap();
    let dev0_bar0 = saved_device(&mut spoiled, "dev0")["transport"]["bars"]["bar0"].clone();
    saved_device(&mut spoiled, "dev2")["transport"]["bars"]["bar0"] = dev0_bar0;
    let overlapping: DevicesState = serde_json::from_value(spoiled.clone()).unwrap();
    let (d, result) = restore_onto("layout-overlap", Transport::Mmio, &["dev2"], &overlapping);
    let e = result.expect_err("overlapping BARs");
    assert!(
        e.starts_with("dev2: BAR 0 at ") && e.contains("overlaps dev0's"),
        "{e}"
    );
    assert_eq!(d.register(PCIU), 0, "hot-plug registers not applied");
    saved_device(&mut spoiled, "dev2")["transport"]["bars"]["bar0"] = json!(0x1000);
    let outside: DevicesState = serde_json::from_value(spoiled).unwrap();
    let (_, result) = restore_onto("layout-outside", Transport::Mmio, &["dev2"], &outside);
    let e = result.expect_err("outside the window");
    assert!(e.starts_with("dev2: BAR 0 at 0x1000: not a"), "{e}");
}

/// The first device that cannot be carried is named before anything is
/// paused.
#[test]
fn check_movable_names_the_first_device_that_cannot_move() {
    let Some(mut rig) = Rig::new("movable") else {
        return;
    };
    build_layout(&mut rig, Transport::Mmio, &[]);
    rig.dm.check_movable().expect("all movable");
    let stuck = Box::new(Movable {
        id: "stuck",
        movable: false,
        shm_base: Arc::default(),
    });
    rig.dm
        .place("stuck", stuck, Transport::Mmio, 0, None)
        .expect("placed");
    let e = rig.dm.check_movable().expect_err("stuck cannot move");
    assert!(e.to_string().starts_with("stuck: cannot be moved"), "{e}");
}

/// A shared memory BAR (a DAX window, a pmem range): 4 MiB of a temporary
/// file, owned by the slot that maps it.
fn shm_backing() -> ShmBacking {
    let backing =
        virtio_devices::pmem::PmemBacking::open(&std::env::temp_dir(), Some(4 << 20), false)
            .expect("backing");
    ShmBacking {
        size: backing.size(),
        host_addr: backing.host_addr(),
        owner: Box::new(backing),
    }
}

/// A device with shared memory placed on PCI; returns where it was told
/// its memory is.
fn place_with_shm(rig: &mut Rig, id: &'static str) -> Arc<Mutex<Option<u64>>> {
    let shm_base = Arc::new(Mutex::new(None));
    let dev = Box::new(Movable {
        id,
        movable: true,
        shm_base: shm_base.clone(),
    });
    rig.dm
        .place(id, dev, Transport::Pci, 0, Some(shm_backing()))
        .expect("placed");
    shm_base
}

impl Rig {
    /// BAR 2 (shared memory) of the function at `at`.
    fn bar2(&self, at: PciAddress) -> u64 {
        let lo = self.mmio_read(ecam(at, 0x18)).unwrap() & !0xf;
        u64::from(lo) | u64::from(self.mmio_read(ecam(at, 0x1c)).unwrap()) << 32
    }

    /// Whether KVM has a memory slot over `addr` (a 4 MiB probe slot there
    /// is refused).
    fn slot_at(&self, addr: u64) -> bool {
        let b = shm_backing();
        // SAFETY: the probe's mapping is owned by the probe slot.
        unsafe {
            MemorySlot::new(
                &self.dm.vm,
                &self.dm.slots,
                addr,
                b.size,
                b.host_addr,
                b.owner,
            )
        }
        .is_err()
    }
}

/// The shared memory BAR the guest moved comes back where the guest put
/// it: KVM's memory slot is there (and not where the device was built),
/// and the device is told its new base (what moves a DAX window's map
/// requests).
#[test]
fn a_moved_shared_memory_bar_is_restored_with_its_memory_slot() {
    let (Some(mut a), Some(mut b)) = (Rig::new("shm-a"), Rig::new("shm-b")) else {
        return;
    };
    place_with_shm(&mut a, "dax0");
    let at = a.at("dax0");
    let bar2 = |r: &Rig| r.bar2(at);
    let built = bar2(&a);
    let moved = built + (64 << 20);
    a.mmio_write(ecam(at, 0x04), &0u32.to_le_bytes());
    a.mmio_write(ecam(at, 0x18), &narrow::low_u32(moved).to_le_bytes());
    a.mmio_write(ecam(at, 0x1c), &((moved >> 32) as u32).to_le_bytes());
    a.mmio_write(ecam(at, 0x04), &6u32.to_le_bytes());
    assert!(a.slot_at(moved), "the running VM followed the move");
    a.dm.pause_devices().expect("pause");
    let state = through_document(&a.dm.save_devices().expect("save"));

    let told = place_with_shm(&mut b, "dax0");
    assert_eq!(*told.lock().unwrap(), Some(built));
    assert!(b.slot_at(built));
    b.dm.restore_devices(&state).expect("restore");
    assert_eq!(bar2(&b), moved);
    assert_eq!(*told.lock().unwrap(), Some(moved));
    assert!(b.slot_at(moved), "KVM maps the memory at the moved BAR");
    assert!(!b.slot_at(built), "and no longer where it was built");
}

/// Two devices the configuration builds in the other order (one was
/// hot-plugged before a device of a kind listed earlier): the restore puts
/// each back in its own slot, and their BARs (registers and shared memory)
/// where the saved VM served them, swapping places with each other; the
/// second one's driver never turned decoding on, so only the VMM knew
/// where it was served.
#[test]
fn devices_built_in_another_order_go_back_to_their_slots_and_bars() {
    let (Some(mut a), Some(mut b)) = (Rig::new("swap-a"), Rig::new("swap-b")) else {
        return;
    };
    place_with_shm(&mut a, "first");
    place_with_shm(&mut a, "second");
    let first = a.at("first");
    a.drive(first, a.bar0(first), 0x61);
    let mut saved = Vec::new();
    for id in ["first", "second"] {
        let at = a.at(id);
        saved.push((id, at, a.bar0(at), a.bar2(at)));
    }
    a.dm.pause_devices().expect("pause");
    let state = through_document(&a.dm.save_devices().expect("save"));

    let told_second = place_with_shm(&mut b, "second");
    let told_first = place_with_shm(&mut b, "first");
    assert_eq!(b.at("second"), saved[0].1, "built in the other's slot");
    b.dm.restore_devices(&state).expect("restore");
    let entry0 = virtio_devices::transport::pci::device::MSIX_TABLE_OFFSET;
    for ((id, at, bar0, bar2), told) in saved.into_iter().zip([told_first, told_second]) {
        assert_eq!(b.at(id), at, "{id}: its own slot");
        assert_eq!((b.bar0(at), b.bar2(at)), (bar0, bar2), "{id}: its BARs");
        let data = b.mmio_read(bar0 + entry0 + 8);
        let control = b.mmio_read(bar0 + entry0 + 12);
        let expect = if id == "first" {
            (Some(0x61), Some(0))
        } else {
            (Some(0), Some(1))
        };
        assert_eq!((data, control), expect, "{id}: served there");
        assert_eq!(*told.lock().unwrap(), Some(bar2), "{id}: its memory base");
        assert!(b.slot_at(bar2), "{id}: KVM maps its memory there");
    }
}

/// The devices a configuration gives (rng, a disk on each transport), not
/// yet driven, are saved on one VM and restored on another built from the
/// same configuration.
#[test]
fn configured_devices_save_and_restore_onto_the_same_configuration() {
    let (Some(mut a), Some(mut b)) = (Rig::new("config-a"), Rig::new("config-b")) else {
        return;
    };
    let config = |rig: &Rig| {
        vm_config_from_json(&json!({
            "payload": {"kernel": "/k"},
            "disks": [
                disk_body(&rig.image("a.img"), "disk0", "pci"),
                disk_body(&rig.image("b.img"), "disk1", "mmio"),
            ],
        }))
        .expect("config")
    };
    a.dm.add_boot_devices(&config(&a), None)
        .expect("boot devices");
    a.dm.check_movable().expect("movable");
    a.dm.pause_devices().expect("pause");
    let state = through_document(&a.dm.save_devices().expect("save"));
    a.dm.resume_devices().expect("resume");
    let ids: Vec<&str> = state.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["_rng", "disk0", "disk1"]);
    b.dm.add_boot_devices(&config(&b), None)
        .expect("boot devices");
    b.dm.restore_devices(&state).expect("restore");
}

impl Rig {
    /// What a driver does to bring up queue 0 of the virtio-PCI function
    /// at `at` (BAR 0 where it was built), rings in guest RAM at `rings`.
    fn driver_ok(&self, at: PciAddress, rings: u64) {
        let bar0 = self.bar0(at);
        self.mmio_write(ecam(at, 0x04), &6u32.to_le_bytes());
        let w = |off: u64, v: u64, len: usize| self.mmio_write(bar0 + off, &v.to_le_bytes()[..len]);
        w(0x14, 1, 1);
        w(0x14, 3, 1);
        w(0x08, 1, 4);
        w(0x0c, 1, 4); // VERSION_1
        w(0x14, 0xb, 1);
        w(0x16, 0, 2);
        w(0x18, 16, 2);
        w(0x20, rings, 8);
        w(0x28, rings + 0x1000, 8);
        w(0x30, rings + 0x2000, 8);
        w(0x1c, 1, 2);
        w(0x14, 0xf, 1);
    }

    /// Whether the device `id` is running, once its activation (on the
    /// activator thread) has settled: running, failed (NEEDS_RESET) or
    /// never asked for (no DRIVER_OK). The bound is for a hang.
    fn activated(&self, id: &str) -> bool {
        let f = self
            .dm
            .pci
            .functions()
            .into_iter()
            .find(|f| f.id == id)
            .expect("placed");
        let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let t = f.transport.lock().unwrap();
            let status = t.status();
            if t.is_activated() || status & 0x40 != 0 || status & 0x4 == 0 {
                return t.is_activated();
            }
            drop(t);
            assert!(std::time::Instant::now() < end, "{id}: activation hangs");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// A running virtio-rng (the guest's driver brought it up) is running
/// again after the restore, without its driver writing DRIVER_OK again.
#[test]
fn a_running_configured_device_runs_again_after_the_restore() {
    let (Some(mut a), Some(mut b)) = (Rig::new("run-a"), Rig::new("run-b")) else {
        return;
    };
    let config = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).expect("config");
    a.dm.add_boot_devices(&config, None).expect("boot devices");
    a.driver_ok(a.at("_rng"), 0x10_0000);
    assert!(a.activated("_rng"));
    a.dm.pause_devices().expect("pause");
    let state = through_document(&a.dm.save_devices().expect("save"));
    let SavedTransport::Pci { state: rng, .. } = &state.devices[0].transport else {
        panic!("rng on PCI");
    };
    assert_eq!(rng.queues.len(), 1, "the running queue's position is saved");
    b.dm.add_boot_devices(&config, None).expect("boot devices");
    assert!(!b.activated("_rng"));
    b.dm.restore_devices(&state).expect("restore");
    assert!(b.activated("_rng"));
}
