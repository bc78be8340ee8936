//! Live migration over TCP between two VMM processes in one emulated host,
//! with the DAX window alive, as an operator scripts it between two hosts
//! with Cloud Hypervisor and virtiofsd: `vm.receive-migration
//! {"receiver_url":"tcp:0.0.0.0:PORT"}` on an empty VMM, `vm.send-migration
//! {"destination_url":"tcp:127.0.0.1:PORT"}` on the running one, and a
//! second daemon on the same share listening at the socket path the VM's
//! configuration names (the source's daemon stays connected to the old,
//! unlinked socket until its VMM lets go). The disk image sits at the same
//! path for both VMMs (the shared storage) and the NIC is on a persistent
//! tap made before the first VMM starts (`tunctl`), opened by name by each.
//! Seccomp filters stay at their default (on) throughout.
//!
//! In the guest, `daxprobe mmap-counter` keeps a u64 in `counter.bin`
//! advancing through a writable DAX mapping and checksums `data.bin`
//! through a read-only one; a 32 MiB tmpfs file of random bytes is
//! checksummed before and after each move; `daxprobe ram-writer` rewrites
//! 4 MiB of its RAM five times a second and checks before each pass that the
//! previous one is all there (a page the migration missed shows).
//!
//! One boot checks, in order:
//! - (a) the destination VMM killed (SIGKILL) once 16 MiB of the stream
//!   have crossed the loopback: `vm.send-migration` fails with an error
//!   and the source VM still runs (`vm.info`, the counter advances);
//! - (b) the destination's daemon serves a share where another file is
//!   mounted over `data.bin` (a file the window maps): the migration fails
//!   before the switch, both API calls answer an error naming `data.bin`
//!   (as does the destination daemon's log); the source still runs;
//! - a migration to a new VMM and daemon: both calls answer 204, the old
//!   VMM exits 0 and its daemon follows, the new VMM runs the VM with the
//!   window's ranges mapped, the counter goes on in the host file, the RAM
//!   checksum and the writer's pages are intact, the guest pings the tap,
//!   a disk write after the move reaches the image;
//! - the migrated VM migrates again, to a third VMM and daemon, with the
//!   same checks.
//!
//! The downtime of each migration (the longest stop of the DAX counter as
//! the host saw it) and `vm.send-migration`'s time go to the results file.
//!
//! Run with `cargo test -p guest-tests -- --ignored migration_tcp::`.

use test_infra::results::Results;
use test_infra::rig;

use crate::devices::{blk, net};
use crate::snapshot::two_numbers;
use crate::snapshot_dax::counter_guest;

const HOST_IP: &str = "192.168.249.1";

/// The host's files, the loopback (the stream's way), the persistent tap
/// and the first daemon.
const HOST_BEFORE: &str = r#"
mkdir -p share share2
dd if=/dev/urandom of=share/data.bin bs=1M count=4 2>/dev/null
dd if=/dev/zero of=share/counter.bin bs=1M count=2 2>/dev/null
dd if=/dev/urandom of=other.bin bs=1M count=4 2>/dev/null
truncate -s 64M disk.img
ip link set lo up
# A persistent tap the operator made and configured: the VMMs open it by
# name and leave its address alone.
tunctl -t dtap0 >/dev/null && ip addr add HOST_IP/24 dev dtap0 && ip link set dtap0 up; echo "@@HOST tap_made=$?"
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
"#;

/// Host-side helpers of this test: `wait_port PORT` until something
/// listens on the TCP port (bounded); `lo_rx` the bytes the loopback has
/// carried; `vm_state SOCKET` the VM's state as `vm.info` says it;
/// `fresh_daemon SHARE` a new daemon at the VM's socket path (the running
/// VM's daemon keeps its connection), its pid in `NEW_DAEMON`, its log in
/// `SHARE.daemon.log`; `receiver SOCKET PORT OUT` a new VMM (pid in
/// `RECEIVER`) receiving on PORT, its answer to OUT (the call's pid in
/// `RECV`).
const TCP_HELPERS: &str = r#"
wait_port() { h=$(printf ':%04X ' $1); i=0; while ! grep -q "$h[0-9A-F:]* 0A " /proc/net/tcp && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; }
lo_rx() { cat /sys/class/net/lo/statistics/rx_bytes; }
vm_state() { api $1 GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"' | cut -d'"' -f4; }
fresh_daemon() { rm -f /tmp/fs.sock; dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir $1 --cache-size 32M --log-level warn 2>>$1.daemon.log & NEW_DAEMON=$!; wait_sock /tmp/fs.sock; }
receiver() { "$VMM" --api-socket $1 -v </dev/null & RECEIVER=$!; wait_sock $1; api $1 PUT /api/v1/vm.receive-migration '{"receiver_url":"tcp:0.0.0.0:'$2'"}' > $3 2>&1 & RECV=$!; wait_port $2; }
"#;

/// VMM A with the whole guest, checked before any move.
const BOOT_A: &str = r#"
api /tmp/api.sock PUT /api/v1/vmm.shutdown >/dev/null
follow serial.log
wait_sock /tmp/fs.sock
"$VMM" --api-socket /tmp/a.sock --kernel "$KERNEL" --initramfs "$INITRAMFS" --cmdline "$CMDLINE" \
  --memory size=512M,shared=on --serial "file=$WORK/serial.log" \
  --fs tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=32M,id=fs0 \
  --disk path=$WORK/disk.img,id=disk0,serial=tcpdisk \
  --net tap=dtap0,ip=HOST_IP,mask=255.255.255.0,mac=52:54:00:12:34:56,id=net0 -v </dev/null &
A=$!
seen '@@GUEST ready=1' $A
echo "@@HOST before=$(advancing)"
echo "@@HOST mapped_before=$(metric /tmp/a.sock mapped_ranges)"
"#;

/// (a) The destination VMM killed mid-stream; (b) the destination's share
/// has another file at `data.bin`'s path. The source runs on after both.
const FAILED_MOVES: &str = r#"
receiver /tmp/k.sock 6101 recv_killed.out
L0=$(lo_rx)
api /tmp/a.sock PUT /api/v1/vm.send-migration '{"destination_url":"tcp:127.0.0.1:6101"}' > send_killed.out 2>&1 &
SEND=$!
i=0; while [ $(( $(lo_rx) - L0 )) -lt 16777216 ] && alive $SEND && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
echo "@@HOST killed_at_bytes=$(( $(lo_rx) - L0 )) send_running=$(alive $SEND && echo yes)"
kill -9 $RECEIVER; wait $RECEIVER
wait $SEND; echo "@@HOST send_killed=$(cat send_killed.out)"
wait $RECV
echo "@@HOST killed_state=$(vm_state /tmp/a.sock)"
echo "@@HOST after_killed=$(advancing)"

mount --bind share share2 && mount --bind other.bin share2/data.bin; echo "@@HOST share2_made=$?"
fresh_daemon share2; D2=$NEW_DAEMON
receiver /tmp/m.sock 6102 recv_mismatch.out
echo "@@HOST send_mismatch=$(api /tmp/a.sock PUT /api/v1/vm.send-migration '{"destination_url":"tcp:127.0.0.1:6102"}')"
wait $RECV; echo "@@HOST receive_mismatch=$(cat recv_mismatch.out)"
echo "@@HOST mismatch_state=$(vm_state /tmp/a.sock)"
echo "@@HOST after_mismatch=$(advancing)"
api /tmp/m.sock PUT /api/v1/vmm.shutdown >/dev/null; ended $RECEIVER
kill $D2 2>/dev/null; ended $D2
umount share2/data.bin; umount share2
echo "@@HOST mismatch_daemon_said=$(grep -a 'data.bin' share2.daemon.log | head -1)"
"#;

/// One successful move of the VM from `$SRC` (API socket `$SRC_SOCK`,
/// daemon `$SRC_DAEMON`) to a new VMM at `/tmp/vm@VM.sock` on port 610@VM,
/// then `share/moved@N` for the guest's checks; `$SRC` is then the new one.
const MOVE: &str = r#"
fresh_daemon share; DST_DAEMON=$NEW_DAEMON
receiver /tmp/vm@VM.sock 610@VM recv@N.out
daxprobe counter-gap share/counter.bin 30 > gap@N.out 2>&1 &
GAP=$!
sleep 1
T0=$(ms)
echo "@@HOST send@N=$(api $SRC_SOCK PUT /api/v1/vm.send-migration '{"destination_url":"tcp:127.0.0.1:610@VM"}')"
echo "@@HOST send@N_ms=$(( $(ms) - T0 ))"
wait $RECV; echo "@@HOST receive@N=$(cat recv@N.out)"
ended $SRC; echo "@@HOST src_exit@N=$EXIT"
ended $SRC_DAEMON; echo "@@HOST src_daemon_exit@N=$EXIT"
echo "@@HOST state@N=$(vm_state /tmp/vm@VM.sock)"
echo "@@HOST mapped@N=$(metric /tmp/vm@VM.sock mapped_ranges)"
echo "@@HOST after@N=$(advancing)"
wait $GAP; echo "@@HOST gap@N=$(cat gap@N.out)"
SRC=$RECEIVER; SRC_SOCK=/tmp/vm@VM.sock; SRC_DAEMON=$DST_DAEMON
touch share/moved@N
seen '@@GUEST after@N_done=1' $SRC
"#;

/// The end: the last VMM shut down, the disk's three marks.
const HOST_END: &str = r#"
echo "@@HOST last_shutdown=$(api $SRC_SOCK PUT /api/v1/vmm.shutdown)"
ended $SRC; echo "@@HOST last_exit=$EXIT"
kill $SRC_DAEMON 2>/dev/null
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
echo "@@HOST disk_marks=$(dd if=disk.img bs=4096 count=3 2>/dev/null | tr -c 'A-Z0-9-' ' ' | tr -s ' ')"
"#;

/// The guest: the DAX share, a disk mark, the NIC, the RAM checksum and
/// writer, the counter; after each move (`/mnt/movedN`) the checks again.
const GUEST_SCRIPT: &str = r#"
wait_for() { i=0; until eval "$1"; do [ $i -ge $2 ] && return 1; sleep 0.1; i=$((i+1)); done; }
mkdir -p /mnt /ram
wait_for 'mount -t virtiofs share /mnt -o dax=always 2>/dev/null' 300; echo "@@GUEST mount_rc=$?"
echo "@@GUEST statx_before=$(daxprobe statx /mnt/counter.bin /mnt/data.bin)"
DISK=$(for b in /sys/block/vd*; do [ "$(cat $b/serial 2>/dev/null)" = tcpdisk ] && echo ${b##*/}; done)
printf 'BEFORE-MARK' | dd of=/dev/$DISK bs=4096 seek=0 conv=fsync 2>/dev/null; echo "@@GUEST disk_before_rc=$?"
ip addr add 192.168.249.2/24 dev eth0 && ip link set eth0 up
mount -t tmpfs tmpfs /ram
dd if=/dev/urandom of=/ram/random.bin bs=1M count=32 2>/dev/null
echo "@@GUEST ram_sum_before=$(md5sum /ram/random.bin | cut -d' ' -f1)"
daxprobe ram-writer 4 200 /ram/writer.status 1800 &
daxprobe mmap-counter /mnt/counter.bin /mnt/data.bin 1800 &
sleep 2
echo "@@GUEST ping_before=$(ping -c 3 -W 10 HOST_IP 2>&1 | grep -o '[0-9]* packets received')"
echo "@@GUEST writer_before=$(cat /ram/writer.status)"
echo "@@GUEST ready=1"
for n in 1 2; do
    wait_for "[ -e /mnt/moved$n ]" 6000; echo "@@GUEST saw_moved$n=$?"
    sleep 1
    echo "@@GUEST statx_$n=$(daxprobe statx /mnt/counter.bin /mnt/data.bin)"
    echo "@@GUEST ram_sum_$n=$(md5sum /ram/random.bin | cut -d' ' -f1)"
    echo "@@GUEST writer_$n=$(cat /ram/writer.status)"
    echo "@@GUEST ping_$n=$(ping -c 3 -W 10 HOST_IP 2>&1 | grep -o '[0-9]* packets received')"
    printf "AFTER$n-MARK" | dd of=/dev/$DISK bs=4096 seek=$n conv=fsync 2>/dev/null; echo "@@GUEST disk_${n}_rc=$?"
    echo "@@GUEST after${n}_done=1"
done
sleep 5
"#;

/// The host's steps: the failures, then two moves (A to VM 3, VM 3 to VM 4).
fn host_steps() -> String {
    let moves: String = [3, 4]
        .iter()
        .enumerate()
        .map(|(i, vm)| {
            MOVE.replace("@N", &(i + 1).to_string())
                .replace("@VM", &vm.to_string())
        })
        .collect();
    format!(
        "{TCP_HELPERS}{}{FAILED_MOVES}SRC=$A; SRC_SOCK=/tmp/a.sock; SRC_DAEMON=$DAEMON\n{moves}{HOST_END}",
        BOOT_A.replace("HOST_IP", HOST_IP)
    )
}

/// `passes=N bad_pages=M` as (N, M).
fn writer_status(value: Option<&str>) -> Option<(u64, u64)> {
    let v = value?;
    let field = |k: &str| {
        v.split_whitespace()
            .find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
    };
    Some((field("passes")?, field("bad_pages")?))
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_dax_guest_migrates_over_tcp_twice_and_survives_failed_attempts() {
    let modules: Vec<&str> = ["virtio_mmio"]
        .iter()
        .chain(blk::GUEST_MODULES)
        .chain(net::GUEST_MODULES)
        .copied()
        .collect();
    let guest = counter_guest(
        "migration-tcp",
        &GUEST_SCRIPT.replace("HOST_IP", HOST_IP),
        &modules,
        [
            &HOST_BEFORE.replace("HOST_IP", HOST_IP),
            &host_steps(),
            HOST_AFTER,
        ],
    );
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(120);
    assert!(!run.timed_out, "{tail}");
    let host = |key: &str| run.host(key).unwrap_or_default().to_string();

    // Before: the window is busy, the disk and the RAM writer work.
    assert_eq!(host("tap_made"), "0", "{tail}");
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    let dax = "/mnt/counter.bin:1 /mnt/data.bin:1";
    assert_eq!(run.guest("statx_before"), Some(dax), "{tail}");
    let (b0, b1) = two_numbers(run.host("before")).unwrap_or_else(|| panic!("no counter\n{tail}"));
    assert!(b1 > b0, "the guest's stores reach the host file\n{tail}");
    let mapped: u64 = host("mapped_before").parse().unwrap_or(0);
    assert!(mapped >= 2, "both files mapped through the window\n{tail}");
    assert_eq!(run.guest("disk_before_rc"), Some("0"), "{tail}");
    assert_eq!(
        run.guest("ping_before"),
        Some("3 packets received"),
        "{tail}"
    );
    let sum = run.guest("ram_sum_before").unwrap_or_default().to_string();
    assert_eq!(sum.len(), 32, "{tail}");
    let (p0, bad0) = writer_status(run.guest("writer_before")).unwrap_or_else(|| panic!("{tail}"));
    assert!(p0 > 0 && bad0 == 0, "{tail}");

    // (a) The destination killed mid-stream: an error, the source runs.
    assert!(
        host("killed_at_bytes").contains("send_running=yes"),
        "the destination was killed while the stream ran\n{tail}"
    );
    let killed = host("send_killed");
    assert!(
        killed.starts_with("status=") && !killed.starts_with("status=2"),
        "send-migration fails when the destination dies: {killed}\n{tail}"
    );
    assert!(
        killed.len() > "status=500 body=".len(),
        "and says why: {killed}\n{tail}"
    );
    assert_eq!(host("killed_state"), "Running", "{tail}");
    let (k0, k1) = two_numbers(run.host("after_killed")).unwrap_or_else(|| panic!("{tail}"));
    assert!(k0 > b1 && k1 > k0, "the source VM runs on\n{tail}");

    // (b) Another file at data.bin's path on the destination: refused
    // before the switch, by name; the source runs.
    assert_eq!(host("share2_made"), "0", "{tail}");
    // Both API answers name the file: the daemon wrote its reason back on
    // the state's socket, and the receiver's answer carried it to the
    // sender.
    let mismatch = host("send_mismatch");
    assert!(
        mismatch.starts_with("status=")
            && !mismatch.starts_with("status=2")
            && mismatch.contains("data.bin"),
        "send-migration fails naming the file: {mismatch}\n{tail}"
    );
    let receive = host("receive_mismatch");
    assert!(
        receive.starts_with("status=")
            && !receive.starts_with("status=2")
            && receive.contains("data.bin"),
        "receive-migration fails naming the file: {receive}\n{tail}"
    );
    // The destination's daemon logs it too.
    let said = host("mismatch_daemon_said");
    assert!(
        said.contains("data.bin") && said.contains("is not the saved file"),
        "the destination daemon names the file: {said}\n{tail}"
    );
    assert_eq!(host("mismatch_state"), "Running", "{tail}");
    let (m0, m1) = two_numbers(run.host("after_mismatch")).unwrap_or_else(|| panic!("{tail}"));
    assert!(m0 > k1 && m1 > m0, "the source VM runs on\n{tail}");

    // Two moves, the second of a VM that was migrated already.
    let mut last = m1;
    let mut results = Results::new("migration-tcp");
    results.record_run("live migration over TCP with a DAX window", &run);
    let mut last_passes = p0;
    for n in 1..=2 {
        let k = |key: &str| host(&format!("{key}{n}"));
        assert_eq!(k("send"), "status=204 body=", "move {n}\n{tail}");
        assert_eq!(k("receive"), "status=204 body=", "move {n}\n{tail}");
        assert_eq!(
            k("src_exit"),
            "status=0",
            "the old VMM exits (move {n})\n{tail}"
        );
        assert_eq!(
            k("src_daemon_exit"),
            "status=0",
            "the old daemon ends with its VMM (move {n})\n{tail}"
        );
        assert_eq!(k("state"), "Running", "move {n}\n{tail}");
        assert_eq!(
            k("mapped").parse::<u64>().unwrap_or(0),
            mapped,
            "the window's ranges mapped again by the new VMM (move {n})\n{tail}"
        );
        let (a0, a1) = two_numbers(Some(&k("after"))).unwrap_or_else(|| panic!("{tail}"));
        assert!(
            a0 > last && a1 > a0,
            "the counter goes on in the host file (move {n})\n{tail}"
        );
        last = a1;
        let g = |key: &str| {
            run.guest(&format!("{key}{n}"))
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(g("saw_moved"), "0", "{tail}");
        assert_eq!(g("statx_"), dax, "move {n}\n{tail}");
        assert_eq!(
            g("ram_sum_"),
            sum,
            "the tmpfs file's bytes moved intact (move {n})\n{tail}"
        );
        let (passes, bad) = writer_status(Some(&g("writer_"))).unwrap_or_else(|| panic!("{tail}"));
        assert_eq!(
            bad, 0,
            "every page the writer wrote arrived (move {n})\n{tail}"
        );
        assert!(
            passes > last_passes,
            "the writer went on (move {n})\n{tail}"
        );
        last_passes = passes;
        assert_eq!(
            g("ping_"),
            "3 packets received",
            "the tap by name (move {n})\n{tail}"
        );
        assert_eq!(
            run.guest(&format!("disk_{n}_rc")),
            Some("0"),
            "move {n}\n{tail}"
        );
        let gap = k("gap");
        assert!(gap.starts_with("max_gap_ms="), "{gap}\n{tail}");
        results.record(
            &format!("move {n}: downtime, the DAX counter's longest stop as the host saw it"),
            gap,
        );
        results.record(
            &format!("move {n}: vm.send-migration answered after (ms), the whole pre-copy"),
            host(&format!("send{n}_ms")),
        );
    }
    let lines = run.tail(100_000);
    assert!(
        !lines.contains("check=bad"),
        "data.bin read right through its mapping\n{tail}"
    );
    assert!(!lines.contains("ram_bad"), "{tail}");
    assert_eq!(host("last_shutdown"), "status=204 body=", "{tail}");
    assert_eq!(host("last_exit"), "status=0", "{tail}");
    assert_eq!(
        host("disk_marks").trim(),
        "BEFORE-MARK AFTER1-MARK AFTER2-MARK",
        "the disk writes of all three VMMs in the image\n{tail}"
    );
    results.record(
        "(a) destination killed: send-migration said",
        host("send_killed"),
    );
    for (what, key) in [
        (
            "(b) another file on the destination: send-migration said",
            "send_mismatch",
        ),
        ("(b) receive-migration said", "receive_mismatch"),
        ("(b) the destination daemon said", "mismatch_daemon_said"),
    ] {
        results.record(what, host(key));
    }
    results.save().expect("write results");
}
