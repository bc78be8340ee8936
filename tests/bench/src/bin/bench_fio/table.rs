//! `bench-fio`'s tables from the guest's and the host's markers: the
//! seed's table per host page size with its ratios, the cost of fsync and
//! msync, the multi-queue rows with the daemon threads that served them,
//! and the targets, met or not.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use test_infra::fio::{parse_fio_terse, terse_error, FioResult};
use test_infra::results::Results;

use super::jobs::{
    all_jobs, Job, Server, Set, CH_2M, CH_4K, DAX_2M, DAX_4K, MQ, NEVER_2M, NEVER_4K, TMPFS,
};

/// A marker's value by its key (`@@GUEST key=value` or `@@HOST key=value`).
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The key of one job's result on one server in one round.
pub(crate) fn key(round: u32, server: &str, job: &str) -> String {
    format!("r{round}_{server}_{job}")
}

/// A cell's failure when the guest printed nothing for it (the boot did
/// not run, or stopped before it).
const NO_RESULT: &str = "no result";

/// One job on one server over the rounds: each round's result, or why
/// the job gave none.
#[derive(Debug, PartialEq)]
pub(crate) struct Cell {
    pub runs: Vec<FioResult>,
    pub failure: Option<String>,
}

impl Cell {
    pub fn of(guest: Lookup, rounds: u32, server: &str, job: &Job) -> Cell {
        let mut runs = Vec::new();
        let mut failure = None;
        for r in 1..=rounds {
            match guest(&key(r, server, &job.name)) {
                Some(v) => match parse_fio_terse(&v, job.writes()) {
                    Some(res) => runs.push(res),
                    None => {
                        failure = Some(match terse_error(&v) {
                            Some(e) => format!("fio error {e}"),
                            None => reason(&v),
                        })
                    }
                },
                None => failure = Some(NO_RESULT.into()),
            }
        }
        Cell { runs, failure }
    }

    /// MiB/s over the rounds (all of them, or None).
    pub fn mib(&self) -> Option<f64> {
        self.failure
            .is_none()
            .then(|| mean(self.runs.iter().map(|r| r.kib_per_s / 1024.0)))
            .flatten()
    }

    pub fn iops(&self) -> Option<f64> {
        self.failure
            .is_none()
            .then(|| mean(self.runs.iter().map(|r| r.iops)))
            .flatten()
    }

    /// "643.2 (640.1 / 646.3)": the mean and each round's; or why not.
    pub fn shown(&self) -> String {
        if let Some(f) = &self.failure {
            return format!("fails ({f})");
        }
        let Some(m) = self.mib() else {
            return "n/a".into();
        };
        if self.runs.len() < 2 {
            return format!("{m:.1}");
        }
        let each: Vec<String> = self
            .runs
            .iter()
            .map(|r| format!("{:.1}", r.kib_per_s / 1024.0))
            .collect();
        format!("{m:.1} ({})", each.join(" / "))
    }
}

/// What the guest printed instead of fio's line: its last words, short,
/// without the table's separators.
fn reason(value: &str) -> String {
    let text = value.trim().trim_start_matches("failed").trim();
    let text: String = text.chars().filter(|&c| c != '|').take(80).collect();
    if text.is_empty() {
        "no output".into()
    } else {
        text
    }
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = v.fold((0.0, 0u32), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

/// `a / b` as "12.3x", or "n/a".
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "n/a".into(),
    }
}

/// The seed's rows on one host page size: MiB/s per server, and the
/// ratios beside the seed's. Whether a cell that should have a figure
/// has none (mmap without DAX is expected to fail).
pub(crate) fn seed_table(
    guest: Lookup,
    rounds: u32,
    huge: bool,
    results: &mut Results,
) -> (String, bool) {
    let (dax, never, ch) = if huge {
        (DAX_2M, NEVER_2M, CH_2M)
    } else {
        (DAX_4K, NEVER_4K, CH_4K)
    };
    let pages = if huge { "2 MiB" } else { "4 KiB" };
    let mut t = String::from(
        "| 4 KiB blocks | ours, DAX | ours, cache=never | CH + virtiofsd, cache=never | guest tmpfs \
         | DAX ÷ cache=never | DAX ÷ CH cache=never | DAX ÷ guest tmpfs | the seed's DAX ÷ cache=none |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    let mut missing = false;
    for job in all_jobs().iter().filter(|j| j.set == Set::Seed) {
        let cells: Vec<Cell> = [dax, never, ch, TMPFS]
            .iter()
            .map(|s| Cell::of(guest, rounds, s.name, job))
            .collect();
        for (s, c) in [dax, never, ch, TMPFS].iter().zip(&cells) {
            // Without DAX a cache=never file is opened for direct I/O,
            // which the guest does not mmap (the seed's "only with DAX").
            let expected_to_fail =
                job.engine == "mmap" && !s.name.starts_with("dax") && s.huge.is_some();
            missing |= c.failure.is_some() && !expected_to_fail;
            results.record(
                &format!("{pages} pages: {}: {}, MiB/s", job.label(), s.name),
                c.shown(),
            );
        }
        let d = cells[0].mib();
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            job.label(),
            cells[0].shown(),
            cells[1].shown(),
            cells[2].shown(),
            cells[3].shown(),
            ratio_or_only(d, &cells[1]),
            ratio_or_only(d, &cells[2]),
            ratio(d, cells[3].mib()),
            job.seed_ratio(),
        );
    }
    (t, missing)
}

/// DAX over a server that could not run the job: "only with DAX".
fn ratio_or_only(dax: Option<f64>, other: &Cell) -> String {
    let refused = other.failure.as_deref().is_some_and(|f| f != NO_RESULT);
    if dax.is_some() && refused {
        "only with DAX".into()
    } else {
        ratio(dax, other.mib())
    }
}

/// Per-operation time in µs from IOPS.
fn micros_per_op(iops: Option<f64>) -> Option<f64> {
    iops.filter(|&i| i > 0.0).map(|i| 1e6 / i)
}

/// What fsync (psync) and msync (mmap) add to each 4 KiB random write,
/// per server: the writes' IOPS without and with a sync after each, and
/// the difference in µs per write.
pub(crate) fn sync_table(guest: Lookup, rounds: u32, results: &mut Results) -> (String, bool) {
    let jobs = all_jobs();
    let plain = |engine: &str| {
        jobs.iter()
            .find(|j| {
                j.set == Set::Seed && j.jobs == 1 && j.pattern == "randwrite" && j.engine == engine
            })
            .expect("the seed's table has every engine's randwrite")
    };
    let mut t = String::from(
        "| 4 KiB random writes, 1 job | server | host pages | IOPS without sync | IOPS with a sync after each write | µs per write without / with | the sync's cost per write |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let mut missing = false;
    for synced in jobs.iter().filter(|j| j.set == Set::Sync) {
        let base = plain(synced.engine);
        for s in [DAX_4K, NEVER_4K, CH_4K, DAX_2M, NEVER_2M, CH_2M, TMPFS] {
            let without = Cell::of(guest, rounds, s.name, base);
            let with = Cell::of(guest, rounds, s.name, synced);
            let mmap_without_dax =
                synced.engine == "mmap" && !s.name.starts_with("dax") && s.huge.is_some();
            if mmap_without_dax {
                continue;
            }
            missing |= without.failure.is_some() || with.failure.is_some();
            let (a, b) = (micros_per_op(without.iops()), micros_per_op(with.iops()));
            let cost = match (a, b) {
                (Some(a), Some(b)) => format!("{:.1} µs", b - a),
                _ => "n/a".into(),
            };
            let us = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.1}"));
            results.record(
                &format!("{}: {}: cost per write", synced.label(), s.name),
                cost.clone(),
            );
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} / {} µs | {cost} |",
                synced.label(),
                s.label,
                pages_of(&s),
                iops_shown(&without),
                iops_shown(&with),
                us(a),
                us(b),
            );
        }
    }
    (t, missing)
}

fn pages_of(s: &Server) -> &'static str {
    match s.huge {
        Some(true) => "2 MiB",
        Some(false) => "4 KiB",
        None => "(guest RAM)",
    }
}

fn iops_shown(c: &Cell) -> String {
    if let Some(f) = &c.failure {
        return format!("fails ({f})");
    }
    let each: Vec<String> = c.runs.iter().map(|r| format!("{:.0}", r.iops)).collect();
    match c.iops() {
        Some(m) if c.runs.len() > 1 => format!("{m:.0} ({})", each.join(" / ")),
        Some(m) => format!("{m:.0}"),
        None => "n/a".into(),
    }
}

/// A daemon's threads as the host noted them: `tid:comm:ticks` words.
fn thread_ticks(text: &str) -> BTreeMap<String, (String, u64)> {
    text.split_whitespace()
        .filter_map(|w| {
            let mut parts = w.splitn(3, ':');
            let (tid, comm, ticks) = (parts.next()?, parts.next()?, parts.next()?);
            Some((tid.to_string(), (comm.to_string(), ticks.parse().ok()?)))
        })
        .collect()
}

/// The threads whose CPU time grew between two notes, with how much
/// (clock ticks), busiest first.
pub(crate) fn busy_threads(begin: &str, end: &str) -> Vec<(String, u64)> {
    let before = thread_ticks(begin);
    let mut busy: Vec<(String, u64)> = thread_ticks(end)
        .into_iter()
        .filter_map(|(tid, (comm, t))| {
            let t0 = before.get(&tid).map_or(0, |b| b.1);
            let d = t.checked_sub(t0)?;
            (d > 0).then(|| (format!("{comm}/{tid}"), d))
        })
        .collect();
    busy.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    busy
}

/// How many interrupts each request queue of `device` (e.g. `virtio2`)
/// raised between two notes of the guest's `/proc/interrupts`
/// (`virtio2-requests.0:812` words), by queue.
pub(crate) fn queue_interrupts(begin: &str, end: &str, device: &str) -> Vec<(String, u64)> {
    let prefix = format!("{device}-");
    let counts = |text: &str| -> BTreeMap<String, u64> {
        text.split_whitespace()
            .filter_map(|w| {
                let (name, n) = w.rsplit_once(':')?;
                let queue = name.strip_prefix(&prefix)?;
                Some((queue.to_string(), n.parse().ok()?))
            })
            .collect()
    };
    let before = counts(begin);
    counts(end)
        .into_iter()
        .map(|(q, n)| {
            let d = n.saturating_sub(before.get(&q).copied().unwrap_or(0));
            (q, d)
        })
        .collect()
}

/// Parallel 4 KiB random reads without DAX: one and two jobs per server,
/// and which daemon threads did the work of the two.
pub(crate) fn mq_table(
    guest: Lookup,
    host: Lookup,
    rounds: u32,
    results: &mut Results,
) -> (String, bool) {
    let jobs = all_jobs();
    let mq: Vec<&Job> = jobs.iter().filter(|j| j.set == Set::MultiQueue).collect();
    let mut t = String::from(
        "| server (2 vCPUs) | psync randread, 1 job, MiB/s | 2 jobs, MiB/s | 2 jobs ÷ 1 job | the guest's interrupts per request queue during the 2 jobs, per round | daemon threads busy during the 2 jobs (comm/tid: CPU ticks), per round |\n\
         |---|---|---|---|---|---|\n",
    );
    let mut missing = false;
    for s in MQ {
        let cells: Vec<Cell> = mq
            .iter()
            .map(|j| Cell::of(guest, rounds, s.name, j))
            .collect();
        missing |= cells.iter().any(|c| c.failure.is_some());
        let two = mq.last().expect("two multi-queue jobs");
        let threads: Vec<String> = (1..=rounds)
            .map(|r| {
                let k = key(r, s.name, &two.name);
                match (
                    host(&format!("threads_{k}_begin")),
                    host(&format!("threads_{k}_end")),
                ) {
                    (Some(b), Some(e)) => {
                        let busy = busy_threads(&b, &e);
                        let words: Vec<String> =
                            busy.iter().map(|(n, d)| format!("{n}: {d}")).collect();
                        format!("{} busy: {}", busy.len(), words.join(", "))
                    }
                    _ => "not noted".into(),
                }
            })
            .collect();
        let threads = threads.join("; ");
        let irqs: Vec<String> = (1..=rounds)
            .map(|r| {
                let k = key(r, s.name, &two.name);
                let device = guest(&format!("r{r}_{}_device", s.name));
                match (
                    device,
                    guest(&format!("irqs_{k}_begin")),
                    guest(&format!("irqs_{k}_end")),
                ) {
                    (Some(d), Some(b), Some(e)) => {
                        let words: Vec<String> = queue_interrupts(&b, &e, &d)
                            .iter()
                            .map(|(q, n)| format!("{q} +{n}"))
                            .collect();
                        words.join(", ")
                    }
                    _ => "not noted".into(),
                }
            })
            .collect();
        let irqs = irqs.join("; ");
        results.record(
            &format!("multi-queue: {}: queue interrupts", s.name),
            irqs.clone(),
        );
        results.record(
            &format!("multi-queue: {}: threads", s.name),
            threads.clone(),
        );
        for (j, c) in mq.iter().zip(&cells) {
            results.record(
                &format!("multi-queue: {}: {}, MiB/s", s.name, j.label()),
                c.shown(),
            );
        }
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {irqs} | {threads} |",
            s.label,
            cells[0].shown(),
            cells[1].shown(),
            ratio(cells[1].mib(), cells[0].mib()),
        );
    }
    (t, missing)
}

/// The targets against this run: (what, measured, target, met).
pub(crate) fn targets(guest: Lookup, rounds: u32) -> Vec<(String, String, String, Option<bool>)> {
    let jobs = all_jobs();
    let job = |p: &str, e: &str| {
        jobs.iter()
            .find(|j| j.set == Set::Seed && j.jobs == 1 && j.pattern == p && j.engine == e)
            .expect("a row of the seed's table")
    };
    let mib = |s: &Server, j: &Job| Cell::of(guest, rounds, s.name, j).mib();
    let mut out = Vec::new();
    let mut at_least = |what: String, a: Option<f64>, b: Option<f64>, target: f64| {
        let met = a
            .zip(b)
            .filter(|&(_, b)| b > 0.0)
            .map(|(a, b)| a / b >= target);
        out.push((what, ratio(a, b), format!("≥ {target}x"), met));
    };
    for (huge, dax, never, read_target, write_target) in [
        (false, DAX_4K, NEVER_4K, 16.0, 14.0),
        (true, DAX_2M, NEVER_2M, 25.0, 20.0),
    ] {
        let pages = if huge { "2 MiB" } else { "4 KiB" };
        for (p, target) in [("randread", read_target), ("randwrite", write_target)] {
            let j = job(p, "psync");
            at_least(
                format!("psync {p}, DAX ÷ cache=never, {pages} host pages"),
                mib(&dax, j),
                mib(&never, j),
                target,
            );
        }
        for (p, seed) in [("read", 18.0), ("write", 14.5)] {
            let j = job(p, "psync");
            at_least(
                format!(
                    "psync seq{}, DAX ÷ cache=never, {pages} host pages (the seed's ratio)",
                    &p
                ),
                mib(&dax, j),
                mib(&never, j),
                seed,
            );
        }
        for p in ["read", "write"] {
            let j = job(p, "libaio");
            at_least(
                format!("libaio seq{p}, DAX ÷ cache=never, {pages} host pages (the seed's 1.2x)"),
                mib(&dax, j),
                mib(&never, j),
                1.2,
            );
        }
        let j = job("randread", "mmap");
        at_least(
            format!("mmap randread, DAX ÷ guest tmpfs, {pages} host pages"),
            mib(&dax, j),
            mib(&TMPFS, j),
            0.5,
        );
    }
    out
}

/// The targets as a table.
pub(crate) fn targets_table(targets: &[(String, String, String, Option<bool>)]) -> String {
    let mut t = String::from("| target | measured | wanted | met |\n|---|---|---|---|\n");
    for (what, measured, wanted, met) in targets {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "n/a",
        };
        let _ = writeln!(t, "| {what} | {measured} | {wanted} | {met} |");
    }
    t
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
