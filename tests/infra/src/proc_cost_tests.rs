use super::*;

/// One smaps entry: header, then the fields the parser reads among ones
/// it skips.
fn entry(header: &str, rss: u64, pss: u64, anon: u64) -> String {
    format!(
        "{header}\nSize:               4096 kB\nKernelPageSize:        4 kB\nRss:            {rss:>6} kB\n\
         Pss:            {pss:>6} kB\nPss_Dirty:              0 kB\nShared_Clean:           0 kB\n\
         Anonymous:      {anon:>6} kB\nAnonHugePages:          0 kB\nTHPeligible:    0\nVmFlags: rd wr mr mw me sd \n"
    )
}

#[test]
fn guest_ram_and_share_pages_are_left_out_of_own() {
    let smaps = [
        entry("55d0c0000000-55d0c0200000 r-xp 00000000 00:02 1234   /bin/dax-vmm", 1800, 1800, 0),
        entry("55d0c1000000-55d0c1100000 rw-p 00000000 00:00 0      [heap]", 300, 300, 300),
        entry("7f0000000000-7f0010000000 rw-s 00000000 00:01 77     /memfd:guest-ram (deleted)", 65536, 32768, 0),
        entry("7f1000000000-7f1000200000 r--s 00000000 01:00 12     /work/share/data/f0.bin", 2048, 2048, 0),
        entry("7f1000200000-7f1000400000 r--s 00000000 01:00 13     /work/share/data/f 1.bin", 1024, 512, 0),
        entry("7f1000400000-7f1000600000 r--s 00000000 00:01 78     /memfd:dax-window-scratch (deleted)", 4, 1, 0),
        entry("7f2000000000-7f2000021000 rw-p 00000000 00:00 0 ", 132, 132, 132),
        entry("7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0      [stack]", 12, 12, 12),
    ]
    .concat();
    let [own, ram, share] = smaps_cost(&smaps, "/work/share").unwrap();
    assert_eq!(
        own,
        MemSums {
            rss: 1800 + 300 + 4 + 132 + 12,
            pss: 1800 + 300 + 1 + 132 + 12,
            anon: 300 + 132 + 12
        },
        "the scratch memfd is the VMM's own, guest RAM and share files are not"
    );
    assert_eq!(
        ram,
        MemSums {
            rss: 65536,
            pss: 32768,
            anon: 0
        }
    );
    assert_eq!(
        share,
        MemSums {
            rss: 3072,
            pss: 2560,
            anon: 0
        },
        "a path with a space is still under the share"
    );
}

#[test]
fn mappings_are_classified_by_path() {
    use MappingClass::*;
    assert_eq!(classify(None, "/work/share"), Own);
    assert_eq!(
        classify(Some("/memfd:ch_ram (deleted)"), "/work/share"),
        GuestRam
    );
    assert_eq!(classify(Some("/memfd:guest-ram"), "/work/share"), GuestRam);
    assert_eq!(
        classify(Some("/memfd:guest-ram-not (deleted)"), "/work/share"),
        Own
    );
    assert_eq!(
        classify(Some("/memfd:dirty-log (deleted)"), "/work/share"),
        Own
    );
    assert_eq!(classify(Some("/work/share/a"), "/work/share/"), Share);
    assert_eq!(
        classify(Some("/work/shared/a"), "/work/share"),
        Own,
        "a sibling with the same prefix"
    );
    assert_eq!(
        classify(Some("/work/share"), "/work/share"),
        Own,
        "the directory itself is no file page"
    );
    assert_eq!(
        classify(Some("/work/share/a"), ""),
        Own,
        "no share given: nothing is the share's"
    );
    assert_eq!(classify(Some("[heap]"), "/work/share"), Own);
}

#[test]
fn malformed_smaps_fails_naming_the_line() {
    let bad = entry("00400000-00401000 r-xp 00000000 00:02 1 /bin/x", 4, 4, 0)
        .replace("Pss:                 4 kB", "Pss: lots");
    assert_eq!(
        smaps_cost(&bad, "/s"),
        Err(ProcCostError::Smaps {
            line: 5,
            what: "Pss is not `N kB`: \" lots\"".into()
        })
    );
    assert!(matches!(
        smaps_cost("Rss: 4 kB\n", "/s"),
        Err(ProcCostError::Smaps { line: 1, .. })
    ));
    // A header whose first field is not an address range is not a header.
    assert!(header_path("VmFlags: rd wr mr mw me").is_none());
    assert!(header_path("Rss:                   8 kB").is_none());
    assert_eq!(header_path("7f00-7f01 rw-p 00000000 00:00 0"), Some(None));
}

#[test]
fn threads_come_from_status_and_a_missing_line_is_an_error() {
    let status = "Name:\tdax-vmm\nState:\tS (sleeping)\nThreads:\t7\nSigQ:\t0/1\n";
    assert_eq!(status_threads(status), Ok(7));
    assert_eq!(status_threads("Name:\tx\n"), Err(ProcCostError::NoThreads));
    let cost = process_cost(
        &entry("00400000-00401000 r-xp 0 00:02 1 /bin/x", 4, 4, 0),
        status,
        "/s",
    )
    .unwrap();
    assert_eq!((cost.procs, cost.threads, cost.own.rss), (1, 7, 4));
}

#[test]
fn the_line_reads_back_and_sums_add() {
    let a = ProcCost {
        procs: 1,
        threads: 5,
        own: MemSums {
            rss: 10,
            pss: 9,
            anon: 8,
        },
        guest_ram: MemSums {
            rss: 100,
            pss: 50,
            anon: 0,
        },
        share: MemSums {
            rss: 7,
            pss: 6,
            anon: 0,
        },
    };
    assert_eq!(ProcCost::parse_line(&a.line()), Ok(a));
    let mut sum = a;
    sum.add(&a);
    assert_eq!(
        (sum.procs, sum.threads, sum.own.pss, sum.share.rss),
        (2, 10, 18, 14)
    );
    assert_eq!(
        ProcCost::parse_line("procs=1 threads=x"),
        Err(ProcCostError::Field("threads"))
    );
}

#[test]
fn a_daemon_is_counted_with_its_children() {
    // 10 waits for 11 (sandboxed), which started 12; 20 is someone else's.
    let procs = [(10, 1), (11, 10), (12, 11), (20, 1), (21, 20)];
    assert_eq!(descendants(10, &procs), vec![10, 11, 12]);
    assert_eq!(descendants(21, &procs), vec![21]);
    assert_eq!(stat_parent("123 (a (b) c) S 45 123 123 0"), Some(45));
    assert_eq!(stat_parent("garbage"), None);
}
