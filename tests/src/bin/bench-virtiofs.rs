//! The virtio-fs read benchmark (not a test): one file, read by `daxprobe
//! bench` in the guest (sequential 1 MiB preads, random 4 KiB preads,
//! random 4 KiB touches through mmap), over five servers in one rig run —
//! our daemon without DAX and with DAX, each confined as by default
//! (namespaces, seccomp, capabilities; the VMM's seccomp filters on) and
//! unconfined (`--sandbox none --seccomp none`, VMM `--seccomp false`), so
//! the cost of confinement is measured, and the Rust `virtiofsd` as users
//! run it today (no DAX). All over virtio-PCI, where the daemons signal the
//! guest through MSI-X irqfds. Writes `target/rig-results/virtiofs-bench.md`.
//!
//! `./scripts/bench.sh` builds what it needs (a static virtiofsd with `cargo
//! install`, cached in `~/.cache/dax-vmm/virtiofsd-<version>/`).

use std::path::PathBuf;

use guest_tests::results::Results;
use guest_tests::rig::{self, Guest};

const VIRTIOFSD_VERSION: &str = "1.14.0";
const FILE_MIB: u32 = 64;

const GUEST_SCRIPT: &str = r#"
phase=$(grep -o 'bench=[a-z]*' /proc/cmdline | cut -d= -f2)
opts=$(grep -o 'mountopts=[a-z=]*' /proc/cmdline | cut -d= -f2-)
mkdir -p /mnt
mount -t virtiofs share /mnt -o $opts || echo "@@GUEST ${phase}_mount_failed=1"
echo "@@GUEST ${phase}_statx=$(daxprobe statx /mnt/bench.bin)"
file=/mnt/bench.bin
# local=1: the limit, the same file in the guest's own tmpfs (its root).
if grep -q 'local=1' /proc/cmdline; then cp /mnt/bench.bin /local.bin; file=/local.bin; fi
for m in "seq 1024 FILE_MIB" "rand 4 16" "mmap 4 FILE_MIB"; do
    set -- $m
    echo 3 > /proc/sys/vm/drop_caches
    echo "@@GUEST ${phase}_$1=$(daxprobe bench $file $m)"
done
umount /mnt
"#;

/// Starts a server in the background and waits for its socket.
fn start(cmd: &str, sock: &str) -> String {
    format!(
        "rm -f {sock}; {cmd} &\nSERVER=$!\ni=0; while [ ! -S {sock} ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done\n"
    )
}

/// One more VMM run in the same emulated host, for another server.
fn another_run(
    guest: &Guest,
    base_cmdline: &str,
    phase: &str,
    mountopts: &str,
    fs: &str,
    vmm_extra: &str,
) -> String {
    let local = if phase == "guesttmpfs" {
        " local=1"
    } else {
        ""
    };
    let cmdline = format!("{base_cmdline} bench={phase} mountopts={mountopts}{local}");
    format!(
        "\"$VMM\" -v --kernel \"$KERNEL\" --initramfs \"$INITRAMFS\" --cmdline '{cmdline}' --cpus boot={cpus} \
         --memory size={memory} --fs {fs} {vmm_extra} </dev/null\necho \"@@HOST {phase}_vmm_exit=$?\"\nwait $SERVER\n",
        cpus = guest.cpus,
        memory = guest.memory,
    )
}

/// A static virtiofsd, built once with `cargo install` and cached.
fn virtiofsd() -> Result<PathBuf, String> {
    guest_tests::host::crates_io_tool(
        "virtiofsd",
        VIRTIOFSD_VERSION,
        "virtiofsd",
        // Its seccomp and capng bindings link dynamically unless told otherwise.
        &[
            ("LIBSECCOMP_LINK_TYPE", "static"),
            ("LIBSECCOMP_LIB_PATH", "/usr/lib/x86_64-linux-gnu"),
            ("LIBCAPNG_LINK_TYPE", "static"),
            ("LIBCAPNG_LIB_PATH", "/usr/lib/x86_64-linux-gnu"),
        ],
    )
    .map_err(|e| format!("{e} (virtiofsd needs libseccomp-dev and libcap-ng-dev)"))
}

fn main() {
    let fail = |e: String| -> ! {
        eprintln!("bench-virtiofs: {e}");
        std::process::exit(1)
    };
    let virtiofsd = virtiofsd().unwrap_or_else(|e| fail(e));
    let tool = |pkg, bin| rig::tool(pkg, bin).unwrap_or_else(|e| fail(e.to_string()));
    let mut guest = Guest::new(
        "virtiofs-bench",
        &GUEST_SCRIPT.replace("FILE_MIB", &FILE_MIB.to_string()),
    );
    guest.cpus = 1;
    guest.memory = "512M,shared=on".into();
    let base_cmdline = guest.cmdline();
    guest.guest_tools = vec![tool("guest-tests", "daxprobe")];
    guest.host_tools = vec![tool("daemon", "dax-virtiofsd"), virtiofsd];
    guest.timeout = std::time::Duration::from_secs(2400);
    // Confined (the default) and unconfined runs alternate A B B A, so the
    // order in the emulated host (the first run is often slower) does not
    // pass for the cost of confinement.
    const OPEN: &str = "--sandbox none --seccomp none";
    let nodax = ("dax=never", "--dax off", "dax=off");
    let dax = ("dax=always", "--cache-size 128M", "cache_size=128M");
    // The same without the VMM pre-faulting new mappings (dax_prefault=off).
    let dax_cold = (
        "dax=always",
        "--cache-size 128M",
        "cache_size=128M,dax_prefault=off",
    );
    // The same file on a host tmpfs that backs it with 2 MiB pages: the
    // window's 2 MiB ranges then map with huge entries on the host and in KVM.
    let dax_huge = (
        "dax=always",
        "--cache-size 128M --shared-dir share-huge",
        "cache_size=128M",
    );
    // A window half the file's size: the guest must reclaim ranges as it
    // reads, with and without pre-faulting each new one.
    let dax_small = ("dax=always", "--cache-size 32M", "cache_size=32M");
    let dax_small_cold = (
        "dax=always",
        "--cache-size 32M",
        "cache_size=32M,dax_prefault=off",
    );
    let phases: Vec<(&str, (&str, &str, &str), &str)> = vec![
        ("ours", nodax, ""),
        ("oursopen", nodax, OPEN),
        ("oursopenb", nodax, OPEN),
        ("oursb", nodax, ""),
        ("dax", dax, ""),
        ("daxopen", dax, OPEN),
        ("daxopenb", dax, OPEN),
        ("daxb", dax, ""),
        ("daxnopf", dax_cold, ""),
        ("daxhuge", dax_huge, ""),
        ("daxsmall", dax_small, ""),
        ("daxsmallnopf", dax_small_cold, ""),
        ("guesttmpfs", nodax, ""),
    ];
    let mut host_after = vec!["wait $SERVER\n".to_string()];
    for (n, (phase, (mountopts, daemon_args, fs_args), open)) in phases.iter().enumerate() {
        let sock = format!("/tmp/s{n}.sock");
        let share = if daemon_args.contains("--shared-dir") {
            ""
        } else {
            "--shared-dir share"
        };
        let cmd = format!(
            "dax-virtiofsd --socket-path {sock} {share} {daemon_args} {open} --log-level warn"
        );
        if n == 0 {
            guest.host_before = format!(
                "mkdir -p share share-huge && dd if=/dev/urandom of=share/bench.bin bs=1M count={FILE_MIB} 2>/dev/null\n\
                 mount -t tmpfs -o huge=always,size=256m tmpfs share-huge && cp share/bench.bin share-huge/\n\
                 echo \"@@HOST share_huge_anon_huge_kb=$(grep ShmemHugePages /proc/meminfo | tr -s ' ' | cut -d' ' -f2)\"\n{}",
                start(&cmd, &sock)
            );
            guest.vmm_args = vec![
                "-v".into(),
                "--fs".into(),
                format!("tag=share,socket={sock},{fs_args},transport=pci"),
            ];
            guest.cmdline = format!("bench={phase} mountopts={mountopts}");
            continue;
        }
        let vmm_extra = if open.is_empty() {
            ""
        } else {
            "--seccomp false"
        };
        host_after.push(start(&cmd, &sock));
        host_after.push(another_run(
            &guest,
            &base_cmdline,
            phase,
            mountopts,
            &format!("tag=share,socket={sock},{fs_args},transport=pci"),
            vmm_extra,
        ));
    }
    for (phase, cache) in [("virtiofsd", "auto"), ("virtiofsdnever", "never")] {
        host_after.push(start(&format!("virtiofsd --socket-path=/tmp/c.sock --shared-dir=share --sandbox=none --cache={cache} --log-level=warn"), "/tmp/c.sock"));
        host_after.push(another_run(
            &guest,
            &base_cmdline,
            phase,
            "dax=never",
            "tag=share,socket=/tmp/c.sock,dax=off,transport=pci",
            "",
        ));
    }
    guest.host_after = host_after.concat();
    let run = rig::run(&guest).unwrap_or_else(|e| fail(e.to_string()));
    if run.timed_out {
        fail(format!("timed out\n{}", run.tail(60)));
    }
    let mut results = Results::new("virtiofs-bench");
    results.record_run("virtio-fs read benchmark", &run);
    // Each VMM run logs KVM's counters when it ends, in the order of the runs.
    let kvm_lines: Vec<String> = run
        .lines
        .iter()
        .filter_map(|l| l.text.split_once("KVM counters at the end: "))
        .map(|(_, c)| c.to_string())
        .collect();
    let phase_order: Vec<&str> = phases
        .iter()
        .map(|(p, _, _)| *p)
        .chain(["virtiofsd", "virtiofsdnever"])
        .collect();
    let kvm_of = |phase: &str| -> String {
        let field = |line: &str, key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or("?")
                .to_string()
        };
        phase_order
            .iter()
            .position(|p| *p == phase)
            .and_then(|i| kvm_lines.get(i))
            .map_or("n/a".into(), |l| {
                format!(
                    "{} exits, {} page faults",
                    field(l, "exits="),
                    field(l, "page_faults=")
                )
            })
    };
    let mut table = String::from("| server | DAX in the guest | seq 1 MiB pread | rand 4 KiB pread | rand 4 KiB mmap | KVM, whole run (boot + 3 passes) |\n|---|---|---|---|---|---|\n");
    for (phase, label) in [
        ("ours", "dax-virtiofsd --dax off, confined (default), 1st"),
        ("oursopen", "dax-virtiofsd --dax off, unconfined, 1st"),
        ("oursopenb", "dax-virtiofsd --dax off, unconfined, 2nd"),
        ("oursb", "dax-virtiofsd --dax off, confined (default), 2nd"),
        (
            "dax",
            "dax-virtiofsd (DAX, 128 MiB window), confined (default), 1st",
        ),
        (
            "daxopen",
            "dax-virtiofsd (DAX, 128 MiB window), unconfined, 1st",
        ),
        (
            "daxopenb",
            "dax-virtiofsd (DAX, 128 MiB window), unconfined, 2nd",
        ),
        (
            "daxb",
            "dax-virtiofsd (DAX, 128 MiB window), confined (default), 2nd",
        ),
        (
            "daxnopf",
            "dax-virtiofsd (DAX, 128 MiB window), confined, VMM dax_prefault=off",
        ),
        (
            "daxhuge",
            "dax-virtiofsd (DAX, 128 MiB window), share on a host tmpfs with 2 MiB pages",
        ),
        (
            "daxsmall",
            "dax-virtiofsd (DAX, 32 MiB window: half the file)",
        ),
        (
            "daxsmallnopf",
            "dax-virtiofsd (DAX, 32 MiB window), VMM dax_prefault=off",
        ),
        ("virtiofsd", "virtiofsd 1.14 --cache=auto"),
        ("virtiofsdnever", "virtiofsd 1.14 --cache=never"),
        (
            "guesttmpfs",
            "the limit: the file in the guest's own tmpfs (RAM)",
        ),
    ] {
        let mibs = |mode: &str| {
            // cache=never opens files with direct I/O, which has no mmap.
            if phase == "virtiofsdnever" && mode == "mmap" {
                return "unsupported (direct I/O)".to_string();
            }
            run.guest(&format!("{phase}_{mode}"))
                .and_then(|v| {
                    v.split_whitespace()
                        .find_map(|w| w.strip_prefix("mib_per_s="))
                })
                .map_or("failed".to_string(), |v| format!("{v} MiB/s"))
        };
        let statx = run
            .guest(&format!("{phase}_statx"))
            .unwrap_or("-")
            .rsplit(':')
            .next()
            .unwrap_or("-")
            .to_string();
        let row = [
            label.to_string(),
            if statx == "1" {
                "yes".into()
            } else {
                "no".into()
            },
            mibs("seq"),
            mibs("rand"),
            mibs("mmap"),
            kvm_of(phase),
        ];
        table.push_str(&format!("| {} |\n", row.join(" | ")));
        for mode in ["seq", "rand", "mmap"] {
            results.record(&format!("{label}: {mode}"), mibs(mode));
        }
        results.record(&format!("{label}: KVM"), kvm_of(phase));
    }
    let path = results.save().unwrap_or_else(|e| fail(e.to_string()));
    println!("{FILE_MIB} MiB file, guest caches dropped before each pass, 1 vCPU, guest clock:\n\n{table}");
    println!(
        "results: {}  log: {}",
        path.display(),
        run.log_path.display()
    );
    if table.contains("failed") {
        fail(format!(
            "some measurements failed; see the log\n{}",
            run.tail(40)
        ));
    }
}
