//! virtio-blk and virtio-net throughput, ours beside Cloud Hypervisor's, in
//! one rig run (a benchmark, not a test): `scripts/bench.sh devices`, with
//! `BASELINE_VMM=/path/to/cloud-hypervisor` for the comparison.
//!
//! One emulated host boots the same guest (kernel, initramfs, 1 vCPU,
//! 1 GiB, one raw disk, one net device on a tap the VMM creates) four
//! times: ours, Cloud Hypervisor, Cloud Hypervisor, ours — or ours twice
//! without a baseline — so drift over the emulated host's life shows
//! rather than passing for a difference between the VMMs. Both VMMs get
//! the same command line (`--disk path=…` with the defaults of both:
//! `direct=off`, one queue of 128; `--net tap=…,ip=,mask=,mac=`: one queue
//! pair of 256, offloads on), both on virtio-PCI.
//!
//! In each boot the guest runs four `fio` jobs (libaio, `O_DIRECT`) on the
//! whole disk — sequential 1 MiB read and write at queue depth 8, random
//! 4 KiB read and write at queue depth 32 — each capped by size and time,
//! and before each asks the emulated host over the tap to drop its page
//! cache (cold). The disk image sits on ext4 on a RAM disk (`brd`) in the
//! emulated host: an ordinary file system with a page cache, which a
//! tmpfs (all Shmem, never dropped) would not be. Then `iperf3` moves TCP
//! data guest → host and host → guest for a few seconds each. At each of
//! these steps the host also notes the VMM's CPU time, so each job's cost
//! in VMM CPU shows beside its throughput, and at the end each VMM
//! thread's.
//!
//! `fio` and `iperf3` are Debian's, copied with their shared libraries;
//! so is Cloud Hypervisor's binary. Writes
//! `target/rig-results/devices-bench.md`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use test_infra::fio::{parse_fio_terse, FioResult};
use test_infra::kernel::GuestKernel;
use test_infra::packaged::{installed, with_libraries};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile, Run};

/// The Cloud Hypervisor binary to compare with (unset: ours alone).
const BASELINE_ENV: &str = "BASELINE_VMM";
const DISK_MIB: u32 = 256;
/// Each fio job stops after this many seconds if it has not covered the disk.
const JOB_SECS: u32 = 6;
const NET_SECS: u32 = 5;
/// Each block job runs this many times per boot (interleaved, each cold):
/// a sequential job covers the disk in a second or two.
const REPEATS: u32 = 2;
const GUEST_MEMORY: &str = "1024M";
const HOST_IP: &str = "192.168.249.1";
const MAC: &str = "52:54:00:12:34:56";

/// The block jobs: name, what the docs call it, fio's arguments.
const JOBS: [(&str, &str, &str); 4] = [
    (
        "seq1m_read",
        "seq 1 MiB read, QD8",
        "--rw=read --bs=1M --iodepth=8",
    ),
    (
        "seq1m_write",
        "seq 1 MiB write, QD8",
        "--rw=write --bs=1M --iodepth=8",
    ),
    (
        "rand4k_read",
        "rand 4 KiB read, QD32",
        "--rw=randread --bs=4k --iodepth=32",
    ),
    (
        "rand4k_write",
        "rand 4 KiB write, QD32",
        "--rw=randwrite --bs=4k --iodepth=32",
    ),
];
/// The net transfers: name, what the docs call it, iperf3's arguments.
const NETS: [(&str, &str, &str); 2] = [
    ("net_g2h", "TCP guest → host", ""),
    ("net_h2g", "TCP host → guest", "-R"),
];

const GUEST_SCRIPT: &str = r#"
HOST=HOST_IP
i=0; while { [ ! -e /sys/class/net/eth0 ] || [ ! -e /dev/vda ]; } && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
ip addr add 192.168.249.2/24 dev eth0 && ip link set eth0 up
i=0; while ! ping -c 1 -W 1 $HOST >/dev/null 2>&1 && [ $i -lt 60 ]; do i=$((i+1)); done
echo "@@GUEST features=blk:$(cat /sys/block/vda/device/features) net:$(cat /sys/class/net/eth0/device/features)"
# The host drops its page cache and notes the VMM's CPU time, then answers.
step() { echo "@@GUEST $1_sync=$(echo "$1" | nc $HOST 7000)"; }
job() {
    name=$1; shift; step $name
    echo "@@GUEST $name=$(fio --name=$name --filename=/dev/vda --direct=1 --ioengine=libaio --size=DISK_MIBM --runtime=JOB_SECS --minimal "$@" 2>&1 | tail -1)"
}
JOB_LINES
net() {
    name=$1; shift; step $name
    echo "@@GUEST $name=$(iperf3 -c $HOST -t NET_SECS -f k "$@" 2>&1 | awk '/receiver/ {for (i = 1; i <= NF; i++) if ($i == "Kbits/sec") print $(i-1)}')"
}
NET_LINES
step end
"#;

/// The emulated host: the RAM-disk file system and the image, the
/// libraries of the copied tools, the iperf3 server, the step server, and
/// the boots.
const HOST_SCRIPT: &str = r#"
cp -a sysroot/. /
insmod brd.ko rd_nr=1 rd_size=BRD_KIB || echo "@@HOST error=brd"
# busybox's mke2fs (the emulated host has no other) makes ext2.
mkdir -p disk && mke2fs -F /dev/ram0 >/dev/null && mount -t ext2 /dev/ram0 disk || echo "@@HOST error=disk_fs"
# Zeroes written out, so every block is allocated (reads hit real blocks, not holes).
dd if=/dev/zero of=disk/disk.img bs=1M count=DISK_MIB 2>/dev/null; sync
echo "@@HOST disk=$(grep ' /work/disk ' /proc/mounts | cut -d' ' -f1-3) kib=$(du -k disk/disk.img | cut -f1)"
# The emulated host's RAM is touched once before the first boot: its first
# touch costs the real host page faults, which would otherwise slow
# whichever boot came first.
mkdir -p /tmp/touch && mount -t tmpfs -o size=100% tmpfs /tmp/touch
dd if=/dev/zero of=/tmp/touch/f bs=1M count=$(( $(awk '$1 == "MemAvailable:" {print $2}' /proc/meminfo) / 1024 - 256 )) 2>/dev/null
rm /tmp/touch/f; umount /tmp/touch
echo "@@HOST touched memavailable_kib=$(awk '$1 == "MemAvailable:" {print $2}' /proc/meminfo)"
iperf3 -s >/dev/null 2>&1 &
cat > step.sh <<'EOF'
#!/bin/sh
read step
sync; echo 3 > /proc/sys/vm/drop_caches
label=$(cat label); pid=$(cat vmm.pid)
echo "@@HOST ${label}_${step}_ticks=$(cut -d')' -f2 /proc/$pid/stat | awk '{print $12 + $13}') cached_kib=$(awk '$1 == "Cached:" {print $2}' /proc/meminfo)" >&2
if [ "$step" = end ]; then
    echo "@@HOST ${label}_threads=$(for t in /proc/$pid/task/*; do printf '%s:%s ' "$(tr ' ' _ < $t/comm)" "$(cut -d')' -f2 $t/stat | awk '{print $12 + $13}')"; done)" >&2
fi
echo ok
EOF
chmod +x step.sh
nc -ll -p 7000 -e /work/step.sh &
boot() {
    label=$1; bin=$2; shift 2
    echo $label > label
    echo "@@HOST ${label}_start"
    "$bin" --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "BASE_CMDLINE" \
        --cpus boot=1 --memory size=GUEST_MEMORY --serial tty --console off \
        --disk path=/work/disk/disk.img,image_type=raw \
        --net tap=dtap0,ip=HOST_IP,mask=255.255.255.0,mac=MAC </dev/null >$label.out 2>&1 &
    echo $! > vmm.pid
    wait $!
    echo "@@HOST ${label}_exit=$?"
    grep -a '@@GUEST' $label.out | sed "s/@@GUEST /@@GUEST ${label}_/"
    grep -a -i 'dax-vmm: \|error' $label.out | tail -3 | sed "s/^/@@HOST ${label}_said=/"
}
BOOTS
echo "@@HOST devices_done"
# The rig's own VMM run is not used: the boots above started their own.
exit 0
"#;

fn fail(e: String) -> ! {
    eprintln!("bench-devices: {e}");
    std::process::exit(1)
}

fn main() {
    let baseline = std::env::var_os(BASELINE_ENV).map(PathBuf::from);
    let boots: Vec<&str> = if baseline.is_some() {
        vec!["ours1", "ch1", "ch2", "ours2"]
    } else {
        vec!["ours1", "ours2"]
    };
    let tool = |name| installed(name).unwrap_or_else(|e| fail(e.to_string()));
    let (fio, iperf3) = (tool("fio"), tool("iperf3"));
    let job_lines: String = (1..=REPEATS)
        .flat_map(|r| {
            JOBS.iter()
                .map(move |(name, _, args)| format!("job {name}_{r} {args}\n"))
        })
        .collect();
    let net_lines: String = NETS
        .iter()
        .map(|(name, _, args)| format!("net {name} {args}\n"))
        .collect();
    let script = GUEST_SCRIPT
        .replace("JOB_LINES", &job_lines)
        .replace("NET_LINES", &net_lines)
        .replace("HOST_IP", HOST_IP)
        .replace("DISK_MIB", &DISK_MIB.to_string())
        .replace("JOB_SECS", &JOB_SECS.to_string())
        .replace("NET_SECS", &NET_SECS.to_string());
    let mut guest = Guest::new("bench-devices", &script);
    let base_cmdline = guest.cmdline();
    guest.memory = GUEST_MEMORY.into();
    guest.guest_modules = vec!["virtio_blk".into(), "virtio_net".into()];
    guest.host_modules = vec!["tun".into()];
    guest.guest_files =
        with_libraries(&[&fio, &iperf3], "bin", "").unwrap_or_else(|e| fail(e.to_string()));
    let mut host_bins = vec![iperf3.as_path()];
    if let Some(ch) = &baseline {
        host_bins.push(ch);
    }
    // In $WORK/sysroot, copied onto the emulated host's root before use.
    guest.host_files = with_libraries(&host_bins, "sysroot/bin", "sysroot/")
        .unwrap_or_else(|e| fail(e.to_string()));
    let kernel = GuestKernel::fetch().unwrap_or_else(|e| fail(e.to_string()));
    for (name, data) in kernel
        .modules_with_deps(&["brd"])
        .unwrap_or_else(|e| fail(e.to_string()))
    {
        guest.host_files.push(ImageFile {
            path: format!("{name}.ko"),
            perm: 0o644,
            data,
        });
    }
    let boot_lines: String = boots
        .iter()
        .map(|b| {
            if b.starts_with("ch") {
                format!("boot {b} /bin/cloud-hypervisor\n")
            } else {
                format!("boot {b} \"$VMM\"\n")
            }
        })
        .collect();
    // The image, its ext4 metadata and room to spare.
    let brd_kib = (DISK_MIB + 64) * 1024;
    guest.host_before = HOST_SCRIPT
        .replace("BOOTS", &boot_lines)
        .replace("BASE_CMDLINE", &base_cmdline)
        .replace("BRD_KIB", &brd_kib.to_string())
        .replace("DISK_MIB", &DISK_MIB.to_string())
        .replace("GUEST_MEMORY", GUEST_MEMORY)
        .replace("HOST_IP", HOST_IP)
        .replace("MAC", MAC);
    guest.timeout = std::time::Duration::from_secs(2400);
    let run = rig::run_to_end(&guest).unwrap_or_else(|e| fail(e));
    let ch_version = baseline.as_deref().map(version).unwrap_or_default();
    let (results, tables, failed) = report(&run, &boots, &ch_version);
    if let Err(e) = results.finish_bench(&tables, failed, &run) {
        fail(e);
    }
}

/// `cloud-hypervisor --version`'s line, for the results.
fn version(bin: &Path) -> String {
    Command::new(bin)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|e| format!("({}: {e})", bin.display()))
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Ours over Cloud Hypervisor's, each the mean of its boots.
fn ratio(ours: &[f64], theirs: &[f64]) -> Option<f64> {
    let (o, t) = (mean(ours)?, mean(theirs)?);
    (t > 0.0).then_some(o / t)
}

/// The VMM's CPU time (clock ticks) per step of one boot, from the host's
/// notes at each step: the time from a step to the next.
fn step_ticks(run: &Run, label: &str, steps: &[&str]) -> HashMap<String, u64> {
    let at = |s: &str| -> Option<u64> {
        run.host(&format!("{label}_{s}_ticks"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    steps
        .windows(2)
        .filter_map(|w| Some((w[0].to_string(), at(w[1])?.checked_sub(at(w[0])?)?)))
        .collect()
}

fn report(run: &Run, boots: &[&str], ch_version: &str) -> (Results, String, bool) {
    let mut results = Results::new("devices-bench");
    results.record_run("devices", run);
    if !ch_version.is_empty() {
        results.record("baseline", ch_version);
    }
    let mut failed = run.host("devices_done").is_none();
    let mut steps: Vec<String> = (1..=REPEATS)
        .flat_map(|r| JOBS.iter().map(move |j| format!("{}_{r}", j.0)))
        .collect();
    steps.extend(NETS.iter().map(|n| n.0.to_string()));
    steps.push("end".into());
    let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
    let mut header = String::from("| workload |");
    let mut rule = String::from("|---|");
    for b in boots {
        let _ = write!(header, " {b} |");
        rule.push_str("---|");
    }
    let compare = boots.iter().any(|b| b.starts_with("ch"));
    if compare {
        header.push_str(" ours / CH |");
        rule.push_str("---|");
    }
    let mut tables = format!("{header}\n{rule}\n");
    let mut cpu = format!(
        "VMM CPU time per workload (ms, all repeats; clock ticks of 10 ms)\n\n{header}\n{rule}\n"
    );
    let ticks: Vec<HashMap<String, u64>> =
        boots.iter().map(|b| step_ticks(run, b, &steps)).collect();
    let mut row = |name: &str, what: &str, values: Vec<Option<(f64, String)>>| {
        let _ = write!(tables, "| {what} |");
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for (b, v) in boots.iter().zip(&values) {
            match v {
                Some((x, shown)) => {
                    let _ = write!(tables, " {shown} |");
                    results.record(&format!("{b}: {what}"), shown.clone());
                    let side = if b.starts_with("ch") {
                        &mut theirs
                    } else {
                        &mut ours
                    };
                    side.push(*x);
                }
                None => {
                    failed = true;
                    tables.push_str(" n/a |");
                }
            }
        }
        if compare {
            let r = ratio(&ours, &theirs).map_or("n/a".into(), |r| format!("{r:.2}x"));
            results.record(&format!("ours / CH: {what}"), r.clone());
            let _ = write!(tables, " {r} |");
        }
        tables.push('\n');
        let _ = write!(cpu, "| {what} |");
        for t in &ticks {
            // A block job's repeats, summed.
            let sum: Option<u64> = if NETS.iter().any(|n| n.0 == name) {
                t.get(name).copied()
            } else {
                (1..=REPEATS)
                    .map(|r| t.get(&format!("{name}_{r}")).copied())
                    .sum()
            };
            let _ = write!(
                cpu,
                " {} |",
                sum.map_or("n/a".into(), |t| (t * 10).to_string())
            );
        }
        if compare {
            cpu.push_str(" |");
        }
        cpu.push('\n');
    };
    for (name, what, args) in JOBS {
        let values = boots
            .iter()
            .map(|b| {
                let each: Vec<FioResult> = (1..=REPEATS)
                    .map(|r| {
                        let line = run.guest(&format!("{b}_{name}_{r}"))?;
                        parse_fio_terse(line, args.contains("write"))
                    })
                    .collect::<Option<_>>()?;
                let bw: Vec<f64> = each.iter().map(|r| r.kib_per_s / 1024.0).collect();
                let iops: Vec<f64> = each.iter().map(|r| r.iops).collect();
                let (bw_mean, iops_mean) = (mean(&bw)?, mean(&iops)?);
                let runs: Vec<String> = bw.iter().map(|b| format!("{b:.1}")).collect();
                Some((
                    bw_mean,
                    format!(
                        "{bw_mean:.1} MiB/s, {iops_mean:.0} IOPS ({})",
                        runs.join(" / ")
                    ),
                ))
            })
            .collect();
        row(name, what, values);
    }
    for (name, what, _) in NETS {
        let values = boots
            .iter()
            .map(|b| {
                let kbit: f64 = run.guest(&format!("{b}_{name}"))?.trim().parse().ok()?;
                Some((kbit, format!("{:.0} Mbit/s", kbit / 1000.0)))
            })
            .collect();
        row(name, what, values);
    }
    let _ = writeln!(tables, "\n{cpu}");
    tables.push_str("VMM threads at the end of each boot (name:CPU ticks)\n\n");
    for b in boots {
        let threads = run.host(&format!("{b}_threads")).unwrap_or("n/a");
        let _ = writeln!(tables, "- {b}: {threads}");
        let features = run.guest(&format!("{b}_features")).unwrap_or("n/a");
        results.record(&format!("{b}: negotiated features"), features);
        if run.host(&format!("{b}_exit")) != Some("0") {
            failed = true;
        }
    }
    (results, tables, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_of_the_means_and_needs_both_sides() {
        assert_eq!(ratio(&[90.0, 110.0], &[50.0, 150.0]), Some(1.0));
        assert_eq!(ratio(&[100.0], &[]), None);
        assert_eq!(ratio(&[], &[100.0]), None);
        assert_eq!(ratio(&[100.0], &[0.0]), None);
    }
}
