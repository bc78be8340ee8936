//! The VMM's seccomp allowlists, one per kind of thread, as Cloud
//! Hypervisor and Firecracker install them. Each thread installs its own
//! filter when it starts ([`seccomp::enter_thread`]); the main thread's
//! (the control loop: VM creation, boot, devices, the API's requests) is
//! installed first thing in `main`, so every other thread runs under it
//! too and under its own, narrower one: a call passes only if both allow it.
//!
//! `ioctl` is allowed without argument checks on the main thread (it makes
//! the VM: dozens of KVM requests, and the terminal's), on a vCPU only for
//! the KVM requests a vCPU makes ([`VCPU_IOCTLS`]), and only for
//! FIONBIO/FIOCLEX elsewhere (plus `KVM_PRE_FAULT_MEMORY` where DAX ranges
//! are mapped). Signals go only to the VMM's own threads (`tgkill` with its
//! own pid; no `kill`), sockets are only unix stream sockets, `prctl` only
//! names a new thread and sets `no_new_privs` for its filter, and only the
//! main thread opens files (see [`VMM_OPEN_FLAGS`]). No thread may execute
//! programs, ptrace, mount, change namespaces or credentials.
#![allow(clippy::wildcard_imports)]

use libc::*;
use seccomp::{Allow, Cond};

pub const VMM: &str = "vmm";
pub const VCPU: &str = "vcpu";
pub const SERIAL_INPUT: &str = "serial-input";
pub const ACTIVATOR: &str = "device-activator";
pub use api::API_THREAD as API;
pub use virtio_devices::net::NET_WORKER_THREAD as NET_WORKER;
pub use virtio_devices::vsock::VSOCK_WORKER_THREAD as VSOCK_WORKER;
pub use virtio_devices::BLOCK_IO_THREAD as BLOCK_IO;
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
    // The timer that bounds a DAX pre-fault (`memory::prefault`).
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

/// A virtio-blk I/O thread (`virtio_devices::block::io`): positioned
/// reads and writes between the image and guest memory, flushes, and
/// fallocate for DISCARD / WRITE_ZEROES; completing a request, it writes
/// the guest's irqfd and the queue thread's eventfd (`write`, in
/// [`COMMON`]). No sockets, no KVM, no mmap of files, no opens: the image
/// was opened by the main thread. Started by the device activator, so
/// also under its filter.
const BLOCK_IO_CALLS: &[i64] = &[
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_fsync,
    SYS_fdatasync,
    SYS_fallocate,
];

/// The vsock device's thread (started by the main thread with the device,
/// not by the activator): accepts host connections on the device's
/// listener, connects to `<socket>_<port>` listeners for the guest (a
/// non-blocking unix stream socket, [`VSOCK_SOCKETS`]), moves bytes, shuts
/// down halves, reads its deadline timer; when it stops, unlinks the
/// device's socket (the backend is dropped on this thread). No file opens,
/// no other family.
const VSOCK_WORKER_CALLS: &[i64] = &[
    SYS_unlink,
    SYS_accept4,
    SYS_connect,
    SYS_shutdown,
    SYS_recvfrom,
    SYS_sendto,
    SYS_recvmsg,
    SYS_sendmsg,
];

/// A virtio-net queue pair's thread (started by the device activator,
/// so also under its filter): frames are read from and written to the tap
/// with readv/writev (straight between the tap and guest memory) and
/// waited for with epoll, all in [`COMMON`]. No
/// ioctl at all (the activator sets the tap's offloads), no sockets, no
/// opens.
const NET_WORKER_CALLS: &[i64] = &[];

/// What the device activator may ask of a tap: which offloads it takes
/// from the guest's acked features (`TUNSETOFFLOAD`), nothing else.
const NET_OFFLOAD_IOCTL: Allow = Allow::Arg(SYS_ioctl, 1, &[TUNSETOFFLOAD]);

/// The API thread: its socket, the daemons' control sockets (connect; the
/// socket itself is [`API_SOCKETS`]). It opens no file: page-fault counts
/// come from getrusage.
const API_CALLS: &[i64] = &[
    SYS_accept4,
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_recvfrom,
    SYS_sendto,
    SYS_shutdown,
    SYS_connect,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_getsockname,
    SYS_getpeername,
    SYS_pipe2,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_getrusage,
];

/// A vCPU: KVM_RUN, and the device registers it reaches ([`VCPU_IOCTLS`]
/// when the guest moves a BAR or programs MSI-X; eventfd writes for queue
/// notifications and interrupts). Device activation and reset, and with
/// them every vhost-user round trip and thread creation, run on the device
/// activator instead.
const VCPU_CALLS: &[i64] = &[
    SYS_pread64,
    SYS_pwrite64,
    SYS_fsync,
    SYS_fdatasync,
    SYS_msync,
    SYS_mincore,
    // A memory fault in a DAX window: the scratch shown over a truncated
    // file's vanished pages (mmap MAP_FIXED, emptied with fallocate).
    SYS_fallocate,
    SYS_inotify_rm_watch,
];

// KVM request numbers (<linux/kvm.h>; a test derives each from its
// structure's size as the kernel does).
pub const KVM_RUN: u64 = 0xae80;
pub const KVM_GET_REGS: u64 = 0x8090_ae81;
pub const KVM_SET_USER_MEMORY_REGION: u64 = 0x4020_ae46;
pub const KVM_IOEVENTFD: u64 = 0x4040_ae79;
pub const KVM_IRQFD: u64 = 0x4020_ae76;
pub const KVM_SET_GSI_ROUTING: u64 = 0x4008_ae6a;
// What a parked vCPU reads to save its state (`vcpu::state`).
pub const KVM_GET_SREGS: u64 = 0x8138_ae83;
pub const KVM_GET_MSRS: u64 = 0xc008_ae88;
pub const KVM_GET_LAPIC: u64 = 0x8400_ae8e;
pub const KVM_GET_CPUID2: u64 = 0xc008_ae91;
pub const KVM_GET_MP_STATE: u64 = 0x8004_ae98;
pub const KVM_GET_VCPU_EVENTS: u64 = 0x8040_ae9f;
pub const KVM_GET_DEBUGREGS: u64 = 0x8080_aea1;
pub const KVM_GET_TSC_KHZ: u64 = 0xaea3;
pub const KVM_GET_XSAVE: u64 = 0x9000_aea4;
pub const KVM_GET_XCRS: u64 = 0x8188_aea6;
pub const KVM_GET_XSAVE2: u64 = 0x9000_aecf;

/// The ioctls a vCPU thread makes: running the guest; its registers for an
/// error message (the rip of an unhandled exit); a BAR the guest moves
/// (its memory slot deleted and made again, its queue-notify ioeventfds
/// moved: `device_manager::virtio_pci`, `device_manager::address_space`); MSI-X entries the guest
/// programs or masks (routes and irqfds: `device_manager::gsi_routing`); and what std
/// sets on fds; while parked, the reads that save its state (the writes
/// that restore one run on the main thread, into a vCPU not yet started).
/// Not: creating vCPUs, devices or memory fds, KVM_GET_STATS_FD
/// (opened on the main thread at boot), nor anything on a non-KVM fd.
pub const VCPU_IOCTLS: &[u64] = &[
    KVM_RUN,
    KVM_GET_REGS,
    KVM_GET_SREGS,
    KVM_GET_MSRS,
    KVM_GET_LAPIC,
    KVM_GET_CPUID2,
    KVM_GET_MP_STATE,
    KVM_GET_VCPU_EVENTS,
    KVM_GET_DEBUGREGS,
    KVM_GET_TSC_KHZ,
    KVM_GET_XSAVE,
    KVM_GET_XCRS,
    KVM_GET_XSAVE2,
    KVM_SET_USER_MEMORY_REGION,
    KVM_IOEVENTFD,
    KVM_IRQFD,
    KVM_SET_GSI_ROUTING,
    FIONBIO,
    FIOCLEX,
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

/// The main thread (and so an upper bound for every thread). Its sockets
/// are [`VMM_SOCKETS`], the files it opens [`VMM_OPEN_FLAGS`].
const VMM_CALLS: &[i64] = &[
    SYS_ioctl,
    SYS_timer_create,
    SYS_timer_settime,
    SYS_timer_delete,
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_clone,
    SYS_clone3,
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
    SYS_wait4,
    SYS_pipe2,
    SYS_timerfd_create,
    SYS_timerfd_settime,
    SYS_getcwd,
    SYS_readlink,
    SYS_readlinkat,
    SYS_uname,
    SYS_sysinfo,
    // Raising RLIMIT_NOFILE for the API's connections (glibc's setrlimit
    // is prlimit64; the older call for other libcs).
    SYS_prlimit64,
    SYS_getrlimit,
    SYS_setrlimit,
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
/// idle pre-fault vCPU, see `memory::prefault`): that one KVM ioctl, no other.
const PREFAULT_IOCTL: Allow = Allow::Arg(
    SYS_ioctl,
    1,
    &[crate::memory::prefault::KVM_PRE_FAULT_MEMORY_NR],
);

/// What a thread that starts threads needs of `prctl`: the new thread is
/// named (std: PR_SET_NAME) and sets `no_new_privs` before installing its
/// own filter (seccompiler), both under this thread's filter. Nothing else
/// (no PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_PDEATHSIG, PR_SET_MM…).
const THREAD_START_PRCTL: Allow = Allow::Arg(
    SYS_prctl,
    0,
    &[PR_SET_NAME as u64, PR_SET_NO_NEW_PRIVS as u64],
);

/// A unix stream socket as std makes one (the API socket's bind and its
/// stale-socket probe, vhost-user connects), and as tokio makes one
/// (non-blocking: the API thread's connects to the daemons' control
/// sockets). No other family (no network), no other type.
const UNIX_STREAM: &[Cond] = &[
    Cond::eq(0, AF_UNIX as u32),
    Cond::eq(1, (SOCK_STREAM | SOCK_CLOEXEC) as u32),
    Cond::eq(2, 0),
];
const UNIX_STREAM_NONBLOCK: &[Cond] = &[
    Cond::eq(0, AF_UNIX as u32),
    Cond::eq(1, (SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK) as u32),
    Cond::eq(2, 0),
];
/// The socket the main thread gives a tap its host address, netmask, MTU
/// and link state through (SIOCSIF* ioctls); no data crosses it.
const INET_DGRAM: &[Cond] = &[
    Cond::eq(0, AF_INET as u32),
    Cond::eq(1, (SOCK_DGRAM | SOCK_CLOEXEC) as u32),
    Cond::eq(2, 0),
];
/// A migration over TCP (`tcp:` URLs): the main thread connects to the
/// receiver or listens for the sender, as std makes the sockets.
const INET_STREAM: &[Cond] = &[
    Cond::eq(0, AF_INET as u32),
    Cond::eq(1, (SOCK_STREAM | SOCK_CLOEXEC) as u32),
    Cond::eq(2, 0),
];
const INET6_STREAM: &[Cond] = &[
    Cond::eq(0, AF_INET6 as u32),
    Cond::eq(1, (SOCK_STREAM | SOCK_CLOEXEC) as u32),
    Cond::eq(2, 0),
];
pub const VMM_SOCKETS: &[&[Cond]] = &[
    UNIX_STREAM,
    UNIX_STREAM_NONBLOCK,
    INET_DGRAM,
    INET_STREAM,
    INET6_STREAM,
];
pub const API_SOCKETS: &[&[Cond]] = &[UNIX_STREAM_NONBLOCK];
pub const VSOCK_SOCKETS: &[&[Cond]] = &[UNIX_STREAM_NONBLOCK];

/// The `openat` flag bits that say what an open may do to a file: its
/// access mode and whether it creates, truncates or only names one. The
/// others (O_CLOEXEC, O_NONBLOCK, O_DIRECTORY, O_NOFOLLOW…) are free.
/// O_TMPFILE is O_DIRECTORY plus a bit of its own; only that bit is here.
const OPEN_EFFECT_BITS: u32 =
    (O_ACCMODE | O_CREAT | O_EXCL | O_TRUNC | O_APPEND | O_PATH | (O_TMPFILE & !O_DIRECTORY))
        as u32;
const fn open_as(flags: c_int) -> [Cond; 1] {
    // The kernel compares the flags' bits: reinterpreted, not converted.
    [Cond::masked(2, OPEN_EFFECT_BITS, flags.cast_unsigned())]
}
/// Kernel, initramfs, the rng source, a read-only (discard_writes) pmem file.
const OPEN_READ: &[Cond] = &open_as(O_RDONLY);
/// /dev/kvm, a pmem file.
const OPEN_READ_WRITE: &[Cond] = &open_as(O_RDWR);
/// A pmem backing made in a directory: an unnamed file, gone when closed.
const OPEN_UNNAMED_FILE: &[Cond] = &open_as(O_RDWR | (O_TMPFILE & !O_DIRECTORY));
/// `--serial file=`: created if missing, appended to, never truncated.
const OPEN_APPEND_CREATE: &[Cond] = &open_as(O_WRONLY | O_CREAT | O_APPEND);
/// Every way the main thread opens a file. Seccomp cannot see the path:
/// the VM's files come from the command line or a `vm.create` request, so
/// any path the VMM's user can read (or write, for these modes) stays
/// reachable. What is shut is truncating (O_TRUNC), creating other than
/// by appending (O_CREAT with O_RDWR or without O_APPEND, O_EXCL), and
/// O_PATH. Only the main thread has `openat` at all.
pub const VMM_OPEN_FLAGS: &[&[Cond]] = &[
    OPEN_READ,
    OPEN_READ_WRITE,
    OPEN_UNNAMED_FILE,
    OPEN_APPEND_CREATE,
];

/// COMMON, `extra`, and signals to this process's threads only (`pid`):
/// the vCPU kicks (pthread_kill) and abort's raise are tgkill with the
/// VMM's pid. No thread may signal another process.
fn base(pid: u32, extra: &[i64]) -> Vec<Allow> {
    let mut v = seccomp::calls(COMMON);
    v.extend(seccomp::calls(extra));
    v.push(Allow::ArgIs(SYS_tgkill, 0, u64::from(pid)));
    v
}

fn each(nr: i64, rules: &'static [&'static [Cond]]) -> impl Iterator<Item = Allow> {
    rules.iter().map(move |r| Allow::All(nr, r))
}

/// Every thread kind's allowlist, for [`seccomp::register`].
pub fn all() -> Vec<(&'static str, Vec<Allow>)> {
    all_for(std::process::id())
}

/// Every thread kind's allowlist for the process `pid`.
pub fn all_for(pid: u32) -> Vec<(&'static str, Vec<Allow>)> {
    let fd_flags = seccomp::IOCTL_FD_FLAGS_ONLY;
    let mut vmm = base(pid, VMM_CALLS);
    vmm.push(THREAD_START_PRCTL);
    vmm.extend(each(SYS_socket, VMM_SOCKETS));
    vmm.extend(each(SYS_openat, VMM_OPEN_FLAGS));
    let mut vcpu = base(pid, VCPU_CALLS);
    vcpu.push(Allow::Arg(SYS_ioctl, 1, VCPU_IOCTLS));
    let mut api = base(pid, API_CALLS);
    api.push(fd_flags);
    api.extend(each(SYS_socket, API_SOCKETS));
    let mut worker = base(pid, DEVICE_WORKER_CALLS);
    worker.extend([fd_flags, PREFAULT_IOCTL]);
    let mut vsock = base(pid, VSOCK_WORKER_CALLS);
    vsock.push(fd_flags);
    vsock.extend(each(SYS_socket, VSOCK_SOCKETS));
    let mut serial = base(pid, SERIAL_INPUT_CALLS);
    serial.push(fd_flags);
    let block_io = base(pid, BLOCK_IO_CALLS);
    let mut activator = base(pid, ACTIVATOR_CALLS);
    activator.extend(seccomp::calls(DEVICE_WORKER_CALLS));
    activator.extend([
        fd_flags,
        PREFAULT_IOCTL,
        THREAD_START_PRCTL,
        NET_OFFLOAD_IOCTL,
    ]);
    let net_worker = base(pid, NET_WORKER_CALLS);
    vec![
        (VMM, vmm),
        (VCPU, vcpu),
        (API, api),
        (DEVICE_WORKER, worker),
        (VSOCK_WORKER, vsock),
        (SERIAL_INPUT, serial),
        (ACTIVATOR, activator),
        (BLOCK_IO, block_io),
        (NET_WORKER, net_worker),
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
#[path = "seccomp_filters_tests.rs"]
mod tests;
