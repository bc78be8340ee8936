//! Each thread's CPU time around some guest work (bench-roundtrip's CPU
//! table), with marks the guest and the host's share directory exchange.
//!
//! - `daxprobe cpu-marks DIR MARK...` (run in the VMM's host): for each
//!   MARK in turn, waits for the file `DIR/.mark-MARK`, prints
//!   `@@HOST cpu_MARK=` and every task's time on a CPU so far, from
//!   `/proc/PID/task/TID/schedstat` (nanoseconds, not ticks), as
//!   `GROUP/COMM=NS` words (GROUP: the process's socket, `--socket-path`'s
//!   file name, for a daemon; `vmm` for the VMM; else `other`), then makes
//!   `DIR/.mark-MARK-ok`.
//! - `daxprobe mark DIR MARK` (run in the guest): makes `DIR/.mark-MARK`
//!   and waits for the host's `-ok`.
//!
//! Both look every 20 ms from one process: a shell loop that starts a
//! `sleep` per look took much of the emulated host's one CPU.

use std::collections::BTreeMap;
use std::time::Duration;

use super::wait_for_file;

/// What a process is, from its command line (NUL-separated).
fn group(cmdline: &str) -> String {
    let args: Vec<&str> = cmdline.split('\0').collect();
    if let Some(i) = args.iter().position(|a| *a == "--socket-path") {
        if let Some(path) = args.get(i + 1) {
            return path.rsplit('/').next().unwrap_or(path).to_string();
        }
    }
    let exe = args
        .first()
        .map_or("", |a| a.rsplit('/').next().unwrap_or(a));
    if exe == "dax-vmm" || exe == "cloud-hypervisor" {
        "vmm".into()
    } else {
        "other".into()
    }
}

/// CPU nanoseconds per `group/comm`, summed over tasks of that name.
fn snapshot() -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let g = group(&cmdline);
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let dir = t.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let ns = std::fs::read_to_string(dir.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            if let Some(ns) = ns {
                // A comm may hold spaces: keep the word whole.
                let name = format!("{g}/{}", comm.trim().replace(' ', "_"));
                *out.entry(name).or_insert(0) += ns;
            }
        }
    }
    out
}

/// How often a side looks for the other's file.
const LOOK: Duration = Duration::from_millis(20);

fn touch(path: &std::path::Path) {
    if let Err(e) = std::fs::write(path, b"") {
        super::fail(format!("{}: {e}", path.display()));
    }
}

/// The host's side: a snapshot at each mark, in order.
pub fn marks(dir: &str, marks: &[&str]) {
    use std::io::Write as _;
    let dir = std::path::Path::new(dir);
    for m in marks {
        if !wait_for_file(
            &dir.join(format!(".mark-{m}")),
            Duration::from_secs(300),
            LOOK,
        ) {
            super::fail(format!("no mark {m} from the guest in 300 s"));
        }
        let words: Vec<String> = snapshot()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!("@@HOST cpu_{m}={}", words.join(" "));
        let _ = std::io::stdout().flush();
        touch(&dir.join(format!(".mark-{m}-ok")));
    }
}

/// The guest's side of one mark.
pub fn mark(dir: &str, m: &str) {
    let dir = std::path::Path::new(dir);
    touch(&dir.join(format!(".mark-{m}")));
    if !wait_for_file(
        &dir.join(format!(".mark-{m}-ok")),
        Duration::from_secs(60),
        LOOK,
    ) {
        super::fail(format!("the host did not answer mark {m} in 60 s"));
    }
}

#[cfg(test)]
mod tests {
    use super::group;

    #[test]
    fn processes_are_named_by_their_socket_or_their_program() {
        assert_eq!(
            group("/bin/dax-virtiofsd\0--socket-path\0/tmp/daxnopf.sock\0--x\0"),
            "daxnopf.sock"
        );
        assert_eq!(group("/usr/bin/dax-vmm\0--kernel\0k\0"), "vmm");
        assert_eq!(group("sh\0-c\0x\0"), "other");
        assert_eq!(group(""), "other");
        assert_eq!(group("d\0--socket-path"), "other");
    }
}
