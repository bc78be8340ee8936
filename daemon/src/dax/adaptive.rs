//! The adaptive part of the DAX policy: refines, at run time, the answer
//! for files no rule names (those the policy's `default` gives DAX).
//!
//! It watches the window the way the guest uses it — every range the VMM
//! mapped or unmapped for a SETUPMAPPING or REMOVEMAPPING (the mapper
//! reports them), by 2 MiB range, and which file holds each — and how
//! each file is read through FUSE when it has no DAX:
//!
//! - **larger than the window's share** (`max_file_share`): no DAX from
//!   the start; its working set would evict itself range by range, each
//!   read paying REMOVEMAPPING + SETUPMAPPING.
//! - **thrashing**: a file whose ranges the guest reclaimed
//!   `thrash_reclaims` times, at least half as often as it mapped them,
//!   loses DAX; it may get it back `retry_after` later, once pressure ended.
//! - **small under pressure**: while the window is under pressure (mapped
//!   ranges ≥ `pressure_high` %, or the guest reclaiming; it ends below
//!   `pressure_low` % after `cool_down`), files under `small_file` get no
//!   new DAX: each would hold a whole 2 MiB range for a few KiB and push
//!   out ranges of the files that gain from it.
//! - **re-read, or read at random**: a file without DAX read through FUSE
//!   `reread_factor` times its size, or at `random_reads` places out of
//!   sequence, gains it, even under pressure.
//!
//! An answer reaches the guest at its next LOOKUP or GETATTR of the file;
//! Linux re-instantiates an inode whose `FUSE_ATTR_DAX` flipped once the
//! file is no longer open. Every changed answer is an event (the control
//! socket's `adaptive/events`, relayed by the VMM's `vm.dax-events`).
//!
//! What it keeps is bounded: one entry per window range and one per file
//! the daemon has an inode for (entries go with FORGET), and a ring of
//! [`EVENT_RING`] events.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use control_protocol::{AdaptiveEvent, AdaptiveEvents, AdaptiveStats};
use policies::Adaptive;

/// Linux maps its DAX window in ranges of this size (`FUSE_DAX_SHIFT`).
pub const RANGE_SHIFT: u32 = dax_abi::GUEST_RANGE_SHIFT;
/// Events kept for readers of `adaptive/events`.
pub const EVENT_RING: usize = 1024;
// Linux starts reclaiming ranges when fewer than 20 % are free: unmaps at
// this occupancy or above are reclaim even when `pressure_high` is higher.
use dax_abi::GUEST_RECLAIM_OCCUPANCY_PCT;

#[derive(Default)]
struct FileUse {
    /// SETUPMAPPINGs of a new range, and how many of its ranges the guest
    /// reclaimed under pressure.
    maps: u64,
    reclaimed: u64,
    /// Ranges it holds now.
    mapped: u64,
    /// Bytes read through FUSE (not DAX).
    fuse_read: u64,
    /// Where the next sequential FUSE read would start, and how many did
    /// not start there.
    next_offset: u64,
    random_reads: u64,
    /// When it was found thrashing.
    thrashing_since: Option<Instant>,
    /// The last answer the guest got.
    answered: Option<bool>,
}

struct State {
    tuning: Adaptive,
    ranges: u64,
    /// Window range index → the node id mapped there (ordered: an unmap
    /// visits only the entries it removes, whatever length the guest gave).
    slots: BTreeMap<u64, u64>,
    files: HashMap<u64, FileUse>,
    pressure: bool,
    /// The last time occupancy was at `pressure_high` or the guest reclaimed.
    last_high: Option<Instant>,
    stats: AdaptiveStats,
    events: VecDeque<AdaptiveEvent>,
    next_seq: u64,
}

pub struct AdaptiveDax {
    state: Mutex<State>,
}

fn percent(n: u64, of: u64) -> u64 {
    n.saturating_mul(100) / of.max(1)
}

impl State {
    fn occupancy(&self) -> u64 {
        percent(self.slots.len() as u64, self.ranges)
    }

    fn event(&mut self, kind: &str, file: Option<(String, u64)>, reason: &str) {
        self.next_seq += 1;
        if self.events.len() == EVENT_RING {
            self.events.pop_front();
        }
        let (path, nodeid) = file.unzip();
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let occupancy_pct = self.occupancy();
        self.events.push_back(AdaptiveEvent {
            seq: self.next_seq,
            at_ms,
            kind: kind.into(),
            path,
            nodeid,
            reason: reason.into(),
            occupancy_pct,
        });
    }

    /// Pressure starts at `pressure_high` and ends below `pressure_low`
    /// once `cool_down` passed since it was last high.
    fn update_pressure(&mut self, now: Instant) {
        let occ = self.occupancy();
        if occ >= u64::from(self.tuning.pressure_high) {
            self.last_high = Some(now);
        }
        let cooled = self.last_high.is_none_or(|t| {
            now.saturating_duration_since(t) >= Duration::from_millis(self.tuning.cool_down_ms)
        });
        let high = self.last_high == Some(now);
        if !self.pressure && high {
            self.pressure = true;
            self.stats.pressure_episodes += 1;
            self.event("pressure_on", None, &format!("{occ}% of the window mapped"));
        } else if self.pressure && occ < u64::from(self.tuning.pressure_low) && cooled {
            self.pressure = false;
            self.event(
                "pressure_off",
                None,
                &format!("{occ}% of the window mapped"),
            );
        }
    }

    fn window_bytes(&self) -> u64 {
        self.ranges << RANGE_SHIFT
    }

    /// The answer for a file the policy's default gives DAX, and why.
    fn answer(&mut self, nodeid: u64, size: u64, now: Instant) -> (bool, &'static str) {
        let t = self.tuning.clone();
        let pressure = self.pressure;
        let too_large =
            u128::from(size) * 100 > u128::from(self.window_bytes()) * u128::from(t.max_file_share);
        let f = self.files.entry(nodeid).or_default();
        if let Some(since) = f.thrashing_since {
            let waited =
                now.saturating_duration_since(since) >= Duration::from_millis(t.retry_after_ms);
            if pressure || !waited {
                return (false, "thrashing");
            }
            *f = FileUse {
                answered: f.answered,
                ..FileUse::default()
            };
            self.stats.thrashing_files = self.stats.thrashing_files.saturating_sub(1);
            return (true, "retry");
        }
        if too_large {
            return (false, "larger_than_window_share");
        }
        if f.fuse_read >= size.max(1).saturating_mul(u64::from(t.reread_factor)) {
            return (true, "reread");
        }
        if f.random_reads >= u64::from(t.random_reads) {
            return (true, "random_reads");
        }
        if pressure && size < t.small_file && f.mapped == 0 {
            return (false, "small_file_under_pressure");
        }
        (true, "fits")
    }
}

impl AdaptiveDax {
    /// `window_size`: the DAX window's bytes (its 2 MiB ranges are watched).
    pub fn new(tuning: Adaptive, window_size: u64) -> Self {
        AdaptiveDax {
            state: Mutex::new(State {
                tuning,
                ranges: (window_size >> RANGE_SHIFT).max(1),
                slots: BTreeMap::new(),
                files: HashMap::new(),
                pressure: false,
                last_high: None,
                stats: AdaptiveStats::default(),
                events: VecDeque::new(),
                next_seq: 0,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new policy's tuning; what was observed is kept.
    pub fn set_tuning(&self, tuning: Adaptive) {
        self.state().tuning = tuning;
    }

    /// Whether a regular file that the policy's default gives DAX gets it.
    /// `path` is asked for only when the answer changes (for the event).
    pub fn decide(&self, nodeid: u64, size: u64, path: &dyn Fn() -> String) -> bool {
        self.decide_at(nodeid, size, path, Instant::now())
    }

    fn decide_at(&self, nodeid: u64, size: u64, path: &dyn Fn() -> String, now: Instant) -> bool {
        let mut s = self.state();
        if !s.tuning.enabled {
            return true;
        }
        s.update_pressure(now);
        let (dax, reason) = s.answer(nodeid, size, now);
        let before = s.files.get(&nodeid).and_then(|f| f.answered);
        if before != Some(dax) {
            // A first answer of "yes" is what the policy says anyway: only
            // refusals and changes are decisions worth an event.
            if before.is_some() || !dax {
                let (kind, counts) = if dax {
                    ("grant", &mut s.stats.granted)
                } else {
                    ("withdraw", &mut s.stats.withdrawn)
                };
                *counts.entry(reason.to_string()).or_insert(0) += 1;
                s.event(kind, Some((path(), nodeid)), reason);
            }
            if let Some(f) = s.files.get_mut(&nodeid) {
                f.answered = Some(dax);
            }
        }
        dax
    }

    /// The window ranges `[moffset, moffset + len)` now map `nodeid` (a
    /// SETUPMAPPING the VMM performed; the range was checked).
    pub fn mapped(&self, nodeid: u64, moffset: u64, len: u64) {
        self.mapped_at(nodeid, moffset, len, Instant::now())
    }

    fn range_indices(moffset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        let last = moffset.saturating_add(len.max(1) - 1);
        (moffset >> RANGE_SHIFT)..=(last >> RANGE_SHIFT)
    }

    fn mapped_at(&self, nodeid: u64, moffset: u64, len: u64, now: Instant) {
        let mut s = self.state();
        for idx in Self::range_indices(moffset, len) {
            if idx >= s.ranges {
                break;
            }
            match s.slots.insert(idx, nodeid) {
                // The guest upgrading a read mapping to read-write.
                Some(old) if old == nodeid => continue,
                Some(old) => {
                    if let Some(f) = s.files.get_mut(&old) {
                        f.mapped = f.mapped.saturating_sub(1);
                    }
                }
                None => {}
            }
            let f = s.files.entry(nodeid).or_default();
            f.maps += 1;
            f.mapped += 1;
        }
        s.update_pressure(now);
    }

    /// The mappings of `[moffset, moffset + len)` are gone (a REMOVEMAPPING
    /// range the VMM unmapped; the range was checked).
    pub fn unmapped(&self, moffset: u64, len: u64) {
        self.unmapped_at(moffset, len, Instant::now())
    }

    fn unmapped_at(&self, moffset: u64, len: u64, now: Instant) {
        let mut s = self.state();
        let occ = s.occupancy();
        let reclaim = occ >= u64::from(s.tuning.pressure_high).min(GUEST_RECLAIM_OCCUPANCY_PCT);
        let thrash_reclaims = u64::from(s.tuning.thrash_reclaims);
        let mut newly_thrashing = 0;
        let gone: Vec<u64> = s
            .slots
            .range(Self::range_indices(moffset, len))
            .map(|(&idx, _)| idx)
            .collect();
        for idx in gone {
            let Some(owner) = s.slots.remove(&idx) else {
                continue;
            };
            if reclaim {
                s.stats.reclaims += 1;
            }
            let Some(f) = s.files.get_mut(&owner) else {
                continue;
            };
            f.mapped = f.mapped.saturating_sub(1);
            if reclaim {
                f.reclaimed += 1;
                if f.thrashing_since.is_none()
                    && f.reclaimed >= thrash_reclaims
                    && f.reclaimed.saturating_mul(2) >= f.maps
                {
                    f.thrashing_since = Some(now);
                    newly_thrashing += 1;
                }
            }
        }
        s.stats.thrashing_files += newly_thrashing;
        if reclaim {
            s.last_high = Some(now);
        }
        s.update_pressure(now);
    }

    /// `bytes` of the file at `offset` were read through FUSE (it has no DAX).
    pub fn fuse_read(&self, nodeid: u64, offset: u64, bytes: u64) {
        let mut s = self.state();
        if s.tuning.enabled {
            let f = s.files.entry(nodeid).or_default();
            f.fuse_read = f.fuse_read.saturating_add(bytes);
            if offset != f.next_offset {
                f.random_reads += 1;
            }
            f.next_offset = offset.saturating_add(bytes);
        }
    }

    /// The daemon dropped the inode (FORGET).
    pub fn forget(&self, nodeid: u64) {
        let mut s = self.state();
        if let Some(f) = s.files.remove(&nodeid) {
            if f.thrashing_since.is_some() {
                s.stats.thrashing_files = s.stats.thrashing_files.saturating_sub(1);
            }
        }
    }

    /// A new FUSE session (INIT) or VMM: no mapping and no inode survive.
    pub fn reset(&self) {
        let mut s = self.state();
        s.slots.clear();
        s.files.clear();
        s.stats.thrashing_files = 0;
        s.update_pressure(Instant::now());
    }

    pub fn stats(&self) -> AdaptiveStats {
        let mut s = self.state();
        s.update_pressure(Instant::now());
        AdaptiveStats {
            enabled: s.tuning.enabled,
            pressure: s.pressure,
            window_ranges: s.ranges,
            mapped_ranges: s.slots.len() as u64,
            ..s.stats.clone()
        }
    }

    /// The events numbered above `after`. An `after` beyond the newest
    /// event is from before a restart of the daemon: everything is new.
    pub fn events_after(&self, after: u64) -> AdaptiveEvents {
        let s = self.state();
        let after = if after > s.next_seq { 0 } else { after };
        // The ring holds the newest events, numbered up to `next_seq`.
        let first = s.next_seq + 1 - s.events.len() as u64;
        AdaptiveEvents {
            events: s.events.iter().filter(|e| e.seq > after).cloned().collect(),
            next: s.next_seq,
            missed: first.saturating_sub(after + 1),
        }
    }
}

#[cfg(test)]
#[path = "adaptive_tests.rs"]
mod tests;
