//! vCPU creation, initial state and the run loop that dispatches exits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{CpuId, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use crate::arch::x86_64::{cpuid, regs};
use crate::devices::Bus;
use crate::exit::{ExitHandle, VmExit};
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("creating vCPU {index} failed: {source}")]
    Create { index: u32, source: kvm_ioctls::Error },
    #[error("vCPU {index}: setting CPUID failed: {source}")]
    Cpuid { index: u32, source: kvm_ioctls::Error },
    #[error("vCPU {index}: {source}")]
    Regs { index: u32, source: regs::RegsError },
    #[error("starting the thread of vCPU {index} failed: {source}")]
    Spawn { index: u32, source: std::io::Error },
}

pub struct Vcpu {
    index: u32,
    fd: VcpuFd,
}

/// What every vCPU needs to be configured.
pub struct VcpuSetup<'a> {
    pub cpus: u32,
    pub base_cpuid: &'a CpuId,
    pub tsc_deadline: bool,
    /// The bzImage 64-bit entry point; only the boot vCPU starts there, the
    /// others wait for INIT/SIPI from the guest in the in-kernel LAPIC.
    pub entry: u64,
    pub mem: &'a GuestMemoryMmap,
}

impl Vcpu {
    pub fn new(vm: &VmFd, index: u32, setup: &VcpuSetup) -> Result<Self, VcpuError> {
        let fd = vm.create_vcpu(u64::from(index)).map_err(|source| VcpuError::Create { index, source })?;
        let mut cpuid = setup.base_cpuid.clone();
        cpuid::patch_cpuid(cpuid.as_mut_slice(), index, setup.cpus, setup.tsc_deadline);
        fd.set_cpuid2(&cpuid).map_err(|source| VcpuError::Cpuid { index, source })?;
        let r = |source| VcpuError::Regs { index, source };
        regs::setup_msrs(&fd).map_err(r)?;
        regs::setup_fpu(&fd).map_err(r)?;
        regs::setup_lint(&fd).map_err(r)?;
        if index == 0 {
            regs::write_boot_structures(setup.mem).map_err(r)?;
            regs::setup_sregs(&fd).map_err(r)?;
            regs::setup_regs(&fd, setup.entry).map_err(r)?;
        }
        Ok(Vcpu { index, fd })
    }

    pub fn spawn(mut self, pio: Arc<Bus>, mmio: Arc<Bus>, exit: Arc<ExitHandle>) -> Result<RunningVcpu, VcpuError> {
        let index = self.index;
        install_kick_handler();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                if let Some(reason) = self.run(&pio, &mmio, &stop_flag) {
                    exit.request(reason);
                }
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(RunningVcpu { thread, stop })
    }

    /// Runs the guest until an exit that ends the VM (Some) or until asked
    /// to stop (None).
    fn run(&mut self, pio: &Bus, mmio: &Bus, stop: &AtomicBool) -> Option<VmExit> {
        let cpu = self.index;
        loop {
            if stop.load(Ordering::SeqCst) {
                return None;
            }
            return Some(match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !pio.read(u64::from(port), data) {
                        data.fill(0xff); // an empty ISA bus floats high
                    }
                    continue;
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    if !pio.write(u64::from(port), data) {
                        log::trace!("vCPU {cpu}: write {data:x?} to unclaimed port {port:#x}");
                    }
                    continue;
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    if !mmio.read(addr, data) {
                        data.fill(0xff);
                    }
                    continue;
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    mmio.write(addr, data);
                    continue;
                }
                // With the in-kernel irqchip HLT is handled by KVM; these are benign.
                Ok(VcpuExit::Hlt | VcpuExit::IrqWindowOpen | VcpuExit::Intr) => continue,
                Ok(VcpuExit::Shutdown) => VmExit::TripleFault { cpu },
                Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                    KVM_SYSTEM_EVENT_SHUTDOWN => VmExit::PowerOff,
                    KVM_SYSTEM_EVENT_RESET => VmExit::Reset,
                    KVM_SYSTEM_EVENT_CRASH => VmExit::GuestPanic,
                    other => VmExit::VcpuError { cpu, message: format!("unknown KVM system event {other}") },
                },
                Ok(VcpuExit::FailEntry(reason, _)) => {
                    VmExit::VcpuError { cpu, message: format!("KVM_EXIT_FAIL_ENTRY, hardware reason {reason:#x}") }
                }
                Ok(VcpuExit::InternalError) => {
                    VmExit::VcpuError { cpu, message: format!("KVM_EXIT_INTERNAL_ERROR at {}", self.rip()) }
                }
                Ok(other) => {
                    let message = format!("unhandled exit {other:?}");
                    VmExit::VcpuError { cpu, message: format!("{message} at {}", self.rip()) }
                }
                // A kick (see RunningVcpu::stop) or a spurious signal.
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => VmExit::VcpuError { cpu, message: format!("KVM_RUN failed: {e}") },
            });
        }
    }

    fn rip(&self) -> String {
        self.fd.get_regs().map_or_else(|e| format!("unknown rip ({e})"), |r| format!("rip {:#x}", r.rip))
    }
}

/// The signal that kicks a vCPU thread out of KVM_RUN.
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The handler does nothing: its only job is to make KVM_RUN return EINTR.
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick) {
            log::error!("installing the vCPU kick handler: {e}; stopping a VM will wait for its vCPUs to exit");
        }
    });
}

/// A vCPU thread and the flag that asks it to stop.
pub struct RunningVcpu {
    thread: JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl RunningVcpu {
    /// Asks the vCPU to stop and waits for its thread. The signal is sent
    /// until the thread is gone: one sent just before it entered KVM_RUN
    /// would otherwise be lost while it sleeps in a halted guest.
    pub fn stop(self) {
        use vmm_sys_util::signal::Killable;
        self.stop.store(true, Ordering::SeqCst);
        while !self.thread.is_finished() {
            if let Err(e) = self.thread.kill(kick_signal()) {
                log::warn!("kicking a vCPU thread: {e}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.thread.join();
    }
}
