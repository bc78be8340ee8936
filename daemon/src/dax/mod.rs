//! The DAX window from the daemon's side: [`mapper`] turns the guest's
//! FUSE_SETUPMAPPING/REMOVEMAPPING into the VMM's SHMEM_MAP/SHMEM_UNMAP
//! and reports what the VMM did ([`WindowUse`]) to [`adaptive`], which
//! watches how the window is used and refines, per file, the policy's
//! default answer. [`window_map`] records what was mapped where,
//! so [`window_io`] can serve READ and WRITE whose buffers lie in the window.

pub mod adaptive;
pub mod kept_fds;
pub mod mapper;
pub mod window_io;
pub mod window_map;

pub use mapper::{DaxMapper, DaxStats, MapStage, WindowUse, MAX_REMOVEMAPPING_ENTRIES};
