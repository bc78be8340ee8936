//! The daemon's seccomp allowlist: one filter for the whole process,
//! installed on the main thread once the sandbox is entered and before any
//! other thread starts, so every thread (vhost-user queues, workers, the
//! control socket) inherits it. What is not here: anything that executes,
//! mounts, changes namespaces or credentials, traces, loads modules or
//! opens sockets (the two sockets are bound before the filter). `ioctl` is
//! allowed for FIONBIO/FIOCLEX only.
#![allow(clippy::wildcard_imports)]

use libc::*;
use seccomp::Allow;

/// `ioctl` requests allowed: non-blocking and close-on-exec flags (std,
/// tokio), and nothing else.
const IOCTLS: &[u64] = &[FIONBIO, FIOCLEX];

/// The daemon's allowlist.
pub fn serving() -> Vec<Allow> {
    let mut v = seccomp::calls(SERVING);
    v.push(Allow::Arg(SYS_ioctl, 1, IOCTLS));
    v
}

/// Every system call the daemon makes while serving (x86-64), but `ioctl`.
const SERVING: &[i64] = &[
    // Memory and threads (the Rust runtime, tokio, vhost-user-backend).
    SYS_brk,
    SYS_mmap,
    SYS_munmap,
    SYS_mprotect,
    SYS_madvise,
    SYS_mremap,
    SYS_clone,
    SYS_clone3,
    SYS_set_robust_list,
    SYS_rseq,
    SYS_futex,
    SYS_sched_yield,
    SYS_sched_getaffinity,
    SYS_exit,
    SYS_exit_group,
    SYS_gettid,
    SYS_getpid,
    SYS_tgkill,
    SYS_rt_sigaction,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sigaltstack,
    SYS_prctl,
    SYS_getrandom,
    SYS_clock_gettime,
    SYS_clock_nanosleep,
    SYS_nanosleep,
    SYS_membarrier,
    SYS_capget,
    SYS_capset,
    // Event loops and sockets already open.
    SYS_epoll_create1,
    SYS_epoll_ctl,
    SYS_epoll_wait,
    SYS_epoll_pwait,
    SYS_eventfd2,
    SYS_poll,
    SYS_ppoll,
    SYS_accept4,
    SYS_recvmsg,
    SYS_sendmsg,
    SYS_recvfrom,
    SYS_sendto,
    SYS_shutdown,
    SYS_getsockopt,
    SYS_setsockopt,
    SYS_getsockname,
    SYS_getpeername,
    SYS_pipe2,
    // File I/O on the share.
    SYS_read,
    SYS_write,
    SYS_readv,
    SYS_writev,
    SYS_pread64,
    SYS_pwrite64,
    SYS_preadv,
    SYS_pwritev,
    SYS_preadv2,
    SYS_pwritev2,
    SYS_openat,
    SYS_close,
    SYS_fstat,
    SYS_newfstatat,
    SYS_statx,
    SYS_lseek,
    SYS_fcntl,
    SYS_dup,
    SYS_dup3,
    SYS_getdents64,
    SYS_mkdirat,
    SYS_mknodat,
    SYS_symlinkat,
    SYS_unlinkat,
    SYS_unlink,
    SYS_renameat,
    SYS_renameat2,
    SYS_linkat,
    SYS_readlinkat,
    SYS_fchownat,
    SYS_fchmodat,
    SYS_fchmodat2,
    SYS_fchmod,
    SYS_fchown,
    SYS_utimensat,
    SYS_ftruncate,
    SYS_fallocate,
    SYS_fsync,
    SYS_fdatasync,
    SYS_syncfs,
    SYS_fstatfs,
    SYS_fsetxattr,
    SYS_fgetxattr,
    SYS_flistxattr,
    SYS_fremovexattr,
    SYS_umask,
    SYS_geteuid,
    SYS_getuid,
    SYS_getegid,
    SYS_getgid,
    SYS_prlimit64,
    SYS_getrlimit,
    SYS_setrlimit,
    SYS_sysinfo,
    SYS_getcwd,
    SYS_uname,
];
