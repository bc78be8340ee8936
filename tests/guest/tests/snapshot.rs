//! Snapshot and restore of a running guest, as Cloud Hypervisor's users
//! drive them. The guest has no virtio device (`--rng off`): its script
//! prints a counter on the serial console (`@@GUEST tick=N end`) five times
//! a second, to a file the VMM appends to. One run checks:
//! - a VMM without a VM answers `vm.snapshot` 404 and a `vm.restore` of a
//!   directory without a snapshot 500, and stays up (`vmm.shutdown`: 204);
//! - a running VM is not snapshotted (500 naming the state); paused, it is
//!   (204) into an existing directory, and its VMM is killed (every VMM
//!   here runs with its seccomp filters);
//! - a new VMM with only `--api-socket` restores it from ch-remote's body
//!   (204): `vm.info` shows the snapshot's configuration, paused; resumed,
//!   the guest's counter goes on from the last value printed before the
//!   snapshot (the next one, or the one after when a line was cut by the
//!   pause), never from 1;
//! - a third VMM started with `--restore source_url=file:///DIR,resume=true`
//!   runs the same snapshot at once and the counter goes on the same way.
//!
//! Run with `cargo test -p guest-tests -- --ignored snapshot::`.

use std::time::Duration;

use test_infra::rig::{self, Guest};
use test_infra::shell::SHELL_HELPERS;

/// The guest: a counter on the serial console, each line ended by a word
/// so a line cut by the pause (no ` end`) is never read as a value.
const GUEST_SCRIPT: &str = r#"
i=0
while [ $i -lt 1000000 ]; do i=$((i+1)); echo "@@GUEST tick=$i end"; sleep 0.2; done
"#;

/// Host side. `ticks N`: the counter values of the complete lines after
/// line N of serial.log; `wait_ticks N K PID`: until K of them are there
/// (bounded, and given up when the VMM PID is gone).
const API_SCRIPT: &str = r#"
ticks() { tr -d '\r' < serial.log | sed -n "$(( $1 + 1 )),\$p" | grep -E '^@@GUEST tick=[0-9]+ end$' | sed 's/^@@GUEST tick=//; s/ end$//'; }
wait_ticks() { i=0; while [ "$(ticks $1 | wc -l)" -lt $2 ] && [ $i -lt 3000 ] && alive $3; do sleep 0.1; i=$((i+1)); done; }
mkdir -p "$WORK/snap" "$WORK/empty"
SNAP="file://$WORK/snap"
# The rig's VMM has no VM: nothing to snapshot, nothing to restore from an empty directory.
echo "@@HOST no_vm_snapshot=$(api /tmp/api.sock PUT /api/v1/vm.snapshot '{"destination_url":"'$SNAP'"}')"
echo "@@HOST empty_restore=$(api /tmp/api.sock PUT /api/v1/vm.restore '{"source_url":"file://'$WORK'/empty"}')"
echo "@@HOST vmm1_shutdown=$(api /tmp/api.sock PUT /api/v1/vmm.shutdown)"
follow serial.log
"$VMM" --api-socket /tmp/a.sock --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "$CMDLINE" \
  --memory size=256M --rng off --serial "file=$WORK/serial.log" -v </dev/null &
A=$!
wait_sock /tmp/a.sock
wait_ticks 0 5 $A
echo "@@HOST running_snapshot=$(api /tmp/a.sock PUT /api/v1/vm.snapshot '{"destination_url":"'$SNAP'"}')"
echo "@@HOST pause=$(api /tmp/a.sock PUT /api/v1/vm.pause)"
echo "@@HOST snapshot=$(api /tmp/a.sock PUT /api/v1/vm.snapshot '{"destination_url":"'$SNAP'"}')"
echo "@@HOST last_before=$(ticks 0 | tail -1)"
kill -9 $A; wait $A
echo "@@HOST snapshot_files=$(ls "$WORK/snap" | tr '\n' ' ')"
n=$(wc -l < serial.log)
"$VMM" --api-socket /tmp/b.sock -v </dev/null &
B=$!
wait_sock /tmp/b.sock
R=$(api /tmp/b.sock PUT /api/v1/vm.restore '{"source_url":"'$SNAP'","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}')
echo "@@HOST restore=$R"
echo "@@HOST restored_info=$(api /tmp/b.sock GET /api/v1/vm.info | grep -oE '"state":"[A-Za-z]*"|"size":[0-9]*' | head -2 | tr '\n' ' ')"
echo "@@HOST restore_again=$(api /tmp/b.sock PUT /api/v1/vm.restore '{"source_url":"'$SNAP'"}')"
echo "@@HOST resume=$(api /tmp/b.sock PUT /api/v1/vm.resume)"
case "$R" in status=204*) wait_ticks $n 5 $B;; esac
echo "@@HOST b_ticks=$(ticks $n | head -1) $(ticks $n | tail -1)"
echo "@@HOST b_shutdown=$(api /tmp/b.sock PUT /api/v1/vmm.shutdown)"
ended $B; echo "@@HOST b_exit=$EXIT"
# B stopped the guest mid-line perhaps: the next VMM's lines start on a line of their own.
echo >> serial.log
n=$(wc -l < serial.log)
"$VMM" --api-socket /tmp/c.sock --restore "source_url=$SNAP,resume=true" -v </dev/null &
C=$!
wait_sock /tmp/c.sock
wait_ticks $n 5 $C
echo "@@HOST c_ticks=$(ticks $n | head -1) $(ticks $n | tail -1)"
echo "@@HOST c_state=$(api /tmp/c.sock GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"')"
echo "@@HOST c_shutdown=$(api /tmp/c.sock PUT /api/v1/vmm.shutdown)"
ended $C; echo "@@HOST c_exit=$EXIT"
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
"#;

/// Two numbers of a marker line (`"a b"`): counter values, sizes.
pub(crate) fn two_numbers(v: Option<&str>) -> Option<(u64, u64)> {
    let mut it = v?.split_whitespace().map(|n| n.parse().ok());
    Some((it.next()??, it.next()??))
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_paused_guest_is_snapshotted_and_restored_by_api_and_by_command_line() {
    let mut guest = Guest::new("snapshot", GUEST_SCRIPT);
    guest.host_tools = vec![rig::tool("guest-tools", "daxprobe").expect("daxprobe")];
    guest.host_after = HOST_AFTER.into();
    guest.vmm_args = vec!["-v".into()];
    guest.api_script = Some(format!("{SHELL_HELPERS}{API_SCRIPT}"));
    guest.timeout = Duration::from_secs(900);
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    let host = |key: &str| run.host(key).unwrap_or_default().to_string();

    // Without a VM: 404, and 500 naming the empty directory; the VMM stays up.
    assert!(host("no_vm_snapshot").starts_with("status=404"), "{tail}");
    let empty = host("empty_restore");
    assert!(
        empty.starts_with("status=500") && empty.contains("could not be restored from"),
        "{empty}\n{tail}"
    );
    assert_eq!(host("vmm1_shutdown"), "status=204 body=", "{tail}");

    // Running: refused naming the state. Paused: written.
    let running = host("running_snapshot");
    assert!(
        running.starts_with("status=500") && running.contains("while the VM is running"),
        "{running}\n{tail}"
    );
    assert_eq!(host("pause"), "status=204 body=", "{tail}");
    assert_eq!(host("snapshot"), "status=204 body=", "{tail}");
    assert!(!host("snapshot_files").trim().is_empty(), "{tail}");
    let last: u64 = host("last_before")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no counter before the snapshot\n{tail}"));
    assert!(last >= 5, "{tail}");

    // Restored through the API: the snapshot's configuration, paused; a
    // second restore into the same VMM is refused.
    assert_eq!(host("restore"), "status=204 body=", "{tail}");
    let info = host("restored_info");
    assert!(
        info.contains("\"state\":\"Paused\"") && info.contains("\"size\":268435456"),
        "{info}\n{tail}"
    );
    let again = host("restore_again");
    assert!(
        again.starts_with("status=500") && again.contains("a VM is already created"),
        "{again}\n{tail}"
    );
    assert_eq!(host("resume"), "status=204 body=", "{tail}");
    let continues = |key: &str| {
        let (first, latest) = two_numbers(run.host(key))
            .unwrap_or_else(|| panic!("{key}: no counter after the restore\n{tail}"));
        // The next value, or the one after when the pause cut a line.
        assert!(
            first == last + 1 || first == last + 2,
            "{key}: the counter went on from {first}, not from {last}\n{tail}"
        );
        assert!(
            latest >= first + 4,
            "{key}: it kept counting ({first}..{latest})\n{tail}"
        );
    };
    continues("b_ticks");
    assert_eq!(host("b_shutdown"), "status=204 body=", "{tail}");
    assert_eq!(host("b_exit"), "status=0", "{tail}");

    // --restore …,resume=true: the same snapshot, running at once.
    continues("c_ticks");
    assert!(host("c_state").contains("\"state\":\"Running\""), "{tail}");
    assert_eq!(host("c_shutdown"), "status=204 body=", "{tail}");
    assert_eq!(host("c_exit"), "status=0", "{tail}");
}
