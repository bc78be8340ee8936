//! What a seccomp allowlist costs per system call: the same call timed on a
//! thread without a filter and on threads with allowlists of the daemon's
//! and the VMM's size (the call placed last, the worst case for a chain of
//! comparisons), and with two filters stacked as on a VMM thread.
//!
//! `cargo bench -p seccomp --bench filter_cost` prints ns per call; the
//! numbers are measurements, not assertions.

use std::time::Instant;

use seccomp::{Allow, Mode};

const CALLS: u32 = 2_000_000;

/// `size` allowed calls, all but getppid numbered above it (so a filter
/// that checks in number order reaches getppid last), plus what the
/// thread needs to finish.
fn allowlist(size: usize) -> Vec<Allow> {
    let size = i64::try_from(size).expect("an allowlist size fits i64");
    let mut v: Vec<Allow> = (0..size).map(|i| Allow::Call(1000 + i)).collect();
    for nr in [
        libc::SYS_getppid,
        libc::SYS_futex,
        libc::SYS_munmap,
        libc::SYS_madvise,
        libc::SYS_exit,
        libc::SYS_rt_sigprocmask,
        libc::SYS_sigaltstack,
        libc::SYS_write,
        libc::SYS_mmap,
        libc::SYS_brk,
        libc::SYS_rseq,
        libc::SYS_gettid,
        libc::SYS_exit_group,
        libc::SYS_sched_yield,
        libc::SYS_mprotect,
        libc::SYS_prctl,
        libc::SYS_seccomp,
    ] {
        v.push(Allow::Call(nr));
    }
    v
}

fn time_on_thread(filters: Vec<Vec<Allow>>) -> f64 {
    std::thread::spawn(move || {
        for f in &filters {
            seccomp::apply("bench", f, Mode::Kill).expect("filter");
        }
        let start = Instant::now();
        for _ in 0..CALLS {
            // SAFETY: getppid has no preconditions.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
        start.elapsed().as_nanos() as f64 / f64::from(CALLS)
    })
    .join()
    .expect("bench thread")
}

fn main() {
    let _ = seccomp::install_sigsys_report();
    let base = time_on_thread(vec![]);
    println!("getppid, no filter:                      {base:6.1} ns/call");
    for (label, filters) in [
        (
            "one 100-call allowlist (daemon-sized)",
            vec![allowlist(100)],
        ),
        (
            "two stacked allowlists (VMM + vCPU)",
            vec![allowlist(100), allowlist(40)],
        ),
    ] {
        let t = time_on_thread(filters);
        println!("getppid, {label:38} {t:6.1} ns/call (+{:.1})", t - base);
    }
}
