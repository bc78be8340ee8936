//! What a guest costs the host beyond its RAM, ours beside Cloud Hypervisor
//! with virtiofsd, in one rig run (a benchmark, not a test):
//! `scripts/bench.sh overhead`, with `BASELINE_VMM=/path/to/cloud-hypervisor`
//! and `BASELINE_VIRTIOFSD=/path/to/virtiofsd` (both static) for the
//! comparison; without them it measures ours alone and says so.
//!
//! One emulated host boots the same guest (kernel, initramfs, 1 vCPU,
//! [`GUEST_MIB`] MiB of shared RAM, a virtio-fs share) [`ROUNDS`] times per
//! kind, the kinds alternating (ours without DAX, Cloud Hypervisor +
//! virtiofsd, ours with a DAX window; then in the reverse order; …) so
//! drift over the emulated host's life shows rather than passing for a
//! difference. Each boot:
//! - the daemon starts (ours `--dax off`, or with a [`WINDOW_MIB`] MiB
//!   window; virtiofsd `--sandbox=chroot`, as its namespace sandbox cannot
//!   leave the initramfs root), then the VMM with only `--api-socket`;
//! - `vm.create` (the same body for both VMMs, ours with `dax` off or a
//!   `cache_size`) and `vm.boot` through the API; the host watches the
//!   guest's serial output (the VMM's stdout, in a file) for the init's
//!   first line (`daxprobe wait-text`, 5 ms polls): **vm.create to init**
//!   on the host's clock;
//! - the guest mounts the share and reads a [`DATA_MIB`] MiB file once;
//!   two seconds later the host reads each process's `/proc/PID/smaps`
//!   and `status` (`daxprobe proc-cost`, `test_infra::proc_cost`): the
//!   VMM's and the daemon's (with its children) **own** memory — every
//!   mapping except guest RAM's memfd and files under the share (the DAX
//!   window's file pages) — as Rss and Pss, and their threads.
//!
//! Writes `target/rig-results/overhead-bench.md`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde_json::json;
use test_infra::baseline::{host_files, version, vmm_and_virtiofsd};
use test_infra::proc_cost::ProcCost;
use test_infra::results::{marker_fields, mean_and_spread, Results};
use test_infra::rig::{self, Guest, ImageFile, Run};
use test_infra::shell::SHELL_HELPERS;

/// Boots per kind.
const ROUNDS: usize = 3;
const GUEST_MIB: u64 = 256;
const WINDOW_MIB: u64 = 128;
/// The file each guest reads once through the share before the host measures.
const DATA_MIB: u64 = 16;
/// Where the rig puts the guest's kernel and initramfs in the emulated host.
const KERNEL: &str = "/guest/vmlinuz";
const INITRAMFS: &str = "/guest/initramfs.cpio";

/// The kinds of guest, in the first round's order: label, row name.
/// `daxchroot` is `dax` in the sandbox virtiofsd runs in here
/// (`--sandbox chroot`): our default namespace sandbox leaves a parent
/// process waiting for the sandboxed one, as virtiofsd's does, so only
/// this kind compares like with like.
const KINDS: [(&str, &str); 4] = [
    ("ours", "ours (dax-vmm + dax-virtiofsd), no DAX"),
    ("ch", "Cloud Hypervisor + virtiofsd (--sandbox=chroot)"),
    ("dax", "ours, DAX window"),
    (
        "daxchroot",
        "ours, DAX window, --sandbox chroot (as virtiofsd here)",
    ),
];

const GUEST_SCRIPT: &str = r#"
arg() { tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p"; }
mkdir -p /mnt
i=0; until mount -t virtiofs share /mnt -o "$(arg mountopts)" 2>/dev/null || [ $i -ge 300 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST $(arg label)_mounted=$(cut -d' ' -f1 /proc/uptime) statx=$(daxprobe statx /mnt/data.bin)"
cat /mnt/data.bin > /dev/null
echo "@@GUEST $(arg label)_settled=1"
while :; do sleep 60; done
"#;

/// The emulated host's part: `boot LABEL KIND` starts a daemon and a VMM,
/// creates and boots the VM (body in `$WORK/KIND.json`, `FS_SOCKET` and
/// `LABEL` replaced), waits for the guest's init and its read, measures,
/// and shuts the VM down.
const HOST_SCRIPT: &str = r#"
mkdir -p share && dd if=/dev/urandom of=share/data.bin bs=1M count=DATA_MIB 2>/dev/null
ms() { awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
N=0
boot() {
    LABEL=$1; KIND=$2; N=$((N+1)); SER=$WORK/$LABEL.serial; : > $SER
    FSS=/tmp/fs$N.sock; SOCK=/tmp/vmm$N.sock
    case $KIND in
    ours) dax-virtiofsd --socket-path $FSS --shared-dir share --dax off --log-level warn & BIN=$VMM ;;
    dax) dax-virtiofsd --socket-path $FSS --shared-dir share --cache-size WINDOW_MIBM --log-level warn & BIN=$VMM ;;
    daxchroot) dax-virtiofsd --socket-path $FSS --shared-dir share --cache-size WINDOW_MIBM --sandbox chroot --log-level warn & BIN=$VMM ;;
    ch) $WORK/baseline/virtiofsd --socket-path=$FSS --shared-dir=share --sandbox=chroot --log-level=warn & BIN=$WORK/baseline/cloud-hypervisor ;;
    esac
    DAEMON=$!
    wait_sock $FSS
    "$BIN" --api-socket $SOCK </dev/null >>$SER 2>>$LABEL.err &
    PID=$!
    wait_sock $SOCK
    BODY=$(sed -e "s|FS_SOCKET|$FSS|" -e "s|LABEL|$LABEL|" $WORK/$KIND.json)
    T0=$(ms); C=$(api $SOCK PUT /api/v1/vm.create "$BODY"); T1=$(ms)
    B=$(api $SOCK PUT /api/v1/vm.boot); T2=$(ms)
    AT=$(daxprobe wait-text $SER '@@GUEST init' 300)
    daxprobe wait-text $SER "@@GUEST ${LABEL}_settled" 600 >/dev/null
    sleep 2
    echo "@@HOST ${LABEL}_times create=${C%% *} boot=${B%% *} t0_ms=$T0 created_ms=$T1 booted_ms=$T2 init_$AT"
    echo "@@HOST ${LABEL}_vmm $(daxprobe proc-cost $WORK/share $PID)"
    echo "@@HOST ${LABEL}_daemon $(daxprobe proc-cost $WORK/share $DAEMON)"
    echo "@@HOST ${LABEL}_shutdown=$(api $SOCK PUT /api/v1/vmm.shutdown)"
    ended $PID; echo "@@HOST ${LABEL}_exit=$EXIT"
    kill $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null
    grep -a '@@GUEST' $SER | head -5
    grep -a -i 'error\|panic' $LABEL.err | tail -3 | sed "s/^/@@HOST ${LABEL}_said=/"
    rm -f $FSS $FSS.pid
}
BOOTS
echo "@@HOST overhead_done"
# The rig's own VMM run is not used: the boots above started their own.
exit 0
"#;

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("bench-overhead: {e}");
    std::process::exit(1)
}

/// The boots: (label, kind), each round the kinds in turn, every other
/// round reversed (ours ch dax, dax ch ours, …).
fn boots(kinds: &[&'static str], rounds: usize) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for r in 0..rounds {
        let mut order: Vec<&str> = kinds.to_vec();
        if r % 2 == 1 {
            order.reverse();
        }
        for k in order {
            out.push((format!("{k}{}", r + 1), k));
        }
    }
    out
}

/// The `vm.create` body of a kind; `FS_SOCKET` and `LABEL` are filled in
/// by the host script.
fn create_body(kind: &str, base_cmdline: &str) -> String {
    let dax = kind.starts_with("dax");
    let mountopts = if dax { "dax=always" } else { "dax=never" };
    let mut fs =
        json!({"tag": "share", "socket": "FS_SOCKET", "num_queues": 1, "queue_size": 1024});
    if kind == "ours" {
        fs["dax"] = json!(false);
    } else if dax {
        fs["cache_size"] = json!(WINDOW_MIB << 20);
    }
    json!({
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": GUEST_MIB << 20, "shared": true},
        "payload": {
            "kernel": KERNEL,
            "initramfs": INITRAMFS,
            "cmdline": format!("{base_cmdline} label=LABEL mountopts={mountopts}"),
        },
        "fs": [fs],
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
    })
    .to_string()
}

fn main() {
    let baseline = vmm_and_virtiofsd().unwrap_or_else(|e| fail(e));
    let kinds: Vec<&str> = KINDS
        .iter()
        .map(|k| k.0)
        .filter(|k| baseline.is_some() || *k != "ch")
        .collect();
    let boots = boots(&kinds, ROUNDS);
    let daxprobe = rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e));
    let daemon = rig::tool("daemon", "dax-virtiofsd").unwrap_or_else(|e| fail(e));
    let mut guest = Guest::new("bench-overhead", GUEST_SCRIPT);
    let base_cmdline = guest.cmdline();
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![daxprobe, daemon];
    for kind in &kinds {
        guest.host_files.push(ImageFile {
            path: format!("{kind}.json"),
            perm: 0o644,
            data: create_body(kind, &base_cmdline).into_bytes(),
        });
    }
    if let Some(pair) = &baseline {
        guest
            .host_files
            .extend(host_files(pair).unwrap_or_else(|e| fail(e)));
    }
    let lines: String = boots
        .iter()
        .map(|(l, k)| format!("boot {l} {k}\n"))
        .collect();
    guest.host_before = format!("{SHELL_HELPERS}{HOST_SCRIPT}")
        .replace("BOOTS", &lines)
        .replace("WINDOW_MIB", &WINDOW_MIB.to_string())
        .replace("DATA_MIB", &DATA_MIB.to_string());
    guest.timeout = Duration::from_secs(2400);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let versions = baseline
        .as_ref()
        .map(|(c, v)| format!("{}, {}", version(c), version(v)));
    let (results, tables, failed) = report(&run, &boots, versions);
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// From vm.create sent to the moment `key` of the `times` marker
/// (`booted_ms`: vm.boot answered; `init_at_ms`: the guest's init seen),
/// host clock, ms; None if a call failed or a time is missing.
fn since_create_ms(times: &str, key: &str) -> Option<u64> {
    let f = marker_fields(times);
    if !f.get("create")?.starts_with("status=2") || !f.get("boot")?.starts_with("status=2") {
        return None;
    }
    let t0: u64 = f.get("t0_ms")?.parse().ok()?;
    let at: u64 = f.get(key)?.parse().ok()?;
    at.checked_sub(t0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// One boot's measurements.
struct Boot {
    create_to_init_ms: Option<u64>,
    create_to_boot_answered_ms: Option<u64>,
    vmm: Option<ProcCost>,
    daemon: Option<ProcCost>,
}

fn report(
    run: &Run,
    boots: &[(String, &str)],
    baseline: Option<String>,
) -> (Results, String, bool) {
    let mut results = Results::new("overhead-bench");
    results.record_run("overhead run", run);
    results.record(
        "baseline",
        baseline.unwrap_or_else(|| {
            "none (BASELINE_VMM and BASELINE_VIRTIOFSD unset): ours alone".into()
        }),
    );
    let mut failed = false;
    let mut by_kind: HashMap<&str, Vec<Boot>> = HashMap::new();
    let mut boot_rows = String::new();
    for (label, kind) in boots {
        let host = |what: &str| run.host(&format!("{label}_{what}"));
        let cost = |what: &str| host(what).and_then(|l| ProcCost::parse_line(l).ok());
        let boot = Boot {
            create_to_init_ms: host("times").and_then(|t| since_create_ms(t, "init_at_ms")),
            create_to_boot_answered_ms: host("times").and_then(|t| since_create_ms(t, "booted_ms")),
            vmm: cost("vmm"),
            daemon: cost("daemon"),
        };
        // A guest RAM class that stayed empty means its memfd was not
        // recognised, and its pages were counted as the VMM's own.
        let ram_seen = boot.vmm.is_some_and(|v| v.guest_ram.rss > 0);
        failed |= boot.create_to_init_ms.is_none()
            || boot.vmm.is_none()
            || boot.daemon.is_none()
            || !ram_seen;
        let cell = |c: &Option<ProcCost>| {
            c.map_or("missing".into(), |c| {
                format!(
                    "{:.1} / {:.1} / {:.1} / {} / {:.1} / {:.1}",
                    mib(c.own.rss),
                    mib(c.own.pss),
                    mib(c.own.anon),
                    c.threads,
                    mib(c.guest_ram.rss),
                    mib(c.share.rss)
                )
            })
        };
        let init = boot
            .create_to_init_ms
            .map_or("missing".into(), |v| v.to_string());
        let booted = boot
            .create_to_boot_answered_ms
            .map_or("missing".into(), |v| v.to_string());
        let _ = writeln!(
            boot_rows,
            "| {label} | {init} | {booted} | {} | {} |",
            cell(&boot.vmm),
            cell(&boot.daemon)
        );
        results.record(&format!("{label}: vm.create to init, ms"), init);
        results.record(
            &format!("{label}: vm.create to vm.boot answered, ms"),
            booted,
        );
        results.record(
            &format!(
                "{label}: VMM own Rss / Pss / Anonymous MiB, threads, guest RAM Rss, share Rss"
            ),
            cell(&boot.vmm),
        );
        results.record(&format!("{label}: daemon the same"), cell(&boot.daemon));
        by_kind.entry(kind).or_default().push(boot);
    }
    let mut tables = format!(
        "One guest at a time ({GUEST_MIB} MiB shared RAM, 1 vCPU, a virtio-fs share; DAX boots: {WINDOW_MIB} MiB window), \
         the kinds alternating. Per boot: vm.create to the guest's init (host clock, ms), then after a {DATA_MIB} MiB read \
         through the share, each process's own memory (smaps, every mapping except the guest RAM memfd and files under \
         the share): Rss / Pss / Anonymous MiB / threads / (excluded: guest RAM Rss / share file pages Rss, MiB):\n\n\
         | boot | vm.create to init, ms | vm.create to vm.boot answered, ms | VMM | daemon (with its children) |\n|---|---|---|---|---|\n{boot_rows}"
    );
    tables.push_str(
        "\nPer kind, mean (each boot; spread max - min):\n\n\
         | kind | vm.create to init, ms | VMM own Rss, MiB | VMM own Pss, MiB | VMM threads | daemon own Rss, MiB | daemon own Pss, MiB | daemon threads | VMM + daemon own Pss, MiB | VMM + daemon own anonymous, MiB | VMM + daemon threads |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (kind, name) in KINDS {
        let Some(bs) = by_kind.get(kind) else {
            continue;
        };
        let col = |f: &dyn Fn(&Boot) -> Option<f64>, digits| {
            mean_and_spread(&bs.iter().filter_map(f).collect::<Vec<_>>(), digits)
        };
        let cells = [
            col(&|b| b.create_to_init_ms.map(|v| v as f64), 0),
            col(&|b| b.vmm.map(|c| mib(c.own.rss)), 1),
            col(&|b| b.vmm.map(|c| mib(c.own.pss)), 1),
            col(&|b| b.vmm.map(|c| f64::from(c.threads)), 0),
            col(&|b| b.daemon.map(|c| mib(c.own.rss)), 1),
            col(&|b| b.daemon.map(|c| mib(c.own.pss)), 1),
            col(&|b| b.daemon.map(|c| f64::from(c.threads)), 0),
            col(&|b| Some(mib(b.vmm?.own.pss + b.daemon?.own.pss)), 1),
            col(&|b| Some(mib(b.vmm?.own.anon + b.daemon?.own.anon)), 1),
            col(&|b| Some(f64::from(b.vmm?.threads + b.daemon?.threads)), 0),
        ];
        let _ = writeln!(tables, "| {name} | {} |", cells.join(" | "));
        for (what, v) in [
            "vm.create to init, ms",
            "VMM own Rss, MiB",
            "VMM own Pss, MiB",
            "VMM threads",
            "daemon own Rss, MiB",
            "daemon own Pss, MiB",
            "daemon threads",
            "VMM + daemon own Pss, MiB",
            "VMM + daemon own anonymous, MiB",
            "VMM + daemon threads",
        ]
        .iter()
        .zip(&cells)
        {
            results.record(&format!("{name}: {what}"), v.clone());
        }
    }
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_alternate_round_by_round() {
        let b = boots(&["ours", "ch", "dax"], 3);
        let labels: Vec<&str> = b.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(
            labels,
            ["ours1", "ch1", "dax1", "dax2", "ch2", "ours2", "ours3", "ch3", "dax3"]
        );
    }

    #[test]
    fn times_since_create_need_both_calls_to_succeed() {
        let ok = "create=status=204 boot=status=204 t0_ms=1000 created_ms=1100 booted_ms=1200 init_at_ms=7250";
        assert_eq!(since_create_ms(ok, "init_at_ms"), Some(6250));
        assert_eq!(since_create_ms(ok, "booted_ms"), Some(200));
        assert_eq!(
            since_create_ms(
                &ok.replace("boot=status=204", "boot=status=500"),
                "init_at_ms"
            ),
            None
        );
        assert_eq!(
            since_create_ms(
                &ok.replace("init_at_ms=7250", "init_at_ms=timeout"),
                "init_at_ms"
            ),
            None
        );
        assert_eq!(
            since_create_ms(&ok.replace("t0_ms=1000", "t0_ms=9000"), "init_at_ms"),
            None
        );
    }

    #[test]
    fn bodies_differ_only_in_the_share() {
        let ours: serde_json::Value =
            serde_json::from_str(&create_body("ours", "console=ttyS0")).unwrap();
        let ch: serde_json::Value =
            serde_json::from_str(&create_body("ch", "console=ttyS0")).unwrap();
        let dax: serde_json::Value =
            serde_json::from_str(&create_body("dax", "console=ttyS0")).unwrap();
        assert_eq!(ours["memory"], ch["memory"]);
        assert_eq!(ours["cpus"], ch["cpus"]);
        assert_eq!(ours["fs"][0]["dax"], false);
        assert!(
            ch["fs"][0].get("dax").is_none(),
            "Cloud Hypervisor has no dax field"
        );
        assert_eq!(dax["fs"][0]["cache_size"], WINDOW_MIB << 20);
        assert!(dax["payload"]["cmdline"]
            .as_str()
            .unwrap()
            .ends_with("mountopts=dax=always"));
        // The chroot kind differs from dax only in the daemon's sandbox.
        assert_eq!(
            create_body("daxchroot", "console=ttyS0"),
            create_body("dax", "console=ttyS0")
        );
    }
}
