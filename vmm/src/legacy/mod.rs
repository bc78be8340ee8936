//! The fixed platform devices every VM has, each at a fixed I/O port and
//! made once at boot: the PC's legacy devices (the COM1 UART, the i8042's
//! reset line), the hardware-reduced ACPI ones (the PM registers, pvpanic)
//! and the Generic Event Device, the one interrupt through which the vCPU,
//! memory and PCI hot-plug controllers reach the guest.

pub mod acpi_pm;
pub mod ged;
pub mod i8042;
pub mod pvpanic;
pub mod serial;
pub mod state;
