pub mod configuration;
pub mod msix;
pub mod device;
