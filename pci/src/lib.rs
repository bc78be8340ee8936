//! PCI as a device sees it, independent of what the device is: a type-0
//! configuration space (header, BARs and their sizing protocol,
//! capabilities) and MSI-X (table, PBA, masking). The VMM's host bridge
//! and the virtio-PCI transport are both built on it.

pub mod configuration;
pub mod msix;
pub mod state;
