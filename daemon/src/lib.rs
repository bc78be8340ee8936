//! dax-virtiofsd: a vhost-user virtio-fs backend that serves one host
//! directory and maps files into the guest's DAX window.
//!
//! A FUSE_SETUPMAPPING travels: [`backend`] (queue kick) →
//! [`fuse::server`] (parse, dispatch) → [`dax`] (open the file, SHMEM_MAP
//! with its fd) → the VMM's `virtio_devices::vhost_user_fs::window`.

pub mod backend;
pub mod control;
pub mod dax;
pub mod fuse;
pub mod passthrough;
pub mod policy;
pub mod sandbox;
pub mod workers;

/// Guest memory as the daemon maps it from the VMM's memory table.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;
