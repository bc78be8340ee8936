//! The API socket against a client that opens connections and sends
//! nothing, on the real VMM binary (no guest).

use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;

use crate::api_common::{json, scratch, start_vmm_with, wait_for};

/// The soft and hard open-file limits `/proc/<pid>/limits` shows.
fn nofile_of(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let f: Vec<&str> = line.split_whitespace().collect();
    (f[3].to_string(), f[4].to_string())
}

/// Sets this process's open-file soft limit to at least `n` (as root, the
/// hard one too if it is lower).
fn ensure_nofile(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_cur = lim.rlim_cur.max(n);
    lim.rlim_max = lim.rlim_max.max(n);
    // SAFETY: setrlimit only reads the struct it is given.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(
        r,
        0,
        "RLIMIT_NOFILE {n}: {}",
        std::io::Error::last_os_error()
    );
}

/// A VMM started with a shell's soft limit (1024) raises it to the hard
/// one, and 10,000 connections that send nothing do not keep `vmm.ping`
/// from answering (past its connection cap the API closes idle ones).
#[test]
fn ping_answers_while_ten_thousand_silent_connections_are_open() {
    const SILENT: u64 = 10_000;
    ensure_nofile(SILENT + 500);
    let dir = scratch("api-silent-clients");
    let (vmm, api) = start_vmm_with(&dir, |command| {
        // SAFETY: between fork and exec the closure calls only setrlimit,
        // which is async-signal-safe, on a struct of its own.
        unsafe {
            command.pre_exec(|| {
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                lim.rlim_cur = lim.rlim_cur.min(1024);
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    wait_for(&api);
    let (soft, hard) = nofile_of(vmm.0.id());
    assert_eq!(
        soft, hard,
        "the VMM's open-file soft limit is raised to the hard one"
    );

    let silent: Vec<UnixStream> = (0..SILENT)
        .map(|i| UnixStream::connect(&api).unwrap_or_else(|e| panic!("silent connection {i}: {e}")))
        .collect();
    let ping = json(&api, "GET", "/api/v1/vmm.ping", "");
    assert_eq!(ping["pid"].as_u64(), Some(u64::from(vmm.0.id())), "{ping}");
    drop(silent);
}
