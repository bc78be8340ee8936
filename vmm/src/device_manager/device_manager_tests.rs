//! The device manager against the real KVM (a VM fd, its memory slots,
//! irqfds and ioeventfds; no vCPU runs): which devices a configuration
//! gives and where, the hot-plug refusals, and the ids a device holds until
//! the guest ejects it. Each test is skipped where /dev/kvm cannot be
//! opened.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use virtio_devices::device_state::{DeviceStateError, SavedQueue};
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::config::json::{disk_config_from_json, vm_config_from_json};
use crate::device_manager::hotplug_controller::PCI_HOTPLUG_PORT;
use crate::legacy::ged::Ged;

/// Registers of the hot-plug controller (offsets from its port).
const PCIU: u64 = 0;
const PCID: u64 = 4;
const B0EJ: u64 = 8;

/// A device manager on a VM of its own, and a directory for its files.
struct Rig {
    dm: DeviceManager,
    pio: Bus,
    dir: PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Rig {
    /// None (the test is skipped) without /dev/kvm.
    fn new(name: &str) -> Option<Rig> {
        let Ok(kvm) = Kvm::new() else {
            eprintln!("no /dev/kvm; skipped");
            return None;
        };
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
        let memory = MemoryConfig {
            size: crate::config::MIN_MEMORY,
            ..MemoryConfig::default()
        };
        let mem = crate::memory::create_guest_memory(&memory).expect("guest RAM");
        crate::memory::register_with_kvm(&vm, &mem).expect("RAM slots");
        let pio = Bus::new();
        let mmio = Arc::new(Bus::new());
        let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let ged = GedHandle(Arc::new(Mutex::new(Ged::new(irq))));
        let dm = DeviceManager::new(
            &kvm,
            &vm,
            &pio,
            &mmio,
            GuestMemoryAtomic::new(mem),
            &memory,
            1,
            ged,
        )
        .expect("device manager");
        let dir = std::env::temp_dir().join(format!("dm-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test directory");
        Some(Rig { dm, pio, dir })
    }

    /// A 1 MiB disk image in the rig's directory.
    fn image(&self, name: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("disk image");
        path
    }

    fn disk(&self, id: &str, transport: &str) -> DiskConfig {
        let path = self.image(&format!("{id}.img"));
        disk_config_from_json(&disk_body(&path, id, transport), 0).expect("disk config")
    }

    fn register(&self, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        assert!(self
            .pio
            .read(u64::from(PCI_HOTPLUG_PORT) + offset, &mut data));
        u32::from_le_bytes(data)
    }

    /// What the guest's `_EJ0` does for `slot` of segment 0.
    fn guest_ejects(&self, slot: u8) {
        let bit = (1u32 << slot).to_le_bytes();
        assert!(self.pio.write(u64::from(PCI_HOTPLUG_PORT) + B0EJ, &bit));
    }

    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .dm
            .pci_addresses()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        ids.sort();
        ids
    }

    fn counted(&self) -> Vec<&str> {
        self.dm
            .device_counters()
            .iter()
            .map(|(id, _)| id.as_str())
            .collect()
    }
}

fn disk_body(path: &Path, id: &str, transport: &str) -> Value {
    json!({"path": path, "id": id, "transport": transport})
}

fn slot_of(info: &PciDeviceInfo) -> u8 {
    // `SSSS:00:DD.0`
    u8::from_str_radix(&info.bdf[8..10], 16).expect("slot in the bdf")
}

#[test]
fn boot_devices_go_where_the_configuration_says_with_their_counters() {
    let Some(mut rig) = Rig::new("boot") else {
        return;
    };
    let config = vm_config_from_json(&json!({
        "payload": {"kernel": "/k"},
        "disks": [
            disk_body(&rig.image("a.img"), "disk0", "pci"),
            disk_body(&rig.image("b.img"), "disk1", "mmio"),
        ],
    }))
    .expect("config");
    rig.dm
        .add_boot_devices(&config, None)
        .expect("boot devices");
    // The rng is on by default; the MMIO disk has no PCI address.
    assert_eq!(rig.ids(), ["_rng", "disk0"]);
    let mut counted = rig.counted();
    counted.sort_unstable();
    assert_eq!(counted, ["disk0", "disk1"]);
    // Nothing is announced for devices there at boot.
    assert_eq!(rig.register(PCIU), 0);
}

#[test]
fn a_hotplug_over_mmio_is_refused_and_adds_nothing() {
    let Some(mut rig) = Rig::new("mmio") else {
        return;
    };
    let d = rig.disk("disk9", "mmio");
    let e = rig.dm.hotplug_disk(&d).expect_err("MMIO has no hot-plug");
    assert!(
        matches!(&e, DeviceManagerError::HotplugOverMmio { id } if id == "disk9"),
        "{e}"
    );
    assert!(
        !e.is_refusal(),
        "a wrong request, not a refusal of the VM's state"
    );
    assert!(rig.ids().is_empty());
    assert!(rig.counted().is_empty());
    assert_eq!(rig.register(PCIU), 0);
}

#[test]
fn a_hotplugged_disk_gets_a_slot_and_the_guest_is_told() {
    let Some(mut rig) = Rig::new("plug") else {
        return;
    };
    let info = rig
        .dm
        .hotplug_disk(&rig.disk("disk0", "pci"))
        .expect("hot-plug");
    assert_eq!(info.id, "disk0");
    assert!(info.bdf.starts_with("0000:00:"), "{}", info.bdf);
    let slot = slot_of(&info);
    assert_eq!(rig.register(PCIU), 1 << slot, "PCIU has the new slot's bit");
    assert_eq!(rig.ids(), ["disk0"]);
    assert_eq!(rig.counted(), ["disk0"]);
}

#[test]
fn an_id_stays_taken_until_the_guest_ejects_its_device() {
    let Some(mut rig) = Rig::new("eject") else {
        return;
    };
    let d = rig.disk("disk0", "pci");
    let slot = slot_of(&rig.dm.hotplug_disk(&d).expect("hot-plug"));
    rig.dm.request_removal("disk0").expect("removal asked");
    assert_eq!(rig.register(PCID), 1 << slot, "PCID has the slot's bit");
    // Until the guest lets go, the id is still in use.
    let e = rig.dm.hotplug_disk(&d).expect_err("id in use");
    assert!(
        matches!(&e, DeviceManagerError::IdStillPlaced { id, at } if id == "disk0" && at.slot == slot),
        "{e}"
    );
    assert!(e.is_refusal());
    assert!(rig.dm.complete_ejects().is_empty(), "nothing ejected yet");
    rig.guest_ejects(slot);
    assert_eq!(rig.dm.complete_ejects(), ["disk0"]);
    assert!(rig.ids().is_empty());
    assert!(rig.counted().is_empty());
    // The id is free again.
    let again = rig.dm.hotplug_disk(&d).expect("hot-plug after the eject");
    assert_eq!(again.id, "disk0");
}

#[test]
fn removal_refuses_unknown_ids_and_the_rng() {
    let Some(mut rig) = Rig::new("remove") else {
        return;
    };
    let config = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).expect("config");
    rig.dm
        .add_boot_devices(&config, None)
        .expect("boot devices");
    let e = rig.dm.request_removal("nope").expect_err("unknown id");
    assert!(
        matches!(&e, DeviceManagerError::NotHotpluggable { id } if id == "nope"),
        "{e}"
    );
    assert!(e.is_refusal());
    let e = rig.dm.request_removal("_rng").expect_err("the rng stays");
    assert!(matches!(e, DeviceManagerError::RngNotRemovable), "{e}");
    // Neither asked the guest for anything.
    assert_eq!(rig.register(PCID), 0);
    assert_eq!(rig.ids(), ["_rng"]);
}

#[test]
fn new_ram_that_overlaps_guest_ram_is_refused_and_changes_nothing() {
    let Some(mut rig) = Rig::new("ram") else {
        return;
    };
    let memory = MemoryConfig {
        size: crate::config::MIN_MEMORY,
        ..MemoryConfig::default()
    };
    let regions_before = rig.dm.mem.memory().iter().count();
    // A region over RAM that exists: KVM refuses the overlapping slot.
    let region = crate::memory::create_hotplug_region(&memory, 0, crate::config::HOTPLUG_BLOCK)
        .expect("region");
    let e = rig.dm.add_ram_region(region).expect_err("overlapping RAM");
    assert!(
        matches!(
            e,
            DeviceManagerError::RamSlot { addr: 0, .. }
                | DeviceManagerError::RamRegion { addr: 0, .. }
        ),
        "{e}"
    );
    assert_eq!(rig.dm.mem.memory().iter().count(), regions_before);
    assert!(rig.dm.hotplugged_ram.is_empty());
}

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
fn through_document(state: &state::DevicesState) -> state::DevicesState {
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
    let restore_onto =
        |name: &str, dev1: Transport, extra: &[&'static str], s: &state::DevicesState| {
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
    let spoiled: state::DevicesState = serde_json::from_value(spoiled).unwrap();
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
    let overlapping: state::DevicesState = serde_json::from_value(spoiled.clone()).unwrap();
    let (d, result) = restore_onto("layout-overlap", Transport::Mmio, &["dev2"], &overlapping);
    let e = result.expect_err("overlapping BARs");
    assert!(
        e.starts_with("dev2: BAR 0 at ") && e.contains("overlaps dev0's"),
        "{e}"
    );
    assert_eq!(d.register(PCIU), 0, "hot-plug registers not applied");
    saved_device(&mut spoiled, "dev2")["transport"]["bars"]["bar0"] = json!(0x1000);
    let outside: state::DevicesState = serde_json::from_value(spoiled).unwrap();
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
