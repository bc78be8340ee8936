//! What the DAX window did, counted where it happens (the backend request
//! handler) and read by whoever publishes it (the API: `vm.dax-metrics`,
//! `vm.counters`).
//! Plain atomics: the request thread writes, readers take a snapshot.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use dax_abi::MAP_LATENCY_BUCKETS_US;

/// What [`DaxMetrics::snapshot`] takes: the type the API renders, so the
/// counters reach it without being copied into another struct.
pub use control_protocol::{StageTotal, WindowCounters};

/// Why a SHMEM_MAP/SHMEM_UNMAP was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureReason {
    /// The shmid names no region of this device.
    UnknownRegion,
    ZeroLength,
    /// offset + length overflows or ends past the window (or past off_t for the file).
    OutOfBounds,
    /// An offset or the length is not a multiple of the host page size.
    Misaligned,
    /// Flag bits other than WRITABLE.
    BadFlags,
    /// The fd is not a regular file, or cannot be inspected or kept.
    BadFd,
    /// mmap itself failed (e.g. a writable mapping of a read-only fd).
    MapFailed,
    /// The request would leave more separate mappings than the cap allows.
    TooManyMappings,
    /// While a saved window is re-established, a map over a different
    /// mapping (another file, offset or access) than the one in place.
    ReplayMismatch,
}

impl FailureReason {
    pub const ALL: [FailureReason; 9] = [
        FailureReason::UnknownRegion,
        FailureReason::ZeroLength,
        FailureReason::OutOfBounds,
        FailureReason::Misaligned,
        FailureReason::BadFlags,
        FailureReason::BadFd,
        FailureReason::MapFailed,
        FailureReason::TooManyMappings,
        FailureReason::ReplayMismatch,
    ];

    /// The label metrics publish it under.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::UnknownRegion => "unknown_region",
            FailureReason::ZeroLength => "zero_length",
            FailureReason::OutOfBounds => "out_of_bounds",
            FailureReason::Misaligned => "misaligned",
            FailureReason::BadFlags => "bad_flags",
            FailureReason::BadFd => "bad_fd",
            FailureReason::MapFailed => "map_failed",
            FailureReason::TooManyMappings => "too_many_mappings",
            FailureReason::ReplayMismatch => "replay_mismatch",
        }
    }

    fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|r| *r == self)
            .expect("listed in ALL")
    }
}

/// Where a SHMEM_MAP's time goes in the VMM, stage by stage; each is
/// summed and counted (two relaxed atomic adds), so the trace costs a
/// clock read per stage and nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapStage {
    /// The whole backend request on the device worker: the message (and
    /// its fd) read, the map served, the ack written (and, on a busy host,
    /// whatever ran before the worker got its CPU back to read the clock).
    Request,
    /// Its first part: from the worker's wake-up to the map's first check
    /// (the message and its fd read).
    Read,
    /// Region, bounds, alignment and flags.
    Check,
    /// `fstat` of the passed fd: its type, identity and size.
    Fstat,
    /// The window's lock taken and, for a file not mapped yet, the fd
    /// duplicated to keep.
    KeepFd,
    /// The mapping cap checked and the `mmap` over the scratch.
    Mmap,
    /// The new mapping kept out of core dumps (and, for a map not served
    /// for the daemon, the scratch it hides emptied: a served map's is
    /// emptied after the ack).
    Scratch,
    /// The bookkeeping: ranges, files (an inotify watch for a new file),
    /// the guard past a file's end, the budget.
    Record,
    /// The pre-fault queued for after the ack (or run, when not deferred).
    QueuePrefault,
    /// Whoever watches the window told (the API's event stream).
    Notify,
    /// After the ack: the device worker's turn at the queued pre-faults.
    PrefaultAfterAck,
}

impl MapStage {
    pub const ALL: [MapStage; 11] = [
        MapStage::Request,
        MapStage::Read,
        MapStage::Check,
        MapStage::Fstat,
        MapStage::KeepFd,
        MapStage::Mmap,
        MapStage::Scratch,
        MapStage::Record,
        MapStage::QueuePrefault,
        MapStage::Notify,
        MapStage::PrefaultAfterAck,
    ];

    /// The label metrics publish it under.
    pub fn as_str(self) -> &'static str {
        match self {
            MapStage::Request => "request",
            MapStage::Read => "read",
            MapStage::Check => "check",
            MapStage::Fstat => "fstat",
            MapStage::KeepFd => "keep_fd",
            MapStage::Mmap => "mmap",
            MapStage::Scratch => "scratch",
            MapStage::Record => "record",
            MapStage::QueuePrefault => "queue_prefault",
            MapStage::Notify => "notify",
            MapStage::PrefaultAfterAck => "prefault_after_ack",
        }
    }
}

/// Times consecutive stages of one map: each [`StageClock::lap`] counts the
/// time since the previous one (or the start) against its stage.
pub struct StageClock<'m> {
    metrics: &'m DaxMetrics,
    last: Instant,
}

impl<'m> StageClock<'m> {
    pub fn start(metrics: &'m DaxMetrics) -> Self {
        StageClock {
            metrics,
            last: Instant::now(),
        }
    }

    pub fn lap(&mut self, stage: MapStage) {
        let now = Instant::now();
        self.metrics.record_stage(stage, now - self.last);
        self.last = now;
    }
}

#[derive(Default)]
pub struct DaxMetrics {
    pub maps: AtomicU64,
    pub unmaps: AtomicU64,
    /// Bytes of the window backed by a file mapping right now.
    pub bytes_mapped: AtomicU64,
    /// Unmaps that dropped every mapping at once (device reset, daemon gone).
    pub resets: AtomicU64,
    /// Bytes of new mappings whose host page tables were filled at map time.
    pub prefaulted_bytes: AtomicU64,
    /// Bytes of new mappings put into KVM's page tables at map time.
    pub guest_prefaulted_bytes: AtomicU64,
    /// Maps whose pre-fault failed (the mapping stayed; pages fault later).
    pub prefault_failures: AtomicU64,
    /// Bytes of mappings whose file shrank on the host, shown as scratch since.
    pub truncated_bytes: AtomicU64,
    /// Ranges mapped again from a saved window record (a restore), counted
    /// apart from the guest's own maps.
    pub restored_ranges: AtomicU64,
    failures: [AtomicU64; FailureReason::ALL.len()],
    latency_buckets: [AtomicU64; MAP_LATENCY_BUCKETS_US.len() + 1],
    latency_sum_us: AtomicU64,
    /// Per [`MapStage`]: how many maps reached it, and their µs.
    stage_counts: [AtomicU64; MapStage::ALL.len()],
    stage_sums_us: [AtomicU64; MapStage::ALL.len()],
    /// When the device worker started on the backend request being served
    /// ([`Self::request_started`]), for the map's [`MapStage::Read`].
    request_start: std::sync::Mutex<Option<Instant>>,
}

impl DaxMetrics {
    pub fn record_failure(&self, reason: FailureReason) {
        self.failures[reason.index()].fetch_add(1, Relaxed);
    }

    pub fn record_map(&self, took: Duration) {
        self.maps.fetch_add(1, Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = MAP_LATENCY_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(MAP_LATENCY_BUCKETS_US.len());
        self.latency_buckets[bucket].fetch_add(1, Relaxed);
        self.latency_sum_us.fetch_add(us, Relaxed);
    }

    /// The device worker starts on a backend request (`at`), or is done
    /// with it (None).
    pub fn request_started(&self, at: Option<Instant>) {
        *self.request_start.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }

    /// A map's handling starts at `now`: the time since the worker started
    /// on its request is its [`MapStage::Read`].
    pub fn map_started(&self, now: Instant) {
        let start = self
            .request_start
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(start) = start {
            self.record_stage(MapStage::Read, now.saturating_duration_since(start));
        }
    }

    pub fn record_stage(&self, stage: MapStage, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.stage_counts[stage as usize].fetch_add(1, Relaxed);
        self.stage_sums_us[stage as usize].fetch_add(us, Relaxed);
    }

    pub fn snapshot(&self) -> WindowCounters {
        let mut cumulative = 0;
        let bounds = MAP_LATENCY_BUCKETS_US
            .iter()
            .map(|&b| Some(b))
            .chain(std::iter::once(None));
        WindowCounters {
            maps: self.maps.load(Relaxed),
            unmaps: self.unmaps.load(Relaxed),
            bytes_mapped: self.bytes_mapped.load(Relaxed),
            resets: self.resets.load(Relaxed),
            prefaulted_bytes: self.prefaulted_bytes.load(Relaxed),
            guest_prefaulted_bytes: self.guest_prefaulted_bytes.load(Relaxed),
            prefault_failures: self.prefault_failures.load(Relaxed),
            truncated_bytes: self.truncated_bytes.load(Relaxed),
            restored_ranges: self.restored_ranges.load(Relaxed),
            failures: FailureReason::ALL
                .iter()
                .map(|r| (r.as_str(), self.failures[r.index()].load(Relaxed)))
                .collect(),
            latency_buckets: bounds
                .zip(self.latency_buckets.iter().map(|b| {
                    cumulative += b.load(Relaxed);
                    cumulative
                }))
                .collect(),
            latency_sum_us: self.latency_sum_us.load(Relaxed),
            map_stages: MapStage::ALL
                .iter()
                .map(|&st| StageTotal {
                    stage: st.as_str().to_string(),
                    count: self.stage_counts[st as usize].load(Relaxed),
                    sum_us: self.stage_sums_us[st as usize].load(Relaxed),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_histogram_is_cumulative_and_failures_are_by_reason() {
        let m = DaxMetrics::default();
        m.record_map(Duration::from_micros(5));
        m.record_map(Duration::from_micros(30));
        m.record_map(Duration::from_secs(1));
        m.record_failure(FailureReason::Misaligned);
        m.record_failure(FailureReason::Misaligned);
        let s = m.snapshot();
        assert_eq!(s.maps, 3);
        assert_eq!(s.latency_buckets[0], (Some(10), 1));
        assert_eq!(s.latency_buckets[2], (Some(50), 2));
        assert_eq!(*s.latency_buckets.last().unwrap(), (None, 3));
        assert_eq!(s.latency_sum_us, 1_000_035);
        assert!(s.failures.contains(&("misaligned", 2)));
        assert!(s.failures.contains(&("bad_fd", 0)));
    }
}
