//! How a DAX window learns that a file it maps shrank on the host, without
//! making the lock its map path and the vCPU repair take part of the work.
//!
//! Every mapped file is followed here, in a table of its own: a descriptor
//! and the size it had when last seen. Files within the VMM's watch budget
//! ([`super::watch_budget`]) have an inotify watch (`IN_MODIFY`, which
//! every `write` and every truncate raises); the others are read once a
//! second ([`FileWatch::shrunk_unwatched`]). Either way the sizes are read
//! outside the window's lock, only for the files an event names (each once
//! however many events named it), and only a file whose size went down is
//! handed back: the window then takes its lock and shows the scratch past
//! the new end ([`super::window::DaxWindow::repair_truncated`]). A guest
//! writing a mapped file a byte at a time costs the device worker one
//! `fstat` per wake-up, never the lock or a walk of the window's mappings.
//!
//! A file's size when last seen only goes down here, when read: the map
//! path raises it to what each new mapping saw ([`FileWatch::saw_size`]), so
//! a file that grows, gets mapped further and shrinks back before its
//! events are read still counts as shrunk.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use super::watch_budget::WatchBudget;

/// A file's identity: (st_dev, st_ino).
pub type FileKey = (u64, u64);

/// Reads of the inotify queue per wake-up, 4 KiB each (at least 16 bytes
/// an event): what is still queued after them waits for the next wake-up
/// (the descriptor stays readable), so one wake-up is bounded.
const MAX_READS_PER_DRAIN: usize = 64;

/// A mapped file as followed here.
struct Followed {
    file: Arc<File>,
    /// Its size when last seen.
    size: u64,
    /// Bumped when the map path raises `size`: a read of the size started
    /// before then must not lower it.
    raised: u64,
    wd: Option<i32>,
}

#[derive(Default)]
struct Table {
    files: HashMap<FileKey, Followed>,
    by_wd: HashMap<i32, FileKey>,
}

/// A file whose size is to be read: (key, descriptor, `raised` then).
type ToCheck = Vec<(FileKey, Arc<File>, u64)>;

/// The window's watch of its mapped files.
pub struct FileWatch {
    /// None where inotify is unavailable: every file is then read on each
    /// tick.
    inotify: Option<File>,
    budget: Arc<WatchBudget>,
    table: Mutex<Table>,
    /// Sizes read to look for a shrink (each an `fstat`, outside the
    /// window's lock).
    size_checks: AtomicU64,
    /// Files left without a watch because the budget was spent.
    refused: AtomicU64,
}

impl FileWatch {
    /// A watch drawing on `budget`; without inotify, one that reads every
    /// file on each tick (logged).
    pub fn new(budget: Arc<WatchBudget>) -> Self {
        // SAFETY: no pointers; the returned fd is checked and then owned.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        let inotify = if fd < 0 {
            let e = std::io::Error::last_os_error();
            tracing::warn!("DAX window: no inotify ({e}); mapped files are checked for truncation once a second");
            None
        } else {
            // SAFETY: `fd` is a fresh descriptor no one else owns.
            Some(unsafe { File::from_raw_fd(fd) })
        };
        FileWatch {
            inotify,
            budget,
            table: Mutex::default(),
            size_checks: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The inotify descriptor, readable when a watched file was modified.
    pub fn as_raw_fd(&self) -> Option<RawFd> {
        self.inotify.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Starts following file `key`, open at `file`, of `size` bytes when
    /// mapped: with a watch when the budget and the host allow one, else
    /// by the once-a-second read.
    pub fn follow(&self, key: FileKey, file: Arc<File>, size: u64) {
        let wd = self.add_watch(&file);
        let mut t = self.table();
        if let Some(wd) = wd {
            t.by_wd.insert(wd, key);
        }
        let followed = Followed {
            file,
            size,
            raised: 0,
            wd,
        };
        if let Some(old) = t.files.insert(key, followed) {
            // (The window follows a file once; a second call replaces it.)
            if let Some(wd) = old.wd.filter(|&w| Some(w) != wd) {
                t.by_wd.remove(&wd);
                drop(t);
                self.remove_watch(wd);
            }
        }
    }

    /// A new mapping of a followed file saw it `size` bytes long.
    pub fn saw_size(&self, key: FileKey, size: u64) {
        if let Some(f) = self.table().files.get_mut(&key) {
            if size > f.size {
                f.size = size;
                f.raised += 1;
            }
        }
    }

    /// Stops following file `key` (its last mapping went).
    pub fn unfollow(&self, key: FileKey) {
        let mut t = self.table();
        let Some(f) = t.files.remove(&key) else {
            return;
        };
        if let Some(wd) = f.wd {
            t.by_wd.remove(&wd);
            drop(t);
            self.remove_watch(wd);
        }
    }

    /// A watch on `file` from the budget; None when the budget is spent,
    /// the host refuses (`fs.inotify.max_user_watches`) or there is no
    /// inotify.
    fn add_watch(&self, file: &File) -> Option<i32> {
        let inotify = self.inotify.as_ref()?;
        if !self.budget.take() {
            self.refused.fetch_add(1, Relaxed);
            crate::warn_limited!(
                "DAX window: the VMM's {} inotify watches for mapped files are in use; further files are checked for truncation once a second",
                self.budget.limit()
            );
            return None;
        }
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).ok();
        let wd = path.map_or(-1, |path| {
            // SAFETY: `path` is NUL-terminated and outlives the call.
            unsafe { libc::inotify_add_watch(inotify.as_raw_fd(), path.as_ptr(), libc::IN_MODIFY) }
        });
        if wd < 0 {
            self.budget.give_back();
            let e = std::io::Error::last_os_error();
            crate::warn_limited!(
                "DAX window: no inotify watch for a mapped file ({e}; see fs.inotify.max_user_watches); it is checked for truncation once a second"
            );
            return None;
        }
        Some(wd)
    }

    fn remove_watch(&self, wd: i32) {
        if let Some(inotify) = &self.inotify {
            // SAFETY: no pointers; a stale wd just fails.
            unsafe { libc::inotify_rm_watch(inotify.as_raw_fd(), wd) };
        }
        self.budget.give_back();
    }

    /// Reads what is queued (at most [`MAX_READS_PER_DRAIN`] reads) and
    /// returns the files whose size went down since last seen: those the
    /// events named, each read once, or every file when the queue
    /// overflowed. No window lock is held or taken here.
    pub fn shrunk_after_events(&self) -> Vec<FileKey> {
        let Some(inotify) = &self.inotify else {
            return Vec::new();
        };
        let (named, gone, overflow) = drain(inotify);
        let to_check: ToCheck = {
            let mut t = self.table();
            // Watches the kernel dropped (the file system went away):
            // those files fall to the once-a-second read.
            for wd in gone {
                if let Some(key) = t.by_wd.remove(&wd) {
                    if let Some(f) = t.files.get_mut(&key) {
                        f.wd = None;
                    }
                    self.budget.give_back();
                }
            }
            let keys: Vec<FileKey> = if overflow {
                t.files.keys().copied().collect()
            } else {
                named
                    .iter()
                    .filter_map(|wd| t.by_wd.get(wd))
                    .copied()
                    .collect()
            };
            pick(&t, keys)
        };
        self.shrunk(to_check)
    }

    /// The files without a watch whose size went down since last seen
    /// (read on each tick).
    pub fn shrunk_unwatched(&self) -> Vec<FileKey> {
        let to_check = {
            let t = self.table();
            let keys = t
                .files
                .iter()
                .filter(|(_, f)| f.wd.is_none())
                .map(|(k, _)| *k)
                .collect();
            pick(&t, keys)
        };
        self.shrunk(to_check)
    }

    /// Reads each file's size (outside every lock) and keeps it as last
    /// seen; returns those that went down.
    fn shrunk(&self, to_check: ToCheck) -> Vec<FileKey> {
        if to_check.is_empty() {
            return Vec::new();
        }
        let sizes: Vec<(FileKey, u64, u64)> = to_check
            .into_iter()
            .filter_map(|(key, file, raised)| {
                self.size_checks.fetch_add(1, Relaxed);
                // A file that cannot be inspected is left as it is.
                let size = file.metadata().ok()?.len();
                Some((key, size, raised))
            })
            .collect();
        let mut t = self.table();
        let mut shrunk = Vec::new();
        for (key, size, raised) in sizes {
            let Some(f) = t.files.get_mut(&key) else {
                continue; // unmapped meanwhile
            };
            if size < f.size {
                shrunk.push(key);
            }
            // A mapping made since the read saw a size of its own: keep
            // the larger.
            if f.raised == raised || size > f.size {
                f.size = size;
            }
        }
        shrunk
    }

    /// Files followed now, and how many of them have a watch.
    pub fn followed(&self) -> (usize, usize) {
        let t = self.table();
        (t.files.len(), t.by_wd.len())
    }

    /// Sizes read so far to look for a shrink.
    pub fn size_checks(&self) -> u64 {
        self.size_checks.load(Relaxed)
    }

    /// Files left without a watch because the budget was spent.
    pub fn refused(&self) -> u64 {
        self.refused.load(Relaxed)
    }
}

impl Drop for FileWatch {
    fn drop(&mut self) {
        // Closing the inotify descriptor drops the watches: give them back.
        let t = self.table.get_mut().unwrap_or_else(|p| p.into_inner());
        for _ in t.by_wd.drain() {
            self.budget.give_back();
        }
    }
}

/// `keys` with their descriptors and `raised` stamps.
fn pick(t: &Table, keys: Vec<FileKey>) -> ToCheck {
    keys.into_iter()
        .filter_map(|k| t.files.get(&k).map(|f| (k, f.file.clone(), f.raised)))
        .collect()
}

/// Reads queued events: the watch descriptors named (each once), those
/// the kernel dropped (`IN_IGNORED`), and whether the queue overflowed.
fn drain(inotify: &File) -> (HashSet<i32>, Vec<i32>, bool) {
    const EVENT_HEADER: usize = 16; // wd, mask, cookie, len
    let mut named = HashSet::new();
    let mut gone = Vec::new();
    let mut overflow = false;
    let mut buf = [0u8; 4096];
    for _ in 0..MAX_READS_PER_DRAIN {
        let n = match (&*inotify).read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut at = 0;
        while at + EVENT_HEADER <= n {
            let word = |i: usize| {
                u32::from_ne_bytes([
                    buf[at + i],
                    buf[at + i + 1],
                    buf[at + i + 2],
                    buf[at + i + 3],
                ])
            };
            let (wd, mask, len) = (
                i32::from_ne_bytes(word(0).to_ne_bytes()),
                word(4),
                narrow::usize_of(u64::from(word(12))),
            );
            if mask & libc::IN_Q_OVERFLOW != 0 {
                overflow = true;
            } else if mask & libc::IN_IGNORED != 0 {
                gone.push(wd);
            } else {
                named.insert(wd);
            }
            at += EVENT_HEADER + len;
        }
    }
    (named, gone, overflow)
}

#[cfg(test)]
#[path = "file_watch_tests.rs"]
mod tests;
