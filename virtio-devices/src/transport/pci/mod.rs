pub mod configuration;
pub mod device;
pub mod msix;
