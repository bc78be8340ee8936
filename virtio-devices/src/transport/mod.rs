pub mod common;
pub mod mmio;
pub mod pci;
pub mod state;
