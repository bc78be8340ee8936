//! The VMM → daemon notices channel: what the VMM's devices must get to a
//! device's daemon, typed ([`DaemonNotice`]), held until the controller's
//! delivery task ([`super::notices::deliver_truncations`]) hands them over.
//! It is not the event stream ([`crate::events`]): that one reports
//! outward and drops events for a reader that lags; this one never drops.
//!
//! The VMM's window observers push truncations from the thread that found
//! them ([`DaemonNotices::truncated`]; never blocks). A guest can make many
//! (it can shrink files it mapped through the daemon), so the queue is
//! bounded by coalescing, not by dropping: per device, the pending
//! truncated ranges are kept merged (overlapping or touching ranges become
//! one), at most [`MAX_PENDING_RANGES`] of them. A disjoint range past that
//! bound collapses them all into one range that spans every one of them
//! (the overflow is counted: [`DaemonNotices::overflows`]): the daemon is
//! then told a range that covers all it missed, never fewer bytes.
//!
//! Why telling more is safe: the VMM has already shown its scratch over
//! the exact vanished pages, and counts the exact bytes in its own metrics
//! (`daxvmm_dax_truncated_bytes_total`). The daemon only counts what it is
//! told (`window_truncated_bytes`) and logs it; serving requests does not
//! depend on it. So after an overflow its count may include gaps between
//! truncated ranges, but no truncation goes unannounced.
//!
//! The window's location is the other notice; it is state, not a stream:
//! the controller reads the latest one per device from the VMM at every
//! tick and tells the daemon each change until it takes it
//! ([`super::PolicyController::tell_locations`]), so it needs no queue.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use control_protocol::{WindowLocation, WindowTruncated};
use tokio::sync::Notify;

/// Pending truncated ranges kept per device before they collapse into one.
pub const MAX_PENDING_RANGES: usize = 64;

/// One notice for a device's daemon, as the control protocol carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DaemonNotice {
    /// Where the device's window sits in guest-physical memory.
    Location(WindowLocation),
    /// A mapped file shrank on the host under this window range.
    Truncated(WindowTruncated),
}

/// The truncations waiting for one device's daemon.
#[derive(Debug, Default)]
struct Pending {
    /// Disjoint, non-touching ranges: start → end (exclusive).
    ranges: BTreeMap<u64, u64>,
}

impl Pending {
    /// Adds `[start, end)`, merged with every range it overlaps or touches.
    /// False when that left more than [`MAX_PENDING_RANGES`] and they were
    /// collapsed into one.
    fn add(&mut self, mut start: u64, mut end: u64) -> bool {
        // Ranges that start at or before `end` and end at or after `start`.
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touching {
            self.ranges.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.ranges.insert(start, end);
        if self.ranges.len() <= MAX_PENDING_RANGES {
            return true;
        }
        let first = self.ranges.keys().next().copied().unwrap_or(start);
        let last = self.ranges.values().next_back().copied().unwrap_or(end);
        self.ranges.clear();
        self.ranges.insert(first, last);
        false
    }

    fn notices(&self) -> impl Iterator<Item = DaemonNotice> + '_ {
        self.ranges.iter().map(|(&offset, &end)| {
            DaemonNotice::Truncated(WindowTruncated {
                offset,
                len: end - offset,
            })
        })
    }
}

#[derive(Debug, Default)]
struct Queue {
    pending: HashMap<String, Pending>,
    /// Times a device's pending ranges collapsed into one.
    overflows: u64,
}

/// Both ends of the channel; cheap to clone. The VMM's observers push,
/// the controller's delivery task takes.
#[derive(Clone, Debug, Default)]
pub struct DaemonNotices {
    queue: Arc<Mutex<Queue>>,
    ready: Arc<Notify>,
}

impl DaemonNotices {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `device`'s window shows its scratch over `[offset, offset + len)`
    /// since the file mapped there shrank. Never blocks for long (one
    /// short lock) and never drops: see the module's note for the bound.
    pub fn truncated(&self, device: &str, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = offset.saturating_add(len);
        {
            let mut queue = self.queue();
            let fitted = queue
                .pending
                .entry(device.to_string())
                .or_default()
                .add(offset, end);
            if !fitted {
                queue.overflows += 1;
            }
        }
        self.ready.notify_one();
    }

    /// Waits until something was pushed since the last [`Self::take`]
    /// (at once if something was pushed before the call).
    pub(crate) async fn ready(&self) {
        self.ready.notified().await;
    }

    /// Every pending notice, per device, lowest offset first; the queue is
    /// empty after it.
    pub fn take(&self) -> Vec<(String, Vec<DaemonNotice>)> {
        let mut queue = self.queue();
        let mut taken: Vec<(String, Vec<DaemonNotice>)> = queue
            .pending
            .drain()
            .map(|(id, p)| (id, p.notices().collect()))
            .collect();
        taken.sort_by(|a, b| a.0.cmp(&b.0));
        taken
    }

    /// Gives back notices that could not be delivered yet (their daemon
    /// did not answer), merged with what came meanwhile.
    pub(crate) fn put_back(&self, device: &str, notices: &[DaemonNotice]) {
        for n in notices {
            if let DaemonNotice::Truncated(t) = n {
                self.truncated(device, t.offset, t.len);
            }
        }
    }

    /// Times a device's pending truncations collapsed into one range
    /// because more than `MAX_PENDING_RANGES` were waiting.
    pub fn overflows(&self) -> u64 {
        self.queue().overflows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(notices: &DaemonNotices, device: &str) -> Vec<(u64, u64)> {
        notices
            .take()
            .into_iter()
            .filter(|(id, _)| id == device)
            .flat_map(|(_, n)| n)
            .map(|n| match n {
                DaemonNotice::Truncated(t) => (t.offset, t.len),
                other @ DaemonNotice::Location(_) => panic!("not queued: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn overlapping_and_touching_ranges_merge_and_devices_stay_apart() {
        let q = DaemonNotices::default();
        q.truncated("fs0", 0x1000, 0x1000);
        q.truncated("fs0", 0x2000, 0x1000); // touches the first
        q.truncated("fs0", 0x1800, 0x2000); // overlaps both
        q.truncated("fs0", 0x8000, 0x1000);
        q.truncated("fs1", 0x1000, 0x1000);
        q.truncated("fs1", 0x0, 0); // nothing truncated
        let taken = q.take();
        assert_eq!(
            taken,
            vec![
                (
                    "fs0".to_string(),
                    vec![
                        DaemonNotice::Truncated(WindowTruncated {
                            offset: 0x1000,
                            len: 0x2800
                        }),
                        DaemonNotice::Truncated(WindowTruncated {
                            offset: 0x8000,
                            len: 0x1000
                        }),
                    ]
                ),
                (
                    "fs1".to_string(),
                    vec![DaemonNotice::Truncated(WindowTruncated {
                        offset: 0x1000,
                        len: 0x1000
                    })]
                ),
            ]
        );
        assert!(q.take().is_empty(), "taken once");
        assert_eq!(q.overflows(), 0);
    }

    #[test]
    fn a_flood_of_disjoint_ranges_stays_bounded_and_every_range_stays_covered() {
        let q = DaemonNotices::default();
        let page = 0x1000u64;
        let told: Vec<(u64, u64)> = (0..(MAX_PENDING_RANGES as u64) * 3)
            .map(|i| (i * 2 * page, page))
            .collect();
        for &(offset, len) in &told {
            q.truncated("fs0", offset, len);
            let pending = q.queue().pending["fs0"].ranges.len();
            assert!(pending <= MAX_PENDING_RANGES, "{pending} ranges pending");
        }
        assert!(q.overflows() >= 1, "the overflow is counted");
        let pending = ranges(&q, "fs0");
        for (offset, len) in told {
            assert!(
                pending
                    .iter()
                    .any(|&(o, l)| o <= offset && offset + len <= o + l),
                "{offset:#x}+{len:#x} is in no pending range: {pending:x?}"
            );
        }
    }

    #[test]
    fn a_range_reaching_past_the_address_space_is_kept_to_its_end() {
        let q = DaemonNotices::default();
        q.truncated("fs0", u64::MAX - 10, 100);
        assert_eq!(ranges(&q, "fs0"), vec![(u64::MAX - 10, 10)]);
    }

    #[test]
    fn notices_given_back_merge_with_the_new_ones() {
        let q = DaemonNotices::default();
        q.truncated("fs0", 0, 0x1000);
        let taken = q.take();
        q.truncated("fs0", 0x1000, 0x1000);
        q.put_back("fs0", &taken[0].1);
        assert_eq!(ranges(&q, "fs0"), vec![(0, 0x2000)]);
    }
}
