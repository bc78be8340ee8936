//! Pre-faulting new DAX mappings (see [`DaxWindow::prefault`]); whether
//! the guest is reclaiming, which decides when not to, is counted in
//! [`super::reclaim`].

use std::sync::Arc;

use super::{DaxWindow, GuestPrefaulter};
use crate::vhost_user_fs::metrics::MapStage;

/// `MADV_POPULATE_READ` (Linux 5.14): fault pages in readable, as a read
/// would, without touching their contents.
const MADV_POPULATE_READ: libc::c_int = 22;

/// Pre-faults waiting for the device worker: at least this many
/// ([`queue_max`]). A guest that maps faster than they run loses the
/// oldest past the bound: pre-faulting is only work done ahead of the
/// guest's touch, which KVM serves either way. A random reader maps its
/// file's ranges in a burst, faster than their pre-faults run on 4 KiB
/// host pages; with a queue of eight, 13 of a 64 MiB file's 32 ranges went
/// without and the guest took a nested page fault per 4 KiB page there
/// (docs/benchmarks.md, "Run 4: every pre-fault kept").
const PREFAULT_QUEUE_MIN: usize = 512;

/// How many pre-faults may wait in a window of `size` bytes that holds at
/// most `max_mappings` ranges: one per 2 MiB range of the window, at least
/// [`PREFAULT_QUEUE_MIN`]. Each waiting job is a distinct live range (one
/// mapped anew or unmapped leaves the queue), so there are never more
/// than `max_mappings`; the bound is a few dozen bytes of bookkeeping per
/// range, not work.
pub(crate) fn queue_max(size: u64, max_mappings: usize) -> usize {
    let ranges = usize::try_from(size / MAX_PREFAULT_STEP).unwrap_or(usize::MAX);
    ranges.clamp(PREFAULT_QUEUE_MIN, max_mappings.max(PREFAULT_QUEUE_MIN))
}

/// Scratch emptyings left for after the ack. Past this the oldest runs at
/// once: each holds scratch memory the guest can no longer reach.
const HIDDEN_SCRATCH_MAX: usize = 8;

/// What one step pre-faults before the worker looks for a waiting backend
/// request: a SHMEM_MAP waits at most one step, not a whole 2 MiB range
/// (512 pages at 4 KiB, milliseconds under nested virtualization: measured
/// in docs/benchmarks.md, "The SETUPMAPPING round trip").
const PREFAULT_STEP: u64 = 128 << 10;

/// The largest step: one 2 MiB host page, which KVM maps in one call
/// however the range is cut (so cutting it only adds calls: a 2 MiB range
/// in 128 KiB steps made a cold map on 2 MiB host pages slower, measured in
/// docs/benchmarks.md). Larger pages (1 GiB hugetlbfs) are still stepped by
/// 2 MiB, so a waiting SHMEM_MAP never waits behind more than one.
const MAX_PREFAULT_STEP: u64 = 2 << 20;

/// The host page size of a file whose `st_blksize` is `blksize`, where that
/// names a huge page: tmpfs with huge pages and hugetlbfs report the size
/// of the pages that hold the file there (2 MiB, or the huge page size).
/// 0 below 2 MiB: elsewhere `st_blksize` is a preferred I/O size (4 KiB on
/// local disks, up to 1 MiB on a network file system) and says nothing of
/// pages. (A file system reporting an I/O size of 2 MiB or more without
/// huge pages gets 2 MiB steps: a waiting SHMEM_MAP may then wait for one
/// 2 MiB step, as it did for a whole range before steps; the type of the
/// file system is not asked, which would take one more system call per
/// map on the device worker.)
pub(super) fn host_page(blksize: u64) -> u64 {
    if blksize >= MAX_PREFAULT_STEP && blksize.is_power_of_two() {
        blksize
    } else {
        0
    }
}

/// The pre-fault step of a mapping whose file's host pages are
/// `host_page` bytes (0: not known, 4 KiB pages as a rule): one page, from
/// [`PREFAULT_STEP`] to [`MAX_PREFAULT_STEP`].
pub(super) fn step_for(host_page: u64) -> u64 {
    host_page.clamp(PREFAULT_STEP, MAX_PREFAULT_STEP)
}

/// Puts guest bytes `[gpa, gpa + len)` into KVM's page tables; the bytes it
/// did (KVM may do a range in several calls).
fn guest_prefault(p: &dyn GuestPrefaulter, gpa: u64, len: u64) -> u64 {
    let mut done = 0;
    while done < len {
        match p.prefault(gpa + done, len - done) {
            Ok(0) | Err(_) => break,
            Ok(n) => done += n.min(len - done),
        }
    }
    done
}

/// A new mapping's pre-fault: `[addr, addr + len)` at window offset
/// `shm_offset`, file offset `fd_offset` of a `file_size`-byte file.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deferred {
    pub addr: u64,
    pub shm_offset: u64,
    pub len: u64,
    pub fd_offset: u64,
    pub file_size: u64,
    /// Bytes a step ([`step_for`]).
    pub step: u64,
}

impl DaxWindow {
    /// Runs the pre-faults [`Self::map_deferring_prefault`] left, newest
    /// first (the range the guest asked for last is the one it touches
    /// next), step by step; when `interrupted` says a request is waiting,
    /// what is left goes back to the queue for the worker's next turn.
    ///
    /// First it empties the scratch the last maps hid
    /// ([`Self::defer_scratch_forget`]): one system call or more per map,
    /// off the guest's wait.
    pub fn run_deferred_prefault(&self, interrupted: &dyn Fn() -> bool) {
        let hidden = std::mem::take(&mut *self.hidden_scratch());
        for (start, end) in hidden {
            self.forget_scratch(start, end);
        }
        let started = std::time::Instant::now();
        let mut ran = false;
        loop {
            let job = self.deferred().pop();
            let Some(job) = job else {
                break;
            };
            ran = true;
            if let Some(rest) = self.prefault_steps(job, interrupted) {
                self.deferred().push(rest);
                break;
            }
        }
        if ran {
            self.metrics
                .record_stage(MapStage::PrefaultAfterAck, started.elapsed());
        }
    }

    fn hidden_scratch(&self) -> std::sync::MutexGuard<'_, Vec<(u64, u64)>> {
        self.deferred_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Empties the scratch at `[start, end)`, which a new mapping hides.
    pub(super) fn forget_scratch(&self, start: u64, end: u64) {
        if let Err(e) = self.scratch.forget(start, end) {
            tracing::debug!("DAX window: emptying the scratch under a new mapping: {e}");
        }
    }

    /// Leaves the emptying of the scratch a new mapping hides at
    /// `[start, end)` for after the daemon's ack. Safe to wait: the guest
    /// cannot reach hidden pages, and a range that shows the scratch again
    /// first (an unmap, a reset, a truncation's repair) drops it
    /// ([`Self::drop_hidden_scratch`]), so stray writes made there since
    /// are never emptied by it. At most [`HIDDEN_SCRATCH_MAX`] wait; past that
    /// the oldest is emptied now.
    pub(super) fn defer_scratch_forget(&self, start: u64, end: u64) {
        let oldest = {
            let mut hidden = self.hidden_scratch();
            hidden.push((start, end));
            (hidden.len() > HIDDEN_SCRATCH_MAX).then(|| hidden.remove(0))
        };
        if let Some((start, end)) = oldest {
            self.forget_scratch(start, end);
        }
    }

    /// `[start, end)` shows the scratch again (emptied by whoever shows it):
    /// a deferred emptying of it must not run later.
    pub(super) fn drop_hidden_scratch(&self, start: u64, end: u64) {
        self.hidden_scratch()
            .retain(|&(s, e)| s >= end || e <= start);
    }

    fn deferred(&self) -> std::sync::MutexGuard<'_, Vec<Deferred>> {
        self.deferred_prefault
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a new mapping's pre-fault for [`Self::run_deferred_prefault`].
    fn defer_prefault(&self, job: Deferred) {
        let mut queue = self.deferred();
        queue.push(job);
        if queue.len() > queue_max(self.size, self.max_mappings) {
            queue.remove(0);
        }
    }

    /// Drops queued pre-faults of window bytes `[start, end)`: the range is
    /// being mapped anew or unmapped, and pre-faulting the scratch would
    /// only fill it.
    pub(super) fn forget_deferred(&self, start: u64, end: u64) {
        self.deferred()
            .retain(|j| j.shm_offset >= end || j.shm_offset.saturating_add(j.len) <= start);
    }

    /// Whether new mappings are pre-faulted (the device's `dax_prefault`).
    pub fn set_prefault(&self, on: bool) {
        self.prefault
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Where the guest sees the window now (set when it is placed or its
    /// BAR moves).
    pub fn set_guest_base(&self, gpa: u64) {
        self.guest_base
            .store(gpa, std::sync::atomic::Ordering::Relaxed);
    }

    /// What maps new ranges into the guest's view ahead of its touch.
    pub fn set_guest_prefaulter(&self, prefaulter: Arc<dyn GuestPrefaulter>) {
        let _ = self.guest_prefaulter.set(prefaulter);
    }

    /// What a new mapping gets, once the window's lock is dropped (this
    /// may read the file; a concurrent unmap of the range only leaves the
    /// scratch populated): its pre-fault now, or queued when `defer`; none
    /// when pre-faulting is off, or when the guest is `reclaiming` and the
    /// map does not continue the last one.
    pub(super) fn prefault_new_mapping(
        &self,
        job: Deferred,
        file: (u64, u64),
        reclaiming: bool,
        defer: bool,
    ) {
        let follows = self.follows_last_map(file, job.fd_offset, job.len);
        if self.prefault.load(std::sync::atomic::Ordering::Relaxed) && (!reclaiming || follows) {
            if defer {
                // A pre-fault still queued for what this map replaced is moot.
                self.forget_deferred(job.shm_offset, job.shm_offset + job.len);
                self.defer_prefault(job);
            } else {
                self.prefault(job);
            }
        }
    }

    /// Pre-faults a new mapping `[addr, addr + len)` at window offset
    /// `shm_offset`, up to the end of the file (past it there are no pages,
    /// and faulting them would fail). Best effort: a failure is counted and
    /// the mapping stays; its pages then fault one by one as usual.
    ///
    /// Where KVM can ([`GuestPrefaulter`]), the range goes straight into
    /// KVM's page tables: the guest's first touch of each page then takes no
    /// nested page fault at all (one per 4 KiB of a file the host caches in
    /// 4 KiB pages otherwise), and KVM faults in the host pages it needs on
    /// the way. Otherwise only this process's page tables are filled
    /// (`MADV_POPULATE_READ`), which spares the host fault inside each
    /// nested one. Either way a file not in the host's page cache is read
    /// here, by the backend thread, not under a stalled vCPU; pages are
    /// faulted for reading, so nothing the guest did not write is dirtied.
    ///
    /// Not while the guest is reclaiming ranges to map new ones
    /// ([`super::reclaim::ReclaimPressure`]), unless the map continues the last one: a
    /// random reader then uses a page or two of each range before it goes
    /// again, so pre-faulting the whole range only costs (random 4 KiB reads
    /// of a file twice the window's size ran at half the speed with it). A
    /// sequential reader uses all of it.
    fn prefault(&self, job: Deferred) {
        self.prefault_steps(job, &|| false);
    }

    /// [`Self::prefault`] in steps of the job's size ([`step_for`]: the
    /// file's host page, at least [`PREFAULT_STEP`]); when `interrupted`
    /// answers true between two, returns the part not yet done.
    pub(super) fn prefault_steps(
        &self,
        job: Deferred,
        interrupted: &dyn Fn() -> bool,
    ) -> Option<Deferred> {
        let len = job.len.min(job.file_size.saturating_sub(job.fd_offset));
        let len = len.div_ceil(self.page_size) * self.page_size;
        let base = self.guest_base.load(std::sync::atomic::Ordering::Relaxed);
        let prefaulter = self
            .guest_prefaulter
            .get()
            .filter(|p| p.available() && base != 0);
        let m = &self.metrics;
        let mut done = 0;
        while done < len {
            let step = job.step.min(len - done);
            let faulted = match prefaulter {
                Some(p) => {
                    let n = guest_prefault(p.as_ref(), base + job.shm_offset + done, step);
                    m.guest_prefaulted_bytes
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    n == step
                }
                None => {
                    // SAFETY: [addr + done, + step) lies inside the window's
                    // new file mapping (done + step is at most the mapping's
                    // length); populating reads no memory into Rust values
                    // and changes no contents.
                    let r = unsafe {
                        libc::madvise(
                            (job.addr + done) as *mut libc::c_void,
                            narrow::usize_of(step),
                            MADV_POPULATE_READ,
                        )
                    };
                    if r == 0 {
                        m.prefaulted_bytes
                            .fetch_add(step, std::sync::atomic::Ordering::Relaxed);
                    }
                    r == 0
                }
            };
            if !faulted {
                m.prefault_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return None;
            }
            done += step;
            if done < len && interrupted() {
                return Some(Deferred {
                    addr: job.addr + done,
                    shm_offset: job.shm_offset + done,
                    len: len - done,
                    fd_offset: job.fd_offset + done,
                    file_size: job.file_size,
                    step: job.step,
                });
            }
        }
        None
    }

    /// Whether a map of `file` at `fd_offset` continues the last map (the
    /// guest reads the file in order); remembers this one.
    fn follows_last_map(&self, file: (u64, u64), fd_offset: u64, len: u64) -> bool {
        let mut last = self.last_map.lock().unwrap_or_else(|p| p.into_inner());
        let follows = *last == Some((file, fd_offset));
        *last = fd_offset.checked_add(len).map(|end| (file, end));
        follows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vhost_user_fs::window::DEFAULT_MAX_MAPPINGS;

    /// One waiting pre-fault per 2 MiB range of the window, at least 512,
    /// never more than the window's ranges can be.
    #[test]
    fn the_prefault_queue_grows_with_the_window_up_to_its_mapping_cap() {
        const MIB: u64 = 1 << 20;
        assert_eq!(queue_max(2 * MIB, DEFAULT_MAX_MAPPINGS), 512);
        assert_eq!(queue_max(512 * MIB, DEFAULT_MAX_MAPPINGS), 512);
        assert_eq!(queue_max(8 << 30, DEFAULT_MAX_MAPPINGS), 4096);
        assert_eq!(
            queue_max(64 << 30, DEFAULT_MAX_MAPPINGS),
            DEFAULT_MAX_MAPPINGS
        );
        assert_eq!(
            queue_max(u64::MAX, DEFAULT_MAX_MAPPINGS),
            DEFAULT_MAX_MAPPINGS
        );
        assert_eq!(queue_max(8 << 30, 1000), 1000);
        assert_eq!(queue_max(8 << 30, 3), 512, "the floor holds");
    }
}
