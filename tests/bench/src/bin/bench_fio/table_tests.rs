use std::collections::HashMap;

use super::*;

/// A terse line as fio 3.33 prints it, with the given side's bandwidth
/// (KiB/s) and IOPS.
fn terse(write: bool, kib_per_s: u64, iops: u64) -> String {
    let mut f = vec!["0".to_string(); 130];
    f[0] = "3".into();
    let (bw, io) = if write { (47, 48) } else { (6, 7) };
    f[bw] = kib_per_s.to_string();
    f[io] = iops.to_string();
    f.join(";")
}

fn lookup(map: &HashMap<String, String>) -> impl Fn(&str) -> Option<String> + '_ {
    |k| map.get(k).cloned()
}

fn job(name: &str) -> Job {
    all_jobs().into_iter().find(|j| j.name == name).unwrap()
}

#[test]
fn a_cell_is_the_mean_of_its_rounds_and_shows_each() {
    let mut m = HashMap::new();
    m.insert(
        key(1, "dax4k", "randread_psync_1"),
        terse(false, 1024 * 600, 153_600),
    );
    m.insert(
        key(2, "dax4k", "randread_psync_1"),
        terse(false, 1024 * 700, 179_200),
    );
    let c = Cell::of(&lookup(&m), 2, "dax4k", &job("randread_psync_1"));
    assert_eq!(c.mib(), Some(650.0));
    assert_eq!(c.iops(), Some(166_400.0));
    assert_eq!(c.shown(), "650.0 (600.0 / 700.0)");
    let one = Cell::of(&lookup(&m), 1, "dax4k", &job("randread_psync_1"));
    assert_eq!(one.shown(), "600.0");
}

#[test]
fn a_write_job_reads_the_write_side_and_a_failure_names_fios_reason() {
    let mut m = HashMap::new();
    m.insert(key(1, "dax4k", "randwrite_psync_1"), terse(true, 2048, 512));
    m.insert(
        key(1, "never4k", "randwrite_mmap_1"),
        "failed fio: pid=88, err=19/file:engines/mmap.c:, func=mmap, error=No such device".into(),
    );
    let w = Cell::of(&lookup(&m), 1, "dax4k", &job("randwrite_psync_1"));
    assert_eq!(w.mib(), Some(2.0));
    let f = Cell::of(&lookup(&m), 1, "never4k", &job("randwrite_mmap_1"));
    assert_eq!(f.mib(), None);
    assert!(f.shown().starts_with("fails (fio: pid=88"), "{}", f.shown());
    assert!(f.shown().contains("No such device"));
    // A round without a line is a failure of the cell, not a smaller mean.
    m.insert(
        key(2, "dax4k", "randwrite_psync_1"),
        terse(true, 4096, 1024),
    );
    let missing = Cell::of(&lookup(&m), 3, "dax4k", &job("randwrite_psync_1"));
    assert_eq!(missing.mib(), None);
    assert_eq!(missing.failure.as_deref(), Some("no result"));
}

#[test]
fn the_seed_table_gives_the_ratios_beside_the_seeds_and_only_with_dax_for_mmap() {
    let mut m = HashMap::new();
    // fio 3.33's line for the mmap the guest refuses (ENODEV).
    let mut enodev = vec!["0"; 130];
    enodev[0] = "3";
    enodev[4] = "19";
    let put = |m: &mut HashMap<String, String>, s: &str, j: &str, line: String| {
        m.insert(key(1, s, j), line);
    };
    put(
        &mut m,
        "dax4k",
        "randread_psync_1",
        terse(false, 1600 * 1024, 1),
    );
    put(
        &mut m,
        "never4k",
        "randread_psync_1",
        terse(false, 100 * 1024, 1),
    );
    put(
        &mut m,
        "ch4k",
        "randread_psync_1",
        terse(false, 80 * 1024, 1),
    );
    put(
        &mut m,
        "tmpfs",
        "randread_psync_1",
        terse(false, 3200 * 1024, 1),
    );
    put(
        &mut m,
        "dax4k",
        "randread_mmap_1",
        terse(false, 500 * 1024, 1),
    );
    put(&mut m, "never4k", "randread_mmap_1", enodev.join(";"));
    put(
        &mut m,
        "ch4k",
        "randread_mmap_1",
        "failed mmap: No such device".into(),
    );
    put(
        &mut m,
        "tmpfs",
        "randread_mmap_1",
        terse(false, 1000 * 1024, 1),
    );
    let mut results = Results::new("fio-bench-test");
    let (t, missing) = seed_table(&lookup(&m), 1, false, &mut results);
    let row = |label: &str| {
        t.lines()
            .find(|l| l.starts_with(&format!("| {label} |")))
            .unwrap()
            .to_string()
    };
    assert_eq!(
        row("psync randread"),
        "| psync randread | 1600.0 | 100.0 | 80.0 | 3200.0 | 16.00x | 20.00x | 0.50x | 16x |"
    );
    let mmap = row("mmap randread");
    assert!(
        mmap.ends_with("| only with DAX | only with DAX | 0.50x | only with DAX |"),
        "{mmap}"
    );
    assert!(t.contains("fails (fio error 19)"), "{t}");
    // A server without a line is no comparison, not "only with DAX".
    m.remove(&key(1, "ch4k", "randread_mmap_1"));
    let (t2, _) = seed_table(&lookup(&m), 1, false, &mut results);
    assert!(
        t2.contains("| fails (no result) | 1000.0 | only with DAX | n/a | 0.50x |"),
        "{t2}"
    );
    // The other rows have no lines: the table says so.
    assert!(missing);
    assert!(row("libaio seqwrite, 4 jobs").contains("fails (no result)"));
}

#[test]
fn the_sync_cost_is_the_difference_of_the_per_write_times() {
    let mut m = HashMap::new();
    // 10,000 writes/s without (100 µs each), 2,000 with an fsync (500 µs).
    m.insert(
        key(1, "dax4k", "randwrite_psync_1"),
        terse(true, 40_000, 10_000),
    );
    m.insert(
        key(1, "dax4k", "randwrite_psync_1_fsync"),
        terse(true, 8_000, 2_000),
    );
    m.insert(
        key(1, "dax4k", "randwrite_mmap_1"),
        terse(true, 80_000, 20_000),
    );
    m.insert(
        key(1, "dax4k", "randwrite_mmap_1_fsync"),
        terse(true, 4_000, 1_000),
    );
    let mut results = Results::new("fio-bench-test");
    let (t, missing) = sync_table(&lookup(&m), 1, &mut results);
    let fsync = t
        .lines()
        .find(|l| l.starts_with("| psync randwrite + fsync | ours, DAX | 4 KiB |"))
        .unwrap();
    assert!(
        fsync.ends_with("| 10000 | 2000 | 100.0 / 500.0 µs | 400.0 µs |"),
        "{fsync}"
    );
    let msync = t
        .lines()
        .find(|l| l.starts_with("| mmap randwrite + msync | ours, DAX | 4 KiB |"))
        .unwrap();
    assert!(
        msync.ends_with("| 50.0 / 1000.0 µs | 950.0 µs |"),
        "{msync}"
    );
    // mmap rows of servers without DAX are left out, not counted missing;
    // the other servers' rows here have no lines.
    assert!(!t.contains("mmap randwrite + msync | ours, cache=never"));
    assert!(missing);
}

#[test]
fn busy_threads_are_those_whose_cpu_time_grew() {
    let begin = "100:dax-virtiofsd:5 101:vring0:10 102:vring1:3 103:control:1";
    let end = "100:dax-virtiofsd:5 101:vring0:40 102:vring1:25 103:control:1 104:new:2";
    assert_eq!(
        busy_threads(begin, end),
        vec![
            ("vring0/101".to_string(), 30),
            ("vring1/102".to_string(), 22),
            ("new/104".to_string(), 2),
        ]
    );
    assert!(busy_threads(end, end).is_empty());
    assert!(busy_threads("", "garbage words").is_empty());
}

#[test]
fn the_multi_queue_table_gives_the_scaling_and_the_threads() {
    let mut m = HashMap::new();
    let mut h = HashMap::new();
    m.insert(
        key(1, "mq2", "mq_randread_psync_1"),
        terse(false, 10 * 1024, 1),
    );
    m.insert(
        key(1, "mq2", "mq_randread_psync_2"),
        terse(false, 18 * 1024, 1),
    );
    let k = key(1, "mq2", "mq_randread_psync_2");
    h.insert(format!("threads_{k}_begin"), "7:a:1 8:b:1".to_string());
    h.insert(format!("threads_{k}_end"), "7:a:9 8:b:5".to_string());
    m.insert("r1_mq2_device".into(), "virtio1".into());
    m.insert(
        format!("irqs_{k}_begin"),
        "virtio0-requests.0:50 virtio1-requests.0:10 virtio1-requests.1:3".into(),
    );
    m.insert(
        format!("irqs_{k}_end"),
        "virtio0-requests.0:50 virtio1-requests.0:900 virtio1-requests.1:703".into(),
    );
    let mut results = Results::new("fio-bench-test");
    let (t, missing) = mq_table(&lookup(&m), &lookup(&h), 1, &mut results);
    let row = t
        .lines()
        .find(|l| l.starts_with("| ours, cache=never, 2 queues |"))
        .unwrap();
    assert_eq!(
        row,
        "| ours, cache=never, 2 queues | 10.0 | 18.0 | 1.80x | requests.0 +890, requests.1 +700 | 2 busy: a/7: 8, b/8: 4 |"
    );
    assert!(t.contains(
        "| ours, cache=never, 1 queue | fails (no result) | fails (no result) | n/a | not noted | not noted |"
    ));
    assert!(missing);
}

#[test]
fn targets_say_met_not_met_or_not_measured() {
    let mut m = HashMap::new();
    m.insert(key(1, "dax4k", "randread_psync_1"), terse(false, 1700, 1));
    m.insert(key(1, "never4k", "randread_psync_1"), terse(false, 100, 1));
    m.insert(key(1, "dax4k", "randwrite_psync_1"), terse(true, 1000, 1));
    m.insert(key(1, "never4k", "randwrite_psync_1"), terse(true, 100, 1));
    let t = targets(&lookup(&m), 1);
    let find = |w: &str| t.iter().find(|x| x.0 == w).unwrap();
    let read = find("psync randread, DAX ÷ cache=never, 4 KiB host pages");
    assert_eq!(
        (read.1.as_str(), read.2.as_str(), read.3),
        ("17.00x", "≥ 16x", Some(true))
    );
    let write = find("psync randwrite, DAX ÷ cache=never, 4 KiB host pages");
    assert_eq!((write.1.as_str(), write.3), ("10.00x", Some(false)));
    let huge = find("psync randread, DAX ÷ cache=never, 2 MiB host pages");
    assert_eq!(
        (huge.1.as_str(), huge.2.as_str(), huge.3),
        ("n/a", "≥ 25x", None)
    );
    let table = targets_table(&t);
    assert!(table.contains(
        "| psync randread, DAX ÷ cache=never, 4 KiB host pages | 17.00x | ≥ 16x | yes |"
    ));
    assert!(table.contains(
        "| psync randwrite, DAX ÷ cache=never, 4 KiB host pages | 10.00x | ≥ 14x | no |"
    ));
}

#[test]
fn queue_interrupts_are_the_devices_own_by_queue() {
    let begin = "virtio0-requests.0:5 virtio1-requests.0:10 virtio10-requests.0:7";
    let end =
        "virtio0-requests.0:9 virtio1-requests.0:15 virtio1-requests.1:4 virtio10-requests.0:70";
    assert_eq!(
        queue_interrupts(begin, end, "virtio1"),
        vec![("requests.0".to_string(), 5), ("requests.1".to_string(), 4)]
    );
    assert!(queue_interrupts(begin, end, "virtio3").is_empty());
}
