//! Maps new DAX ranges into the guest's view before the guest touches them,
//! with `KVM_PRE_FAULT_MEMORY` (Linux 6.10). Without it every 4 KiB of a
//! new range costs the guest a nested page fault (an exit to KVM and a host
//! fault) on its first touch: 512 per 2 MiB range where the host caches the
//! file in 4 KiB pages.
//!
//! The ioctl runs on a vCPU and takes that vCPU's lock, which a running
//! vCPU holds for as long as it is inside `KVM_RUN`, so it cannot use the
//! guest's vCPUs. The VMM creates one more KVM vCPU that never runs and is
//! never announced to the guest (no ACPI entry, no thread): with two-
//! dimensional paging KVM shares one page-table root among vCPUs of the
//! same role, so what this vCPU maps, the guest's vCPUs see. A guest that
//! sends it INIT/SIPI anyway achieves nothing: nothing runs it.
//!
//! Because it never runs, this vCPU never takes the requests KVM leaves for
//! vCPUs when their page-table root goes stale (a memory slot removed: a
//! device unplugged, a BAR moved). On the emulated host's 6.12 kernel the
//! ioctl then retried for ever inside KVM, and the device's backend thread
//! with it: a hot-plug test crawled for minutes. So each call is bounded: a
//! per-thread timer interrupts it after [`CALL_LIMIT`] (KVM gives up with
//! EINTR). A call that made no progress moves on to a spare idle vCPU, whose
//! page tables KVM builds anew when first used, and is tried once more. The
//! spares are made at boot, on the VMM's thread (the device threads that map
//! may not create vCPUs); once they are used up, or a fresh one gets nowhere
//! either, pre-faulting is off for the rest of the VM's life (the window then
//! fills only the VMM's page tables).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvm_bindings::{kvm_pre_fault_memory, CpuId, KVMIO, KVM_CAP_PRE_FAULT_MEMORY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use virtio_devices::vhost_user_fs::window::GuestPrefaulter;
use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::ioctl_iowr_nr;

ioctl_iowr_nr!(KVM_PRE_FAULT_MEMORY, KVMIO, 0xd5, kvm_pre_fault_memory);

/// The request number, for the seccomp filters of the threads that map
/// (a test checks it against the macro's).
pub const KVM_PRE_FAULT_MEMORY_NR: u64 = 0xc040_aed5;

/// Longest one pre-fault call may take before it is interrupted: far more
/// than mapping 2 MiB takes, even under the emulator or from a cold disk.
pub const CALL_LIMIT: Duration = Duration::from_millis(250);

/// Spare idle vCPUs made at boot: one is used up per burst of memory-slot
/// removals (a device unplugged, a BAR moved) followed by a DAX mapping.
pub const SPARE_VCPUS: u64 = 4;

/// A vCPU that only ever pre-faults guest memory, and its spares.
pub struct KvmPrefaulter {
    /// Idle vCPUs with their ids; the last is the one in use, the ones
    /// before it are the spares.
    vcpus: Mutex<Vec<(VcpuFd, u64)>>,
    /// Cleared when pre-faulting cannot work any more.
    working: AtomicBool,
}

/// A one-shot timer that sends the calling thread the vCPU kick signal
/// (whose handler does nothing), so a blocking ioctl returns EINTR.
struct ThreadTimer(libc::timer_t);

impl ThreadTimer {
    fn arm(after: Duration) -> io::Result<ThreadTimer> {
        // SAFETY: an all-zero sigevent is valid; the fields that matter are set below.
        let mut ev: libc::sigevent = unsafe { std::mem::zeroed() };
        ev.sigev_notify = libc::SIGEV_THREAD_ID;
        ev.sigev_signo = crate::signals::kick_signal();
        // SAFETY: gettid has no preconditions.
        ev.sigev_notify_thread_id = unsafe { libc::gettid() };
        let mut id: libc::timer_t = std::ptr::null_mut();
        // SAFETY: `ev` and `id` are valid for the call; the timer is deleted on drop.
        if unsafe { libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev, &mut id) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let timer = ThreadTimer(id);
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_nsec: libc::c_long::from(after.subsec_nanos()),
            },
        };
        // SAFETY: `timer.0` was just created; `spec` is valid for the call.
        if unsafe { libc::timer_settime(timer.0, 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(timer)
    }
}

impl Drop for ThreadTimer {
    fn drop(&mut self) {
        // SAFETY: the timer was created by `arm` and is deleted once; a
        // signal already queued is absorbed by the no-op handler.
        unsafe { libc::timer_delete(self.0) };
    }
}

impl KvmPrefaulter {
    /// A prefaulter for `vm`, or None where the host's KVM lacks the ioctl.
    /// `id` must be a vCPU id the guest's vCPUs do not use; `cpuid` is the
    /// guest's (KVM sizes its page tables from the guest's address width).
    /// `id` and the [`SPARE_VCPUS`] ids after it must be vCPU ids the
    /// guest's vCPUs do not use.
    pub fn new(kvm: &Kvm, vm: &VmFd, id: u64, cpuid: &CpuId) -> Option<KvmPrefaulter> {
        if kvm.check_extension_raw(u64::from(KVM_CAP_PRE_FAULT_MEMORY)) <= 0 {
            tracing::info!("KVM has no KVM_PRE_FAULT_MEMORY: DAX ranges fault in page by page");
            return None;
        }
        // Used from the last: the first in use is `id`.
        let vcpus = (id..=id + SPARE_VCPUS)
            .rev()
            .map(|i| idle_vcpu(vm, i, cpuid).map(|v| (v, i)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                tracing::warn!("no pre-fault vCPUs ({e}): DAX ranges fault in page by page")
            })
            .ok()?;
        // The timer's signal must find its (no-op) handler in place.
        crate::signals::install_kick_handler();
        Some(KvmPrefaulter {
            vcpus: Mutex::new(vcpus),
            working: AtomicBool::new(true),
        })
    }

    /// One bounded KVM_PRE_FAULT_MEMORY; the bytes done, or the error if none.
    fn call(vcpu: &VcpuFd, gpa: u64, len: u64) -> io::Result<u64> {
        let mut range = kvm_pre_fault_memory {
            gpa,
            size: len,
            ..Default::default()
        };
        let _timer = ThreadTimer::arm(CALL_LIMIT)?;
        // SAFETY: KVM_PRE_FAULT_MEMORY reads and updates the range struct,
        // which lives for the call; the fd is this VM's idle vCPU.
        let r = unsafe { ioctl_with_mut_ref(vcpu, KVM_PRE_FAULT_MEMORY(), &mut range) };
        let err = io::Error::last_os_error();
        // KVM advances gpa/size as it goes, also when it stops early
        // (EINTR, EAGAIN): what it did counts either way.
        let done = len - range.size.min(len);
        if r < 0 && done == 0 {
            return Err(err);
        }
        Ok(done)
    }
}

fn idle_vcpu(vm: &VmFd, id: u64, cpuid: &CpuId) -> Result<VcpuFd, kvm_ioctls::Error> {
    let vcpu = vm.create_vcpu(id)?;
    vcpu.set_cpuid2(cpuid)?;
    Ok(vcpu)
}

impl GuestPrefaulter for KvmPrefaulter {
    fn available(&self) -> bool {
        self.working.load(Ordering::Relaxed)
    }

    fn prefault(&self, gpa: u64, len: u64) -> io::Result<u64> {
        let mut vcpus = self.vcpus.lock().unwrap_or_else(|p| p.into_inner());
        let mut last_err = io::Error::from_raw_os_error(libc::EINTR);
        // The vCPU in use, then (once) a fresh spare.
        for attempt in 0..2 {
            let Some((vcpu, id)) = vcpus.last() else {
                break;
            };
            match Self::call(vcpu, gpa, len) {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => last_err = e,
                other => return other,
            }
            // No progress in the time given: the page tables it would fill
            // went stale. A spare gets new ones when it is first used.
            let stale = *id;
            vcpus.pop();
            match vcpus.last() {
                Some((_, next)) if attempt == 0 => {
                    tracing::info!("pre-fault vCPU {stale} went stale; vCPU {next} takes over");
                }
                _ => break,
            }
        }
        if self.working.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "KVM_PRE_FAULT_MEMORY made no progress in {CALL_LIMIT:?} and no spare vCPU helped: new DAX ranges fault in page by page from now on"
            );
        }
        Err(last_err)
    }
}

/// Pages `mincore` looks at per call: bounds the vector it fills.
const MINCORE_CHUNK_PAGES: usize = 16384;

/// Calls `each(gpa, len)` for every run of `mem`'s pages the host holds
/// (`mincore` over each region's mapping; for guest RAM, a memfd or
/// hugetlbfs file, that is the page cache), in address order, until it
/// returns false. Pages the host does not hold are never passed: mapping
/// them for the guest would allocate them.
pub fn for_each_resident_run(
    mem: &crate::memory::GuestMemoryMmap,
    mut each: impl FnMut(u64, u64) -> bool,
) {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    const PAGE: usize = 4096;
    let mut vec = vec![0u8; MINCORE_CHUNK_PAGES];
    // The run being gathered, passed on when it ends.
    let mut run: Option<(u64, u64)> = None;
    for region in mem.iter() {
        let Ok(len) = usize::try_from(region.len()) else {
            continue;
        };
        let host = region.as_ptr();
        let base = region.start_addr().0;
        let mut done = 0usize;
        while done < len {
            let chunk = (len - done).min(MINCORE_CHUNK_PAGES * PAGE);
            let pages = chunk.div_ceil(PAGE);
            // SAFETY: `[host + done, + chunk)` lies in the region's
            // mapping, which lives as long as `mem`; `vec` holds a byte
            // for each of its `pages` pages.
            let r = unsafe { libc::mincore(host.add(done).cast(), chunk, vec.as_mut_ptr()) };
            if r != 0 {
                tracing::debug!(
                    "mincore over guest RAM at {:#x}: {}",
                    base + done as u64,
                    io::Error::last_os_error()
                );
                return;
            }
            for (i, v) in vec[..pages].iter().enumerate() {
                let gpa = base + (done + i * PAGE) as u64;
                if v & 1 == 0 {
                    continue;
                }
                match &mut run {
                    Some((start, l)) if *start + *l == gpa => *l += PAGE as u64,
                    _ => {
                        if let Some((start, l)) = run.replace((gpa, PAGE as u64)) {
                            if !each(start, l) {
                                return;
                            }
                        }
                    }
                }
            }
            done += chunk;
        }
    }
    if let Some((start, l)) = run {
        each(start, l);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_number_the_filters_allow_is_the_ioctls() {
        assert_eq!(KVM_PRE_FAULT_MEMORY() as u64, KVM_PRE_FAULT_MEMORY_NR);
    }

    /// Against the real KVM, where it has the ioctl: a range of a memory
    /// slot is mapped (KVM counts its pages), and after the slot is removed
    /// and another added — what leaves the idle vCPU's page tables stale —
    /// a call returns within its limits, mapping (on a fresh idle vCPU) or
    /// giving up, never hanging.
    #[test]
    fn prefaults_a_slot_and_never_hangs_after_slots_change() {
        use kvm_bindings::kvm_userspace_memory_region;
        let Ok(kvm) = Kvm::new() else {
            eprintln!("no /dev/kvm; skipped");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        let cpuid = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .unwrap();
        let Some(p) = KvmPrefaulter::new(&kvm, &vm, 1, &cpuid) else {
            eprintln!("KVM has no KVM_PRE_FAULT_MEMORY here; skipped");
            return;
        };
        const SIZE: usize = 2 << 20;
        // SAFETY: a fresh anonymous mapping, unmapped when the test ends.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(mem, libc::MAP_FAILED);
        let region = |slot: u32, gpa: u64, size: usize, off: usize| kvm_userspace_memory_region {
            slot,
            guest_phys_addr: gpa,
            memory_size: size as u64,
            userspace_addr: mem as u64 + off as u64,
            flags: 0,
        };
        // SAFETY: the regions point into `mem`, which outlives the VM's use of them.
        unsafe { vm.set_user_memory_region(region(0, 0x10_0000_0000, SIZE, 0)) }.unwrap();
        assert_eq!(
            p.prefault(0x10_0000_0000, SIZE as u64).unwrap(),
            SIZE as u64
        );
        // Remove the slot and add another.
        // SAFETY: as above; size 0 deletes the slot.
        unsafe { vm.set_user_memory_region(region(0, 0x10_0000_0000, 0, 0)) }.unwrap();
        // SAFETY: as above.
        unsafe { vm.set_user_memory_region(region(1, 0x20_0000_0000, SIZE, SIZE)) }.unwrap();
        let started = std::time::Instant::now();
        let r = p.prefault(0x20_0000_0000, SIZE as u64);
        assert!(
            started.elapsed() < CALL_LIMIT * 4,
            "{:?}",
            started.elapsed()
        );
        match r {
            Ok(n) => assert!(n > 0 && p.available()),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EINTR), "{e}");
                assert!(!p.available(), "a call that got nowhere turns it off");
            }
        }
        drop(vm);
        // SAFETY: unmapping what was mapped above, after the VM is gone.
        unsafe { libc::munmap(mem, 2 * SIZE) };
    }
}
