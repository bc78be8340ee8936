use super::*;

const MIB: u64 = 1 << 20;
const RANGE: u64 = 2 * MIB;

fn engine(window: u64) -> AdaptiveDax {
    AdaptiveDax::new(Adaptive::default(), window)
}

fn path(name: &str) -> impl Fn() -> String + '_ {
    move || name.to_string()
}

/// Maps `count` ranges of `nodeid` from window range `first` on.
fn map_ranges(a: &AdaptiveDax, nodeid: u64, first: u64, count: u64, now: Instant) {
    for i in first..first + count {
        a.mapped_at(nodeid, i * RANGE, RANGE, now);
    }
}

fn kinds(a: &AdaptiveDax) -> Vec<(String, Option<String>, String)> {
    a.events_after(0)
        .events
        .into_iter()
        .map(|e| (e.kind, e.path, e.reason))
        .collect()
}

#[test]
fn a_file_larger_than_its_share_of_the_window_starts_without_dax() {
    let a = engine(64 * MIB);
    let t = Instant::now();
    assert!(
        a.decide_at(1, 32 * MIB, &path("half.bin"), t),
        "exactly half fits"
    );
    assert!(!a.decide_at(2, 32 * MIB + 1, &path("big.bin"), t));
    // Asked again: the same answer, no second event.
    assert!(!a.decide_at(2, 32 * MIB + 1, &path("big.bin"), t));
    assert_eq!(
        kinds(&a),
        vec![(
            "withdraw".into(),
            Some("big.bin".into()),
            "larger_than_window_share".into()
        )]
    );
    assert_eq!(a.stats().withdrawn["larger_than_window_share"], 1);
}

#[test]
fn under_pressure_small_files_stay_off_the_window_and_the_hot_file_keeps_its_ranges() {
    // The bench's tree + hot file: a 64 MiB window (32 ranges), a 24 MiB
    // hot file (12 ranges), then a tree of 100 KiB files, each of which
    // Linux would give a whole range.
    let a = engine(64 * MIB);
    let t = Instant::now();
    assert!(a.decide_at(1, 24 * MIB, &path("hot.bin"), t));
    map_ranges(&a, 1, 0, 12, t);
    let mut next_range = 12;
    let mut refused = 0;
    for file in 0..200u64 {
        let id = 100 + file;
        if a.decide_at(id, 100 << 10, &path("tree/f"), t) {
            map_ranges(&a, id, next_range, 1, t);
            next_range += 1;
        } else {
            refused += 1;
        }
    }
    let st = a.stats();
    assert!(st.pressure);
    assert_eq!(st.mapped_ranges, 24, "pressure starts at 75 % of 32 ranges");
    assert_eq!(refused, 188);
    assert_eq!(st.withdrawn["small_file_under_pressure"], 188);
    assert_eq!(st.reclaims, 0, "Linux's reclaim (above 80 %) never started");
    // The hot file keeps DAX: it is large, and it holds ranges.
    assert!(a.decide_at(1, 24 * MIB, &path("hot.bin"), t));
    // A small file that already holds its range keeps it.
    assert!(a.decide_at(100, 100 << 10, &path("tree/f"), t));
    assert_eq!(
        kinds(&a)[0],
        (
            "pressure_on".into(),
            None,
            "75% of the window mapped".into()
        )
    );
}

#[test]
fn pressure_ends_below_the_low_mark_only_after_the_cool_down() {
    let a = engine(64 * MIB);
    let t = Instant::now();
    map_ranges(&a, 1, 0, 24, t);
    assert!(a.stats().pressure);
    // 60 %: between the marks, still under pressure.
    for i in 19..24 {
        a.unmapped_at(i * RANGE, RANGE, t);
    }
    assert!(a.stats().pressure);
    // 40 %, but only 1 s after it was high.
    for i in 13..19 {
        a.unmapped_at(i * RANGE, RANGE, t + Duration::from_secs(1));
    }
    assert!(!a.decide_at(9, 100 << 10, &path("s"), t + Duration::from_secs(1)));
    assert!(a.decide_at(9, 100 << 10, &path("s"), t + Duration::from_secs(11)));
    let events = kinds(&a);
    let tail: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(tail, ["pressure_on", "withdraw", "pressure_off", "grant"]);
    assert_eq!(events[3].2, "fits");
}

#[test]
fn a_file_whose_ranges_keep_being_reclaimed_loses_dax_until_retry_after() {
    let a = engine(64 * MIB);
    let t = Instant::now();
    assert!(a.decide_at(7, 30 * MIB, &path("db.bin"), t));
    // Another file fills 26 ranges: the window is above Linux's 80 %
    // once db.bin maps one more.
    map_ranges(&a, 8, 0, 26, t);
    for round in 0..16 {
        map_ranges(&a, 7, 26, 1, t);
        assert!(a.stats().mapped_ranges >= 27);
        a.unmapped_at(26 * RANGE, RANGE, t);
        let thrashing = a.stats().thrashing_files;
        assert_eq!(thrashing, u64::from(round == 15), "round {round}");
    }
    assert!(!a.decide_at(7, 30 * MIB, &path("db.bin"), t));
    // Pressure ends (the other file goes), but retry_after has not passed.
    for i in 0..26 {
        a.unmapped_at(i * RANGE, RANGE, t);
    }
    let later = t + Duration::from_secs(30);
    assert!(!a.decide_at(7, 30 * MIB, &path("db.bin"), later));
    let retry = t + Duration::from_secs(61);
    assert!(a.decide_at(7, 30 * MIB, &path("db.bin"), retry));
    let st = a.stats();
    assert_eq!(st.thrashing_files, 0);
    assert_eq!(st.withdrawn["thrashing"], 1);
    assert_eq!(st.granted["retry"], 1);
    // db.bin's 16, and the other file's first 3 unmaps (at 75 % or more);
    // the rest, below, are no reclaim.
    assert_eq!(st.reclaims, 19);
}

#[test]
fn a_re_read_file_regains_dax_under_pressure() {
    let a = engine(64 * MIB);
    let t = Instant::now();
    map_ranges(&a, 1, 0, 24, t);
    assert!(!a.decide_at(2, 512 << 10, &path("conf"), t));
    // Read through three times, in order: not yet.
    for pass in 0..3 {
        for block in 0..4u64 {
            a.fuse_read(2, block << 17, 128 << 10);
        }
        assert!(!a.decide_at(2, 512 << 10, &path("conf"), t), "pass {pass}");
    }
    a.fuse_read(2, 0, 512 << 10);
    assert!(a.decide_at(2, 512 << 10, &path("conf"), t));
    assert_eq!(a.stats().granted["reread"], 1);
    // A file read at random places gains it sooner.
    assert!(!a.decide_at(3, 900 << 10, &path("index"), t));
    // The first read, at offset 0, is in sequence; the 64 after it are not.
    for i in 0..65u64 {
        a.fuse_read(3, (i * 7919 % 200) << 12, 4096);
    }
    assert!(a.decide_at(3, 900 << 10, &path("index"), t));
    assert_eq!(a.stats().granted["random_reads"], 1);
}

#[test]
fn disabled_it_agrees_with_the_policy_and_records_nothing() {
    let a = AdaptiveDax::new(
        Adaptive {
            enabled: false,
            ..Adaptive::default()
        },
        4 * MIB,
    );
    assert!(a.decide(1, 1 << 40, &path("huge")));
    a.fuse_read(1, 0, 100);
    assert!(a.events_after(0).events.is_empty());
    assert!(!a.stats().enabled);
}

#[test]
fn forget_and_reset_drop_what_was_kept() {
    let a = engine(64 * MIB);
    let t = Instant::now();
    map_ranges(&a, 3, 0, 4, t);
    a.fuse_read(4, 0, 10);
    assert_eq!(a.state().files.len(), 2);
    a.forget(4);
    assert_eq!(a.state().files.len(), 1);
    a.reset();
    assert_eq!(a.stats().mapped_ranges, 0);
    assert!(a.state().files.is_empty());
    // A map outside the window (never checked by the VMM here) is ignored.
    a.mapped(3, 64 * MIB, RANGE);
    assert_eq!(a.stats().mapped_ranges, 0);
}

#[test]
fn readers_of_the_event_ring_learn_what_they_missed() {
    let a = engine(4 * MIB);
    let t = Instant::now();
    for id in 0..(EVENT_RING as u64 + 10) {
        assert!(!a.decide_at(id, 3 * MIB, &path("big"), t));
    }
    let all = a.events_after(0);
    assert_eq!(all.events.len(), EVENT_RING);
    assert_eq!(all.missed, 10);
    assert_eq!(all.next, EVENT_RING as u64 + 10);
    assert_eq!(all.events[0].seq, 11);
    let tail = a.events_after(all.next - 2);
    assert_eq!((tail.events.len(), tail.missed), (2, 0));
    assert!(a.events_after(all.next).events.is_empty());
    // A reader whose cursor is from before a daemon restart starts over.
    assert_eq!(a.events_after(u64::MAX).events.len(), EVENT_RING);
}
