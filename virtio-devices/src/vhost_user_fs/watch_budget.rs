//! One budget of inotify watches for every DAX window of the VMM.
//!
//! A window watches each distinct file it maps, to notice it shrinking
//! ([`super::mapped_files`]). Linux counts every watch against the VMM
//! user's `fs.inotify.max_user_watches`, which that user's other processes
//! on the host (other VMMs, container runtimes, desktop and system
//! services) share; a guest that maps many files must not use it up. So the
//! windows draw their watches from one budget of their own, a fraction of
//! that limit read when the first window is made; a file past it is
//! checked for shrinking once a second instead (its size is read outside
//! the window's lock, so that costs a `fstat` per such file per second).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The share of `fs.inotify.max_user_watches` the VMM's DAX windows may use
/// together: an eighth, at most [`MAX_WATCHES`]. An eighth because the
/// limit is per user and shared (8192 on older kernels gives 1024, leaving
/// seven eighths to everything else); at most 4096 because each watch also
/// pins its file's inode in the host's cache and costs kernel memory, and
/// past a few thousand files the once-a-second check does the same job.
pub fn watch_share(max_user_watches: usize) -> usize {
    (max_user_watches / 8).min(MAX_WATCHES)
}

/// Ceiling of the process-wide budget, whatever the host allows.
pub const MAX_WATCHES: usize = 4096;

#[derive(Debug)]
pub struct WatchBudget {
    limit: usize,
    used: AtomicUsize,
}

impl WatchBudget {
    /// A budget of `limit` watches.
    pub fn new(limit: usize) -> Self {
        WatchBudget {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// The budget of this process: [`watch_share`] of
    /// `fs.inotify.max_user_watches`, read once.
    pub fn process() -> Arc<WatchBudget> {
        static BUDGET: OnceLock<Arc<WatchBudget>> = OnceLock::new();
        BUDGET
            .get_or_init(|| {
                let max = read_max_user_watches();
                let limit = watch_share(max);
                tracing::debug!(
                    "DAX windows may use {limit} of fs.inotify.max_user_watches={max} watches"
                );
                Arc::new(WatchBudget::new(limit))
            })
            .clone()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Takes one watch; false (and nothing taken) when none is left.
    pub fn take(&self) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(1).filter(|&u| u <= self.limit)
            })
            .is_ok()
    }

    /// Gives back one watch taken with [`Self::take`].
    pub fn give_back(&self) {
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_sub(1)
            });
    }
}

/// `fs.inotify.max_user_watches`, or the old kernels' default (the
/// smallest in use) where it cannot be read.
fn read_max_user_watches() -> usize {
    const OLD_DEFAULT: usize = 8192;
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(OLD_DEFAULT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_taken_within_the_limit_and_given_back() {
        let b = WatchBudget::new(2);
        assert!(b.take() && b.take());
        assert!(!b.take(), "the third is refused");
        assert_eq!(b.used(), 2);
        b.give_back();
        assert!(b.take());
        b.give_back();
        b.give_back();
        b.give_back();
        assert_eq!(b.used(), 0, "never below zero");
    }

    #[test]
    fn the_process_budget_is_a_small_share_of_the_host_limit() {
        assert_eq!(watch_share(8192), 1024);
        assert_eq!(watch_share(65536), MAX_WATCHES);
        assert_eq!(watch_share(1 << 20), MAX_WATCHES);
        let max = read_max_user_watches();
        assert_eq!(WatchBudget::process().limit(), watch_share(max));
        assert!(WatchBudget::process().limit() <= max / 8);
    }
}
