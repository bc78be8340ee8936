//! x86-64: guest-physical layout, boot protocol, vCPU state, CPUID and ACPI.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod hotplug_aml;
pub mod layout;
pub mod regs;
