//! A KVM virtual machine monitor for x86-64 that boots a stock Linux bzImage.
//!
//! One folder per owner: [`vcpu`] (the vCPUs and everything that changes
//! their number), [`memory`] (guest RAM and everything that changes it),
//! [`device_manager`] (the virtio devices, their transports, address space
//! and PCI hot-plug), [`legacy`] (the fixed platform devices), with the
//! [`bus`] every vCPU exit is dispatched on between them, [`vm`] putting
//! them together and [`snapshot`] saving and restoring them all.

pub mod arch;
pub mod bus;
pub mod config;
pub mod control_loop;
pub mod device_manager;
pub mod exit;
pub mod kvm_stats;
pub mod legacy;
pub mod memory;
pub mod migration;
pub mod resize;
pub mod seccomp_filters;
pub mod signals;
pub mod snapshot;
pub mod step_times;
pub mod vcpu;
pub mod vm;
pub mod vm_state;
