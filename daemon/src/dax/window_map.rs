//! The daemon's record of what it mapped where in the DAX window: for each
//! window range a SETUPMAPPING put there and the VMM acknowledged, the file
//! (node id and host identity) and its offset, and whether the range is
//! writable. A READ or WRITE whose buffer lies in the window is served from
//! this record ([`super::mapper::DaxMapper::resolve`]): the daemon cannot see
//! the window's pages, but it can reach the files behind them.
//!
//! The record may know less than the VMM (it forgets everything at a new
//! FUSE session, and a range whose unmap failed), never more: a stretch it
//! does not know fails that request with EFAULT instead of reaching a file
//! the guest did not map there.

use std::collections::{BTreeMap, HashMap};

/// What one window range maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedFile {
    pub nodeid: u64,
    /// (st_dev, st_ino) when mapped: a node id the guest forgot and the
    /// daemon gave to another file does not pass for this one.
    pub key: (u64, u64),
    /// File offset of the range's first byte.
    pub foffset: u64,
    pub writable: bool,
}

/// A stretch of window bytes resolved to the file behind them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilePiece {
    pub nodeid: u64,
    pub key: (u64, u64),
    pub foffset: u64,
    pub len: u64,
}

/// Disjoint window ranges, keyed by start offset: `start → (end, file)`.
#[derive(Debug, Default)]
pub struct WindowMap {
    ranges: BTreeMap<u64, (u64, MappedFile)>,
    /// How many of `ranges` each node id has: whether a file still has a
    /// range mapped is asked at every REMOVEMAPPING ([`Self::maps_node`]).
    per_node: HashMap<u64, usize>,
}

impl WindowMap {
    /// Records `[start, start + len)` as mapping `file`, replacing whatever
    /// was recorded there (as the VMM's MAP_FIXED replaces it).
    pub fn insert(&mut self, start: u64, len: u64, file: MappedFile) {
        let Some(end) = start.checked_add(len).filter(|_| len > 0) else {
            return;
        };
        self.remove(start, len);
        self.ranges.insert(start, (end, file));
        self.count(file.nodeid, 1, 0);
    }

    /// Adds `up` and takes `down` from `nodeid`'s count of ranges.
    fn count(&mut self, nodeid: u64, up: usize, down: usize) {
        let n = self.per_node.entry(nodeid).or_default();
        *n = (*n + up).saturating_sub(down);
        if *n == 0 {
            self.per_node.remove(&nodeid);
        }
    }

    /// Whether some range of node `nodeid` is recorded.
    pub fn maps_node(&self, nodeid: u64) -> bool {
        self.per_node.contains_key(&nodeid)
    }

    /// Forgets `[start, start + len)`; ranges it cuts keep their other parts.
    pub fn remove(&mut self, start: u64, len: u64) {
        let Some(end) = start.checked_add(len).filter(|_| len > 0) else {
            return;
        };
        let cut: Vec<(u64, u64, MappedFile)> = self
            .overlapping(start, end)
            .map(|(s, e, f)| (s, e, *f))
            .collect();
        for (s, e, f) in cut {
            self.ranges.remove(&s);
            if s < start {
                self.ranges.insert(s, (start, f));
            }
            if e > end {
                let shifted = MappedFile {
                    foffset: f.foffset.saturating_add(end - s),
                    ..f
                };
                self.ranges.insert(end, (e, shifted));
            }
            let kept = usize::from(s < start) + usize::from(e > end);
            self.count(f.nodeid, kept, 1);
        }
    }

    pub fn clear(&mut self) {
        self.ranges.clear();
        self.per_node.clear();
    }

    /// Every recorded range in window order: (start, len, file).
    pub fn entries(&self) -> Vec<(u64, u64, MappedFile)> {
        self.ranges
            .iter()
            .map(|(&s, &(e, f))| (s, e - s, f))
            .collect()
    }

    /// How many separate ranges are recorded.
    pub fn ranges(&self) -> usize {
        self.ranges.len()
    }

    /// The files behind `[start, start + len)`, in order; None when any byte
    /// of it is not recorded, or (`write`) lies in a read-only range.
    pub fn resolve(&self, start: u64, len: u64, write: bool) -> Option<Vec<FilePiece>> {
        let end = start.checked_add(len).filter(|_| len > 0)?;
        let mut pieces = Vec::new();
        let mut at = start;
        for (s, e, f) in self.overlapping(start, end) {
            if s > at || (write && !f.writable) {
                return None;
            }
            let stop = e.min(end);
            pieces.push(FilePiece {
                nodeid: f.nodeid,
                key: f.key,
                foffset: f.foffset.checked_add(at - s)?,
                len: stop - at,
            });
            at = stop;
        }
        (at == end).then_some(pieces)
    }

    /// Recorded ranges that overlap `[start, end)`, in order: (start, end, file).
    fn overlapping(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u64, &MappedFile)> + '_ {
        // The one range that starts before `start` may reach into it.
        let before = self
            .ranges
            .range(..start)
            .next_back()
            .filter(|(_, (e, _))| *e > start);
        before
            .into_iter()
            .chain(self.ranges.range(start..end))
            .map(|(&s, (e, f))| (s, *e, f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn file(nodeid: u64, foffset: u64, writable: bool) -> MappedFile {
        MappedFile {
            nodeid,
            key: (1, nodeid),
            foffset,
            writable,
        }
    }

    #[test]
    fn resolves_a_stretch_across_ranges_to_each_files_offsets() {
        let mut m = WindowMap::default();
        m.insert(0, 2 * MIB, file(7, 4 * MIB, true));
        m.insert(2 * MIB, 2 * MIB, file(9, 0, true));
        let p = m.resolve(2 * MIB - 4096, 8192, true).unwrap();
        assert_eq!(
            p,
            vec![
                FilePiece {
                    nodeid: 7,
                    key: (1, 7),
                    foffset: 6 * MIB - 4096,
                    len: 4096
                },
                FilePiece {
                    nodeid: 9,
                    key: (1, 9),
                    foffset: 0,
                    len: 4096
                },
            ]
        );
    }

    #[test]
    fn a_gap_a_read_only_range_or_a_bad_length_resolves_to_nothing() {
        let mut m = WindowMap::default();
        m.insert(0, 2 * MIB, file(7, 0, false));
        m.insert(4 * MIB, 2 * MIB, file(8, 0, true));
        assert!(m.resolve(0, 4096, false).is_some());
        assert_eq!(m.resolve(0, 4096, true), None, "read-only range written");
        assert_eq!(m.resolve(2 * MIB - 4096, 8192, false), None, "gap");
        assert_eq!(m.resolve(3 * MIB, 4096, false), None, "unmapped");
        assert_eq!(m.resolve(4 * MIB, 0, false), None, "empty");
        assert_eq!(m.resolve(u64::MAX - 10, 4096, false), None, "overflow");
        assert_eq!(m.resolve(6 * MIB - 4096, 8192, true), None, "past the end");
    }

    #[test]
    fn removing_or_replacing_the_middle_of_a_range_keeps_both_ends() {
        let mut m = WindowMap::default();
        m.insert(0, 2 * MIB, file(7, 10 * MIB, true));
        m.remove(MIB, 4096);
        assert_eq!(m.ranges(), 2);
        assert_eq!(m.resolve(MIB, 4096, false), None);
        let tail = m.resolve(MIB + 4096, 4096, false).unwrap();
        assert_eq!(tail[0].foffset, 11 * MIB + 4096);
        m.insert(MIB - 4096, 3 * 4096, file(8, 0, false));
        assert_eq!(m.ranges(), 3);
        let p = m.resolve(MIB - 8192, 5 * 4096, false).unwrap();
        let nodes: Vec<(u64, u64)> = p.iter().map(|p| (p.nodeid, p.len)).collect();
        assert_eq!(nodes, vec![(7, 4096), (8, 3 * 4096), (7, 4096)]);
        assert_eq!(p[2].foffset, 11 * MIB + 8192);
        m.remove(0, 2 * MIB);
        assert_eq!(m.ranges(), 0);
    }

    /// Whether a file still has a range is known however its ranges were
    /// cut, replaced or removed.
    #[test]
    fn a_node_maps_while_any_piece_of_its_ranges_is_recorded() {
        let mut m = WindowMap::default();
        m.insert(0, 2 * MIB, file(7, 0, false));
        m.insert(2 * MIB, 2 * MIB, file(7, 2 * MIB, false));
        m.remove(MIB, 2 * MIB);
        assert_eq!(m.ranges(), 2);
        assert!(m.maps_node(7));
        // Replaced by another file's range: one piece of 7 is left.
        m.insert(0, MIB, file(8, 0, false));
        assert!(m.maps_node(7) && m.maps_node(8));
        m.remove(3 * MIB, MIB);
        assert!(!m.maps_node(7), "its last piece went");
        m.clear();
        assert!(!m.maps_node(8));
    }
}
