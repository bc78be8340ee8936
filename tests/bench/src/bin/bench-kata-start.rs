//! The Kata sandbox start, ours beside Cloud Hypervisor's, in one rig run
//! (a benchmark, not a test): `scripts/bench.sh kata-start`, with
//! `BASELINE_VMM=/path/to/cloud-hypervisor` and
//! `BASELINE_VIRTIOFSD=/path/to/virtiofsd` for the comparison (both static
//! binaries; without them it measures ours alone and says so).
//!
//! One emulated host starts Kata runtime-rs's default sandbox
//! (`static_sandbox_resource_mgmt = true`) [`ROUNDS`] times per VMM, in
//! the order ours, CH, CH, ours, ours, CH, CH, … — so drift over the emulated
//! host's life shows rather than passing for a difference between the
//! VMMs. Each start is runtime-rs's, byte for byte
//! (`daxprobe kata-rs-replay`, `test_infra::kata::rs`): the daemon on
//! runtime-rs's command line, waited for by its stderr line; the VMM
//! started with only `--api-socket`; on one API connection `vmm.ping`,
//! `vm.create` with runtime-rs's VmConfig, `vm.add-net` with the tap's fd,
//! `vm.boot`; the agent dialled with `connect 1024` until it answers `OK`,
//! then a 4 KiB exchange each way (the stand-in for the agent's first
//! request); the stand-in agent then mounts the share as runtime-rs's
//! agent does (`kataShared`, `nodev`); `vmm.shutdown`. Both VMMs get the
//! same bodies, kernel, initramfs, root image and stand-in agent; ours
//! runs with `dax-virtiofsd`, Cloud Hypervisor with the Rust `virtiofsd`,
//! each on the same command line.
//!
//! The Rust virtiofsd's default sandbox (namespaces and `pivot_root`)
//! refuses to start when the root is the initramfs (rootfs): so the whole
//! benchmark, both VMMs and both daemons, runs chrooted in a tmpfs, as a
//! real host's root is after its initramfs switched to it.
//!
//! Host clock (the replay's milliseconds): VMM process start to `vmm.ping`
//! answered; VMM set-up (`vm.create` to `vm.boot` answered); `vm.create`
//! to the agent's `OK`, to the first exchange done, to the share mounted
//! (seen in the serial file, 100 ms polls). Guest clock (uptime): kernel to
//! init, module loads, root disk, the agent listening, the share mount.
//! Writes `target/rig-results/kata-start-bench.md`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use test_infra::baseline::{
    host_files, version, vmm_and_virtiofsd, VIRTIOFSD_ENV as BASELINE_VIRTIOFSD_ENV,
    VMM_ENV as BASELINE_VMM_ENV,
};
use test_infra::host::static_busybox;
use test_infra::kata::rs::json::Json;
use test_infra::kata::rs::{self, RsSandbox};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile, Run};

/// The Cloud Hypervisor and virtiofsd binaries to compare with.
/// Words added to our daemon's command line only, as runtime-rs's
/// `virtio_fs_extra_args` would add them (e.g. `--cache-size=64M`, to see
/// what the DAX window's size costs the start).
const OURS_EXTRA_ARGS_ENV: &str = "KATA_START_OURS_DAEMON_ARGS";
/// Sandbox starts per VMM.
const ROUNDS: usize = 5;
/// The sandbox's memory (runtime-rs's default is 2048; the emulated host has 3072).
const SANDBOX_MIB: u64 = 512;
/// What the replay takes for the host's RAM (MemoryConfig's hotplug_size).
const HOST_RAM_MIB: u64 = 2048;
/// The stand-in agent's first exchange, bytes each way.
const EXCHANGE_BYTES: u32 = 4096;
/// How long the agent dial and the share may take under the emulator.
const GUEST_SECS: u32 = 900;
const TAP: &str = "ktap0";
const MAC: &str = "52:54:00:ca:7a:01";

/// The rig's guest initramfs runs this after its modules: the read-only
/// root image, then the stand-in agent from it (Kata's guest boots the
/// image directly; Debian's kernel needs its virtio-blk module first).
const GUEST_SCRIPT: &str = r#"
echo "@@GUEST modules_loaded=$(cut -d' ' -f1 /proc/uptime)"
i=0; while [ ! -b /dev/vda1 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /newroot
mount -t ext4 -o ro /dev/vda1 /newroot; echo "@@GUEST root_mount=$?"
echo "@@GUEST root_mounted=$(cut -d' ' -f1 /proc/uptime)"
for d in proc sys dev; do mount -o bind /$d /newroot/$d; done
mount -t tmpfs tmpfs /newroot/run; mount -t tmpfs tmpfs /newroot/tmp
chroot /newroot /bin/sh /agent.sh
echo "@@GUEST agent_exit=$?"
"#;

/// The stand-in kata-agent: listens on vsock 1024, answers the runtime's
/// first exchange, then mounts the share as runtime-rs asks it to
/// (`kataShared` at /run/kata-containers/shared/containers, `nodev`).
const AGENT: &str = r#"
up() { cut -d' ' -f1 /proc/uptime; }
i=0; while ! ls /sys/bus/virtio/drivers/vmw_vsock_virtio_transport 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
daxprobe vsock-serve 1024 EXCHANGE_BYTES 1 > /tmp/agent.out 2> /tmp/agent.err &
AGENT=$!
echo "@@GUEST agent_listening=$(up)"
i=0; while kill -0 $AGENT 2>/dev/null && [ $i -lt 30000 ]; do sleep 0.01; i=$((i+1)); done
echo "@@GUEST agent_answered=$(up)"
echo "@@GUEST agent=$(cat /tmp/agent.out)"
S=/run/kata-containers/shared/containers
mkdir -p $S
mount -t virtiofs -o nodev kataShared $S; echo "@@GUEST share_mount=$?"
echo "@@GUEST share_mounted=$(up)"
echo "@@GUEST share_file=$(cat $S/small.txt)"
echo "@@GUEST share_done=1"
# For the log only (after every measured step): where the kernel's boot
# went (the vCPU's cycles before its clock, memory, PCI, the DAX window).
# Only these lines: a long dump over the serial port has stalled the
# emulated host.
dmesg | grep -e 'sched offset' -e 'Memory:' -e 'PCI host bridge' -e 'fuse: init' -e 'enabling device' -e 'Cache len' -e 'cache capability' -e 'Run /init' | sed 's/^/@@DMESG /'
echo "@@GUEST dmesg_done=1"
sleep 600
"#;

/// In the emulated host, before anything: the chroot on a tmpfs (see the
/// module note), entered for good.
const HOST_BEFORE: &str = r#"
mkdir -p /sysroot && mount -t tmpfs -o size=1536m tmpfs /sysroot
cp -a /bin /guest /work /sysroot/
for d in proc sys dev tmp run; do mkdir -p /sysroot/$d; done
mount -t proc proc /sysroot/proc; mount -t sysfs sysfs /sysroot/sys
mount -o bind /dev /sysroot/dev; mount -t tmpfs tmpfs /sysroot/tmp
mount -t tmpfs tmpfs /sysroot/run
echo "@@HOST chroot_ready=$(grep -c ' /sysroot ' /proc/mounts)"
exec chroot /sysroot /bin/sh /work/bench.sh
"#;

/// In the chroot: the emulated host's RAM touched once (its first touch
/// costs the real host page faults, which would slow whichever start came
/// first), then each start. The rig's own VMM run is not used.
const BENCH_SCRIPT: &str = r#"
cd /work; export PATH=/bin RUST_LOG_STYLE=never
echo "@@HOST in_chroot=$(grep -c ' / tmpfs' /proc/self/mountinfo)"
mkdir -p /tmp/touch && mount -t tmpfs -o size=100% tmpfs /tmp/touch
dd if=/dev/zero of=/tmp/touch/f bs=1M count=$(( $(awk '$1 == "MemAvailable:" {print $2}' /proc/meminfo) / 1024 - 384 )) 2>/dev/null
rm /tmp/touch/f; umount /tmp/touch
echo "@@HOST touched memavailable_kib=$(awk '$1 == "MemAvailable:" {print $2}' /proc/meminfo)"
up() { cut -d' ' -f1 /proc/uptime; }
start() {
    label=$1; vmm=$2; daemon=$3; dir=$4; share=$5; shift 5
    mkdir -p $dir/root $share/rw $share/ro
    printf 'small file' > $share/rw/small.txt
    mount --bind $share/rw $share/ro && mount -o remount,bind,ro $share/ro
    echo "@@HOST ${label}_daemon_start=$(up)"
    "$daemon" "$@" 2> $label-daemon.log &
    DAEMON=$!
    i=0; while ! grep -q 'READY_LINE' $label-daemon.log && kill -0 $DAEMON 2>/dev/null && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done
    echo "@@HOST ${label}_daemon_ready=$(up) $(grep -c 'READY_LINE' $label-daemon.log)"
    "$vmm" --api-socket $dir/ch-api.sock </dev/null > $label-vmm.out 2>&1 &
    VMM=$!
    daxprobe kata-rs-replay $dir/ch-api.sock $label.script
    i=0; while kill -0 $VMM 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    kill -0 $VMM 2>/dev/null && { echo "@@HOST ${label}_vmm_left=1"; kill -9 $VMM; }
    wait $VMM; echo "@@HOST ${label}_vmm_exit=$?"
    # The daemon ends once its VMM is gone (runtime-rs would SIGKILL it).
    i=0; while kill -0 $DAEMON 2>/dev/null && [ $i -lt 20 ]; do sleep 0.1; i=$((i+1)); done
    kill -0 $DAEMON 2>/dev/null && echo "@@HOST ${label}_daemon_left=1"; kill -9 $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null
    grep -a '@@GUEST' serial-$label.log | sed "s/.*@@GUEST /@@GUEST ${label}_/"
    grep -a '@@DMESG' serial-$label.log | sed "s/^@@DMESG /@@DMESG ${label} /"
    grep -a -i 'error' $label-vmm.out | head -3 | sed "s/^/@@HOST ${label}_vmm_said=/"
    grep -a -i 'error\|panic' $label-daemon.log | head -3 | sed "s/^/@@HOST ${label}_daemon_said=/"
    umount $share/ro; rm -rf $dir $share
}
STARTS
echo "@@HOST kata_start_done"
exit 0
"#;

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("bench-kata-start: {e}");
    std::process::exit(1)
}

/// One VMM and its daemon, as the emulated host runs them.
struct Side {
    /// `ours` or `ch`: the labels' prefix.
    name: &'static str,
    vmm: &'static str,
    daemon: &'static str,
}

const OURS: Side = Side {
    name: "ours",
    vmm: "/bin/dax-vmm",
    daemon: "/bin/dax-virtiofsd",
};
const CH: Side = Side {
    name: "ch",
    vmm: "/work/baseline/cloud-hypervisor",
    daemon: "/work/baseline/virtiofsd",
};

/// The order of the starts: ours, CH, CH, ours, ours, CH, …; ours alone
/// without a baseline.
fn order(compare: bool) -> Vec<(String, &'static Side)> {
    let mut out = Vec::new();
    let mut count = [0usize; 2];
    for i in 0..ROUNDS * 2 {
        let side = if !compare {
            0
        } else {
            // Pairs alternate which goes first: (ours, ch), (ch, ours), …
            (i % 2) ^ ((i / 2) % 2)
        };
        if !compare && i >= ROUNDS {
            break;
        }
        count[side] += 1;
        let s = if side == 0 { &OURS } else { &CH };
        out.push((format!("{}{}", s.name, count[side]), s));
    }
    out
}

fn sandbox(label: &str) -> RsSandbox {
    let mut s = RsSandbox::new(
        &format!("kbench-{label}"),
        "/guest/vmlinuz",
        "/work/root.img",
        4,
        HOST_RAM_MIB << 20,
        true,
    );
    s.memory_mib = SANDBOX_MIB;
    s.kernel_params = vec!["console=ttyS0".into()];
    s
}

/// runtime-rs's VmConfig with the rig's differences (as in the guest test
/// `kata_sandbox_rs`): the serial to a file (runtime-rs sends Off) and an
/// initramfs beside the image (Debian's kernel has virtio-blk, virtio-net
/// and vsock as modules).
fn create_body(label: &str) -> String {
    let mut body = sandbox(label).vm_config();
    let payload = body.get_mut("payload").expect("payload");
    *payload.get_mut("initramfs").expect("initramfs") = Json::str("/guest/initramfs.cpio");
    *body.get_mut("serial").expect("serial") = Json::Obj(vec![
        ("file", Json::str(format!("/work/serial-{label}.log"))),
        ("mode", Json::str("File")),
        ("iommu", Json::Bool(false)),
    ]);
    body.pretty()
}

/// runtime-rs's calls for one start, for `daxprobe kata-rs-replay`.
fn replay_script(label: &str) -> String {
    let s = sandbox(label);
    format!(
        "{label}_ping ping\n\
         {label}_create create /work/{label}.json\n\
         {label}_net add-net {TAP} {MAC}\n\
         {label}_boot boot\n\
         {label}_agent agent {vsock} {port} {EXCHANGE_BYTES} {GUEST_SECS}\n\
         {label}_share wait /work/serial-{label}.log share_done=1 {GUEST_SECS}\n\
         {label}_dmesg wait /work/serial-{label}.log dmesg_done=1 60\n\
         {label}_end shutdown\n",
        vsock = s.vsock_socket(),
        port = rs::AGENT_PORT,
    )
}

/// The shell line that runs one start; `extra` goes to our daemon only.
fn start_line(label: &str, side: &Side, extra: &[String]) -> String {
    let s = sandbox(label);
    let share = s.shared_dir();
    let share_root = share.trim_end_matches("/ro");
    let mut args = s.virtiofsd_args();
    if side.name == OURS.name {
        args.extend(extra.iter().cloned());
    }
    format!(
        "start {label} {} {} {} {share_root} {}\n",
        side.vmm,
        side.daemon,
        s.dir(),
        args.join(" ")
    )
}

/// The stand-in agent's read-only root image: busybox, daxprobe, the script.
fn root_disk(daxprobe: &Path) -> Vec<u8> {
    let busybox = std::fs::read(static_busybox().unwrap_or_else(|e| fail(e)))
        .unwrap_or_else(|e| fail(format!("busybox: {e}")));
    let daxprobe = std::fs::read(daxprobe).unwrap_or_else(|e| fail(format!("daxprobe: {e}")));
    let agent = AGENT.replace("EXCHANGE_BYTES", &EXCHANGE_BYTES.to_string());
    let applets = [
        "sh", "cat", "cut", "grep", "ls", "mkdir", "mount", "sleep", "kill", "dmesg", "sed",
    ];
    test_infra::kata::agent_root_disk("kata-start-root", &busybox, &daxprobe, &agent, &applets)
}

fn main() {
    let baseline = vmm_and_virtiofsd().unwrap_or_else(|e| fail(e));
    let compare = baseline.is_some();
    let starts = order(compare);
    let extra: Vec<String> = std::env::var(OURS_EXTRA_ARGS_ENV)
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    if extra
        .iter()
        .any(|w| !w.starts_with('-') || w.contains(['\'', '"', ';', '$', '`']))
    {
        fail(format!(
            "{OURS_EXTRA_ARGS_ENV}: options only, no shell characters"
        ));
    }
    let daxprobe = rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e));
    let daemon = rig::tool("daemon", "dax-virtiofsd").unwrap_or_else(|e| fail(e));
    let mut guest = Guest::new("bench-kata-start", GUEST_SCRIPT);
    guest.guest_modules = vec![
        "virtio_blk".into(),
        "virtio_net".into(),
        "vmw_vsock_virtio_transport".into(),
    ];
    guest.host_modules = vec!["tun".into()];
    guest.host_tools = vec![daxprobe.clone(), daemon];
    guest.host_files = vec![ImageFile {
        path: "root.img".into(),
        perm: 0o644,
        data: root_disk(&daxprobe),
    }];
    if let Some(pair) = &baseline {
        guest
            .host_files
            .extend(host_files(pair).unwrap_or_else(|e| fail(e)));
    }
    let mut lines = String::new();
    for (label, side) in &starts {
        guest.host_files.push(ImageFile {
            path: format!("{label}.json"),
            perm: 0o644,
            data: create_body(label).into_bytes(),
        });
        guest.host_files.push(ImageFile {
            path: format!("{label}.script"),
            perm: 0o644,
            data: replay_script(label).into_bytes(),
        });
        lines.push_str(&start_line(label, side, &extra));
    }
    let bench = BENCH_SCRIPT
        .replace("READY_LINE", rs::DAEMON_READY_LINE)
        .replace("STARTS", &lines);
    guest.host_files.push(ImageFile {
        path: "bench.sh".into(),
        perm: 0o755,
        data: bench.into_bytes(),
    });
    guest.host_before = HOST_BEFORE.into();
    guest.timeout = Duration::from_secs(3600);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let versions = baseline.as_ref().map(|(c, v)| (version(c), version(v)));
    let (mut results, tables, failed) = report(&run, &starts, versions);
    if !extra.is_empty() {
        results.record("our daemon's extra arguments", extra.join(" "));
    }
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// One measurement of a start, in milliseconds, from the run's markers.
struct Row {
    what: &'static str,
    value: fn(&Run, &str) -> Option<f64>,
}

/// The replay's milliseconds for `key` (`krs_<label>_<key>`).
fn host_ms(run: &Run, label: &str, key: &str) -> Option<f64> {
    run.host(&format!("krs_{label}_{key}"))?.trim().parse().ok()
}

/// The guest's uptime marker `<label>_<key>`, in milliseconds.
fn guest_ms(run: &Run, label: &str, key: &str) -> Option<f64> {
    let v = run.guest(&format!("{label}_{key}"))?;
    let secs: f64 = v.trim().trim_start_matches("uptime=").parse().ok()?;
    Some(secs * 1000.0)
}

/// From the replay's `from` to its `to` (host clock).
fn host_span(run: &Run, label: &str, from: &str, to: &str) -> Option<f64> {
    Some(host_ms(run, label, to)? - host_ms(run, label, from)?)
}

fn guest_span(run: &Run, label: &str, from: &str, to: &str) -> Option<f64> {
    Some(guest_ms(run, label, to)? - guest_ms(run, label, from)?)
}

/// The emulated host's uptime at the daemon's start and ready line.
fn daemon_ms(run: &Run, label: &str) -> Option<f64> {
    let at = |k: &str| -> Option<f64> {
        run.host(&format!("{label}_{k}"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some((at("daemon_ready")? - at("daemon_start")?) * 1000.0)
}

const ROWS: [Row; 12] = [
    Row {
        what: "**`vm.create` to the agent's `OK`** (host clock)",
        value: |r, l| host_span(r, l, "create_start_ms", "agent_ok_ms"),
    },
    Row {
        what: "`vm.create` to the first exchange done (host clock)",
        value: |r, l| host_span(r, l, "create_start_ms", "agent_end_ms"),
    },
    Row {
        what: "`vm.create` to the share mounted (host clock, 100 ms polls)",
        value: |r, l| host_span(r, l, "create_start_ms", "share_end_ms"),
    },
    Row {
        what: "daemon start to its ready line (emulated host's uptime, 10 ms)",
        value: daemon_ms,
    },
    Row {
        what: "VMM process start to `vmm.ping` answered (host clock)",
        value: |r, l| host_ms(r, l, "ping_end_ms"),
    },
    Row {
        what: "VMM set-up: `vm.create` to `vm.boot` answered (host clock)",
        value: |r, l| host_span(r, l, "create_start_ms", "boot_end_ms"),
    },
    Row {
        what: "`vm.boot` answered to the agent's `OK` (host clock)",
        value: |r, l| host_span(r, l, "boot_end_ms", "agent_ok_ms"),
    },
    Row {
        what: "of which before the guest clock starts, and the dial (boot→OK less the guest's uptime at listening)",
        value: |r, l| Some(host_span(r, l, "boot_end_ms", "agent_ok_ms")? - guest_ms(r, l, "agent_listening")?),
    },
    Row {
        what: "guest kernel to init (guest clock)",
        value: |r, l| guest_ms(r, l, "init"),
    },
    Row {
        what: "module loads: virtio_blk, virtio_net, vsock (guest clock)",
        value: |r, l| guest_span(r, l, "init", "modules_loaded"),
    },
    Row {
        what: "root disk found and mounted (guest clock)",
        value: |r, l| guest_span(r, l, "modules_loaded", "root_mounted"),
    },
    Row {
        what: "root mounted to the agent listening (guest clock)",
        value: |r, l| guest_span(r, l, "root_mounted", "agent_listening"),
    },
];

/// The share mount after the agent's answer: not part of the start above,
/// shown beside it.
const SHARE_ROW: Row = Row {
    what: "virtio-fs share mount, after the agent's answer (guest clock)",
    value: |r, l| guest_span(r, l, "agent_answered", "share_mounted"),
};

/// The middle value (the mean of the two middle ones for an even count).
fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// Every call of the start answered as runtime-rs needs it, and the guest
/// mounted the share: else the start's figures are not a start's.
fn start_failures(run: &Run, label: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for step in ["ping", "create", "net", "boot", "end"] {
        let v = run
            .host(&format!("krs_{label}_{step}"))
            .unwrap_or("missing");
        if !v.starts_with("ok") {
            bad.push(format!("{step}: {v}"));
        }
    }
    let agent = run.host(&format!("krs_{label}_agent")).unwrap_or("missing");
    let exchanged = format!("sent={EXCHANGE_BYTES} received={EXCHANGE_BYTES} match=1");
    if !agent.starts_with("OK ") || !agent.contains(&exchanged) {
        bad.push(format!("agent: {agent}"));
    }
    let share = run.host(&format!("krs_{label}_share")).unwrap_or("missing");
    if share != "seen" || run.guest(&format!("{label}_share_file")) != Some("small file") {
        bad.push(format!("share: {share}"));
    }
    if run.host(&format!("{label}_vmm_exit")) != Some("0") {
        bad.push(format!(
            "VMM exit: {}",
            run.host(&format!("{label}_vmm_exit")).unwrap_or("missing")
        ));
    }
    bad
}

fn report(
    run: &Run,
    starts: &[(String, &Side)],
    versions: Option<(String, String)>,
) -> (Results, String, bool) {
    let mut results = Results::new("kata-start-bench");
    results.record_run("kata-start", run);
    let compare = versions.is_some();
    match versions {
        Some((ch, virtiofsd)) => {
            results.record("baseline", format!("{ch}, {virtiofsd}"));
        }
        None => results.record(
            "baseline",
            format!("none: ours alone ({BASELINE_VMM_ENV} and {BASELINE_VIRTIOFSD_ENV} unset)"),
        ),
    }
    let mut failed = run.host("kata_start_done").is_none();
    for (label, _) in starts {
        let bad = start_failures(run, label);
        failed |= !bad.is_empty();
        results.record(
            &format!("{label}: calls, agent, share"),
            if bad.is_empty() {
                "all as runtime-rs needs".into()
            } else {
                bad.join("; ")
            },
        );
        let tries = run
            .host(&format!("krs_{label}_agent_tries"))
            .unwrap_or("n/a");
        results.record(&format!("{label}: agent dial tries (10 ms apart)"), tries);
        for key in ["vmm_said", "daemon_said", "vmm_left", "daemon_left"] {
            if let Some(v) = run.host(&format!("{label}_{key}")) {
                results.record(&format!("{label}: {key}"), v);
            }
        }
    }
    let mut header = String::from("| ms |");
    let mut rule = String::from("|---|");
    for (label, _) in starts {
        let _ = write!(header, " {label} |");
        rule.push_str("---|");
    }
    header.push_str(" ours, median |");
    rule.push_str("---|");
    if compare {
        header.push_str(" CH, median | ours / CH |");
        rule.push_str("---|---|");
    }
    let mut tables = format!("{header}\n{rule}\n");
    for row in ROWS.iter().chain(std::iter::once(&SHARE_ROW)) {
        let _ = write!(tables, "| {} |", row.what);
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for (label, side) in starts {
            match (row.value)(run, label) {
                Some(v) => {
                    let _ = write!(tables, " {v:.0} |");
                    results.record(&format!("{label}: {}", row.what), format!("{v:.0} ms"));
                    if side.name == OURS.name {
                        ours.push(v);
                    } else {
                        theirs.push(v);
                    }
                }
                None => tables.push_str(" n/a |"),
            }
        }
        let shown = |m: Option<f64>| m.map_or("n/a".into(), |m| format!("{m:.0}"));
        let (o, t) = (median(&ours), median(&theirs));
        let _ = write!(tables, " {} |", shown(o));
        results.record(&format!("ours, median: {}", row.what), shown(o));
        if compare {
            let ratio = match (o, t) {
                (Some(o), Some(t)) if t > 0.0 => format!("{:.2}x", o / t),
                _ => "n/a".into(),
            };
            let _ = write!(tables, " {} | {ratio} |", shown(t));
            results.record(&format!("CH, median: {}", row.what), shown(t));
            results.record(&format!("ours / CH: {}", row.what), ratio);
        }
        tables.push('\n');
    }
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_alternate_in_pairs_and_ours_runs_alone_without_a_baseline() {
        let labels = |c| order(c).into_iter().map(|(l, _)| l).collect::<Vec<_>>();
        assert_eq!(
            labels(true),
            ["ours1", "ch1", "ch2", "ours2", "ours3", "ch3", "ch4", "ours4", "ours5", "ch5"]
        );
        assert_eq!(labels(false), ["ours1", "ours2", "ours3", "ours4", "ours5"]);
        assert!(order(true).iter().all(|(l, s)| l.starts_with(s.name)));
    }

    #[test]
    fn median_is_the_middle_value_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn the_replay_script_is_runtime_rs_s_order_on_the_sandbox_s_sockets() {
        let script = replay_script("ch2");
        let calls: Vec<&str> = script
            .lines()
            .map(|l| l.split_whitespace().nth(1).unwrap())
            .collect();
        assert_eq!(
            calls,
            ["ping", "create", "add-net", "boot", "agent", "wait", "wait", "shutdown"]
        );
        assert!(script.contains("agent /run/kata/kbench-ch2/ch-vm.sock 1024 4096 "));
        let extra = ["--cache-size=64M".to_string()];
        let line = start_line("ch2", &CH, &extra);
        assert!(!line.contains("cache-size"), "{line}");
        let ours = start_line("ours1", &OURS, &extra);
        assert!(
            ours.trim_end()
                .ends_with("announce_submounts --cache-size=64M"),
            "{ours}"
        );
        assert!(line.starts_with(
            "start ch2 /work/baseline/cloud-hypervisor /work/baseline/virtiofsd /run/kata/kbench-ch2 \
             /run/kata-containers/shared/sandboxes/kbench-ch2 --socket-path /run/kata/kbench-ch2/root/virtiofsd.sock"
        ), "{line}");
        let body = create_body("ch2");
        assert!(body.contains("\"/work/serial-ch2.log\""), "{body}");
        assert!(body.contains("\"/guest/initramfs.cpio\""), "{body}");
    }
}
