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

use crate::arch::x86_64::hotplug_aml::{
    self, PortController, RawAml, RegisterField, ScanFlag, SelectedDevice,
};
use crate::bus::BusDevice;
use serde::{Deserialize, Serialize};

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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
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
        if !enabled {
            let scan = aml::Method::new("MSCN".into(), 0, true, vec![]);
            return CONTROLLER.append_unbacked_aml(&[&scan], sink);
        }
        let names: Vec<String> = (0..MEMORY_SLOTS).map(slot_name).collect();
        let mtfy = hotplug_aml::notify_method("MTFY", &names);
        let mscn = hotplug_aml::scan_method(
            "MSCN",
            &REGISTERS,
            names.len(),
            "MTFY",
            &[ScanFlag {
                flag: "MINS",
                event: DEVICE_CHECK,
            }],
        );
        let msta = hotplug_aml::status_method("MSTA", &REGISTERS);
        let mcrs = mcrs();
        let mut slots = Vec::new();
        for i in 0..MEMORY_SLOTS {
            slot_aml(i, &mut slots);
        }
        let slots = RawAml(slots);
        PortController {
            fields: vec![
                RegisterField {
                    access: aml::FieldAccessType::DWord,
                    update: aml::FieldUpdateRule::Preserve,
                    entries: vec![
                        aml::FieldEntry::Named(*b"MHBL", 32),
                        aml::FieldEntry::Named(*b"MHBH", 32),
                        aml::FieldEntry::Named(*b"MHLL", 32),
                        aml::FieldEntry::Named(*b"MHLH", 32),
                        aml::FieldEntry::Named(*b"MSEL", 32),
                    ],
                },
                RegisterField {
                    access: aml::FieldAccessType::Byte,
                    update: aml::FieldUpdateRule::WriteAsZeroes,
                    entries: vec![
                        aml::FieldEntry::Reserved(160),
                        aml::FieldEntry::Named(*b"MEN_", 1),
                        aml::FieldEntry::Named(*b"MINS", 1),
                    ],
                },
            ],
            ..CONTROLLER
        }
        .append_aml(&[&mtfy, &mscn, &msta, &mcrs, &slots], sink);
    }
}

/// The memory hot-plug registers' part of a snapshot: every slot (the
/// range it announces, enabled, not yet told to the guest) and the selector.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryHotplugRegisters {
    pub slots: Vec<Slot>,
    pub selected: u32,
}

impl MemoryHotplugController {
    pub fn save(&self) -> MemoryHotplugRegisters {
        MemoryHotplugRegisters {
            slots: self.slots.to_vec(),
            selected: self.selected,
        }
    }

    /// A controller with saved registers; refused unless they hold
    /// [`MEMORY_SLOTS`] slots.
    pub fn restore(saved: &MemoryHotplugRegisters) -> Result<Self, String> {
        let slots = <[Slot; MEMORY_SLOTS]>::try_from(saved.slots.as_slice()).map_err(|_| {
            format!(
                "slots: {} saved, this VMM has {MEMORY_SLOTS}",
                saved.slots.len()
            )
        })?;
        Ok(MemoryHotplugController {
            slots,
            selected: saved.selected,
        })
    }

    /// The ranges of the enabled slots, (base, length), in slot order.
    pub fn enabled_ranges(&self) -> Vec<(u64, u64)> {
        self.slots
            .iter()
            .filter(|s| s.enabled)
            .map(|s| (s.base, s.length))
            .collect()
    }
}

/// The controller's device, with the registers `append_aml` gives it.
const CONTROLLER: PortController<'static> = PortController {
    path: "\\_SB_.MHPC",
    uid: "Memory Hotplug Controller",
    port: MEMORY_HOTPLUG_PORT,
    ports: const { narrow::u8_of(MEMORY_HOTPLUG_PORT_COUNT) },
    mutex: "MLCK",
    region: "MHPR",
    fields: Vec::new(),
};

/// The registers the controller's methods select a slot with.
const REGISTERS: SelectedDevice<'static> = SelectedDevice {
    lock: "MLCK",
    select: "MSEL",
    enabled: "MEN_",
};

/// ACPI's "device check" notification: the guest adds the device.
const DEVICE_CHECK: u8 = 1;

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

/// `MCRS(slot)`: a QWord memory range [base, base + length - 1], from the
/// 32-bit halves (the DSDT's revision makes integers 64-bit).
fn mcrs() -> RawAml {
    let path = aml::Path::new;
    let lock = || path("MLCK");
    let (min, max, len) = (path("MINL"), path("MAXL"), path("LENL"));
    let buf = path("MR64");
    let tmp = aml::Local(1);
    RawAml::of(&aml::Method::new(
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
    ))
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
