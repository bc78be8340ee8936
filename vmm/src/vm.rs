//! Builds a VM from its configuration, runs it and waits for it to end.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use kvm_bindings::kvm_userspace_memory_region;
use virtio_devices::pmem::{Pmem, PmemBacking};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::terminal::Terminal;

use crate::arch::x86_64::{acpi::AcpiTables, boot, layout};
use crate::config::{SerialMode, Transport, VmConfig};
use crate::devices::virtio_mmio::MmioDeviceManager;
use crate::devices::virtio_pci::PciDeviceManager;
use crate::devices::{acpi_pm, i8042, pvpanic, serial, Bus};
use crate::exit::{ExitHandle, VmExit};
use crate::memory::{self, GuestMemoryMmap};
use crate::signals::StopSignals;
use crate::vcpu::{Vcpu, VcpuSetup};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot use /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    #[error("{what}: {source}")]
    KvmSetup { what: &'static str, source: kvm_ioctls::Error },
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Acpi(#[from] crate::arch::x86_64::acpi::AcpiError),
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::VcpuError),
    #[error("--serial file={path}: {source}")]
    SerialFile { path: String, source: std::io::Error },
    #[error("device setup: {0}")]
    Device(String),
    #[error(transparent)]
    Pmem(#[from] virtio_devices::pmem::PmemError),
    #[error(transparent)]
    VirtioMmio(#[from] crate::devices::virtio_mmio::VirtioMmioError),
    #[error("--pmem id={id}: registering its {size}-byte range at {addr:#x} with KVM: {source}")]
    PmemSlot { id: String, addr: u64, size: u64, source: kvm_ioctls::Error },
    #[error(transparent)]
    VirtioPci(#[from] crate::devices::virtio_pci::VirtioPciSetupError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn kvm_setup<T>(what: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, VmError> {
    r.map_err(|source| VmError::KvmSetup { what, source })
}

/// Restores the terminal from raw mode when the VM ends, however it ends.
///
/// Works on a duplicate of fd 0 rather than `std::io::stdin()`: std's stdin
/// lock is held across blocking reads, and the serial input thread blocks in
/// one for the life of the VM.
struct RawTerminal(std::fs::File);

impl RawTerminal {
    fn enable() -> Option<Self> {
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

fn serial_output(mode: &SerialMode) -> Result<Option<Box<dyn Write + Send>>, VmError> {
    Ok(match mode {
        SerialMode::Off => None,
        SerialMode::Null => Some(Box::new(std::io::sink())),
        SerialMode::Tty => Some(Box::new(std::io::stdout())),
        SerialMode::File(path) => Some(Box::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| VmError::SerialFile { path: path.display().to_string(), source })?,
        )),
    })
}

type SharedSerial = Arc<Mutex<serial::SerialDevice>>;

/// The legacy devices on the I/O port bus, plus their DSDT descriptions.
fn add_platform_devices(
    vm: &VmFd,
    config: &VmConfig,
    pio: &Bus,
    exit: &Arc<ExitHandle>,
) -> Result<(Option<SharedSerial>, Vec<u8>), VmError> {
    let dev = |e: crate::devices::bus::BusError| VmError::Device(e.to_string());
    let mut serial_dev = None;
    let mut aml = Vec::new();
    if let Some(out) = serial_output(&config.serial)? {
        let irq = EventFd::new(libc::EFD_NONBLOCK)?;
        kvm_setup("registering the serial irqfd", vm.register_irqfd(&irq, serial::COM1_IRQ))?;
        let s = Arc::new(Mutex::new(serial::SerialDevice::new(irq, out)));
        pio.insert(s.clone(), serial::COM1_PORT, serial::PORT_COUNT).map_err(dev)?;
        serial_dev = Some(s);
        serial::SerialDevice::append_aml(&mut aml);
    }
    pio.insert(Arc::new(Mutex::new(i8042::I8042::new(exit.clone()))), i8042::I8042_PORT, i8042::PORT_COUNT)
        .map_err(dev)?;
    pio.insert(
        Arc::new(Mutex::new(acpi_pm::AcpiPm::new(exit.clone()))),
        u64::from(acpi_pm::SLEEP_CONTROL_PORT),
        acpi_pm::PORT_COUNT,
    )
    .map_err(dev)?;
    pio.insert(Arc::new(Mutex::new(pvpanic::PvPanic::new(exit.clone()))), u64::from(pvpanic::PVPANIC_PORT), 1)
        .map_err(dev)?;
    pvpanic::PvPanic::append_aml(&mut aml);
    Ok((serial_dev, aml))
}

fn create_vm(kvm: &Kvm) -> Result<VmFd, VmError> {
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
    kvm_setup("KVM_SET_TSS_ADDR", vm.set_tss_address(layout::KVM_TSS_ADDRESS as usize))?;
    kvm_setup("KVM_CREATE_IRQCHIP", vm.create_irq_chip())?;
    let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
    kvm_setup("KVM_CREATE_PIT2", vm.create_pit2(pit))?;
    Ok(vm)
}

/// First KVM memory slot for device memory (pmem ranges, shared memory
/// regions); guest RAM uses the slots below.
const DEVICE_MEMORY_SLOT_BASE: u32 = 100;

/// Opens, maps and registers each `--pmem` backing file above RAM and puts a
/// virtio-pmem device for it on its transport.
fn add_pmem_devices(
    vm: &Arc<VmFd>,
    config: &VmConfig,
    mmio: &Bus,
    mem: &GuestMemoryAtomic<GuestMemoryMmap>,
    mmio_devices: &mut MmioDeviceManager,
    pci_devices: &mut PciDeviceManager,
) -> Result<Vec<PmemBacking>, VmError> {
    let mut backings = Vec::new();
    let mut next_addr = layout::device_memory_start(config.memory.size);
    for (i, p) in config.pmem.iter().enumerate() {
        let backing = PmemBacking::open(&p.file, p.size, p.discard_writes)?;
        let size = backing.size();
        // Over PCI the range is BAR 2: a power of two, aligned to its size.
        let span = match p.transport {
            Transport::Pci => size.next_power_of_two().max(layout::DEVICE_MEMORY_ALIGN),
            Transport::Mmio => size,
        };
        let addr = match p.transport {
            Transport::Pci => next_addr.next_multiple_of(span),
            Transport::Mmio => next_addr,
        };
        let region = kvm_userspace_memory_region {
            slot: DEVICE_MEMORY_SLOT_BASE + i as u32,
            flags: 0,
            guest_phys_addr: addr,
            memory_size: size,
            userspace_addr: backing.host_addr(),
        };
        // SAFETY: the mapping is `size` bytes long and stays mapped while the
        // VM runs (`backings` is kept until `run` returns).
        unsafe { vm.set_user_memory_region(region) }
            .map_err(|source| VmError::PmemSlot { id: p.id.clone(), addr, size, source })?;
        let device = Box::new(Pmem::new(p.id.clone(), &backing, addr)?);
        match p.transport {
            Transport::Mmio => mmio_devices.add(vm, mmio, mem, device)?,
            Transport::Pci => pci_devices.add(vm, mmio, mem, device, Some((addr, span)))?,
        }
        next_addr = (addr + span).next_multiple_of(layout::DEVICE_MEMORY_ALIGN);
        log::info!("pmem {}: {} bytes of {} at {addr:#x}", p.id, size, p.file.display());
        backings.push(backing);
    }
    Ok(backings)
}

/// Loads kernel, initramfs, command line, ACPI tables and the zero page.
fn load_payload(mem: &GuestMemoryMmap, config: &VmConfig, device_aml: &[u8]) -> Result<GuestAddress, VmError> {
    let kernel = boot::load_kernel(mem, &config.payload.kernel)?;
    let initramfs = match &config.payload.initramfs {
        Some(path) => Some(boot::load_initramfs(mem, path, &kernel)?),
        None => None,
    };
    let cmdline_size = boot::load_command_line(mem, &config.payload.cmdline)?;
    mem.write_slice(&layout::RESET_STUB, GuestAddress(layout::RESET_VECTOR))
        .map_err(|e| VmError::Device(format!("writing the reset stub: {e}")))?;
    let acpi = AcpiTables::build(config.cpus.boot_vcpus, device_aml)?;
    acpi.write(mem)?;
    let e820 = boot::e820_map(&layout::ram_ranges(config.memory.size));
    boot::write_boot_params(mem, &kernel, cmdline_size, initramfs, &e820, acpi.rsdp_addr)?;
    Ok(kernel.entry)
}

/// Boots the VM and blocks until it ends; the returned reason decides the exit status.
pub fn run(config: &VmConfig, signals: &StopSignals) -> Result<VmExit, VmError> {
    let kvm = Kvm::new().map_err(VmError::Kvm)?;
    let vm = Arc::new(create_vm(&kvm)?);
    let mem = memory::create_guest_memory(&config.memory)?;
    memory::register_with_kvm(&vm, &mem)?;

    let exit = Arc::new(ExitHandle::new()?);
    let pio = Arc::new(Bus::new());
    let mmio = Arc::new(Bus::new());
    let (serial_dev, mut device_aml) = add_platform_devices(&vm, config, &pio, &exit)?;
    let guest_mem = GuestMemoryAtomic::new(mem.clone());
    let mut mmio_devices = MmioDeviceManager::new();
    let mut pci_devices = PciDeviceManager::new(&vm, &pio, &mmio, layout::device_memory_start(config.memory.size))?;
    // The mappings must outlive the VM: kept until `run` returns.
    let _pmem_backings = add_pmem_devices(&vm, config, &mmio, &guest_mem, &mut mmio_devices, &mut pci_devices)?;
    device_aml.extend_from_slice(mmio_devices.aml());
    pci_devices.append_aml(&mut device_aml);
    let entry = load_payload(&mem, config, &device_aml)?;

    let base_cpuid = kvm_setup("KVM_GET_SUPPORTED_CPUID", kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES))?;
    let setup = VcpuSetup {
        cpus: config.cpus.boot_vcpus,
        base_cpuid: &base_cpuid,
        tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
        entry: entry.0,
        mem: &mem,
    };
    let vcpus = (0..setup.cpus).map(|i| Vcpu::new(&vm, i, &setup)).collect::<Result<Vec<_>, _>>()?;

    let _raw_terminal = match (&config.serial, &serial_dev) {
        (SerialMode::Tty, Some(s)) => {
            let raw = RawTerminal::enable();
            serial::spawn_stdin_reader(s.clone())?;
            raw
        }
        _ => None,
    };
    log::info!("booting {} vCPU(s), {} MiB RAM", setup.cpus, config.memory.size >> 20);
    for vcpu in vcpus {
        vcpu.spawn(pio.clone(), mmio.clone(), exit.clone())?;
    }

    loop {
        if let Some(sig) = signals.wait(exit.eventfd().as_raw_fd())? {
            exit.request(VmExit::Signal(sig));
        }
        if let Some(reason) = exit.reason() {
            return Ok(reason);
        }
    }
}
