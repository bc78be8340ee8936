//! The steps every VM is built with, whether it boots or is restored
//! ([`Platform::build`]: the KVM VM, guest RAM given to KVM, the platform
//! devices on the I/O bus, the hot-plug controllers, the devices), and the
//! boot's own step, the payload. What differs between a boot and a restore
//! is only what fills guest RAM and the vCPUs: the kernel and boot
//! registers, or the saved memory and states.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pit_config, CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use virtio_devices::vhost_user_fs::window::GuestPrefaulter;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::terminal::Terminal;

use super::{kvm_setup, VmError};
use crate::arch::x86_64::{acpi::AcpiTables, boot, layout};
use crate::bus::Bus;
use crate::config::{SerialMode, VmConfig};
use crate::device_manager::{DeviceManager, ObserverFactory, WindowFiles};
use crate::exit::ExitHandle;
use crate::kvm_stats::{KvmStatsFile, VmKvmStats};
use crate::legacy::{acpi_pm, ged, i8042, pvpanic, serial};
use crate::memory::hotplug::RamHotplug;
use crate::memory::prefault::{for_each_resident_run, KvmPrefaulter};
use crate::memory::{self, GuestMemoryMmap, GuestRegionMmap};
use crate::vcpu::hotplug_controller::CpuHotplugController;
use crate::vcpu::state::StateCaps;
use crate::vcpu::{Vcpu, VcpuSetup};

/// Restores the terminal from raw mode when the VM ends, however it ends.
///
/// Works on a duplicate of fd 0 rather than `std::io::stdin()`: std's stdin
/// lock is held across blocking reads, and the serial input thread blocks in
/// one for the life of the VM.
pub(super) struct RawTerminal(std::fs::File);

impl RawTerminal {
    pub(super) fn enable() -> Option<Self> {
        use std::io::IsTerminal;
        let tty = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned().ok()?);
        if !tty.is_terminal() {
            return None;
        }
        let raw = RawTerminal(tty);
        raw.set_raw_mode().ok()?;
        Some(raw)
    }
}

// SAFETY: the fd is owned by the RawTerminal, open for its whole lifetime,
// and only used for termios calls.
unsafe impl Terminal for RawTerminal {
    fn tty_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        let _ = self.set_canon_mode();
    }
}

pub(super) fn serial_output(mode: &SerialMode) -> Result<Option<Box<dyn Write + Send>>, VmError> {
    Ok(match mode {
        SerialMode::Off => None,
        SerialMode::Null => Some(Box::new(std::io::sink())),
        SerialMode::Tty => Some(Box::new(std::io::stdout())),
        SerialMode::File(path) => Some(Box::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| VmError::SerialFile {
                    path: path.display().to_string(),
                    source,
                })?,
        )),
    })
}

pub(super) type SharedSerial = Arc<Mutex<serial::SerialDevice>>;

/// The legacy devices on the I/O port bus, plus their DSDT descriptions.
pub(super) fn add_platform_devices(
    vm: &VmFd,
    config: &VmConfig,
    pio: &Bus,
    exit: &Arc<ExitHandle>,
) -> Result<(Option<SharedSerial>, ged::GedHandle, Vec<u8>), VmError> {
    let ports = |device: &'static str| move |source| VmError::PlatformPorts { device, source };
    let mut serial_dev = None;
    let mut aml = Vec::new();
    if let Some(out) = serial_output(&config.serial)? {
        let irq = EventFd::new(libc::EFD_NONBLOCK)?;
        kvm_setup(
            "registering the serial irqfd",
            vm.register_irqfd(&irq, serial::COM1_IRQ),
        )?;
        let s = Arc::new(Mutex::new(serial::SerialDevice::new(irq, out)));
        pio.insert(s.clone(), serial::COM1_PORT, serial::PORT_COUNT)
            .map_err(ports("serial port"))?;
        serial_dev = Some(s);
        serial::SerialDevice::append_aml(&mut aml);
    }
    pio.insert(
        Arc::new(Mutex::new(i8042::I8042::new(exit.clone()))),
        i8042::I8042_PORT,
        i8042::PORT_COUNT,
    )
    .map_err(ports("i8042"))?;
    pio.insert(
        Arc::new(Mutex::new(acpi_pm::AcpiPm::new(exit.clone()))),
        u64::from(acpi_pm::SLEEP_CONTROL_PORT),
        acpi_pm::PORT_COUNT,
    )
    .map_err(ports("ACPI PM"))?;
    if config.pvpanic {
        pio.insert(
            Arc::new(Mutex::new(pvpanic::PvPanic::new(exit.clone()))),
            u64::from(pvpanic::PVPANIC_PORT),
            1,
        )
        .map_err(ports("pvpanic"))?;
        pvpanic::PvPanic::append_aml(&mut aml);
    }
    let irq = EventFd::new(libc::EFD_NONBLOCK)?;
    kvm_setup(
        "registering the GED irqfd",
        vm.register_irqfd(&irq, ged::GED_IRQ),
    )?;
    let ged_dev = Arc::new(Mutex::new(ged::Ged::new(irq)));
    pio.insert(ged_dev.clone(), u64::from(ged::GED_PORT), 1)
        .map_err(ports("GED"))?;
    ged::Ged::append_aml(&mut aml);
    Ok((serial_dev, ged::GedHandle(ged_dev), aml))
}

/// The ACPI memory hot-plug controller on the I/O bus (when the
/// configuration has `hotplug_size`) and its DSDT part (always: the GED
/// calls its `MSCN`).
pub(super) fn add_memory_hotplug(
    ram: &RamHotplug,
    pio: &Bus,
    aml: &mut Vec<u8>,
) -> Result<(), VmError> {
    use crate::memory::hotplug_controller::{
        MemoryHotplugController, MEMORY_HOTPLUG_PORT, MEMORY_HOTPLUG_PORT_COUNT,
    };
    let controller = ram.controller();
    if let Some(c) = &controller {
        pio.insert(
            c.clone(),
            u64::from(MEMORY_HOTPLUG_PORT),
            MEMORY_HOTPLUG_PORT_COUNT,
        )
        .map_err(|source| VmError::PlatformPorts {
            device: "memory hot-plug controller",
            source,
        })?;
    }
    MemoryHotplugController::append_aml(controller.is_some(), aml);
    Ok(())
}

pub(super) fn create_vm(kvm: &Kvm) -> Result<VmFd, VmError> {
    for (cap, name) in [
        (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
        (Cap::Irqfd, "KVM_CAP_IRQFD"),
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::Pit2, "KVM_CAP_PIT2"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(VmError::MissingCap(name));
        }
    }
    let vm = kvm.create_vm().map_err(VmError::Kvm)?;
    kvm_setup(
        "KVM_SET_TSS_ADDR",
        vm.set_tss_address(const { narrow::usize_of(layout::KVM_TSS_ADDRESS) }),
    )?;
    kvm_setup("KVM_CREATE_IRQCHIP", vm.create_irq_chip())?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    kvm_setup("KVM_CREATE_PIT2", vm.create_pit2(pit))?;
    Ok(vm)
}

/// Loads kernel, initramfs, command line, ACPI tables and the zero page.
pub(super) fn load_payload(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    device_aml: &[u8],
) -> Result<GuestAddress, VmError> {
    let kernel = boot::load_kernel(mem, &config.payload.kernel)?;
    let initramfs = match &config.payload.initramfs {
        Some(path) => Some(boot::load_initramfs(mem, path, &kernel)?),
        None => None,
    };
    let cmdline_size = boot::load_command_line(mem, &config.payload.cmdline)?;
    mem.write_slice(&layout::RESET_STUB, GuestAddress(layout::RESET_VECTOR))
        .map_err(VmError::ResetStub)?;
    let acpi = AcpiTables::build(&config.cpus, device_aml, config.platform.num_pci_segments)?;
    acpi.write(mem)?;
    let e820 = boot::e820_map(&layout::ram_ranges(config.memory.size));
    boot::write_boot_params(mem, &kernel, cmdline_size, initramfs, &e820, acpi.rsdp_addr)?;
    Ok(kernel.entry)
}

/// KVM's statistics of `vm` and `vcpus`, or None (logged) where the host's
/// KVM cannot give them: the metrics then leave them out.
pub(super) fn open_kvm_stats(vm: &VmFd, vcpus: &[&Vcpu]) -> Option<VmKvmStats> {
    let opened = KvmStatsFile::open(vm).and_then(|vm_stats| {
        let per_vcpu = vcpus
            .iter()
            .map(|v| v.stats())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VmKvmStats::new(vm_stats, per_vcpu))
    });
    opened
        .map_err(|e| tracing::info!("no KVM statistics in the metrics: {e}"))
        .ok()
}

/// Longest [`VmBase::prefault_resident`] goes on: it runs while a
/// migrating guest still runs on the sender, which waits for it.
pub const RESIDENT_PREFAULT_BUDGET: Duration = Duration::from_secs(10);

/// The KVM VM with its boot RAM registered, and the idle vCPU that maps
/// guest memory into the guest's view ([`KvmPrefaulter`]): the part of a
/// VM that needs nothing but its configuration and RAM. An incoming
/// migration makes it as soon as the configuration arrives, while the
/// guest still runs on the sender, and maps the guest's RAM into it
/// there, so that neither is part of the guest's downtime.
pub(crate) struct VmBase {
    kvm: Kvm,
    vm: Arc<VmFd>,
    mem: GuestMemoryMmap,
    base_cpuid: CpuId,
    prefaulter: Option<Arc<KvmPrefaulter>>,
}

impl VmBase {
    pub fn new(config: &VmConfig, mem: GuestMemoryMmap) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = Arc::new(create_vm(&kvm)?);
        memory::register_with_kvm(&vm, &mem)?;
        let base_cpuid = kvm_setup(
            "KVM_GET_SUPPORTED_CPUID",
            kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES),
        )?;
        // KVM_CAP_MAX_VCPUS (kvm-ioctls falls back to KVM_CAP_NR_VCPUS).
        let limit = u32::try_from(kvm.get_max_vcpus()).unwrap_or(u32::MAX);
        if config.cpus.max_vcpus > limit {
            return Err(VmError::TooManyVcpus {
                max: config.cpus.max_vcpus,
                limit,
            });
        }
        // The pre-fault vCPUs take ids above every possible vCPU's APIC id.
        let topology = config.cpus.effective_topology();
        let first_free_id = topology.apic_id(config.cpus.max_vcpus - 1) + 1;
        let prefaulter =
            KvmPrefaulter::new(&kvm, &vm, u64::from(first_free_id), &base_cpuid).map(Arc::new);
        Ok(VmBase {
            kvm,
            vm,
            mem,
            base_cpuid,
            prefaulter,
        })
    }

    #[cfg(test)]
    pub fn has_prefaulter(&self) -> bool {
        self.prefaulter.is_some()
    }

    /// Maps the boot RAM the host holds into the guest's view before any
    /// vCPU runs. A guest that comes from another VMM (a migration, a
    /// restore that read its memory in) touches its working set at once,
    /// and on a fresh VM each 4 KiB of it would cost a nested page fault:
    /// on the emulated host those kept a migrated guest from running for
    /// longer than the whole move took. Best effort, for at most
    /// [`RESIDENT_PREFAULT_BUDGET`]: what is not mapped here is mapped when
    /// the guest touches it, as always. Returns the bytes mapped.
    pub fn prefault_resident(&self) -> u64 {
        let Some(p) = self.prefaulter.as_ref().filter(|p| p.available()) else {
            return 0;
        };
        let started = Instant::now();
        let mut mapped = 0u64;
        for_each_resident_run(&self.mem, |gpa, len| {
            prefault_run(p.as_ref(), gpa, len, started, &mut mapped)
        });
        tracing::info!(
            "pre-faulted {} MiB of guest RAM in {} ms",
            mapped >> 20,
            started.elapsed().as_millis()
        );
        mapped
    }

    /// Maps `ranges` of guest RAM (just written: a pre-copy's pages as
    /// they arrive) into the guest's view, as [`Self::prefault_resident`]
    /// does for all of it, each call within [`RESIDENT_PREFAULT_BUDGET`].
    /// Pages already mapped cost KVM a walk, nothing more. Returns the
    /// bytes mapped.
    pub fn prefault_ranges(&self, ranges: impl Iterator<Item = (u64, u64)>) -> u64 {
        let Some(p) = self.prefaulter.as_ref().filter(|p| p.available()) else {
            return 0;
        };
        let started = Instant::now();
        let mut mapped = 0u64;
        for (gpa, len) in ranges {
            if !prefault_run(p.as_ref(), gpa, len, started, &mut mapped) {
                break;
            }
        }
        mapped
    }
}

/// Pre-faults `[gpa, gpa + len)` through `p`, adding what it mapped to
/// `mapped`; false once the budget from `started` is spent or KVM maps no
/// more (the rest faults in when touched).
fn prefault_run(p: &KvmPrefaulter, gpa: u64, len: u64, started: Instant, mapped: &mut u64) -> bool {
    let end = gpa.saturating_add(len);
    let mut at = gpa;
    while at < end {
        if started.elapsed() > RESIDENT_PREFAULT_BUDGET {
            return false;
        }
        match p.prefault(at, end - at) {
            Ok(n) if n > 0 => {
                at = at.saturating_add(n);
                *mapped = mapped.saturating_add(n);
            }
            Ok(_) => return false,
            Err(e) => {
                tracing::info!(
                    "pre-faulting guest RAM at {at:#x}: {e}; the rest faults in when touched"
                );
                return false;
            }
        }
    }
    true
}

/// A VM built up to its vCPUs: what a boot and a restore share.
pub(crate) struct Platform {
    pub vm: Arc<VmFd>,
    /// Boot RAM, registered with KVM.
    pub mem: GuestMemoryMmap,
    /// RAM added by hot-plug (a restore's), given to KVM and the devices.
    pub hotplugged_ram: Vec<Arc<GuestRegionMmap>>,
    pub exit: Arc<ExitHandle>,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub serial: Option<SharedSerial>,
    pub ged: ged::GedHandle,
    pub ram: RamHotplug,
    pub devices: DeviceManager,
    pub cpu_hotplug: Arc<Mutex<CpuHotplugController>>,
    /// The DSDT's device part, for the boot's ACPI tables.
    pub device_aml: Vec<u8>,
    pub base_cpuid: CpuId,
    /// What maps DAX ranges into the guest's view (None where KVM cannot).
    pub prefaulter: Option<Arc<KvmPrefaulter>>,
    pub tsc_deadline: bool,
    /// What this host's KVM offers for saving a vCPU (None, logged: the
    /// VM runs but cannot be snapshotted).
    pub caps: Option<Arc<StateCaps>>,
}

impl Platform {
    /// Everything but the vCPUs, on guest RAM `mem` (boot RAM, already
    /// filled on a restore) and `hotplugged_ram` (the regions a restore
    /// re-creates at their addresses): both are given to KVM and to the
    /// devices before any device is made, so a vhost-user device's first
    /// memory table already holds them. `restoring` (a restore or an
    /// incoming migration, with the window files a migration passed): each
    /// fs device waits for its daemon to appear (see
    /// [`DeviceManager::wait_for_daemons`]).
    pub fn build(
        config: &VmConfig,
        base: VmBase,
        hotplugged_ram: Vec<Arc<GuestRegionMmap>>,
        observe: Option<&ObserverFactory>,
        restoring: Option<WindowFiles>,
    ) -> Result<Self, VmError> {
        let VmBase {
            kvm,
            vm,
            mem,
            base_cpuid,
            prefaulter,
        } = base;

        let exit = Arc::new(ExitHandle::new()?);
        let pio = Arc::new(Bus::new());
        let mmio = Arc::new(Bus::new());
        let (serial, ged, mut device_aml) = add_platform_devices(&vm, config, &pio, &exit)?;
        let ram = RamHotplug::new(&config.memory);
        add_memory_hotplug(&ram, &pio, &mut device_aml)?;
        let guest_mem = GuestMemoryAtomic::new(mem.clone());
        let mut devices = DeviceManager::new(
            &kvm,
            &vm,
            &pio,
            &mmio,
            guest_mem,
            &config.memory,
            config.platform.num_pci_segments,
            ged.clone(),
        )?;
        for region in &hotplugged_ram {
            devices.add_ram_region(region.clone())?;
        }
        if let Some(window_files) = restoring {
            devices.wait_for_daemons(window_files);
        }
        devices.add_boot_devices(config, observe)?;
        devices.append_aml(&mut device_aml);
        let cpu_hotplug = crate::vcpu::hotplug::install(&config.cpus, &pio, &mut device_aml)?;

        let caps = StateCaps::probe(&kvm, &vm)
            .map_err(|e| tracing::warn!("this VM cannot be snapshotted: {e}"))
            .ok()
            .map(Arc::new);
        Ok(Platform {
            tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
            vm,
            mem,
            hotplugged_ram,
            exit,
            pio,
            mmio,
            serial,
            ged,
            ram,
            devices,
            cpu_hotplug,
            device_aml,
            base_cpuid,
            prefaulter,
            caps,
        })
    }

    /// What the boot vCPUs are made with; `entry` is the kernel's.
    pub fn vcpu_setup<'a>(&'a self, config: &VmConfig, entry: u64) -> VcpuSetup<'a> {
        VcpuSetup {
            topology: config.cpus.effective_topology(),
            base_cpuid: &self.base_cpuid,
            tsc_deadline: self.tsc_deadline,
            entry,
            mem: &self.mem,
        }
    }
}
