//! Caps on what a guest can make the daemon hold: inodes (each an open
//! `O_PATH` fd), open handles, extended attribute sizes and the worker
//! queue. Past a cap the request fails with an errno, a warning is logged
//! at most once per interval (with how many were suppressed), and a counter
//! goes up; the daemon keeps serving everything else.
//!
//! The fd caps sit below `RLIMIT_NOFILE` with room to spare, so a guest that
//! holds every inode it may still leaves the daemon fds to accept the VMM,
//! pass a file to SHMEM_MAP and answer the control socket (the
//! CVE-2020-10717 class: a guest exhausting the daemon's fds).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::log_limit::{RateLimitedLog, PERIOD};

/// Linux's own cap on one extended attribute value (`XATTR_SIZE_MAX`).
pub const XATTR_SIZE_MAX: u32 = 64 * 1024;
/// Linux's own cap on a list of attribute names (`XATTR_LIST_MAX`).
pub const XATTR_LIST_MAX: u32 = 64 * 1024;
/// Fds the daemon keeps for itself beyond the guest's inodes and handles.
pub const RESERVED_FDS: u64 = 1024;

/// The configured caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Inodes the guest may hold at once (root included).
    pub max_inodes: u64,
    /// Open file and directory handles at once, and the descriptors
    /// window-buffer I/O holds while its requests are served.
    pub max_handles: u64,
    /// Largest extended attribute value served or stored.
    pub max_xattr_size: u32,
    /// Requests waiting for a worker (`--thread-pool-size`) at once.
    pub worker_queue_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_inodes: 1 << 20,
            max_handles: 1 << 16,
            max_xattr_size: XATTR_SIZE_MAX,
            worker_queue_depth: 1024,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error(
        "--max-inodes {inodes} + --max-handles {handles} + {RESERVED_FDS} reserved fds exceed the open-file limit {nofile} \
         (lower them, or raise --rlimit-nofile)"
    )]
    Fds {
        inodes: u64,
        handles: u64,
        nofile: u64,
    },
    #[error("--{field} must be at least {min}, got {value}")]
    TooSmall {
        field: &'static str,
        min: u64,
        value: u64,
    },
    #[error("--max-xattr-size must be at most {XATTR_SIZE_MAX} (Linux's XATTR_SIZE_MAX), got {0}")]
    XattrSize(u32),
}

impl Limits {
    /// Caps for an open-file limit of `nofile`: the explicit values where
    /// given (checked against it), else defaults shrunk to fit.
    pub fn for_nofile(
        nofile: u64,
        inodes: Option<u64>,
        handles: Option<u64>,
        xattr: Option<u32>,
        depth: Option<usize>,
    ) -> Result<Limits, LimitsError> {
        let d = Limits::default();
        let budget = nofile.saturating_sub(RESERVED_FDS);
        let max_handles = handles.unwrap_or(d.max_handles.min(budget / 4));
        let max_inodes = inodes.unwrap_or(d.max_inodes.min(budget.saturating_sub(max_handles)));
        for (field, min, value) in [
            ("max-inodes", 2, max_inodes),
            ("max-handles", 1, max_handles),
        ] {
            if value < min {
                return Err(LimitsError::TooSmall { field, min, value });
            }
        }
        if max_inodes
            .saturating_add(max_handles)
            .saturating_add(RESERVED_FDS)
            > nofile
        {
            return Err(LimitsError::Fds {
                inodes: max_inodes,
                handles: max_handles,
                nofile,
            });
        }
        let max_xattr_size = xattr.unwrap_or(d.max_xattr_size);
        if max_xattr_size > XATTR_SIZE_MAX {
            return Err(LimitsError::XattrSize(max_xattr_size));
        }
        let worker_queue_depth = depth.unwrap_or(d.worker_queue_depth);
        if worker_queue_depth == 0 {
            return Err(LimitsError::TooSmall {
                field: "worker-queue-depth",
                min: 1,
                value: 0,
            });
        }
        Ok(Limits {
            max_inodes,
            max_handles,
            max_xattr_size,
            worker_queue_depth,
        })
    }
}

/// Which cap a request hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cap {
    Inodes,
    Handles,
    XattrSize,
    WorkerQueue,
    /// Window stretches of one READ or WRITE
    /// ([`crate::dax::window_io::MAX_WINDOW_PIECES`]).
    WindowPieces,
}

impl Cap {
    pub const ALL: [Cap; 5] = [
        Cap::Inodes,
        Cap::Handles,
        Cap::XattrSize,
        Cap::WorkerQueue,
        Cap::WindowPieces,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Cap::Inodes => "inodes",
            Cap::Handles => "handles",
            Cap::XattrSize => "xattr_size",
            Cap::WorkerQueue => "worker_queue",
            Cap::WindowPieces => "window_pieces",
        }
    }
}

/// Counts requests refused by each cap and rate-limits the warnings, one
/// limiter per cap (a flood of one cap's refusals does not hide another's).
pub struct CapCounters {
    hits: [AtomicU64; Cap::ALL.len()],
    log: [RateLimitedLog; Cap::ALL.len()],
}

impl Default for CapCounters {
    fn default() -> Self {
        CapCounters {
            hits: Default::default(),
            log: std::array::from_fn(|_| RateLimitedLog::new(PERIOD)),
        }
    }
}

impl CapCounters {
    /// Records one refusal by `cap` (whose value is `limit`).
    pub fn hit(&self, cap: Cap, limit: u64) {
        self.hits[cap as usize].fetch_add(1, Relaxed);
        if let Some(suppressed) = self.log[cap as usize].admit() {
            tracing::warn!(
                "guest request refused: the {} cap ({limit}) is reached{}",
                cap.name(),
                if suppressed > 0 {
                    format!(" ({suppressed} similar warnings suppressed)")
                } else {
                    String::new()
                }
            );
        }
    }

    pub fn get(&self, cap: Cap) -> u64 {
        self.hits[cap as usize].load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_shrink_to_fit_the_open_file_limit() {
        let l = Limits::for_nofile(1 << 20, None, None, None, None).unwrap();
        assert_eq!(l.max_handles, 1 << 16);
        assert!(l.max_inodes + l.max_handles + RESERVED_FDS <= 1 << 20);
        let l = Limits::for_nofile(5120, None, None, None, None).unwrap();
        assert_eq!((l.max_handles, l.max_inodes), (1024, 3072));
    }

    #[test]
    fn explicit_caps_are_checked_by_name() {
        let e = Limits::for_nofile(4096, Some(4000), Some(10), None, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--max-inodes 4000 + --max-handles 10 + 1024 reserved fds exceed the open-file limit 4096 \
             (lower them, or raise --rlimit-nofile)"
        );
        let e = Limits::for_nofile(1 << 20, Some(1), None, None, None).unwrap_err();
        assert_eq!(e.to_string(), "--max-inodes must be at least 2, got 1");
        let e = Limits::for_nofile(1 << 20, None, None, Some(70000), None).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--max-xattr-size must be at most 65536"),
            "{e}"
        );
        let e = Limits::for_nofile(1 << 20, None, None, None, Some(0)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--worker-queue-depth must be at least 1, got 0"
        );
    }

    #[test]
    fn warnings_are_rate_limited_and_count_what_they_held_back() {
        let log = RateLimitedLog::new(std::time::Duration::from_secs(3600));
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), None, "held back");
        assert_eq!(log.admit(), None, "held back");
        assert_eq!(log.suppressed(), 2);
        let counters = CapCounters::default();
        counters.hit(Cap::Handles, 5);
        counters.hit(Cap::Handles, 5);
        assert_eq!(counters.get(Cap::Handles), 2);
        assert_eq!(counters.get(Cap::Inodes), 0);
    }

    /// Each cap warns on its own: handles refused in a flood do not keep
    /// the first inodes refusal out of the log.
    #[test]
    fn each_cap_has_its_own_warning_limit() {
        crate::log_limit::capture::start();
        let counters = CapCounters::default();
        for _ in 0..100 {
            counters.hit(Cap::Handles, 5);
        }
        counters.hit(Cap::Inodes, 7);
        counters.hit(Cap::Inodes, 7);
        assert_eq!(
            crate::log_limit::capture::take(),
            [
                (
                    tracing::Level::WARN,
                    "guest request refused: the handles cap (5) is reached".to_string()
                ),
                (
                    tracing::Level::WARN,
                    "guest request refused: the inodes cap (7) is reached".to_string()
                ),
            ]
        );
    }
}
