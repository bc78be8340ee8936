//! ACPI PCI hot-plug for bus 0, the way Cloud Hypervisor (and QEMU's
//! `acpi-pci-hotplug`) signal it to a guest:
//!
//! - the DSDT describes each slot of bus 0 as a device with `_ADR`, `_SUN`
//!   and `_EJ0`, so Linux's `acpiphp` registers it as a hot-plug slot;
//! - to add or remove a device the VMM sets the slot's bit in `PCIU` (up)
//!   or `PCID` (down) and raises the GED interrupt; the GED's `_EVT` calls
//!   `PSCN`, which reads both registers (reading clears them) and notifies
//!   each slot: "device check" (1) for up, "eject request" (3) for down;
//! - on a device check Linux scans the slot, gives the new function its
//!   BARs and binds its driver; on an eject request it unbinds the driver
//!   and calls the slot's `_EJ0`, which writes the slot's bit to `B0EJ`:
//!   only then does the VMM take the device away ([`EjectRequests`]).
//!
//! Registers, 32-bit, in I/O space at [`PCI_HOTPLUG_PORT`]: 0 `PCIU`,
//! 4 `PCID`, 8 `B0EJ` (write), 12 `PSEG` (segment; only 0 exists).

use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use vmm_sys_util::eventfd::EventFd;

use super::BusDevice;

pub const PCI_HOTPLUG_PORT: u16 = 0xae00;
pub const PCI_HOTPLUG_PORT_COUNT: u64 = 16;
/// Slot 0 is the host bridge; slots 1..=31 can take a device.
pub const HOTPLUG_SLOTS: std::ops::RangeInclusive<u8> = 1..=31;
/// Bits of the slots a device may sit in.
const SLOT_MASK: u32 = !1;

/// Slots whose ejection the guest has asked for, and an eventfd the VMM's
/// control thread waits on: the removal itself (memory slots, daemon
/// connection) is not done on a vCPU thread.
pub struct EjectRequests {
    slots: Mutex<u32>,
    evt: EventFd,
}

impl EjectRequests {
    fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(EjectRequests {
            slots: Mutex::new(0),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        }))
    }

    /// Readable when the guest has ejected a slot.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// The slots ejected since the last call.
    pub fn take(&self) -> Vec<u8> {
        let _ = self.evt.read();
        let bits = std::mem::take(&mut *self.slots.lock().unwrap_or_else(|e| e.into_inner()));
        HOTPLUG_SLOTS.filter(|s| bits & (1 << s) != 0).collect()
    }
}

/// The register block on the I/O bus.
pub struct PciHotplug {
    up: u32,
    down: u32,
    ejects: Arc<EjectRequests>,
}

impl PciHotplug {
    pub fn new() -> std::io::Result<Self> {
        Ok(PciHotplug {
            up: 0,
            down: 0,
            ejects: EjectRequests::new()?,
        })
    }

    pub fn eject_requests(&self) -> Arc<EjectRequests> {
        self.ejects.clone()
    }

    /// A device was put in `slot`: the next scan tells the guest.
    pub fn announce_add(&mut self, slot: u8) {
        self.up |= 1 << slot;
        self.down &= !(1 << slot);
    }

    /// The device in `slot` is to go: the next scan asks the guest to eject it.
    pub fn announce_remove(&mut self, slot: u8) {
        self.down |= 1 << slot;
        self.up &= !(1 << slot);
    }

    /// The DSDT's part: the controller device `\_SB_.PHPR` with its
    /// registers and methods. The slots and `PCNT` go inside the host
    /// bridge: see [`slot_aml`].
    pub fn append_aml(sink: &mut Vec<u8>) {
        let port = usize::from(PCI_HOTPLUG_PORT);
        let len = PCI_HOTPLUG_PORT_COUNT as usize;
        let lock = || aml::Path::new("BLCK");
        aml::Device::new(
            "\\_SB_.PHPR".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A06")),
                &aml::Name::new("_UID".into(), &"PCI Hotplug Controller"),
                &aml::Mutex::new(lock(), 0),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![&aml::IO::new(
                        PCI_HOTPLUG_PORT,
                        PCI_HOTPLUG_PORT,
                        1,
                        len as u8,
                    )]),
                ),
                &aml::OpRegion::new("PCST".into(), aml::OpRegionSpace::SystemIO, &port, &len),
                &aml::Field::new(
                    "PCST".into(),
                    aml::FieldAccessType::DWord,
                    aml::FieldLockRule::NoLock,
                    aml::FieldUpdateRule::WriteAsZeroes,
                    vec![
                        aml::FieldEntry::Named(*b"PCIU", 32),
                        aml::FieldEntry::Named(*b"PCID", 32),
                        aml::FieldEntry::Named(*b"B0EJ", 32),
                        aml::FieldEntry::Named(*b"PSEG", 32),
                    ],
                ),
                // PCEJ(slot, segment): the guest is done with the slot.
                &aml::Method::new(
                    "PCEJ".into(),
                    2,
                    true,
                    vec![
                        &aml::Acquire::new(lock(), 0xffff),
                        &aml::Store::new(&aml::Path::new("PSEG"), &aml::Arg(1)),
                        &aml::ShiftLeft::new(&aml::Path::new("B0EJ"), &aml::ONE, &aml::Arg(0)),
                        &aml::Release::new(lock()),
                        &aml::Return::new(&aml::ZERO),
                    ],
                ),
                // PSCN(): reads what changed and tells the slots.
                &aml::Method::new(
                    "PSCN".into(),
                    0,
                    true,
                    vec![
                        &aml::Acquire::new(lock(), 0xffff),
                        &aml::Store::new(&aml::Local(0), &aml::Path::new("PCIU")),
                        &aml::Store::new(&aml::Local(1), &aml::Path::new("PCID")),
                        &aml::Release::new(lock()),
                        &aml::MethodCall::new(
                            "\\_SB_.PCI0.PCNT".into(),
                            vec![&aml::Local(0), &aml::Local(1)],
                        ),
                    ],
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
}

fn slot_name(slot: u8) -> String {
    format!("S{slot:03}")
}

/// The slot devices and `PCNT(up, down)`, to be placed inside the host
/// bridge's device.
pub fn slot_aml(sink: &mut Vec<u8>) {
    for slot in HOTPLUG_SLOTS {
        aml::Device::new(
            slot_name(slot).as_str().into(),
            vec![
                &aml::Name::new("_ADR".into(), &(u32::from(slot) << 16)),
                &aml::Name::new("_SUN".into(), &slot),
                &aml::Method::new(
                    "_EJ0".into(),
                    1,
                    false,
                    vec![&aml::MethodCall::new(
                        "\\_SB_.PHPR.PCEJ".into(),
                        vec![&aml::Path::new("_SUN"), &aml::ZERO],
                    )],
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
    let paths: Vec<aml::Path> = HOTPLUG_SLOTS
        .map(|s| aml::Path::new(&slot_name(s)))
        .collect();
    let bits: Vec<u32> = HOTPLUG_SLOTS.map(|s| 1u32 << s).collect();
    let tests: Vec<[aml::And; 2]> = bits
        .iter()
        .map(|b| {
            [
                aml::And::new(&aml::ZERO, &aml::Arg(0), b),
                aml::And::new(&aml::ZERO, &aml::Arg(1), b),
            ]
        })
        .collect();
    let (check, eject) = (1u8, 3u8);
    let notifies: Vec<[aml::Notify; 2]> = paths
        .iter()
        .map(|p| [aml::Notify::new(p, &check), aml::Notify::new(p, &eject)])
        .collect();
    let ifs: Vec<aml::If> = tests
        .iter()
        .zip(&notifies)
        .flat_map(|(t, n)| {
            [
                aml::If::new(&t[0], vec![&n[0]]),
                aml::If::new(&t[1], vec![&n[1]]),
            ]
        })
        .collect();
    let body: Vec<&dyn Aml> = ifs.iter().map(|i| i as &dyn Aml).collect();
    aml::Method::new("PCNT".into(), 2, true, body).to_aml_bytes(sink);
}

impl BusDevice for PciHotplug {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            0 => std::mem::take(&mut self.up),
            4 => std::mem::take(&mut self.down),
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data.fill(0);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 8 || data.len() != 4 {
            return; // PSEG: only segment 0 exists; nothing else is writable.
        }
        let mut v = [0u8; 4];
        v.copy_from_slice(data);
        let slots = u32::from_le_bytes(v) & SLOT_MASK;
        if slots == 0 {
            return;
        }
        *self.ejects.slots.lock().unwrap_or_else(|e| e.into_inner()) |= slots;
        if let Err(e) = self.ejects.evt.write(1) {
            virtio_devices::error_limited!("PCI hot-plug: signalling an eject: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r32(dev: &mut PciHotplug, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        dev.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn up_and_down_are_read_once_and_ejects_reach_the_control_thread() {
        let mut dev = PciHotplug::new().unwrap();
        let ejects = dev.eject_requests();
        dev.announce_add(3);
        dev.announce_add(5);
        dev.announce_remove(5); // removal before the guest saw it: only down
        assert_eq!(r32(&mut dev, 0), 1 << 3);
        assert_eq!(r32(&mut dev, 4), 1 << 5);
        assert_eq!((r32(&mut dev, 0), r32(&mut dev, 4)), (0, 0), "cleared");
        assert!(ejects.take().is_empty());
        assert!(ejects.eventfd().read().is_err(), "nothing signalled yet");
        // The guest's _EJ0 for slot 5; slot 0 (the bridge) cannot go.
        dev.write(8, &((1u32 << 5) | 1).to_le_bytes());
        assert_eq!(ejects.eventfd().read().unwrap(), 1);
        dev.write(8, &(1u32 << 7).to_le_bytes());
        assert_eq!(ejects.take(), vec![5, 7]);
        assert!(ejects.take().is_empty());
        // Short or misplaced writes do nothing.
        dev.write(8, &[0xff]);
        dev.write(12, &u32::MAX.to_le_bytes());
        assert!(ejects.take().is_empty());
    }

    #[test]
    fn aml_describes_every_slot_and_the_scan_methods() {
        let mut sink = Vec::new();
        PciHotplug::append_aml(&mut sink);
        slot_aml(&mut sink);
        let has = |name: &[u8]| sink.windows(name.len()).any(|w| w == name);
        for name in [
            b"PHPR", b"PCEJ", b"PSCN", b"PCNT", b"B0EJ", b"S001", b"S031", b"_EJ0",
        ] {
            assert!(has(name), "{}", String::from_utf8_lossy(name));
        }
        assert!(!has(b"S000"), "slot 0 is the host bridge");
    }
}
