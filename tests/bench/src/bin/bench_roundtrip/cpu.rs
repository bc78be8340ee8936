//! Where a SETUPMAPPING's CPU time goes, thread by thread, beside a FUSE
//! READ's. The emulated host has one CPU: whatever the VMM or a daemon
//! does before the guest's vCPU runs again (after the reply as well as
//! before it) is time the guest waits, so each thread's CPU time per
//! operation says where the round trip goes better than stage clocks
//! on one side can.
//!
//! The guest makes one pass of one kind (cold touches on one DAX mount, or
//! 4 KiB reads without DAX) between two marks; at each mark the host reads
//! every task's time on the CPU (`daxprobe cpu-time`), and the guest waits
//! for that before it goes on. An empty pass between two marks measures
//! what the marking itself costs, which each pass's figures have taken off.
//! The table keeps the VMM's and the daemons' threads, which do nothing
//! else meanwhile.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use test_infra::rig::Run;

/// Rounds of (idle, each kind of pass): the spread.
pub const ROUNDS: u32 = 3;
/// The passes measured: mark name, the guest command's marker, what the
/// table calls it.
pub const KINDS: [(&str, &str, &str); 3] = [
    (
        "mapsnopf",
        "cpu_mapsnopf",
        "SETUPMAPPING, `dax_prefault=off`",
    ),
    ("mapshuge", "cpu_mapshuge", "SETUPMAPPING, 2 MiB host pages"),
    ("reads", "cpu_reads", "4 KiB FUSE READ"),
];

/// The marks, in the order the guest makes them.
pub fn marks() -> Vec<String> {
    let mut marks = Vec::new();
    for round in 1..=ROUNDS {
        for kind in std::iter::once("idle").chain(KINDS.iter().map(|k| k.0)) {
            marks.push(format!("{kind}{round}-0"));
            marks.push(format!("{kind}{round}-1"));
        }
    }
    marks
}

/// The guest's side: each pass between its two marks. `reads` is how many
/// FUSE READs the read pass makes (as many as a map pass has ranges).
pub fn guest_script(reads: u32) -> String {
    let mut s = String::from("mark() { daxprobe mark /fuse $1; }\n");
    for round in 1..=ROUNDS {
        let _ = writeln!(s, "sleep 1; mark idle{round}-0; mark idle{round}-1");
        for (kind, marker, _) in KINDS {
            let command = match kind {
                "mapsnopf" => "daxprobe roundtrip-maps /daxnopf/rt.bin".to_string(),
                "mapshuge" => "daxprobe roundtrip-maps /daxhuge/rt.bin".to_string(),
                _ => format!("daxprobe roundtrip-reads /fuse/rt.bin {reads}"),
            };
            // A map pass needs the guest's caches dropped: outside the
            // marks, so the REMOVEMAPPINGs of the ranges mapped before are
            // not this pass's, and a second before the first, for what the
            // drop leaves to the host's and the guest's workers to finish.
            let settle = if kind == "reads" {
                "sleep 1"
            } else {
                "echo 3 > /proc/sys/vm/drop_caches; sleep 1"
            };
            let _ = writeln!(
                s,
                "{settle}; mark {kind}{round}-0; out=$({command} 2>&1); mark {kind}{round}-1; echo \"@@GUEST {marker}{round}=$out\""
            );
        }
    }
    s
}

/// The host's side, in the background: at each mark, every task's CPU time.
pub fn host_script() -> String {
    format!("daxprobe cpu-marks share {} &\n", marks().join(" "))
}

/// One `daxprobe cpu-time` line: ns per `group/comm`.
fn parse(line: &str) -> BTreeMap<String, u64> {
    line.split_whitespace()
        .filter_map(|w| {
            let (k, v) = w.rsplit_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The row a task's CPU time counts in.
fn row_of(key: &str) -> &'static str {
    let (group, comm) = key.split_once('/').unwrap_or(("other", key));
    match (group, comm) {
        ("vmm", c) if c.starts_with("vcpu") => "guest vCPU thread (the guest, and KVM under it)",
        ("vmm", "fs-fs2") => "VMM: device worker of the `dax_prefault=off` share",
        ("vmm", "fs-fs3") => "VMM: device worker of the 2 MiB-page share",
        ("vmm", _) => "VMM: other threads",
        ("daxnopf.sock", _) => "daemon of the `dax_prefault=off` share",
        ("daxhuge.sock", _) => "daemon of the 2 MiB-page share",
        ("fuse.sock", _) => "daemon of the share without DAX",
        ("dax.sock", _) => "daemon of the default DAX share",
        _ => "everything else (host kernel threads, the rig's shell)",
    }
}

/// Per row, µs of CPU between `run`'s marks `from` and `to`.
fn delta(run: &Run, from: &str, to: &str) -> Option<BTreeMap<&'static str, f64>> {
    let a = parse(run.host(&format!("cpu_{from}"))?);
    let b = parse(run.host(&format!("cpu_{to}"))?);
    let mut rows = BTreeMap::new();
    for (k, vb) in &b {
        // A task that started between the marks counts from zero.
        let va = a.get(k).copied().unwrap_or(0);
        *rows.entry(row_of(k)).or_insert(0.0) += vb.saturating_sub(va) as f64 / 1e3;
    }
    Some(rows)
}

/// The table: per kind of operation, each row's µs of CPU per operation
/// (mean of the rounds, and their range), with the marking's own cost
/// (the idle pass of the same round) taken off; and the guest's mean time
/// per operation in the same passes. None when a mark is missing.
pub fn table(run: &Run, ops: u32) -> Option<String> {
    let mut per: BTreeMap<&'static str, Vec<Vec<f64>>> = BTreeMap::new();
    let mut guest_means: Vec<Vec<f64>> = vec![Vec::new(); KINDS.len()];
    for round in 1..=ROUNDS {
        let idle = delta(run, &format!("idle{round}-0"), &format!("idle{round}-1"))?;
        for (k, (kind, marker, _)) in KINDS.iter().enumerate() {
            let d = delta(
                run,
                &format!("{kind}{round}-0"),
                &format!("{kind}{round}-1"),
            )?;
            for (row, us) in &d {
                let cells = per
                    .entry(row)
                    .or_insert_with(|| vec![Vec::new(); KINDS.len()]);
                let base = idle.get(row).copied().unwrap_or(0.0);
                cells[k].push((us - base) / f64::from(ops));
            }
            if let Some(mean) = run
                .guest(&format!("{marker}{round}"))
                .and_then(|s| s.split_whitespace().find_map(|w| w.split_once("_mean_us=")))
                .and_then(|(_, v)| v.parse::<f64>().ok())
            {
                guest_means[k].push(mean);
            }
        }
    }
    let cell = |v: &[f64]| {
        if v.is_empty() {
            return "-".to_string();
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        format!("{mean:.0} ({lo:.0} to {hi:.0})")
    };
    // One row's cells, a kind of operation each.
    let cells_of = |kinds: &[Vec<f64>]| {
        kinds
            .iter()
            .map(|c| cell(c))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let mut t = String::from("| thread | ");
    t.push_str(&KINDS.map(|k| k.2).join(" | "));
    t.push_str(" |\n|---|");
    t.push_str(&"---|".repeat(KINDS.len()));
    t.push('\n');
    // Only the VMM's and the daemons' threads: they work for nothing but
    // these requests, so their figures are the requests'. The guest's vCPU
    // and the host's other tasks also carry the marks' own work (a lookup
    // every 20 ms in the guest, a /proc walk on the host), which the empty
    // pass does not cancel reliably.
    for (row, cells) in per
        .iter()
        .filter(|(row, _)| row.starts_with("VMM") || row.starts_with("daemon"))
    {
        let _ = writeln!(t, "| {row} | {} |", cells_of(cells));
    }
    let _ = writeln!(
        t,
        "| the guest's own clock, mean per operation | {} |",
        cells_of(&guest_means)
    );
    Some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_pair_up_round_by_round_and_both_scripts_use_them() {
        let m = marks();
        assert_eq!(m.len(), ROUNDS as usize * (KINDS.len() + 1) * 2);
        assert_eq!(
            &m[..4],
            ["idle1-0", "idle1-1", "mapsnopf1-0", "mapsnopf1-1"]
        );
        let g = guest_script(32);
        let h = host_script();
        for mark in &m {
            assert!(h.contains(&format!(" {mark}")), "{mark}");
            assert!(g.contains(&format!("mark {mark}")), "{mark}");
        }
        assert!(g.contains("roundtrip-reads /fuse/rt.bin 32"));
    }

    #[test]
    fn tasks_fall_into_their_rows() {
        assert_eq!(
            row_of("vmm/vcpu0"),
            "guest vCPU thread (the guest, and KVM under it)"
        );
        assert_eq!(
            row_of("vmm/fs-fs2"),
            "VMM: device worker of the `dax_prefault=off` share"
        );
        assert_eq!(row_of("vmm/serial-input"), "VMM: other threads");
        assert_eq!(
            row_of("daxnopf.sock/fs-worker-0"),
            "daemon of the `dax_prefault=off` share"
        );
        assert_eq!(
            row_of("other/kworker/0:1"),
            "everything else (host kernel threads, the rig's shell)"
        );
        let p = parse("vmm/vcpu0=1500 daxnopf.sock/x=7 bad other/a=b");
        assert_eq!(p.len(), 2);
        assert_eq!(p["vmm/vcpu0"], 1500);
    }
}
