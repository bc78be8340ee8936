//! What our VMM did during each DAX job, from the counters the host noted
//! before and after it (`vmm_<key>_begin` / `vmm_<key>_end`, each the
//! `vm.dax-metrics` text on one line): maps, bytes put into
//! KVM's page tables ahead of the guest, pre-fault failures, the nested
//! page faults and exits KVM took, and the device worker's time in
//! pre-faults after the ack. This says where a slow DAX row's time went.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use test_infra::fio::parse_fio_terse;
use test_infra::prom::{label, samples};

use super::jobs::{all_jobs, Set, DAX_2M, DAX_4K};
use super::table::{key, Lookup};

const STAGE_FAMILY: &str = "daxvmm_dax_map_stage_seconds_total";

/// One snapshot's counters (the metrics text on one line, as `daxprobe
/// http` prints it), summed over devices: by family name, and for the
/// stage family by `family:stage`. A sample is a `daxvmm_` series
/// followed by a number; the `# HELP` and `# TYPE` words are not.
pub(crate) fn counters(snapshot: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for s in samples(snapshot).filter(|s| s.family.starts_with("daxvmm_")) {
        let Ok(value) = s.value.parse::<f64>() else {
            continue;
        };
        let name = if s.family == STAGE_FAMILY {
            let Some(stage) = label(s.labels, "stage") else {
                continue;
            };
            format!("{}:{stage}", s.family)
        } else {
            s.family.to_string()
        };
        *sums.entry(name).or_insert(0.0) += value;
    }
    sums
}

/// `end - begin` of each counter in `end`.
fn deltas(begin: &str, end: &str) -> BTreeMap<String, f64> {
    let before = counters(begin);
    counters(end)
        .into_iter()
        .map(|(k, v)| {
            let d = v - before.get(&k).copied().unwrap_or(0.0);
            (k, d)
        })
        .collect()
}

/// The table, one line per DAX job, host page size and round the host
/// noted; empty when it noted none (a run before these notes, or no DAX
/// job run).
pub(crate) fn dax_trace_table(guest: Lookup, host: Lookup, rounds: u32) -> String {
    let mut t = String::from(
        "| job | host pages | round | MiB/s | maps | pre-faulted into KVM, MiB | pre-fault failures | KVM page faults | KVM exits | worker's pre-faults after the ack, ms |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows = 0;
    for job in all_jobs().iter().filter(|j| j.set != Set::MultiQueue) {
        for server in [DAX_4K, DAX_2M] {
            for r in 1..=rounds {
                let k = key(r, server.name, &job.name);
                let (Some(b), Some(e)) = (
                    host(&format!("vmm_{k}_begin")),
                    host(&format!("vmm_{k}_end")),
                ) else {
                    continue;
                };
                let d = deltas(&b, &e);
                let get = |name: &str| d.get(name).copied().unwrap_or(0.0);
                let mib = guest(&k)
                    .and_then(|v| parse_fio_terse(&v, job.writes()))
                    .map_or_else(|| "n/a".into(), |f| format!("{:.1}", f.kib_per_s / 1024.0));
                let _ = writeln!(
                    t,
                    "| {} | {} | {r} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} | {:.1} |",
                    job.label(),
                    if server.huge == Some(true) {
                        "2 MiB"
                    } else {
                        "4 KiB"
                    },
                    mib,
                    get("daxvmm_dax_maps_total"),
                    get("daxvmm_dax_guest_prefaulted_bytes_total") / f64::from(1u32 << 20),
                    get("daxvmm_dax_prefault_failures_total"),
                    get("daxvmm_kvm_page_faults_total"),
                    get("daxvmm_kvm_exits_total"),
                    get(&format!("{STAGE_FAMILY}:prefault_after_ack")) * 1000.0,
                );
                rows += 1;
            }
        }
    }
    if rows == 0 {
        String::new()
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_devices_and_keep_the_stage() {
        let s = "# HELP daxvmm_dax_maps_total Maps 2 ranges # TYPE daxvmm_dax_maps_total counter \
                 daxvmm_dax_maps_total{device=\"_fs0\"} 3 daxvmm_dax_maps_total{device=\"_fs1\"} 4 \
                 daxvmm_kvm_exits_total 100 \
                 daxvmm_dax_map_stage_seconds_total{device=\"_fs0\",stage=\"prefault_after_ack\"} 0.25 \
                 daxvmm_dax_map_stage_seconds_total{device=\"_fs0\",stage=\"mmap\"} 0.5 garbage";
        let c = counters(s);
        assert_eq!(c["daxvmm_dax_maps_total"], 7.0);
        assert_eq!(c["daxvmm_kvm_exits_total"], 100.0);
        assert_eq!(c[&format!("{STAGE_FAMILY}:prefault_after_ack")], 0.25);
        assert_eq!(c[&format!("{STAGE_FAMILY}:mmap")], 0.5);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn a_job_line_shows_what_moved_during_it() {
        let begin = "daxvmm_dax_maps_total{device=\"_fs0\"} 10 daxvmm_kvm_page_faults_total 1000 daxvmm_dax_guest_prefaulted_bytes_total{device=\"_fs0\"} 0";
        let end = "daxvmm_dax_maps_total{device=\"_fs0\"} 42 daxvmm_kvm_page_faults_total 5000 daxvmm_dax_guest_prefaulted_bytes_total{device=\"_fs0\"} 67108864";
        let host = |k: &str| match k {
            "vmm_r1_dax4k_randread_psync_1_begin" => Some(begin.to_string()),
            "vmm_r1_dax4k_randread_psync_1_end" => Some(end.to_string()),
            _ => None,
        };
        let guest = |_: &str| None;
        let t = dax_trace_table(&guest, &host, 1);
        let line = t
            .lines()
            .find(|l| l.starts_with("| psync randread |"))
            .expect("the noted job has a line");
        assert!(line.contains("| 4 KiB | 1 |"), "{line}");
        assert!(line.contains("| 32 | 64.0 | 0 | 4000 | 0 |"), "{line}");
        assert_eq!(t.lines().count(), 3, "only the noted job: {t}");
        assert_eq!(dax_trace_table(&guest, &|_: &str| None, 1), "");
    }
}
