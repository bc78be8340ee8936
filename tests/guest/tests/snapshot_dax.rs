//! A guest with a DAX share, a disk, a NIC on a tap and a vsock device is
//! snapshotted and restored with its DAX window alive, as an operator
//! scripts it with Cloud Hypervisor and virtiofsd (one daemon per VMM; a
//! fresh daemon on the same socket path and share serves the restored VM).
//! In the guest, `daxprobe mmap-counter` keeps a u64 in the shared file
//! `counter.bin` advancing through a writable DAX mapping and checksums
//! `data.bin` through a read-only one, both mapped once before the
//! snapshot. One run per transport of the fs device checks:
//! - before: the counter advances in the host's file (the guest's stores
//!   land in the host page cache through the window); `vm.dax-metrics`
//!   shows mapped ranges; a hybrid vsock connection is served;
//! - paused: the counter stands still; the snapshot is written (204) and
//!   its memory file holds less than the guest's RAM on disk (sparse), and
//!   never the window;
//! - the VMM is killed and its daemon exits; a new daemon and a new VMM
//!   restore the snapshot (204, paused) with the window's ranges mapped
//!   again before it resumes (`vm.dax-metrics`); resumed, the same mapping
//!   in the same process advances the same host file from where it stood,
//!   `data.bin`'s checksum through its old mapping stays right, `statx`
//!   still says DAX, the disk takes a write that reaches the image, the
//!   guest pings the new tap, and a new vsock connection is served.
//!
//! Run with `cargo test -p guest-tests -- --ignored snapshot_dax::`.

use std::time::Duration;

use test_infra::results::Results;
use test_infra::rig::{self, Guest};
use test_infra::shell::{COUNTER_HELPERS, DAEMON_SWAP_HELPERS, SHELL_HELPERS};

use crate::devices::{blk, net, vsock};
use crate::snapshot::two_numbers;

const HOST_IP: &str = "192.168.249.1";

/// The host's files of the whole-guest tests and the first daemon.
const WHOLE_HOST_BEFORE: &str = r#"
mkdir -p share snap
dd if=/dev/urandom of=share/data.bin bs=1M count=4 2>/dev/null
dd if=/dev/zero of=share/counter.bin bs=1M count=2 2>/dev/null
truncate -s 64M disk.img
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
"#;

/// VMM A with the whole guest (`VMM_A_ARGS` and `FS_ARGS` add words to
/// its command line and its `--fs`), checked before the move: the counter
/// advances, ranges are mapped, a host connection reaches the guest.
const WHOLE_BOOT_A: &str = r#"
api /tmp/api.sock PUT /api/v1/vmm.shutdown >/dev/null
follow serial.log
wait_sock /tmp/fs.sock
"$VMM" --api-socket /tmp/a.sock --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "$CMDLINE" \
  --memory size=512M,shared=on VMM_A_ARGS --serial "file=$WORK/serial.log" \
  --fs tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=32M,id=fs0FS_ARGS \
  --disk path=$WORK/disk.img,id=disk0,serial=DISK_SERIAL \
  --net tap=dtap0,ip=HOST_IP,mask=255.255.255.0,mac=52:54:00:12:34:56,id=net0 \
  --vsock cid=3,socket=/tmp/vsock.sock,id=vsock0 -v </dev/null &
A=$!
seen '@@GUEST ready=1' $A
echo "@@HOST before=$(advancing)"
echo "@@HOST mapped_before=$(metric /tmp/a.sock mapped_ranges)"
echo "@@HOST vsock_before=$(daxprobe hybrid-connect /tmp/vsock.sock 5000 4096 2>&1 | tr '\n' ' ')"
"#;

/// What the guest's disk holds after the run (its two marks).
const WHOLE_HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
echo "@@HOST disk_marks=$(dd if=disk.img bs=4096 count=2 2>/dev/null | tr -c 'A-Z-' ' ' | tr -s ' ')"
"#;

/// The whole guest's own part: the share mounted `dax=always`, a mark on
/// the disk (serial `DISK_SERIAL`), the NIC up, a vsock listener, the
/// counter and the checksummed mapping; once the host creates `MOVED` in
/// the share (`saw_MOVED`), the same checks again and a second disk mark.
const WHOLE_GUEST_SCRIPT: &str = r#"
wait_for() { i=0; until eval "$1"; do [ $i -ge $2 ] && return 1; sleep 0.1; i=$((i+1)); done; }
mkdir -p /mnt
wait_for 'mount -t virtiofs share /mnt -o dax=always 2>/dev/null' 300; echo "@@GUEST mount_rc=$?"
echo "@@GUEST statx_before=$(daxprobe statx /mnt/counter.bin /mnt/data.bin)"
DISK=$(for b in /sys/block/vd*; do [ "$(cat $b/serial 2>/dev/null)" = DISK_SERIAL ] && echo ${b##*/}; done)
printf 'BEFORE-MARK' | dd of=/dev/$DISK bs=4096 seek=0 conv=fsync 2>/dev/null; echo "@@GUEST disk_before_rc=$?"
ip addr add 192.168.249.2/24 dev eth0 && ip link set eth0 up
daxprobe vsock-serve 5000 64 2 &
daxprobe mmap-counter /mnt/counter.bin /mnt/data.bin 900 &
sleep 2
echo "@@GUEST ready=1"
wait_for '[ -e /mnt/MOVED ]' 6000; echo "@@GUEST saw_MOVED=$?"
sleep 2
echo "@@GUEST statx_after=$(daxprobe statx /mnt/counter.bin /mnt/data.bin)"
echo "@@GUEST ping=$(ping -c 3 -W 10 HOST_IP 2>&1 | grep -o '[0-9]* packets received')"
printf 'AFTER-MARK' | dd of=/dev/$DISK bs=4096 seek=1 conv=fsync 2>/dev/null; echo "@@GUEST disk_after_rc=$?"
echo "@@GUEST after_done=1"
sleep 5
"#;

/// How the whole guest (a DAX share, a disk, a NIC on a tap, a vsock
/// device) is run and moved by one test.
pub(crate) struct WholeGuest<'a> {
    /// The rig run's name.
    pub name: &'a str,
    /// The disk's serial, by which the guest finds it.
    pub disk_serial: &'a str,
    /// Words added to VMM A's command line and to its `--fs`.
    pub vmm_a_args: &'a str,
    pub fs_args: &'a str,
    /// The host's steps once VMM A runs and was checked: they move the
    /// guest, then create `share/<moved>` and wait for `after_done`.
    pub move_steps: &'a str,
    pub moved: &'a str,
}

impl WholeGuest<'_> {
    pub(crate) fn guest(&self) -> Guest {
        let words = |text: &str| {
            text.replace("VMM_A_ARGS", self.vmm_a_args)
                .replace("FS_ARGS", self.fs_args)
                .replace("DISK_SERIAL", self.disk_serial)
                .replace("MOVED", self.moved)
                .replace("HOST_IP", HOST_IP)
        };
        counter_guest(
            self.name,
            &words(WHOLE_GUEST_SCRIPT),
            &full_guest_modules(),
            [
                WHOLE_HOST_BEFORE,
                &format!("{}{}", words(WHOLE_BOOT_A), self.move_steps),
                WHOLE_HOST_AFTER,
            ],
        )
    }
}

/// Snapshot and restore: paused, snapshotted, VMM A killed and its daemon
/// gone, a fresh daemon and VMM B restore it and resume it.
const SNAPSHOT_STEPS: &str = r#"
echo "@@HOST pause=$(api /tmp/a.sock PUT /api/v1/vm.pause)"
echo "@@HOST paused=$(advancing)"
T0=$(ms)
echo "@@HOST snapshot=$(api /tmp/a.sock PUT /api/v1/vm.snapshot '{"destination_url":"file://'$WORK'/snap"}')"
echo "@@HOST snapshot_ms=$(( $(ms) - T0 ))"
echo "@@HOST snap_files=$(ls snap | tr '\n' ' ')"
echo "@@HOST snap_size=$(stat -c %s snap/memory-ranges) $(du -k snap/memory-ranges | cut -f1)"
kill -9 $A; wait $A
ended $DAEMON; echo "@@HOST daemon1_exit=$EXIT"
# The operator's part: a fresh daemon on the same socket path and share.
rm -f /tmp/fs.sock /tmp/vsock.sock
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
wait_sock /tmp/fs.sock
"$VMM" --api-socket /tmp/b.sock -v </dev/null &
B=$!
wait_sock /tmp/b.sock
T0=$(ms)
echo "@@HOST restore=$(api /tmp/b.sock PUT /api/v1/vm.restore '{"source_url":"file://'$WORK'/snap"}')"
echo "@@HOST restore_ms=$(( $(ms) - T0 ))"
echo "@@HOST restored_state=$(api /tmp/b.sock GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"')"
echo "@@HOST mapped_restored=$(metric /tmp/b.sock mapped_ranges)"
echo "@@HOST still_paused=$(advancing)"
echo "@@HOST resume=$(api /tmp/b.sock PUT /api/v1/vm.resume)"
echo "@@HOST after=$(advancing)"
touch share/restored
seen '@@GUEST after_done=1' $B
echo "@@HOST vsock_after=$(daxprobe hybrid-connect /tmp/vsock.sock 5000 4096 2>&1 | tr '\n' ' ')"
echo "@@HOST maps_after=$(metric /tmp/b.sock maps_total)"
echo "@@HOST b_shutdown=$(api /tmp/b.sock PUT /api/v1/vmm.shutdown)"
ended $B; echo "@@HOST b_exit=$EXIT"
kill $DAEMON 2>/dev/null
"#;

/// A guest of the DAX counter tests: shared RAM for the daemon,
/// `daxprobe` in it and on the emulated host beside `dax-virtiofsd`, `tun`
/// loaded for the tap, `modules` in the guest, and the host's API script
/// run after [`SHELL_HELPERS`], [`COUNTER_HELPERS`] and
/// [`DAEMON_SWAP_HELPERS`].
pub(crate) fn counter_guest(
    name: &str,
    script: &str,
    modules: &[&str],
    [host_before, api_script, host_after]: [&str; 3],
) -> Guest {
    let mut guest = Guest::new(name, script);
    guest.memory = "512M,shared=on".into();
    guest.guest_modules = modules.iter().map(|m| m.to_string()).collect();
    guest.host_modules = net::HOST_MODULES.iter().map(|m| m.to_string()).collect();
    let daxprobe = rig::tool("guest-tools", "daxprobe").expect("daxprobe");
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![
        rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd"),
        daxprobe,
    ];
    guest.host_before = host_before.into();
    guest.host_after = host_after.into();
    guest.vmm_args = vec!["-v".into()];
    guest.api_script = Some(format!(
        "{SHELL_HELPERS}{COUNTER_HELPERS}{DAEMON_SWAP_HELPERS}{api_script}"
    ));
    guest.timeout = Duration::from_secs(900);
    guest
}

/// The guest modules of the DAX counter tests' full guest: both
/// transports, blk, vsock and net.
pub(crate) fn full_guest_modules() -> Vec<&'static str> {
    ["virtio_mmio"]
        .iter()
        .chain(blk::GUEST_MODULES)
        .chain(vsock::GUEST_MODULES)
        .chain(net::GUEST_MODULES)
        .copied()
        .collect()
}

fn run_transport(transport: &str) {
    let guest = WholeGuest {
        name: &format!("snapshot-dax-{transport}"),
        disk_serial: "snapdisk",
        vmm_a_args: "--rng off",
        fs_args: &format!(",transport={transport}"),
        move_steps: SNAPSHOT_STEPS,
        moved: "restored",
    }
    .guest();
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(100);
    assert!(!run.timed_out, "{tail}");
    let host = |key: &str| run.host(key).unwrap_or_default().to_string();

    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    let dax = "/mnt/counter.bin:1 /mnt/data.bin:1";
    assert_eq!(run.guest("statx_before"), Some(dax), "{tail}");
    let (b0, b1) = two_numbers(run.host("before")).unwrap_or_else(|| panic!("no counter\n{tail}"));
    assert!(b1 > b0, "the guest's stores reach the host file\n{tail}");
    let mapped: u64 = host("mapped_before").parse().unwrap_or(0);
    assert!(mapped >= 2, "both files mapped through the window\n{tail}");
    assert!(host("vsock_before").contains("ok_port="), "{tail}");

    // Paused: nothing moves; the snapshot is written, RAM sparse.
    assert_eq!(host("pause"), "status=204 body=", "{tail}");
    let (p0, p1) = two_numbers(run.host("paused")).unwrap_or_else(|| panic!("{tail}"));
    assert_eq!(p0, p1, "a paused guest does not write\n{tail}");
    assert_eq!(host("snapshot"), "status=204 body=", "{tail}");
    assert_eq!(
        host("snap_files").trim(),
        "config.json memory-ranges state.json",
        "{tail}"
    );
    let (apparent, kib) = two_numbers(run.host("snap_size")).unwrap_or_else(|| panic!("{tail}"));
    assert!(apparent >= 512 << 20, "{tail}");
    assert!(kib * 1024 < apparent, "memory-ranges is sparse\n{tail}");
    assert_eq!(host("daemon1_exit"), "status=0", "{tail}");

    // Restored by a new VMM and a new daemon: paused, the window mapped
    // again, and the counter goes on from where it stood.
    assert_eq!(host("restore"), "status=204 body=", "{tail}");
    assert_eq!(host("restored_state"), "\"state\":\"Paused\"", "{tail}");
    let remapped: u64 = host("mapped_restored").parse().unwrap_or(0);
    assert_eq!(remapped, mapped, "the same ranges mapped again\n{tail}");
    let (s0, s1) = two_numbers(run.host("still_paused")).unwrap_or_else(|| panic!("{tail}"));
    assert_eq!((s0, s1), (p1, p1), "{tail}");
    assert_eq!(host("resume"), "status=204 body=", "{tail}");
    let (a0, a1) = two_numbers(run.host("after")).unwrap_or_else(|| panic!("{tail}"));
    assert!(
        a0 >= p1 && a1 > a0,
        "the counter advances from {p1}\n{tail}"
    );
    assert_eq!(run.guest("saw_restored"), Some("0"), "{tail}");
    assert_eq!(run.guest("statx_after"), Some(dax), "{tail}");
    let lines = run.tail(100_000);
    assert!(
        !lines.contains("check=bad"),
        "data.bin read right through its mapping\n{tail}"
    );
    assert!(lines.contains("check=ok"), "{tail}");
    assert_eq!(run.guest("ping"), Some("3 packets received"), "{tail}");
    assert_eq!(run.guest("disk_after_rc"), Some("0"), "{tail}");
    assert!(host("vsock_after").contains("ok_port="), "{tail}");
    assert_eq!(host("b_shutdown"), "status=204 body=", "{tail}");
    assert_eq!(host("b_exit"), "status=0", "{tail}");
    assert_eq!(
        host("disk_marks").trim(),
        "BEFORE-MARK AFTER-MARK",
        "both disk writes in the image, each in its block\n{tail}"
    );

    let mut results = Results::new(&format!("snapshot-dax-{transport}"));
    results.record_run("snapshot and restore with a DAX window", &run);
    results.record("snapshot (ms, API call)", host("snapshot_ms"));
    results.record("restore (ms, API call)", host("restore_ms"));
    results.record(
        "memory-ranges apparent bytes / KiB on disk",
        host("snap_size"),
    );
    results.record("DAX ranges mapped again", host("mapped_restored"));
    results.save().expect("write results");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_dax_guest_is_snapshotted_and_restored_with_its_window_on_pci() {
    run_transport("pci");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_dax_guest_is_snapshotted_and_restored_with_its_window_on_mmio() {
    run_transport("mmio");
}
