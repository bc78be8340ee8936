//! Window pages that map a file past its end: guarded (`PROT_NONE`) until
//! the guest touches them.
//!
//! The guest maps whole ranges (2 MiB for Linux), so the last range of a
//! file usually reaches past its end; and a guest that has not yet learnt
//! that the host cut a file short asks for ranges of pages that are gone
//! (a write to a page it read before upgrades the range to writable: a new
//! SHMEM_MAP of the same, vanished pages). A host page past the file's
//! end cannot be faulted in: on Linux before 6.13 KVM turns the failed
//! fault of a guest running with interrupts enabled into an async page
//! fault that it retries for ever, without an exit, and the vCPU (the whole
//! guest, with one) hangs; no inotify event comes to repair it, as the file
//! does not change again.
//!
//! So the window maps such a tail `PROT_NONE`. KVM does not try an async
//! fault on a page the mapping does not allow, and KVM_RUN fails with
//! `EFAULT` instead; the vCPU asks the window ([`DaxWindow::repair_after_fault`]),
//! which looks at the file again: the pages it covers now (it grew, e.g. by
//! the guest's own FUSE WRITE past the end) get the file's protection back,
//! and the guest sees the file; pages still past its end show the scratch
//! (zeros), as [`DaxWindow::repair_truncated`] does for a file that shrank.

use std::collections::BTreeMap;

use super::{DaxWindow, Mappings, WindowEvent};

/// One guarded range's end and the protection its file mapping gets back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Guard {
    end: u64,
    writable: bool,
}

/// The guarded window ranges, disjoint `[start, end)`.
#[derive(Default, Debug)]
pub(super) struct Guards(BTreeMap<u64, Guard>);

impl Guards {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The guarded ranges that share a byte with `[start, end)`:
    /// `(start, end, writable)`.
    pub fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let mut found: Vec<_> = self
            .0
            .range(..end)
            .rev()
            .take_while(|(_, g)| g.end > start)
            .map(|(&s, g)| (s, g.end, g.writable))
            .collect();
        found.reverse();
        found
    }

    /// Unguards `[start, end)`, cutting guards that straddle its ends.
    pub fn remove(&mut self, start: u64, end: u64) {
        for (s, e, writable) in self.overlapping(start, end) {
            self.0.remove(&s);
            if s < start {
                self.0.insert(
                    s,
                    Guard {
                        end: start,
                        writable,
                    },
                );
            }
            if e > end {
                self.0.insert(end, Guard { end: e, writable });
            }
        }
    }

    pub fn insert(&mut self, start: u64, end: u64, writable: bool) {
        self.remove(start, end);
        self.0.insert(start, Guard { end, writable });
    }

    /// Guards after `[start, end)` is unguarded (and, with `add`, one put
    /// there): each is a mapping of its own, charged to the budget.
    pub fn count_after(&self, start: u64, end: u64, add: bool) -> usize {
        let mut n = self.0.len();
        for (s, e, _) in self.overlapping(start, end) {
            n = n - 1 + usize::from(s < start) + usize::from(e > end);
        }
        n + usize::from(add)
    }

    /// The parts of `[start, end)` no guard covers.
    pub fn uncovered(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut parts = Vec::new();
        let mut at = start;
        for (s, e, _) in self.overlapping(start, end) {
            if s > at {
                parts.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            parts.push((at, end));
        }
        parts
    }
}

/// The window bytes of a `len`-byte map at `shm_offset` (file offset
/// `fd_offset`) that lie past the end of a `file_size`-byte file, rounded
/// up to `page`: `[from, shm_offset + len)`, or None.
pub(super) fn tail_past_eof(
    shm_offset: u64,
    len: u64,
    fd_offset: u64,
    file_size: u64,
    page: u64,
) -> Option<u64> {
    let eof = file_size.checked_next_multiple_of(page)?;
    let valid = eof.saturating_sub(fd_offset);
    (valid < len).then(|| shm_offset + valid)
}

/// Sets the protection of `[addr, addr + len)` of the window.
fn protect(addr: u64, len: u64, prot: libc::c_int) -> std::io::Result<()> {
    let len = usize::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: the caller passes a range of the window's own reservation
    // that holds a file mapping; changing its protection touches no Rust
    // value (no reference points into the window).
    let r = unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn file_prot(writable: bool) -> libc::c_int {
    libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 }
}

impl DaxWindow {
    /// Guards `[from, end)` of a file mapping just made (it lies past the
    /// file's end). Should that fail, the scratch goes there instead: the
    /// guest then reads zeros even if the file grows, but no vCPU hangs.
    pub(super) fn guard_tail(&self, mapped: &mut Mappings, from: u64, end: u64, writable: bool) {
        match protect(self.host_addr + from, end - from, libc::PROT_NONE) {
            Ok(()) => mapped.guarded.insert(from, end, writable),
            Err(e) => {
                crate::warn_limited!(
                    "DAX window: guarding window offset {from:#x}..{end:#x} past the end of its file: {e}; it shows zeros instead"
                );
                if let Err(e) = self.drop_mappings(mapped, from, end) {
                    crate::error_limited!(
                        "DAX window: showing the scratch at {from:#x}..{end:#x}: {e}"
                    );
                }
            }
        }
    }

    /// A vCPU's access to a guarded page failed (KVM_RUN's `EFAULT`; at
    /// window offset `at` when KVM said where): the guarded pages the file
    /// covers now get its protection back; if none did (or the page at
    /// `at` is still past the end), the guarded pages still past the end
    /// show the scratch. Only the guard holding `at`, when known. Returns
    /// the bytes changed.
    pub(super) fn resolve_guards(&self, at: Option<u64>) -> u64 {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if mapped.guarded.is_empty() {
            return 0;
        }
        let guards = match at {
            Some(o) => mapped.guarded.overlapping(o, o + 1),
            None => mapped.guarded.overlapping(0, self.size),
        };
        if guards.is_empty() {
            return 0;
        }
        // What is past the end of each file now.
        let mut gone = Guards::default();
        for (s, e) in mapped.files.past_eof(None, self.page_size) {
            gone.insert(s, e, false);
        }
        let mut grown = 0;
        for &(s, e, writable) in &guards {
            for (a, b) in gone.uncovered(s, e) {
                match protect(self.host_addr + a, b - a, file_prot(writable)) {
                    Ok(()) => {
                        mapped.guarded.remove(a, b);
                        grown += b - a;
                    }
                    Err(e) => {
                        tracing::debug!("DAX window: unguarding window offset {a:#x}..{b:#x}: {e}")
                    }
                }
            }
        }
        let still_guarded = at.is_none_or(|o| !mapped.guarded.overlapping(o, o + 1).is_empty());
        if grown > 0 && (at.is_none() || !still_guarded) {
            return grown;
        }
        let mut zeroed = Vec::new();
        for (s, e, _) in guards {
            for (a, b, _) in mapped.guarded.overlapping(s, e) {
                let (a, b) = (a.max(s), b.min(e));
                if let Err(e) = self.drop_mappings(&mut mapped, a, b) {
                    crate::error_limited!(
                        "DAX window: showing the scratch over guarded pages {a:#x}..{b:#x}: {e}"
                    );
                    continue;
                }
                zeroed.push((a, b));
            }
        }
        drop(mapped);
        let zeroed_bytes: u64 = zeroed.iter().map(|(a, b)| b - a).sum();
        for (offset, end) in zeroed {
            self.notify(WindowEvent::Truncated {
                offset,
                len: end - offset,
            });
        }
        if zeroed_bytes > 0 {
            self.metrics
                .truncated_bytes
                .fetch_add(zeroed_bytes, std::sync::atomic::Ordering::Relaxed);
            crate::warn_limited!(
                "DAX window: the guest touched pages mapped past the end of their file (cut short on the host?); {zeroed_bytes} bytes of the window read zeros now"
            );
        }
        grown + zeroed_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_split_count_and_leave_gaps() {
        let mut g = Guards::default();
        g.insert(10, 20, true);
        g.insert(30, 40, false);
        assert_eq!(g.count_after(15, 35, false), 2, "both cut, one piece each");
        assert_eq!(g.count_after(12, 18, true), 4);
        assert_eq!(g.uncovered(0, 50), vec![(0, 10), (20, 30), (40, 50)]);
        assert_eq!(g.uncovered(12, 18), vec![]);
        g.remove(12, 18);
        assert_eq!(
            g.overlapping(0, 50),
            vec![(10, 12, true), (18, 20, true), (30, 40, false)]
        );
        assert_eq!(g.overlapping(19, 31), vec![(18, 20, true), (30, 40, false)]);
    }

    #[test]
    fn only_what_lies_past_the_rounded_end_is_a_tail() {
        const P: u64 = 4096;
        // 2.5 pages of file mapped from its start over 8 pages at 64 pages.
        assert_eq!(tail_past_eof(64 * P, 8 * P, 0, 2 * P + 1, P), Some(67 * P));
        assert_eq!(tail_past_eof(64 * P, 8 * P, 0, 8 * P, P), None);
        // Entirely past the end (a file cut to a page, mapped from 6 MiB).
        assert_eq!(tail_past_eof(0, 512 * P, 1536 * P, P, P), Some(0));
    }
}
