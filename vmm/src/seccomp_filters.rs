//! The VMM's seccomp allowlists, one per kind of thread, as Cloud
//! Hypervisor and Firecracker install them. Each thread installs its own
//! filter when it starts ([`seccomp::enter_thread`]); the main thread's
//! (the control loop: VM creation, boot, devices, the API's requests) is
//! installed first thing in `main`, so every other thread runs under it
//! too and under its own, narrower one: a call passes only if both allow it.
//!
//! `ioctl` is allowed without argument checks on the main and vCPU threads
//! (KVM's interface is ioctls), and only for FIONBIO/FIOCLEX elsewhere (plus
//! `KVM_PRE_FAULT_MEMORY` where DAX ranges are mapped). No thread
//! may execute programs, ptrace, mount, change namespaces or credentials.
#![allow(clippy::wildcard_imports)]

use libc::*;
use seccomp::Allow;

pub const VMM: &str = "vmm";
pub const VCPU: &str = "vcpu";
pub const SERIAL_INPUT: &str = "serial-input";
pub const ACTIVATOR: &str = "device-activator";
pub use api::API_THREAD as API;
pub use virtio_devices::DEVICE_WORKER_THREAD as DEVICE_WORKER;

/// What every Rust thread needs: memory, futexes, signals, time, exit.
const COMMON: &[i64] = &[
    SYS_read,
    SYS_write,
    SYS_readv,
    SYS_writev,
    SYS_close,
    SYS_futex,
    SYS_mmap,
    SYS_munmap,
    SYS_mprotect,
    SYS_madvise,
    SYS_mremap,
    SYS_brk,
    SYS_rt_sigaction,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sigaltstack,
    SYS_exit,
    SYS_exit_group,
    SYS_gettid,
    SYS_getpid,
    SYS_tgkill,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_nanosleep,
    SYS_sched_yield,
    SYS_getrandom,
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    SYS_eventfd2,
    SYS_fcntl,
    SYS_dup,
    SYS_rseq,
    SYS_set_robust_list,
    SYS_sched_getaffinity,
    SYS_prctl,
    SYS_poll,
    SYS_ppoll,
    SYS_restart_syscall,
    SYS_membarrier,
    SYS_fstat,
    SYS_statx,
    SYS_newfstatat,
    SYS_lseek,
];

/// A device worker: relays interrupts, serves the backend request channel
/// (SHMEM_MAP with a passed fd: mmap MAP_FIXED into the window), pmem
/// flushes.
const DEVICE_WORKER_CALLS: &[i64] = &[
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_recvfrom,
    SYS_sendto,
    SYS_fsync,
    SYS_fdatasync,
    SYS_msync,
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_mincore,
    // The timer that bounds a DAX pre-fault (prefault.rs).
    SYS_timer_create,
    SYS_timer_settime,
    SYS_timer_delete,
    // The DAX window: a descriptor and an inotify watch of each mapped
    // file (truncation), its once-a-second tick, emptying the scratch.
    SYS_inotify_init1,
    SYS_inotify_add_watch,
    SYS_inotify_rm_watch,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_fallocate,
];

/// The API thread: its socket, the daemons' control sockets (connect), the
/// process's own /proc (page faults).
const API_CALLS: &[i64] = &[
    SYS_accept4,
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_recvfrom,
    SYS_sendto,
    SYS_shutdown,
    SYS_socket,
    SYS_connect,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_getsockname,
    SYS_getpeername,
    SYS_openat,
    SYS_pipe2,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_getrusage,
];

/// A vCPU: KVM_RUN and register access, and the device registers it
/// reaches (KVM ioctls when the guest moves a BAR or programs MSI-X).
/// Device activation and reset, and with them every vhost-user round trip
/// and thread creation, run on the device activator instead.
const VCPU_CALLS: &[i64] = &[
    SYS_ioctl,
    SYS_pread64,
    SYS_pwrite64,
    SYS_fsync,
    SYS_fdatasync,
    SYS_msync,
    SYS_mincore,
    SYS_kill,
    // A memory fault in a DAX window: the scratch shown over a truncated
    // file's vanished pages (mmap MAP_FIXED, emptied with fallocate).
    SYS_fallocate,
    SYS_inotify_rm_watch,
];

const SERIAL_INPUT_CALLS: &[i64] = &[];

/// The device activator: vhost-user round trips, the device workers it
/// starts, a watchdog that shuts down the socket of a daemon that stopped
/// answering. A thread runs under the filters of every thread above it,
/// so the workers' own calls (DEVICE_WORKER_CALLS) are allowed here too.
const ACTIVATOR_CALLS: &[i64] = &[
    SYS_socketpair,
    SYS_shutdown,
    SYS_clone,
    SYS_clone3,
    SYS_seccomp,
];

/// The main thread (and so an upper bound for every thread).
const VMM_CALLS: &[i64] = &[
    SYS_ioctl,
    SYS_timer_create,
    SYS_timer_settime,
    SYS_timer_delete,
    SYS_openat,
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_clone,
    SYS_clone3,
    SYS_socket,
    SYS_connect,
    SYS_bind,
    SYS_listen,
    SYS_accept4,
    SYS_socketpair,
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_recvfrom,
    SYS_sendto,
    SYS_shutdown,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_getsockname,
    SYS_getpeername,
    SYS_unlink,
    SYS_unlinkat,
    // The API socket is bound under a temporary name and renamed into
    // place, so it never appears before it listens (glibc's rename is
    // one of the three, by version).
    SYS_rename,
    SYS_renameat,
    SYS_renameat2,
    SYS_chmod,
    SYS_fchmod,
    SYS_fchmodat,
    SYS_memfd_create,
    SYS_inotify_init1,
    SYS_inotify_add_watch,
    SYS_inotify_rm_watch,
    SYS_ftruncate,
    SYS_fallocate,
    SYS_fsync,
    SYS_fdatasync,
    SYS_msync,
    SYS_mincore,
    SYS_kill,
    SYS_wait4,
    SYS_pipe2,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_getcwd,
    SYS_readlink,
    SYS_readlinkat,
    SYS_uname,
    SYS_sysinfo,
    SYS_prlimit64,
    SYS_getrlimit,
    SYS_getuid,
    SYS_geteuid,
    SYS_getgid,
    SYS_getegid,
    SYS_sched_setaffinity,
    SYS_set_tid_address,
    SYS_getdents64,
    SYS_dup3,
    SYS_rt_sigtimedwait,
    SYS_signalfd4,
    SYS_access,
    SYS_faccessat,
    SYS_faccessat2,
    SYS_getppid,
    SYS_mlock,
    SYS_munlock,
    SYS_umask,
    SYS_getrusage,
    // Threads started from here install their own (narrower) filter.
    SYS_seccomp,
];

/// A device worker maps new DAX ranges into the guest's view (on the VMM's
/// idle pre-fault vCPU, see `prefault.rs`): that one KVM ioctl, no other.
const PREFAULT_IOCTL: Allow = Allow::Arg(SYS_ioctl, 1, &[crate::prefault::KVM_PRE_FAULT_MEMORY_NR]);

fn with(extra: &[i64], ioctl_any: bool) -> Vec<Allow> {
    let mut v = seccomp::calls(COMMON);
    v.extend(seccomp::calls(extra));
    if !ioctl_any {
        v.push(seccomp::IOCTL_FD_FLAGS_ONLY);
    }
    v
}

/// Every thread kind's allowlist, for [`seccomp::register`].
pub fn all() -> Vec<(&'static str, Vec<Allow>)> {
    vec![
        (VMM, with(VMM_CALLS, true)),
        (VCPU, with(VCPU_CALLS, true)),
        (API, with(API_CALLS, false)),
        (DEVICE_WORKER, {
            let mut v = with(DEVICE_WORKER_CALLS, false);
            v.push(PREFAULT_IOCTL);
            v
        }),
        (SERIAL_INPUT, with(SERIAL_INPUT_CALLS, false)),
        (ACTIVATOR, {
            let mut v = with(ACTIVATOR_CALLS, false);
            v.extend(seccomp::calls(DEVICE_WORKER_CALLS));
            v.push(PREFAULT_IOCTL);
            v
        }),
    ]
}

/// Registers every kind's filter and installs the main thread's.
pub fn install(mode: seccomp::Mode) -> Result<(), seccomp::SeccompError> {
    if mode == seccomp::Mode::Kill {
        seccomp::install_sigsys_report()
            .map_err(|e| seccomp::SeccompError::Handler(e.to_string()))?;
    }
    seccomp::register(&all(), mode)?;
    seccomp::enter_thread(VMM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_kind_is_a_subset_of_the_main_threads_list() {
        // Threads start under the main thread's filter: a call it does not
        // allow would be refused whatever the thread's own list says.
        let main: std::collections::BTreeSet<i64> =
            COMMON.iter().chain(VMM_CALLS).copied().collect();
        for (kind, extra) in [
            (VCPU, VCPU_CALLS),
            (API, API_CALLS),
            (DEVICE_WORKER, DEVICE_WORKER_CALLS),
            (ACTIVATOR, ACTIVATOR_CALLS),
        ] {
            for nr in extra {
                assert!(
                    main.contains(nr),
                    "{kind} allows syscall {nr}, which the main thread's filter refuses"
                );
            }
        }
        for (kind, list) in all() {
            assert!(seccomp::build(kind, &list, seccomp::Mode::Kill)
                .unwrap()
                .is_some());
        }
    }

    /// Filters stack: a device worker runs under the activator's filter
    /// (which started it) as well as its own. A call the worker needs that
    /// the activator's list lacks kills the VMM (seen: recvfrom, when
    /// workers were started from vCPUs).
    #[test]
    fn device_workers_calls_pass_the_filter_of_the_thread_that_starts_them() {
        let activator = all()
            .into_iter()
            .find(|(k, _)| *k == ACTIVATOR)
            .map(|(_, l)| l)
            .unwrap();
        for nr in DEVICE_WORKER_CALLS.iter().chain(COMMON) {
            assert!(
                activator.contains(&Allow::Call(*nr)),
                "a device worker needs syscall {nr}, which the activator's filter refuses"
            );
        }
    }

    #[test]
    fn threads_that_start_threads_let_them_install_their_own_filter() {
        // The main thread starts the API thread, vCPUs and the activator;
        // the activator starts device workers. Each new thread calls seccomp(2).
        for (kind, extra) in [(VMM, VMM_CALLS), (ACTIVATOR, ACTIVATOR_CALLS)] {
            for nr in [SYS_clone3, SYS_seccomp] {
                assert!(
                    extra.contains(&nr),
                    "{kind} starts threads but does not allow syscall {nr}"
                );
            }
        }
    }
}
