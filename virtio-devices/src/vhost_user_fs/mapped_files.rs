//! Which file each mapping of the DAX window shows, so the window notices
//! when one shrinks on the host.
//!
//! A file mapped into the window can be truncated under the guest (another
//! VM on the same share, an operator, a log rotation). Its pages past the
//! new end are gone: the host's fault on them is SIGBUS, which KVM turns
//! into `-EFAULT` from KVM_RUN, or (Linux before 6.13) into an async page
//! fault it retries for ever, so the vCPU never comes back and the VM
//! hangs without a word. The window therefore keeps a descriptor of every
//! file it maps and follows its size ([`super::file_watch`]): when the file
//! shrinks the window compares each mapping with the file's size and shows
//! the scratch over pages past the end
//! ([`super::window::DaxWindow::repair_truncated`]), after which the
//! guest's access completes (reading zeros).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::Arc;

use super::file_watch::{FileKey, FileWatch};

/// The file ranges currently mapped, as disjoint `[start, end)` offsets.
#[derive(Default, Debug)]
pub struct MappedRanges(pub BTreeMap<u64, u64>);

impl MappedRanges {
    /// Removes `[start, end)`, splitting ranges that straddle its ends;
    /// returns how many bytes were mapped there.
    pub fn remove(&mut self, start: u64, end: u64) -> u64 {
        let mut removed = 0;
        let overlapping: Vec<(u64, u64)> = self.overlapping(start, end).collect();
        for (s, e) in overlapping {
            self.0.remove(&s);
            if s < start {
                self.0.insert(s, start);
            }
            if e > end {
                self.0.insert(end, e);
            }
            removed += e.min(end) - s.max(start);
        }
        removed
    }

    /// How many ranges there would be after `[start, end)` is mapped
    /// (`mapped`) or unmapped: overlapped ranges go, the pieces they leave
    /// outside the request stay, and a mapping adds itself.
    pub fn count_after(&self, start: u64, end: u64, mapped: bool) -> usize {
        let (mut gone, mut pieces) = (0, 0);
        for (s, e) in self.overlapping(start, end) {
            gone += 1;
            pieces += usize::from(s < start) + usize::from(e > end);
        }
        self.0.len() - gone + pieces + usize::from(mapped)
    }

    /// The ranges that share at least one byte with `[start, end)`.
    pub fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0
            .range(..end)
            .rev()
            .take_while(move |(_, &e)| e > start)
            .map(|(&s, &e)| (s, e))
    }

    pub fn insert(&mut self, start: u64, end: u64) -> u64 {
        let replaced = self.remove(start, end);
        self.0.insert(start, end);
        replaced
    }

    /// How many `granularity`-sized, aligned ranges hold at least one mapped byte.
    pub fn ranges_touched(&self, granularity: u64) -> u64 {
        let mut count = 0;
        let mut last = None;
        for (&s, &e) in &self.0 {
            let (first, end) = (s / granularity, (e - 1) / granularity);
            let first = if last == Some(first) {
                first + 1
            } else {
                first
            };
            if end >= first {
                count += end - first + 1;
            }
            last = Some(end);
        }
        count
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    end: u64,
    file: FileKey,
    fd_offset: u64,
    /// Mapped read-write (SHMEM_MAP's WRITABLE), else read-only: a
    /// restored window maps it again with the same access.
    writable: bool,
}

/// One mapping in place, as [`MappedFiles::pieces`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedPiece {
    pub start: u64,
    pub end: u64,
    pub file: FileKey,
    pub fd_offset: u64,
    pub writable: bool,
}

impl MappedPiece {
    fn new(start: u64, p: &Piece) -> Self {
        MappedPiece {
            start,
            end: p.end,
            file: p.file,
            fd_offset: p.fd_offset,
            writable: p.writable,
        }
    }
}

struct TrackedFile {
    file: Arc<File>,
    /// Pieces that show it.
    pieces: usize,
    /// `file` came with a read-write mapping (so it is open for writing):
    /// a local migration passes it on for the receiver to map the same
    /// ranges again, writable ones included.
    writable: bool,
}

/// The window's mappings, one piece per `mmap` still (partly) in place.
#[derive(Default)]
pub struct MappedFiles {
    pieces: BTreeMap<u64, Piece>,
    files: HashMap<FileKey, TrackedFile>,
    /// Walks over every piece looking for pages past a file's end.
    walks: u64,
}

impl MappedFiles {
    /// Separate mappings now.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Distinct files mapped now (each holds one descriptor).
    pub fn files(&self) -> usize {
        self.files.len()
    }

    fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, Piece)> {
        let first = self
            .pieces
            .range(..=start)
            .next_back()
            .filter(|(_, p)| p.end > start)
            .map(|(&s, _)| s)
            .unwrap_or(start);
        self.pieces
            .range(first..end)
            .map(|(&s, &p)| (s, p))
            .collect()
    }

    /// Separate mappings once `[start, end)` is removed (and, with `map`,
    /// a new one put there).
    pub fn count_after(&self, start: u64, end: u64, map: bool) -> usize {
        let mut n = self.pieces.len();
        for (s, p) in self.overlapping(start, end) {
            n -= 1;
            n += usize::from(s < start) + usize::from(p.end > end);
        }
        n + usize::from(map)
    }

    /// Removes `[start, end)`, cutting pieces that straddle its ends.
    pub fn remove(&mut self, start: u64, end: u64, watch: Option<&FileWatch>) {
        for (s, p) in self.overlapping(start, end) {
            self.pieces.remove(&s);
            let mut kept = 0;
            if s < start {
                self.pieces.insert(s, Piece { end: start, ..p });
                kept += 1;
            }
            if p.end > end {
                let fd_offset = p.fd_offset + (end - s);
                self.pieces.insert(end, Piece { fd_offset, ..p });
                kept += 1;
            }
            if kept == 0 {
                self.release(p.file, watch);
            } else if kept == 2 {
                if let Some(f) = self.files.get_mut(&p.file) {
                    f.pieces += 1;
                }
            }
        }
    }

    fn release(&mut self, key: FileKey, watch: Option<&FileWatch>) {
        let Some(f) = self.files.get_mut(&key) else {
            return;
        };
        f.pieces -= 1;
        if f.pieces == 0 {
            self.files.remove(&key);
            if let Some(w) = watch {
                w.unfollow(key);
            }
        }
    }

    /// Every mapping in place, by window offset.
    pub fn pieces(&self) -> impl Iterator<Item = MappedPiece> + '_ {
        self.pieces.iter().map(|(&s, p)| MappedPiece::new(s, p))
    }

    /// The mappings that share at least one byte with `[start, end)`.
    pub fn pieces_overlapping(&self, start: u64, end: u64) -> Vec<MappedPiece> {
        self.overlapping(start, end)
            .iter()
            .map(|(s, p)| MappedPiece::new(*s, p))
            .collect()
    }

    /// The descriptor kept of file `key` while it is mapped.
    pub fn file(&self, key: FileKey) -> Option<Arc<File>> {
        self.files.get(&key).map(|f| f.file.clone())
    }

    /// Whether the file `key` is mapped (its descriptor kept) now.
    pub fn tracks(&self, key: FileKey) -> bool {
        self.files.contains_key(&key)
    }

    /// Whether the descriptor kept of `key` serves a new mapping of it:
    /// it is kept, and it came with a writable mapping if this one is
    /// (the guest maps a range read-only first and upgrades it on its first
    /// write; the daemon's descriptor for the upgrade is the one open for
    /// writing).
    pub fn keeps_for(&self, key: FileKey, writable: bool) -> bool {
        self.files
            .get(&key)
            .is_some_and(|f| f.writable || !writable)
    }

    /// Records a new mapping of file `key` at `[start, end)`, which was
    /// `size` bytes long when mapped; `file` is a descriptor of its own,
    /// kept while any piece shows the file, needed only when the file is
    /// not [`Self::tracks`]ed yet. `watch` follows the file's size.
    /// `writable`: mapped read-write.
    #[expect(clippy::too_many_arguments, reason = "one mapping's facts")]
    pub fn insert(
        &mut self,
        start: u64,
        end: u64,
        key: FileKey,
        file: Option<File>,
        size: u64,
        fd_offset: u64,
        writable: bool,
        watch: Option<&FileWatch>,
    ) {
        // The new piece counts before the pieces it replaces go: when it
        // replaces the file's last one (the guest remapping a range
        // writable), the file's descriptor and watch must stay.
        match (self.files.get_mut(&key), file) {
            (Some(tracked), file) => {
                tracked.pieces += 1;
                // The descriptor of a writable mapping replaces a read-only
                // one (the watch keeps its own: the same file).
                if let Some(file) = file.filter(|_| writable && !tracked.writable) {
                    tracked.file = Arc::new(file);
                    tracked.writable = true;
                }
                if let Some(w) = watch {
                    w.saw_size(key, size);
                }
            }
            (None, Some(file)) => {
                let file = Arc::new(file);
                if let Some(w) = watch {
                    w.follow(key, file.clone(), size);
                }
                self.files.insert(
                    key,
                    TrackedFile {
                        file,
                        pieces: 1,
                        writable,
                    },
                );
            }
            // (A caller that checked `tracks` under the same lock never
            // gets here; the piece is then simply not watched.)
            (None, None) => {}
        }
        self.remove(start, end, watch);
        self.pieces.insert(
            start,
            Piece {
                end,
                file: key,
                fd_offset,
                writable,
            },
        );
    }

    /// Window ranges whose file pages are gone: past the end (rounded up
    /// to `page`) of the file as it is now. `only`: just those files.
    pub fn past_eof(&mut self, only: Option<&[FileKey]>, page: u64) -> Vec<(u64, u64)> {
        self.walks += 1;
        let mut eof = HashMap::new();
        for (key, f) in &self.files {
            if only.is_some_and(|keys| !keys.contains(key)) {
                continue;
            }
            // A file that cannot be inspected is left as it is.
            if let Ok(m) = f.file.metadata() {
                eof.insert(
                    *key,
                    m.len().checked_next_multiple_of(page).unwrap_or(u64::MAX),
                );
            }
        }
        let mut gone = Vec::new();
        for (&start, p) in &self.pieces {
            let Some(&eof) = eof.get(&p.file) else {
                continue;
            };
            let valid = eof.saturating_sub(p.fd_offset);
            if valid < p.end - start {
                gone.push((start + valid, p.end));
            }
        }
        gone
    }

    /// Walks [`Self::past_eof`] made (each under the window's lock).
    pub fn walks(&self) -> u64 {
        self.walks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> File {
        vmm_sys_util::tempfile::TempFile::new().unwrap().into_file()
    }

    #[test]
    fn pieces_are_cut_and_files_released_with_their_last_piece() {
        let mut m = MappedFiles::default();
        m.insert(0, 100, (1, 1), Some(file()), 0, 1000, false, None);
        m.insert(100, 200, (1, 2), Some(file()), 0, 0, false, None);
        assert_eq!((m.len(), m.files()), (2, 2));
        // A hole in the middle of the first: two pieces, one file.
        assert_eq!(m.count_after(40, 60, false), 3);
        m.remove(40, 60, None);
        assert_eq!((m.len(), m.files()), (3, 2));
        assert_eq!(m.pieces[&60].fd_offset, 1060);
        // Mapping over both pieces of file 1 releases it.
        m.insert(0, 100, (1, 3), Some(file()), 0, 0, false, None);
        assert_eq!((m.len(), m.files()), (2, 2));
        m.remove(0, 200, None);
        assert!(m.is_empty() && m.files() == 0);
    }

    /// The guest upgrades a range to writable: the same file over its only
    /// piece. The file stays tracked (its descriptor, its watch), so a
    /// later truncation is still seen.
    #[test]
    fn remapping_a_files_only_piece_keeps_the_file() {
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap();
        f.as_file().set_len(2 * 4096).unwrap();
        let mut m = MappedFiles::default();
        let dup = f.as_file().try_clone().unwrap();
        m.insert(0, 2 * 4096, (5, 5), Some(dup), 2 * 4096, 0, false, None);
        assert!(m.tracks((5, 5)));
        m.insert(0, 2 * 4096, (5, 5), None, 2 * 4096, 0, true, None);
        assert_eq!((m.len(), m.files()), (1, 1));
        assert!(m.pieces().all(|p| p.writable), "the new access is kept");
        f.as_file().set_len(4096).unwrap();
        assert_eq!(m.past_eof(None, 4096), vec![(4096, 2 * 4096)]);
        m.remove(0, 2 * 4096, None);
        assert_eq!(m.files(), 0, "released with its last piece");
    }

    #[test]
    fn ranges_past_the_end_of_a_shrunk_file_are_found() {
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap();
        f.as_file().set_len(10 * 4096).unwrap();
        let mut m = MappedFiles::default();
        let dup = f.as_file().try_clone().unwrap();
        // Window [0, 4 pages) shows file pages 4..8.
        m.insert(
            0,
            4 * 4096,
            (9, 9),
            Some(dup),
            10 * 4096,
            4 * 4096,
            false,
            None,
        );
        assert!(m.past_eof(None, 4096).is_empty());
        f.as_file().set_len(5 * 4096 + 1).unwrap();
        // File pages 6.. are gone: window pages 2..4.
        assert_eq!(m.past_eof(None, 4096), vec![(2 * 4096, 4 * 4096)]);
        assert!(m.past_eof(Some(&[(1, 1)]), 4096).is_empty());
    }
}
