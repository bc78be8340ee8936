//! Growing guest RAM while the guest runs (`vm.resize` with `desired_ram`),
//! by ACPI memory hot-plug as Cloud Hypervisor does it:
//!
//! - RAM grows in multiples of 128 MiB, each `vm.resize` adding one region
//!   in the hot-plug area above boot RAM (`layout::hotplug_memory_start`),
//!   right after the previous one, up to `size + hotplug_size`;
//! - a smaller `desired_ram` changes nothing and is no error: ACPI memory is
//!   not unplugged (Cloud Hypervisor answers it the same way);
//! - the new region is mapped, given to KVM and to every device (the
//!   `GuestMemoryAtomic` they share, and each vhost-user daemon's memory
//!   table), and only then announced to the guest.
//!
//! This runs on the VMM's control thread; the guest's side is
//! [`super::hotplug_controller`].

use std::sync::{Arc, Mutex};

use crate::arch::x86_64::layout::{hotplug_memory_start, HOTPLUG_MEMORY_ALIGN};
use crate::config::MemoryConfig;
use crate::memory::hotplug_controller::{
    MemoryHotplugController, MemoryHotplugRegisters, NoFreeSlot,
};
use serde::{Deserialize, Serialize};
use vm_state::SectionState;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RamHotplugError {
    #[error(
        "desired_ram={desired} is above the limit of {limit} bytes \
         (memory.size {size} + memory.hotplug_size {hotplug})"
    )]
    AboveLimit {
        desired: u64,
        limit: u64,
        size: u64,
        hotplug: u64,
    },
    #[error(
        "desired_ram={desired} would add {added} bytes to the current {current}: \
         RAM grows in multiples of 128 MiB ({HOTPLUG_MEMORY_ALIGN} bytes)"
    )]
    NotBlockMultiple {
        desired: u64,
        current: u64,
        added: u64,
    },
    #[error("desired_ram: {0}")]
    NoSlot(#[from] NoFreeSlot),
    #[error("desired_ram: adding RAM failed: {0}")]
    Failed(String),
}

impl RamHotplugError {
    /// The request was wrong (400), rather than the VMM failing (500).
    pub fn is_refusal(&self) -> bool {
        !matches!(self, RamHotplugError::Failed(_))
    }
}

/// RAM added to the guest so far, and the slots that announce it.
pub struct RamHotplug {
    /// The configuration at boot: `size` is boot RAM.
    boot: MemoryConfig,
    /// Where the hot-plug area starts.
    start: u64,
    /// Bytes added so far (regions are contiguous from `start`).
    added: u64,
    /// The register device, when the configuration has `hotplug_size`.
    controller: Option<Arc<Mutex<MemoryHotplugController>>>,
}

impl RamHotplug {
    pub fn new(boot: &MemoryConfig) -> Self {
        RamHotplug {
            boot: boot.clone(),
            start: hotplug_memory_start(boot.size),
            added: 0,
            controller: boot
                .hotplug_size
                .map(|_| Arc::new(Mutex::new(MemoryHotplugController::new()))),
        }
    }

    /// The register device to put on the I/O bus (None without hot-plug).
    pub fn controller(&self) -> Option<Arc<Mutex<MemoryHotplugController>>> {
        self.controller.clone()
    }

    pub fn boot_config(&self) -> &MemoryConfig {
        &self.boot
    }

    /// Guest RAM now: boot RAM plus what was added.
    pub fn current(&self) -> u64 {
        self.boot.size + self.added
    }

    fn lock(&self) -> Option<std::sync::MutexGuard<'_, MemoryHotplugController>> {
        self.controller
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The region (guest address, size) that takes RAM to `desired` bytes,
    /// or None when RAM already has that much.
    pub fn plan(&self, desired: u64) -> Result<Option<(u64, u64)>, RamHotplugError> {
        let current = self.current();
        if desired <= current {
            return Ok(None);
        }
        let hotplug = self.boot.hotplug_size.unwrap_or(0);
        let limit = self.boot.max_size();
        if desired > limit {
            return Err(RamHotplugError::AboveLimit {
                desired,
                limit,
                size: self.boot.size,
                hotplug,
            });
        }
        let added = desired - current;
        if !added.is_multiple_of(HOTPLUG_MEMORY_ALIGN) {
            return Err(RamHotplugError::NotBlockMultiple {
                desired,
                current,
                added,
            });
        }
        if !self.lock().is_some_and(|c| c.has_free_slot()) {
            return Err(NoFreeSlot.into());
        }
        Ok(Some((self.start + self.added, added)))
    }

    /// The region from [`Self::plan`] is in place: a slot announces it at
    /// the guest's next scan.
    pub fn commit(&mut self, base: u64, size: u64) -> Result<(), RamHotplugError> {
        let mut controller = self.lock().ok_or(NoFreeSlot)?;
        controller.insert(base, size)?;
        drop(controller);
        self.added += size;
        Ok(())
    }
}

/// RAM hot-plug's section of a snapshot: how much was added, and the
/// controller's registers (None without `hotplug_size`). The regions
/// themselves are in the memory layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamHotplugState {
    pub added: u64,
    pub registers: Option<MemoryHotplugRegisters>,
}

impl SectionState for RamHotplugState {
    const KIND: &'static str = "memory-hotplug";
    const VERSION: u32 = 1;
}

impl RamHotplug {
    pub fn save(&self) -> RamHotplugState {
        RamHotplugState {
            added: self.added,
            registers: self.lock().map(|c| c.save()),
        }
    }

    /// Puts a saved state back into this (freshly built) hot-plug: refused,
    /// nothing changed, unless it fits this VM's configuration and the RAM
    /// regions `added_regions` (gpa, length) restored from the layout are
    /// what it announces, back to back from the hot-plug area's start.
    /// Err names the field.
    pub fn restore(
        &mut self,
        saved: &RamHotplugState,
        added_regions: &[(u64, u64)],
    ) -> Result<(), String> {
        let hotplug = self.boot.hotplug_size.unwrap_or(0);
        if saved.added > hotplug {
            return Err(format!(
                "added: {} bytes, above memory.hotplug_size {hotplug}",
                saved.added
            ));
        }
        let restored = match (&saved.registers, &self.controller) {
            (Some(r), Some(_)) => MemoryHotplugController::restore(r)?,
            (None, None) if saved.added == 0 => MemoryHotplugController::new(),
            _ => {
                return Err(
                    "registers: saved with memory hot-plug on, restored with it off (or the other way round)"
                        .to_string(),
                )
            }
        };
        let mut next = self.start;
        for &(gpa, length) in added_regions {
            if gpa != next {
                return Err(format!(
                    "added: a hot-plugged region at {gpa:#x}, expected at {next:#x}"
                ));
            }
            next = gpa.checked_add(length).ok_or("added: a region wraps")?;
        }
        if next - self.start != saved.added {
            return Err(format!(
                "added: {} bytes, but the layout's hot-plugged regions hold {}",
                saved.added,
                next - self.start
            ));
        }
        if restored.enabled_ranges() != added_regions {
            return Err(
                "registers: the slots do not announce the layout's hot-plugged regions".to_string(),
            );
        }
        if let Some(mut c) = self.lock() {
            *c = restored;
        }
        self.added = saved.added;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ram(size: u64, hotplug: Option<u64>) -> RamHotplug {
        RamHotplug::new(&MemoryConfig {
            size,
            hotplug_size: hotplug,
            ..Default::default()
        })
    }

    #[test]
    fn growth_is_placed_after_the_previous_region_up_to_the_limit() {
        let mut r = ram(512 * MIB, Some(1024 * MIB));
        assert_eq!(r.plan(512 * MIB), Ok(None), "no change");
        assert_eq!(r.plan(256 * MIB), Ok(None), "shrinking: nothing to do");
        assert_eq!(r.plan(1024 * MIB), Ok(Some((1 << 32, 512 * MIB))));
        r.commit(1 << 32, 512 * MIB).unwrap();
        assert_eq!(r.current(), 1024 * MIB);
        assert_eq!(r.plan(1024 * MIB), Ok(None));
        assert_eq!(
            r.plan(1536 * MIB),
            Ok(Some(((1 << 32) + 512 * MIB, 512 * MIB)))
        );
        assert_eq!(
            r.plan(1536 * MIB + 128 * MIB),
            Err(RamHotplugError::AboveLimit {
                desired: 1664 * MIB,
                limit: 1536 * MIB,
                size: 512 * MIB,
                hotplug: 1024 * MIB,
            })
        );
        let e = r.plan(2048 * MIB).unwrap_err();
        assert!(e.is_refusal());
        let msg = e.to_string();
        assert!(
            msg.contains("desired_ram=2147483648") && msg.contains("1610612736"),
            "{msg}"
        );
    }

    #[test]
    fn growth_is_in_whole_blocks() {
        let r = ram(512 * MIB, Some(1024 * MIB));
        let e = r.plan(600 * MIB).unwrap_err();
        assert_eq!(
            e,
            RamHotplugError::NotBlockMultiple {
                desired: 600 * MIB,
                current: 512 * MIB,
                added: 88 * MIB,
            }
        );
        assert!(e.to_string().contains("128 MiB"));
        // The block is counted from the current size, not from zero.
        let r = ram(500 * MIB, Some(1024 * MIB));
        assert_eq!(r.plan(628 * MIB), Ok(Some((1 << 32, 128 * MIB))));
    }

    #[test]
    fn without_hotplug_size_ram_cannot_grow() {
        let r = ram(512 * MIB, None);
        assert!(r.controller().is_none());
        assert_eq!(r.plan(512 * MIB), Ok(None));
        let e = r.plan(640 * MIB).unwrap_err();
        assert!(e.to_string().contains("memory.hotplug_size 0"), "{e}");
    }

    #[test]
    fn slots_run_out() {
        let mut r = ram(512 * MIB, Some(64 << 30));
        let slots = crate::memory::hotplug_controller::MEMORY_SLOTS;
        for _ in 0..slots {
            let (base, size) = r.plan(r.current() + 128 * MIB).unwrap().unwrap();
            r.commit(base, size).unwrap();
        }
        assert_eq!(
            r.plan(r.current() + 128 * MIB),
            Err(RamHotplugError::NoSlot(NoFreeSlot))
        );
        assert_eq!(r.current(), 512 * MIB + slots as u64 * 128 * MIB);
    }

    /// A saved hot-plug state is put back only onto a configuration and
    /// regions it fits; each refusal names the field, and changes nothing.
    #[test]
    fn a_saved_state_that_does_not_fit_is_refused_by_field() {
        let mut r = ram(512 * MIB, Some(1024 * MIB));
        let (base, size) = r.plan(640 * MIB).unwrap().unwrap();
        r.commit(base, size).unwrap();
        let saved = r.save();
        let json = serde_json::to_value(&saved).unwrap();
        let saved: RamHotplugState = serde_json::from_value(json).unwrap();

        let mut fresh = ram(512 * MIB, Some(1024 * MIB));
        let refused = |fresh: &mut RamHotplug, s: &RamHotplugState, regions: &[(u64, u64)]| {
            let e = fresh.restore(s, regions).unwrap_err();
            assert_eq!(fresh.save(), ram(512 * MIB, Some(1024 * MIB)).save(), "{e}");
            e
        };
        let e = refused(&mut fresh, &saved, &[]);
        assert!(e.starts_with("added: 134217728 bytes, but"), "{e}");
        let e = refused(&mut fresh, &saved, &[(base + 4096, size)]);
        assert!(e.starts_with("added: a hot-plugged region at"), "{e}");
        let mut too_much = saved.clone();
        too_much.added = 2048 * MIB;
        let e = refused(&mut fresh, &too_much, &[(base, size)]);
        assert!(e.contains("above memory.hotplug_size"), "{e}");
        let mut other_slots = saved.clone();
        other_slots.registers = Some(MemoryHotplugController::new().save());
        let e = refused(&mut fresh, &other_slots, &[(base, size)]);
        assert!(e.starts_with("registers:"), "{e}");
        let mut without = ram(512 * MIB, None);
        let e = without.restore(&saved, &[(base, size)]).unwrap_err();
        assert!(e.contains("memory.hotplug_size 0"), "{e}");
        assert_eq!(without.current(), 512 * MIB);

        fresh.restore(&saved, &[(base, size)]).unwrap();
        assert_eq!(fresh.save(), saved);
        assert_eq!(fresh.current(), 640 * MIB);
        assert_eq!(fresh.plan(768 * MIB), Ok(Some((base + size, 128 * MIB))));
    }
}
