//! The DAX window from the daemon's side: [`mapper`] turns the guest's
//! FUSE_SETUPMAPPING/REMOVEMAPPING into the VMM's SHMEM_MAP/SHMEM_UNMAP;
//! [`adaptive`] watches how the window is used and refines, per file, the
//! policy's default answer.

pub mod adaptive;
pub mod mapper;

pub use mapper::{DaxMapper, DaxStats, MAX_REMOVEMAPPING_ENTRIES};
