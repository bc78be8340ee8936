//! The daemon's migratable state: what a new daemon on the same share needs
//! to serve a guest that moved (a restored snapshot, a migrated VM) without
//! a new FUSE session — the inodes and handles the guest holds
//! ([`crate::passthrough::PassthroughState`]), the record of what is
//! mapped where in the DAX window, and the DAX policy in force (the
//! adaptive part is fed the window's ranges again as if newly mapped; its
//! per-file history and event ring are not carried).
//!
//! The blob is JSON (serde_json, already a dependency): self-describing, so
//! a version bump can add fields and an operator can read a saved state;
//! its size is capped ([`MAX_STATE_BYTES`]) before it is parsed and every
//! count after, by the daemon's own caps (`--max-inodes`, `--max-handles`,
//! the window's size over the mapping alignment). Counters (`ServerStats`,
//! `DaxStats`) are not carried: a new daemon starts them at zero.

pub mod transfer;

use serde::{Deserialize, Serialize};

use crate::dax::window_map::MappedFile;
use crate::dax::DaxMapper;
use crate::passthrough::{PassthroughFs, PassthroughState, StateError};
use crate::policy::DaxPolicy;

/// The format this daemon writes and the only one it reads.
pub const STATE_VERSION: u32 = 1;

/// The largest blob saved or loaded. An inode takes about a hundred bytes
/// plus a few per byte of its name (names are byte arrays in JSON), so
/// hundreds of thousands of inodes fit, not always `--max-inodes`' default
/// of a million: a state past the cap is refused at save, naming it.
pub const MAX_STATE_BYTES: usize = 64 << 20;

/// The smallest and largest mapping alignment a session can have (a page,
/// and the largest `--dax-alignment` the policy takes).
const ALIGN_LOG2: std::ops::RangeInclusive<u16> = 12..=30;

/// One window range the guest mapped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowRange {
    /// Window offset and length, bytes.
    pub start: u64,
    pub len: u64,
    pub nodeid: u64,
    /// File offset of the range's first byte.
    pub foffset: u64,
    pub writable: bool,
}

/// The window's part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowState {
    pub map_alignment_log2: u16,
    pub ranges: Vec<WindowRange>,
}

/// Everything one daemon hands to the next.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonState {
    pub version: u32,
    pub share: PassthroughState,
    pub window: WindowState,
    /// The DAX policy document in force (as the control socket shows it).
    pub policy: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("the state is {len} bytes, the limit is {MAX_STATE_BYTES}")]
    TooLarge { len: usize },
    #[error("the state is not valid: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("state version {0}, this daemon reads version {STATE_VERSION}")]
    Version(u32),
    #[error("restore: {0}")]
    Share(#[from] StateError),
    #[error("policy: {0}")]
    Policy(String),
    #[error("window.{field}: {why}")]
    Window { field: &'static str, why: String },
}

fn window_err(field: &'static str, why: impl ToString) -> MigrationError {
    MigrationError::Window {
        field,
        why: why.to_string(),
    }
}

/// Serializes the daemon's state; refused (naming the path) when an inode
/// the guest holds can no longer be found by its path, and when the blob
/// would pass [`MAX_STATE_BYTES`].
pub fn save(
    fs: &PassthroughFs,
    dax: &DaxMapper,
    policy: &DaxPolicy,
) -> Result<Vec<u8>, MigrationError> {
    let share = fs.save_state()?;
    let (map_alignment_log2, ranges) = dax.window_record();
    let ranges = ranges
        .into_iter()
        .map(|(start, len, f)| WindowRange {
            start,
            len,
            nodeid: f.nodeid,
            foffset: f.foffset,
            writable: f.writable,
        })
        .collect();
    let state = DaemonState {
        version: STATE_VERSION,
        share,
        window: WindowState {
            map_alignment_log2,
            ranges,
        },
        policy: policy.current().policy.to_value(),
    };
    let blob = serde_json::to_vec(&state)?;
    if blob.len() > MAX_STATE_BYTES {
        return Err(MigrationError::TooLarge { len: blob.len() });
    }
    Ok(blob)
}

/// Parses a blob: its size, syntax and version (nothing is applied).
pub fn decode(blob: &[u8]) -> Result<DaemonState, MigrationError> {
    if blob.len() > MAX_STATE_BYTES {
        return Err(MigrationError::TooLarge { len: blob.len() });
    }
    let state: DaemonState = serde_json::from_slice(blob)?;
    if state.version != STATE_VERSION {
        return Err(MigrationError::Version(state.version));
    }
    Ok(state)
}

/// Loads a blob into a daemon that serves no session yet: the share's
/// inodes and handles (each verified, see [`PassthroughFs::load_state`]),
/// then the window's record, whose every range must lie in the window,
/// follow the alignment, not overlap the previous one and map a regular
/// file the state holds, and which the VMM maps again (SHMEM_MAP per range,
/// each acknowledged; a refusal names the file's path); then the policy, swapped in as the control socket
/// swaps one when it differs from the one in force. On an error the window's
/// record and the policy are left as they were; the share's part is applied
/// only after it all loaded.
pub fn load(
    blob: &[u8],
    fs: &PassthroughFs,
    dax: &DaxMapper,
    policy: &DaxPolicy,
) -> Result<(), MigrationError> {
    let state = decode(blob)?;
    let window = check_window(&state, dax.window_size())?;
    let carried = policies::Policy::from_value(&state.policy)
        .map_err(|e| MigrationError::Policy(e.to_string()))?;
    fs.load_state(&state.share)?;
    let mut ranges = Vec::with_capacity(window.ranges.len());
    for r in &window.ranges {
        // check_window saw every node id among the state's regular files.
        let Ok(inode) = fs.inode(r.nodeid) else {
            fs.reset();
            return Err(window_err(
                "ranges.nodeid",
                format!("{} vanished", r.nodeid),
            ));
        };
        let file = MappedFile {
            nodeid: r.nodeid,
            key: inode.key(),
            foffset: r.foffset,
            writable: r.writable,
        };
        ranges.push((r.start, r.len, file));
    }
    // The VMM's window is empty in a new process: the guest's ranges are
    // mapped again before the guest runs (the VMM checks each against its
    // own record of the window).
    if let Err(why) = dax.replay_mappings(fs, &ranges, |nodeid| fs.path_of(nodeid)) {
        fs.reset();
        return Err(window_err("ranges", why));
    }
    dax.load_window_record(window.map_alignment_log2, &ranges);
    if policy.current().policy != carried {
        policy.replace(carried);
    }
    Ok(())
}

/// The window's record checked against the window's size: ranges in order,
/// disjoint, aligned, inside; no more of them than the window has
/// alignment units; each maps a regular file the state holds.
fn check_window(state: &DaemonState, window_size: u64) -> Result<&WindowState, MigrationError> {
    let w = &state.window;
    let files: std::collections::HashSet<u64> = state
        .share
        .inodes
        .iter()
        .filter(|i| i.kind == libc::S_IFREG)
        .map(|i| i.nodeid)
        .collect();
    if !ALIGN_LOG2.contains(&w.map_alignment_log2) {
        return Err(window_err(
            "map_alignment_log2",
            format!("{} outside {ALIGN_LOG2:?}", w.map_alignment_log2),
        ));
    }
    let align = 1u64 << w.map_alignment_log2;
    let cap = window_size / align;
    if w.ranges.len() as u64 > cap {
        return Err(window_err(
            "ranges",
            format!("{} entries, the window holds at most {cap}", w.ranges.len()),
        ));
    }
    let mut end_of_last = 0;
    for r in &w.ranges {
        let end = r.start.checked_add(r.len).filter(|&e| e <= window_size);
        let Some(end) = end.filter(|_| r.len > 0) else {
            return Err(window_err(
                "ranges",
                format!(
                    "{:#x}+{:#x} is empty or outside the {window_size:#x}-byte window",
                    r.start, r.len
                ),
            ));
        };
        if r.start < end_of_last {
            return Err(window_err(
                "ranges",
                format!("{:#x} overlaps or is out of order", r.start),
            ));
        }
        if !r.start.is_multiple_of(align) || !r.len.is_multiple_of(align) {
            return Err(window_err(
                "ranges",
                format!("{:#x}+{:#x} not aligned to {align:#x}", r.start, r.len),
            ));
        }
        if r.foffset
            .checked_add(r.len)
            .is_none_or(|e| i64::try_from(e).is_err())
        {
            return Err(window_err(
                "ranges.foffset",
                format!("{:#x} overflows", r.foffset),
            ));
        }
        if !files.contains(&r.nodeid) {
            return Err(window_err(
                "ranges.nodeid",
                format!(
                    "{} at {:#x} is not a regular file of the state",
                    r.nodeid, r.start
                ),
            ));
        }
        end_of_last = end;
    }
    Ok(w)
}

#[cfg(test)]
#[path = "migration_tests.rs"]
mod tests;
