//! The demo: boots a guest under dax-vmm through the rig with a virtio-fs
//! DAX share served by dax-virtiofsd, and shows what DAX did — every line
//! derived from what this run measured: which files the guest sees with
//! DAX and why the others are kept off (the daemon's own reasons), the
//! ranges the VMM mapped (its metrics) and the daemon asked for (its
//! stats), and the same reads without DAX in the same boot, with their time
//! and how much the guest's page cache grew each way.
//! `cargo run -p dax-bench --bin demo -- --help`.

use std::time::Duration;

use control_protocol::AdaptiveEvents;
use test_infra::rig::{self, Guest, Run};

/// The files the guest reads both ways (sizes in MiB).
const READ_FILES: [(&str, u64); 2] = [("lib.bin", 8), ("data.bin", 4)];

const DEMO_SCRIPT: &str = r#"
up() { cut -d' ' -f1 /proc/uptime; }
cached() { awk '/^Cached:/ {print $2}' /proc/meminfo; }
# One read pass over the files in /mnt, guest caches dropped first: its
# time, how much the guest's page cache grew and the md5s, under names
# prefixed with $1.
read_pass() {
    sync; echo 3 > /proc/sys/vm/drop_caches
    c0=$(cached); t0=$(up)
    md5sum lib.bin data.bin > /tmp/sums.$1
    t1=$(up); c1=$(cached)
    echo "@@GUEST $1_read_s=$(awk "BEGIN{print $t1-$t0}")"
    echo "@@GUEST $1_cached_kib=$((c1-c0))"
    echo "@@GUEST $1_sums=$(cut -d' ' -f1 /tmp/sums.$1 | tr '\n' ' ')"
}
echo "@@GUEST kernel=$(uname -r)"
echo "@@GUEST nproc=$(nproc)"
echo "@@GUEST memtotal=$(awk '/^MemTotal:/ {print $2 " " $3}' /proc/meminfo)"
mkdir -p /mnt && mount -t virtiofs share /mnt -o dax=inode
echo "@@GUEST mount=$(grep ' /mnt ' /proc/mounts)"
cd /mnt
echo "@@GUEST sizes=$(ls -l lib.bin data.bin big.bin hello.txt | awk '{print $9 ":" $5}' | tr '\n' ' ')"
echo "@@GUEST statx_dax=$(daxprobe statx lib.bin data.bin big.bin hello.txt)"
# Pass 1, dax=inode: the policy's files through the window.
read_pass dax
# The host reads the VMM's and the daemon's counters now, while it is mapped.
touch .dax-done
i=0; while [ ! -e .host-done ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
cd /; umount /mnt
# Pass 2, dax=never: the same reads through FUSE and the guest's page cache.
mount -t virtiofs share /mnt -o dax=never
cd /mnt
echo "@@GUEST statx_never=$(daxprobe statx lib.bin data.bin)"
read_pass never
echo "written by the guest" > from-guest.txt && sync
cd /; umount /mnt
"#;

/// Host side: the share (two files DAX takes, one larger than half the
/// window that the daemon's adaptive default keeps off, one under the
/// default policy's 32 KiB), the daemon with its control socket, and a
/// watcher that reads the counters when the guest has read through DAX.
const HOST_BEFORE: &str = r#"
mkdir -p share && echo "hello from the host" > share/hello.txt
dd if=/dev/urandom of=share/lib.bin bs=1M count=8 2>/dev/null
dd if=/dev/urandom of=share/data.bin bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=share/big.bin bs=1M count=64 2>/dev/null
echo "@@HOST sums=$(md5sum share/lib.bin share/data.bin | cut -d' ' -f1 | tr '\n' ' ')"
dax-virtiofsd --socket-path /tmp/demo-fs.sock --shared-dir share --cache-size 32M \
    --control-socket /tmp/demo-ctl.sock --log-level info &
DAEMON=$!
i=0; while [ ! -S /tmp/demo-fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
( i=0; while [ ! -e share/.dax-done ] && [ $i -lt 3000 ] && { [ $i -lt 300 ] || pidof dax-vmm >/dev/null; }; do sleep 0.1; i=$((i+1)); done
  daxprobe http /tmp/demo-api.sock GET /api/v1/vm.dax-metrics > metrics.out 2>&1
  m() { sed -n "s/.* $1{device=\"[^\"]*\"} \([0-9]*\).*/\1/p" metrics.out; }
  echo "@@HOST window=maps:$(m daxvmm_dax_maps_total) unmaps:$(m daxvmm_dax_unmaps_total) ranges:$(m daxvmm_dax_mapped_ranges) mapped_bytes:$(m daxvmm_dax_mapped_bytes) window_bytes:$(m daxvmm_dax_window_bytes) resident_bytes:$(m daxvmm_dax_resident_bytes)"
  s=$(daxprobe http /tmp/demo-ctl.sock GET /api/v1/stats)
  echo "@@HOST daemon=setupmappings:$(echo "$s" | grep -o '"setupmappings":[0-9]*' | cut -d: -f2) removemappings:$(echo "$s" | grep -o '"removemappings":[0-9]*' | cut -d: -f2)"
  echo "@@HOST adaptive_events=$(daxprobe http /tmp/demo-ctl.sock GET '/api/v1/adaptive/events?after=0' | sed 's/^status=[0-9]* body=//')"
  echo "@@HOST policy=$(daxprobe http /tmp/demo-ctl.sock GET /api/v1/policy | sed 's/^status=[0-9]* body=//')"
  touch share/.host-done ) &
"#;

const HOST_AFTER: &str = r#"
wait $DAEMON
echo "@@HOST from_guest=$(cat share/from-guest.txt)"
"#;

fn usage() -> ! {
    eprintln!("usage: demo [--cpus N] [--memory SIZE] [--cmdline WORDS] [--timeout SECS] [--vmm-arg ARG]... [--script FILE] [--echo]");
    std::process::exit(2);
}

fn main() {
    let mut guest = Guest::new("demo", DEMO_SCRIPT);
    guest.cpus = 2;
    guest.memory = "512M,shared=on".into();
    let tool = |pkg, bin| {
        rig::tool(pkg, bin).unwrap_or_else(|e| {
            eprintln!("demo: {e}");
            std::process::exit(1)
        })
    };
    guest.host_tools = vec![
        tool("daemon", "dax-virtiofsd"),
        tool("guest-tools", "daxprobe"),
    ];
    guest.guest_tools = vec![tool("guest-tools", "daxprobe")];
    guest.host_before = HOST_BEFORE.into();
    guest.host_after = HOST_AFTER.into();
    guest.vmm_args = vec![
        "-v".into(),
        "--api-socket".into(),
        "/tmp/demo-api.sock".into(),
        "--fs".into(),
        "tag=share,socket=/tmp/demo-fs.sock,cache_size=32M,id=fs0".into(),
    ];
    let mut custom_script = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--cpus" => guest.cpus = value().parse().unwrap_or_else(|_| usage()),
            "--memory" => guest.memory = value(),
            "--cmdline" => guest.cmdline = value(),
            "--timeout" => {
                guest.timeout = Duration::from_secs(value().parse().unwrap_or_else(|_| usage()))
            }
            "--vmm-arg" => guest.vmm_args.push(value()),
            "--script" => {
                let path = value();
                guest.script = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                    eprintln!("demo: --script {path}: {e}");
                    std::process::exit(2)
                });
                custom_script = true;
            }
            "--echo" => std::env::set_var("DAX_VMM_RIG_ECHO", "1"),
            _ => usage(),
        }
    }
    let run = match rig::run(&guest) {
        Ok(run) => run,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(1);
        }
    };
    println!("{}", run.text());
    println!();
    if custom_script {
        report_custom(&run);
    } else {
        report(&run);
    }
    report_vmm(&run);
    let sums_differ = !custom_script
        && ["dax_sums", "never_sums"]
            .iter()
            .any(|k| run.guest(k).is_none() || run.guest(k) != run.host("sums"));
    if run.timed_out || run.vmm_exit != Some(0) || sums_differ {
        std::process::exit(1);
    }
}

/// With the caller's own guest script: what it printed, as it printed it.
fn report_custom(run: &Run) {
    println!("== what the guest found ==");
    let mut found: Vec<_> = run.guest_values().into_iter().collect();
    found.sort();
    for (k, v) in found {
        println!("  {k:14} {v}");
    }
}

/// `name:value` pairs of a marker.
fn pairs(s: &str) -> Vec<(&str, &str)> {
    s.split_whitespace()
        .filter_map(|kv| kv.split_once(':'))
        .collect()
}

fn field<'a>(s: Option<&'a str>, key: &str) -> &'a str {
    s.and_then(|s| pairs(s).into_iter().find(|(k, _)| *k == key))
        .map_or("?", |(_, v)| v)
}

/// Why a file the guest sees without DAX is kept off: the daemon's
/// adaptive decision for it if it made one, else what its policy's rules
/// say (evaluated with the daemon's own evaluator and policy).
fn reason(run: &Run, path: &str, size: u64) -> String {
    let events: Option<AdaptiveEvents> = run
        .host("adaptive_events")
        .and_then(|b| serde_json::from_str(b).ok());
    if let Some(e) = events.and_then(|ev| {
        ev.events
            .into_iter()
            .rev()
            .find(|e| e.path.as_deref() == Some(path))
    }) {
        return format!(
            "the daemon's adaptive default: {} ({}, window {} % full)",
            e.reason, e.kind, e.occupancy_pct
        );
    }
    let document = run
        .host("policy")
        .and_then(|b| serde_json::from_str::<serde_json::Value>(b).ok())
        .map(|v| v["policy"].clone());
    let rules = document
        .as_ref()
        .map_or(String::new(), |d| d["rules"].to_string());
    let policy = document.and_then(|d| policies::Policy::parse_json(&d.to_string()).ok());
    match policy.map(|p| policies::Evaluator::new(&p).decide(path, size)) {
        Some(d) if !d.dax && !d.by_default => {
            format!("a rule of the daemon's policy (rules: {rules})")
        }
        Some(d) if !d.dax => "the daemon's policy default".into(),
        Some(_) => "the policy says DAX, yet the guest does not show it".into(),
        None => "(the daemon's policy could not be read)".into(),
    }
}

fn report(run: &Run) {
    let sizes: Vec<(String, u64)> = pairs(run.guest("sizes").unwrap_or(""))
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect();
    let statx = run.guest("statx_dax").unwrap_or("");
    println!("== which files the guest sees with DAX (statx in the guest) ==");
    for (path, dax) in pairs(statx) {
        let size = sizes.iter().find(|(p, _)| p == path).map_or(0, |s| s.1);
        if dax == "1" {
            println!("  {path:10} {size:>9} bytes  DAX");
        } else {
            println!(
                "  {path:10} {size:>9} bytes  no DAX: {}",
                reason(run, path, size)
            );
        }
    }
    let window = run.host("window");
    let daemon = run.host("daemon");
    println!(
        "== the window after the guest read {} through it ==",
        names()
    );
    println!(
        "  the VMM (vm.dax-metrics)  {} maps, {} unmaps; {} 2 MiB ranges and {} bytes mapped of a {}-byte window; {} bytes of them resident on the host",
        field(window, "maps"),
        field(window, "unmaps"),
        field(window, "ranges"),
        field(window, "mapped_bytes"),
        field(window, "window_bytes"),
        field(window, "resident_bytes"),
    );
    println!(
        "  the daemon (its stats)    {} SETUPMAPPINGs, {} REMOVEMAPPINGs",
        field(daemon, "setupmappings"),
        field(daemon, "removemappings"),
    );
    println!("== the same reads both ways, one boot (guest caches dropped before each) ==");
    let host_sums = run.host("sums").unwrap_or("-");
    for (mode, label) in [("dax", "dax=inode"), ("never", "dax=never")] {
        let sums = run.guest(&format!("{mode}_sums")).unwrap_or("");
        println!(
            "  {label:10} {} s, guest page cache (Cached:) {:+} KiB, data {}",
            run.guest(&format!("{mode}_read_s")).unwrap_or("?"),
            run.guest(&format!("{mode}_cached_kib"))
                .and_then(|k| k.parse::<i64>().ok())
                .unwrap_or(0),
            if sums == host_sums {
                "identical to the host's (md5)"
            } else {
                "DIFFERENT from the host's"
            }
        );
    }
    println!("  (times are the guest's clock under this host; compare the two lines, not across machines)");
    println!("== the host ==");
    println!("  from_guest     {}", run.host("from_guest").unwrap_or("-"));
    println!("== the daemon ==");
    for line in run
        .lines
        .iter()
        .filter(|l| l.text.contains("dax_virtiofsd"))
    {
        println!("  {}", line.text);
    }
    println!("== next ==");
    println!("  GET /api/v1/vm.dax-metrics on the VMM's --api-socket gives these counters live (Prometheus text),");
    println!("  GET /api/v1/vm.dax-events streams every map, unmap, truncation and adaptive decision (docs/api.md);");
    println!("  PUT /api/v1/vm.dax-policy?id=fs0 changes which files get DAX while the guest runs (docs/policies.md).");
}

fn names() -> String {
    READ_FILES
        .iter()
        .map(|(n, mib)| format!("{n} ({mib} MiB)"))
        .collect::<Vec<_>>()
        .join(" and ")
}

fn report_vmm(run: &Run) {
    println!("== the VMM ==");
    println!(
        "  exit status    {}",
        run.vmm_exit
            .map(|s| s.to_string())
            .unwrap_or_else(|| "none (did not finish)".into())
    );
    println!("  said           {}", run.vmm_message().unwrap_or("-"));
    if let Some(t) = run.guest_boot_to_init() {
        println!("  boot-to-init   {:.2} s", t.as_secs_f64());
    }
    println!("  log            {}", run.log_path.display());
}
