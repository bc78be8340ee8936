//! Snapshot, restore and local migration of a 1 GiB guest, ours beside
//! Cloud Hypervisor's local migration, in one rig run (a benchmark, not a
//! test): `scripts/bench.sh snapshot`, with
//! `BASELINE_VMM=/path/to/cloud-hypervisor` (static) for the comparison.
//!
//! One emulated host boots the same guest (kernel, initramfs, 1 vCPU,
//! 1 GiB of shared RAM, `--serial tty --console off`) several times, in
//! the order ours, CH, ours with DAX, CH, ours — or without a baseline
//! ours, ours with DAX, ours — so drift over the emulated host's life
//! shows rather than passing for a difference between the VMMs:
//! - ours and CH without a share: a controlled pause (`vm.pause`, 2 s,
//!   `vm.resume`), which validates the downtime probe, then one local
//!   migration to a new VMM process (`vm.receive-migration` on it,
//!   `vm.send-migration` `local: true` on the old one);
//! - ours with a DAX share (`dax-virtiofsd`, a fresh daemon for every new
//!   VMM, as an operator scripts it with virtiofsd): two snapshot/restore
//!   cycles with the window idle (the share mounted `dax=always`, nothing
//!   mapped), two with it busy (`daxprobe mmap-busy` keeps every 2 MiB
//!   range of a file mapped and written), then two local migrations with
//!   it busy. A cycle: `vm.pause`, `vm.snapshot` (timed; the memory file's
//!   apparent and allocated size), the VMM killed, a new daemon and VMM,
//!   `vm.restore` (timed, to Paused), `vm.resume` and the time until the
//!   guest runs again.
//!
//! The downtime probe is the same for both VMMs: the guest's
//! `daxprobe ram-counter` advances a u64 in a locked page of its RAM about
//! every millisecond; the host reads it in the VMM's RAM memfd (the one of
//! the guest's size; guest RAM below 3 GiB starts at its offset 0 in both
//! VMMs) with `daxprobe counter-gap`, which reports each time it stood
//! still. A migration's downtime is the longest of those stops between
//! `vm.send-migration` sent and the old VMM's exit: the emulated host as a
//! whole sometimes stalls for hundreds of milliseconds, and such a stop
//! seconds after the move is not the migration's (the longest stop of the
//! whole run is reported beside it). A local migration passes that memfd
//! to the new VMM, so the host's open file follows the guest. Our VMMs log
//! where the time they were paused went, step by step; the results quote
//! it. The guest's own clocks (`CLOCK_MONOTONIC`, `CLOCK_REALTIME`) are
//! watched beside it and reported, since both VMMs may set the guest's
//! clock back to where it paused; the controlled pause shows which of them
//! sees a stop.
//! Writes `target/rig-results/snapshot-bench.md`.
//!
//! `bench-snapshot tcp` measures live migration over TCP instead
//! (bench_snapshot/tcp.rs).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use test_infra::baseline::{baseline_binary, version};
use test_infra::results::{marker_fields, Results};
use test_infra::rig::{self, Guest, ImageFile, Run};
use test_infra::shell::{COUNTER_HELPERS, DAEMON_SWAP_HELPERS, SHELL_HELPERS};

#[path = "bench_snapshot/tcp.rs"]
mod tcp;

/// The Cloud Hypervisor binary to compare with (unset: ours alone).
const BASELINE_ENV: &str = "BASELINE_VMM";
const GUEST_MIB: u64 = 1024;
/// The DAX window, and the busy file that keeps all of it mapped.
const WINDOW_MIB: u64 = 128;
const BUSY_MIB: u64 = 64;
/// How long the host watches the heartbeat around one migration or pause.
const GAP_SECS: u32 = 12;
/// Snapshot/restore cycles per window state, and migrations of the DAX guest.
const REPEATS: usize = 2;
/// Comma-separated boot labels to run alone (e.g. `ours1,dax`), to try a
/// part of the benchmark; unset: all of them.
const ONLY_ENV: &str = "SNAPSHOT_BENCH_BOOTS";

const GUEST_SCRIPT: &str = r#"
mode=$(sed -n 's/.*bench_mode=\([a-z]*\).*/\1/p' /proc/cmdline)
daxprobe ram-counter 7200 &
if [ "$mode" = dax ]; then
    mkdir -p /mnt
    i=0; until mount -t virtiofs share /mnt -o dax=always 2>/dev/null || [ $i -ge 300 ]; do sleep 0.1; i=$((i+1)); done
    echo "@@GUEST statx=$(daxprobe statx /mnt/busy.bin)"
fi
sleep 1
echo "@@GUEST ready=1"
if [ "$mode" = dax ]; then
    i=0; until [ -e /mnt/busy-go ] || [ $i -ge 36000 ]; do sleep 0.1; i=$((i+1)); done
    daxprobe mmap-busy /mnt/busy.bin 7200 &
fi
while :; do sleep 60; done
"#;

/// The emulated host's part: shell functions, then the boots. `boot LABEL
/// BIN MODE` starts a VMM (and for `dax` a daemon) and waits for the
/// guest; `pause_check`, `migrate NAME` and `snapcycle NAME` measure on
/// the running VM and print `@@HOST NAME k=v ...`; `finish` shuts it down.
const HOST_SCRIPT: &str = r#"
mkdir -p share
dd if=/dev/zero of=share/busy.bin bs=1M count=BUSY_MIB 2>/dev/null
# The VMM's RAM memfd: the one of the guest's size.
memfd() { for f in /proc/$1/fd/*; do case "$(readlink $f)" in *memfd:*) [ "$(stat -L -c %s $f)" = GUEST_BYTES ] && { echo $f; return; };; esac; done; }
seen_in() { i=0; while ! grep -q "$1" $2 2>/dev/null && [ $i -lt 3000 ] && alive $3; do sleep 0.1; i=$((i+1)); done; }
# The largest gap of each guest clock in FILE after line N.
clockgaps() { tail -n +$(( $2 + 1 )) $1 | tr -d '\r' | grep -a -o 'clockgap mono_ms=[0-9]* real_ms=[0-9]*' | tr '=' ' ' | awk '$3 > m { m = $3 } $5 > r { r = $5 } END { printf "guest_mono_ms=%d guest_real_ms=%d", m, r }'; }
daemon() { rm -f /tmp/fs.sock; dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size WINDOW_MIBM --log-level warn & DAEMON=$!; wait_sock /tmp/fs.sock; }
N=0
boot() {
    LABEL=$1; BIN=$2; MODE=$3; SER=$WORK/$1.serial; : > $SER
    FS=""
    if [ $MODE = dax ]; then
        daemon
        FS="--fs tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=WINDOW_MIBM,id=fs0"
    fi
    N=$((N+1)); SOCK=/tmp/vmm$N.sock
    # Cloud Hypervisor's own seccomp filter kills its migration thread on
    # this host (the source exits 159, SIGSYS): its VMMs run without it.
    case $LABEL in ch*) NOFILTER="--seccomp false" ;; *) NOFILTER="" ;; esac
    # Our VMMs log where a migration's downtime went (the rest at warn).
    export RUST_LOG=warn,vmm::migration=info,vmm::snapshot=info
    "$BIN" $NOFILTER --api-socket $SOCK --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "BASE_CMDLINE bench_mode=$MODE" \
        --cpus boot=1 --memory size=GUEST_MIBM,shared=on --serial tty --console off $FS </dev/null >>$SER 2>>$LABEL.err &
    PID=$!
    seen_in '@@GUEST ready' $SER $PID
    GPA=$(grep -a -o 'ram_counter_gpa=[0-9]*' $SER | head -1 | cut -d= -f2)
    echo "@@HOST ${LABEL}_booted gpa=$GPA memfd=$(memfd $PID) $(grep -a -o 'statx=.*' $SER | head -1)"
}
pause_check() {
    # The probe's resolution: the longest stop while nothing happens.
    QUIET=$(daxprobe counter-gap $(memfd $PID) 3 $GPA | cut -d' ' -f1)
    n=$(wc -l < $SER)
    daxprobe counter-gap $(memfd $PID) GAP_SECS $GPA > gap.out 2>&1 &
    G=$!; sleep 2
    T0=$(ms); P=$(api $SOCK PUT /api/v1/vm.pause); sleep 2; T1=$(ms)
    # Paused at least the 2 s between vm.pause answered and vm.resume sent,
    # at most from vm.pause sent to vm.resume answered.
    R=$(api $SOCK PUT /api/v1/vm.resume); T2=$(ms)
    wait $G; sleep 1
    echo "@@HOST ${LABEL}_pause pause=${P%% *} resume=${R%% *} pause_to_resume_sent_ms=$((T1 - T0)) paused_max_ms=$((T2 - T0)) quiet_$QUIET $(cat gap.out) $(clockgaps $SER $n)"
}
migrate() {
    n=$(wc -l < $SER)
    N=$((N+1)); DST=/tmp/vmm$N.sock; MIG=/tmp/mig$N.sock
    "$BIN" $NOFILTER --api-socket $DST </dev/null >>$SER 2>>$LABEL.err &
    NEW=$!
    wait_sock $DST
    api $DST PUT /api/v1/vm.receive-migration '{"receiver_url":"unix:'$MIG'"}' > receive.out 2>&1 &
    RECV=$!
    wait_sock $MIG
    if [ $MODE = dax ]; then
        # As with virtiofsd: the old daemon's socket goes; once it has
        # handed over its state and exited, a fresh one serves the share.
        swap_daemon $DAEMON daemon WINDOW_MIBM
    fi
    daxprobe counter-gap $(memfd $PID) GAP_SECS $GPA > gap.out 2>&1 &
    G=$!; sleep 1
    T0=$(ms)
    S=$(api $SOCK PUT /api/v1/vm.send-migration '{"destination_url":"unix:'$MIG'","local":true}')
    T1=$(ms)
    echo "@@HOST $1_sent=${S%% *} send_ms=$((T1 - T0))"
    # Bounded: a receiver whose sender failed would listen for good.
    i=0; while alive $RECV && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    alive $RECV && kill $RECV; wait $RECV; R=$(cat receive.out)
    ended $PID; SRC_EXIT=$EXIT; SRC_GONE=$(ms)
    case "$S" in status=2*) ;; *) tail -5 $LABEL.err | sed "s/^/@@HOST $1_err=/";; esac
    wait $G; sleep 1
    MAPPED=""
    if [ $MODE = dax ]; then
        i=0; while [ ! -s daemon.pid ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
        DAEMON=$(cat daemon.pid); MAPPED="mapped=$(metric $DST mapped_ranges)"
    fi
    # Where our VMMs say the downtime went (both log to the same file).
    echo "@@HOST $1_steps $(grep -a -o 'paused here .*\|State of .*\|restored [0-9]* vCPU.*\|migration received: .*' $LABEL.err | tail -n 4 | tr '\n' ';')"
    echo "@@HOST $1 send=${S%% *} receive=${R%% *} src_exit=$SRC_EXIT send_ms=$((T1 - T0)) send_started_ms=$T0 src_gone_ms=$SRC_GONE $(cat gap.out) $(clockgaps $SER $n) $MAPPED"
    PID=$NEW; SOCK=$DST
}
snapcycle() {
    n=$(wc -l < $SER)
    rm -rf snap; mkdir snap
    MAPPED=$(metric $SOCK mapped_ranges)
    P=$(api $SOCK PUT /api/v1/vm.pause)
    T0=$(ms); S=$(api $SOCK PUT /api/v1/vm.snapshot '{"destination_url":"file://'$WORK'/snap"}'); T1=$(ms)
    SIZE="mem_bytes=$(stat -c %s snap/memory-ranges) mem_kib=$(du -k snap/memory-ranges | cut -f1) dir_bytes=$(stat -c %s snap/* | awk '{ s += $1 } END { print s }') dir_kib=$(du -sk snap | cut -f1)"
    kill -9 $PID; wait $PID
    ended $DAEMON; D_EXIT=$EXIT
    daemon
    N=$((N+1)); SOCK=/tmp/vmm$N.sock
    "$VMM" --api-socket $SOCK </dev/null >>$SER 2>>$LABEL.err &
    PID=$!
    wait_sock $SOCK
    T2=$(ms); R=$(api $SOCK PUT /api/v1/vm.restore '{"source_url":"file://'$WORK'/snap"}'); T3=$(ms)
    STATE=$(api $SOCK GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"' | cut -d'"' -f4)
    REMAPPED=$(metric $SOCK mapped_ranges)
    daxprobe counter-moves $(memfd $PID) $GPA 60 > moved.out 2>&1 &
    MV=$!; sleep 1
    T4=$(ms); U=$(api $SOCK PUT /api/v1/vm.resume); T5=$(ms)
    wait $MV; MOVED=$(cut -d= -f2 moved.out)
    case "$MOVED" in ''|*[!0-9]*) RUNNING=none;; *) RUNNING=$((MOVED - T4));; esac
    echo "@@HOST $1 mapped=$MAPPED pause=${P%% *} snapshot=${S%% *} snapshot_ms=$((T1 - T0)) $SIZE daemon_exit=$D_EXIT restore=${R%% *} restore_ms=$((T3 - T2)) state=$STATE remapped=$REMAPPED resume=${U%% *} resume_ms=$((T5 - T4)) running_ms=$RUNNING $(clockgaps $SER $n)"
    rm -rf snap
}
start_busy() {
    touch share/busy-go
    seen_in 'busy_ready' $SER $PID
    sleep 2
    echo "@@HOST busy $(grep -a -o 'busy_ready ranges=[0-9]*' $SER | head -1) mapped=$(metric $SOCK mapped_ranges)"
}
finish() {
    echo "@@HOST ${LABEL}_shutdown=$(api $SOCK PUT /api/v1/vmm.shutdown)"
    ended $PID; echo "@@HOST ${LABEL}_exit=$EXIT"
    [ $MODE = dax ] && kill $DAEMON 2>/dev/null
    grep -a -i 'error\|panic' $LABEL.err | tail -3 | sed "s/^/@@HOST ${LABEL}_said=/"
    grep -a -i 'error\|panic\|busy_done' $SER | tail -3 | sed "s/^/@@HOST ${LABEL}_guest_said=/"
}
BOOTS
echo "@@HOST snapshot_done"
# The rig's own VMM run is not used: the boots above started their own.
exit 0
"#;

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("bench-snapshot: {e}");
    std::process::exit(1)
}

/// The boots: label, whose VMM, mode (`plain`: no share; `dax`).
fn boots(compare: bool) -> Vec<(&'static str, bool, &'static str)> {
    if compare {
        vec![
            ("ours1", false, "plain"),
            ("ch1", true, "plain"),
            ("dax", false, "dax"),
            ("ch2", true, "plain"),
            ("ours2", false, "plain"),
        ]
    } else {
        vec![
            ("ours1", false, "plain"),
            ("dax", false, "dax"),
            ("ours2", false, "plain"),
        ]
    }
}

/// The host script's lines for one boot.
fn boot_lines(label: &str, ch: bool, mode: &str) -> String {
    let bin = if ch {
        "$WORK/baseline/cloud-hypervisor"
    } else {
        "$VMM"
    };
    let mut s = format!("boot {label} \"{bin}\" {mode}\n");
    if mode == "dax" {
        for state in ["idle", "busy"] {
            if state == "busy" {
                s.push_str("start_busy\n");
            }
            for r in 1..=REPEATS {
                let _ = writeln!(s, "snapcycle snap_{state}_{r}");
            }
        }
        for r in 1..=REPEATS {
            let _ = writeln!(s, "migrate dax_mig_{r}");
        }
    } else {
        let _ = writeln!(s, "pause_check\nmigrate {label}_mig");
    }
    s.push_str("finish\n");
    s
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("tcp") {
        tcp::main();
        return;
    }
    let ch = baseline_binary(BASELINE_ENV).unwrap_or_else(|e| fail(e));
    let mut boots = boots(ch.is_some());
    if let Ok(only) = std::env::var(ONLY_ENV) {
        boots.retain(|b| only.split(',').any(|o| o == b.0));
    }
    let daxprobe = rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e));
    let daemon = rig::tool("daemon", "dax-virtiofsd").unwrap_or_else(|e| fail(e));
    let mut guest = Guest::new("bench-snapshot", GUEST_SCRIPT);
    let base_cmdline = guest.cmdline();
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![daxprobe, daemon];
    if let Some(ch) = &ch {
        guest.host_files.push(ImageFile {
            path: "baseline/cloud-hypervisor".into(),
            perm: 0o755,
            data: std::fs::read(ch).unwrap_or_else(|e| fail(format!("{}: {e}", ch.display()))),
        });
    }
    let lines: String = boots.iter().map(|&(l, c, m)| boot_lines(l, c, m)).collect();
    guest.host_before =
        format!("{SHELL_HELPERS}{COUNTER_HELPERS}{DAEMON_SWAP_HELPERS}{HOST_SCRIPT}")
            .replace("BOOTS", &lines)
            .replace("BASE_CMDLINE", &base_cmdline)
            .replace("GUEST_BYTES", &(GUEST_MIB << 20).to_string())
            .replace("GUEST_MIB", &GUEST_MIB.to_string())
            .replace("WINDOW_MIB", &WINDOW_MIB.to_string())
            .replace("BUSY_MIB", &BUSY_MIB.to_string())
            .replace("GAP_SECS", &GAP_SECS.to_string());
    guest.timeout = Duration::from_secs(2400);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let ch_version = ch.as_deref().map(version);
    let (results, tables, failed) = report(&run, &boots, ch_version);
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// One measured quantity over its runs: `mean (a / b …; spread max−min)`.
fn summary(values: &[f64], unit: &str) -> String {
    if values.is_empty() {
        return "n/a".into();
    }
    let n = values.len();
    let mean = values.iter().sum::<f64>() / n as f64;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let each: Vec<String> = values.iter().map(|v| format!("{v:.0}")).collect();
    format!(
        "{mean:.0} {unit} ({n} runs: {}; spread {:.0})",
        each.join(" / "),
        max - min
    )
}

/// The values of `key` in the markers `names`, each scaled by `scale`;
/// `None` when one is missing (a run failed).
fn values(run: &Run, names: &[String], key: &str, scale: f64) -> Option<Vec<f64>> {
    names
        .iter()
        .map(|n| {
            let v: f64 = marker_fields(run.host(n)?).get(key)?.parse().ok()?;
            Some(v * scale)
        })
        .collect()
}

/// A migration's downtime: the longest of the heartbeat's stops (`stops=`,
/// `start-end` in ms) that overlaps the migration, from `vm.send-migration`
/// sent (`send_started_ms`) to the old VMM's exit (`src_gone_ms`; Cloud
/// Hypervisor answers `vm.send-migration` before the guest is even
/// paused). A stop elsewhere in the probe's run (the emulated host
/// stalling as a whole) is not the migration's.
fn migration_stop(f: &HashMap<&str, &str>) -> Option<f64> {
    let from: u64 = f.get("send_started_ms")?.parse().ok()?;
    let to: u64 = f.get("src_gone_ms")?.parse().ok()?;
    let stops = f.get("stops").copied().unwrap_or("");
    let longest = stops
        .split(',')
        .filter_map(|s| {
            let (a, b) = s.split_once('-')?;
            Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?))
        })
        .filter(|&(start, end)| start <= to && end >= from)
        .map(|(start, end)| end - start)
        .max()
        .unwrap_or(0);
    Some(longest as f64)
}

/// Every marker in `names` carries all `expect`ed `k=v` pairs.
fn all_ok(run: &Run, names: &[String], expect: &[(&str, &str)]) -> bool {
    names.iter().all(|n| {
        run.host(n)
            .map(marker_fields)
            .is_some_and(|f| expect.iter().all(|(k, v)| f.get(k) == Some(v)))
    })
}

/// A table row and a results row: the runs' [`summary`] of `what`.
fn row(results: &mut Results, table: &mut String, what: &str, v: Option<Vec<f64>>, unit: &str) {
    let s = summary(&v.unwrap_or_default(), unit);
    results.record(what, s.clone());
    let _ = writeln!(table, "| {what} | {s} |");
}

fn report(
    run: &Run,
    boots: &[(&str, bool, &str)],
    ch_version: Option<String>,
) -> (Results, String, bool) {
    let mut results = Results::new("snapshot-bench");
    results.record_run("snapshot, restore and local migration", run);
    results.record(
        "baseline",
        ch_version.unwrap_or_else(|| format!("none: ours alone ({BASELINE_ENV} unset)")),
    );
    let mut failed = run.host("snapshot_done").is_none();
    let mut tables = String::new();

    // Snapshot and restore, per window state.
    tables.push_str("Snapshot and restore of the 1 GiB guest with a DAX share (ours)\n\n");
    tables.push_str("| measurement | value |\n|---|---|\n");
    let ok = [
        ("pause", "status=204"),
        ("snapshot", "status=204"),
        ("restore", "status=204"),
        ("state", "Paused"),
        ("resume", "status=204"),
        ("daemon_exit", "status=0"),
    ];
    for state in ["idle", "busy"] {
        let names: Vec<String> = (1..=REPEATS).map(|r| format!("snap_{state}_{r}")).collect();
        failed |= !all_ok(run, &names, &ok);
        let w = format!("{state} window");
        let mib = 1.0 / 1024.0;
        for (what, key, scale, unit) in [
            ("DAX ranges mapped at the snapshot", "mapped", 1.0, "ranges"),
            (
                "DAX ranges mapped again by the restore",
                "remapped",
                1.0,
                "ranges",
            ),
            ("vm.snapshot (paused VM)", "snapshot_ms", 1.0, "ms"),
            ("memory file, apparent size", "mem_bytes", mib * mib, "MiB"),
            ("memory file, allocated on disk", "mem_kib", mib, "MiB"),
            (
                "snapshot directory, allocated on disk",
                "dir_kib",
                mib,
                "MiB",
            ),
            ("vm.restore, to Paused", "restore_ms", 1.0, "ms"),
            ("vm.resume answered", "resume_ms", 1.0, "ms"),
            ("vm.resume to the guest running", "running_ms", 1.0, "ms"),
        ] {
            let v = values(run, &names, key, scale);
            failed |= v.is_none();
            row(&mut results, &mut tables, &format!("{w}: {what}"), v, unit);
        }
    }

    // Local migration: ours without DAX, ours with a busy DAX window, CH.
    tables.push_str("\nLocal migration of the same guest (downtime: the longest stop of the guest's RAM heartbeat, as the host saw it, between vm.send-migration sent and the old VMM's exit)\n\n");
    tables.push_str("| measurement | value |\n|---|---|\n");
    let mig_ok = [
        ("send", "status=204"),
        ("receive", "status=204"),
        ("src_exit", "status=0"),
    ];
    let plain = |ch: bool| -> Vec<String> {
        boots
            .iter()
            .filter(|b| b.2 == "plain" && b.1 == ch)
            .map(|b| format!("{}_mig", b.0))
            .collect()
    };
    let dax: Vec<String> = (1..=REPEATS).map(|r| format!("dax_mig_{r}")).collect();
    let mut cases = vec![
        ("ours, no DAX", plain(false)),
        ("ours, busy DAX window", dax),
    ];
    if boots.iter().any(|b| b.1) {
        cases.push(("Cloud Hypervisor, no share", plain(true)));
    }
    for (case, names) in &cases {
        // CH's source may exit by its own means; its status is shown, not required.
        let expect = if case.starts_with("Cloud") {
            &mig_ok[..2]
        } else {
            &mig_ok[..]
        };
        let migrated = all_ok(run, names, expect);
        failed |= !migrated;
        if !migrated {
            // A migration that failed has no downtime to report: its
            // heartbeat never stopped for a move.
            let what = format!("{case}: local migration");
            let s = "failed (see the raw rows)".to_string();
            results.record(&what, s.clone());
            let _ = writeln!(tables, "| {what} | {s} |");
            for n in names {
                results.record(&format!("{n} (raw)"), run.host(n).unwrap_or("n/a"));
            }
            continue;
        }
        let downtime = names
            .iter()
            .map(|n| migration_stop(&marker_fields(run.host(n)?)))
            .collect::<Option<Vec<f64>>>();
        failed |= downtime.is_none();
        row(
            &mut results,
            &mut tables,
            &format!("{case}: downtime (the heartbeat's longest stop during the migration)"),
            downtime,
            "ms",
        );
        for (what, key) in [
            (
                "the heartbeat's longest stop in the probe's whole run (any cause)",
                "max_gap_ms",
            ),
            ("vm.send-migration answered after", "send_ms"),
            (
                "largest gap of the guest's CLOCK_MONOTONIC",
                "guest_mono_ms",
            ),
            ("largest gap of the guest's CLOCK_REALTIME", "guest_real_ms"),
        ] {
            let v = values(run, names, key, 1.0);
            failed |= v.is_none();
            row(
                &mut results,
                &mut tables,
                &format!("{case}: {what}"),
                v,
                "ms",
            );
        }
        for n in names {
            results.record(&format!("{n} (raw)"), run.host(n).unwrap_or("n/a"));
            if let Some(steps) = run.host(&format!("{n}_steps")).filter(|s| !s.is_empty()) {
                results.record(&format!("{n}: where the VMMs say it went"), steps);
            }
        }
    }

    // The probe's check: a controlled 2 s pause of each no-share boot.
    tables.push_str("\nDowntime probe check: `vm.pause`, 2 s, `vm.resume` (host clock around the calls, the heartbeat's stop, the guest clocks' largest gaps)\n\n");
    tables.push_str("| boot | heartbeat's longest stop, 3 s undisturbed (ms) | vm.pause sent to vm.resume sent (ms) | paused at most: vm.pause sent to vm.resume answered (ms) | heartbeat stop (ms) | guest CLOCK_MONOTONIC gap (ms) | guest CLOCK_REALTIME gap (ms) |\n|---|---|---|---|---|---|---|\n");
    for (label, _, mode) in boots {
        if *mode != "plain" {
            continue;
        }
        let key = format!("{label}_pause");
        let f = run.host(&key).map(marker_fields).unwrap_or_default();
        let get = |k: &str| f.get(k).copied().unwrap_or("n/a");
        failed |= get("pause") != "status=204" || get("max_gap_ms") == "n/a";
        let _ = writeln!(
            tables,
            "| {label} | {} | {} | {} | {} | {} | {} |",
            get("quiet_max_gap_ms"),
            get("pause_to_resume_sent_ms"),
            get("paused_max_ms"),
            get("max_gap_ms"),
            get("guest_mono_ms"),
            get("guest_real_ms")
        );
        results.record(&format!("{key} (raw)"), run.host(&key).unwrap_or("n/a"));
    }
    for (label, _, _) in boots {
        failed |= run.host(&format!("{label}_exit")) != Some("status=0");
    }
    for key in ["busy", "dax_booted"] {
        results.record(key, run.host(key).unwrap_or("n/a"));
    }
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_downtime_is_the_longest_stop_overlapping_the_send() {
        let line = "send_started_ms=1000 src_gone_ms=1300 stops=100-900,950-1200,1250-1260,2000-2900 max_gap_ms=900";
        assert_eq!(migration_stop(&marker_fields(line)), Some(250.0));
        let none = "send_started_ms=1000 src_gone_ms=1300 stops= max_gap_ms=5";
        assert_eq!(migration_stop(&marker_fields(none)), Some(0.0));
        assert_eq!(migration_stop(&marker_fields("stops=1-2")), None);
    }

    #[test]
    fn a_summary_shows_each_run_and_the_spread() {
        assert_eq!(
            summary(&[1500.0, 1700.0], "ms"),
            "1600 ms (2 runs: 1500 / 1700; spread 200)"
        );
        assert_eq!(summary(&[], "ms"), "n/a");
    }

    #[test]
    fn the_dax_boot_measures_idle_before_busy_and_migrates_last() {
        let s = boot_lines("dax", false, "dax");
        let at = |w: &str| s.find(w).unwrap_or_else(|| panic!("{w} missing:\n{s}"));
        assert!(at("snapcycle snap_idle_2") < at("start_busy"));
        assert!(at("start_busy") < at("snapcycle snap_busy_1"));
        assert!(at("snapcycle snap_busy_2") < at("migrate dax_mig_1"));
        assert!(s.ends_with("finish\n"));
        assert!(boot_lines("ch1", true, "plain").contains("cloud-hypervisor"));
    }
}
