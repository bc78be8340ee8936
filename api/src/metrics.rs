//! `GET /api/v1/vm.dax-metrics`: per fs device, in the Prometheus text
//! exposition format (version 0.0.4). Window counters come from the VMM,
//! file and FUSE counters from each daemon's control socket, page faults
//! from this process; they meet in one [`MetricsSnapshot`], and [`render`]
//! writes it through one table of families ([`FAMILIES`]), in its order.

use std::fmt::Write as _;

use control_protocol::{AdaptiveStats, DaemonStats, WindowCounters};

/// A DAX window at one moment: its counters as the window keeps them, and
/// what the VMM reads off the window itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WindowStats {
    pub size: u64,
    /// 2 MiB guest ranges with something mapped.
    pub ranges_mapped: u64,
    /// Times the scratch went over its budget and was emptied.
    pub stray_resets: u64,
    /// Mapped files followed now without an inotify watch (the VMM's
    /// watch budget was spent): their size is read every second instead.
    pub unwatched_files: u64,
    /// Files refused a watch by that budget since the window was made.
    pub watch_refusals: u64,
    /// Resident bytes of the window's file mappings (mincore); None if it
    /// could not be read.
    pub resident_bytes: Option<u64>,
    /// Bytes of the window's scratch that guest accesses outside any
    /// mapping touched; None if it could not be read.
    pub stray_bytes: Option<u64>,
    pub counters: WindowCounters,
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
        // Counts of faults since the process started: never negative.
        PageFaults {
            minor: u64::try_from(usage.ru_minflt).unwrap_or(0),
            major: u64::try_from(usage.ru_majflt).unwrap_or(0),
        }
    }
}

/// One fs device in a [`MetricsSnapshot`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceMetrics {
    pub id: String,
    /// False once the device's daemon went away while the VM ran.
    pub up: bool,
    /// None before boot, or without DAX.
    pub window: Option<WindowStats>,
    /// What the daemon reported (`GET /api/v1/stats`), if it could be asked.
    pub daemon: Option<DaemonStats>,
}

/// Everything one metrics text is rendered from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// None without a running VM (or without KVM's statistics).
    pub kvm: Option<KvmCounters>,
    pub devices: Vec<DeviceMetrics>,
    pub faults: PageFaults,
}

/// A histogram's samples for one device: cumulative `buckets` by upper
/// bound in µs (None: +Inf), the sum in µs, the count.
pub struct Histogram<'a> {
    buckets: &'a [(Option<u64>, u64)],
    sum_us: u64,
    count: u64,
}

/// Label values and their samples.
pub type Entries<'a> = Vec<(&'a str, u64)>;

/// Where a family's samples come from.
pub enum Samples {
    /// One unlabelled sample for the VM, if there is one.
    Vm(fn(&MetricsSnapshot) -> Option<u64>),
    /// Samples for the VM labelled `key`, if there are any.
    VmLabelled(
        &'static str,
        fn(&MetricsSnapshot) -> Option<Entries<'static>>,
    ),
    /// One sample per device that has the value.
    Device(fn(&DeviceMetrics) -> Option<u64>),
    /// Per device that has the source, one sample per entry, labelled `key`.
    DeviceLabelled(&'static str, fn(&DeviceMetrics) -> Option<Entries<'_>>),
    /// As `DeviceLabelled`, the values in µs, written in seconds (the
    /// base unit Prometheus names take).
    DeviceLabelledMicros(&'static str, fn(&DeviceMetrics) -> Option<Entries<'_>>),
    /// Per device that has the source, a latency histogram.
    DeviceHistogram(fn(&DeviceMetrics) -> Option<Histogram<'_>>),
}

/// When a family's `# HELP`/`# TYPE` header is written.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    Always,
    /// When some device (or the VM) has the source, even with no samples.
    WithSource,
    WithSamples,
}

/// One metric family: its name, type, help text, samples, and when it is shown.
pub struct Family {
    pub name: &'static str,
    pub kind: &'static str,
    pub help: &'static str,
    pub samples: Samples,
    pub shown: Shown,
}

const fn family(
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Samples,
) -> Family {
    Family {
        name,
        kind,
        help,
        samples,
        shown: Shown::WithSamples,
    }
}

fn kvm(s: &MetricsSnapshot) -> Option<&KvmCounters> {
    s.kvm.as_ref()
}

fn window(d: &DeviceMetrics) -> Option<&WindowStats> {
    d.window.as_ref()
}

fn counters(d: &DeviceMetrics) -> Option<&WindowCounters> {
    d.window.as_ref().map(|w| &w.counters)
}

fn daemon(d: &DeviceMetrics) -> Option<&DaemonStats> {
    d.daemon.as_ref()
}

fn adaptive(d: &DeviceMetrics) -> Option<&AdaptiveStats> {
    d.daemon.as_ref().map(|s| &s.adaptive)
}

/// One sample per stage of a map's trace: `value` of each.
fn stage_entries(
    stages: &[control_protocol::StageTotal],
    value: fn(&control_protocol::StageTotal) -> u64,
) -> Entries<'_> {
    stages
        .iter()
        .map(|s| (s.stage.as_str(), value(s)))
        .collect()
}

fn entries(m: &std::collections::BTreeMap<String, u64>) -> Entries<'_> {
    m.iter().map(|(k, n)| (k.as_str(), *n)).collect()
}

/// Every family, in the order the text has them.
pub const FAMILIES: &[Family] = &[
    family(
        "daxvmm_kvm_exits_total",
        "counter",
        "vCPU exits to KVM, of any kind, over all vCPUs",
        Samples::Vm(|s| kvm(s).map(|k| k.exits)),
    ),
    family(
        "daxvmm_kvm_halt_exits_total",
        "counter",
        "vCPU exits because the guest halted",
        Samples::Vm(|s| kvm(s).map(|k| k.halt_exits)),
    ),
    family(
        "daxvmm_kvm_page_faults_total",
        "counter",
        "Guest page faults KVM handled (nested paging: first touches of unmapped guest pages, DAX ones among them)",
        Samples::Vm(|s| kvm(s).map(|k| k.page_faults)),
    ),
    family(
        "daxvmm_kvm_page_faults_fixed_total",
        "counter",
        "Guest page faults KVM resolved by mapping a page",
        Samples::Vm(|s| kvm(s).map(|k| k.page_faults_fixed)),
    ),
    family(
        "daxvmm_kvm_mapped_pages",
        "gauge",
        "Guest memory KVM maps now, in pages of each size (DAX on 2 MiB host pages shows in size=\"2m\")",
        Samples::VmLabelled("size", |s| kvm(s).map(|k| k.pages.clone())),
    ),
    Family {
        shown: Shown::Always,
        ..family(
            "daxvmm_fs_up",
            "gauge",
            "1 while the fs device's daemon is connected (or the VM not booted yet)",
            Samples::Device(|d| Some(u64::from(d.up))),
        )
    },
    family(
        "daxvmm_dax_window_bytes",
        "gauge",
        "Size of the DAX cache window",
        Samples::Device(|d| window(d).map(|w| w.size)),
    ),
    family(
        "daxvmm_dax_mapped_bytes",
        "gauge",
        "Bytes of the window backed by a file mapping now",
        Samples::Device(|d| counters(d).map(|c| c.bytes_mapped)),
    ),
    family(
        "daxvmm_dax_mapped_ranges",
        "gauge",
        "2 MiB guest ranges of the window with a file mapping now",
        Samples::Device(|d| window(d).map(|w| w.ranges_mapped)),
    ),
    family(
        "daxvmm_dax_maps_total",
        "counter",
        "SHMEM_MAP requests served",
        Samples::Device(|d| counters(d).map(|c| c.maps)),
    ),
    family(
        "daxvmm_dax_unmaps_total",
        "counter",
        "SHMEM_UNMAP requests served (the guest's reclaim and inode eviction)",
        Samples::Device(|d| counters(d).map(|c| c.unmaps)),
    ),
    family(
        "daxvmm_dax_resets_total",
        "counter",
        "Times every mapping was dropped at once (device reset, daemon gone)",
        Samples::Device(|d| counters(d).map(|c| c.resets)),
    ),
    family(
        "daxvmm_dax_prefaulted_bytes_total",
        "counter",
        "Bytes of new mappings whose host page tables the VMM filled when mapping (dax_prefault, where KVM cannot pre-fault)",
        Samples::Device(|d| counters(d).map(|c| c.prefaulted_bytes)),
    ),
    family(
        "daxvmm_dax_guest_prefaulted_bytes_total",
        "counter",
        "Bytes of new mappings the VMM put into KVM's page tables when mapping (dax_prefault): no nested page fault on the guest's first touch",
        Samples::Device(|d| counters(d).map(|c| c.guest_prefaulted_bytes)),
    ),
    family(
        "daxvmm_dax_prefault_failures_total",
        "counter",
        "New mappings whose pre-fault failed (they fault page by page instead)",
        Samples::Device(|d| counters(d).map(|c| c.prefault_failures)),
    ),
    family(
        "daxvmm_dax_truncated_bytes_total",
        "counter",
        "Bytes of mappings whose file shrank on the host; the window shows zeros there since",
        Samples::Device(|d| counters(d).map(|c| c.truncated_bytes)),
    ),
    family(
        "daxvmm_dax_restored_ranges_total",
        "counter",
        "2 MiB ranges of the window mapped again from the saved record at a restore or an incoming migration, before a vCPU ran",
        Samples::Device(|d| counters(d).map(|c| c.restored_ranges)),
    ),
    family(
        "daxvmm_dax_stray_resets_total",
        "counter",
        "Times the guest kept more than the budget in the window's scratch and it was emptied",
        Samples::Device(|d| window(d).map(|w| w.stray_resets)),
    ),
    family(
        "daxvmm_dax_unwatched_files",
        "gauge",
        "Mapped files without an inotify watch (the VMM's watch budget is spent); their size is read every second instead",
        Samples::Device(|d| window(d).map(|w| w.unwatched_files)),
    ),
    family(
        "daxvmm_dax_watch_refusals_total",
        "counter",
        "Mapped files refused an inotify watch by the VMM's watch budget",
        Samples::Device(|d| window(d).map(|w| w.watch_refusals)),
    ),
    family(
        "daxvmm_dax_resident_bytes",
        "gauge",
        "Bytes of the window's file mappings resident in host memory (mincore)",
        Samples::Device(|d| window(d).and_then(|w| w.resident_bytes)),
    ),
    family(
        "daxvmm_dax_stray_bytes",
        "gauge",
        "Bytes of the window's scratch touched by guest accesses where nothing was mapped",
        Samples::Device(|d| window(d).and_then(|w| w.stray_bytes)),
    ),
    Family {
        shown: Shown::WithSource,
        ..family(
            "daxvmm_dax_failures_total",
            "counter",
            "SHMEM_MAP/UNMAP requests refused, by reason",
            Samples::DeviceLabelled("reason", |d| counters(d).map(|c| c.failures.clone())),
        )
    },
    Family {
        shown: Shown::WithSource,
        ..family(
            "daxvmm_dax_map_latency_seconds",
            "histogram",
            "Time to serve a SHMEM_MAP (checks and mmap)",
            Samples::DeviceHistogram(|d| {
                counters(d).map(|c| Histogram {
                    buckets: &c.latency_buckets,
                    sum_us: c.latency_sum_us,
                    count: c.maps,
                })
            }),
        )
    },
    Family {
        shown: Shown::WithSource,
        ..family(
            "daxvmm_dax_map_stage_seconds_total",
            "counter",
            "Time the VMM spent on SHMEM_MAPs, by stage: request (the whole backend request, read to ack), its parts read, check, fstat, keep_fd, mmap, scratch, record, queue_prefault, notify, and prefault_after_ack (the worker's pre-faults after the ack)",
            Samples::DeviceLabelledMicros("stage", |d| {
                counters(d).map(|c| stage_entries(&c.map_stages, |s| s.sum_us))
            }),
        )
    },
    Family {
        shown: Shown::WithSource,
        ..family(
            "daxvmm_dax_map_stages_total",
            "counter",
            "SHMEM_MAPs that reached each stage of daxvmm_dax_map_stage_seconds_total",
            Samples::DeviceLabelled("stage", |d| {
                counters(d).map(|c| stage_entries(&c.map_stages, |s| s.count))
            }),
        )
    },
    family(
        "daxvmm_fs_file_attrs_dax_total",
        "counter",
        "Regular-file attributes the daemon answered with FUSE_ATTR_DAX",
        Samples::Device(|d| daemon(d).map(|s| s.file_attrs_dax)),
    ),
    family(
        "daxvmm_fs_file_attrs_nodax_total",
        "counter",
        "Regular-file attributes the daemon answered without FUSE_ATTR_DAX",
        Samples::Device(|d| daemon(d).map(|s| s.file_attrs_nodax)),
    ),
    family(
        "daxvmm_fs_fuse_reads_total",
        "counter",
        "FUSE READ requests (data copied through the queue, not DAX)",
        Samples::Device(|d| daemon(d).map(|s| s.fuse_reads)),
    ),
    family(
        "daxvmm_fs_fuse_read_bytes_total",
        "counter",
        "Bytes read through FUSE READ",
        Samples::Device(|d| daemon(d).map(|s| s.fuse_read_bytes)),
    ),
    family(
        "daxvmm_fs_fuse_writes_total",
        "counter",
        "FUSE WRITE requests (data copied through the queue, not DAX)",
        Samples::Device(|d| daemon(d).map(|s| s.fuse_writes)),
    ),
    family(
        "daxvmm_fs_fuse_write_bytes_total",
        "counter",
        "Bytes written through FUSE WRITE",
        Samples::Device(|d| daemon(d).map(|s| s.fuse_write_bytes)),
    ),
    family(
        "daxvmm_fs_requests_total",
        "counter",
        "FUSE requests the daemon served",
        Samples::Device(|d| daemon(d).map(|s| s.requests)),
    ),
    family(
        "daxvmm_fs_setupmappings_total",
        "counter",
        "FUSE_SETUPMAPPING requests the daemon served",
        Samples::Device(|d| daemon(d).map(|s| s.setupmappings)),
    ),
    family(
        "daxvmm_fs_removemappings_total",
        "counter",
        "FUSE_REMOVEMAPPING requests the daemon served",
        Samples::Device(|d| daemon(d).map(|s| s.removemappings)),
    ),
    family(
        "daxvmm_fs_cap_refusals_total",
        "counter",
        "Guest requests the daemon refused because a cap was reached, by cap",
        Samples::DeviceLabelled("cap", |d| daemon(d).map(|s| entries(&s.cap_refusals))),
    ),
    family(
        "daxvmm_fs_handles",
        "gauge",
        "File and directory handles the guest holds open in the daemon",
        Samples::Device(|d| daemon(d).map(|s| s.handles)),
    ),
    family(
        "daxvmm_fs_policy_generation",
        "gauge",
        "Generation of the DAX policy the daemon has in force",
        Samples::Device(|d| daemon(d).map(|s| s.policy_generation)),
    ),
    family(
        "daxvmm_fs_map_alignment_bytes",
        "gauge",
        "Mapping alignment the daemon announced (window_granularity, auto resolved by the host file system)",
        Samples::Device(|d| daemon(d).map(|s| s.map_alignment)),
    ),
    family(
        "daxvmm_dax_adaptive_pressure",
        "gauge",
        "1 while the daemon sees the window under pressure (mapped ranges at pressure_high, or the guest reclaiming)",
        Samples::Device(|d| adaptive(d).map(|a| u64::from(a.pressure))),
    ),
    family(
        "daxvmm_dax_adaptive_pressure_episodes_total",
        "counter",
        "Times the window came under pressure",
        Samples::Device(|d| adaptive(d).map(|a| a.pressure_episodes)),
    ),
    family(
        "daxvmm_dax_adaptive_reclaims_total",
        "counter",
        "Ranges the guest unmapped while the window was under pressure (its reclaim)",
        Samples::Device(|d| adaptive(d).map(|a| a.reclaims)),
    ),
    family(
        "daxvmm_dax_adaptive_thrashing_files",
        "gauge",
        "Files kept off DAX now because their ranges kept being reclaimed",
        Samples::Device(|d| adaptive(d).map(|a| a.thrashing_files)),
    ),
    family(
        "daxvmm_dax_adaptive_withdrawn_total",
        "counter",
        "Files the adaptive policy answered without DAX where the policy's default gave it, by reason",
        Samples::DeviceLabelled("reason", |d| adaptive(d).map(|a| entries(&a.withdrawn))),
    ),
    family(
        "daxvmm_dax_adaptive_granted_total",
        "counter",
        "Files given DAX back by the adaptive policy, by reason",
        Samples::DeviceLabelled("reason", |d| adaptive(d).map(|a| entries(&a.granted))),
    ),
    family(
        "daxvmm_fs_map_stage_seconds_total",
        "counter",
        "Time the daemon spent on SETUPMAPPINGs, by stage: open, shmem_map (SHMEM_MAP sent to ack), record, and served (popped from the queue to the reply on the used ring)",
        Samples::DeviceLabelledMicros("stage", |d| {
            daemon(d).map(|s| stage_entries(&s.map_stages, |t| t.sum_us))
        }),
    ),
    family(
        "daxvmm_fs_map_stages_total",
        "counter",
        "SETUPMAPPINGs that reached each stage of daxvmm_fs_map_stage_seconds_total",
        Samples::DeviceLabelled("stage", |d| {
            daemon(d).map(|s| stage_entries(&s.map_stages, |t| t.count))
        }),
    ),
    family(
        "daxvmm_fs_map_roundtrip_seconds",
        "histogram",
        "SETUPMAPPING as the daemon sees it: SHMEM_MAP sent, the VMM's checks, mmap and pre-fault, ack received",
        Samples::DeviceHistogram(|d| {
            daemon(d)
                .filter(|s| !s.map_latency_buckets.is_empty())
                .map(|s| Histogram {
                    buckets: &s.map_latency_buckets,
                    sum_us: s.map_latency_sum_us,
                    count: s.map_latency_buckets.last().map_or(0, |b| b.1),
                })
        }),
    ),
    Family {
        shown: Shown::Always,
        ..family(
            "daxvmm_process_page_faults_total",
            "counter",
            "Page faults taken by the VMM process (guest accesses to the window fault here)",
            Samples::VmLabelled("kind", |s| {
                Some(vec![("minor", s.faults.minor), ("major", s.faults.major)])
            }),
        )
    },
];

/// Escapes a label value (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// µs as the seconds Prometheus expects.
fn seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

#[derive(Default)]
struct Writer {
    out: String,
}

impl Writer {
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

    fn histogram(&mut self, name: &str, device: &str, h: &Histogram) {
        for (le, n) in h.buckets {
            let le = le.map_or_else(|| "+Inf".to_string(), |us| seconds(us).to_string());
            self.sample(
                &format!("{name}_bucket"),
                &[("device", device), ("le", &le)],
                n,
            );
        }
        self.sample(
            &format!("{name}_sum"),
            &[("device", device)],
            seconds(h.sum_us),
        );
        self.sample(&format!("{name}_count"), &[("device", device)], h.count);
    }

    /// `f`'s samples from `snapshot`, and whether any device (or the VM)
    /// had their source.
    fn samples(&mut self, f: &Family, snapshot: &MetricsSnapshot) -> bool {
        let mut sourced = false;
        match &f.samples {
            Samples::Vm(get) => {
                if let Some(v) = get(snapshot) {
                    sourced = true;
                    self.sample(f.name, &[], v);
                }
            }
            Samples::VmLabelled(key, get) => {
                for (k, v) in get(snapshot).into_iter().flatten() {
                    sourced = true;
                    self.sample(f.name, &[(key, k)], v);
                }
            }
            Samples::Device(get) => {
                for d in &snapshot.devices {
                    if let Some(v) = get(d) {
                        sourced = true;
                        self.sample(f.name, &[("device", &d.id)], v);
                    }
                }
            }
            Samples::DeviceLabelled(key, get) | Samples::DeviceLabelledMicros(key, get) => {
                let micros = matches!(f.samples, Samples::DeviceLabelledMicros(..));
                for d in &snapshot.devices {
                    let Some(entries) = get(d) else { continue };
                    sourced = true;
                    for (k, v) in entries {
                        let labels = [("device", d.id.as_str()), (*key, k)];
                        if micros {
                            self.sample(f.name, &labels, seconds(v));
                        } else {
                            self.sample(f.name, &labels, v);
                        }
                    }
                }
            }
            Samples::DeviceHistogram(get) => {
                for d in &snapshot.devices {
                    if let Some(h) = get(d) {
                        sourced = true;
                        self.histogram(f.name, &d.id, &h);
                    }
                }
            }
        }
        sourced
    }
}

/// The text of `snapshot`: each of [`FAMILIES`] that is shown, its header
/// then its samples.
pub fn render(snapshot: &MetricsSnapshot) -> String {
    let mut out = String::new();
    for f in FAMILIES {
        let mut samples = Writer::default();
        let sourced = samples.samples(f, snapshot);
        let shown = match f.shown {
            Shown::Always => true,
            Shown::WithSource => sourced,
            Shown::WithSamples => !samples.out.is_empty(),
        };
        if shown {
            let name = f.name;
            let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} {}", f.help, f.kind);
            out.push_str(&samples.out);
        }
    }
    out
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
