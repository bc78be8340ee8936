//! The virtio-fs read benchmark (not a test), in one rig run, all over
//! virtio-PCI:
//!
//! - one 64 MiB file read by `daxprobe bench` in the guest (sequential
//!   1 MiB preads, random 4 KiB preads, random 4 KiB touches through mmap),
//!   each pass cold (guest caches dropped) and then warm: our daemon without
//!   and with DAX, confined as by default and unconfined (so the cost of
//!   confinement is measured), with and without the VMM's pre-faulting, on
//!   host 4 KiB and 2 MiB pages, through a window half the file's size (DAX
//!   forced, and the default policy); the Rust `virtiofsd` with
//!   `--cache=auto` and `--cache=never`; the file in the guest's own tmpfs;
//! - a source-tree-like share (4,000 files) and a hot 24 MiB file through a
//!   64 MiB window: the hot file's warm figure, the tree read once, the hot
//!   file again — with the default policy, with its adaptive part off, and
//!   on virtiofsd `--cache=auto`.
//!
//! It prints the tables and the ratios the DAX targets are stated in, and
//! writes them to `target/rig-results/virtiofs-bench.md`.
//!
//! `./scripts/bench.sh` builds what it needs (a static virtiofsd with `cargo
//! install`, cached in `~/.cache/dax-vmm/virtiofsd-<version>/`).

use std::path::PathBuf;

use test_infra::results::Results;
use test_infra::rig::{self, Guest, Run};

const VIRTIOFSD_VERSION: &str = "1.14.0";
const FILE_MIB: u32 = 64;

const GUEST_SCRIPT: &str = r#"
phase=$(grep -o 'bench=[a-z0-9]*' /proc/cmdline | cut -d= -f2)
opts=$(grep -o 'mountopts=[a-z=]*' /proc/cmdline | cut -d= -f2-)
mkdir -p /mnt
mount -t virtiofs share /mnt -o $opts || echo "@@GUEST ${phase}_mount_failed=1"
if [ "${phase#tree}" != "$phase" ]; then
    # The tree + hot file case: the hot file's warm figure, the whole tree
    # read once, then the hot file again.
    daxprobe bench /mnt/hot.bin rand 4 16 >/dev/null
    echo "@@GUEST ${phase}_hotwarm=$(daxprobe bench /mnt/hot.bin rand 4 16)"
    echo "@@GUEST ${phase}_tree=$(daxprobe readtree /mnt/tree)"
    echo "@@GUEST ${phase}_hotafter=$(daxprobe bench /mnt/hot.bin rand 4 16)"
    echo "@@GUEST ${phase}_statx=$(daxprobe statx /mnt/hot.bin)"
    umount /mnt
    exit 0
fi
echo "@@GUEST ${phase}_statx=$(daxprobe statx /mnt/bench.bin)"
file=/mnt/bench.bin
# local=1: the limit, the same file in the guest's own tmpfs (its root).
if grep -q 'local=1' /proc/cmdline; then cp /mnt/bench.bin /local.bin; file=/local.bin; fi
# Each pass cold (guest caches dropped, which also drops DAX mappings with
# the inode) and then warm (at once again, as it is left).
for m in "seq 1024 FILE_MIB" "rand 4 16" "mmap 4 FILE_MIB"; do
    set -- $m
    echo 3 > /proc/sys/vm/drop_caches
    echo "@@GUEST ${phase}_$1=$(daxprobe bench $file $m)"
    echo "@@GUEST ${phase}_$1_warm=$(daxprobe bench $file $m)"
done
umount /mnt
"#;

/// The tree + hot file case: 40 x 100 files (97 % of 1-12 KiB, 3 % of
/// 64-320 KiB) and a 24 MiB hot file, through a 64 MiB window.
const TREE_DIRS: u32 = 40;
const TREE_FILES: u32 = 100;
const HOT_MIB: u32 = 24;

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
    test_infra::host::crates_io_tool(
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

/// One dax-virtiofsd run: its name, (guest mount options, daemon
/// arguments, `--fs` options), and the unconfined switches or "".
type Phase = (
    &'static str,
    (&'static str, &'static str, &'static str),
    &'static str,
);

/// Every dax-virtiofsd phase, in the order they run.
fn phases() -> Vec<Phase> {
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
    // The same window with the default policy (the guest mounts dax=inode):
    // the adaptive part keeps a file over half the window off DAX.
    let dax_small_inode = ("dax=inode", "--cache-size 32M", "cache_size=32M");
    // Tree + hot file through a 64 MiB window, the default policy, and
    // the same with the adaptive part off.
    let tree = ("dax=inode", "--cache-size 64M", "cache_size=64M");
    let tree_fixed = (
        "dax=inode",
        "--cache-size 64M --dax-policy fixed.json",
        "cache_size=64M",
    );
    // The mapping alignment announced to the guest, fixed either way
    // (the default, auto, follows the host file system).
    let gran_4k = (
        "dax=always",
        "--cache-size 128M --dax-policy gran4k.json",
        "cache_size=128M",
    );
    let gran_2m = (
        "dax=always",
        "--cache-size 128M --dax-policy gran2m.json",
        "cache_size=128M",
    );
    vec![
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
        ("daxgran4k", gran_4k, ""),
        ("daxgran2m", gran_2m, ""),
        ("daxsmall", dax_small, ""),
        ("daxsmallnopf", dax_small_cold, ""),
        ("daxsmallinode", dax_small_inode, ""),
        ("guesttmpfs", nodax, ""),
        ("treeours", tree, ""),
        ("treefixed", tree_fixed, ""),
        ("treenodax", nodax, ""),
    ]
}

/// The phases virtiofsd itself runs in (name, its `--cache`), after ours.
const VIRTIOFSD_PHASES: [(&str, &str); 3] = [
    ("virtiofsd", "auto"),
    ("virtiofsdnever", "never"),
    ("treevirtiofsd", "auto"),
];

/// A pass's throughput, from its `mib_per_s=` word.
fn mib(run: &Run, key: &str) -> Option<f64> {
    run.guest(key)?
        .split_whitespace()
        .find_map(|w| w.strip_prefix("mib_per_s="))?
        .parse()
        .ok()
}

fn shown(v: Option<f64>) -> String {
    v.map_or("failed".to_string(), |v| format!("{v:.1}"))
}

/// KVM's counters each VMM run logs when it ends, by phase.
struct KvmCounters {
    by_phase: Vec<(&'static str, String)>,
}

impl KvmCounters {
    /// The runs log in the order they ran: ours, then virtiofsd's.
    fn of(run: &Run, phases: &[Phase], wanted: &dyn Fn(&str) -> bool) -> Self {
        let lines = run
            .lines
            .iter()
            .filter_map(|l| l.text.split_once("KVM counters at the end: "))
            .map(|(_, c)| c.to_string());
        let order = phases.iter().map(|(p, _, _)| *p).chain(
            VIRTIOFSD_PHASES
                .iter()
                .map(|(p, _)| *p)
                .filter(|p| wanted(p)),
        );
        KvmCounters {
            by_phase: order.zip(lines).collect(),
        }
    }

    fn summary(&self, phase: &str) -> String {
        let field = |line: &str, key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or("?")
                .to_string()
        };
        self.by_phase
            .iter()
            .find(|(p, _)| *p == phase)
            .map_or("n/a".into(), |(_, l)| {
                format!(
                    "{} exits, {} page faults",
                    field(l, "exits="),
                    field(l, "page_faults=")
                )
            })
    }
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
    guest.guest_tools = vec![tool("guest-tools", "daxprobe")];
    guest.host_tools = vec![
        tool("daemon", "dax-virtiofsd"),
        tool("guest-tools", "daxprobe"),
        virtiofsd,
    ];
    guest.timeout = std::time::Duration::from_secs(2400);
    let phases = phases();
    // `scripts/bench.sh PHASE...` runs only those (names as in the rows).
    let only: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |p: &str| only.is_empty() || only.iter().any(|o| o == p);
    let phases: Vec<_> = phases.into_iter().filter(|(p, _, _)| wanted(p)).collect();
    if phases.is_empty() {
        fail(
            "name at least one dax-virtiofsd phase (the first runs the guest the rig boots)".into(),
        );
    }
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
                 echo \"@@HOST share_huge_anon_huge_kb=$(grep ShmemHugePages /proc/meminfo | tr -s ' ' | cut -d' ' -f2)\"\n\
                 dd if=/dev/urandom of=share/hot.bin bs=1M count={HOT_MIB} 2>/dev/null\n\
                 echo \"@@HOST tree=$(daxprobe mktree share/tree {TREE_DIRS} {TREE_FILES})\"\n\
                 echo '{{\"adaptive\": {{\"enabled\": false}}}}' > fixed.json\n\
                 echo '{{\"window_granularity\": \"4K\"}}' > gran4k.json\n\
                 echo '{{\"window_granularity\": \"2M\"}}' > gran2m.json\n{}",
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
    for &(phase, cache) in VIRTIOFSD_PHASES.iter().filter(|(p, _)| wanted(p)) {
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
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let mut results = Results::new("virtiofs-bench");
    results.record_run("virtio-fs read benchmark", &run);
    let kvm = KvmCounters::of(&run, &phases, &wanted);
    let (table, pass_failed) = pass_table(&run, &kvm, &mut results, &wanted);
    let (tree_table, tree_failed) = tree_table(&run, &mut results, &wanted);
    let ratio_table = ratio_table(&run, &mut results);
    let path = results.save().unwrap_or_else(|e| fail(e.to_string()));
    println!("{FILE_MIB} MiB file, each pass cold (guest caches dropped) then warm, 1 vCPU, guest clock, MiB/s:\n\n{table}");
    println!("Tree ({TREE_DIRS} x {TREE_FILES} files) + {HOT_MIB} MiB hot file, 64 MiB window:\n\n{tree_table}");
    println!("Ratios:\n\n{ratio_table}");
    println!(
        "results: {}  log: {}",
        path.display(),
        run.log_path.display()
    );
    if pass_failed || tree_failed {
        fail(format!(
            "some measurements failed; see the log\n{}",
            run.tail(40)
        ));
    }
}

/// The six passes of each server, cold and warm; whether any failed.
fn pass_table(
    run: &Run,
    kvm: &KvmCounters,
    results: &mut Results,
    wanted: &dyn Fn(&str) -> bool,
) -> (String, bool) {
    let mut table = String::from("| server | DAX in the guest | seq 1 MiB pread cold / warm | rand 4 KiB pread cold / warm | rand 4 KiB mmap cold / warm | KVM, whole run (boot + 6 passes) |\n|---|---|---|---|---|---|\n");
    let mut failed = false;
    for &(phase, label) in PASS_ROWS.iter().filter(|(p, _)| wanted(p)) {
        let statx = run
            .guest(&format!("{phase}_statx"))
            .unwrap_or("-")
            .rsplit(':')
            .next()
            .unwrap_or("-")
            .to_string();
        let mut row = vec![
            label.to_string(),
            if statx == "1" { "yes" } else { "no" }.to_string(),
        ];
        for mode in ["seq", "rand", "mmap"] {
            // cache=never opens files with direct I/O, which has no mmap.
            if phase == "virtiofsdnever" && mode == "mmap" {
                row.push("unsupported (direct I/O)".into());
                continue;
            }
            let cold = mib(run, &format!("{phase}_{mode}"));
            let warm = mib(run, &format!("{phase}_{mode}_warm"));
            failed |= cold.is_none() || warm.is_none();
            results.record(&format!("{label}: {mode} cold, MiB/s"), shown(cold));
            results.record(&format!("{label}: {mode} warm, MiB/s"), shown(warm));
            row.push(format!("{} / {}", shown(cold), shown(warm)));
        }
        row.push(kvm.summary(phase));
        results.record(&format!("{label}: KVM"), kvm.summary(phase));
        table.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    (table, failed)
}

/// The hot file before and after a tree read; whether any failed.
fn tree_table(run: &Run, results: &mut Results, wanted: &dyn Fn(&str) -> bool) -> (String, bool) {
    let mut failed = false;
    let mut tree_table = String::from("| server | hot file warm, rand 4 KiB | tree read once | hot file after the tree | after / warm |\n|---|---|---|---|---|\n");
    for &(phase, label) in TREE_ROWS.iter().filter(|(p, _)| wanted(p)) {
        let warm = mib(run, &format!("{phase}_hotwarm"));
        let tree = mib(run, &format!("{phase}_tree"));
        let after = mib(run, &format!("{phase}_hotafter"));
        failed |= warm.is_none() || tree.is_none() || after.is_none();
        for (what, v) in [("hot warm", warm), ("tree", tree), ("hot after", after)] {
            results.record(&format!("{label}: {what}, MiB/s"), shown(v));
        }
        tree_table.push_str(&format!(
            "| {label} | {} MiB/s | {} MiB/s | {} MiB/s | {} |\n",
            shown(warm),
            shown(tree),
            shown(after),
            ratio(after, warm)
        ));
    }
    (tree_table, failed)
}

/// The ratios the targets are stated in.
fn ratio_table(run: &Run, results: &mut Results) -> String {
    let mean = |a: &str, b: &str| Some((mib(run, a)? + mib(run, b)?) / 2.0);
    let dax = |m: &str| mean(&format!("dax_{m}"), &format!("daxb_{m}"));
    let nodax = |m: &str| mean(&format!("ours_{m}"), &format!("oursb_{m}"));
    let ratios = [
        (
            "rand 4 KiB pread, DAX on 4 KiB host pages / virtiofsd cache=never (target 30x)",
            ratio(dax("rand"), mib(run, "virtiofsdnever_rand")),
        ),
        (
            "rand 4 KiB pread, DAX on 2 MiB host pages / virtiofsd cache=never (target 30x)",
            ratio(mib(run, "daxhuge_rand"), mib(run, "virtiofsdnever_rand")),
        ),
        (
            "rand 4 KiB mmap, DAX on 4 KiB host pages / guest tmpfs (target 0.5x)",
            ratio(dax("mmap"), mib(run, "guesttmpfs_mmap")),
        ),
        (
            "rand 4 KiB mmap, DAX on 2 MiB host pages / guest tmpfs (target 0.5x)",
            ratio(mib(run, "daxhuge_mmap"), mib(run, "guesttmpfs_mmap")),
        ),
        (
            "seq 1 MiB pread, DAX on 4 KiB host pages / virtiofsd cache=never (target 1.0x)",
            ratio(dax("seq"), mib(run, "virtiofsdnever_seq")),
        ),
        (
            "seq 1 MiB pread, DAX on 2 MiB host pages / virtiofsd cache=never (target 1.0x)",
            ratio(mib(run, "daxhuge_seq"), mib(run, "virtiofsdnever_seq")),
        ),
        (
            "file twice the window, default policy / no DAX: rand 4 KiB pread (target 1.0x)",
            ratio(mib(run, "daxsmallinode_rand"), nodax("rand")),
        ),
        (
            "file twice the window, default policy / no DAX: seq 1 MiB pread (target 1.0x)",
            ratio(mib(run, "daxsmallinode_seq"), nodax("seq")),
        ),
        (
            "file twice the window, DAX forced (dax=always) / no DAX: rand 4 KiB pread",
            ratio(mib(run, "daxsmall_rand"), nodax("rand")),
        ),
        (
            "tree read, default policy / virtiofsd cache=auto, by time (target 1.0x or less)",
            ratio(mib(run, "treevirtiofsd_tree"), mib(run, "treeours_tree")),
        ),
        (
            "hot file after the tree / before, default policy (target 0.8x)",
            ratio(mib(run, "treeours_hotafter"), mib(run, "treeours_hotwarm")),
        ),
        (
            "hot file after the tree / before, adaptive part off",
            ratio(
                mib(run, "treefixed_hotafter"),
                mib(run, "treefixed_hotwarm"),
            ),
        ),
    ];
    let mut ratio_table = String::from("| ratio | measured |\n|---|---|\n");
    for (what, r) in &ratios {
        results.record(what, r.clone());
        ratio_table.push_str(&format!("| {what} | {r} |\n"));
    }
    ratio_table
}

/// `a / b` as "12.3x", or why not.
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "n/a (a measurement failed)".into(),
    }
}

/// The single-file passes: phase and its row label.
const PASS_ROWS: &[(&str, &str)] = &[
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
        "daxgran4k",
        "dax-virtiofsd (DAX, 128 MiB window), window_granularity 4K announced",
    ),
    (
        "daxgran2m",
        "dax-virtiofsd (DAX, 128 MiB window), window_granularity 2M announced",
    ),
    (
        "daxsmall",
        "dax-virtiofsd (DAX forced, 32 MiB window: half the file)",
    ),
    (
        "daxsmallnopf",
        "dax-virtiofsd (DAX forced, 32 MiB window), VMM dax_prefault=off",
    ),
    (
        "daxsmallinode",
        "dax-virtiofsd (32 MiB window, default policy, guest dax=inode)",
    ),
    ("virtiofsd", "virtiofsd 1.14 --cache=auto"),
    ("virtiofsdnever", "virtiofsd 1.14 --cache=never"),
    (
        "guesttmpfs",
        "the limit: the file in the guest's own tmpfs (RAM)",
    ),
];

/// The tree + hot file runs.
const TREE_ROWS: &[(&str, &str)] = &[
    ("treeours", "dax-virtiofsd, default policy"),
    ("treefixed", "dax-virtiofsd, adaptive part off"),
    ("treenodax", "dax-virtiofsd --dax off"),
    ("treevirtiofsd", "virtiofsd 1.14 --cache=auto (no DAX)"),
];
