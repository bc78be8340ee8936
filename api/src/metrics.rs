//! `GET /api/v1/vm.dax-metrics`: per fs device, in the Prometheus text
//! exposition format (version 0.0.4). Window counters come from the VMM,
//! file and FUSE counters from each daemon's control socket, page faults
//! from this process.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use control_protocol::DaemonStats;

/// What the VMM knows of one fs device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FsDaxStatus {
    pub id: String,
    pub control_socket: Option<PathBuf>,
    /// None before boot, or without DAX.
    pub window: Option<WindowStats>,
    /// Where the window sits in guest-physical memory (None before boot,
    /// without DAX, or before the transport placed it).
    pub window_location: Option<control_protocol::WindowLocation>,
    /// The daemon went away while the VM ran.
    pub failed: bool,
    /// The policy its daemon should have (kept with the device's
    /// configuration in the VMM); None until one is given.
    pub desired_policy: Option<serde_json::Value>,
}

/// A DAX window's counters at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WindowStats {
    pub size: u64,
    pub bytes_mapped: u64,
    /// 2 MiB guest ranges with something mapped.
    pub ranges_mapped: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub resets: u64,
    /// Bytes of new mappings whose host page tables were filled at map time.
    pub prefaulted_bytes: u64,
    /// Bytes of new mappings put into KVM's page tables at map time.
    pub guest_prefaulted_bytes: u64,
    pub prefault_failures: u64,
    /// Bytes of mappings whose file shrank on the host (scratch shown since).
    pub truncated_bytes: u64,
    /// Times the scratch went over its budget and was emptied.
    pub stray_resets: u64,
    pub failures: Vec<(String, u64)>,
    /// (upper bound in µs, None for +Inf; cumulative count).
    pub latency_buckets: Vec<(Option<u64>, u64)>,
    pub latency_sum_us: u64,
    /// Resident bytes of the window's file mappings (mincore); None if it
    /// could not be read.
    pub resident_bytes: Option<u64>,
    /// Bytes of the window's scratch that guest accesses outside any
    /// mapping touched; None if it could not be read.
    pub stray_bytes: Option<u64>,
}

/// KVM's own counters for the running VM (its binary statistics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvmCounters {
    /// vCPU exits to KVM, of any kind, summed over the vCPUs (`exits`).
    pub exits: u64,
    /// Of which the guest halted (`halt_exits`).
    pub halt_exits: u64,
    /// Guest page faults KVM handled (`pf_taken`): with nested paging, the
    /// guest's first touch of a page KVM has not mapped yet, such as a new
    /// DAX mapping's.
    pub page_faults: u64,
    /// Of which KVM resolved by mapping a page (`pf_fixed`).
    pub page_faults_fixed: u64,
    /// Guest memory KVM maps now, in pages of each size ("4k", "2m", "1g").
    pub pages: Vec<(&'static str, u64)>,
}

/// Host page faults of this (the VMM's) process since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageFaults {
    pub minor: u64,
    pub major: u64,
}

impl PageFaults {
    pub fn of_this_process() -> Self {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid rusage for the call to write.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return PageFaults::default();
        }
        PageFaults {
            minor: usage.ru_minflt as u64,
            major: usage.ru_majflt as u64,
        }
    }
}

/// Escapes a label value (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

struct Writer {
    out: String,
}

impl Writer {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let labels: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
        } else {
            let _ = writeln!(self.out, "{name}{{{}}} {value}", labels.join(","));
        }
    }

    /// One device's samples of a latency histogram family: cumulative
    /// `buckets` by upper bound in µs (None: +Inf), the sum in µs, the count.
    fn histogram(
        &mut self,
        name: &str,
        device: &str,
        buckets: &[(Option<u64>, u64)],
        sum_us: u64,
        count: u64,
    ) {
        for (le, n) in buckets {
            let le = le.map_or_else(|| "+Inf".to_string(), |us| format!("{}", us as f64 / 1e6));
            self.sample(
                &format!("{name}_bucket"),
                &[("device", device), ("le", &le)],
                n,
            );
        }
        self.sample(
            &format!("{name}_sum"),
            &[("device", device)],
            sum_us as f64 / 1e6,
        );
        self.sample(&format!("{name}_count"), &[("device", device)], count);
    }
}

/// One metric family over all devices: `get` gives a device's value, if it has one.
fn per_device(
    w: &mut Writer,
    devices: &[(&FsDaxStatus, Option<&DaemonStats>)],
    name: &str,
    kind: &str,
    help: &str,
    get: impl Fn(&FsDaxStatus, Option<&DaemonStats>) -> Option<u64>,
) {
    let values: Vec<(&str, u64)> = devices
        .iter()
        .filter_map(|(d, s)| get(d, *s).map(|v| (d.id.as_str(), v)))
        .collect();
    if values.is_empty() {
        return;
    }
    w.family(name, kind, help);
    for (id, v) in values {
        w.sample(name, &[("device", id)], v);
    }
}

/// A counter family with one sample per device and key of a daemon map.
fn labelled(
    w: &mut Writer,
    rows: &[(&FsDaxStatus, Option<&DaemonStats>)],
    (name, key): (&str, &str),
    help: &str,
    get: impl Fn(&DaemonStats) -> &BTreeMap<String, u64>,
) {
    let samples: Vec<(&str, &str, u64)> = rows
        .iter()
        .filter_map(|(d, s)| s.map(|s| (d.id.as_str(), get(s))))
        .flat_map(|(id, m)| m.iter().map(move |(k, n)| (id, k.as_str(), *n)))
        .collect();
    if samples.is_empty() {
        return;
    }
    w.family(name, "counter", help);
    for (id, k, n) in samples {
        w.sample(name, &[("device", id), (key, k)], n);
    }
}

/// The daemon's adaptive DAX policy: pressure, reclaim, its decisions.
fn render_adaptive(w: &mut Writer, rows: &[(&FsDaxStatus, Option<&DaemonStats>)]) {
    let adaptive = |f: fn(&control_protocol::AdaptiveStats) -> u64| {
        move |_: &FsDaxStatus, s: Option<&DaemonStats>| s.map(|s| f(&s.adaptive))
    };
    for (name, kind, help, get) in [
        (
            "daxvmm_dax_adaptive_pressure",
            "gauge",
            "1 while the daemon sees the window under pressure (mapped ranges at pressure_high, or the guest reclaiming)",
            (|a: &control_protocol::AdaptiveStats| u64::from(a.pressure))
                as fn(&control_protocol::AdaptiveStats) -> u64,
        ),
        (
            "daxvmm_dax_adaptive_pressure_episodes_total",
            "counter",
            "Times the window came under pressure",
            |a| a.pressure_episodes,
        ),
        (
            "daxvmm_dax_adaptive_reclaims_total",
            "counter",
            "Ranges the guest unmapped while the window was under pressure (its reclaim)",
            |a| a.reclaims,
        ),
        (
            "daxvmm_dax_adaptive_thrashing_files",
            "gauge",
            "Files kept off DAX now because their ranges kept being reclaimed",
            |a| a.thrashing_files,
        ),
    ] {
        per_device(w, rows, name, kind, help, adaptive(get));
    }
    labelled(
        w,
        rows,
        ("daxvmm_dax_adaptive_withdrawn_total", "reason"),
        "Files the adaptive policy answered without DAX where the policy's default gave it, by reason",
        |s| &s.adaptive.withdrawn,
    );
    labelled(
        w,
        rows,
        ("daxvmm_dax_adaptive_granted_total", "reason"),
        "Files given DAX back by the adaptive policy, by reason",
        |s| &s.adaptive.granted,
    );
}

fn render_kvm(w: &mut Writer, k: &KvmCounters) {
    for (name, help, value) in [
        (
            "daxvmm_kvm_exits_total",
            "vCPU exits to KVM, of any kind, over all vCPUs",
            k.exits,
        ),
        (
            "daxvmm_kvm_halt_exits_total",
            "vCPU exits because the guest halted",
            k.halt_exits,
        ),
        (
            "daxvmm_kvm_page_faults_total",
            "Guest page faults KVM handled (nested paging: first touches of unmapped guest pages, DAX ones among them)",
            k.page_faults,
        ),
        (
            "daxvmm_kvm_page_faults_fixed_total",
            "Guest page faults KVM resolved by mapping a page",
            k.page_faults_fixed,
        ),
    ] {
        w.family(name, "counter", help);
        w.sample(name, &[], value);
    }
    if !k.pages.is_empty() {
        w.family(
            "daxvmm_kvm_mapped_pages",
            "gauge",
            "Guest memory KVM maps now, in pages of each size (DAX on 2 MiB host pages shows in size=\"2m\")",
        );
        for (size, n) in &k.pages {
            w.sample("daxvmm_kvm_mapped_pages", &[("size", size)], n);
        }
    }
}

/// Renders the metrics of `devices`; `daemon_stats[i]` is what device i's
/// daemon reported (`GET /api/v1/stats`), if it could be asked.
pub fn render(
    devices: &[FsDaxStatus],
    daemon_stats: &[Option<DaemonStats>],
    faults: PageFaults,
    kvm: Option<&KvmCounters>,
) -> String {
    let mut w = Writer { out: String::new() };
    if let Some(k) = kvm {
        render_kvm(&mut w, k);
    }
    let rows: Vec<(&FsDaxStatus, Option<&DaemonStats>)> = devices
        .iter()
        .zip(
            daemon_stats
                .iter()
                .map(Option::as_ref)
                .chain(std::iter::repeat(None)),
        )
        .collect();
    let win = |f: fn(&WindowStats) -> u64| {
        move |d: &FsDaxStatus, _: Option<&DaemonStats>| d.window.as_ref().map(f)
    };
    let daemon =
        |f: fn(&DaemonStats) -> u64| move |_: &FsDaxStatus, s: Option<&DaemonStats>| s.map(f);

    w.family(
        "daxvmm_fs_up",
        "gauge",
        "1 while the fs device's daemon is connected (or the VM not booted yet)",
    );
    for d in devices {
        w.sample("daxvmm_fs_up", &[("device", &d.id)], u8::from(!d.failed));
    }
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_window_bytes",
        "gauge",
        "Size of the DAX cache window",
        win(|s| s.size),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_mapped_bytes",
        "gauge",
        "Bytes of the window backed by a file mapping now",
        win(|s| s.bytes_mapped),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_mapped_ranges",
        "gauge",
        "2 MiB guest ranges of the window with a file mapping now",
        win(|s| s.ranges_mapped),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_maps_total",
        "counter",
        "SHMEM_MAP requests served",
        win(|s| s.maps),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_unmaps_total",
        "counter",
        "SHMEM_UNMAP requests served (the guest's reclaim and inode eviction)",
        win(|s| s.unmaps),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_resets_total",
        "counter",
        "Times every mapping was dropped at once (device reset, daemon gone)",
        win(|s| s.resets),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_prefaulted_bytes_total",
        "counter",
        "Bytes of new mappings whose host page tables the VMM filled when mapping (dax_prefault, where KVM cannot pre-fault)",
        win(|s| s.prefaulted_bytes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_guest_prefaulted_bytes_total",
        "counter",
        "Bytes of new mappings the VMM put into KVM's page tables when mapping (dax_prefault): no nested page fault on the guest's first touch",
        win(|s| s.guest_prefaulted_bytes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_prefault_failures_total",
        "counter",
        "New mappings whose pre-fault failed (they fault page by page instead)",
        win(|s| s.prefault_failures),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_truncated_bytes_total",
        "counter",
        "Bytes of mappings whose file shrank on the host; the window shows zeros there since",
        win(|s| s.truncated_bytes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_dax_stray_resets_total",
        "counter",
        "Times the guest kept more than the budget in the window's scratch and it was emptied",
        win(|s| s.stray_resets),
    );
    for (name, help, get) in [
        (
            "daxvmm_dax_resident_bytes",
            "Bytes of the window's file mappings resident in host memory (mincore)",
            (|s: &WindowStats| s.resident_bytes) as fn(&WindowStats) -> Option<u64>,
        ),
        (
            "daxvmm_dax_stray_bytes",
            "Bytes of the window's scratch touched by guest accesses where nothing was mapped",
            |s: &WindowStats| s.stray_bytes,
        ),
    ] {
        let samples: Vec<(&str, u64)> = devices
            .iter()
            .filter_map(|d| d.window.as_ref().and_then(get).map(|v| (d.id.as_str(), v)))
            .collect();
        if !samples.is_empty() {
            w.family(name, "gauge", help);
            for (id, v) in samples {
                w.sample(name, &[("device", id)], v);
            }
        }
    }
    if devices.iter().any(|d| d.window.is_some()) {
        w.family(
            "daxvmm_dax_failures_total",
            "counter",
            "SHMEM_MAP/UNMAP requests refused, by reason",
        );
        for d in devices {
            for (reason, n) in d.window.iter().flat_map(|s| &s.failures) {
                w.sample(
                    "daxvmm_dax_failures_total",
                    &[("device", &d.id), ("reason", reason)],
                    n,
                );
            }
        }
        w.family(
            "daxvmm_dax_map_latency_seconds",
            "histogram",
            "Time to serve a SHMEM_MAP (checks and mmap)",
        );
        for d in devices {
            let Some(s) = &d.window else { continue };
            w.histogram(
                "daxvmm_dax_map_latency_seconds",
                &d.id,
                &s.latency_buckets,
                s.latency_sum_us,
                s.maps,
            );
        }
    }
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_file_attrs_dax_total",
        "counter",
        "Regular-file attributes the daemon answered with FUSE_ATTR_DAX",
        daemon(|s| s.file_attrs_dax),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_file_attrs_nodax_total",
        "counter",
        "Regular-file attributes the daemon answered without FUSE_ATTR_DAX",
        daemon(|s| s.file_attrs_nodax),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_fuse_reads_total",
        "counter",
        "FUSE READ requests (data copied through the queue, not DAX)",
        daemon(|s| s.fuse_reads),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_fuse_read_bytes_total",
        "counter",
        "Bytes read through FUSE READ",
        daemon(|s| s.fuse_read_bytes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_fuse_writes_total",
        "counter",
        "FUSE WRITE requests (data copied through the queue, not DAX)",
        daemon(|s| s.fuse_writes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_fuse_write_bytes_total",
        "counter",
        "Bytes written through FUSE WRITE",
        daemon(|s| s.fuse_write_bytes),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_requests_total",
        "counter",
        "FUSE requests the daemon served",
        daemon(|s| s.requests),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_setupmappings_total",
        "counter",
        "FUSE_SETUPMAPPING requests the daemon served",
        daemon(|s| s.setupmappings),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_removemappings_total",
        "counter",
        "FUSE_REMOVEMAPPING requests the daemon served",
        daemon(|s| s.removemappings),
    );
    labelled(
        &mut w,
        &rows,
        ("daxvmm_fs_cap_refusals_total", "cap"),
        "Guest requests the daemon refused because a cap was reached, by cap",
        |s| &s.cap_refusals,
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_handles",
        "gauge",
        "File and directory handles the guest holds open in the daemon",
        daemon(|s| s.handles),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_policy_generation",
        "gauge",
        "Generation of the DAX policy the daemon has in force",
        daemon(|s| s.policy_generation),
    );
    per_device(
        &mut w,
        &rows,
        "daxvmm_fs_map_alignment_bytes",
        "gauge",
        "Mapping alignment the daemon announced (window_granularity, auto resolved by the host file system)",
        daemon(|s| s.map_alignment),
    );
    render_adaptive(&mut w, &rows);
    let with_maps: Vec<(&str, &DaemonStats)> = rows
        .iter()
        .filter_map(|(d, s)| s.map(|s| (d.id.as_str(), s)))
        .filter(|(_, s)| !s.map_latency_buckets.is_empty())
        .collect();
    if !with_maps.is_empty() {
        let name = "daxvmm_fs_map_roundtrip_seconds";
        w.family(
            name,
            "histogram",
            "SETUPMAPPING as the daemon sees it: SHMEM_MAP sent, the VMM's checks, mmap and pre-fault, ack received",
        );
        for (id, s) in with_maps {
            let count = s.map_latency_buckets.last().map_or(0, |b| b.1);
            w.histogram(
                name,
                id,
                &s.map_latency_buckets,
                s.map_latency_sum_us,
                count,
            );
        }
    }

    w.family(
        "daxvmm_process_page_faults_total",
        "counter",
        "Page faults taken by the VMM process (guest accesses to the window fault here)",
    );
    w.sample(
        "daxvmm_process_page_faults_total",
        &[("kind", "minor")],
        faults.minor,
    );
    w.sample(
        "daxvmm_process_page_faults_total",
        &[("kind", "major")],
        faults.major,
    );
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str) -> FsDaxStatus {
        FsDaxStatus {
            id: id.into(),
            control_socket: None,
            window: Some(WindowStats {
                size: 32 << 20,
                bytes_mapped: 4 << 20,
                ranges_mapped: 2,
                maps: 3,
                unmaps: 1,
                resets: 0,
                prefaulted_bytes: 3 << 20,
                guest_prefaulted_bytes: 2 << 20,
                prefault_failures: 1,
                truncated_bytes: 3 << 20,
                stray_resets: 2,
                failures: vec![("misaligned".into(), 1), ("bad_fd".into(), 0)],
                latency_buckets: vec![(Some(10), 1), (Some(100), 3), (None, 3)],
                latency_sum_us: 150,
                resident_bytes: Some(8192),
                stray_bytes: Some(4096),
            }),
            window_location: None,
            failed: false,
            desired_policy: None,
        }
    }

    #[test]
    fn renders_families_once_with_device_labels() {
        let stats = DaemonStats {
            file_attrs_dax: 5,
            file_attrs_nodax: 7,
            fuse_reads: 2,
            requests: 40,
            handles: 3,
            cap_refusals: [("inodes".to_string(), 4), ("handles".to_string(), 0)].into(),
            map_alignment: 2 << 20,
            map_latency_buckets: vec![(Some(100), 2), (None, 3)],
            map_latency_sum_us: 500,
            adaptive: control_protocol::AdaptiveStats {
                pressure: true,
                reclaims: 9,
                withdrawn: [("thrashing".to_string(), 2)].into(),
                ..Default::default()
            },
            ..Default::default()
        };
        let text = render(
            &[device("fs0"), device("fs\"1")],
            &[Some(stats), None],
            PageFaults {
                minor: 10,
                major: 1,
            },
            Some(&KvmCounters {
                exits: 1000,
                halt_exits: 10,
                page_faults: 600,
                page_faults_fixed: 512,
                pages: vec![("4k", 300), ("2m", 4), ("1g", 0)],
            }),
        );
        assert_eq!(
            text.matches("# TYPE daxvmm_dax_maps_total counter").count(),
            1
        );
        assert!(text.contains("daxvmm_dax_maps_total{device=\"fs0\"} 3\n"));
        assert!(
            text.contains("daxvmm_dax_mapped_ranges{device=\"fs\\\"1\"} 2\n"),
            "label escaped"
        );
        assert!(
            text.contains("daxvmm_dax_failures_total{device=\"fs0\",reason=\"misaligned\"} 1\n")
        );
        assert!(text
            .contains("daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"0.00001\"} 1\n"));
        assert!(
            text.contains("daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"+Inf\"} 3\n")
        );
        assert!(text.contains("daxvmm_dax_map_latency_seconds_sum{device=\"fs0\"} 0.00015\n"));
        assert!(text.contains("daxvmm_fs_file_attrs_dax_total{device=\"fs0\"} 5\n"));
        assert!(
            !text.contains("daxvmm_fs_file_attrs_dax_total{device=\"fs\\\"1\"}"),
            "no daemon stats, no sample"
        );
        assert!(text.contains("daxvmm_process_page_faults_total{kind=\"major\"} 1\n"));
        assert!(text.contains("daxvmm_dax_resident_bytes{device=\"fs0\"} 8192\n"));
        assert!(text.contains("daxvmm_dax_stray_bytes{device=\"fs0\"} 4096\n"));
        assert_eq!(
            text.matches("# TYPE daxvmm_dax_stray_bytes gauge").count(),
            1
        );
        assert!(text.contains("daxvmm_fs_cap_refusals_total{device=\"fs0\",cap=\"inodes\"} 4\n"));
        assert!(text.contains("daxvmm_fs_handles{device=\"fs0\"} 3\n"));
        assert!(text.contains("daxvmm_fs_map_alignment_bytes{device=\"fs0\"} 2097152\n"));
        assert!(text.contains("daxvmm_dax_adaptive_pressure{device=\"fs0\"} 1\n"));
        assert!(text
            .contains("daxvmm_fs_map_roundtrip_seconds_bucket{device=\"fs0\",le=\"0.0001\"} 2\n"));
        assert!(text.contains("daxvmm_fs_map_roundtrip_seconds_count{device=\"fs0\"} 3\n"));
        assert!(text.contains("daxvmm_dax_adaptive_reclaims_total{device=\"fs0\"} 9\n"));
        assert!(text.contains(
            "daxvmm_dax_adaptive_withdrawn_total{device=\"fs0\",reason=\"thrashing\"} 2\n"
        ));
        assert!(text.contains("daxvmm_dax_prefaulted_bytes_total{device=\"fs0\"} 3145728\n"));
        assert!(text.contains("daxvmm_dax_prefault_failures_total{device=\"fs0\"} 1\n"));
        assert!(text.contains("daxvmm_dax_truncated_bytes_total{device=\"fs0\"} 3145728\n"));
        assert!(text.contains("daxvmm_dax_stray_resets_total{device=\"fs0\"} 2\n"));
        assert!(text.contains("daxvmm_dax_guest_prefaulted_bytes_total{device=\"fs0\"} 2097152\n"));
        assert!(
            text.contains("# TYPE daxvmm_kvm_exits_total counter\ndaxvmm_kvm_exits_total 1000\n")
        );
        assert!(text.contains("daxvmm_kvm_page_faults_total 600\n"));
        assert!(text.contains("daxvmm_kvm_mapped_pages{size=\"2m\"} 4\n"));
    }

    /// The whole text for a fixed snapshot, byte for byte: two devices (one
    /// with daemon stats, one without), KVM's counters, page faults. Pinned
    /// from the renderer as it was before it became table-driven.
    #[test]
    fn the_text_for_a_fixed_snapshot_is_pinned() {
        let stats = DaemonStats {
            file_attrs_dax: 5,
            file_attrs_nodax: 7,
            fuse_reads: 2,
            fuse_read_bytes: 8192,
            fuse_writes: 1,
            fuse_write_bytes: 4096,
            requests: 40,
            setupmappings: 6,
            removemappings: 2,
            handles: 3,
            policy_generation: 4,
            cap_refusals: [("inodes".to_string(), 4), ("handles".to_string(), 0)].into(),
            map_alignment: 2 << 20,
            map_latency_buckets: vec![(Some(100), 2), (Some(2500), 3), (None, 3)],
            map_latency_sum_us: 500,
            adaptive: control_protocol::AdaptiveStats {
                pressure: true,
                pressure_episodes: 2,
                reclaims: 9,
                thrashing_files: 1,
                withdrawn: [("thrashing".to_string(), 2)].into(),
                granted: [("reread".to_string(), 1)].into(),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut failed = device("fs\"1");
        failed.failed = true;
        let text = render(
            &[device("fs0"), failed],
            &[Some(stats), None],
            PageFaults {
                minor: 10,
                major: 1,
            },
            Some(&KvmCounters {
                exits: 1000,
                halt_exits: 10,
                page_faults: 600,
                page_faults_fixed: 512,
                pages: vec![("4k", 300), ("2m", 4), ("1g", 0)],
            }),
        );
        assert_eq!(text, include_str!("metrics_pinned.prom"));
        let none = render(&[], &[], PageFaults::default(), None);
        assert_eq!(none, include_str!("metrics_pinned_empty.prom"));
        // A window with no failure reasons and no latency buckets, a daemon
        // with empty maps and no round-trip histogram: which headers stay.
        let sparse = FsDaxStatus {
            id: "fs0".into(),
            window: Some(WindowStats::default()),
            ..Default::default()
        };
        let text = render(
            &[sparse],
            &[Some(DaemonStats::default())],
            PageFaults::default(),
            None,
        );
        assert_eq!(text, include_str!("metrics_pinned_sparse.prom"));
    }

    #[test]
    fn a_device_before_boot_has_only_its_up_gauge() {
        let d = FsDaxStatus {
            id: "fs0".into(),
            ..Default::default()
        };
        let text = render(&[d], &[], PageFaults::default(), None);
        assert!(text.contains("daxvmm_fs_up{device=\"fs0\"} 1\n"));
        assert!(!text.contains("daxvmm_kvm_"), "no VM, no KVM counters");
        assert!(!text.contains("daxvmm_dax_maps_total"));
        assert!(!text.contains("daxvmm_dax_map_latency_seconds"));
    }
}
