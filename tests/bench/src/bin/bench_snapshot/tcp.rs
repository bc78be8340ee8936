//! `bench-snapshot tcp` (`scripts/bench.sh snapshot tcp`): live migration
//! over TCP between two VMM processes in one emulated host, ours with a busy
//! DAX window beside Cloud Hypervisor with virtiofsd for the same guest
//! without DAX (`BASELINE_VMM=/path/to/cloud-hypervisor` and
//! `BASELINE_VIRTIOFSD=/path/to/virtiofsd`, both static), in one rig run.
//!
//! Every boot runs the same guest (1 vCPU, 512 MiB of shared RAM, the
//! share mounted, `daxprobe ram-counter` and `daxprobe mmap-busy` over a
//! 64 MiB file of the share: through the window with `dax=always` for ours,
//! through the guest's page cache for Cloud Hypervisor's), in the order
//! CH, ours, CH, ours (ours alone without the baselines). Each boot
//! migrates the VM twice, the second time the VM that arrived by the first
//! (as a fleet moves a guest on): a fresh daemon on the same share at the
//! socket path the VM's configuration names (the old one stays connected),
//! a new VMM with `vm.receive-migration {"receiver_url":"tcp:0.0.0.0:PORT"}`,
//! then `vm.send-migration {"destination_url":"tcp:127.0.0.1:PORT"}` on the
//! running one. Cloud Hypervisor runs with `--seccomp false`: its own filter
//! kills its migration thread on this host.
//!
//! - downtime: `daxprobe counter-handover` follows the guest's RAM
//!   heartbeat from the source VMM's RAM memfd to the destination's: from
//!   its last change in the source to the first reading in the destination
//!   past the source's last value;
//! - total: from `vm.send-migration` sent to `vm.receive-migration`
//!   answered (20 ms polls; Cloud Hypervisor answers `vm.send-migration`
//!   before the move is done), and when `vm.send-migration` answered.
//!
//! Writes `target/rig-results/migration-tcp-bench.md` (with
//! `SNAPSHOT_BENCH_BOOTS` naming only some boots, `-` and their labels are
//! added to the name).

use std::fmt::Write as _;
use std::time::Duration;

use test_infra::baseline::{
    host_files, version, vmm_and_virtiofsd, VIRTIOFSD_ENV as BASELINE_VIRTIOFSD_ENV,
    VMM_ENV as BASELINE_VMM_ENV,
};
use test_infra::results::{marker_fields, Results};
use test_infra::rig::{self, Guest, Run};
use test_infra::shell::SHELL_HELPERS;

use super::{fail, summary, ONLY_ENV};

const GUEST_MIB: u64 = 512;
const WINDOW_MIB: u64 = 128;
const BUSY_MIB: u64 = 64;
/// How long the handover probe watches one migration at most (it ends a
/// second after the guest ran on the destination; a failed migration
/// stops it).
const PROBE_SECS: u32 = 150;
/// Migrations per boot: the second one moves the VM that arrived.
const MOVES: usize = 2;

const GUEST_SCRIPT: &str = r#"
mode=$(sed -n 's/.*bench_mode=\([a-z]*\).*/\1/p' /proc/cmdline)
daxprobe ram-counter 7200 &
mkdir -p /mnt
opts=""; [ "$mode" = dax ] && opts="-o dax=always"
i=0; until mount -t virtiofs share /mnt $opts 2>/dev/null || [ $i -ge 300 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST statx=$(daxprobe statx /mnt/busy.bin)"
daxprobe mmap-busy /mnt/busy.bin 7200 &
sleep 1
echo "@@GUEST ready=1"
while :; do sleep 60; done
"#;

/// `boot LABEL BIN MODE` (mode `dax`: our daemon and a window; `fs`:
/// virtiofsd); `tcp_move NAME` migrates the running VM to a new VMM and
/// prints `@@HOST NAME k=v ...`; `finish` shuts the last one down.
const HOST_SCRIPT: &str = r#"
mkdir -p share
dd if=/dev/zero of=share/busy.bin bs=1M count=BUSY_MIB 2>/dev/null
ip link set lo up
seen_in() { i=0; while ! grep -q "$1" $2 2>/dev/null && [ $i -lt 3000 ] && alive $3; do sleep 0.1; i=$((i+1)); done; }
wait_port() { h=$(printf ':%04X ' $1); i=0; while ! grep -q "$h[0-9A-F:]* 0A " /proc/net/tcp && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; }
ms() { awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
vm_state() { api $1 GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"' | cut -d'"' -f4; }
daemon() {
    # virtiofsd keeps a locked pid file beside its socket: a second one on
    # the same path starts only once that file is gone.
    rm -f /tmp/fs.sock /tmp/fs.sock.pid
    if [ $MODE = dax ]; then
        dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size WINDOW_MIBM --log-level warn &
    else
        # virtiofsd's namespace sandbox cannot pivot_root from the initramfs.
        $WORK/baseline/virtiofsd --socket-path=/tmp/fs.sock --shared-dir=share --sandbox=chroot --log-level=warn &
    fi
    NEWD=$!; wait_sock /tmp/fs.sock
}
N=0
boot() {
    LABEL=$1; BIN=$2; MODE=$3; SER=$WORK/$1.serial; : > $SER
    daemon; DAEMON=$NEWD
    FS="tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024"
    [ $MODE = dax ] && FS="$FS,cache_size=WINDOW_MIBM"
    case $LABEL in ch*) NOFILTER="--seccomp false" ;; *) NOFILTER="" ;; esac
    export RUST_LOG=warn,vmm::migration=info
    N=$((N+1)); SOCK=/tmp/vmm$N.sock
    "$BIN" $NOFILTER --api-socket $SOCK --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "BASE_CMDLINE bench_mode=$MODE" \
        --cpus boot=1 --memory size=GUEST_MIBM,shared=on --serial tty --console off --fs $FS </dev/null >>$SER 2>>$LABEL.err &
    PID=$!
    seen_in 'busy_ready' $SER $PID
    GPA=$(grep -a -o 'ram_counter_gpa=[0-9]*' $SER | head -1 | cut -d= -f2)
    echo "@@HOST ${LABEL}_booted gpa=$GPA $(grep -a -o 'statx=.*' $SER | head -1) $(grep -a -o 'busy_ready ranges=[0-9]*' $SER | head -1)"
}
tcp_move() {
    daemon; NEW_DAEMON=$NEWD
    N=$((N+1)); DST=/tmp/vmm$N.sock; PORT=$((6000 + N))
    "$BIN" $NOFILTER --api-socket $DST </dev/null >>$SER 2>>$LABEL.err &
    NEW=$!
    wait_sock $DST
    api $DST PUT /api/v1/vm.receive-migration '{"receiver_url":"tcp:0.0.0.0:'$PORT'"}' > receive.out 2>&1 &
    RECV=$!
    wait_port $PORT
    daxprobe counter-handover $PID $NEW GUEST_BYTES $GPA PROBE_SECS > handover.out 2>&1 &
    G=$!; sleep 1
    T0=$(ms)
    S=$(api $SOCK PUT /api/v1/vm.send-migration '{"destination_url":"tcp:127.0.0.1:'$PORT'"}')
    T1=$(ms)
    # Bounded: a receiver whose sender failed would listen for good.
    i=0; while alive $RECV && [ $i -lt 6000 ]; do sleep 0.02; i=$((i+1)); done
    T2=$(ms)
    alive $RECV && kill $RECV; wait $RECV; R=$(cat receive.out)
    # Cloud Hypervisor's source may stay up without its VM; a source whose
    # migration failed runs on.
    case "$R" in status=2*)
        alive $PID && api $SOCK PUT /api/v1/vmm.shutdown >/dev/null 2>&1
        ended $PID; SRC_EXIT=$EXIT ;;
    *) SRC_EXIT="running:$(vm_state $SOCK)"; kill $G 2>/dev/null ;;
    esac
    wait $G
    case "$S" in status=2*) ;; *) echo "@@HOST $1_send_said=$S";; esac
    case "$R" in status=2*) ;; *) echo "@@HOST $1_receive_said=$R";; esac
    STATE=$(vm_state $DST)
    echo "@@HOST $1 send=${S%% *} receive=${R%% *} state=$STATE src_exit=$SRC_EXIT send_ms=$((T1 - T0)) total_ms=$((T2 - T0)) $(cat handover.out)"
    if [ "$STATE" = Running ]; then
        ended $DAEMON; echo "@@HOST $1_old_daemon=$EXIT"
        PID=$NEW; SOCK=$DST; DAEMON=$NEW_DAEMON
    else
        grep -a -i 'error\|panic' $LABEL.err | tail -3 | sed "s/^/@@HOST $1_err=/"
        kill -9 $NEW $NEW_DAEMON 2>/dev/null; wait $NEW $NEW_DAEMON
    fi
}
finish() {
    alive $PID && echo "@@HOST ${LABEL}_shutdown=$(api $SOCK PUT /api/v1/vmm.shutdown)"
    ended $PID; echo "@@HOST ${LABEL}_exit=$EXIT"
    kill $DAEMON 2>/dev/null; wait $DAEMON
}
BOOTS
echo "@@HOST tcp_done"
exit 0
"#;

/// The boots: label, whose VMM (true: Cloud Hypervisor), mode.
fn boots(compare: bool) -> Vec<(&'static str, bool, &'static str)> {
    if compare {
        vec![
            ("ch1", true, "fs"),
            ("ours1", false, "dax"),
            ("ch2", true, "fs"),
            ("ours2", false, "dax"),
        ]
    } else {
        vec![("ours1", false, "dax"), ("ours2", false, "dax")]
    }
}

fn boot_lines(label: &str, ch: bool, mode: &str) -> String {
    let bin = if ch {
        "$WORK/baseline/cloud-hypervisor"
    } else {
        "$VMM"
    };
    let mut s = format!("boot {label} \"{bin}\" {mode}\n");
    for m in 1..=MOVES {
        let _ = writeln!(s, "tcp_move {label}_move{m}");
    }
    s.push_str("finish\n");
    s
}

pub(super) fn main() {
    let baseline = vmm_and_virtiofsd().unwrap_or_else(|e| fail(e));
    let mut boots = boots(baseline.is_some());
    let only = std::env::var(ONLY_ENV).ok().filter(|o| !o.is_empty());
    if let Some(only) = &only {
        boots.retain(|b| only.split(',').any(|o| o == b.0));
    }
    let daxprobe = rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e));
    let daemon = rig::tool("daemon", "dax-virtiofsd").unwrap_or_else(|e| fail(e));
    let mut guest = Guest::new("bench-migration-tcp", GUEST_SCRIPT);
    let base_cmdline = guest.cmdline();
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![daxprobe, daemon];
    if let Some(pair) = &baseline {
        guest
            .host_files
            .extend(host_files(pair).unwrap_or_else(|e| fail(e)));
    }
    let lines: String = boots.iter().map(|&(l, c, m)| boot_lines(l, c, m)).collect();
    guest.host_before = format!("{SHELL_HELPERS}{HOST_SCRIPT}")
        .replace("BOOTS", &lines)
        .replace("BASE_CMDLINE", &base_cmdline)
        .replace("GUEST_BYTES", &(GUEST_MIB << 20).to_string())
        .replace("GUEST_MIB", &GUEST_MIB.to_string())
        .replace("WINDOW_MIB", &WINDOW_MIB.to_string())
        .replace("BUSY_MIB", &BUSY_MIB.to_string())
        .replace("PROBE_SECS", &PROBE_SECS.to_string());
    guest.timeout = Duration::from_secs(2400);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let versions = baseline
        .as_ref()
        .map(|(c, v)| format!("{}, {}", version(c), version(v)));
    let name = match &only {
        Some(o) => format!("migration-tcp-bench-{}", o.replace(',', "-")),
        None => "migration-tcp-bench".into(),
    };
    let (results, tables, failed) = report(&run, &boots, versions, &name);
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// One move's figures in ms (downtime, total, `vm.send-migration`'s
/// answer; the downtime `None` when the probe did not see the guest run on
/// the destination), or `None` when it failed (or never ran).
fn moved(line: &str) -> Option<(Option<f64>, f64, f64)> {
    let f = marker_fields(line);
    if f.get("receive") != Some(&"status=204") || f.get("state") != Some(&"Running") {
        return None;
    }
    let n = |k: &str| f.get(k)?.parse::<f64>().ok();
    Some((n("downtime_ms"), n("total_ms")?, n("send_ms")?))
}

fn report(
    run: &Run,
    boots: &[(&str, bool, &str)],
    versions: Option<String>,
    name: &str,
) -> (Results, String, bool) {
    let mut results = Results::new(name);
    results.record_run("live migration over TCP", run);
    results.record(
        "baseline",
        versions.unwrap_or_else(|| {
            format!("none: ours alone ({BASELINE_VMM_ENV} and {BASELINE_VIRTIOFSD_ENV} unset)")
        }),
    );
    results.record(
        "our binaries' cargo profile (scripts/bench.sh: release)",
        rig::build_profile(),
    );
    let mut failed = run.host("tcp_done").is_none();
    let mut tables = String::from(
        "Live migration over TCP of a 512 MiB guest with a busy share (downtime: the guest's RAM heartbeat, from its last change in the source VMM to the destination's first reading past it; total: vm.send-migration sent to vm.receive-migration answered)\n\n| case | move | result | downtime | total | vm.send-migration answered after |\n|---|---|---|---|---|---|\n",
    );
    let cases = [
        ("Cloud Hypervisor + virtiofsd, no DAX", true),
        ("ours, busy DAX window", false),
    ];
    for (case, ch) in cases {
        let labels: Vec<&str> = boots.iter().filter(|b| b.1 == ch).map(|b| b.0).collect();
        if labels.is_empty() {
            continue;
        }
        for m in 1..=MOVES {
            let which = if m == 1 {
                "first"
            } else {
                "second (the VM that arrived by the first)"
            };
            let names: Vec<String> = labels.iter().map(|l| format!("{l}_move{m}")).collect();
            let each: Vec<Option<(Option<f64>, f64, f64)>> =
                names.iter().map(|n| run.host(n).and_then(moved)).collect();
            for n in &names {
                results.record(&format!("{n} (raw)"), run.host(n).unwrap_or("n/a"));
                for said in ["send_said", "receive_said", "err"] {
                    if let Some(s) = run.host(&format!("{n}_{said}")) {
                        results.record(&format!("{n}: {said}"), s);
                    }
                }
            }
            let ok: Vec<(Option<f64>, f64, f64)> = each.iter().flatten().copied().collect();
            let downtimes: Vec<f64> = ok.iter().filter_map(|t| t.0).collect();
            // Ours must move and be measured; the baseline's failures are
            // results.
            failed |= !ch && (ok.len() != names.len() || downtimes.len() != ok.len());
            let mut result = format!("{} of {} migrated", ok.len(), names.len());
            if downtimes.len() != ok.len() {
                let _ = write!(
                    result,
                    " ({} without a downtime: the probe did not see the guest run)",
                    ok.len() - downtimes.len()
                );
            }
            let (d, t, s) = (
                summary(&downtimes, "ms"),
                summary(&ok.iter().map(|t| t.1).collect::<Vec<_>>(), "ms"),
                summary(&ok.iter().map(|t| t.2).collect::<Vec<_>>(), "ms"),
            );
            let _ = writeln!(tables, "| {case} | {which} | {result} | {d} | {t} | {s} |");
            results.record(&format!("{case}, {which} move: result"), result);
            results.record(&format!("{case}, {which} move: downtime"), d);
            results.record(&format!("{case}, {which} move: total"), t);
        }
    }
    for (label, _, _) in boots {
        results.record(
            &format!("{label} booted"),
            run.host(&format!("{label}_booted")).unwrap_or("n/a"),
        );
    }
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_counts_only_when_the_vm_runs_on_the_destination() {
        let ok = "send=status=204 receive=status=204 state=Running src_exit=status=0 send_ms=900 total_ms=2100 src_last_ms=5 src_max=9 dst_past_ms=305 downtime_ms=300";
        assert_eq!(moved(ok), Some((Some(300.0), 2100.0, 900.0)));
        let unseen = "send=status=204 receive=status=204 state=Running src_exit=status=0 send_ms=200 total_ms=48000 src_last_ms=5 src_max=9 dst_past_ms=none downtime_ms=none";
        assert_eq!(moved(unseen), Some((None, 48000.0, 200.0)));
        let failed = "send=status=500 receive=status=500 state=Paused send_ms=900 total_ms=2100 downtime_ms=none";
        assert_eq!(moved(failed), None);
        let not_there =
            "send=status=204 receive=status=500 state= send_ms=9 total_ms=9 downtime_ms=none";
        assert_eq!(moved(not_there), None);
    }

    #[test]
    fn every_boot_moves_its_vm_twice_then_finishes() {
        let s = boot_lines("ch1", true, "fs");
        assert!(s.starts_with("boot ch1 \"$WORK/baseline/cloud-hypervisor\" fs\n"));
        assert!(s.find("tcp_move ch1_move1") < s.find("tcp_move ch1_move2"));
        assert!(s.ends_with("finish\n"));
        assert!(boot_lines("ours1", false, "dax").contains("\"$VMM\" dax"));
    }
}
