pub mod mmio;
pub mod pci;
