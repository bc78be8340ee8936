//! ACPI PCI hot-plug on every PCI segment, the way Cloud Hypervisor (and
//! QEMU's `acpi-pci-hotplug`) signal it to a guest:
//!
//! - the DSDT describes each slot of bus 0 of each segment as a device with
//!   `_ADR`, `_SUN` and `_EJ0` inside that segment's host bridge, so Linux's
//!   `acpiphp` registers it as a hot-plug slot;
//! - to add or remove a device the VMM sets the slot's bit in its segment's
//!   `PCIU` (up) or `PCID` (down) and raises the GED interrupt; the GED's
//!   `_EVT` calls `PSCN`, which, segment by segment, selects the segment
//!   (`PSEG`), reads both registers (reading clears them) and has the host
//!   bridge's `PCNT` notify each slot: "device check" (1) for up, "eject
//!   request" (3) for down;
//! - on a device check Linux scans the slot, gives the new function its
//!   BARs and binds its driver; on an eject request it unbinds the driver
//!   and calls the slot's `_EJ0`, which selects the segment and writes the
//!   slot's bit to `B0EJ`: only then does the VMM take the device away
//!   ([`EjectRequests`]).
//!
//! Registers, 32-bit, in I/O space at [`PCI_HOTPLUG_PORT`]: 0 `PCIU`,
//! 4 `PCID`, 8 `B0EJ` (write), 12 `PSEG` (the segment the other three are
//! about; written first, under the controller's ACPI mutex).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::hotplug_aml::{PortController, RawAml, RegisterField};
use crate::bus::BusDevice;

pub const PCI_HOTPLUG_PORT: u16 = 0xae00;
pub const PCI_HOTPLUG_PORT_COUNT: u64 = 16;
/// Slot 0 is the host bridge; slots 1..=31 can take a device.
pub const HOTPLUG_SLOTS: std::ops::RangeInclusive<u8> = 1..=31;
/// Bits of the slots a device may sit in.
const SLOT_MASK: u32 = !1;

/// The ACPI path of PCI segment `segment`'s host bridge: `\_SB_.PCI0` for
/// segment 0 (the name it always had), `\_SB_.PCnn` (hex) for the others,
/// as Cloud Hypervisor names them.
pub fn host_bridge_path(segment: u16) -> String {
    match segment {
        0 => "\\_SB_.PCI0".to_string(),
        s => format!("\\_SB_.PC{s:02X}"),
    }
}

/// Slots whose ejection the guest has asked for, and an eventfd the VMM's
/// control thread waits on: the removal itself (memory slots, daemon
/// connection) is not done on a vCPU thread.
pub struct EjectRequests {
    /// Slot bits by segment.
    slots: Mutex<BTreeMap<u16, u32>>,
    evt: EventFd,
}

impl EjectRequests {
    fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(EjectRequests {
            slots: Mutex::new(BTreeMap::new()),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        }))
    }

    /// Readable when the guest has ejected a slot.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// The (segment, slot) pairs ejected since the last call.
    pub fn take(&self) -> Vec<(u16, u8)> {
        let _ = self.evt.read();
        let bits = std::mem::take(&mut *self.slots.lock().unwrap_or_else(|e| e.into_inner()));
        bits.into_iter()
            .flat_map(|(seg, b)| {
                HOTPLUG_SLOTS
                    .filter(move |s| b & (1 << s) != 0)
                    .map(move |s| (seg, s))
            })
            .collect()
    }
}

/// The controller's saved registers: per segment the slots to announce
/// as added and as removed, the selected segment, and the slots the guest
/// ejected that the VMM has not removed yet.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugControllerState {
    pub up: Vec<u32>,
    pub down: Vec<u32>,
    pub selected: u32,
    pub pending_ejects: BTreeMap<u16, u32>,
}

/// The register block on the I/O bus.
pub struct PciHotplugController {
    /// Per segment: slots to announce as added, and as to be removed.
    up: Vec<u32>,
    down: Vec<u32>,
    /// `PSEG`: the segment the guest is reading or ejecting on.
    selected: u32,
    ejects: Arc<EjectRequests>,
}

impl PciHotplugController {
    /// The controller of `segments` PCI segments (at least one).
    pub fn new(segments: u16) -> std::io::Result<Self> {
        let n = usize::from(segments.max(1));
        Ok(PciHotplugController {
            up: vec![0; n],
            down: vec![0; n],
            selected: 0,
            ejects: EjectRequests::new()?,
        })
    }

    pub fn eject_requests(&self) -> Arc<EjectRequests> {
        self.ejects.clone()
    }

    /// A device was put in `slot` of `segment`: the next scan tells the guest.
    pub fn announce_add(&mut self, segment: u16, slot: u8) {
        let s = usize::from(segment);
        if let (Some(up), Some(down)) = (self.up.get_mut(s), self.down.get_mut(s)) {
            *up |= 1 << slot;
            *down &= !(1 << slot);
        }
    }

    /// The device in `slot` of `segment` is to go: the next scan asks the
    /// guest to eject it.
    pub fn announce_remove(&mut self, segment: u16, slot: u8) {
        let s = usize::from(segment);
        if let (Some(up), Some(down)) = (self.up.get_mut(s), self.down.get_mut(s)) {
            *down |= 1 << slot;
            *up &= !(1 << slot);
        }
    }

    /// The registers and the ejects the control thread has not taken yet.
    pub fn save(&self) -> HotplugControllerState {
        HotplugControllerState {
            up: self.up.clone(),
            down: self.down.clone(),
            selected: self.selected,
            pending_ejects: self
                .ejects
                .slots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// Takes `state` (of a controller with as many segments), or refuses
    /// it naming the field and changes nothing. Pending ejects wake the
    /// control thread again.
    pub fn restore(&mut self, state: &HotplugControllerState) -> Result<(), (String, String)> {
        let segments = self.up.len();
        for (name, bits) in [("up", &state.up), ("down", &state.down)] {
            if bits.len() != segments {
                return Err((
                    name.to_string(),
                    format!("{} segments, this VM has {segments}", bits.len()),
                ));
            }
            if let Some(i) = bits.iter().position(|b| b & !SLOT_MASK != 0) {
                return Err((
                    format!("{name}[{i}]"),
                    "bit of slot 0 (the host bridge)".into(),
                ));
            }
        }
        for (segment, bits) in &state.pending_ejects {
            if usize::from(*segment) >= segments || bits & !SLOT_MASK != 0 {
                return Err((
                    format!("pending_ejects[{segment}]"),
                    format!("{bits:#x}: no such segment, or the host bridge's slot"),
                ));
            }
        }
        self.up.clone_from(&state.up);
        self.down.clone_from(&state.down);
        self.selected = state.selected;
        if !state.pending_ejects.is_empty() {
            self.ejects
                .slots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone_from(&state.pending_ejects);
            if let Err(e) = self.ejects.evt.write(1) {
                virtio_devices::error_limited!("PCI hot-plug: signalling restored ejects: {e}");
            }
        }
        Ok(())
    }

    /// The DSDT's part: the controller device `\_SB_.PHPR` with its
    /// registers and methods, for `segments` segments. The slots and `PCNT`
    /// go inside each host bridge: see [`slot_aml`].
    pub fn append_aml(sink: &mut Vec<u8>, segments: u16) {
        let lock = || aml::Path::new("BLCK");
        // PSCN(): for each segment, what changed, told to its slots.
        let mut scan = Vec::new();
        let (pseg, pciu, pcid) = (
            aml::Path::new("PSEG"),
            aml::Path::new("PCIU"),
            aml::Path::new("PCID"),
        );
        for segment in 0..segments.max(1) {
            let pcnt = format!("{}.PCNT", host_bridge_path(segment));
            aml::Acquire::new(lock(), 0xffff).to_aml_bytes(&mut scan);
            aml::Store::new(&pseg, &segment).to_aml_bytes(&mut scan);
            aml::Store::new(&aml::Local(0), &pciu).to_aml_bytes(&mut scan);
            aml::Store::new(&aml::Local(1), &pcid).to_aml_bytes(&mut scan);
            aml::Release::new(lock()).to_aml_bytes(&mut scan);
            aml::MethodCall::new(pcnt.as_str().into(), vec![&aml::Local(0), &aml::Local(1)])
                .to_aml_bytes(&mut scan);
        }
        let scan = RawAml(scan);
        // PCEJ(slot, segment): the guest is done with the slot.
        let pcej = RawAml::of(&aml::Method::new(
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
        ));
        let pscn = aml::Method::new("PSCN".into(), 0, true, vec![&scan]);
        PortController {
            path: "\\_SB_.PHPR",
            uid: "PCI Hotplug Controller",
            port: PCI_HOTPLUG_PORT,
            ports: const { narrow::u8_of(PCI_HOTPLUG_PORT_COUNT) },
            mutex: "BLCK",
            region: "PCST",
            fields: vec![RegisterField {
                access: aml::FieldAccessType::DWord,
                update: aml::FieldUpdateRule::WriteAsZeroes,
                entries: vec![
                    aml::FieldEntry::Named(*b"PCIU", 32),
                    aml::FieldEntry::Named(*b"PCID", 32),
                    aml::FieldEntry::Named(*b"B0EJ", 32),
                    aml::FieldEntry::Named(*b"PSEG", 32),
                ],
            }],
        }
        .append_aml(&[&pcej, &pscn], sink);
    }
}

fn slot_name(slot: u8) -> String {
    format!("S{slot:03}")
}

/// The slot devices of `segment`, their `PCEJ_`-calling `_EJ0`s and
/// `PCNT(up, down)`, to be placed inside that segment's host bridge. Kept
/// small (a VM may have 96 segments, and the DSDT lives below 1 MiB): each
/// slot's `_EJ0` calls the bridge's `PEJ_`, which knows the segment, and
/// `PCNT` tests each slot once per kind of notification through `DVNT`.
pub fn slot_aml(sink: &mut Vec<u8>, segment: u16) {
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
                    // PEJ_ is found in the enclosing host bridge (ACPI's
                    // search rules for a single name segment).
                    vec![&aml::MethodCall::new(
                        "PEJ_".into(),
                        vec![&aml::Path::new("_SUN")],
                    )],
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
    // PEJ_(slot): eject `slot` of this segment.
    aml::Method::new(
        "PEJ_".into(),
        1,
        false,
        vec![&aml::MethodCall::new(
            "\\_SB_.PHPR.PCEJ".into(),
            vec![&aml::Arg(0), &segment],
        )],
    )
    .to_aml_bytes(sink);
    // DVNT(bits, what): Notify(slot, what) for each slot whose bit is set.
    let paths: Vec<aml::Path> = HOTPLUG_SLOTS
        .map(|s| aml::Path::new(&slot_name(s)))
        .collect();
    let bits: Vec<u32> = HOTPLUG_SLOTS.map(|s| 1u32 << s).collect();
    let tests: Vec<aml::And> = bits
        .iter()
        .map(|b| aml::And::new(&aml::ZERO, &aml::Arg(0), b))
        .collect();
    let notifies: Vec<aml::Notify> = paths
        .iter()
        .map(|p| aml::Notify::new(p, &aml::Arg(1)))
        .collect();
    let ifs: Vec<aml::If> = tests
        .iter()
        .zip(&notifies)
        .map(|(t, n)| aml::If::new(t, vec![n]))
        .collect();
    let body: Vec<&dyn Aml> = ifs.iter().map(|i| i as &dyn Aml).collect();
    aml::Method::new("DVNT".into(), 2, true, body).to_aml_bytes(sink);
    let (check, eject) = (1u8, 3u8);
    aml::Method::new(
        "PCNT".into(),
        2,
        true,
        vec![
            &aml::MethodCall::new("DVNT".into(), vec![&aml::Arg(0), &check]),
            &aml::MethodCall::new("DVNT".into(), vec![&aml::Arg(1), &eject]),
        ],
    )
    .to_aml_bytes(sink);
}

impl BusDevice for PciHotplugController {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let s = self.selected as usize;
        let value = match offset {
            0 => self.up.get_mut(s).map_or(0, std::mem::take),
            4 => self.down.get_mut(s).map_or(0, std::mem::take),
            12 => self.selected,
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data.fill(0);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() != 4 {
            return;
        }
        let mut v = [0u8; 4];
        v.copy_from_slice(data);
        let v = u32::from_le_bytes(v);
        match offset {
            // A segment that does not exist selects nothing: reads give 0,
            // ejects are dropped.
            12 => self.selected = v,
            8 => self.eject(v),
            _ => {}
        }
    }
}

impl PciHotplugController {
    /// `B0EJ`: the guest let go of the slots in `bits` of the selected segment.
    fn eject(&mut self, bits: u32) {
        let slots = bits & SLOT_MASK;
        let Ok(segment) = u16::try_from(self.selected) else {
            return;
        };
        if slots == 0 || usize::from(segment) >= self.up.len() {
            return;
        }
        *self
            .ejects
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(segment)
            .or_default() |= slots;
        if let Err(e) = self.ejects.evt.write(1) {
            virtio_devices::error_limited!("PCI hot-plug: signalling an eject: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r32(dev: &mut PciHotplugController, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        dev.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    fn w32(dev: &mut PciHotplugController, offset: u64, v: u32) {
        dev.write(offset, &v.to_le_bytes());
    }

    /// Announcements the guest has not read, the selected segment and an
    /// eject the control thread has not taken come back in a new
    /// controller (the eject wakes the control thread again); a state of
    /// another segment count or with the bridge's slot is refused by field
    /// and changes nothing.
    #[test]
    fn state_round_trip_and_refusals() {
        let mut dev = PciHotplugController::new(2).unwrap();
        dev.announce_add(1, 3);
        dev.announce_remove(0, 4);
        w32(&mut dev, 12, 1);
        w32(&mut dev, 8, 1 << 6);
        let state: HotplugControllerState =
            serde_json::from_value(serde_json::to_value(dev.save()).unwrap()).unwrap();

        let mut fresh = PciHotplugController::new(2).unwrap();
        let ejects = fresh.eject_requests();
        fresh.restore(&state).unwrap();
        assert_eq!(ejects.eventfd().read().unwrap(), 1, "control thread woken");
        assert_eq!(ejects.take(), vec![(1, 6)]);
        assert_eq!(r32(&mut fresh, 12), 1);
        assert_eq!(r32(&mut fresh, 0), 1 << 3, "segment 1's PCIU");
        w32(&mut fresh, 12, 0);
        assert_eq!(r32(&mut fresh, 4), 1 << 4, "segment 0's PCID");

        let mut other = PciHotplugController::new(1).unwrap();
        let e = other.restore(&state).unwrap_err();
        assert_eq!(e.0, "up");
        let mut bad = state.clone();
        bad.down[1] = 1;
        let e = PciHotplugController::new(2)
            .unwrap()
            .restore(&bad)
            .unwrap_err();
        assert_eq!(e.0, "down[1]");
        let mut bad = state.clone();
        bad.pending_ejects.insert(5, 1 << 2);
        let mut fresh = PciHotplugController::new(2).unwrap();
        let e = fresh.restore(&bad).unwrap_err();
        assert_eq!(e.0, "pending_ejects[5]");
        assert_eq!(r32(&mut fresh, 0), 0, "nothing applied");
        assert!(fresh.eject_requests().take().is_empty());
    }

    #[test]
    fn up_and_down_are_read_once_and_ejects_reach_the_control_thread() {
        let mut dev = PciHotplugController::new(1).unwrap();
        let ejects = dev.eject_requests();
        dev.announce_add(0, 3);
        dev.announce_add(0, 5);
        dev.announce_remove(0, 5); // removal before the guest saw it: only down
        assert_eq!(r32(&mut dev, 0), 1 << 3);
        assert_eq!(r32(&mut dev, 4), 1 << 5);
        assert_eq!((r32(&mut dev, 0), r32(&mut dev, 4)), (0, 0), "cleared");
        assert!(ejects.take().is_empty());
        assert!(ejects.eventfd().read().is_err(), "nothing signalled yet");
        // The guest's _EJ0 for slot 5; slot 0 (the bridge) cannot go.
        w32(&mut dev, 8, (1u32 << 5) | 1);
        assert_eq!(ejects.eventfd().read().unwrap(), 1);
        w32(&mut dev, 8, 1u32 << 7);
        assert_eq!(ejects.take(), vec![(0, 5), (0, 7)]);
        assert!(ejects.take().is_empty());
        // Short writes do nothing.
        dev.write(8, &[0xff]);
        assert!(ejects.take().is_empty());
    }

    #[test]
    fn each_segment_keeps_its_own_slot_bits() {
        let mut dev = PciHotplugController::new(3).unwrap();
        let ejects = dev.eject_requests();
        dev.announce_add(0, 2);
        dev.announce_add(1, 2);
        dev.announce_add(2, 9);
        dev.announce_remove(1, 4);
        dev.announce_add(3, 1); // no such segment: nothing to tell
                                // As PSCN reads them: select, then PCIU and PCID.
        let mut seen = Vec::new();
        for seg in 0..4u32 {
            w32(&mut dev, 12, seg);
            assert_eq!(r32(&mut dev, 12), seg, "PSEG reads back");
            seen.push((r32(&mut dev, 0), r32(&mut dev, 4)));
        }
        assert_eq!(
            seen,
            vec![(1 << 2, 0), (1 << 2, 1 << 4), (1 << 9, 0), (0, 0)]
        );
        // Ejects land on the selected segment; one selecting a segment
        // that does not exist is dropped.
        w32(&mut dev, 12, 1);
        w32(&mut dev, 8, 1 << 4);
        w32(&mut dev, 12, 0);
        w32(&mut dev, 8, 1 << 2);
        w32(&mut dev, 12, 7);
        w32(&mut dev, 8, 1 << 6);
        assert_eq!(ejects.take(), vec![(0, 2), (1, 4)]);
    }

    fn has(sink: &[u8], name: &[u8]) -> bool {
        sink.windows(name.len()).any(|w| w == name)
    }

    #[test]
    fn aml_describes_every_slot_and_the_scan_methods() {
        let mut sink = Vec::new();
        PciHotplugController::append_aml(&mut sink, 1);
        slot_aml(&mut sink, 0);
        for name in [
            &b"PHPR"[..],
            b"PCEJ",
            b"PSCN",
            b"PCNT",
            b"DVNT",
            b"PEJ_",
            b"B0EJ",
            b"PSEG",
            b"S001",
            b"S031",
            b"_EJ0",
            b"PCI0",
        ] {
            assert!(has(&sink, name), "{}", String::from_utf8_lossy(name));
        }
        assert!(!has(&sink, b"S000"), "slot 0 is the host bridge");
        assert!(!has(&sink, b"PC01"), "one segment only");
    }

    #[test]
    fn the_scan_visits_every_segments_bridge() {
        let mut sink = Vec::new();
        PciHotplugController::append_aml(&mut sink, 3);
        for name in [&b"PCI0PCNT"[..], b"PC01PCNT", b"PC02PCNT"] {
            assert!(has(&sink, name), "{}", String::from_utf8_lossy(name));
        }
        assert!(!has(&sink, b"PC03"));
        assert_eq!(host_bridge_path(0x5f), "\\_SB_.PC5F");
        // Each segment's PEJ_ passes its own number to PCEJ.
        let mut seg = Vec::new();
        slot_aml(&mut seg, 0x42);
        // MethodCall PCEJ: the path, Arg0 (0x68), then BytePrefix 0x42.
        assert!(has(&seg, &[b'P', b'C', b'E', b'J', 0x68, 0x0a, 0x42]));
    }
}
