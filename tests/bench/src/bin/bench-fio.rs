//! The seed's fio table as a benchmark of the project (not a test), in one
//! rig run: `scripts/bench.sh fio`, with
//! `BASELINE_VMM=/path/to/cloud-hypervisor` and
//! `BASELINE_VIRTIOFSD=/path/to/virtiofsd` (both static) for the
//! comparison.
//!
//! fio (Debian's, copied into the guest with its shared libraries) runs
//! the seed's rows on 64 MiB files with 4 KiB blocks, each job for a few
//! seconds (`--time_based`), the guest's caches dropped before each: the
//! psync, libaio (queue depth 16, `O_DIRECT`) and mmap engines × sequential
//! and random reads and writes, with one job and with four (each on its
//! own file); then a 4 KiB random write with an fsync (psync) or an msync
//! (mmap) after each write, whose difference to the same job without is
//! what the sync costs. Each job runs on every server of the boot in
//! turn, so drift over the emulated host's life touches them alike.
//!
//! Boots, one per VMM (each round runs them again, `FIO_BENCH_ROUNDS`,
//! default 1):
//!
//! - ours: 4 vCPUs, 1 GiB of shared RAM, four fs devices with four
//!   request queues each, each served by its own `dax-virtiofsd --cache
//!   never`: with DAX (a 512 MiB window, mounted `dax=always`) and without
//!   (`--dax off`, mounted `dax=never`), each on a host tmpfs with 4 KiB
//!   pages (`huge=never`) and on one with 2 MiB pages (`huge=always`);
//!   and the same files in the guest's own tmpfs, the limit;
//! - Cloud Hypervisor: the same guest, with virtiofsd `--cache=never` on
//!   both shares, one request queue each (virtiofsd serves one);
//! - multi-queue: our VMM, 2 vCPUs, no DAX, 4 KiB host pages: our daemon
//!   with two request queues, with one, and virtiofsd with one, each
//!   read by 4 KiB random preads with one job and with two; the host notes
//!   the daemon's threads' CPU time before and after the two jobs, which
//!   tells how many threads served them.
//!
//! Writes `target/rig-results/fio-bench.md`. `bench-fio ours ch mq` runs
//! only the named boots; `bench-fio --from-log PATH [boots]` writes the
//! tables again from a finished run's `serial.log`.

#[path = "bench_fio/jobs.rs"]
mod jobs;
#[path = "bench_fio/table.rs"]
mod table;
#[path = "bench_fio/trace.rs"]
mod trace;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use test_infra::baseline::{host_files, version, vmm_and_virtiofsd};
use test_infra::packaged::{installed, with_libraries};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, Line, Run};
use test_infra::shell::SHELL_HELPERS;

use jobs::{all_jobs, Server, Set, CH, MQ, OURS};

const ROUNDS_ENV: &str = "FIO_BENCH_ROUNDS";
/// `FIO_BENCH_JOBS=randread_psync_1,...`: only these jobs (the keys of
/// the guest's output), e.g. to trace one row; the tables then show the
/// others as having no result.
const JOBS_ENV: &str = "FIO_BENCH_JOBS";
const FILE_MIB: u32 = 64;
/// Each job's run time: long enough for a few thousand 4 KiB requests on
/// the slowest server in the emulated host, short enough for the run to
/// fit.
const JOB_SECS: u32 = 2;
/// The DAX window: larger than the four jobs' files together (4 x 64
/// MiB), so no job waits for the guest to reclaim a range.
/// `FIO_BENCH_WINDOW` sets another (a size in MiB, even, 2 to 4096): one
/// smaller than the files makes the guest reclaim ranges while it writes
/// (with 128 MiB, four mmap writers on 2 MiB host pages once hung while
/// the guest's DAX writeback refused those files' block size).
const WINDOW_MIB: u32 = 512;
const WINDOW_ENV: &str = "FIO_BENCH_WINDOW";
const GUEST_MEMORY: &str = "1024M";
/// Request queues of our fs devices in the main boot: one per vCPU.
const MAIN_CPUS: u32 = 4;
const MQ_CPUS: u32 = 2;
const QUEUE_SIZE: u32 = 1024;

const GUEST_SCRIPT: &str = r#"
word() { sed -n "s/.*$1=\([a-z0-9,]*\).*/\1/p" /proc/cmdline; }
round=$(word fio_round); set=$(word fio_set); servers=$(word fio_servers | tr , ' ')
echo "@@GUEST r${round}_${set}_cpus=$(grep -c ^processor /proc/cpuinfo)"
for s in $servers; do
    mkdir -p /fio/$s
    case $s in
        tmpfs) mount -t tmpfs -o size=320m tmpfs /fio/$s &&
            for f in 0 1 2 3; do dd if=/dev/zero of=/fio/$s/f$f bs=1M count=FILE_MIB 2>/dev/null; done ;;
        dax*) mount -t virtiofs $s /fio/$s -o dax=always ;;
        *) mount -t virtiofs $s /fio/$s -o dax=never ;;
    esac || echo "@@GUEST r${round}_${s}_mount_failed=1"
    echo "@@GUEST r${round}_${s}_statx=$(daxprobe statx /fio/$s/f0 2>&1)"
done
# Which virtio device serves which tag (sysfs names each virtio-fs tag).
for d in /sys/fs/virtiofs/*; do
    [ -e $d/tag ] && echo "@@GUEST r${round}_$(cat $d/tag)_device=$(basename $(readlink -f $d/device))"
done
# Each request queue's interrupts (all CPUs), as `virtioN-requests.Q:count`.
irqs() {
    grep 'requests' /proc/interrupts | awk -v n=$(grep -c ^processor /proc/cpuinfo) \
        '{ s = 0; for (i = 2; i <= n + 1; i++) s += $i; printf "%s:%d ", $NF, s }'
}
# In the multi-queue boot the guest notes its request queues'
# interrupts, and the host the daemon's threads; around a DAX job the host
# notes the VMM's counters. The host does so when a note file appears on
# the share, which it then removes (bounded wait).
note() {
    case "$set:$1" in mq:*) echo "@@GUEST irqs_$2=$(irqs)" ;; main:dax*) ;; *) return 0 ;; esac
    : > /fio/$1/.note-$2
    i=0; while [ -e /fio/$1/.note-$2 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
}
job() {
    of=$1; name=$2; shift 2
    [ "$of" = "$set" ] || return 0
    for s in $servers; do
        k=r${round}_${s}_$name
        echo 3 > /proc/sys/vm/drop_caches
        note $s ${k}_begin
        # Bounded: a job that hangs must not stall the other rows.
        out=$(timeout -s KILL JOB_LIMIT fio --name=$name --directory=/fio/$s --filename_format='f$jobnum' --size=FILE_MIBM --bs=4k \
            --runtime=JOB_SECS --time_based --minimal --group_reporting "$@" 2>&1)
        note $s ${k}_end
        line=$(echo "$out" | grep '^3;' | tail -1)
        [ -n "$line" ] || line="failed $(echo "$out" | grep -v '^$' | tail -1 | tr -d ';')"
        echo "@@GUEST $k=$line"
        # A kernel warning (hidden by `quiet`) names the job that raised it.
        w=$(dmesg | grep -c 'WARNING:')
        [ "$w" = "$warnings" ] || echo "@@GUEST ${k}_kernel_warning=$(dmesg | grep 'WARNING:' | tail -1)"
        warnings=$w
    done
}
warnings=$(dmesg | grep -c 'WARNING:')
JOB_LINES
for s in $servers; do umount /fio/$s; done
dmesg | grep -A14 'WARNING:' | head -60 | sed "s/^/@@GUEST r${round}_${set}_dmesg /"
echo "@@GUEST r${round}_${set}_done=1"
"#;

/// The emulated host: the two shares, the note watcher, the daemons and
/// the boots. The rig's own VMM run is not used.
const HOST_SCRIPT: &str = r#"
mkdir -p share4k share2m
mount -t tmpfs -o huge=never,size=600m tmpfs share4k
mount -t tmpfs -o huge=always,size=600m tmpfs share2m
dd if=/dev/urandom of=share4k/f0 bs=1M count=FILE_MIB 2>/dev/null
for f in 1 2 3; do cp share4k/f0 share4k/f$f; done
cp share4k/f0 share4k/f1 share4k/f2 share4k/f3 share2m/
echo "@@HOST shares share2m_huge_kib=$(grep ShmemHugePages /proc/meminfo | tr -s ' ' | cut -d' ' -f2) share4k=$(grep share4k /proc/mounts | cut -d' ' -f4) share2m=$(grep share2m /proc/mounts | cut -d' ' -f4)"
# The VMM's counters (its metrics text, one line).
vmm_counters() {
    daxprobe http /tmp/vmm-api.sock GET /api/v1/vm.dax-metrics | sed 's/^status=[0-9]* body=//'
}
notes() {
    while [ ! -e notes.stop ]; do
        for f in share4k/.note-* share2m/.note-*; do
            [ -e "$f" ] || continue
            n=${f#share*/.note-}
            case $n in *_dax*) echo "@@HOST vmm_$n=$(vmm_counters)"; rm -f "$f"; continue ;; esac
            p=$(cat $(echo $n | cut -d_ -f2).pid 2>/dev/null)
            # Our daemon serves from a child process in its sandbox.
            kids=$(grep -l "^PPid:[[:space:]]*$p\$" /proc/[0-9]*/status 2>/dev/null | cut -d/ -f3)
            echo "@@HOST threads_$n=$(for t in $(for q in $p $kids; do echo /proc/$q/task/*; done); do printf '%s:%s:%s ' ${t##*/} "$(tr -d ' :' < $t/comm)" "$(cut -d')' -f2 $t/stat | awk '{print $12 + $13}')"; done)"
            rm -f "$f"
        done
        sleep 0.1
    done
}
notes &
ours() {
    n=$1; d=$2; shift 2; rm -f /tmp/$n.sock
    dax-virtiofsd --socket-path /tmp/$n.sock --shared-dir $d --cache never --log-level warn "$@" &
    echo $! > $n.pid; wait_sock /tmp/$n.sock
}
virtiofsd() {
    n=$1; d=$2; rm -f /tmp/$n.sock /tmp/$n.sock.pid
    # Its namespace sandbox cannot pivot_root from the initramfs.
    $WORK/baseline/virtiofsd --socket-path=/tmp/$n.sock --shared-dir=$d --cache=never --sandbox=chroot --log-level=warn &
    echo $! > $n.pid; wait_sock /tmp/$n.sock
}
boot() {
    label=$1; bin=$2; cpus=$3; servers=$4; set=$5; round=$6; shift 6
    fs=""; for f in "$@"; do fs="$fs --fs $f"; done
    echo "@@HOST ${label}_start"
    # Our VMM's API: the counters noted around DAX jobs.
    api=""; rm -f /tmp/vmm-api.sock
    [ "$bin" = "$VMM" ] && api="--api-socket /tmp/vmm-api.sock"
    "$bin" $api --kernel "$KERNEL" --initramfs "$INITRAMFS" \
        --cmdline "BASE_CMDLINE fio_round=$round fio_set=$set fio_servers=$servers" \
        --cpus boot=$cpus --memory size=GUEST_MEMORY,shared=on --serial tty --console off $fs </dev/null
    echo "@@HOST ${label}_exit=$?"
    for p in *.pid; do kill $(cat $p) 2>/dev/null; ended $(cat $p); echo "@@HOST ${label}_${p%.pid}_daemon=$EXIT"; rm -f $p; done
}
BOOTS
touch notes.stop; wait
echo "@@HOST fio_done"
exit 0
"#;

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("bench-fio: {e}");
    std::process::exit(1)
}

/// One fs device's `--fs` value.
fn fs_arg(s: &Server, queues: u32, ours: bool, window_mib: u32) -> String {
    let mut a = format!(
        "tag={n},socket=/tmp/{n}.sock,num_queues={queues},queue_size={QUEUE_SIZE}",
        n = s.name
    );
    if ours && s.name.starts_with("dax") {
        a.push_str(&format!(",transport=pci,cache_size={window_mib}M"));
    } else if ours {
        a.push_str(",dax=off,transport=pci");
    }
    a
}

fn share(s: &Server) -> &'static str {
    if s.huge == Some(true) {
        "share2m"
    } else {
        "share4k"
    }
}

/// The host lines of one round's boots.
fn boot_lines(round: u32, boots: &[&str], window_mib: u32) -> String {
    let mut out = String::new();
    let servers = |list: &[Server]| list.iter().map(|s| s.name).collect::<Vec<_>>().join(",");
    if boots.contains(&"ours") {
        for s in OURS.iter().filter(|s| s.huge.is_some()) {
            // The daemon serves as many request queues as the device asks.
            let args = if s.name.starts_with("dax") {
                format!("--cache-size {window_mib}M --max-request-queues {MAIN_CPUS}")
            } else {
                format!("--dax off --max-request-queues {MAIN_CPUS}")
            };
            let _ = writeln!(out, "ours {} {} {args}", s.name, share(s));
        }
        let fs: Vec<String> = OURS
            .iter()
            .filter(|s| s.huge.is_some())
            .map(|s| fs_arg(s, MAIN_CPUS, true, window_mib))
            .collect();
        let _ = writeln!(
            out,
            "boot ours{round} \"$VMM\" {MAIN_CPUS} {} main {round} {}",
            servers(&OURS),
            fs.join(" ")
        );
    }
    if boots.contains(&"ch") {
        for s in &CH {
            let _ = writeln!(out, "virtiofsd {} {}", s.name, share(s));
        }
        let fs: Vec<String> = CH.iter().map(|s| fs_arg(s, 1, false, window_mib)).collect();
        let _ = writeln!(
            out,
            "boot ch{round} \"$WORK/baseline/cloud-hypervisor\" {MAIN_CPUS} {} main {round} {}",
            servers(&CH),
            fs.join(" ")
        );
    }
    if boots.contains(&"mq") {
        let mut fs = Vec::new();
        for s in &MQ {
            let queues = if s.name == "mq2" { 2 } else { 1 };
            if s.name.starts_with("vfsd") {
                let _ = writeln!(out, "virtiofsd {} {}", s.name, share(s));
            } else {
                let _ = writeln!(
                    out,
                    "ours {} {} --dax off --max-request-queues {queues}",
                    s.name,
                    share(s)
                );
            }
            fs.push(fs_arg(s, queues, true, window_mib));
        }
        let _ = writeln!(
            out,
            "boot mq{round} \"$VMM\" {MQ_CPUS} {} mq {round} {}",
            servers(&MQ),
            fs.join(" ")
        );
    }
    out
}

fn main() {
    let baseline = vmm_and_virtiofsd().unwrap_or_else(|e| fail(e));
    let rounds: u32 = match std::env::var(ROUNDS_ENV) {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|r| (1..=4).contains(r))
            .unwrap_or_else(|| fail(format!("{ROUNDS_ENV}={v}: a number from 1 to 4"))),
        Err(_) => 1,
    };
    let window_mib: u32 = match std::env::var(WINDOW_ENV) {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|m| (2..=4096).contains(m) && m % 2 == 0)
            .unwrap_or_else(|| {
                fail(format!(
                    "{WINDOW_ENV}={v}: a window size in MiB, even, from 2 to 4096"
                ))
            }),
        Err(_) => WINDOW_MIB,
    };
    let mut only: Vec<String> = std::env::args().skip(1).collect();
    let from_log = (only.first().map(String::as_str) == Some("--from-log")).then(|| {
        only.remove(0);
        if only.is_empty() {
            fail("--from-log needs the path of a run's serial.log");
        }
        PathBuf::from(only.remove(0))
    });
    let mut boots: Vec<&str> = vec!["ours", "ch", "mq"];
    if baseline.is_none() && from_log.is_none() {
        // The multi-queue boot compares with virtiofsd too.
        boots = vec!["ours"];
    }
    if !only.is_empty() {
        if let Some(o) = only
            .iter()
            .find(|o| !["ours", "ch", "mq"].contains(&o.as_str()))
        {
            fail(format!("{o}: the boots are ours, ch and mq"));
        }
        boots.retain(|b| only.iter().any(|o| o == b));
        if boots.is_empty() {
            fail("ch and mq need the baselines (BASELINE_VMM and BASELINE_VIRTIOFSD)");
        }
    }
    if let Some(log) = from_log {
        // The tables again from a finished run's log (e.g. after the
        // tables changed), without booting anything.
        let run = run_from_log(&log).unwrap_or_else(|e| fail(e));
        let (results, tables, failed) = report(&run, rounds, &boots, None);
        if let Err(e) = results.finish_bench(&tables, failed, &run) {
            fail(e);
        }
        return;
    }
    let fio = installed("fio").unwrap_or_else(|e| fail(e));
    let job_lines: String = chosen_jobs()
        .unwrap_or_else(|e| fail(e))
        .iter()
        .map(|j| {
            let set = if j.set == Set::MultiQueue {
                "mq"
            } else {
                "main"
            };
            format!("job {set} {} {}\n", j.name, j.fio_args())
        })
        .collect();
    let script = GUEST_SCRIPT
        .replace("JOB_LINES", &job_lines)
        .replace("FILE_MIB", &FILE_MIB.to_string())
        .replace("JOB_SECS", &JOB_SECS.to_string())
        .replace("JOB_LIMIT", &(JOB_SECS * 30).to_string());
    let mut guest = Guest::new("bench-fio", &script);
    let base_cmdline = guest.cmdline();
    let daxprobe = rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e));
    guest.guest_tools = vec![daxprobe];
    guest.guest_files = with_libraries(&[&fio], "bin", "").unwrap_or_else(|e| fail(e));
    guest.host_tools = vec![
        rig::tool("daemon", "dax-virtiofsd").unwrap_or_else(|e| fail(e)),
        // The host's API client for the VMM's counters.
        rig::tool("guest-tools", "daxprobe").unwrap_or_else(|e| fail(e)),
    ];
    if let Some(pair) = &baseline {
        guest
            .host_files
            .extend(host_files(pair).unwrap_or_else(|e| fail(e)));
    }
    let lines: String = (1..=rounds)
        .map(|r| boot_lines(r, &boots, window_mib))
        .collect();
    guest.host_before = format!("{SHELL_HELPERS}{HOST_SCRIPT}")
        .replace("BOOTS", &lines)
        .replace("BASE_CMDLINE", &base_cmdline)
        .replace("GUEST_MEMORY", GUEST_MEMORY)
        .replace("FILE_MIB", &FILE_MIB.to_string());
    guest.timeout = Duration::from_secs(1800 * u64::from(rounds));
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let versions = baseline
        .as_ref()
        .map(|(c, v)| format!("{}, {}", version(c), version(v)));
    let (mut results, tables, failed) = report(&run, rounds, &boots, versions);
    results.record("DAX window (ours)", format!("{window_mib} MiB"));
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// The jobs to run: all, or those `FIO_BENCH_JOBS` names.
fn chosen_jobs() -> Result<Vec<jobs::Job>, String> {
    let all = all_jobs();
    let Ok(names) = std::env::var(JOBS_ENV) else {
        return Ok(all);
    };
    let names: Vec<&str> = names.split(',').filter(|n| !n.is_empty()).collect();
    if let Some(unknown) = names.iter().find(|n| !all.iter().any(|j| j.name == **n)) {
        let known: Vec<&str> = all.iter().map(|j| j.name.as_str()).collect();
        return Err(format!(
            "{JOBS_ENV}: no job {unknown}; the jobs are {}",
            known.join(", ")
        ));
    }
    if names.is_empty() {
        return Err(format!("{JOBS_ENV} is empty: name at least one job"));
    }
    Ok(all
        .into_iter()
        .filter(|j| names.contains(&j.name.as_str()))
        .collect())
}

/// A run as the rig logged it (`[  12.345] text` lines).
fn run_from_log(path: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let lines = text
        .lines()
        .filter_map(|l| {
            let (at, text) = l.strip_prefix('[')?.split_once("] ")?;
            Some(Line {
                at: Duration::from_secs_f64(at.trim().parse().ok()?),
                text: text.to_string(),
            })
        })
        .collect();
    Ok(Run {
        name: "bench-fio".into(),
        nested: true,
        lines,
        vmm_exit: None,
        timed_out: false,
        wall: Duration::ZERO,
        log_path: path.to_path_buf(),
        host_cpus: None,
    })
}

fn report(
    run: &Run,
    rounds: u32,
    boots: &[&str],
    versions: Option<String>,
) -> (Results, String, bool) {
    let mut results = Results::new("fio-bench");
    results.record_run("fio", run);
    results.record(
        "baselines",
        versions.unwrap_or_else(|| "none: ours alone".into()),
    );
    results.record(
        "set-up",
        format!(
            "{FILE_MIB} MiB files, 4 KiB blocks, {JOB_SECS} s per job (time_based), guest caches dropped before each job, \
             {rounds} round(s); main boots {MAIN_CPUS} vCPUs ({MAIN_CPUS} request queues on ours, 1 on virtiofsd), \
             multi-queue boot {MQ_CPUS} vCPUs"
        ),
    );
    let guest_map = run.guest_values();
    let guest = |k: &str| guest_map.get(k).cloned();
    let host = |k: &str| run.host(k).map(str::to_string);
    let mut failed = run.host("fio_done").is_none();
    for r in 1..=rounds {
        for b in boots {
            let label = format!("{b}{r}");
            let exit = run.host(&format!("{label}_exit"));
            results.record(&format!("{label}: VMM exit"), exit.unwrap_or("n/a"));
            failed |= exit != Some("0");
        }
        for s in OURS.iter().chain(&CH).chain(&MQ) {
            if let Some(statx) = guest(&format!("r{r}_{}_statx", s.name)) {
                results.record(&format!("round {r}: {}: statx of f0", s.name), statx);
            }
        }
    }
    // Kernel warnings the guest saw, by the job after which they showed.
    let mut warned: Vec<(&String, &String)> = guest_map
        .iter()
        .filter(|(k, _)| k.ends_with("_kernel_warning"))
        .collect();
    warned.sort();
    for (k, v) in warned {
        results.record(k, v.clone());
    }
    let mut tables = String::new();
    let has = |b: &str| boots.contains(&b);
    if has("ours") || has("ch") {
        for huge in [false, true] {
            let (t, missing) = table::seed_table(&guest, rounds, huge, &mut results);
            failed |= missing && has("ours") && has("ch");
            let pages = if huge { "2 MiB" } else { "4 KiB" };
            let _ = writeln!(
                tables,
                "The seed's rows on {pages} host pages (MiB/s; mean of the rounds, each round in brackets):\n\n{t}"
            );
        }
        let (t, missing) = table::sync_table(&guest, rounds, &mut results);
        failed |= missing && has("ours") && has("ch");
        let _ = writeln!(tables, "What a sync after each write costs:\n\n{t}");
        let targets = table::targets(&guest, rounds);
        for (what, measured, wanted, met) in &targets {
            results.record(
                &format!("target: {what} ({wanted})"),
                format!("{measured}, met: {met:?}"),
            );
        }
        let _ = writeln!(tables, "The targets:\n\n{}", table::targets_table(&targets));
    }
    let trace = trace::dax_trace_table(&guest, &host, rounds);
    if !trace.is_empty() {
        let _ = writeln!(
            tables,
            "What our VMM did during each DAX job (counters noted before and after it):\n\n{trace}"
        );
    }
    if has("mq") {
        let (t, missing) = table::mq_table(&guest, &host, rounds, &mut results);
        failed |= missing;
        let _ = writeln!(
            tables,
            "Multi-queue: 4 KiB random reads without DAX, {MQ_CPUS} vCPUs:\n\n{t}"
        );
    }
    (results, tables, failed)
}
