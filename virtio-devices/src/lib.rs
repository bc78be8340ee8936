//! Virtio devices and the transports that carry them.
//!
//! A device implements [`VirtioDevice`]: its type, features, config space,
//! queues and the shared memory regions it owns. A transport
//! ([`transport::mmio::MmioTransport`]) presents any device to the guest
//! without the device knowing which transport carries it.

pub mod block;
pub mod counters;
pub mod dependency_log;
pub mod device;
pub mod device_state;
pub mod event_loop;
pub mod file_type;
pub mod net;
pub mod pmem;
pub mod queue_worker;
pub mod rng;
pub mod transport;
pub mod vhost_user_fs;
pub mod vsock;

#[cfg(test)]
mod test_util;

pub use counters::DeviceCounters;
pub use device::{ActivateError, Interrupt, SharedMemoryRegion, VirtioDevice, VirtioInterrupt};
pub use device_state::{DeviceStateError, SavedQueue};
/// Rate-limited logging of what a guest can repeat (the shared `log-limit`
/// crate), reachable as `virtio_devices::warn_limited!` and
/// `virtio_devices::log_limit`.
pub use log_limit::{self, error_limited, info_limited, log_limited, warn_limited};

/// The seccomp thread kind of device worker threads (see the VMM's
/// `seccomp_filters`).
pub const DEVICE_WORKER_THREAD: &str = "device-worker";

/// The seccomp thread kind of a virtio-blk device's I/O threads (see
/// `block::io`): positioned reads and writes, flushes, fallocate.
pub const BLOCK_IO_THREAD: &str = "block-io";

/// Guest memory as the VMM maps it. Each region carries a dirty-page
/// bitmap that every write through vm-memory marks (the devices emulated
/// in the VMM write guest RAM without KVM seeing it): a live migration's
/// pre-copy reads it back beside KVM's dirty log. About one atomic OR per
/// page written; 32 KiB of bitmap per GiB of RAM.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;
/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<vm_memory::bitmap::AtomicBitmap>;
