//! Counters a device's threads keep and `vm.counters` reads, named as
//! Cloud Hypervisor names them (`read_bytes`, `rx_frames`, …) so that
//! `ch-remote counters` and scripts written for it read ours unchanged.
//!
//! The values live in atomics shared by the device, its worker threads
//! and the VMM's control loop; they survive a device reset (a guest's
//! driver reload), as Cloud Hypervisor's do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A fixed set of named counters.
pub struct DeviceCounters {
    names: &'static [&'static str],
    values: Box<[AtomicU64]>,
}

impl DeviceCounters {
    pub fn new(names: &'static [&'static str]) -> Arc<Self> {
        Arc::new(DeviceCounters {
            names,
            values: names.iter().map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Adds `n` to counter `index` (wrapping, as a u64 counter does). An
    /// index past the set is a programming error caught in debug builds
    /// and ignored in release ones: a counter must never stop a device.
    pub fn add(&self, index: usize, n: u64) {
        debug_assert!(index < self.values.len(), "counter {index}");
        if let Some(v) = self.values.get(index) {
            v.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Sets counter `index`, for a worker that keeps its own tallies and
    /// publishes them.
    pub fn set(&self, index: usize, value: u64) {
        debug_assert!(index < self.values.len(), "counter {index}");
        if let Some(v) = self.values.get(index) {
            v.store(value, Ordering::Relaxed);
        }
    }

    /// Every counter with its name, in the order given to [`Self::new`].
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        self.names
            .iter()
            .zip(self.values.iter())
            .map(|(n, v)| (*n, v.load(Ordering::Relaxed)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_set_and_read_back_by_name() {
        let c = DeviceCounters::new(&["a_bytes", "a_ops"]);
        c.add(0, 4096);
        c.add(0, 512);
        c.add(1, 1);
        assert_eq!(c.snapshot(), vec![("a_bytes", 4608), ("a_ops", 1)]);
        c.set(1, 7);
        assert_eq!(c.snapshot()[1], ("a_ops", 7));
        c.add(0, u64::MAX);
        assert_eq!(c.snapshot()[0], ("a_bytes", 4607), "wraps");
    }
}
