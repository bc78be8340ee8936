//! ACPI memory hot-plug, the way Cloud Hypervisor and QEMU describe it to a
//! guest:
//!
//! - the DSDT has a controller `\_SB_.MHPC` and, inside it, one memory
//!   device (`PNP0C80`, Linux's `acpi_memhotplug` driver) per slot, whose
//!   `_STA` and `_CRS` ask the controller's registers about that slot;
//! - to add RAM the VMM maps it, gives it to KVM and the devices, fills a
//!   free slot with its range and marks it "inserting", then raises the
//!   GED interrupt with [`crate::legacy::ged::EVENT_MEMORY_HOTPLUG`]; the GED's
//!   `_EVT` calls `MSCN`, which notifies each inserting slot with "device
//!   check" and acknowledges it; Linux then evaluates `_CRS`, adds the range
//!   and (with the usual auto-online policy) onlines its memory blocks.
//!
//! Hot-added RAM is never taken away (as in Cloud Hypervisor: ACPI memory
//! is not unplugged), so there is no eject.
//!
//! Registers in I/O space at [`MEMORY_HOTPLUG_PORT`] (QEMU's memory
//! hot-plug base), for the slot selected by `MSEL`: 0 `MHBL`, 4 `MHBH`
//! (base, low and high 32 bits, read-only), 8 `MHLL`, 12 `MHLH` (length),
//! 16 `MSEL` (slot number, read/write), 20 status byte: bit 0 `MEN_`
//! (enabled, read-only), bit 1 `MINS` (inserting; writing 1 acknowledges).

use acpi_tables::{aml, Aml};

use crate::bus::BusDevice;

pub const MEMORY_HOTPLUG_PORT: u16 = 0xa00;
pub const MEMORY_HOTPLUG_PORT_COUNT: u64 = 24;
/// Slots, each holding the RAM one `vm.resize` added. Cloud Hypervisor has
/// 8; Kata grows a sandbox's RAM once per container, so more are kept.
pub const MEMORY_SLOTS: usize = 32;

const BASE_LOW: u64 = 0;
const BASE_HIGH: u64 = 4;
const LENGTH_LOW: u64 = 8;
const LENGTH_HIGH: u64 = 12;
const SELECTOR: u64 = 16;
const STATUS: u64 = 20;
const STATUS_ENABLED: u8 = 1 << 0;
const STATUS_INSERTING: u8 = 1 << 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    base: u64,
    length: u64,
    enabled: bool,
    inserting: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "all {MEMORY_SLOTS} memory hot-plug slots are in use (each vm.resize that grows RAM takes one)"
)]
pub struct NoFreeSlot;

/// The controller's register block on the I/O bus and the slots' state.
#[derive(Default)]
pub struct MemoryHotplugController {
    slots: [Slot; MEMORY_SLOTS],
    selected: u32,
}

impl MemoryHotplugController {
    pub fn new() -> Self {
        Self::default()
    }

    /// True when a slot is free for [`Self::insert`].
    pub fn has_free_slot(&self) -> bool {
        self.slots.iter().any(|s| !s.enabled)
    }

    /// Puts `[base, base + length)` in the first free slot, marked inserting:
    /// the next `MSCN` tells the guest. Returns the slot.
    pub fn insert(&mut self, base: u64, length: u64) -> Result<usize, NoFreeSlot> {
        let (i, slot) = self
            .slots
            .iter_mut()
            .enumerate()
            .find(|(_, s)| !s.enabled)
            .ok_or(NoFreeSlot)?;
        *slot = Slot {
            base,
            length,
            enabled: true,
            inserting: true,
        };
        Ok(i)
    }

    fn slot(&self) -> Option<&Slot> {
        self.slots.get(usize::try_from(self.selected).ok()?)
    }

    /// The DSDT's part: `\_SB_.MHPC`, its registers, methods and slot
    /// devices. Without hot-plug (`enabled` false) only an empty `MSCN`,
    /// so the GED's `_EVT` always has something to call.
    pub fn append_aml(enabled: bool, sink: &mut Vec<u8>) {
        let hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A06"));
        let uid = aml::Name::new("_UID".into(), &"Memory Hotplug Controller");
        if !enabled {
            let scan = aml::Method::new("MSCN".into(), 0, true, vec![]);
            aml::Device::new("\\_SB_.MHPC".into(), vec![&hid, &uid, &scan]).to_aml_bytes(sink);
            return;
        }
        let port = usize::from(MEMORY_HOTPLUG_PORT);
        let len = const { narrow::usize_of(MEMORY_HOTPLUG_PORT_COUNT) };
        let crs = aml::Name::new(
            "_CRS".into(),
            &aml::ResourceTemplate::new(vec![&aml::IO::new(
                MEMORY_HOTPLUG_PORT,
                MEMORY_HOTPLUG_PORT,
                1,
                const { narrow::u8_of(MEMORY_HOTPLUG_PORT_COUNT) },
            )]),
        );
        let lock = aml::Mutex::new("MLCK".into(), 0);
        let region = aml::OpRegion::new("MHPR".into(), aml::OpRegionSpace::SystemIO, &port, &len);
        let dwords = aml::Field::new(
            "MHPR".into(),
            aml::FieldAccessType::DWord,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::Preserve,
            vec![
                aml::FieldEntry::Named(*b"MHBL", 32),
                aml::FieldEntry::Named(*b"MHBH", 32),
                aml::FieldEntry::Named(*b"MHLL", 32),
                aml::FieldEntry::Named(*b"MHLH", 32),
                aml::FieldEntry::Named(*b"MSEL", 32),
            ],
        );
        let status = aml::Field::new(
            "MHPR".into(),
            aml::FieldAccessType::Byte,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::WriteAsZeroes,
            vec![
                aml::FieldEntry::Reserved(160),
                aml::FieldEntry::Named(*b"MEN_", 1),
                aml::FieldEntry::Named(*b"MINS", 1),
            ],
        );
        let mut methods = Vec::new();
        methods_aml(&mut methods);
        let mut slots = Vec::new();
        for i in 0..MEMORY_SLOTS {
            slot_aml(i, &mut slots);
        }
        let methods = RawAml(&methods);
        let slots = RawAml(&slots);
        aml::Device::new(
            "\\_SB_.MHPC".into(),
            vec![
                &hid, &uid, &crs, &lock, &region, &dwords, &status, &methods, &slots,
            ],
        )
        .to_aml_bytes(sink);
    }
}

/// Already encoded AML, to put inside a device.
struct RawAml<'a>(&'a [u8]);

impl Aml for RawAml<'_> {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(self.0);
    }
}

fn slot_name(i: usize) -> String {
    format!("M{i:03}")
}

/// One memory device: `_STA` and `_CRS` ask the controller about slot `i`.
fn slot_aml(i: usize, sink: &mut Vec<u8>) {
    let sta = aml::MethodCall::new("MSTA".into(), vec![&i]);
    let crs = aml::MethodCall::new("MCRS".into(), vec![&i]);
    aml::Device::new(
        slot_name(i).as_str().into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C80")),
            &aml::Name::new("_UID".into(), &i),
            &aml::Method::new("_STA".into(), 0, false, vec![&aml::Return::new(&sta)]),
            &aml::Method::new("_CRS".into(), 0, false, vec![&aml::Return::new(&crs)]),
        ],
    )
    .to_aml_bytes(sink);
}

/// `MTFY(slot, event)`, `MSCN()`, `MSTA(slot)`, `MCRS(slot)`.
fn methods_aml(sink: &mut Vec<u8>) {
    mtfy(sink);
    mscn(sink);
    msta(sink);
    mcrs(sink);
}

/// `MTFY(slot, event)`: notifies slot `slot`'s device of `event`. Notify
/// needs the device by name, so one If per slot.
fn mtfy(sink: &mut Vec<u8>) {
    let path = aml::Path::new;
    let names: Vec<aml::Path> = (0..MEMORY_SLOTS).map(|i| path(&slot_name(i))).collect();
    let numbers: Vec<usize> = (0..MEMORY_SLOTS).collect();
    let event = aml::Arg(1);
    let notifies: Vec<aml::Notify> = names.iter().map(|n| aml::Notify::new(n, &event)).collect();
    let arg = aml::Arg(0);
    let tests: Vec<aml::Equal> = numbers.iter().map(|i| aml::Equal::new(&arg, i)).collect();
    let ifs: Vec<aml::If> = tests
        .iter()
        .zip(&notifies)
        .map(|(t, n)| aml::If::new(t, vec![n]))
        .collect();
    aml::Method::new(
        "MTFY".into(),
        2,
        true,
        ifs.iter().map(|i| i as &dyn Aml).collect(),
    )
    .to_aml_bytes(sink);
}

/// `MSCN`: notify every inserting slot with "device check" (1), then
/// acknowledge it.
fn mscn(sink: &mut Vec<u8>) {
    let path = aml::Path::new;
    let lock = || path("MLCK");
    let slot = aml::Local(0);
    aml::Method::new(
        "MSCN".into(),
        0,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&slot, &aml::ZERO),
            &aml::While::new(
                &aml::LessThan::new(&slot, &MEMORY_SLOTS),
                vec![
                    &aml::Store::new(&path("MSEL"), &slot),
                    &aml::If::new(
                        &aml::Equal::new(&path("MINS"), &aml::ONE),
                        vec![
                            &aml::MethodCall::new("MTFY".into(), vec![&slot, &aml::ONE]),
                            &aml::Store::new(&path("MINS"), &aml::ONE),
                        ],
                    ),
                    &aml::Add::new(&slot, &slot, &aml::ONE),
                ],
            ),
            &aml::Release::new(lock()),
        ],
    )
    .to_aml_bytes(sink);
}

/// `MSTA(slot)`: 0xf (present, enabled, shown, working) or 0.
fn msta(sink: &mut Vec<u8>) {
    let path = aml::Path::new;
    let lock = || path("MLCK");
    aml::Method::new(
        "MSTA".into(),
        1,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&path("MSEL"), &aml::Arg(0)),
            &aml::Store::new(&aml::Local(0), &aml::ZERO),
            &aml::If::new(
                &aml::Equal::new(&path("MEN_"), &aml::ONE),
                vec![&aml::Store::new(&aml::Local(0), &0xfu8)],
            ),
            &aml::Release::new(lock()),
            &aml::Return::new(&aml::Local(0)),
        ],
    )
    .to_aml_bytes(sink);
}

/// `MCRS(slot)`: a QWord memory range [base, base + length - 1], from the
/// 32-bit halves (the DSDT's revision makes integers 64-bit).
fn mcrs(sink: &mut Vec<u8>) {
    let path = aml::Path::new;
    let lock = || path("MLCK");
    let (min, max, len) = (path("MINL"), path("MAXL"), path("LENL"));
    let buf = path("MR64");
    let tmp = aml::Local(1);
    aml::Method::new(
        "MCRS".into(),
        1,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&path("MSEL"), &aml::Arg(0)),
            &aml::Name::new(
                "MR64".into(),
                &aml::ResourceTemplate::new(vec![&aml::AddressSpace::new_memory(
                    aml::AddressSpaceCacheable::Cacheable,
                    true,
                    0u64,
                    0xffff_ffff_ffff_fffeu64,
                    None,
                )]),
            ),
            // Offsets in the QWord address space descriptor.
            &aml::CreateQWordField::new(&min, &buf, &14usize),
            &aml::CreateQWordField::new(&max, &buf, &22usize),
            &aml::CreateQWordField::new(&len, &buf, &38usize),
            &aml::ShiftLeft::new(&tmp, &path("MHBH"), &32u8),
            &aml::Or::new(&min, &tmp, &path("MHBL")),
            &aml::ShiftLeft::new(&tmp, &path("MHLH"), &32u8),
            &aml::Or::new(&len, &tmp, &path("MHLL")),
            &aml::Add::new(&max, &min, &len),
            &aml::Subtract::new(&max, &max, &aml::ONE),
            &aml::Release::new(lock()),
            &aml::Return::new(&buf),
        ],
    )
    .to_aml_bytes(sink);
}

impl BusDevice for MemoryHotplugController {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let value: u64 = match offset {
            SELECTOR => u64::from(self.selected),
            _ => {
                let Some(s) = self.slot() else {
                    return;
                };
                match offset {
                    BASE_LOW => s.base & 0xffff_ffff,
                    BASE_HIGH => s.base >> 32,
                    LENGTH_LOW => s.length & 0xffff_ffff,
                    LENGTH_HIGH => s.length >> 32,
                    STATUS => {
                        let mut v = 0;
                        if s.enabled {
                            v |= STATUS_ENABLED;
                        }
                        if s.inserting {
                            v |= STATUS_INSERTING;
                        }
                        u64::from(v)
                    }
                    _ => return,
                }
            }
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(bytes.len());
        data[..n].copy_from_slice(&bytes[..n]);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut bytes = [0u8; 4];
        let n = data.len().min(4);
        bytes[..n].copy_from_slice(&data[..n]);
        let value = u32::from_le_bytes(bytes);
        match offset {
            SELECTOR => self.selected = value,
            STATUS => {
                let selected = usize::try_from(self.selected).ok();
                if let Some(s) = selected.and_then(|i| self.slots.get_mut(i)) {
                    if value & u32::from(STATUS_INSERTING) != 0 {
                        s.inserting = false;
                    }
                }
            }
            // The range registers are read-only.
            _ => {}
        }
    }
}

#[cfg(test)]
#[path = "hotplug_controller_tests.rs"]
mod tests;
