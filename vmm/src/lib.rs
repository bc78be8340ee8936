//! A KVM virtual machine monitor for x86-64 that boots a stock Linux bzImage.

pub mod arch;
pub mod config;
pub mod control_loop;
pub mod device_manager;
pub mod devices;
pub mod exit;
pub mod kvm_stats;
pub mod memory;
pub mod prefault;
pub mod ram_hotplug;
pub mod resize;
pub mod seccomp_filters;
pub mod signals;
pub mod vcpu;
pub mod vcpu_hotplug;
pub mod vm;
