//! One budget of memory mappings (VMAs) for every DAX window of the VMM.
//!
//! Each separate file mapping in a window is a VMA of this process, and the
//! scratch between two of them another. Linux refuses new mappings past
//! `vm.max_map_count`, and the VMM's next `mmap` (a thread stack, an
//! allocation) then fails and aborts it. A per-window cap alone does not
//! hold: two windows at 4 KiB granularity reach the limit together. So the
//! windows draw from one budget, derived from `vm.max_map_count` when the
//! first window is made, and a map past it is refused (`ENOSPC`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// What a window with `mappings` separate file mappings costs in VMAs: one
/// per mapping, one per scratch piece between or around them.
pub fn vmas_for(mappings: usize) -> usize {
    mappings.saturating_mul(2).saturating_add(1)
}

/// VMAs kept for everything else the VMM maps (guest RAM, libraries,
/// thread stacks, heap arenas): an eighth of the limit, at least 8192.
pub fn reserved_vmas(max_map_count: usize) -> usize {
    (max_map_count / 8).max(8192)
}

#[derive(Debug)]
pub struct MapBudget {
    limit: usize,
    used: AtomicUsize,
}

impl MapBudget {
    /// A budget of `limit` VMAs.
    pub fn new(limit: usize) -> Self {
        MapBudget {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// The budget of this process: `vm.max_map_count` less
    /// [`reserved_vmas`], read once.
    pub fn process() -> Arc<MapBudget> {
        static BUDGET: OnceLock<Arc<MapBudget>> = OnceLock::new();
        BUDGET
            .get_or_init(|| {
                let max = read_max_map_count();
                let limit = max.saturating_sub(reserved_vmas(max));
                tracing::debug!("DAX windows may use {limit} of vm.max_map_count={max} mappings");
                Arc::new(MapBudget::new(limit))
            })
            .clone()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Moves a holder's charge from `from` to `to` VMAs; false (and
    /// nothing changed) when growing it would pass the limit.
    pub fn recharge(&self, from: usize, to: usize) -> bool {
        if to <= from {
            self.used.fetch_sub(from - to, Ordering::SeqCst);
            return true;
        }
        let more = to - from;
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(more).filter(|&u| u <= self.limit)
            })
            .is_ok()
    }
}

/// `vm.max_map_count`, or Linux's default where it cannot be read.
fn read_max_map_count() -> usize {
    const LINUX_DEFAULT: usize = 65530;
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(LINUX_DEFAULT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_move_within_the_limit_and_refusals_change_nothing() {
        let b = MapBudget::new(10);
        assert!(b.recharge(0, 7));
        assert!(!b.recharge(0, 4), "7 + 4 > 10");
        assert_eq!(b.used(), 7);
        assert!(b.recharge(7, 10));
        assert!(b.recharge(10, 3));
        assert_eq!(b.used(), 3);
    }

    #[test]
    fn the_process_budget_leaves_room_below_max_map_count() {
        let max = read_max_map_count();
        let b = MapBudget::process();
        assert_eq!(b.limit(), max - reserved_vmas(max));
        assert!(reserved_vmas(65530) >= 8192);
        // Two windows at the per-window cap would pass the default limit.
        assert!(
            2 * vmas_for(super::super::window::DEFAULT_MAX_MAPPINGS) > 65530 - reserved_vmas(65530)
        );
    }
}
