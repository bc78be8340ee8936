//! The device manager against the real KVM (a VM fd, its memory slots,
//! irqfds and ioeventfds; no vCPU runs): which devices a configuration
//! gives and where, the hot-plug refusals, and the ids a device holds until
//! the guest ejects it. Each test is skipped where /dev/kvm cannot be
//! opened.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::config::json::{disk_config_from_json, vm_config_from_json};
use crate::device_manager::hotplug_controller::PCI_HOTPLUG_PORT;
use crate::legacy::ged::Ged;

/// Registers of the hot-plug controller (offsets from its port).
pub(super) const PCIU: u64 = 0;
const PCID: u64 = 4;
const B0EJ: u64 = 8;

/// A device manager on a VM of its own, and a directory for its files.
pub(super) struct Rig {
    pub(super) dm: DeviceManager,
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
    pub(super) fn new(name: &str) -> Option<Rig> {
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
    pub(super) fn image(&self, name: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("disk image");
        path
    }

    fn disk(&self, id: &str, transport: &str) -> DiskConfig {
        let path = self.image(&format!("{id}.img"));
        disk_config_from_json(&disk_body(&path, id, transport), 0).expect("disk config")
    }

    pub(super) fn register(&self, offset: u64) -> u32 {
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

pub(super) fn disk_body(path: &Path, id: &str, transport: &str) -> Value {
    json!({"path": path, "id": id, "transport": transport})
}

pub(super) fn slot_of(info: &PciDeviceInfo) -> u8 {
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
