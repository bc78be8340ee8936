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

/// The daemon's allowlist, for the process that installs it (signals go
/// to its own threads only; see [`serving_for`]).
pub fn serving() -> Vec<Allow> {
    serving_for(std::process::id())
}

/// The allowlist for the process `pid`: `tgkill` (std's and glibc's
/// `pthread_kill`, `abort`'s `raise`) only with `pid` as the thread group,
/// so a compromised daemon cannot signal the VMM or any other process its
/// user may (in `--sandbox chroot` or `none`, every process of that user,
/// or every process when it runs as root). In the namespace sandbox `pid`
/// is the daemon's id in its own pid namespace, as `tgkill` reads it.
pub fn serving_for(pid: u32) -> Vec<Allow> {
    let mut v = seccomp::calls(SERVING);
    v.push(seccomp::IOCTL_FD_FLAGS_ONLY);
    v.push(PRCTL_THREAD_NAME_ONLY);
    v.push(Allow::ArgIs(SYS_tgkill, 0, u64::from(pid)));
    v
}

/// `prctl` only names threads (std does, as each starts). Everything else
/// the daemon asks of prctl — dropping capabilities, the parent-death
/// signal, not being dumpable — is done before the filter; a compromised
/// daemon must not undo it (`PR_SET_DUMPABLE` 1 would let a pipe
/// `core_pattern`, which ignores the core size limit, take its memory —
/// the guest's).
const PRCTL_THREAD_NAME_ONLY: Allow = Allow::Arg(SYS_prctl, 0, &[PR_SET_NAME as u64]);

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
    SYS_rt_sigaction,
    SYS_rt_sigprocmask,
    SYS_rt_sigreturn,
    SYS_sigaltstack,
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
    // A READ or WRITE whose buffer is in the DAX window: a copy between
    // the request's file and the one mapped there.
    SYS_copy_file_range,
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

#[cfg(test)]
mod tests {
    use seccomp::{try_in_child, Outcome};

    use super::*;

    fn prctl_under_the_filter(option: c_int, arg: u64) -> Outcome {
        try_in_child(
            || {
                vec![seccomp::build("daemon", &serving(), seccomp::Mode::Kill)
                    .unwrap()
                    .unwrap()]
            },
            // SAFETY: prctl with integer arguments (a pointer to a
            // NUL-terminated literal for PR_SET_NAME), in the child.
            move || unsafe { libc::prctl(option, arg, 0, 0, 0) }.into(),
        )
    }

    /// Any prctl used to be allowed, so a compromised daemon could make
    /// itself dumpable again.
    #[test]
    fn prctl_only_names_threads() {
        let name = c"t".as_ptr() as u64;
        assert_eq!(
            prctl_under_the_filter(PR_SET_NAME, name),
            Outcome::Returned(0)
        );
        for option in [
            PR_SET_DUMPABLE,
            PR_SET_PDEATHSIG,
            PR_SET_MM,
            PR_SET_PTRACER,
            PR_CAP_AMBIENT,
        ] {
            assert_eq!(
                prctl_under_the_filter(option, 1),
                Outcome::Signalled(SIGSYS),
                "prctl option {option}"
            );
        }
    }

    /// `tgkill(tgid, tid, 0)` (signal 0: checks only) under the filter.
    fn tgkill_under_the_filter(target: impl FnOnce() -> (i32, i32)) -> Outcome {
        try_in_child(
            || {
                vec![seccomp::build("daemon", &serving(), seccomp::Mode::Kill)
                    .unwrap()
                    .unwrap()]
            },
            move || {
                let (tgid, tid) = target();
                // SAFETY: a raw syscall with integer arguments, in the child.
                let rc = unsafe { libc::syscall(SYS_tgkill, tgid, tid, 0) };
                if rc == 0 {
                    0
                } else {
                    std::io::Error::last_os_error()
                        .raw_os_error()
                        .map_or(-1, i64::from)
                }
            },
        )
    }

    /// A compromised daemon could signal any process it may: the VMM, or
    /// with root any process on the host.
    #[test]
    fn tgkill_reaches_the_daemons_own_threads_only() {
        // SAFETY: getpid and gettid take no arguments.
        let own = || unsafe { (libc::getpid(), libc::gettid()) };
        assert_eq!(tgkill_under_the_filter(own), Outcome::Returned(0));
        // The parent (the test process), and init.
        let parent = std::process::id().cast_signed();
        for tgid in [parent, 1] {
            assert_eq!(
                tgkill_under_the_filter(move || (tgid, tgid)),
                Outcome::Signalled(SIGSYS),
                "tgkill to {tgid}"
            );
        }
    }
}
