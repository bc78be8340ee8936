//! The vCPUs and everything that changes their number: vCPU creation,
//! initial state and the run loop that dispatches exits (here), the
//! `vm.resize` side that starts, wakes and parks vCPU threads
//! ([`hotplug`]), and the ACPI CPU hot-plug controller the guest sees
//! ([`hotplug_controller`]).

pub mod hotplug;
pub mod hotplug_controller;
pub mod state;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{
    CpuId, KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use crate::arch::x86_64::{cpuid, regs};
use crate::bus::Bus;
use crate::config::CpuTopology;
use crate::exit::{ExitHandle, VmExit};
use crate::memory::GuestMemoryMmap;
use crate::signals::{install_kick_handler, kick_signal};
use state::{StateCaps, VcpuState, VcpuStateError};

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("creating vCPU {index} failed: {source}")]
    Create {
        index: u32,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {index}: setting CPUID failed: {source}")]
    Cpuid {
        index: u32,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {index}: {source}")]
    Regs { index: u32, source: regs::RegsError },
    #[error("starting the thread of vCPU {index} failed: {source}")]
    Spawn { index: u32, source: std::io::Error },
    #[error("vCPU {index}: {source}")]
    State { index: u32, source: VcpuStateError },
    #[error("the vCPUs' state is saved only while the VM is paused")]
    NotPaused,
    #[error("vCPU {index} did not save its state: {reason}")]
    NoAnswer { index: u32, reason: &'static str },
}

/// How long a parked vCPU thread may take to answer a request: it answers
/// at once unless it has ended or hangs; then the caller learns which.
const REQUEST_WAIT: Duration = Duration::from_secs(10);

/// What a parked vCPU thread is asked to do with its `VcpuFd`, which only
/// it holds.
enum VcpuRequest {
    SaveState {
        caps: Arc<StateCaps>,
        reply: mpsc::Sender<Result<VcpuState, VcpuStateError>>,
    },
}

pub struct Vcpu {
    index: u32,
    fd: VcpuFd,
}

/// What every vCPU needs to be configured.
pub struct VcpuSetup<'a> {
    /// How the possible vCPUs are laid out (their APIC ids and CPUID topology).
    pub topology: CpuTopology,
    pub base_cpuid: &'a CpuId,
    pub tsc_deadline: bool,
    /// The bzImage 64-bit entry point; only the boot vCPU starts there, the
    /// others wait for INIT/SIPI from the guest in the in-kernel LAPIC.
    pub entry: u64,
    pub mem: &'a GuestMemoryMmap,
}

impl Vcpu {
    pub fn new(vm: &VmFd, index: u32, setup: &VcpuSetup) -> Result<Self, VcpuError> {
        // KVM's vCPU id is the in-kernel LAPIC's APIC id.
        let fd = vm
            .create_vcpu(u64::from(setup.topology.apic_id(index)))
            .map_err(|source| VcpuError::Create { index, source })?;
        let mut cpuid = setup.base_cpuid.clone();
        cpuid::patch_cpuid(
            cpuid.as_mut_slice(),
            index,
            setup.topology,
            setup.tsc_deadline,
        );
        fd.set_cpuid2(&cpuid)
            .map_err(|source| VcpuError::Cpuid { index, source })?;
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

    /// vCPU `index` made again from a saved state (instead of the boot
    /// setup of [`Vcpu::new`]), on the main thread, before its thread starts.
    pub fn restore(
        vm: &VmFd,
        index: u32,
        topology: CpuTopology,
        caps: &StateCaps,
        state: &VcpuState,
    ) -> Result<Self, VcpuError> {
        // Refused before a vCPU is made: KVM cannot destroy one.
        state
            .check(caps)
            .map_err(|source| VcpuError::State { index, source })?;
        let fd = vm
            .create_vcpu(u64::from(topology.apic_id(index)))
            .map_err(|source| VcpuError::Create { index, source })?;
        state
            .restore(&fd, caps)
            .map_err(|source| VcpuError::State { index, source })?;
        Ok(Vcpu { index, fd })
    }

    #[cfg(test)]
    pub(crate) fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// This vCPU's KVM statistics, readable while it runs.
    pub fn stats(&self) -> Result<crate::kvm_stats::KvmStatsFile, crate::kvm_stats::KvmStatsError> {
        crate::kvm_stats::KvmStatsFile::open(&self.fd)
    }

    /// Runs the guest until an exit that ends the VM (Some) or until asked
    /// to stop (None). Parks while the VM is paused or this vCPU ejected.
    fn run(
        &mut self,
        pio: &Bus,
        mmio: &Bus,
        control: &VcpuControl,
        slot: &VcpuSlot,
    ) -> Option<VmExit> {
        let cpu = self.index;
        let mut repairs = FaultRepairs::default();
        let mut exit_to_complete = false;
        loop {
            if control.stop.load(Ordering::SeqCst) {
                return None;
            }
            if control.pause.load(Ordering::SeqCst) || slot.ejected.load(Ordering::SeqCst) {
                if std::mem::take(&mut exit_to_complete) {
                    self.complete_exit();
                }
                control.park(slot, &mut |request| self.serve(request));
                continue;
            }
            let result = self.fd.run();
            exit_to_complete = matches!(
                result,
                Ok(VcpuExit::IoIn(..)
                    | VcpuExit::IoOut(..)
                    | VcpuExit::MmioRead(..)
                    | VcpuExit::MmioWrite(..))
            );
            // Any exit but a memory fault means the guest got somewhere.
            if result.is_ok() && !matches!(result, Ok(VcpuExit::MemoryFault { .. })) {
                repairs.reset();
            }
            return Some(match result {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !pio.read(u64::from(port), data) {
                        data.fill(0xff); // an empty ISA bus floats high
                    }
                    continue;
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    if !pio.write(u64::from(port), data) {
                        tracing::trace!("vCPU {cpu}: write {data:x?} to unclaimed port {port:#x}");
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
                    other => VmExit::VcpuError {
                        cpu,
                        message: format!("unknown KVM system event {other}"),
                    },
                },
                Ok(VcpuExit::FailEntry(reason, _)) => VmExit::VcpuError {
                    cpu,
                    message: format!("KVM_EXIT_FAIL_ENTRY, hardware reason {reason:#x}"),
                },
                Ok(VcpuExit::InternalError) => VmExit::VcpuError {
                    cpu,
                    message: format!("KVM_EXIT_INTERNAL_ERROR at {}", self.rip()),
                },
                // KVM could not fault a page in: on Linux with
                // KVM_CAP_MEMORY_FAULT_INFO it says where, else KVM_RUN
                // just fails with EFAULT. A DAX file shrunk on the host is
                // repaired (the scratch shown over its vanished pages) and
                // the vCPU resumes; anything else ends the VM as before.
                Ok(VcpuExit::MemoryFault { gpa, size, .. }) => {
                    if repairs.allow(Some(gpa)) && memory_fault_repaired(cpu, Some(gpa)) {
                        continue;
                    }
                    VmExit::VcpuError {
                        cpu,
                        message: format!(
                            "KVM could not map guest-physical {gpa:#x} (+{size:#x}) at {}{}",
                            self.rip(),
                            repairs.gave_up()
                        ),
                    }
                }
                Err(e)
                    if e.errno() == libc::EFAULT
                        && repairs.allow(None)
                        && memory_fault_repaired(cpu, None) =>
                {
                    continue
                }
                Err(e) if e.errno() == libc::EFAULT => VmExit::VcpuError {
                    cpu,
                    message: format!("KVM_RUN failed: {e} at {}{}", self.rip(), repairs.gave_up()),
                },
                Ok(other) => {
                    let message = format!("unhandled exit {other:?}");
                    VmExit::VcpuError {
                        cpu,
                        message: format!("{message} at {}", self.rip()),
                    }
                }
                // A kick (see RunningVcpus) or a spurious signal.
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => VmExit::VcpuError {
                    cpu,
                    message: format!("KVM_RUN failed: {e}"),
                },
            });
        }
    }

    /// KVM finishes an IO or MMIO exit (an `in`'s or MMIO read's value
    /// into its register, RIP past the instruction) only when KVM_RUN is
    /// entered again: "the corresponding operations are complete (and
    /// guest state is consistent) only after userspace has re-entered the
    /// kernel with KVM_RUN" (KVM API doc). Before parking, where the state
    /// may be saved, enter once with `immediate_exit` set: KVM completes the
    /// exit and returns EINTR without running guest code.
    fn complete_exit(&mut self) {
        self.fd.set_kvm_immediate_exit(1);
        let outcome = match self.fd.run() {
            Err(e) if e.errno() == libc::EINTR => None,
            Err(e) => Some(e.to_string()),
            Ok(exit) => Some(format!("{exit:?}")),
        };
        self.fd.set_kvm_immediate_exit(0);
        if let Some(outcome) = outcome {
            tracing::warn!(
                "vCPU {}: completing the last exit before parking: {outcome}",
                self.index
            );
        }
    }

    /// Answers a request made while parked.
    fn serve(&self, request: VcpuRequest) {
        match request {
            VcpuRequest::SaveState { caps, reply } => {
                // The asker may have given up waiting: nothing to do then.
                let _ = reply.send(VcpuState::capture(&self.fd, &caps));
            }
        }
    }

    fn rip(&self) -> String {
        self.fd.get_regs().map_or_else(
            |e| format!("unknown rip ({e})"),
            |r| format!("rip {:#x}", r.rip),
        )
    }
}

/// Repairs DAX windows after a failed guest memory access; whether
/// anything was repaired (and the access may be retried).
fn memory_fault_repaired(cpu: u32, gpa: Option<u64>) -> bool {
    let repaired = virtio_devices::vhost_user_fs::repair_windows_after_fault(gpa);
    if repaired > 0 {
        virtio_devices::warn_limited!(
            "vCPU {cpu}: a DAX mapping reached past its file's end (cut short on the host, or grown since); {repaired} bytes of the window show the file again or read zeros now{}",
            gpa.map_or(String::new(), |g| format!(" (fault at {g:#x})"))
        );
    }
    repaired > 0
}

/// Repairs a vCPU may try in a row for the same fault (the same page, or
/// a fault KVM gave no address for) with no other exit between: one
/// resolves a guarded page, a second and third show the scratch where the
/// first could not (see [`virtio_devices::vhost_user_fs::repair_windows_after_fault`]).
/// A fault that comes back after that is not the windows' to fix; looping
/// on it would spin the vCPU thread for as long as the guest likes.
const MAX_REPAIRS_IN_A_ROW: u32 = 16;

/// Counts the repairs of one fault in a row ([`MAX_REPAIRS_IN_A_ROW`]).
#[derive(Default, Debug)]
struct FaultRepairs {
    /// The page of the last fault (None: KVM did not say where), and how
    /// many times in a row it came.
    last: Option<(Option<u64>, u32)>,
}

impl FaultRepairs {
    /// A fault at `gpa`: whether a repair may be tried once more.
    fn allow(&mut self, gpa: Option<u64>) -> bool {
        let page = gpa.map(|g| g & !0xfff);
        let count = match self.last {
            Some((last, n)) if last == page => n.saturating_add(1),
            _ => 1,
        };
        self.last = Some((page, count));
        count <= MAX_REPAIRS_IN_A_ROW
    }

    /// The guest got somewhere: the next fault starts a new count.
    fn reset(&mut self) {
        self.last = None;
    }

    /// Words for the VM's end when the repairs were given up.
    fn gave_up(&self) -> String {
        match self.last {
            Some((_, n)) if n > MAX_REPAIRS_IN_A_ROW => {
                format!(" (the same fault came back after {MAX_REPAIRS_IN_A_ROW} repairs in a row)")
            }
            _ => String::new(),
        }
    }
}

/// What the VMM asks of the vCPU threads of one VM: to park until resumed,
/// or to stop. A thread looks at it between two KVM_RUNs; a kick makes a
/// running one return from KVM_RUN so it does.
#[derive(Default)]
struct VcpuControl {
    stop: AtomicBool,
    pause: AtomicBool,
    /// Threads parked in [`VcpuControl::park`]. Changes to
    /// `pause` and `stop` are made under this lock, so a parking thread
    /// cannot miss the wake-up.
    parked: Mutex<usize>,
    changed: Condvar,
}

/// One vCPU thread's own state: ejected by the guest (after a `vm.resize`
/// down) it parks, keeping its KVM vCPU (which KVM cannot destroy) for a
/// later re-add.
#[derive(Default)]
struct VcpuSlot {
    ejected: AtomicBool,
    /// The thread is in [`VcpuControl::park`].
    parked: AtomicBool,
    /// Requests for the parked thread ([`VcpuControl::ask`]).
    mailbox: Mutex<Vec<VcpuRequest>>,
}

impl VcpuControl {
    /// Waits while the VM is paused or `slot` is ejected, unless stopped,
    /// handing the requests put in `slot`'s mailbox meanwhile to `serve`.
    /// Requests still there when it leaves are dropped: their askers see
    /// the reply channel close.
    fn park(&self, slot: &VcpuSlot, serve: &mut dyn FnMut(VcpuRequest)) {
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        *parked += 1;
        slot.parked.store(true, Ordering::SeqCst);
        self.changed.notify_all();
        while (self.pause.load(Ordering::SeqCst) || slot.ejected.load(Ordering::SeqCst))
            && !self.stop.load(Ordering::SeqCst)
        {
            let requests = std::mem::take(&mut *slot.mailbox());
            if requests.is_empty() {
                parked = self.changed.wait(parked).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            // Served without the lock: the other vCPUs park and leave meanwhile.
            drop(parked);
            requests.into_iter().for_each(&mut *serve);
            parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        }
        slot.mailbox().clear();
        slot.parked.store(false, Ordering::SeqCst);
        *parked -= 1;
    }

    /// Puts `request` in `slot`'s mailbox and wakes the parked threads.
    /// The wake-up is sent under the park lock after the request is in, so
    /// a thread between its mailbox check and its wait cannot miss it.
    fn ask(&self, slot: &VcpuSlot, request: VcpuRequest) {
        slot.mailbox().push(request);
        let _parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        self.changed.notify_all();
    }

    fn set(&self, flag: &AtomicBool, value: bool) {
        let _parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        flag.store(value, Ordering::SeqCst);
        self.changed.notify_all();
    }

    fn parked(&self) -> usize {
        *self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl VcpuSlot {
    fn mailbox(&self) -> std::sync::MutexGuard<'_, Vec<VcpuRequest>> {
        self.mailbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct VcpuThread {
    index: u32,
    handle: JoinHandle<()>,
    slot: Arc<VcpuSlot>,
}

/// The vCPU threads of one VM.
#[derive(Default)]
pub struct RunningVcpus {
    threads: Vec<VcpuThread>,
    control: Arc<VcpuControl>,
}

impl RunningVcpus {
    /// Starts `vcpu` on a thread of its own.
    pub fn spawn(
        &mut self,
        vcpu: Vcpu,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitHandle>,
    ) -> Result<(), VcpuError> {
        self.spawn_as(vcpu, false, pio, mmio, exit)
    }

    /// Starts `vcpu` on a thread of its own, parked from the start if
    /// `ejected` (a restored vCPU the guest had ejected).
    pub fn spawn_as(
        &mut self,
        mut vcpu: Vcpu,
        ejected: bool,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitHandle>,
    ) -> Result<(), VcpuError> {
        let index = vcpu.index;
        install_kick_handler();
        let control = self.control.clone();
        let slot = Arc::new(VcpuSlot {
            ejected: AtomicBool::new(ejected),
            ..VcpuSlot::default()
        });
        let thread_slot = slot.clone();
        let handle = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::seccomp_filters::VCPU) {
                    tracing::error!(vcpu = index, "vcpu{index}: {e}");
                    return exit.request(crate::exit::VmExit::VcpuError {
                        cpu: index,
                        message: e.to_string(),
                    });
                }
                if let Some(reason) = vcpu.run(&pio, &mmio, &control, &thread_slot) {
                    exit.request(reason);
                }
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        self.threads.push(VcpuThread {
            index,
            handle,
            slot,
        });
        Ok(())
    }

    /// Every vCPU that has a thread, by index, and whether the guest
    /// ejected it (its thread parked for good).
    pub fn threads(&self) -> Vec<(u32, bool)> {
        self.threads
            .iter()
            .map(|t| (t.index, t.slot.ejected.load(Ordering::SeqCst)))
            .collect()
    }

    /// Whether the VM is paused ([`Self::pause`] until [`Self::resume`]).
    pub fn paused(&self) -> bool {
        self.control.pause.load(Ordering::SeqCst)
    }

    /// Whether vCPU `index` has a thread (running, or parked after an eject).
    pub fn has(&self, index: u32) -> bool {
        self.threads.iter().any(|t| t.index == index)
    }

    /// Parks vCPU `index` for good (the guest ejected it) and returns once
    /// it runs no guest code.
    pub fn eject(&self, index: u32) {
        let Some(t) = self.threads.iter().find(|t| t.index == index) else {
            return;
        };
        self.control.set(&t.slot.ejected, true);
        self.kick_until(
            |t| t.index == index,
            || t.slot.parked.load(Ordering::SeqCst) || t.handle.is_finished(),
        );
    }

    /// Wakes the parked thread of ejected vCPU `index` (re-added): false if
    /// it has no thread.
    pub fn readd(&self, index: u32) -> bool {
        match self.threads.iter().find(|t| t.index == index) {
            Some(t) => {
                self.control.set(&t.slot.ejected, false);
                true
            }
            None => false,
        }
    }

    /// Parks every vCPU and returns once none is running guest code.
    pub fn pause(&self) {
        self.control.set(&self.control.pause, true);
        self.kick_until(|_| true, || self.control.parked() >= self.live());
    }

    pub fn resume(&self) {
        self.control.set(&self.control.pause, false);
    }

    /// Every vCPU's state by index, each read by its own (parked) thread,
    /// all at once. Only while paused: a vCPU's events cannot be read
    /// safely while another one runs.
    pub fn save_state(&self, caps: &Arc<StateCaps>) -> Result<Vec<(u32, VcpuState)>, VcpuError> {
        if !self.control.pause.load(Ordering::SeqCst) {
            return Err(VcpuError::NotPaused);
        }
        let mut replies = Vec::with_capacity(self.threads.len());
        for t in &self.threads {
            let index = t.index;
            if t.handle.is_finished() {
                return Err(VcpuError::NoAnswer {
                    index,
                    reason: "its thread has ended",
                });
            }
            let (reply, answer) = mpsc::channel();
            let caps = caps.clone();
            self.control
                .ask(&t.slot, VcpuRequest::SaveState { caps, reply });
            replies.push((index, answer));
        }
        replies
            .into_iter()
            .map(|(index, answer)| match answer.recv_timeout(REQUEST_WAIT) {
                Ok(Ok(state)) => Ok((index, state)),
                Ok(Err(source)) => Err(VcpuError::State { index, source }),
                Err(mpsc::RecvTimeoutError::Timeout) => Err(VcpuError::NoAnswer {
                    index,
                    reason: "no answer in time",
                }),
                Err(mpsc::RecvTimeoutError::Disconnected) => Err(VcpuError::NoAnswer {
                    index,
                    reason: "it left its park first",
                }),
            })
            .collect()
    }

    /// Asks every vCPU to stop and waits for the threads.
    pub fn stop(&mut self) {
        self.control.set(&self.control.stop, true);
        self.kick_until(|_| true, || self.live() == 0);
        for t in self.threads.drain(..) {
            let _ = t.handle.join();
        }
    }

    fn live(&self) -> usize {
        self.threads
            .iter()
            .filter(|t| !t.handle.is_finished())
            .count()
    }

    /// Kicks the threads still running that `which` picks until `done`. A
    /// kick is sent again and again: one that lands just before a thread
    /// enters KVM_RUN is lost, and a halted guest might not exit on its own
    /// for a long time.
    fn kick_until(&self, which: impl Fn(&VcpuThread) -> bool, done: impl Fn() -> bool) {
        use vmm_sys_util::signal::Killable;
        while !done() {
            for t in self
                .threads
                .iter()
                .filter(|t| which(t) && !t.handle.is_finished())
            {
                if let Err(e) = t.handle.kill(kick_signal()) {
                    tracing::warn!("kicking a vCPU thread: {e}");
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pauses, and returns a thread once it is parked.
    fn parked_thread(control: &Arc<VcpuControl>, slot: &Arc<VcpuSlot>) -> JoinHandle<()> {
        control.set(&control.pause, true);
        let (c, s) = (control.clone(), slot.clone());
        let t = std::thread::spawn(move || c.park(&s, &mut |_| {}));
        while !slot.parked.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        t
    }

    /// A fault the repair does not fix comes back at once: after
    /// MAX_REPAIRS_IN_A_ROW tries the vCPU gives up (and the VM ends with
    /// why) instead of spinning; another page, or any other exit between,
    /// starts a new count.
    #[test]
    fn the_same_fault_is_repaired_a_bounded_number_of_times_in_a_row() {
        let mut r = FaultRepairs::default();
        for _ in 0..MAX_REPAIRS_IN_A_ROW {
            assert!(r.allow(Some(0x1000_0010)));
        }
        assert!(!r.allow(Some(0x1000_0ff0)), "same page");
        assert!(r.gave_up().contains("repairs in a row"));
        assert!(r.allow(Some(0x1000_1000)), "another page");
        r.reset();
        for _ in 0..MAX_REPAIRS_IN_A_ROW {
            assert!(r.allow(None));
        }
        assert!(!r.allow(None), "no address: counted alike");
        r.reset();
        assert!(r.allow(None));
        assert_eq!(r.gave_up(), "");
    }

    #[test]
    fn a_parked_thread_wakes_on_resume_and_on_stop() {
        let control = Arc::new(VcpuControl::default());
        let slot = Arc::new(VcpuSlot::default());
        let t = parked_thread(&control, &slot);
        assert_eq!(control.parked(), 1);
        control.set(&control.pause, false);
        t.join().unwrap();
        assert_eq!(control.parked(), 0);

        let t = parked_thread(&control, &slot);
        control.set(&control.stop, true);
        t.join().unwrap();
    }

    /// A request reaches a thread already parked (the wake-up is not
    /// lost), is served there, and the thread stays parked after it.
    #[test]
    fn a_parked_thread_serves_its_mailbox_and_stays_parked() {
        let control = Arc::new(VcpuControl::default());
        let slot = Arc::new(VcpuSlot::default());
        control.set(&control.pause, true);
        let (c, s) = (control.clone(), slot.clone());
        let t = std::thread::spawn(move || {
            c.park(&s, &mut |request| match request {
                VcpuRequest::SaveState { reply, .. } => {
                    reply.send(Err(VcpuStateError::NoXcrs)).unwrap();
                }
            })
        });
        while !slot.parked.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let caps = Arc::new(StateCaps {
            xsave2_size: None,
            xcrs: false,
            tsc_khz: false,
            msrs: Vec::new(),
        });
        for _ in 0..3 {
            let (reply, answer) = mpsc::channel();
            let caps = caps.clone();
            control.ask(&slot, VcpuRequest::SaveState { caps, reply });
            let served = answer.recv_timeout(REQUEST_WAIT).unwrap();
            assert!(matches!(served, Err(VcpuStateError::NoXcrs)));
        }
        assert!(slot.parked.load(Ordering::SeqCst) && !t.is_finished());
        control.set(&control.pause, false);
        t.join().unwrap();
        assert!(slot.mailbox().is_empty());
    }

    #[test]
    fn an_ejected_vcpu_stays_parked_across_resume_until_readded() {
        let control = Arc::new(VcpuControl::default());
        let slot = Arc::new(VcpuSlot::default());
        control.set(&slot.ejected, true);
        let t = parked_thread(&control, &slot);
        control.set(&control.pause, false);
        // Resumed, but ejected: the thread must still be waiting. Another
        // thread parking and leaving proves the resume was seen.
        let other = Arc::new(VcpuSlot::default());
        let t2 = parked_thread(&control, &other);
        control.set(&control.pause, false);
        t2.join().unwrap();
        assert!(slot.parked.load(Ordering::SeqCst) && !t.is_finished());
        control.set(&slot.ejected, false);
        t.join().unwrap();
        assert!(!slot.parked.load(Ordering::SeqCst));
        assert_eq!(control.parked(), 0);
    }
}
