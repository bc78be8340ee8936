//! POSIX semantics of the share: pjdfstest (the Rust edition from crates.io)
//! run as root inside a guest on the virtio-fs share, mounted with
//! `dax=inode` (the daemon's default policy), `dax=never` and `dax=always`
//! (every file through the DAX window), one pass each in one boot. Any
//! failure not in [`EXPECTED_FAILURES`] fails the test.
//!
//! Run with `cargo test -p guest-tests -- --ignored pjdfstest::`
//! (scripts/test.sh does).

use test_infra::host::crates_io_tool;
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile};

const PJDFSTEST_VERSION: &str = "0.2.2";

/// Tests that cannot pass on a virtio-fs share, with the reason. Empty: the
/// share passes everything pjdfstest runs here (docs/virtiofs.md says what
/// it skips and why).
const EXPECTED_FAILURES: &[(&str, &str)] = &[];

/// The run's configuration: the features pjdfstest tests on the share.
const CONFIG: &str = r#"
[features]
posix_fallocate = {}
utime_now = {}
utimensat = {}

[settings]
naptime = 0.01
allow_remount = false
expected_failures = [EXPECTED]

[dummy_auth]
entries = [["nobody", "nogroup"], ["daemon", "daemon"]]
"#;

const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
    daemon:x:1:1:daemon:/usr/sbin:/bin/false\n\
    nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
const GROUP: &str = "root:x:0:\ndaemon:x:1:\nnogroup:x:65534:\n";

const HOST_BEFORE: &str = r#"
mkdir -p share
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 64M --log-level warn &
DAEMON=$!
i=0; while [ ! -S /tmp/fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
"#;

const HOST_AFTER: &str = r#"
wait $DAEMON; echo "@@HOST daemon_exit=$?"
echo "@@HOST leftovers=$(find share -mindepth 1 | wc -l)"
"#;

/// One pjdfstest pass per mount option; the counts and the names of the
/// failed tests as markers, the full output in the log.
const GUEST_SCRIPT: &str = r#"
export NO_COLOR=1
for dax in inode never always; do
  mount -t virtiofs share /mnt -o dax=$dax; echo "@@GUEST mount_${dax}_rc=$?"
  [ $dax = inode ] && echo "@@GUEST sleep=$(ls -l $(which sleep) | cut -c1)"
  cd /mnt
  pjdfstest -c /etc/pjdfstest.toml -p /mnt > /tmp/pjd-$dax.out 2>&1
  echo "@@GUEST pjdfstest_${dax}_rc=$?"
  cd /
  # Each failure with the message under it.
  grep -E -A3 'FAILED$|PASSED UNEXPECTEDLY$' /tmp/pjd-$dax.out | sed 's/^/pjdfstest-'$dax': /'
  # What was skipped, and why (a reason line follows each), for the log.
  grep -E -A1 ' skipped$' /tmp/pjd-$dax.out | grep -v '^--' | paste - - | sed 's/^/pjdfstest-'$dax' skip: /'
  echo "@@GUEST pjdfstest_${dax}_failed=$(grep -E 'FAILED$|PASSED UNEXPECTEDLY$' /tmp/pjd-$dax.out | awk '{print $1}' | tr '\n' ' ')"
  echo "@@GUEST pjdfstest_${dax}_summary=$(grep '^Summary' /tmp/pjd-$dax.out)"
  umount /mnt; echo "@@GUEST umount_${dax}_rc=$?"
done
"#;

/// "Summary: 0 failed, 23 skipped, 375 passed, 0 expected failures, 398 total"
/// → (failed, skipped, passed, expected failures).
fn counts(summary: &str) -> Option<(u32, u32, u32, u32)> {
    let mut numbers = summary
        .trim_start_matches("Summary:")
        .split(',')
        .map(|part| part.split_whitespace().next()?.parse::<u32>().ok());
    Some((
        numbers.next()??,
        numbers.next()??,
        numbers.next()??,
        numbers.next()??,
    ))
}

#[test]
#[ignore = "boots a real guest; run through scripts/test.sh"]
fn pjdfstest_passes_on_the_share_with_and_without_dax() {
    let pjdfstest =
        crates_io_tool("pjdfstest", PJDFSTEST_VERSION, "pjdfstest", &[]).expect("pjdfstest");
    let expected = EXPECTED_FAILURES
        .iter()
        .map(|(name, _)| format!("\"{name}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let mut guest = Guest::new("pjdfstest", GUEST_SCRIPT);
    guest.cpus = 1;
    guest.memory = "512M,shared=on".into();
    guest.guest_tools = vec![pjdfstest, rig::tool("guest-tools", "sleep").expect("sleep")];
    guest.guest_files = vec![
        ImageFile {
            path: "etc/pjdfstest.toml".into(),
            perm: 0o644,
            data: CONFIG.replace("EXPECTED", &expected).into_bytes(),
        },
        ImageFile {
            path: "etc/passwd".into(),
            perm: 0o644,
            data: PASSWD.as_bytes().to_vec(),
        },
        ImageFile {
            path: "etc/group".into(),
            perm: 0o644,
            data: GROUP.as_bytes().to_vec(),
        },
    ];
    guest.host_tools = vec![rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd")];
    guest.host_before = HOST_BEFORE.into();
    guest.host_after = HOST_AFTER.into();
    guest.vmm_args = vec![
        "--fs".into(),
        "tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=64M,id=fs0".into(),
    ];
    guest.timeout = std::time::Duration::from_secs(2400);
    let (run, stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");

    let mut results = Results::new("pjdfstest");
    results.record_run("pjdfstest", &run);
    results.record_stalls(&stalls);
    for dax in ["inode", "never", "always"] {
        assert_eq!(run.guest(&format!("mount_{dax}_rc")), Some("0"), "{tail}");
        let summary = run
            .guest(&format!("pjdfstest_{dax}_summary"))
            .unwrap_or_else(|| panic!("no pjdfstest summary for dax={dax}\n{tail}"));
        let (failed, skipped, passed, expected_failures) =
            counts(summary).unwrap_or_else(|| panic!("unreadable summary {summary:?}\n{tail}"));
        results.record(
            &format!("dax={dax}"),
            format!("{failed} failed, {skipped} skipped, {passed} passed, {expected_failures} expected failures"),
        );
        let failures = run.guest(&format!("pjdfstest_{dax}_failed")).unwrap_or("");
        assert_eq!(
            (failed, failures.trim()),
            (0, ""),
            "dax={dax}: unexpected pjdfstest failures (their messages are in {})",
            run.log_path.display()
        );
        assert!(passed > 300, "dax={dax}: too few tests ran: {summary}");
        assert_eq!(
            run.guest(&format!("pjdfstest_{dax}_rc")),
            Some("0"),
            "{tail}"
        );
        assert_eq!(run.guest(&format!("umount_{dax}_rc")), Some("0"), "{tail}");
    }
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    assert_eq!(run.host("daemon_exit"), Some("0"), "{tail}");
    results.save().expect("write results");
}

#[test]
fn reads_pjdfstest_summaries() {
    assert_eq!(
        counts("Summary: 0 failed, 23 skipped, 375 passed, 0 expected failures, 398 total"),
        Some((0, 23, 375, 0))
    );
    assert_eq!(counts("Summary: garbage"), None);
}
