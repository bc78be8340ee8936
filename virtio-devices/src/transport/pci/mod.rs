pub mod configuration;
pub mod msix;
