//! Giving window ranges back: SHMEM_UNMAP, a reset, and what a truncation
//! repair drops ([`super::repair`]) all show the window's scratch again
//! ([`super::super::scratch`]) over the range; the scratch's own numbers;
//! and the estimate of how much the guest is reclaiming ranges, which the
//! map path reads to decide on pre-faulting ([`super::prefault`]).

use std::sync::Mutex;

use vhost::vhost_user::message::VhostUserMMap;

use super::{DaxWindow, FailureReason, Mappings, RequestError, WindowEvent};

/// Bytes mapped at or above which an unmap of a `window_size` window
/// counts as the guest reclaiming: three quarters of the window.
///
/// Not Linux's own mark ([`dax_abi::GUEST_RECLAIM_OCCUPANCY_PCT`], 80 % of
/// the ranges, which the daemon uses) but below it on purpose: one pass of
/// the guest's reclaim unmaps several ranges, one REMOVEMAPPING each, so
/// the window's occupancy falls under 80 % while the pass goes on, and
/// those unmaps are reclaim too. The window counts bytes, not the daemon's
/// ranges: every Linux mapping is a whole 2 MiB range, so the two agree
/// for a Linux guest.
pub(super) fn reclaim_mark(window_size: u64) -> u64 {
    window_size / 4 * 3
}

impl DaxWindow {
    /// Shows the scratch, emptied, over `[start, end)` of the window
    /// (callers check bounds).
    pub(super) fn show_scratch(&self, start: u64, end: u64) -> std::io::Result<()> {
        self.drop_hidden_scratch(start, end);
        if let Err(e) = self.scratch.forget(start, end) {
            tracing::debug!("DAX window: emptying the scratch at {start:#x}..{end:#x}: {e}");
        }
        self.scratch.show(self.host_addr, start, end)
    }

    /// Bytes of the scratch that guest accesses outside any mapping have
    /// touched since the window was made (also those emptied since).
    pub fn stray_bytes(&self) -> std::io::Result<u64> {
        self.scratch.stray_bytes()
    }

    /// What the guest may keep in the scratch before it is emptied.
    pub fn stray_budget(&self) -> u64 {
        self.scratch.budget()
    }

    /// Times the scratch went over its budget and was emptied.
    pub fn stray_resets(&self) -> u64 {
        self.scratch.resets()
    }

    /// SHMEM_UNMAP: shows the scratch again over the range.
    pub fn unmap(&self, req: &VhostUserMMap) -> Result<(), RequestError> {
        let result = self
            .check(req)
            .and_then(|end| self.unmap_range(req.shm_offset, end, true));
        let (offset, len) = (req.shm_offset, req.len);
        match &result {
            Ok(()) => {
                self.metrics
                    .unmaps
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.notify(WindowEvent::Unmap { offset, len });
            }
            Err(e) => {
                self.metrics.record_failure(e.reason);
                self.notify(WindowEvent::Refused {
                    request: "unmap",
                    reason: e.reason,
                    offset,
                    len,
                });
            }
        }
        result
    }

    /// `capped`: refuse an unmap that would split ranges past the cap (a
    /// reset, which unmaps everything, never is).
    fn unmap_range(&self, start: u64, end: u64, capped: bool) -> Result<(), RequestError> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if capped {
            self.check_count(&mut mapped, start, end, false, false)?;
        }
        let (removed, in_use) = self.drop_mappings(&mut mapped, start, end).map_err(|e| {
            RequestError::new(
                FailureReason::MapFailed,
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("unmapping window offset {start:#x}..{end:#x}: {e}"),
            )
        })?;
        // Unmaps of a roomy window are inodes going away, not pressure.
        if removed > 0 && in_use >= reclaim_mark(self.size) {
            self.reclaim_pressure.on_unmap();
        }
        Ok(())
    }

    /// Shows the (emptied) scratch over `[start, end)` and forgets what was
    /// mapped there (ranges, files, budget, bytes mapped): what an unmap
    /// and a truncation repair both do. Returns the bytes that were mapped
    /// there and the bytes mapped before.
    pub(super) fn drop_mappings(
        &self,
        mapped: &mut Mappings,
        start: u64,
        end: u64,
    ) -> std::io::Result<(u64, u64)> {
        self.forget_deferred(start, end);
        self.show_scratch(start, end)?;
        let removed = mapped.ranges.remove(start, end);
        mapped.guarded.remove(start, end);
        mapped.files.remove(start, end, Some(&self.file_watch));
        self.settle_charge(mapped);
        let in_use = self
            .metrics
            .bytes_mapped
            .fetch_sub(removed, std::sync::atomic::Ordering::Relaxed);
        Ok((removed, in_use))
    }

    /// Drops every mapping (device reset, daemon gone).
    pub fn clear(&self) {
        if self.unmap_range(0, self.size, false).is_ok() {
            self.metrics
                .resets
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.notify(WindowEvent::Reset);
        } else {
            tracing::error!(
                "could not clear the DAX window; its mappings stay until the VMM exits"
            );
        }
    }
}

/// How much the guest is reclaiming ranges to map new ones: unmaps of a
/// window filled to [`reclaim_mark`] or more counted up, decaying by 1/32
/// at each map, in sixteenths. When every map comes with an unmap it
/// settles at 32 (512); one unmap in ten maps keeps it near 3; the guest
/// counts as reclaiming above 8.
#[derive(Default)]
pub(super) struct ReclaimPressure(Mutex<u32>);

impl ReclaimPressure {
    const ONE: u32 = 16;
    const RECLAIMING: u32 = 8 * Self::ONE;

    pub(super) fn on_unmap(&self) {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *p = p.saturating_add(Self::ONE).min(64 * Self::ONE);
    }

    /// Decays the score for one more map; whether the guest is reclaiming.
    pub(super) fn on_map(&self) -> bool {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *p -= *p / 32;
        *p > Self::RECLAIMING
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_reclaim_from_below_linux_s_mark() {
        let size = 512 * dax_abi::GUEST_RANGE_SIZE;
        let mark = reclaim_mark(size);
        assert_eq!(mark, 384 * dax_abi::GUEST_RANGE_SIZE);
        assert!(mark * 100 < size * dax_abi::GUEST_RECLAIM_OCCUPANCY_PCT);
    }
}
