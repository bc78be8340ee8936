//! The window's record of what is mapped where, complete enough to map it
//! all again after a restore or a local migration: each mapping's window
//! offset, length, file (by `(st_dev, st_ino)`), file offset and access.
//!
//! The window's contents are the host's page cache and are never saved:
//! re-establishing a window maps the same file ranges again at the same
//! offsets. Every such map goes through the window's own SHMEM_MAP path
//! (the same checks as a daemon's request). While a window is being
//! re-established ([`DaxWindow::replay`], or a daemon replaying its own
//! record between [`DaxWindow::set_replaying`] calls) a map identical to
//! the one in place is a no-op, so the VMM can map from passed
//! descriptors first and the daemon's replay then cross-checks it, and a
//! map over a *different* mapping is refused naming the window offset and
//! both files: a replay never silently changes what the guest sees.
//! [`DaxWindow::verify`] compares the window with a saved record and names
//! the first difference.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_state::{Persist, SectionState, StateError};

use super::super::file_watch::FileKey;
use super::super::map_budget::MapBudget;
use super::super::mapped_files::{MappedFiles, MappedPiece};
use super::super::metrics::FailureReason;
use super::super::watch_budget::WatchBudget;
use super::{DaxWindow, RequestError};
use dax_abi::DAX_SHM_REGION_ID;
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};

/// One mapping of the window, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowMapping {
    /// Where it starts in the window.
    pub shm_offset: u64,
    pub len: u64,
    /// Where it starts in the file.
    pub fd_offset: u64,
    /// Mapped read-write, else read-only.
    pub writable: bool,
    /// The file's `st_dev`.
    pub dev: u64,
    /// The file's `st_ino`.
    pub ino: u64,
}

impl WindowMapping {
    fn of(p: &MappedPiece) -> Self {
        WindowMapping {
            shm_offset: p.start,
            len: p.end - p.start,
            fd_offset: p.fd_offset,
            writable: p.writable,
            dev: p.file.0,
            ino: p.file.1,
        }
    }

    pub fn file(&self) -> FileKey {
        (self.dev, self.ino)
    }

    fn describe(&self) -> String {
        format!(
            "{:#x} bytes of file (dev {}, ino {}) from file offset {:#x}, {}",
            self.len,
            self.dev,
            self.ino,
            self.fd_offset,
            if self.writable {
                "writable"
            } else {
                "read-only"
            }
        )
    }
}

/// The window's size and every mapping in place, by window offset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowRecord {
    pub size: u64,
    pub mappings: Vec<WindowMapping>,
}

impl SectionState for WindowRecord {
    const KIND: &'static str = "dax-window";
    const VERSION: u32 = 1;
}

/// Why a saved window could not be re-established, or differs from one.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the window is {found:#x} bytes, the record's {expected:#x}")]
    Size { expected: u64, found: u64 },
    #[error("window offset {shm_offset:#x}: the record maps file (dev {dev}, ino {ino}) there, and no descriptor of that file was passed")]
    NoFile { shm_offset: u64, dev: u64, ino: u64 },
    #[error("window offset {shm_offset:#x}: the descriptor passed for file (dev {dev}, ino {ino}) is of file (dev {}, ino {})", found.0, found.1)]
    WrongFile {
        shm_offset: u64,
        dev: u64,
        ino: u64,
        found: FileKey,
    },
    #[error("window offset {shm_offset:#x}: mapping file (dev {dev}, ino {ino}) again: {source}")]
    Replay {
        shm_offset: u64,
        dev: u64,
        ino: u64,
        source: RequestError,
    },
    #[error("window offset {shm_offset:#x}: the record has {expected}, the window has {found}")]
    Differs {
        shm_offset: u64,
        expected: String,
        found: String,
    },
}

/// During a replay: whether `wanted` is exactly in place already (Ok(true):
/// nothing to map), or nothing is there (Ok(false): map it). Anything else
/// over its range is refused, naming the window offset and both files.
pub(super) fn in_place(files: &MappedFiles, wanted: &MappedPiece) -> Result<bool, RequestError> {
    let there = files.pieces_overlapping(wanted.start, wanted.end);
    match there.as_slice() {
        [] => Ok(false),
        [p] if p == wanted => Ok(true),
        [p, ..] => {
            let (w, p) = (WindowMapping::of(wanted), WindowMapping::of(p));
            Err(RequestError::new(
                FailureReason::ReplayMismatch,
                libc::EEXIST,
                format!(
                    "re-establishing the window: window offset {:#x} holds {}, not {} as asked at {:#x}",
                    p.shm_offset,
                    p.describe(),
                    w.describe(),
                    w.shm_offset
                ),
            ))
        }
    }
}

/// Puts the window's replay flag back as it was when dropped.
struct ReplayingUntilDropped<'a> {
    window: &'a DaxWindow,
    was: bool,
}

impl Drop for ReplayingUntilDropped<'_> {
    fn drop(&mut self) {
        self.window.replaying.store(self.was, Ordering::SeqCst);
    }
}

impl DaxWindow {
    /// What is mapped where now.
    pub fn mappings(&self) -> WindowRecord {
        let mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        WindowRecord {
            size: self.size,
            mappings: mapped
                .files
                .pieces()
                .map(|p| WindowMapping::of(&p))
                .collect(),
        }
    }

    /// Descriptors of every file mapped now, by `(st_dev, st_ino)`: what a
    /// local migration passes so the new VMM can [`Self::replay`] the
    /// window without the daemon.
    pub fn mapped_files_by_key(&self) -> std::io::Result<HashMap<FileKey, File>> {
        let mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let mut files = HashMap::new();
        for p in mapped.files.pieces() {
            if files.contains_key(&p.file) {
                continue;
            }
            if let Some(f) = mapped.files.file(p.file) {
                files.insert(p.file, f.try_clone()?);
            }
        }
        Ok(files)
    }

    /// While on, maps are replays of a saved window: an identical map is a
    /// no-op and one over a different mapping is refused (see the module's
    /// comment). The restore turns it on before the daemon replays its
    /// record and off once the window is verified.
    pub fn set_replaying(&self, on: bool) {
        self.replaying.store(on, Ordering::SeqCst);
    }

    /// Maps every range of `record` again from `files` (a descriptor per
    /// file, as a local migration passes them), each through the window's
    /// SHMEM_MAP path; ranges already in place identically are left as
    /// they are. Every range's request and file are checked before the
    /// first is mapped, so a bad record maps nothing; a map that still
    /// fails (mmap itself, a different mapping in place) stops the replay
    /// naming its range, and [`Persist::restore`] then drops the whole
    /// window. Ends by checking the window equals the record.
    pub fn replay(
        &self,
        record: &WindowRecord,
        files: &HashMap<FileKey, File>,
    ) -> Result<(), RecordError> {
        self.check_record_size(record)?;
        let mut maps = Vec::with_capacity(record.mappings.len().min(self.max_mappings));
        for m in &record.mappings {
            let (shm_offset, dev, ino) = (m.shm_offset, m.dev, m.ino);
            let replay_error = |source| RecordError::Replay {
                shm_offset,
                dev,
                ino,
                source,
            };
            let file = files.get(&m.file()).ok_or(RecordError::NoFile {
                shm_offset,
                dev,
                ino,
            })?;
            let found = Self::check_fd(file.as_raw_fd()).map_err(replay_error)?.file;
            if found != m.file() {
                return Err(RecordError::WrongFile {
                    shm_offset,
                    dev,
                    ino,
                    found,
                });
            }
            let flags = if m.writable {
                VhostUserMMapFlags::WRITABLE.bits()
            } else {
                0
            };
            let req = VhostUserMMap {
                shmid: DAX_SHM_REGION_ID,
                shm_offset,
                fd_offset: m.fd_offset,
                len: m.len,
                flags,
                ..Default::default()
            };
            self.check(&req).map_err(replay_error)?;
            maps.push((req, file, m));
        }
        let _replaying = ReplayingUntilDropped {
            window: self,
            was: self.replaying.swap(true, Ordering::SeqCst),
        };
        for (req, file, m) in maps {
            self.map(&req, file).map_err(|source| RecordError::Replay {
                shm_offset: m.shm_offset,
                dev: m.dev,
                ino: m.ino,
                source,
            })?;
        }
        self.verify(record)
    }

    /// Whether the window holds exactly the mappings of `record`; else
    /// names the first window offset where they differ.
    pub fn verify(&self, record: &WindowRecord) -> Result<(), RecordError> {
        self.check_record_size(record)?;
        let now = self.mappings();
        let nothing = || "nothing mapped".to_string();
        let mut expected = record.mappings.iter();
        let mut found = now.mappings.iter();
        loop {
            let (e, f) = (expected.next(), found.next());
            let (shm_offset, expected, found) = match (e, f) {
                (None, None) => return Ok(()),
                (Some(e), Some(f)) if e == f => continue,
                (Some(e), Some(f)) if e.shm_offset == f.shm_offset => {
                    (e.shm_offset, e.describe(), f.describe())
                }
                (Some(e), Some(f)) if e.shm_offset < f.shm_offset => {
                    (e.shm_offset, e.describe(), nothing())
                }
                (Some(_), Some(f)) | (None, Some(f)) => (f.shm_offset, nothing(), f.describe()),
                (Some(e), None) => (e.shm_offset, e.describe(), nothing()),
            };
            return Err(RecordError::Differs {
                shm_offset,
                expected,
                found,
            });
        }
    }

    fn check_record_size(&self, record: &WindowRecord) -> Result<(), RecordError> {
        if record.size != self.size {
            return Err(RecordError::Size {
                expected: record.size,
                found: self.size,
            });
        }
        Ok(())
    }
}

/// What a window is re-established with besides its record.
pub struct WindowRestoreArgs<'a> {
    /// The VMM's mapping budget ([`MapBudget::process`]).
    pub budget: Arc<MapBudget>,
    /// The VMM's inotify watch budget ([`WatchBudget::process`]).
    pub watches: Arc<WatchBudget>,
    /// A descriptor of every file the record maps, by `(st_dev, st_ino)`.
    pub files: &'a HashMap<FileKey, File>,
}

impl Persist for DaxWindow {
    type State = WindowRecord;
    type RestoreArgs<'a> = WindowRestoreArgs<'a>;

    fn save(&mut self) -> Result<WindowRecord, StateError> {
        Ok(self.mappings())
    }

    /// A new window of the record's size with every range mapped again.
    fn restore(args: WindowRestoreArgs<'_>, state: &WindowRecord) -> Result<Self, StateError> {
        let invalid = |field: &str, reason: String| StateError::Invalid {
            section: WindowRecord::KIND.to_string(),
            field: field.to_string(),
            reason,
        };
        let window = DaxWindow::with_budgets(state.size, args.budget, args.watches)
            .map_err(|e| invalid("size", e.to_string()))?;
        window
            .replay(state, args.files)
            .map_err(|e| invalid("mappings", e.to_string()))?;
        Ok(window)
    }
}
