//! The virtio-PCI transport, on the `pci` crate's configuration space and MSI-X.

pub mod device;
pub mod state;
