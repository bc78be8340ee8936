//! Builds a VM from its configuration, runs it and waits for it to end.
//! A boot and a restore (`crate::snapshot`) build it the same way
//! (`build::Platform::build`, then `Vm::start`); they differ only in
//! what fills guest RAM and the vCPUs.

pub(crate) mod build;

use std::os::fd::AsRawFd;
use std::sync::Arc;

#[cfg(test)]
use kvm_ioctls::Kvm;
use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::boot;
use crate::bus::Bus;
use crate::config::{
    DiskConfig, FsConfig, NetConfig, PmemConfig, SerialMode, VmConfig, VsockConfig,
};
use crate::device_manager::{
    DeviceManager, DeviceManagerError, FsDeviceInfo, ObserverFactory, PciDeviceInfo,
};
use crate::exit::{ExitHandle, VmExit};
use crate::kvm_stats::VmKvmStats;
use crate::legacy::{ged, serial};
use crate::memory::hotplug::{RamHotplug, RamHotplugError};
use crate::memory::{self, GuestMemoryMmap, GuestRegionMmap};
use crate::signals::StopSignals;
use crate::vcpu::hotplug::{VcpuHotplug, VcpuHotplugError, VcpuWiring};
use crate::vcpu::state::StateCaps;
use crate::vcpu::{RunningVcpus, Vcpu};
use api::KvmCounters;
#[cfg(test)]
use build::serial_output;
#[cfg(test)]
use build::{add_memory_hotplug, add_platform_devices, create_vm};
use build::{load_payload, open_kvm_stats, RawTerminal, SharedSerial};
pub(crate) use build::{Platform, VmBase};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot use /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    #[error("{what}: {source}")]
    KvmSetup {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Acpi(#[from] crate::arch::x86_64::acpi::AcpiError),
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::VcpuError),
    #[error("--serial file={path}: {source}")]
    SerialFile {
        path: String,
        source: std::io::Error,
    },
    /// A platform device (serial port, i8042, ACPI PM, pvpanic, GED, the
    /// memory hot-plug controller) found its I/O ports taken.
    #[error("device setup: {device}: {source}")]
    PlatformPorts {
        device: &'static str,
        source: crate::bus::BusError,
    },
    #[error("device setup: writing the reset stub: {0}")]
    ResetStub(#[source] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Device(#[from] DeviceManagerError),
    #[error(transparent)]
    VcpuHotplug(#[from] crate::vcpu::hotplug::VcpuHotplugError),
    #[error("cpus.max_vcpus={max} is above what this host's KVM allows ({limit} vCPUs per VM)")]
    TooManyVcpus { max: u32, limit: u32 },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn kvm_setup<T>(what: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, VmError> {
    r.map_err(|source| VmError::KvmSetup { what, source })
}

/// A booted VM: its vCPU threads run until it ends or [`Vm::stop`] is called.
/// Dropping it tears down its devices (fs daemons see their socket close).
///
/// The fields are the crate's: a snapshot (`crate::snapshot`) reads and
/// restores every part.
pub struct Vm {
    pub(crate) exit: Arc<ExitHandle>,
    pub(crate) vcpus: RunningVcpus,
    pub(crate) devices: DeviceManager,
    /// The guest's clock when it was paused, given back at resume so the
    /// guest does not see the time it spent paused.
    pub(crate) paused_clock: Option<kvm_bindings::kvm_clock_data>,
    // Kept for the life of the VM: the buses (which own the devices), the
    // terminal mode.
    pub(crate) buses: (Arc<Bus>, Arc<Bus>),
    _raw_terminal: Option<RawTerminal>,
    /// The VMM's stdin feeds this VM's serial port until the VM goes.
    stdin: Option<(Arc<serial::InputRouter>, SharedSerial)>,
    /// The COM1 UART (None with `--serial off`).
    pub(crate) serial: Option<SharedSerial>,
    /// Boot RAM: KVM translates guest addresses into this mapping.
    pub(crate) mem: GuestMemoryMmap,
    /// RAM added by `vm.resize` (its KVM slots are the device manager's).
    pub(crate) hotplugged_ram: Vec<Arc<GuestRegionMmap>>,
    /// The KVM VM: its clock is saved and restored across a pause.
    pub(crate) vm: Arc<VmFd>,
    /// The ACPI Generic Event Device, for `vm.power-button`.
    pub(crate) ged: ged::GedHandle,
    /// KVM's counters for this VM and its vCPUs (None where the host's KVM
    /// has no binary statistics).
    kvm_stats: Option<VmKvmStats>,
    /// RAM added by `vm.resize`, and what may still be.
    pub(crate) ram: RamHotplug,
    /// `vm.resize` of the vCPUs.
    pub(crate) vcpu_hotplug: VcpuHotplug,
    /// What this host's KVM offers for saving a vCPU (None: no snapshot).
    pub(crate) caps: Option<Arc<StateCaps>>,
    /// The devices were paused for a snapshot: resumed with the vCPUs.
    pub(crate) devices_paused: bool,
}

/// A vCPU to start, and whether it stays parked as ejected by the guest.
pub(crate) struct VcpuToStart {
    pub vcpu: Vcpu,
    pub ejected: bool,
}

impl Vm {
    /// Builds the VM from `config` and starts its vCPUs. `observe`, when
    /// given, makes the observer of each fs device's DAX window from its id.
    pub fn boot(config: &VmConfig, observe: Option<&ObserverFactory>) -> Result<Vm, VmError> {
        Vm::boot_with(config, observe, |platform| {
            load_payload(&platform.mem, config, &platform.device_aml).map(|entry| entry.0)
        })
    }

    /// [`Vm::boot`] with `load` putting the payload in guest RAM and
    /// giving the boot vCPU's 64-bit entry point (tests load a small
    /// program instead of a kernel).
    pub(crate) fn boot_with(
        config: &VmConfig,
        observe: Option<&ObserverFactory>,
        load: impl FnOnce(&Platform) -> Result<u64, VmError>,
    ) -> Result<Vm, VmError> {
        let mem = memory::create_guest_memory(&config.memory)?;
        let platform =
            Platform::build(config, VmBase::new(config, mem)?, Vec::new(), observe, None)?;
        let entry = load(&platform)?;
        let setup = platform.vcpu_setup(config, entry);
        let boot_vcpus = config.cpus.boot_vcpus;
        let vcpus = (0..boot_vcpus)
            .map(|i| {
                Vcpu::new(&platform.vm, i, &setup).map(|vcpu| VcpuToStart {
                    vcpu,
                    ejected: false,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        tracing::info!(
            "booting {boot_vcpus} vCPU(s) (at most {}), {} MiB RAM",
            config.cpus.max_vcpus,
            config.memory.size >> 20
        );
        Vm::start(platform, config, vcpus, None)
    }

    /// The last step of a boot and of a restore: the vCPUs' threads start
    /// on `platform`, running, or parked when `paused_clock` is given (a
    /// restore: the VM comes back paused, and the clock it was saved with
    /// is set again at resume).
    pub(crate) fn start(
        platform: Platform,
        config: &VmConfig,
        vcpus: Vec<VcpuToStart>,
        paused_clock: Option<kvm_bindings::kvm_clock_data>,
    ) -> Result<Vm, VmError> {
        let Platform {
            vm,
            mem,
            hotplugged_ram,
            exit,
            pio,
            mmio,
            serial,
            ged,
            ram,
            mut devices,
            cpu_hotplug,
            device_aml: _,
            base_cpuid,
            prefaulter,
            tsc_deadline,
            caps,
        } = platform;
        let fds: Vec<&Vcpu> = vcpus.iter().map(|v| &v.vcpu).collect();
        let kvm_stats = open_kvm_stats(&vm, &fds);
        if let Some(p) = prefaulter {
            devices.set_guest_prefaulter(p);
        }
        let vcpu_hotplug = VcpuHotplug::new(cpu_hotplug, &config.cpus, &base_cpuid, tsc_deadline);

        let (raw_terminal, stdin) = match (&config.serial, &serial) {
            (SerialMode::Tty, Some(s)) => {
                let raw = RawTerminal::enable();
                (raw, Some((serial::connect_stdin(s.clone())?, s.clone())))
            }
            _ => (None, None),
        };
        let mut running = RunningVcpus::default();
        if paused_clock.is_some() {
            // No thread yet: each parks before its first KVM_RUN.
            running.pause();
        }
        for v in vcpus {
            let spawned =
                running.spawn_as(v.vcpu, v.ejected, pio.clone(), mmio.clone(), exit.clone());
            if let Err(e) = spawned {
                running.stop();
                return Err(e.into());
            }
        }
        Ok(Vm {
            exit,
            vcpus: running,
            devices,
            paused_clock,
            buses: (pio, mmio),
            _raw_terminal: raw_terminal,
            stdin,
            serial,
            mem,
            hotplugged_ram,
            vm,
            ged,
            kvm_stats,
            ram,
            vcpu_hotplug,
            caps,
            devices_paused: false,
        })
    }

    /// `vm.resize` of the vCPUs: see [`VcpuHotplug::resize`].
    pub fn resize_vcpus(&mut self, desired: u32) -> Result<bool, VcpuHotplugError> {
        let wiring = VcpuWiring {
            vm: &self.vm,
            mem: &self.mem,
            pio: &self.buses.0,
            mmio: &self.buses.1,
            exit: &self.exit,
        };
        self.vcpu_hotplug
            .resize(desired, &mut self.vcpus, &wiring, &self.ged)
    }

    /// Readable when the guest has ejected a vCPU: then call
    /// [`Vm::complete_vcpu_ejects`].
    pub fn vcpu_eject_eventfd(&self) -> &EventFd {
        self.vcpu_hotplug.eject_eventfd()
    }

    /// Parks the vCPUs the guest ejected; returns their indexes.
    pub fn complete_vcpu_ejects(&self) -> Vec<u32> {
        self.vcpu_hotplug.complete_ejects(&self.vcpus)
    }

    /// KVM's counters that the metrics publish: exits and page faults summed
    /// over the vCPUs, and guest memory mapped by page size.
    pub fn kvm_counters(&self) -> Option<KvmCounters> {
        let s = self.kvm_stats.as_ref()?;
        Some(KvmCounters {
            exits: s.vcpu_sum("exits"),
            halt_exits: s.vcpu_sum("halt_exits"),
            page_faults: s.vcpu_sum("pf_taken"),
            page_faults_fixed: s.vcpu_sum("pf_fixed"),
            pages: ["pages_4k", "pages_2m", "pages_1g"]
                .iter()
                .zip(["4k", "2m", "1g"])
                .filter_map(|(stat, size)| s.vm(stat).map(|n| (size, n)))
                .collect(),
        })
    }

    /// Readable once the VM has ended on its own (see [`Vm::exit_reason`]).
    pub fn exit_eventfd(&self) -> &EventFd {
        self.exit.eventfd()
    }

    pub fn exit_reason(&self) -> Option<VmExit> {
        self.exit.reason()
    }

    pub fn fs_devices(&self) -> &[FsDeviceInfo] {
        self.devices.fs_devices()
    }

    /// Where each virtio-PCI device is, by id.
    pub fn pci_addresses(&self) -> Vec<(String, crate::device_manager::virtio_pci::PciAddress)> {
        self.devices.pci_addresses()
    }

    /// The counters of every device that keeps them (disks, NICs), by id.
    pub fn device_counters(&self) -> &[(String, Arc<virtio_devices::DeviceCounters>)] {
        self.devices.device_counters()
    }

    /// Hot-plugs an fs device (and its DAX window) over virtio-PCI.
    pub fn add_fs(
        &mut self,
        fs: &FsConfig,
        observe: Option<&ObserverFactory>,
    ) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.devices.hotplug_fs(fs, observe)
    }

    /// Hot-plugs a pmem device over virtio-PCI.
    pub fn add_pmem(&mut self, pmem: &PmemConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.devices.hotplug_pmem(pmem)
    }

    /// Hot-plugs a disk over virtio-PCI.
    pub fn add_disk(&mut self, disk: &DiskConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.devices.hotplug_disk(disk)
    }

    /// Hot-plugs the vsock device over virtio-PCI.
    pub fn add_vsock(&mut self, vsock: &VsockConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.devices.hotplug_vsock(vsock)
    }

    /// Hot-plugs a net device over virtio-PCI.
    pub fn add_net(&mut self, net: &NetConfig) -> Result<PciDeviceInfo, DeviceManagerError> {
        self.devices.hotplug_net(net)
    }

    /// Asks the guest to eject device `id`; see [`Vm::complete_ejects`].
    pub fn remove_device(&self, id: &str) -> Result<(), DeviceManagerError> {
        self.devices.request_removal(id)
    }

    /// Readable when the guest has ejected a device: then call
    /// [`Vm::complete_ejects`].
    pub fn eject_eventfd(&self) -> &EventFd {
        self.devices.eject_requests().eventfd()
    }

    /// Removes what the guest ejected; returns the ids.
    pub fn complete_ejects(&mut self) -> Vec<String> {
        self.devices.complete_ejects()
    }

    /// `vm.resize`'s `desired_ram`: grows guest RAM to `desired` bytes by
    /// adding a region and announcing it (ACPI memory hot-plug); a size at
    /// or below the current one changes nothing. Returns guest RAM after.
    pub fn resize_memory(&mut self, desired: u64) -> Result<u64, RamHotplugError> {
        let Some((base, size)) = self.ram.plan(desired)? else {
            return Ok(self.ram.current());
        };
        let failed = |e: &dyn std::fmt::Display| RamHotplugError::Failed(e.to_string());
        let region = memory::create_hotplug_region(self.ram.boot_config(), base, size)
            .map_err(|e| failed(&e))?;
        self.devices
            .add_ram_region(region.clone())
            .map_err(|e| failed(&e))?;
        self.ram.commit(base, size)?;
        self.hotplugged_ram.push(region);
        self.ged
            .raise(ged::EVENT_MEMORY_HOTPLUG)
            .map_err(|e| failed(&format!("interrupting the guest: {e}")))?;
        Ok(self.ram.current())
    }

    /// Presses the ACPI power button: a guest that handles it shuts down,
    /// and the VMM exits as for any poweroff.
    pub fn power_button(&self) -> std::io::Result<()> {
        self.ged.raise(ged::EVENT_POWER_BUTTON)
    }

    /// Parks every vCPU (devices and daemons keep their state) and keeps
    /// the guest's clock where it is.
    pub fn pause(&mut self) {
        self.vcpus.pause();
        if self.paused_clock.is_some() {
            // Paused already (or restored, with the clock it was saved
            // with): the guest's time stopped then, not now.
            return;
        }
        match self.vm.get_clock() {
            Ok(clock) => self.paused_clock = Some(clock),
            Err(e) => {
                tracing::warn!("KVM_GET_CLOCK: {e}; the guest will see the time it spent paused")
            }
        }
    }

    pub fn resume(&mut self) {
        if let Some(mut clock) = self.paused_clock.take() {
            // Without KVM_CLOCK_REALTIME, KVM sets the clock to exactly this
            // value instead of advancing it by the time since.
            clock.flags = 0;
            if let Err(e) = self.vm.set_clock(&clock) {
                tracing::warn!("KVM_SET_CLOCK: {e}; the guest will see the time it spent paused");
            }
        }
        if std::mem::take(&mut self.devices_paused) {
            if let Err(e) = self.devices.resume_devices() {
                tracing::error!("resuming the devices after a snapshot: {e}");
            }
        }
        self.vcpus.resume();
    }

    /// Stops every vCPU and tears the VM down.
    pub fn stop(mut self) {
        self.vcpus.stop();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.vcpus.stop();
        // What the whole run cost in KVM terms, for benchmarks run without
        // the API (with it, vm.dax-metrics has these live).
        if let Some(k) = self.kvm_counters() {
            let pages: Vec<String> = k.pages.iter().map(|(s, n)| format!("{s}={n}")).collect();
            tracing::info!(
                "KVM counters at the end: exits={} halt_exits={} page_faults={} page_faults_fixed={} mapped pages {}",
                k.exits,
                k.halt_exits,
                k.page_faults,
                k.page_faults_fixed,
                pages.join(" ")
            );
        }
        if let Some((router, port)) = self.stdin.take() {
            router.disconnect(&port);
        }
    }
}

/// Boots the VM and blocks until it ends; the returned reason decides the exit status.
pub fn run(config: &VmConfig, signals: &StopSignals) -> Result<VmExit, VmError> {
    let mut vm = Vm::boot(config, None)?;
    loop {
        let fds = [
            vm.exit_eventfd().as_raw_fd(),
            vm.eject_eventfd().as_raw_fd(),
        ];
        if let Some(sig) = signals.wait(&fds)? {
            return Ok(VmExit::Signal(sig));
        }
        // The guest may eject a device by itself (PCI slot power off).
        vm.complete_ejects();
        if let Some(reason) = vm.exit_reason() {
            return Ok(reason);
        }
    }
}

#[cfg(test)]
#[path = "vm_tests.rs"]
pub(crate) mod tests;
