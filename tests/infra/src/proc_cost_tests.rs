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
        // A file the daemon opened in its own mount namespace: the host
        // sees it outside the shared directory, mapped shared all the same.
        entry("7f1000600000-7f1000800000 rw-s 00000000 01:00 14     /data/f2.bin", 512, 512, 0),
        entry("7f1000400000-7f1000600000 r--s 00000000 00:01 78     /memfd:dax-window-scratch (deleted)", 4, 1, 0),
        entry("7f3000000000-7f3000001000 rw-s 00000000 00:0e 9      anon_inode:kvm-vcpu:0", 4, 4, 0),
        entry("7f3000001000-7f3000002000 rw-s 00000000 00:05 3      /dev/kvm", 4, 4, 0),
        entry("7f2000000000-7f2000021000 rw-p 00000000 00:00 0 ", 132, 132, 132),
        entry("7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0      [stack]", 12, 12, 12),
    ]
    .concat();
    let [own, ram, share] = smaps_cost(&smaps, "/work/share").unwrap();
    let sums = |rss, pss, anon| MemSums { rss, pss, anon };
    assert_eq!(
        own,
        sums(1800 + 300 + 4 + 4 + 4 + 132 + 12, 1800 + 300 + 1 + 4 + 4 + 132 + 12, 300 + 132 + 12),
        "the scratch memfd, the vCPU's kvm_run and devices are the VMM's own, guest RAM and share files are not"
    );
    assert_eq!(ram, sums(65536, 32768, 0));
    assert_eq!(
        share,
        sums(2048 + 1024 + 512, 2048 + 512 + 512, 0),
        "a path with a space is still under the share"
    );
}

#[test]
fn mappings_are_classified_by_permissions_and_path() {
    use MappingClass::*;
    let s = "/work/share";
    assert_eq!(classify("rw-p", None, s), Own);
    assert_eq!(
        classify("rw-s", None, s),
        Own,
        "shared anonymous memory is no file"
    );
    assert_eq!(
        classify("rw-s", Some("/memfd:ch_ram (deleted)"), s),
        GuestRam
    );
    assert_eq!(classify("rw-s", Some("/memfd:guest-ram"), s), GuestRam);
    assert_eq!(
        classify("rw-s", Some("/memfd:guest-ram-not (deleted)"), s),
        Own
    );
    assert_eq!(classify("rw-s", Some("/memfd:dirty-log (deleted)"), s), Own);
    assert_eq!(
        classify("r--s", Some("/work/share/a"), "/work/share/"),
        Share
    );
    assert_eq!(
        classify("r--p", Some("/work/share/a"), s),
        Share,
        "under the share, shared or not"
    );
    assert_eq!(
        classify("r--p", Some("/work/shared/a"), s),
        Own,
        "a sibling with the same prefix"
    );
    assert_eq!(
        classify("r--s", Some("/data/f.bin"), s),
        Share,
        "a file mapped shared elsewhere"
    );
    assert_eq!(
        classify("r-xp", Some("/bin/dax-vmm"), s),
        Own,
        "the binary is mapped private"
    );
    assert_eq!(
        classify("r--p", Some("/work/share"), s),
        Own,
        "the directory itself is no file page"
    );
    assert_eq!(
        classify("r--p", Some("/work/share/a"), ""),
        Own,
        "no share given: only shared files are"
    );
    assert_eq!(classify("rw-s", Some("/dev/kvm"), s), Own);
    assert_eq!(classify("rw-s", Some("anon_inode:kvm-vcpu:0"), s), Own);
    assert_eq!(classify("rw-p", Some("[heap]"), s), Own);
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
    assert!(header("VmFlags: rd wr mr mw me").is_none());
    assert!(header("Rss:                   8 kB").is_none());
    assert_eq!(
        header("7f00-7f01 rw-p 00000000 00:00 0"),
        Some(("rw-p", None))
    );
    assert_eq!(
        header("7f00-7f01 r--s 00000000 00:00 0   /a b"),
        Some(("r--s", Some("/a b")))
    );
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
