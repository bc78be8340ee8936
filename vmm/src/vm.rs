//! Builds a VM from its configuration, runs it and waits for it to end.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kvm_bindings::kvm_userspace_memory_region;
use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, Kvm, VmFd};
use virtio_devices::pmem::{Pmem, PmemBacking};
use virtio_devices::rng::{Rng, RngError};
use virtio_devices::vhost_user_fs::window::{DaxWindow, WindowObserver};
use virtio_devices::vhost_user_fs::{FsDeviceConfig, VhostUserFs};
use virtio_devices::VirtioDevice;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::terminal::Terminal;

use crate::arch::x86_64::{acpi::AcpiTables, boot, layout};
use crate::config::{SerialMode, Transport, VmConfig};
use crate::devices::virtio_mmio::MmioDeviceManager;
use crate::devices::virtio_pci::PciDeviceManager;
use crate::devices::{acpi_pm, ged, i8042, pvpanic, serial, Bus};
use crate::exit::{ExitHandle, VmExit};
use crate::memory::{self, GuestMemoryMmap};
use crate::signals::StopSignals;
use crate::vcpu::{RunningVcpus, Vcpu, VcpuSetup};

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
    #[error("device setup: {0}")]
    Device(String),
    #[error(transparent)]
    Pmem(#[from] virtio_devices::pmem::PmemError),
    #[error(transparent)]
    Rng(#[from] RngError),
    #[error(transparent)]
    VirtioMmio(#[from] crate::devices::virtio_mmio::VirtioMmioError),
    #[error("device {id}: registering its {size}-byte memory at {addr:#x} with KVM: {source}")]
    DeviceMemorySlot {
        id: String,
        addr: u64,
        size: u64,
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Fs(#[from] virtio_devices::vhost_user_fs::FsError),
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
                .map_err(|source| VmError::SerialFile {
                    path: path.display().to_string(),
                    source,
                })?,
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
) -> Result<(Option<SharedSerial>, ged::GedHandle, Vec<u8>), VmError> {
    let dev = |e: crate::devices::bus::BusError| VmError::Device(e.to_string());
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
            .map_err(dev)?;
        serial_dev = Some(s);
        serial::SerialDevice::append_aml(&mut aml);
    }
    pio.insert(
        Arc::new(Mutex::new(i8042::I8042::new(exit.clone()))),
        i8042::I8042_PORT,
        i8042::PORT_COUNT,
    )
    .map_err(dev)?;
    pio.insert(
        Arc::new(Mutex::new(acpi_pm::AcpiPm::new(exit.clone()))),
        u64::from(acpi_pm::SLEEP_CONTROL_PORT),
        acpi_pm::PORT_COUNT,
    )
    .map_err(dev)?;
    if config.pvpanic {
        pio.insert(
            Arc::new(Mutex::new(pvpanic::PvPanic::new(exit.clone()))),
            u64::from(pvpanic::PVPANIC_PORT),
            1,
        )
        .map_err(dev)?;
        pvpanic::PvPanic::append_aml(&mut aml);
    }
    let irq = EventFd::new(libc::EFD_NONBLOCK)?;
    kvm_setup(
        "registering the GED irqfd",
        vm.register_irqfd(&irq, ged::GED_IRQ),
    )?;
    let ged_dev = Arc::new(Mutex::new(ged::Ged::new(irq)));
    pio.insert(ged_dev.clone(), u64::from(ged::GED_PORT), 1)
        .map_err(dev)?;
    ged::Ged::append_aml(&mut aml);
    Ok((serial_dev, ged::GedHandle(ged_dev), aml))
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
    kvm_setup(
        "KVM_SET_TSS_ADDR",
        vm.set_tss_address(layout::KVM_TSS_ADDRESS as usize),
    )?;
    kvm_setup("KVM_CREATE_IRQCHIP", vm.create_irq_chip())?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    kvm_setup("KVM_CREATE_PIT2", vm.create_pit2(pit))?;
    Ok(vm)
}

/// First KVM memory slot for device memory (pmem ranges, shared memory
/// regions); guest RAM uses the slots below.
const DEVICE_MEMORY_SLOT_BASE: u32 = 100;

/// Hands out guest-physical ranges above RAM for device memory and
/// registers each with KVM in a slot of its own.
struct DeviceMemory {
    next_addr: u64,
    next_slot: u32,
}

impl DeviceMemory {
    fn new(ram_size: u64) -> Self {
        DeviceMemory {
            next_addr: layout::device_memory_start(ram_size),
            next_slot: DEVICE_MEMORY_SLOT_BASE,
        }
    }

    /// Places `size` bytes for a device on `transport`; returns the guest
    /// address and the span reserved (over PCI the range is BAR 2: a power of
    /// two, aligned to its size).
    fn place(&mut self, size: u64, transport: Transport) -> (u64, u64) {
        let (addr, span) = match transport {
            Transport::Pci => {
                let span = size.next_power_of_two().max(layout::DEVICE_MEMORY_ALIGN);
                (self.next_addr.next_multiple_of(span), span)
            }
            Transport::Mmio => (self.next_addr, size),
        };
        self.next_addr = (addr + span).next_multiple_of(layout::DEVICE_MEMORY_ALIGN);
        (addr, span)
    }

    /// Registers `size` bytes mapped at `host_addr` as guest memory at `addr`.
    ///
    /// # Safety
    /// The mapping must stay valid (mapped, or reserved PROT_NONE) while the VM runs.
    unsafe fn register(
        &mut self,
        vm: &VmFd,
        addr: u64,
        size: u64,
        host_addr: u64,
    ) -> Result<(), kvm_ioctls::Error> {
        let region = kvm_userspace_memory_region {
            slot: self.next_slot,
            flags: 0,
            guest_phys_addr: addr,
            memory_size: size,
            userspace_addr: host_addr,
        };
        // SAFETY: the caller keeps the mapping alive for the life of the VM.
        unsafe { vm.set_user_memory_region(region) }?;
        self.next_slot += 1;
        Ok(())
    }
}

/// Where the virtio devices go: the two transports and the device memory area.
struct DeviceSetup<'a> {
    vm: &'a Arc<VmFd>,
    mmio: &'a Bus,
    mem: &'a GuestMemoryAtomic<GuestMemoryMmap>,
    mmio_devices: MmioDeviceManager,
    pci_devices: PciDeviceManager,
    device_memory: DeviceMemory,
}

impl DeviceSetup<'_> {
    fn add(
        &mut self,
        device: Box<dyn VirtioDevice>,
        transport: Transport,
        shm: Option<(u64, u64)>,
    ) -> Result<(), VmError> {
        match transport {
            Transport::Mmio => self
                .mmio_devices
                .add(self.vm, self.mmio, self.mem, device)?,
            Transport::Pci => self
                .pci_devices
                .add(self.vm, self.mmio, self.mem, device, shm)?,
        }
        Ok(())
    }

    /// Opens, maps and registers each `--pmem` backing file above RAM and
    /// puts a virtio-pmem device for it on its transport.
    fn add_pmem_devices(&mut self, config: &VmConfig) -> Result<Vec<PmemBacking>, VmError> {
        let mut backings = Vec::new();
        for p in &config.pmem {
            let backing = PmemBacking::open(&p.file, p.size, p.discard_writes)?;
            let size = backing.size();
            let (addr, span) = self.device_memory.place(size, p.transport);
            // SAFETY: `backings` keeps the mapping until `run` returns.
            unsafe {
                self.device_memory
                    .register(self.vm, addr, size, backing.host_addr())
            }
            .map_err(|source| VmError::DeviceMemorySlot {
                id: p.id.clone(),
                addr,
                size,
                source,
            })?;
            let device = Box::new(Pmem::new(p.id.clone(), &backing, addr)?);
            self.add(device, p.transport, Some((addr, span)))?;
            log::info!(
                "pmem {}: {} bytes of {} at {addr:#x}",
                p.id,
                size,
                p.file.display()
            );
            backings.push(backing);
        }
        Ok(backings)
    }

    /// The virtio-rng device, if the VM has one.
    fn add_rng_device(&mut self, config: &VmConfig) -> Result<(), VmError> {
        if let Some(r) = &config.rng {
            let device = Rng::new("_rng".into(), &r.src)?;
            self.add(Box::new(device), r.transport, None)?;
            log::info!("rng: virtio-rng from {}", r.src.display());
        }
        Ok(())
    }

    /// Connects each `--fs` device to its daemon and, with DAX, places its
    /// window above RAM and registers it with KVM.
    fn add_fs_devices(
        &mut self,
        config: &VmConfig,
        observe: Option<&ObserverFactory>,
    ) -> Result<Vec<FsDeviceInfo>, VmError> {
        let mut infos = Vec::new();
        for f in &config.fs {
            let mut device = VhostUserFs::connect(&FsDeviceConfig {
                id: f.id.clone(),
                tag: f.tag.clone(),
                socket: f.socket.clone(),
                num_request_queues: f.num_queues,
                queue_size: f.queue_size,
                dax: f.dax,
                cache_size: f.cache_size,
            })?;
            let mut shm = None;
            if let Some(window) = device.window().cloned() {
                let (size, host_addr) = (window.size(), window.host_addr());
                let (addr, span) = self.device_memory.place(size, f.transport);
                // SAFETY: the window is reserved for as long as the device
                // exists, and the device lives in its transport until the VM ends.
                unsafe { self.device_memory.register(self.vm, addr, size, host_addr) }.map_err(
                    |source| VmError::DeviceMemorySlot {
                        id: f.id.clone(),
                        addr,
                        size,
                        source,
                    },
                )?;
                device.set_window_guest_addr(addr);
                shm = Some((addr, span));
                log::info!("fs {}: DAX window of {size} bytes at {addr:#x}", f.id);
                if let Some(observe) = observe {
                    window.set_observer(observe(&f.id));
                }
            }
            infos.push(FsDeviceInfo {
                id: f.id.clone(),
                window: device.window().cloned(),
                failed: device.failed_flag(),
                control_socket: f.control_socket.clone(),
            });
            self.add(Box::new(device), f.transport, shm)?;
        }
        Ok(infos)
    }
}

/// Loads kernel, initramfs, command line, ACPI tables and the zero page.
fn load_payload(
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
        .map_err(|e| VmError::Device(format!("writing the reset stub: {e}")))?;
    let acpi = AcpiTables::build(config.cpus.boot_vcpus, device_aml)?;
    acpi.write(mem)?;
    let e820 = boot::e820_map(&layout::ram_ranges(config.memory.size));
    boot::write_boot_params(mem, &kernel, cmdline_size, initramfs, &e820, acpi.rsdp_addr)?;
    Ok(kernel.entry)
}

/// Makes the DAX window observer of the fs device with the given id.
pub type ObserverFactory = dyn Fn(&str) -> Arc<dyn WindowObserver>;

/// What the VMM keeps of one fs device while the VM runs: enough to report
/// on it and to reach its daemon's control socket.
#[derive(Clone)]
pub struct FsDeviceInfo {
    pub id: String,
    pub window: Option<Arc<DaxWindow>>,
    pub failed: Arc<AtomicBool>,
    pub control_socket: Option<std::path::PathBuf>,
}

/// A booted VM: its vCPU threads run until it ends or [`Vm::stop`] is called.
/// Dropping it tears down its devices (fs daemons see their socket close).
pub struct Vm {
    exit: Arc<ExitHandle>,
    vcpus: RunningVcpus,
    fs: Vec<FsDeviceInfo>,
    /// The guest's clock when it was paused, given back at resume so the
    /// guest does not see the time it spent paused.
    paused_clock: Option<kvm_bindings::kvm_clock_data>,
    // Kept for the life of the VM: device memory mappings, the buses (which
    // own the devices), the terminal mode.
    _pmem_backings: Vec<PmemBacking>,
    _buses: (Arc<Bus>, Arc<Bus>),
    _raw_terminal: Option<RawTerminal>,
    /// The VMM's stdin feeds this VM's serial port until the VM goes.
    stdin: Option<(Arc<serial::InputRouter>, SharedSerial)>,
    // Guest RAM: KVM translates guest addresses into this mapping.
    _mem: GuestMemoryMmap,
    /// The KVM VM: its clock is saved and restored across a pause.
    vm: Arc<VmFd>,
    /// The ACPI Generic Event Device, for `vm.power-button`.
    ged: ged::GedHandle,
}

impl Vm {
    /// Builds the VM from `config` and starts its vCPUs. `observe`, when
    /// given, makes the observer of each fs device's DAX window from its id.
    pub fn boot(config: &VmConfig, observe: Option<&ObserverFactory>) -> Result<Vm, VmError> {
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = Arc::new(create_vm(&kvm)?);
        let mem = memory::create_guest_memory(&config.memory)?;
        memory::register_with_kvm(&vm, &mem)?;

        let exit = Arc::new(ExitHandle::new()?);
        let pio = Arc::new(Bus::new());
        let mmio = Arc::new(Bus::new());
        let (serial_dev, ged, mut device_aml) = add_platform_devices(&vm, config, &pio, &exit)?;
        let guest_mem = GuestMemoryAtomic::new(mem.clone());
        let mut devices = DeviceSetup {
            vm: &vm,
            mmio: &mmio,
            mem: &guest_mem,
            mmio_devices: MmioDeviceManager::new(),
            pci_devices: PciDeviceManager::new(
                &vm,
                &pio,
                &mmio,
                layout::device_memory_start(config.memory.size),
            )?,
            device_memory: DeviceMemory::new(config.memory.size),
        };
        devices.add_rng_device(config)?;
        let pmem_backings = devices.add_pmem_devices(config)?;
        let fs = devices.add_fs_devices(config, observe)?;
        device_aml.extend_from_slice(devices.mmio_devices.aml());
        devices.pci_devices.append_aml(&mut device_aml);
        let entry = load_payload(&mem, config, &device_aml)?;

        let base_cpuid = kvm_setup(
            "KVM_GET_SUPPORTED_CPUID",
            kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES),
        )?;
        let setup = VcpuSetup {
            cpus: config.cpus.boot_vcpus,
            base_cpuid: &base_cpuid,
            tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
            entry: entry.0,
            mem: &mem,
        };
        let vcpus = (0..setup.cpus)
            .map(|i| Vcpu::new(&vm, i, &setup))
            .collect::<Result<Vec<_>, _>>()?;

        let (raw_terminal, stdin) = match (&config.serial, &serial_dev) {
            (SerialMode::Tty, Some(s)) => {
                let raw = RawTerminal::enable();
                (raw, Some((serial::connect_stdin(s.clone())?, s.clone())))
            }
            _ => (None, None),
        };
        log::info!(
            "booting {} vCPU(s), {} MiB RAM",
            setup.cpus,
            config.memory.size >> 20
        );
        let mut running = RunningVcpus::default();
        for vcpu in vcpus {
            if let Err(e) = running.spawn(vcpu, pio.clone(), mmio.clone(), exit.clone()) {
                running.stop();
                return Err(e.into());
            }
        }
        Ok(Vm {
            exit,
            vcpus: running,
            fs,
            paused_clock: None,
            _pmem_backings: pmem_backings,
            _buses: (pio, mmio),
            _raw_terminal: raw_terminal,
            stdin,
            _mem: mem,
            vm,
            ged,
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
        &self.fs
    }

    /// Presses the ACPI power button: a guest that handles it shuts down,
    /// and the VMM exits as for any poweroff.
    pub fn power_button(&self) -> std::io::Result<()> {
        self.ged.press_power_button()
    }

    /// Parks every vCPU (devices and daemons keep their state) and keeps
    /// the guest's clock where it is.
    pub fn pause(&mut self) {
        self.vcpus.pause();
        match self.vm.get_clock() {
            Ok(clock) => self.paused_clock = Some(clock),
            Err(e) => log::warn!("KVM_GET_CLOCK: {e}; the guest will see the time it spent paused"),
        }
    }

    pub fn resume(&mut self) {
        if let Some(mut clock) = self.paused_clock.take() {
            // Without KVM_CLOCK_REALTIME, KVM sets the clock to exactly this
            // value instead of advancing it by the time since.
            clock.flags = 0;
            if let Err(e) = self.vm.set_clock(&clock) {
                log::warn!("KVM_SET_CLOCK: {e}; the guest will see the time it spent paused");
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
        if let Some((router, port)) = self.stdin.take() {
            router.disconnect(&port);
        }
    }
}

/// Boots the VM and blocks until it ends; the returned reason decides the exit status.
pub fn run(config: &VmConfig, signals: &StopSignals) -> Result<VmExit, VmError> {
    let vm = Vm::boot(config, None)?;
    loop {
        if let Some(sig) = signals.wait(&[vm.exit_eventfd().as_raw_fd()])? {
            return Ok(VmExit::Signal(sig));
        }
        if let Some(reason) = vm.exit_reason() {
            return Ok(reason);
        }
    }
}
