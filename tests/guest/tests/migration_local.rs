//! A VMM upgrade: a running guest with a DAX share, a writable disk, a NIC
//! on a tap and a vsock device is handed to a new VMM process by a local
//! migration, as an operator
//! scripts it with Cloud Hypervisor and virtiofsd (`receive-migration` on
//! the new VMM, `send-migration ...,local=on` on the old one; the old
//! daemon's socket file removed, a fresh daemon started on the same path
//! and share once the old one has exited). In the guest, `daxprobe
//! mmap-counter` keeps a u64 in `counter.bin` advancing through a writable
//! DAX mapping and checksums `data.bin` through a read-only one. One run
//! checks:
//! - `vm.send-migration` answers 204 once the new VMM has the VM, and the
//!   old VMM then exits 0; `vm.receive-migration` answers 204;
//! - the new VMM shows the VM running with the window's ranges mapped;
//!   the same guest process's counter advances in the host file from
//!   where it was, `data.bin` reads right, `statx` still says DAX, the
//!   guest pings the tap, which the new VMM received from the old one, a
//!   disk write after the move reaches the image (which the new VMM
//!   received open, its lock with it), and once the old VMM has exited a
//!   new host connection through the same vsock socket path (never
//!   removed on the way) reaches the guest's listener, served by the new
//!   VMM;
//! - the downtime, the longest time the counter stood still as the host
//!   saw it, goes to the results file.
//!
//! Run with `cargo test -p guest-tests -- --ignored migration_local::`.

use test_infra::results::Results;
use test_infra::rig;

use crate::snapshot::two_numbers;
use crate::snapshot_dax::WholeGuest;

/// The move: VMM B receives, the old daemon's socket goes and a fresh
/// daemon follows the old one's exit (the operator's part, as in Cloud
/// Hypervisor's virtio-fs migration test), VMM A sends.
const MIGRATION_STEPS: &str = r#"
"$VMM" --api-socket /tmp/b.sock -v </dev/null &
B=$!
wait_sock /tmp/b.sock
api /tmp/b.sock PUT /api/v1/vm.receive-migration '{"receiver_url":"unix:/tmp/mig.sock"}' > receive.out 2>&1 &
RECV=$!
wait_sock /tmp/mig.sock
swap_daemon $DAEMON daemon2 32M
daxprobe counter-gap share/counter.bin 20 > gap.out 2>&1 &
GAP=$!
sleep 1
T0=$(ms)
echo "@@HOST send=$(api /tmp/a.sock PUT /api/v1/vm.send-migration '{"destination_url":"unix:/tmp/mig.sock","local":true}')"
echo "@@HOST send_ms=$(( $(ms) - T0 ))"
wait $RECV; echo "@@HOST receive=$(cat receive.out)"
ended $A; echo "@@HOST a_exit=$EXIT"
echo "@@HOST vsock_socket=$([ -S /tmp/vsock.sock ] && echo kept)"
echo "@@HOST daemon1_exit=$(cat daemon2.old_exit 2>/dev/null)"
echo "@@HOST migrated_state=$(api /tmp/b.sock GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"')"
echo "@@HOST mapped_after=$(metric /tmp/b.sock mapped_ranges)"
echo "@@HOST after=$(advancing)"
wait $GAP; echo "@@HOST gap=$(cat gap.out)"
touch share/migrated
seen '@@GUEST after_done=1' $B
echo "@@HOST vsock_after=$(daxprobe hybrid-connect /tmp/vsock.sock 5000 4096 2>&1 | tr '\n' ' ')"
echo "@@HOST b_shutdown=$(api /tmp/b.sock PUT /api/v1/vmm.shutdown)"
ended $B; echo "@@HOST b_exit=$EXIT"
kill $(cat daemon2.pid 2>/dev/null) 2>/dev/null
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_dax_guest_moves_to_a_new_vmm_process_with_its_window() {
    let guest = WholeGuest {
        name: "migration-local",
        disk_serial: "migdisk",
        vmm_a_args: "",
        fs_args: "",
        move_steps: MIGRATION_STEPS,
        moved: "migrated",
    }
    .guest();
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(100);
    assert!(!run.timed_out, "{tail}");
    let host = |key: &str| run.host(key).unwrap_or_default().to_string();

    let dax = "/mnt/counter.bin:1 /mnt/data.bin:1";
    assert_eq!(run.guest("statx_before"), Some(dax), "{tail}");
    let (b0, b1) = two_numbers(run.host("before")).unwrap_or_else(|| panic!("no counter\n{tail}"));
    assert!(b1 > b0, "{tail}");
    let mapped: u64 = host("mapped_before").parse().unwrap_or(0);
    assert!(mapped >= 2, "{tail}");
    assert_eq!(run.guest("disk_before_rc"), Some("0"), "{tail}");
    assert!(host("vsock_before").contains("ok_port="), "{tail}");

    assert_eq!(host("send"), "status=204 body=", "{tail}");
    assert_eq!(host("receive"), "status=204 body=", "{tail}");
    assert_eq!(host("a_exit"), "status=0", "the old VMM exits\n{tail}");
    assert_eq!(
        host("vsock_socket"),
        "kept",
        "the old VMM left the vsock socket path to the new one\n{tail}"
    );
    assert_eq!(
        host("daemon1_exit"),
        "exited",
        "the old daemon let go once its state was handed over\n{tail}"
    );
    assert_eq!(host("migrated_state"), "\"state\":\"Running\"", "{tail}");
    assert_eq!(
        host("mapped_after").parse::<u64>().unwrap_or(0),
        mapped,
        "the window's ranges mapped in the new VMM\n{tail}"
    );
    let (a0, a1) = two_numbers(run.host("after")).unwrap_or_else(|| panic!("{tail}"));
    assert!(a0 > b1 && a1 > a0, "the counter goes on\n{tail}");
    assert_eq!(run.guest("saw_migrated"), Some("0"), "{tail}");
    assert_eq!(run.guest("statx_after"), Some(dax), "{tail}");
    let lines = run.tail(100_000);
    assert!(!lines.contains("check=bad"), "{tail}");
    assert_eq!(run.guest("ping"), Some("3 packets received"), "{tail}");
    assert_eq!(run.guest("disk_after_rc"), Some("0"), "{tail}");
    assert!(
        host("vsock_after").contains("ok_port="),
        "a new host connection through the same socket path, the old VMM gone\n{tail}"
    );
    assert_eq!(host("b_shutdown"), "status=204 body=", "{tail}");
    assert_eq!(host("b_exit"), "status=0", "{tail}");
    assert_eq!(
        host("disk_marks").trim(),
        "BEFORE-MARK AFTER-MARK",
        "both disk writes in the image, each in its block\n{tail}"
    );
    let gap = host("gap");
    assert!(gap.starts_with("max_gap_ms="), "{gap}\n{tail}");

    let mut results = Results::new("migration-local");
    results.record_run("local migration (VMM upgrade) with a DAX window", &run);
    results.record(
        "downtime: longest stop of the guest's DAX counter as the host saw it",
        gap,
    );
    results.record("vm.send-migration answered after (ms)", host("send_ms"));
    results.record("DAX ranges mapped in the new VMM", host("mapped_after"));
    results.save().expect("write results");
}
