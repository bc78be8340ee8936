//! Descriptors a SETUPMAPPING opened, kept for the next range of the same
//! file: a guest reading a file through DAX maps it range after range, and
//! opening the file anew for each (a path walk through `/proc/self/fd`)
//! was a measured part of every cold map's wait (docs/benchmarks.md).
//!
//! What keeps this safe:
//!
//! - A descriptor is found only by the node id, the file's host identity
//!   (st_dev, st_ino) and the access it was opened with; the mapper looks
//!   the node up first, so a node id the guest forgot, or that now names
//!   another file, finds nothing. The VMM therefore gets what a fresh open
//!   would give it: the same file, opened read-only or read-write as the
//!   mapping asks, never a writable descriptor for a read-only map.
//! - One is kept only while a range of its file is recorded as mapped
//!   (the VMM keeps a descriptor of that file as long anyway), and is
//!   dropped when the file's last range is unmapped, when the guest forgets
//!   the node, and at a new FUSE session; at most [`MAX_KEPT_FDS`] are
//!   kept, the oldest going first.
//! - All of it under the window's lock, with the record of what is mapped:
//!   a descriptor is never kept for a file without a recorded range.
//!
//! Access is checked when the file is opened: while ranges of it stay
//! mapped, a mode the host changes meanwhile does not stop the next range
//! from being mapped with the descriptor already open (the mappings in
//! place, which the VMM keeps, are not stopped by it either).

use std::collections::VecDeque;
use std::fs::File;
use std::sync::Arc;

use super::window_map::WindowMap;

/// Descriptors kept at most: the files a guest maps range after range at
/// the same time (each is one descriptor of this process, taken from the
/// ones it keeps beyond the guest's caps, [`crate::limits::RESERVED_FDS`]).
pub const MAX_KEPT_FDS: usize = 16;

struct Kept {
    nodeid: u64,
    /// (st_dev, st_ino) of the file when it was opened.
    key: (u64, u64),
    writable: bool,
    file: Arc<File>,
}

/// The kept descriptors, oldest first.
#[derive(Default)]
pub struct KeptFds {
    entries: VecDeque<Kept>,
}

impl KeptFds {
    /// The descriptor of node `nodeid`, host file `key`, opened for
    /// writing or not as `writable` asks.
    pub fn get(&self, nodeid: u64, key: (u64, u64), writable: bool) -> Option<Arc<File>> {
        self.entries
            .iter()
            .find(|k| k.nodeid == nodeid && k.key == key && k.writable == writable)
            .map(|k| k.file.clone())
    }

    /// Keeps `file` (node `nodeid`, host file `key`, opened for writing or
    /// not) while `mapped` records a range of the node; the oldest goes
    /// past [`MAX_KEPT_FDS`].
    pub fn keep(
        &mut self,
        mapped: &WindowMap,
        nodeid: u64,
        key: (u64, u64),
        writable: bool,
        file: Arc<File>,
    ) {
        if !mapped.maps_node(nodeid) {
            return;
        }
        self.entries
            .retain(|k| !(k.nodeid == nodeid && k.writable == writable));
        self.entries.push_back(Kept {
            nodeid,
            key,
            writable,
            file,
        });
        while self.entries.len() > MAX_KEPT_FDS {
            self.entries.pop_front();
        }
    }

    /// Drops the descriptors of files `mapped` no longer records a range of.
    pub fn retain_mapped(&mut self, mapped: &WindowMap) {
        self.entries.retain(|k| mapped.maps_node(k.nodeid));
    }

    /// Drops node `nodeid`'s descriptors: the guest forgot the node.
    pub fn forget_node(&mut self, nodeid: u64) {
        self.entries.retain(|k| k.nodeid != nodeid);
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Descriptors kept now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
