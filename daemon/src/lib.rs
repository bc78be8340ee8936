//! dax-virtiofsd: a vhost-user virtio-fs backend that serves one host
//! directory and maps files into the guest's DAX window.
//!
//! A FUSE_SETUPMAPPING travels: [`backend`] (queue kick) →
//! [`fuse::server::Server::handle`] (`fuse/handlers.rs`: parse, dispatch,
//! reply) → [`dax::mapper`] (open the file, SHMEM_MAP with its fd) → the
//! VMM's `virtio_devices::vhost_user_fs::window`.
//! Which files get DAX at all: [`policy`] (the operator's rules), refined
//! at run time by [`dax::adaptive`] (what the window's use shows).

pub mod backend;
pub mod caps;
pub mod cli;
pub mod control;
pub mod dax;
pub mod fuse;
pub mod host_fs;
pub mod inflight;
pub mod limits;
pub mod listen;
pub mod migration;
pub mod passthrough;
pub mod policy;
pub mod sandbox;
pub mod seccomp_filter;
pub mod syslog;
pub mod vring;
pub mod workers;

/// Rate-limited logging of what a guest can repeat (the shared `log-limit`
/// crate), reachable as `crate::warn_limited!` and `crate::log_limit`.
pub use log_limit::{self, error_limited, info_limited, log_limited, warn_limited};

/// Our crates, whose events the daemon's log shows; dependencies are heard
/// only through `log` (`log_limit::stderr`).
pub const OWN_CRATES: &[&str] = &[
    "daemon",
    "dax_virtiofsd",
    "policies",
    "control_protocol",
    "dax_abi",
    "seccomp",
    "log_limit",
];

/// Guest memory as the daemon maps it from the VMM's memory table. Each
/// region carries the vhost-user dirty log's bitmap: empty (one check per
/// write) until the VMM sends SET_LOG_BASE for a migration, then every
/// write made through vm-memory (replies, the used ring) sets the bit of
/// the guest page it touched. Writes that bypass vm-memory (`preadv` into
/// a READ's buffers) mark theirs with [`fuse::chain::Writer::mark_written`].
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vhost_user_backend::bitmap::BitmapMmapRegion>;

/// Test builds only: the largest heap allocation since [`alloc_probe::reset`],
/// so a test can show that a guest-given size never becomes an allocation.
#[cfg(test)]
pub mod alloc_probe {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static LARGEST: AtomicUsize = AtomicUsize::new(0);

    pub struct Probe;

    // SAFETY: forwards every call to the system allocator unchanged; only
    // records the size asked for.
    unsafe impl GlobalAlloc for Probe {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
            // SAFETY: the caller's contract is passed on as is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static PROBE: Probe = Probe;

    pub fn reset() {
        LARGEST.store(0, Ordering::Relaxed);
    }

    pub fn largest() -> usize {
        LARGEST.load(Ordering::Relaxed)
    }
}
