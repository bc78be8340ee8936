//! What the window does about mapped files shrinking on the host (see
//! [`super::super::mapped_files`]), about a vCPU's failed access to the
//! window (see [`super::guard`]) and about its scratch's budget.

use std::os::fd::RawFd;

use super::{DaxWindow, FileKey, WindowEvent};

impl DaxWindow {
    /// The inotify descriptor that becomes readable when a mapped file is
    /// modified: the device worker polls it and calls
    /// [`Self::on_file_events`].
    pub fn file_watch_fd(&self) -> Option<RawFd> {
        self.file_watch.as_raw_fd()
    }

    /// Mapped files were modified: repairs those that shrank. Their sizes
    /// are read without the window's lock; it is taken only for a file
    /// that shrank (a write, however small and frequent, takes nothing).
    pub fn on_file_events(&self) -> u64 {
        let shrunk = self.file_watch.shrunk_after_events();
        if shrunk.is_empty() {
            return 0;
        }
        self.repair_truncated(Some(&shrunk))
    }

    /// Once a second, from the device worker: empties the scratch when the
    /// guest keeps more than its budget there, and checks the files no
    /// inotify watch covers.
    pub fn tick(&self) {
        match self.scratch.enforce_budget() {
            Ok(true) => crate::warn_limited!(
                "DAX window: the guest wrote more than {} bytes outside any mapping; the scratch was emptied (it reads zeros again)",
                self.scratch.budget()
            ),
            Ok(false) => {}
            Err(e) => tracing::debug!("DAX window: checking the scratch: {e}"),
        }
        let shrunk = self.file_watch.shrunk_unwatched();
        if !shrunk.is_empty() {
            self.repair_truncated(Some(&shrunk));
        }
    }

    /// KVM could not fault in a page of this window (at guest-physical
    /// `gpa`, when KVM said where): guarded pages ([`super::guard`]) get the
    /// file back where it grew, or the scratch; failing that, pages of
    /// shrunk files show the scratch ([`Self::repair_truncated`]). Returns
    /// the bytes changed; 0: the fault was none of the window's doing.
    pub fn repair_after_fault(&self, gpa: Option<u64>) -> u64 {
        let at = gpa.and_then(|g| {
            let base = self.guest_base.load(std::sync::atomic::Ordering::Relaxed);
            g.checked_sub(base).filter(|&o| base != 0 && o < self.size)
        });
        match self.resolve_guards(at) {
            0 => self.repair_truncated(None),
            n => n,
        }
    }

    /// Shows the scratch over every mapped page whose file page is gone
    /// (the file shrank on the host), so a guest access there reads zeros
    /// instead of hanging or failing its vCPU. `only`: just those files.
    /// Guarded pages are left as they are: they were past the end already,
    /// and a guest access there is resolved when it comes. Returns the
    /// bytes repaired; each range is counted and announced.
    pub fn repair_truncated(&self, only: Option<&[FileKey]>) -> u64 {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<(u64, u64)> = mapped
            .files
            .past_eof(only, self.page_size)
            .into_iter()
            .flat_map(|(s, e)| mapped.guarded.uncovered(s, e))
            .collect();
        let mut repaired = 0;
        for (start, end) in gone {
            if let Err(e) = self.drop_mappings(&mut mapped, start, end) {
                crate::error_limited!("DAX window: showing the scratch over truncated pages {start:#x}..{end:#x}: {e}");
                continue;
            }
            self.metrics
                .truncated_bytes
                .fetch_add(end - start, std::sync::atomic::Ordering::Relaxed);
            repaired += end - start;
            self.notify(WindowEvent::Truncated {
                offset: start,
                len: end - start,
            });
        }
        if repaired > 0 {
            crate::warn_limited!(
                "DAX window: a mapped file shrank on the host; {repaired} bytes of the window that showed it read zeros now"
            );
        }
        repaired
    }

    /// Distinct files mapped now: the descriptors the window keeps.
    pub fn mapped_files(&self) -> usize {
        self.mapped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .files
            .files()
    }

    /// Whether guest-physical `gpa` lies in this window (as placed now).
    pub fn contains_gpa(&self, gpa: u64) -> bool {
        let base = self.guest_base.load(std::sync::atomic::Ordering::Relaxed);
        base != 0 && gpa >= base && gpa - base < self.size
    }
}
