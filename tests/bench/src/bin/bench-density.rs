//! Memory benchmarks (not tests), each one rig run; `scripts/bench.sh
//! density` and `scripts/bench.sh windowcost` run them.
//!
//! - **density**: [`GUESTS`] guests of our VMM at once, each with its own
//!   `dax-virtiofsd` on the same host directory, each reading the same
//!   64 MiB of files — with DAX (128 MiB windows, guests mount
//!   `dax=always`) and without (`--dax off`, `dax=never`), one set after
//!   the other in the same emulated host. The emulated host's
//!   /proc/meminfo and each VMM's RSS split are read just before the reads
//!   and just after, while the guests still run, and after the reads each
//!   VMM's and daemon's own memory and threads (`daxprobe proc-cost`: smaps
//!   without guest RAM and the share's file pages); each guest reports its
//!   own page cache (`Cached:`) before and after. Writes
//!   `target/rig-results/density-bench.md`.
//! - **windowcost**: one guest at a time, with DAX windows of 0 (no window:
//!   DAX off), 64 MiB, 256 MiB, 1 GiB and 4 GiB, each size booted twice;
//!   the guest's `MemTotal` and what it uses after boot with the share
//!   mounted. The window's cost is the guest's `struct page` for each of its
//!   4 KiB pages (ZONE_DEVICE), taken from guest RAM. Writes
//!   `target/rig-results/window-cost.md`.
//!
//! The share of the density run is an ext2 file system on a RAM disk
//! (`brd`) in the emulated host, not the emulated host's initramfs: files on
//! a tmpfs or the initramfs are Shmem, in memory before anyone reads them,
//! so a read would cost the host nothing either way and the host's copy
//! would hide in the same counter as the guests' RAM. On ext2 the host's
//! copy is ordinary page cache (`Cached:` minus `Shmem:`), dropped before
//! each set and filled by the reads, as on a host with a disk; the RAM
//! disk's own pages are counted in neither and were written before the
//! first measurement.

use std::collections::HashMap;
use std::fmt::Write as _;

use test_infra::kernel::GuestKernel;
use test_infra::proc_cost::ProcCost;
use test_infra::results::{mean_and_spread, Results};
use test_infra::rig::{self, Guest, ImageFile, Run};

/// The guests of each set of the density run.
const GUESTS: u32 = 10;
/// The files every guest reads: count and size of each (MiB).
const FILES: u32 = 4;
const FILE_MIB: u32 = 16;
/// Guest RAM: small, so that what ten guests touch (boot, and without DAX
/// their page caches of the files) fits in the emulated host's 3 GiB.
const GUEST_MEMORY: &str = "256M";
/// Window of the DAX set: holds all the files, with room to spare so the
/// guest never reclaims (it starts at 80 % full).
const DENSITY_WINDOW: &str = "128M";
/// The window sizes booted by the windowcost run, each twice, in an order
/// that puts each size once early and once late in the run.
const WINDOWS: [&str; 10] = [
    "0", "64M", "256M", "1G", "4G", "4G", "1G", "256M", "64M", "0",
];
const WINDOW_GUEST_MEMORY: &str = "512M";

const GUEST_SCRIPT: &str = r#"
arg() { tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p"; }
kib() { awk -v k="$1:" '$1 == k {print $2}' /proc/meminfo; }
up() { cut -d' ' -f1 /proc/uptime; }
# The host's go-ahead, through the share (10 minutes at most).
wait_file() { i=0; while [ ! -e "$1" ] && [ $i -lt 3000 ]; do sleep 0.2; i=$((i+1)); done; }
role=$(arg role); id=$(arg gid)
mkdir -p /mnt
mount -t virtiofs share /mnt -o "$(arg mountopts)" || echo "@@GUEST ${id}_mount_failed=1"
case "$role" in
density)
    echo "@@GUEST ${id}_statx=$(daxprobe statx /mnt/data/f0.bin)"
    touch /mnt/sync/ready.$id
    wait_file /mnt/sync/go
    sync; echo 3 > /proc/sys/vm/drop_caches
    echo "@@GUEST ${id}_cached_before_kib=$(kib Cached)"
    t0=$(up); cat /mnt/data/*.bin > /dev/null; t1=$(up)
    echo "@@GUEST ${id}_cached_after_kib=$(kib Cached)"
    echo "@@GUEST ${id}_read_s=$(awk "BEGIN {print $t1 - $t0}")"
    # The host measures now, while this guest still holds what it read.
    touch /mnt/sync/done.$id
    wait_file /mnt/sync/finish
    ;;
windowcost)
    echo "@@GUEST ${id}_statx=$(daxprobe statx /mnt/probe.bin)"
    # Let boot-time work (deferred initcalls, the RCU-freed initramfs) settle.
    sleep 3
    echo "@@GUEST ${id}_meminfo=$(for k in MemTotal MemFree MemAvailable Buffers Cached Shmem Slab; do printf '%s:%s ' $k "$(kib $k)"; done)"
    ;;
esac
cd /; umount /mnt
"#;

/// Emulated-host helpers of both runs: meminfo and RSS snapshots.
const HOST_HELPERS: &str = r#"
kib() { awk -v k="$1:" '$1 == k {print $2}' /proc/meminfo; }
# PcpFree: free pages held on the per-CPU lists, which MemFree leaves out;
# after the previous set's guests exit they can hold tens of MiB and hand
# them out during the reads, hiding that much of what the reads took.
meminfo() {
    for k in MemTotal MemFree MemAvailable Buffers Cached Shmem 'Active(file)' 'Inactive(file)' AnonPages Mapped PageTables SecPageTables Slab; do printf '%s:%s ' $k "$(kib $k)"; done
    printf 'PcpFree:%s ' "$(awk '$1 == "count:" {s += $2} END {print s * 4}' /proc/zoneinfo)"
}
rss() { awk '/^(VmRSS|RssAnon|RssFile|RssShmem):/ {printf "%s%s ", $1, $2}' /proc/$1/status 2>/dev/null; }
# LABEL: the host's meminfo, each VMM's RSS split, the daemons' summed
# (each daemon is a parent waiting and a sandboxed child serving).
snap() {
    echo "@@HOST $1_meminfo=$(meminfo)"
    n=0; for pid in $VMMS; do n=$((n+1)); echo "@@HOST $1_vmm$n=$(rss $pid)"; done
    echo "@@HOST $1_daemons=$(for p in $(pidof dax-virtiofsd); do cat /proc/$p/status; done | awk '/^(VmRSS|RssAnon|RssFile|RssShmem):/ {s[$1] += $2} END {for (k in s) printf "%s%s ", k, s[k]}')"
}
# LABEL: each VMM's and each daemon's (with its children) own memory and
# threads, beyond guest RAM and the share's file pages.
costs() {
    n=0; for pid in $VMMS; do n=$((n+1)); echo "@@HOST $1_vmm${n}_cost $(daxprobe proc-cost $PWD/share $pid)"; done
    n=0; for pid in $DAEMONS; do n=$((n+1)); echo "@@HOST $1_daemon${n}_cost $(daxprobe proc-cost $PWD/share $pid)"; done
}
# SECONDS FILE...: waits until all exist.
wait_files() {
    t=$1; shift; i=0
    while [ $i -lt $((t * 5)) ]; do
        ok=1; for f in "$@"; do [ -e "$f" ] || ok=0; done
        [ $ok = 1 ] && return 0
        sleep 0.2; i=$((i+1))
    done
    echo "@@HOST wait_timeout=$*"; return 1
}
"#;

/// The density run's emulated-host script: the RAM-disk share, then one set
/// of guests per mode. `run_set MODE MOUNTOPTS DAEMON_ARGS FS_ARGS`.
const DENSITY_HOST: &str = r#"
insmod brd.ko rd_nr=1 rd_size=SHARE_KIB || echo "@@HOST error=brd"
mke2fs -q /dev/ram0 >/dev/null && mkdir -p share && mount -t ext4 /dev/ram0 share || echo "@@HOST error=share_fs"
mkdir -p share/data
for i in $(seq 0 $((FILES - 1))); do dd if=/dev/urandom of=share/data/f$i.bin bs=1M count=FILE_MIB 2>/dev/null; done
sync
echo "@@HOST share=$(grep ' /work/share ' /proc/mounts) files=$(ls share/data | wc -l) kib=$(du -sk share/data | cut -f1)"
run_set() {
    mode=$1
    rm -rf share/sync; mkdir -p share/sync; chmod 777 share/sync
    socks=""; DAEMONS=""
    for g in $(seq 1 GUESTS); do
        rm -f /tmp/$mode$g.sock
        dax-virtiofsd --socket-path /tmp/$mode$g.sock --shared-dir share $3 --log-level warn &
        DAEMONS="$DAEMONS $!"; socks="$socks /tmp/$mode$g.sock"
    done
    wait_files 60 $socks
    VMMS=""; ready=""; finished=""
    for g in $(seq 1 GUESTS); do
        # Each guest's console to a file: guests writing the one
        # console byte by byte would interleave their lines.
        "$VMM" --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "BASE_CMDLINE role=density gid=$mode$g mountopts=$2" \
            --cpus boot=1 --memory size=GUEST_MEMORY,shared=on --serial tty \
            --fs tag=share,socket=/tmp/$mode$g.sock,$4,transport=pci </dev/null >$mode$g.out 2>&1 &
        VMMS="$VMMS $!"; ready="$ready share/sync/ready.$mode$g"; finished="$finished share/sync/done.$mode$g"
    done
    wait_files 900 $ready
    # The share's page cache starts empty (the guests' RAM is Shmem, which
    # this does not drop); a moment for the guests to go idle.
    sync; echo 3 > /proc/sys/vm/drop_caches; sleep 2
    snap ${mode}_before
    touch share/sync/go
    wait_files 900 $finished
    # The VMM pre-faults each new DAX range after acknowledging it: let the
    # last ones finish.
    sleep 2
    snap ${mode}_after
    costs ${mode}_after
    touch share/sync/finish
    for pid in $VMMS; do wait $pid; echo "@@HOST ${mode}_vmm_exit=$?"; done
    wait
    for g in $(seq 1 GUESTS); do
        grep -a '@@GUEST' $mode$g.out
        grep -a 'dax-vmm: \|ERROR\|error' $mode$g.out | tail -3 | sed "s/^/@@HOST ${mode}${g}_vmm_said=/"
    done
}
echo "@@HOST wmark_low_kib=$(awk '$1 == "low" {s += $2} END {print s * 4}' /proc/zoneinfo)"
# A B B A: see SETS.
run_set dax dax=always "--cache-size DENSITY_WINDOW" cache_size=DENSITY_WINDOW
run_set nodax dax=never "--dax off" dax=off
run_set nodaxb dax=never "--dax off" dax=off
run_set daxb dax=always "--cache-size DENSITY_WINDOW" cache_size=DENSITY_WINDOW
echo "@@HOST density_done"
# The rig's own VMM run is not used: the sets above started their own.
exit 0
"#;

/// The windowcost run's emulated-host script: one VMM run per size.
const WINDOWCOST_HOST: &str = r#"
mkdir -p share && dd if=/dev/urandom of=share/probe.bin bs=64k count=1 2>/dev/null
n=0
for w in WINDOWS; do
    n=$((n+1)); id=w$n
    if [ "$w" = 0 ]; then dargs="--dax off"; fargs="dax=off"; opts="dax=never"
    else dargs="--cache-size $w"; fargs="cache_size=$w"; opts="dax=always"; fi
    echo "@@HOST ${id}_window=$w"
    rm -f /tmp/$id.sock
    dax-virtiofsd --socket-path /tmp/$id.sock --shared-dir share $dargs --log-level warn &
    wait_files 60 /tmp/$id.sock
    "$VMM" --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "BASE_CMDLINE role=windowcost gid=$id mountopts=$opts" \
        --cpus boot=1 --memory size=WINDOW_GUEST_MEMORY,shared=on --serial tty \
        --fs tag=share,socket=/tmp/$id.sock,$fargs,transport=pci </dev/null
    echo "@@HOST ${id}_vmm_exit=$?"
    wait
done
echo "@@HOST windowcost_done"
exit 0
"#;

fn fail(e: String) -> ! {
    eprintln!("bench-density: {e}");
    std::process::exit(1)
}

fn main() {
    let what = std::env::args().nth(1).unwrap_or_default();
    let tool = |pkg, bin| rig::tool(pkg, bin).unwrap_or_else(|e| fail(e.to_string()));
    let mut guest = Guest::new(&format!("bench-{what}"), GUEST_SCRIPT);
    let base_cmdline = guest.cmdline();
    guest.guest_tools = vec![tool("guest-tools", "daxprobe")];
    guest.host_tools = vec![
        tool("daemon", "dax-virtiofsd"),
        tool("guest-tools", "daxprobe"),
    ];
    guest.timeout = std::time::Duration::from_secs(3600);
    let host = match what.as_str() {
        "density" => {
            let kernel = GuestKernel::fetch().unwrap_or_else(|e| fail(e.to_string()));
            let brd = kernel
                .modules_with_deps(&["brd"])
                .unwrap_or_else(|e| fail(e.to_string()));
            guest.host_files = brd
                .into_iter()
                .map(|(name, data)| ImageFile {
                    path: format!("{name}.ko"),
                    perm: 0o644,
                    data,
                })
                .collect();
            // The files, the ext2 metadata and room for the sync files.
            let share_kib = (FILES * FILE_MIB + 32) * 1024;
            DENSITY_HOST
                .replace("SHARE_KIB", &share_kib.to_string())
                .replace("$((FILES - 1))", &(FILES - 1).to_string())
                .replace("FILE_MIB", &FILE_MIB.to_string())
                .replace("GUESTS", &GUESTS.to_string())
                .replace("GUEST_MEMORY", GUEST_MEMORY)
                .replace("DENSITY_WINDOW", DENSITY_WINDOW)
        }
        "windowcost" => WINDOWCOST_HOST
            .replace("WINDOWS", &WINDOWS.join(" "))
            .replace("WINDOW_GUEST_MEMORY", WINDOW_GUEST_MEMORY),
        _ => fail("usage: bench-density density|windowcost".into()),
    };
    guest.host_before = format!(
        "{HOST_HELPERS}{}",
        host.replace("BASE_CMDLINE", &base_cmdline)
    );
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let (results, tables, failed) = match what.as_str() {
        "density" => density_report(&run),
        _ => windowcost_report(&run),
    };
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// `Key:value Key:value …` (values in KiB) as a map.
fn pairs(s: Option<&str>) -> HashMap<String, i64> {
    s.unwrap_or("")
        .split_whitespace()
        .filter_map(|kv| {
            let (k, v) = kv.split_once(':')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn mib(kib: i64) -> String {
    format!("{:+.1}", kib as f64 / 1024.0)
}

/// What the reads cost the host in one mode, from its two snapshots.
struct HostCost {
    /// meminfo after − before, KiB, by key.
    delta: HashMap<String, i64>,
    /// Per VMM: (RssAnon, RssFile, RssShmem) after − before, and after, KiB.
    vmm: Vec<([i64; 3], [i64; 3])>,
    daemons: [i64; 3],
}

const RSS_KEYS: [&str; 3] = ["RssAnon", "RssFile", "RssShmem"];

fn host_cost(run: &Run, mode: &str) -> Option<HostCost> {
    let snap = |label: &str, what: &str| pairs(run.host(&format!("{mode}_{label}_{what}")));
    let (before, after) = (snap("before", "meminfo"), snap("after", "meminfo"));
    if before.is_empty() || after.is_empty() {
        return None;
    }
    let delta = after
        .iter()
        .filter_map(|(k, a)| Some((k.clone(), a - before.get(k)?)))
        .collect();
    let split = |m: &HashMap<String, i64>| RSS_KEYS.map(|k| m.get(k).copied().unwrap_or(0));
    let minus = |a: [i64; 3], b: [i64; 3]| [a[0] - b[0], a[1] - b[1], a[2] - b[2]];
    let vmm = (1..=GUESTS)
        .map(|n| {
            let (b, a) = (
                split(&snap("before", &format!("vmm{n}"))),
                split(&snap("after", &format!("vmm{n}"))),
            );
            (minus(a, b), a)
        })
        .collect();
    let daemons = minus(
        split(&snap("after", "daemons")),
        split(&snap("before", "daemons")),
    );
    Some(HostCost {
        delta,
        vmm,
        daemons,
    })
}

/// The density run's sets of guests, in the order they run (A B B A, so a
/// set's place in the emulated host's life is not taken for its mode):
/// name, whether DAX, row label.
const SETS: [(&str, bool, &str); 4] = [
    ("dax", true, "DAX, 1st"),
    ("nodax", false, "no DAX, 1st"),
    ("nodaxb", false, "no DAX, 2nd"),
    ("daxb", true, "DAX, 2nd"),
];

/// Memory the host cannot take back without swap: the guests' RAM (Shmem:
/// memfd), anonymous memory, and page tables (the host's and KVM's).
const PINNED: [&str; 4] = ["Shmem", "AnonPages", "PageTables", "SecPageTables"];

fn density_report(run: &Run) -> (Results, String, bool) {
    let mut results = Results::new("density-bench");
    results.record_run("density run", run);
    let total_mib = FILES * FILE_MIB;
    let mut tables = format!(
        "{GUESTS} guests at once ({GUEST_MEMORY} RAM, shared=on, 1 vCPU each), each with its own daemon on one \
         host directory (ext2 on a RAM disk), each reading the same {FILES} x {FILE_MIB} MiB files once \
         (`cat`); DAX sets: {DENSITY_WINDOW} windows, guests mount dax=always; no-DAX sets: daemons \
         `--dax off`, guests mount dax=never. Emulated host, after the reads minus before them, MiB \
         (pinned = {}):\n\n\
         | set | MemAvailable | MemFree | free on per-CPU lists | Shmem | Cached | share's page cache (Cached - Shmem) | file LRU | PageTables | SecPageTables (KVM) | Slab | pinned |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        PINNED.join(" + ")
    );
    let mut failed = false;
    let mut costs = HashMap::new();
    for (set, _, label) in SETS {
        let Some(cost) = host_cost(run, set) else {
            failed = true;
            tables.push_str(&format!("| {label} | missing |\n"));
            continue;
        };
        let d = |k: &str| cost.delta.get(k).copied().unwrap_or(0);
        let page_cache = d("Cached") - d("Shmem");
        let file_lru = d("Active(file)") + d("Inactive(file)");
        let pinned: i64 = PINNED.iter().map(|k| d(k)).sum();
        let row = [
            d("MemAvailable"),
            d("MemFree"),
            d("PcpFree"),
            d("Shmem"),
            d("Cached"),
            page_cache,
            file_lru,
            d("PageTables"),
            d("SecPageTables"),
            d("Slab"),
            pinned,
        ];
        let _ = writeln!(tables, "| {label} | {} |", row.map(mib).join(" | "));
        for (k, v) in [
            ("MemAvailable", d("MemAvailable")),
            ("MemFree", d("MemFree")),
            ("free on per-CPU lists", d("PcpFree")),
            ("Shmem", d("Shmem")),
            ("Cached", d("Cached")),
            ("Cached - Shmem", page_cache),
            ("pinned", pinned),
        ] {
            results.record(&format!("{label}: host {k} after - before, MiB"), mib(v));
        }
        costs.insert(set, cost);
    }
    if let Some(low) = run.host("wmark_low_kib") {
        let _ = writeln!(
            tables,
            "\n(The emulated host's low watermarks, summed over its zones: {low} KiB. MemAvailable counts \
             page cache as available less the smaller of half of it and this.)"
        );
        results.record("emulated host: low watermarks summed, KiB", low);
    }
    tables.push_str("\nEach VMM's RSS, after the reads minus before (after), MiB:\n\n| set | VMM | RssAnon | RssFile | RssShmem |\n|---|---|---|---|---|\n");
    for (set, _, label) in SETS {
        let Some(cost) = costs.get(set) else { continue };
        for (n, (delta, after)) in cost.vmm.iter().enumerate() {
            let cells: Vec<String> = (0..3)
                .map(|i| format!("{} ({:.1})", mib(delta[i]), after[i] as f64 / 1024.0))
                .collect();
            let _ = writeln!(tables, "| {label} | {} | {} |", n + 1, cells.join(" | "));
            results.record(
                &format!(
                    "{label}: VMM {} RssAnon/RssFile/RssShmem after - before (after), MiB",
                    n + 1
                ),
                cells.join(" / "),
            );
        }
        let _ = writeln!(
            tables,
            "| {label} | the {GUESTS} daemons, summed (no after) | {} |",
            cost.daemons.map(mib).join(" | ")
        );
    }
    own_cost_table(run, &mut results, &mut tables, &mut failed);
    tables.push_str(&format!("\nEach guest's page cache (`Cached:`), after its reads minus before, MiB, and its read time ({total_mib} MiB, guest clock):\n\n| set | guest | Cached after - before | read time | DAX on the files (statx) |\n|---|---|---|---|---|\n"));
    for (set, _, label) in SETS {
        for g in 1..=GUESTS {
            let id = format!("{set}{g}");
            let v = |k: &str| run.guest(&format!("{id}_{k}")).map(str::to_string);
            let kib = |k: &str| v(k).and_then(|s| s.trim().parse::<i64>().ok());
            let grown = match (kib("cached_before_kib"), kib("cached_after_kib")) {
                (Some(b), Some(a)) => mib(a - b),
                _ => {
                    failed = true;
                    "missing".into()
                }
            };
            let read = v("read_s").map_or("missing".into(), |s| format!("{s} s"));
            let dax = v("statx").map_or("-".into(), |s| {
                if s.trim().ends_with(":1") {
                    "yes"
                } else {
                    "no"
                }
                .to_string()
            });
            let _ = writeln!(tables, "| {label} | {g} | {grown} | {read} | {dax} |");
            results.record(
                &format!("{label}: guest {g} Cached after - before, MiB"),
                grown,
            );
            results.record(&format!("{label}: guest {g} read time"), read);
        }
    }
    // What the reads cost the host, mean of the two sets of each mode:
    // memory it can no longer hand out (a fall in MemAvailable or MemFree,
    // a rise in Shmem or in the pinned sum).
    let mean_cost = |dax: bool, cost_of: &dyn Fn(&HostCost) -> i64| -> Option<f64> {
        let v: Vec<i64> = SETS
            .iter()
            .filter(|s| s.1 == dax)
            .map(|s| costs.get(s.0).map(cost_of))
            .collect::<Option<_>>()?;
        Some(v.iter().sum::<i64>() as f64 / v.len() as f64)
    };
    let ratio = |cost_of: &dyn Fn(&HostCost) -> i64| match (
        mean_cost(true, cost_of),
        mean_cost(false, cost_of),
    ) {
        (Some(a), Some(b)) if b > 0.0 => format!(
            "{:.3}x ({:.1} / {:.1} MiB; per guest {:.1} / {:.1} MiB)",
            a / b,
            a / 1024.0,
            b / 1024.0,
            a / 1024.0 / f64::from(GUESTS),
            b / 1024.0 / f64::from(GUESTS)
        ),
        (Some(a), Some(b)) => format!("n/a (DAX {:.1}, no DAX {:.1} MiB)", a / 1024.0, b / 1024.0),
        _ => "n/a (a measurement is missing)".into(),
    };
    let key = |c: &HostCost, k: &str| c.delta.get(k).copied().unwrap_or(0);
    let ratios = [
        (
            "host memory the reads cost, DAX / no DAX, by the fall in MemAvailable (target 0.1x or less)",
            ratio(&|c| -key(c, "MemAvailable")),
        ),
        (
            "the same, counting free pages on the per-CPU lists as available",
            ratio(&|c| -key(c, "MemAvailable") - key(c, "PcpFree")),
        ),
        (
            "host memory the reads cost, DAX / no DAX, by the rise in Shmem (target 0.1x or less)",
            ratio(&|c| key(c, "Shmem")),
        ),
        (
            "host memory the reads cost, DAX / no DAX, by the rise in pinned memory",
            ratio(&|c| PINNED.iter().map(|k| key(c, k)).sum()),
        ),
        (
            "host memory the reads cost, DAX / no DAX, by the fall in MemFree (page cache counted as used)",
            ratio(&|c| -key(c, "MemFree")),
        ),
        (
            "the same, counting free pages on the per-CPU lists as free",
            ratio(&|c| -key(c, "MemFree") - key(c, "PcpFree")),
        ),
    ];
    tables.push_str(
        "\nMeans of the two sets of each mode (DAX / no DAX):\n\n| ratio | measured |\n|---|---|\n",
    );
    for (what, r) in ratios {
        let _ = writeln!(tables, "| {what} | {r} |");
        results.record(what, r);
    }
    for (set, _, _) in SETS {
        let exits: Vec<&str> = run
            .lines
            .iter()
            .filter_map(|l| l.text.split_once(&format!("@@HOST {set}_vmm_exit=")))
            .map(|(_, v)| v.trim())
            .collect();
        failed |= exits.len() != GUESTS as usize || exits.iter().any(|e| *e != "0");
        results.record(&format!("{set}: VMM exit statuses"), exits.join(" "));
    }
    (results, tables, failed)
}

/// Per set, what each VMM and each daemon costs on its own after the
/// reads (`daxprobe proc-cost`: smaps without guest RAM and the share's
/// file pages), over the set's guests: mean (each; spread).
fn own_cost_table(run: &Run, results: &mut Results, tables: &mut String, failed: &mut bool) {
    tables.push_str(&format!(
        "\nEach VMM's and daemon's own memory (smaps, every mapping except guest RAM's memfd and files under the share) \
         and threads, after the reads, over the {GUESTS} guests of each set: mean (each; spread):\n\n\
         | set | VMM own Rss, MiB | VMM own Pss, MiB | VMM threads | daemon own Rss, MiB | daemon own Pss, MiB | daemon threads | VMM + daemon own Pss, MiB |\n\
         |---|---|---|---|---|---|---|---|\n"
    ));
    for (set, _, label) in SETS {
        let of = |who: &str| -> Vec<ProcCost> {
            (1..=GUESTS)
                .filter_map(|n| {
                    ProcCost::parse_line(run.host(&format!("{set}_after_{who}{n}_cost"))?).ok()
                })
                .collect()
        };
        let (vmms, daemons) = (of("vmm"), of("daemon"));
        *failed |= vmms.len() != GUESTS as usize || daemons.len() != GUESTS as usize;
        let col = |cs: &[ProcCost], f: &dyn Fn(&ProcCost) -> f64, digits| {
            mean_and_spread(&cs.iter().map(f).collect::<Vec<_>>(), digits)
        };
        let kib = |v: u64| v as f64 / 1024.0;
        let both: Vec<f64> = vmms
            .iter()
            .zip(&daemons)
            .map(|(v, d)| kib(v.own.pss + d.own.pss))
            .collect();
        let cells = [
            col(&vmms, &|c| kib(c.own.rss), 1),
            col(&vmms, &|c| kib(c.own.pss), 1),
            col(&vmms, &|c| f64::from(c.threads), 0),
            col(&daemons, &|c| kib(c.own.rss), 1),
            col(&daemons, &|c| kib(c.own.pss), 1),
            col(&daemons, &|c| f64::from(c.threads), 0),
            mean_and_spread(&both, 1),
        ];
        let _ = writeln!(tables, "| {label} | {} |", cells.join(" | "));
        results.record(
            &format!("{label}: per guest, VMM own Rss / Pss MiB / threads, daemon own Rss / Pss MiB / threads, VMM + daemon own Pss MiB"),
            cells.join(" ; "),
        );
    }
}

fn windowcost_report(run: &Run) -> (Results, String, bool) {
    let mut results = Results::new("window-cost");
    results.record_run("window boot cost run", run);
    let mut tables = format!(
        "One guest at a time ({WINDOW_GUEST_MEMORY} RAM, 1 vCPU), the share mounted (dax=always; dax=never with no window), \
         3 s after the mount, MiB:\n\n\
         | window | MemTotal | used (MemTotal - MemAvailable) | used (MemTotal - MemFree - Buffers - Cached) | DAX (statx) |\n|---|---|---|---|---|\n"
    );
    let mut failed = false;
    // (window GiB, used by MemAvailable, used by MemFree) for the fit.
    let mut points: Vec<(f64, f64, f64)> = Vec::new();
    for n in 1..=WINDOWS.len() {
        let id = format!("w{n}");
        let window = run.host(&format!("{id}_window")).unwrap_or("?").to_string();
        let m = pairs(run.guest(&format!("{id}_meminfo")));
        let k = |key: &str| m.get(key).copied();
        let (Some(total), Some(avail), Some(free), Some(buffers), Some(cached)) = (
            k("MemTotal"),
            k("MemAvailable"),
            k("MemFree"),
            k("Buffers"),
            k("Cached"),
        ) else {
            failed = true;
            let _ = writeln!(tables, "| {window} | missing | | | |");
            continue;
        };
        let used_avail = total - avail;
        let used_free = total - free - buffers - cached;
        let dax = run.guest(&format!("{id}_statx")).map_or("-", |s| {
            if s.trim().ends_with(":1") {
                "yes"
            } else {
                "no"
            }
        });
        let _ = writeln!(
            tables,
            "| {window} | {:.1} | {:.1} | {:.1} | {dax} |",
            total as f64 / 1024.0,
            used_avail as f64 / 1024.0,
            used_free as f64 / 1024.0
        );
        results.record(
            &format!("window {window} (boot {n}): MemTotal / used by MemAvailable / used by MemFree, MiB"),
            format!(
                "{:.1} / {:.1} / {:.1}",
                total as f64 / 1024.0,
                used_avail as f64 / 1024.0,
                used_free as f64 / 1024.0
            ),
        );
        if let Some(gib) = gib_of(&window) {
            points.push((gib, used_avail as f64 / 1024.0, used_free as f64 / 1024.0));
        }
    }
    tables.push_str("\n| cost of the window in guest RAM, least-squares slope over all boots | MiB per GiB of window |\n|---|---|\n");
    for (what, pick) in [
        ("by MemTotal - MemAvailable", 1usize),
        ("by MemTotal - MemFree - Buffers - Cached", 2),
    ] {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.0, if pick == 1 { p.1 } else { p.2 }))
            .collect();
        let slope = slope(&pts).map_or("n/a".into(), |s| format!("{s:.1}"));
        let _ = writeln!(tables, "| {what} | {slope} |");
        results.record(&format!("window cost per GiB, {what}, MiB"), slope);
    }
    tables.push_str("\n(The floor: 64 bytes of `struct page` per 4 KiB page = 16 MiB per GiB.)\n");
    (results, tables, failed)
}

/// "64M", "4G", "0" in GiB.
fn gib_of(size: &str) -> Option<f64> {
    if size == "0" {
        return Some(0.0);
    }
    let (n, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
    let n: f64 = n.parse().ok()?;
    match unit {
        "M" => Some(n / 1024.0),
        "G" => Some(n),
        _ => None,
    }
}

/// Least-squares slope of y over x.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_sizes_read_as_gib() {
        assert_eq!(gib_of("0"), Some(0.0));
        assert_eq!(gib_of("64M"), Some(0.0625));
        assert_eq!(gib_of("4G"), Some(4.0));
        assert_eq!(gib_of("4T"), None);
        assert_eq!(gib_of("?"), None);
    }

    #[test]
    fn slope_is_the_least_squares_fit() {
        let line: Vec<(f64, f64)> = [0.0, 0.25, 1.0, 4.0]
            .iter()
            .map(|&x| (x, 32.0 + 16.0 * x))
            .collect();
        assert!((slope(&line).unwrap() - 16.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 2.0)]), None, "one point has no slope");
        assert_eq!(slope(&[(1.0, 2.0), (1.0, 3.0)]), None, "no spread in x");
    }

    #[test]
    fn snapshot_pairs_parse_with_parenthesised_keys() {
        let m = pairs(Some("MemFree:100 Active(file):7 PcpFree:12 Bad:x "));
        assert_eq!(m["MemFree"], 100);
        assert_eq!(m["Active(file)"], 7);
        assert_eq!(m["PcpFree"], 12);
        assert!(!m.contains_key("Bad"));
        assert!(pairs(None).is_empty());
    }
}
