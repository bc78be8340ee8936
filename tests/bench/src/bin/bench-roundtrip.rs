//! The SETUPMAPPING round trip beside a 4 KiB FUSE READ round trip (a
//! benchmark, not a test), in one guest boot: `scripts/bench.sh roundtrip`.
//!
//! The guest has three virtio-fs devices on the same host directory, each
//! served by its own `dax-virtiofsd`: `daxshare` with a 128 MiB window,
//! mounted `dax=always`; `daxnopf`, the same with the VMM's pre-faulting off
//! (`dax_prefault=off`), which tells whether a SETUPMAPPING waits behind the
//! pre-fault of the range before it; and `fuseshare` without DAX (`--dax
//! off`), mounted `dax=never`. A fourth, `daxhuge`, serves a copy of the
//! file from a host tmpfs with 2 MiB pages (each range pre-faults in one
//! step there). For each DAX mount in turn, `daxprobe
//! roundtrip` alternates, pass by pass, timing the
//! first touch of each 2 MiB range of a 64 MiB file with guest caches
//! dropped (one SETUPMAPPING and a fault each), a byte 1 MiB into each
//! range right after (a page of a mapped range: faults, no round trip), the
//! same first touches in a new mapping (the guest's fault alone), and 4 KiB
//! `O_DIRECT` preads on the other mount (one FUSE READ each). Then, in
//! single passes between marks, each VMM and daemon thread's CPU time per
//! operation (`bench_roundtrip/cpu.rs`). The host then reads where a SETUPMAPPING's time goes:
//! the daemon's SHMEM_MAP round-trip histogram (daemon → VMM → ack, its
//! control socket's stats) and the VMM's own map histogram (checks and
//! mmap, its API's `vm.dax-metrics`), and both sides' per-stage trace of a
//! map (the daemon's `map_stages`, the VMM's `daxvmm_dax_map_stage_*`), from
//! which it derives what is left to the guest side (the cold touch less
//! the daemon's whole handling). `DAX_VMM_BIN` and `DAX_BENCH_DAEMON_BIN`
//! run other builds of the VMM and the daemon (an A/B comparison). Writes
//! `target/rig-results/roundtrip-bench.md`.
//!
//! `bench-roundtrip floor` runs the daemon built with `bench-unacked-maps`
//! and started with `--bench-unacked-maps`: it answers the guest without
//! waiting for the VMM's ack, which is unsafe
//! (the guest may read the window's zeros) and measures the least any
//! asynchronous map could cost, the VMM's work still beside the guest's.
//! Writes `target/rig-results/roundtrip-floor-bench.md`.
//!
//! Last, the guest kernel's function-graph tracer times one more pass per
//! mount from inside the guest (`bench_roundtrip/guest_trace.rs`).

use std::fmt::Write as _;

use control_protocol::{DaemonStats, StageTotal};
use test_infra::prom::{label, samples};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, Run};

#[path = "bench_roundtrip/cpu.rs"]
mod cpu;
#[path = "bench_roundtrip/guest_trace.rs"]
mod guest_trace;

const FILE_MIB: u32 = 64;
/// The file's 2 MiB ranges: one cold touch each per pass.
const RANGES: u32 = FILE_MIB / 2;
/// Each pass touches FILE_MIB / 2 ranges and makes as many preads.
const PASSES: u32 = 16;
const WINDOW: &str = "128M";
/// A `dax-virtiofsd` binary to run instead of this workspace's.
const DAEMON_BIN_ENV: &str = "DAX_BENCH_DAEMON_BIN";

const GUEST_SCRIPT: &str = r#"
mkdir -p /dax /daxnopf /daxhuge /fuse
mount -t virtiofs daxshare /dax -o dax=always || echo "@@GUEST dax_mount_failed=1"
mount -t virtiofs daxnopf /daxnopf -o dax=always || echo "@@GUEST daxnopf_mount_failed=1"
mount -t virtiofs daxhuge /daxhuge -o dax=always || echo "@@GUEST daxhuge_mount_failed=1"
mount -t virtiofs fuseshare /fuse -o dax=never || echo "@@GUEST fuse_mount_failed=1"
echo "@@GUEST statx=$(daxprobe statx /dax/rt.bin /daxnopf/rt.bin /daxhuge/rt.bin /fuse/rt.bin)"
echo "@@GUEST rt=$(daxprobe roundtrip /dax/rt.bin /fuse/rt.bin PASSES 2>&1)"
echo "@@GUEST rtnopf=$(daxprobe roundtrip /daxnopf/rt.bin /fuse/rt.bin PASSES 2>&1)"
echo "@@GUEST rthuge=$(daxprobe roundtrip /daxhuge/rt.bin /fuse/rt.bin PASSES 2>&1)"
# The host reads the daemon's and the VMM's histograms now, while both run.
touch /fuse/.rt-done
i=0; while [ ! -e /fuse/.host-done ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
# Then each thread's CPU time around single passes (after the histograms:
# these maps are not theirs).
CPU_MARKED_PASSES
# Last, the guest kernel's own trace of a pass per mount.
GUEST_TRACE_PASSES
umount /dax /daxnopf /daxhuge /fuse
"#;

const HOST_BEFORE: &str = r#"
mkdir -p share share-huge && dd if=/dev/urandom of=share/rt.bin bs=1M count=FILE_MIB 2>/dev/null
mount -t tmpfs -o huge=always,size=256m tmpfs share-huge && cp share/rt.bin share-huge/
echo "@@HOST share_huge_kib=$(grep ShmemHugePages /proc/meminfo | tr -s ' ' | cut -d' ' -f2)"
rm -f /tmp/dax.sock /tmp/daxnopf.sock /tmp/daxhuge.sock /tmp/fuse.sock
dax-virtiofsd --socket-path /tmp/dax.sock --shared-dir share --cache-size WINDOW --control-socket /tmp/ctl.sock --log-level warn FLOOR_ARGS&
dax-virtiofsd --socket-path /tmp/daxnopf.sock --shared-dir share --cache-size WINDOW --control-socket /tmp/ctlnopf.sock --log-level warn FLOOR_ARGS&
dax-virtiofsd --socket-path /tmp/daxhuge.sock --shared-dir share-huge --cache-size WINDOW --control-socket /tmp/ctlhuge.sock --log-level warn FLOOR_ARGS&
dax-virtiofsd --socket-path /tmp/fuse.sock --shared-dir share --dax off --log-level warn &
i=0; while { [ ! -S /tmp/dax.sock ] || [ ! -S /tmp/daxnopf.sock ] || [ ! -S /tmp/daxhuge.sock ] || [ ! -S /tmp/fuse.sock ]; } && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
( i=0; while [ ! -e share/.rt-done ] && [ $i -lt 6000 ]; do sleep 0.2; i=$((i+1)); done
  echo "@@HOST daemon_stats_fs0=$(daxprobe http /tmp/ctl.sock GET /api/v1/stats | sed 's/^status=[0-9]* body=//')"
  echo "@@HOST daemon_stats_fs2=$(daxprobe http /tmp/ctlnopf.sock GET /api/v1/stats | sed 's/^status=[0-9]* body=//')"
  echo "@@HOST daemon_stats_fs3=$(daxprobe http /tmp/ctlhuge.sock GET /api/v1/stats | sed 's/^status=[0-9]* body=//')"
  echo "@@HOST vmm_metrics=$(daxprobe http /tmp/api.sock GET /api/v1/vm.dax-metrics | sed 's/^status=[0-9]* body=//')"
  touch share/.host-done ) &
"#;

fn fail(e: String) -> ! {
    eprintln!("bench-roundtrip: {e}");
    std::process::exit(1)
}

/// The daemon's measurement build for `floor` (see daemon/Cargo.toml).
const FLOOR_FEATURE: &str = "bench-unacked-maps";

/// Whether this run is the `floor` one (the only argument there is).
fn floor_arg(args: &[String]) -> Result<bool, String> {
    match args {
        [] => Ok(false),
        [a] if a == "floor" => Ok(true),
        other => Err(format!(
            "unknown arguments {other:?}: none, or `floor` (the daemon answers before the VMM's ack, a measurement build)"
        )),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let floor = floor_arg(&args).unwrap_or_else(|e| fail(e));
    let tool = |pkg, bin| rig::tool(pkg, bin).unwrap_or_else(|e| fail(e.to_string()));
    let mut guest = Guest::new(
        "bench-roundtrip",
        &GUEST_SCRIPT
            .replace("CPU_MARKED_PASSES\n", &cpu::guest_script(RANGES))
            .replace("GUEST_TRACE_PASSES\n", &guest_trace::guest_script())
            .replace("PASSES", &PASSES.to_string()),
    );
    guest.cpus = 1;
    guest.memory = "512M,shared=on".into();
    guest.guest_tools = vec![tool("guest-tools", "daxprobe")];
    // An A/B comparison runs another build of the daemon (and, with
    // DAX_VMM_BIN, of the VMM) under the same benchmark.
    let daemon = match (std::env::var_os(DAEMON_BIN_ENV), floor) {
        (Some(_), true) => fail(format!(
            "{DAEMON_BIN_ENV} and `floor` both choose the daemon: give one"
        )),
        (Some(path), false) => std::path::PathBuf::from(path),
        (None, true) => rig::static_binary_with("daemon", "dax-virtiofsd", &[FLOOR_FEATURE])
            .unwrap_or_else(|e| fail(e.to_string())),
        (None, false) => tool("daemon", "dax-virtiofsd"),
    };
    guest.host_tools = vec![daemon, tool("guest-tools", "daxprobe")];
    guest.host_before = HOST_BEFORE
        .replace(
            "FLOOR_ARGS",
            if floor { "--bench-unacked-maps " } else { "" },
        )
        .replace("FILE_MIB", &FILE_MIB.to_string())
        .replace("WINDOW", WINDOW)
        + &cpu::host_script();
    guest.host_after = "wait\n".into();
    guest.vmm_args = vec![
        "--api-socket".into(),
        "/tmp/api.sock".into(),
        "--fs".into(),
        format!("tag=daxshare,socket=/tmp/dax.sock,cache_size={WINDOW},transport=pci,id=fs0"),
        "--fs".into(),
        "tag=fuseshare,socket=/tmp/fuse.sock,dax=off,transport=pci,id=fs1".into(),
        "--fs".into(),
        format!("tag=daxnopf,socket=/tmp/daxnopf.sock,cache_size={WINDOW},dax_prefault=off,transport=pci,id=fs2"),
        "--fs".into(),
        format!("tag=daxhuge,socket=/tmp/daxhuge.sock,cache_size={WINDOW},transport=pci,id=fs3"),
    ];
    guest.timeout = std::time::Duration::from_secs(1200);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let (results, tables, failed) = report(&run, floor);
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// A latency histogram: cumulative counts per upper bound in µs (None:
/// +Inf), as the daemon's stats and the VMM's metrics give it.
type Histogram = Vec<(Option<u64>, u64)>;

/// A histogram as cumulative (upper bound µs or None for +Inf, count):
/// the bucket holding the `q` quantile, as "≤ N µs" or "> N µs".
fn quantile_bucket(buckets: &[(Option<u64>, u64)], q: f64) -> String {
    let Some(&(_, total)) = buckets.last() else {
        return "n/a".into();
    };
    if total == 0 {
        return "n/a (none)".into();
    }
    let want = u64::try_from(test_infra::results::nearest_rank(
        usize::try_from(total).unwrap_or(usize::MAX),
        q,
    ))
    .unwrap_or(u64::MAX);
    let mut below = 0;
    for &(le, count) in buckets {
        if count >= want {
            return match le {
                Some(le) => format!("{below}-{le} µs"),
                None => format!("> {below} µs"),
            };
        }
        if let Some(le) = le {
            below = le;
        }
    }
    "n/a".into()
}

/// The VMM's `daxvmm_dax_map_latency_seconds` for `device` from its
/// Prometheus text (newlines turned to spaces by `daxprobe http`): the
/// cumulative buckets in µs, and the sum in µs.
fn vmm_histogram(text: &str, device: &str) -> (Histogram, f64) {
    let mut buckets = Vec::new();
    let mut sum_us = 0.0;
    for s in samples(text).filter(|s| label(s.labels, "device") == Some(device)) {
        if s.family == "daxvmm_dax_map_latency_seconds_bucket" {
            // "+Inf" parses as a float too: keep it the open last bucket.
            let bound = label(s.labels, "le")
                .unwrap_or("")
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite())
                .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
                .and_then(|d| u64::try_from(d.as_nanos().div_ceil(1000)).ok());
            if let Ok(count) = s.value.parse() {
                buckets.push((bound, count));
            }
        } else if s.family == "daxvmm_dax_map_latency_seconds_sum" {
            sum_us = s.value.parse::<f64>().unwrap_or(0.0) * 1e6;
        }
    }
    (buckets, sum_us)
}

/// The VMM's per-stage map trace for `device` from its Prometheus text:
/// (stage, count, sum µs) from `daxvmm_dax_map_stages_total` and
/// `daxvmm_dax_map_stage_seconds_total` (in seconds there), in the order the
/// text has them.
fn vmm_stages(text: &str, device: &str) -> Vec<StageTotal> {
    let mut stages: Vec<StageTotal> = Vec::new();
    for s in samples(text) {
        let is_sum = match s.family {
            "daxvmm_dax_map_stage_seconds_total" => true,
            "daxvmm_dax_map_stages_total" => false,
            _ => continue,
        };
        let (Some(stage), Ok(v)) = (label(s.labels, "stage"), s.value.parse::<f64>()) else {
            continue;
        };
        if label(s.labels, "device") != Some(device) {
            continue;
        }
        let i = match stages.iter().position(|t| t.stage == stage) {
            Some(i) => i,
            None => {
                stages.push(StageTotal {
                    stage: stage.to_string(),
                    ..Default::default()
                });
                stages.len() - 1
            }
        };
        if is_sum {
            stages[i].sum_us = whole(v * 1e6);
        } else {
            stages[i].count = whole(v);
        }
    }
    stages
}

/// A non-negative sample value rounded to a whole number.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "rounded and clamped at 0 first; the counters are far below 2^53"
)]
fn whole(v: f64) -> u64 {
    v.max(0.0).round() as u64
}

/// The mean µs of `stage` in `stages`, if any map reached it.
fn stage_mean(stages: &[StageTotal], stage: &str) -> Option<f64> {
    stages
        .iter()
        .find(|s| s.stage == stage && s.count > 0)
        .map(|s| s.sum_us as f64 / s.count as f64)
}

/// The trace of one DAX mount's SETUPMAPPINGs as table rows: every stage's
/// count and mean, then what is left to the guest side (its cold touch's
/// mean less the daemon's whole handling) and to the channel between the
/// daemon and the VMM (the daemon's SHMEM_MAP wait less the VMM's whole
/// request).
fn trace_rows(
    variant: &str,
    cold_touch_mean: Option<f64>,
    daemon: &[StageTotal],
    vmm: &[StageTotal],
) -> String {
    let mut rows = String::new();
    let fmt = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.1}"));
    for (side, stages) in [("daemon", daemon), ("VMM", vmm)] {
        for s in stages {
            let mean = (s.count > 0).then(|| s.sum_us as f64 / s.count as f64);
            let _ = writeln!(
                rows,
                "| {variant} | {side}: {} | {} | {} |",
                s.stage,
                s.count,
                fmt(mean)
            );
        }
    }
    let served = stage_mean(daemon, "served");
    let guest_side = cold_touch_mean.zip(served).map(|(c, d)| c - d);
    let channel = stage_mean(daemon, "shmem_map")
        .zip(stage_mean(vmm, "request"))
        .map(|(d, v)| d - v);
    let _ = writeln!(
        rows,
        "| {variant} | guest side: cold touch less the daemon's whole handling | - | {} |",
        fmt(guest_side)
    );
    let _ = writeln!(
        rows,
        "| {variant} | channel: the daemon's SHMEM_MAP wait less the VMM's whole request | - | {} |",
        fmt(channel)
    );
    rows
}

/// The DAX mounts measured: guest marker, VMM device id, row label.
const VARIANTS: [(&str, &str, &str); 3] = [
    ("rt", "fs0", "pre-fault on (default)"),
    ("rtnopf", "fs2", "dax_prefault=off"),
    ("rthuge", "fs3", "host tmpfs, 2 MiB pages, pre-fault on"),
];

fn report(run: &Run, floor: bool) -> (Results, String, bool) {
    let mut results = Results::new(if floor {
        "roundtrip-floor-bench"
    } else {
        "roundtrip-bench"
    });
    results.record_run("roundtrip run", run);
    results.record(
        "the daemon waits for the VMM's ack before answering the guest",
        if floor {
            format!(
                "no: the floor, a measurement build ({FLOOR_FEATURE}); the guest may read zeros"
            )
        } else {
            "yes".into()
        },
    );
    let statx = run.guest("statx").unwrap_or("-").to_string();
    results.record(
        "statx (DAX file, without pre-fault, on 2 MiB pages, FUSE file)",
        statx,
    );
    let mut failed = run.vmm_exit != Some(0);
    let mut tables = format!(
        "In the guest (1 vCPU, guest clock), {PASSES} passes over a {FILE_MIB} MiB file per DAX mount \
         ({WINDOW} window, dax=always), the FUSE reads interleaved pass by pass, µs per operation:\n\n\
         | DAX mount | operation | n | median | p90 | mean |\n|---|---|---|---|---|---|\n"
    );
    let mut ratio_rows = String::new();
    let mut cold_means: Vec<Option<f64>> = Vec::new();
    for (marker, _, variant) in VARIANTS {
        let rt = run.guest(marker).unwrap_or("");
        let value = |key: &str| -> Option<f64> {
            rt.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{key}=")))?
                .parse()
                .ok()
        };
        failed |=
            value("setupmapping_median_us").is_none() || value("fuse_read_median_us").is_none();
        cold_means.push(value("setupmapping_mean_us"));
        for (key, label) in [
            (
                "setupmapping",
                "cold first touch of a 2 MiB DAX range (SETUPMAPPING + fault)",
            ),
            (
                "other_page",
                "first touch of another page of a range just mapped (no round trip)",
            ),
            (
                "warm_touch",
                "touch of a range mapped before, mapped again (the guest's fault alone)",
            ),
            (
                "fuse_read",
                "4 KiB O_DIRECT pread without DAX (one FUSE READ)",
            ),
        ] {
            let v =
                |s: &str| value(&format!("{key}_{s}")).map_or("n/a".into(), |v| format!("{v:.1}"));
            let n = value(&format!("{key}_n")).map_or("n/a".into(), |v| format!("{v:.0}"));
            let _ = writeln!(
                tables,
                "| {variant} | {label} | {n} | {} | {} | {} |",
                v("median_us"),
                v("p90_us"),
                v("mean_us")
            );
            results.record(
                &format!("{variant}: {label}: n / median / p90 / mean, µs"),
                format!(
                    "{n} / {} / {} / {}",
                    v("median_us"),
                    v("p90_us"),
                    v("mean_us")
                ),
            );
        }
        let ratio = |q: &str| match (
            value(&format!("setupmapping_{q}_us")),
            value(&format!("fuse_read_{q}_us")),
        ) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "n/a".into(),
        };
        // The SETUPMAPPING alone: the cold touch less what a touch of a
        // page of a mapped range costs without one (means: medians do not
        // subtract).
        let alone = match (
            value("setupmapping_mean_us"),
            value("other_page_mean_us"),
            value("fuse_read_mean_us"),
        ) {
            (Some(c), Some(o), Some(r)) if r > 0.0 => format!("{:.2}x", (c - o) / r),
            _ => "n/a".into(),
        };
        let _ = writeln!(
            ratio_rows,
            "| {variant} | {} | {} | {alone} |",
            ratio("median"),
            ratio("p90")
        );
        results.record(
            &format!("{variant}: (cold touch less other-page touch) / FUSE READ, means"),
            alone,
        );
        results.record(
            &format!("{variant}: SETUPMAPPING first touch / 4 KiB FUSE READ, median and p90 (target 2x or less, 1.5x the goal)"),
            format!("{} / {}", ratio("median"), ratio("p90")),
        );
    }
    let _ = write!(
        tables,
        "\nSETUPMAPPING first touch / 4 KiB FUSE READ (target 2x or less, 1.5x the goal):\n\n\
         | DAX mount | medians | p90s | means, the cold touch less the other-page touch |\n|---|---|---|---|\n{ratio_rows}"
    );
    tables.push_str("\nWhere a SETUPMAPPING's time goes, host clock (the histograms' buckets holding the median and p90, and the mean):\n\n| DAX mount | stage | count | median in | p90 in | mean |\n|---|---|---|---|---|---|\n");
    let vmm_text = run.host("vmm_metrics").unwrap_or("");
    let mut trace = String::new();
    for ((_, device, variant), cold_mean) in VARIANTS.into_iter().zip(cold_means) {
        let daemon: Option<DaemonStats> = run
            .host(&format!("daemon_stats_{device}"))
            .and_then(|s| serde_json::from_str(s).ok());
        let mut stages: Vec<(&str, Histogram, f64)> = Vec::new();
        match &daemon {
            Some(d) => {
                stages.push((
                    "daemon: SHMEM_MAP sent to ack received",
                    d.map_latency_buckets.clone(),
                    d.map_latency_sum_us as f64,
                ));
                results.record(
                    &format!("{variant}: daemon SETUPMAPPINGs / REMOVEMAPPINGs"),
                    format!("{} / {}", d.setupmappings, d.removemappings),
                );
            }
            None => {
                failed = true;
                stages.push(("daemon: stats missing", Vec::new(), 0.0));
            }
        }
        let vmm_trace = vmm_stages(vmm_text, device);
        let daemon_trace = daemon.as_ref().map_or(&[][..], |d| &d.map_stages[..]);
        trace.push_str(&trace_rows(variant, cold_mean, daemon_trace, &vmm_trace));
        for s in daemon_trace
            .iter()
            .map(|s| ("daemon", s))
            .chain(vmm_trace.iter().map(|s| ("VMM", s)))
        {
            results.record(
                &format!("{variant}: trace: {}: {}: count / sum µs", s.0, s.1.stage),
                format!("{} / {}", s.1.count, s.1.sum_us),
            );
        }
        let (vmm_buckets, vmm_sum_us) = vmm_histogram(vmm_text, device);
        failed |= vmm_buckets.is_empty();
        stages.push((
            "VMM: SHMEM_MAP served (checks, mmap)",
            vmm_buckets,
            vmm_sum_us,
        ));
        for (label, buckets, sum_us) in &stages {
            let count = buckets.last().map_or(0, |b| b.1);
            let mean = if count > 0 {
                format!("{:.1} µs", sum_us / count as f64)
            } else {
                "n/a".into()
            };
            let (p50, p90) = (quantile_bucket(buckets, 0.5), quantile_bucket(buckets, 0.9));
            let _ = writeln!(
                tables,
                "| {variant} | {label} | {count} | {p50} | {p90} | {mean} |"
            );
            results.record(
                &format!("{variant}: {label}: count / median bucket / p90 bucket / mean"),
                format!("{count} / {p50} / {p90} / {mean}"),
            );
        }
    }
    let _ = write!(
        tables,
        "\nThe trace, host clock, mean µs per SETUPMAPPING that reached each stage (the daemon's \
         stages: `open` the checks and the file's open, `shmem_map` SHMEM_MAP sent to ack, `record` \
         after the ack, `served` popped from the queue to the reply on the used ring; the VMM's: \
         `request` the whole backend request on the device worker, read to ack, and its parts, \
         `prefault_after_ack` per turn of the worker at queued pre-faults):\n\n\
         | DAX mount | stage | n | mean µs |\n|---|---|---|---|\n{trace}"
    );
    // Said only of the emulated host: a run on this machine's own KVM
    // shares however many CPUs it has.
    let cpus = match run.host_cpus {
        Some(1) => " The emulated host has 1 CPU, so the guest waits for all of it.".to_string(),
        Some(n) => format!(" The emulated host has {n} CPUs."),
        None => String::new(),
    };
    match cpu::table(run, RANGES) {
        Some(t) => {
            let _ = write!(
                tables,
                "\nEach thread's CPU time per operation, µs, host clock (`schedstat`), in {} \
                 rounds of one pass of each kind alone ({RANGES} operations), less an empty \
                 pass's in the same round; mean of the rounds (their range).{cpus}\n\n{t}",
                cpu::ROUNDS,
            );
        }
        None => {
            failed = true;
            tables.push_str("\nEach thread's CPU time per operation: marks missing.\n");
        }
    }
    match guest_trace::table(run) {
        Some(t) => {
            let _ = write!(
                tables,
                "\nInside the guest: its kernel's function-graph trace of one more pass per mount \
                 (after all the above; the tracer adds a few µs per traced call), guest clock, \
                 mean µs per call, entry to return:\n\n{t}"
            );
        }
        None => {
            failed = true;
            tables.push_str("\nInside the guest: the trace's lines are missing.\n");
        }
    }
    tables.push_str(
        "\n(Guest-side: the cold touch includes the FUSE request through the queue, the daemon's \
         work and its SHMEM_MAP round trip, the reply, and the guest's fault; the other-page touch is \
         a fault in a range already mapped, a nested one too unless the page was pre-faulted; \
         the warm touch is the guest's fault alone.)\n",
    );
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_is_the_only_argument() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(floor_arg(&args(&[])), Ok(false));
        assert_eq!(floor_arg(&args(&["floor"])), Ok(true));
        let e = floor_arg(&args(&["flor"])).unwrap_err();
        assert!(e.contains("\"flor\"") && e.contains("`floor`"), "{e}");
        assert!(floor_arg(&args(&["floor", "floor"])).is_err());
    }

    #[test]
    fn quantiles_land_in_their_bucket() {
        let h = vec![
            (Some(100), 0),
            (Some(250), 60),
            (Some(1000), 95),
            (None, 100),
        ];
        assert_eq!(quantile_bucket(&h, 0.5), "100-250 µs");
        assert_eq!(quantile_bucket(&h, 0.9), "250-1000 µs");
        assert_eq!(quantile_bucket(&h, 0.99), "> 1000 µs");
        assert_eq!(quantile_bucket(&[(None, 0)], 0.5), "n/a (none)");
        assert_eq!(quantile_bucket(&[], 0.5), "n/a");
    }

    #[test]
    fn the_vmm_histogram_is_read_for_one_device() {
        let text = "# TYPE daxvmm_dax_map_latency_seconds histogram \
            daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"0.00001\"} 1 \
            daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"+Inf\"} 3 \
            daxvmm_dax_map_latency_seconds_sum{device=\"fs0\"} 0.00015 \
            daxvmm_dax_map_latency_seconds_bucket{device=\"fs2\",le=\"+Inf\"} 9 \
            daxvmm_dax_map_latency_seconds_sum{device=\"fs2\"} 1";
        let (buckets, sum_us) = vmm_histogram(text, "fs0");
        assert_eq!(buckets, vec![(Some(10), 1), (None, 3)]);
        assert!((sum_us - 150.0).abs() < 1e-6);
        assert_eq!(vmm_histogram(text, "fs2").0, vec![(None, 9)]);
        assert!(vmm_histogram(text, "fs1").0.is_empty());
    }

    #[test]
    fn the_vmm_trace_is_read_for_one_device_and_the_remainders_follow() {
        let text = "daxvmm_dax_map_stage_seconds_total{device=\"fs0\",stage=\"request\"} 0.0006 \
            daxvmm_dax_map_stage_seconds_total{device=\"fs0\",stage=\"mmap\"} 0.00009 \
            daxvmm_dax_map_stage_seconds_total{device=\"fs2\",stage=\"mmap\"} 0.000007 \
            daxvmm_dax_map_stages_total{device=\"fs0\",stage=\"request\"} 3 \
            daxvmm_dax_map_stages_total{device=\"fs0\",stage=\"mmap\"} 3";
        let stage = |stage: &str, count, sum_us| StageTotal {
            stage: stage.into(),
            count,
            sum_us,
        };
        let vmm = vmm_stages(text, "fs0");
        assert_eq!(vmm, [stage("request", 3, 600), stage("mmap", 3, 90)]);
        assert_eq!(vmm_stages(text, "fs2"), [stage("mmap", 0, 7)]);
        assert_eq!(stage_mean(&vmm, "request"), Some(200.0));
        assert_eq!(stage_mean(&vmm_stages(text, "fs2"), "mmap"), None);
        let daemon = [stage("shmem_map", 2, 1000), stage("served", 2, 1400)];
        let rows = trace_rows("v", Some(1000.0), &daemon, &vmm);
        assert!(
            rows.contains("| v | daemon: served | 2 | 700.0 |"),
            "{rows}"
        );
        assert!(rows.contains("| v | VMM: mmap | 3 | 30.0 |"), "{rows}");
        assert!(rows.contains("handling | - | 300.0 |"), "{rows}");
        assert!(rows.contains("request | - | 300.0 |"), "{rows}");
        assert!(trace_rows("v", None, &[], &[]).contains("handling | - | n/a |"));
    }
}
