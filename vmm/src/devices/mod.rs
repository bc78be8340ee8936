//! Legacy platform devices and the buses vCPU exits are dispatched on.

pub mod acpi_pm;
pub mod activator;
pub mod bus;
pub mod cpu_hotplug;
pub mod device_memory;
pub mod ged;
pub mod gsi_routing;
pub mod i8042;
pub mod memory_hotplug;
pub mod pci_hotplug;
pub mod pci_root;
pub mod pci_segment;
pub mod pvpanic;
pub mod serial;
pub mod virtio_mmio;
pub mod virtio_pci;

pub use bus::{Bus, BusDevice};
