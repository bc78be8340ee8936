//! Hot-plug into a running guest, as an orchestrator drives it through the
//! API (Cloud Hypervisor's endpoints, ch-remote's bodies). One boot checks:
//! - `vm.add-fs` (with a DAX window) and `vm.add-pmem` on the running VM
//!   answer 200 with the device's id and PCI address, and the guest's
//!   kernel finds both by itself (ACPI PCI hot-plug, no rescan by hand);
//! - the hot-plugged share mounts with `dax=always` and a file reads back
//!   through the window at whatever BAR address the guest's kernel chose
//!   (the VMM follows BAR moves), the pmem device shows the host file;
//! - `vm.remove-device` makes the guest eject both; the VMM then takes
//!   them away (the daemon sees its connection close and exits), they leave
//!   `vm.info`, and the guest's writes through pmem are in the host file;
//! - a pmem device plugged again after that works (slots and addresses
//!   are given back and reused);
//! - a second share, hot-plugged too, whose daemon is killed while the
//!   guest reads a DAX file through mmap in a loop: the VM survives (the
//!   window shows its scratch where the file was), the stray accesses are
//!   counted in `vm.dax-metrics`, and the guest still powers off cleanly;
//! - refused requests while running: an MMIO hot-plug (400), an unknown id (404).
//!
//! Run with `cargo test -p guest-tests -- --ignored hotplug::`
//! (scripts/test.sh does).

use test_infra::results::Results;
use test_infra::rig::{self, Guest};

const HOST_BEFORE: &str = r#"
mkdir -p share
dd if=/dev/urandom of=share/data.bin bs=1M count=8 2>/dev/null
echo "@@HOST data_md5=$(md5sum < share/data.bin | cut -d' ' -f1)"
dd if=/dev/zero of=pmem.img bs=1M count=16 2>/dev/null
printf 'pmem-marker-0042' | dd of=pmem.img conv=notrunc 2>/dev/null
mkdir -p share2
dd if=/dev/urandom of=share2/big.bin bs=1M count=24 2>/dev/null
echo "@@HOST big_md5=$(md5sum < share2/big.bin | cut -d' ' -f1)"
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
dax-virtiofsd --socket-path /tmp/fs2.sock --shared-dir share2 --cache-size 32M --log-level warn &
DAEMON2=$!
i=0; while { [ ! -S /tmp/fs.sock ] || [ ! -S /tmp/fs2.sock ]; } && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
"#;

/// The VM's serial goes to a file, so this script can wait for the guest's
/// markers; `tail` passes the lines on to the rig.
const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912,"shared":true},"serial":{"mode":"File","file":"'$WORK'/serial.log"}}'
follow serial.log
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST add_fs=$(api PUT /api/v1/vm.add-fs '{"tag":"hot","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024,"id":"fs0","cache_size":33554432}')"
echo "@@HOST add_pmem=$(api PUT /api/v1/vm.add-pmem '{"file":"'$WORK'/pmem.img","id":"pmem0"}')"
echo "@@HOST add_mmio=$(api PUT /api/v1/vm.add-pmem '{"file":"'$WORK'/pmem.img","id":"pmem9","transport":"mmio"}')"
echo "@@HOST info_plugged=$(api GET /api/v1/vm.info | grep -o '"id":"[a-z0-9_]*"' | tr '\n' ' ')"
seen '@@GUEST used=1'
echo "@@HOST remove_unknown=$(api PUT /api/v1/vm.remove-device '{"id":"nope"}')"
echo "@@HOST remove_fs=$(api PUT /api/v1/vm.remove-device '{"id":"fs0"}')"
echo "@@HOST remove_pmem=$(api PUT /api/v1/vm.remove-device '{"id":"pmem0"}')"
seen '@@GUEST removed=1'
i=0; while kill -0 $DAEMON 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
echo "@@HOST daemon_after_remove=$(kill -0 $DAEMON 2>/dev/null && echo running || echo exited)"
echo "@@HOST info_removed=$(api GET /api/v1/vm.info | grep -o '"id":"[a-z0-9_]*"' | tr '\n' ' ')"
echo "@@HOST replug=$(api PUT /api/v1/vm.add-pmem '{"file":"'$WORK'/pmem.img","id":"pmem1"}')"
echo "@@HOST add_doomed=$(api PUT /api/v1/vm.add-fs '{"tag":"doomed","socket":"/tmp/fs2.sock","num_queues":1,"queue_size":1024,"id":"fs1","cache_size":33554432}')"
seen '@@GUEST reading=1'
sleep 1; kill -9 $DAEMON2; echo "@@HOST killed=$?"
seen '@@GUEST alive='
echo "@@HOST stray=$(api GET /api/v1/vm.dax-metrics | sed -n 's/.*daxvmm_dax_stray_bytes{device="fs1"} \([0-9]*\).*/\1/p')"
echo "@@HOST ping_after_kill=$(api GET /api/v1/vmm.ping | cut -c1-10)"
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
echo "@@HOST pmem_written=$(dd if=pmem.img bs=1M skip=1 count=1 2>/dev/null | head -c 14)"
"#;

const GUEST_SCRIPT: &str = r#"
# A virtio PCI function by device id (0x105a fs, 0x105b pmem): its address.
find_dev() { for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = "$1" ] && basename $d; done; }
bar() { sed -n "$(($2+1))p" /sys/bus/pci/devices/$1/resource | cut -d' ' -f1; }
wait_for() { i=0; until eval "$1"; do [ $i -ge 1200 ] && return 1; sleep 0.1; i=$((i+1)); done; }
mkdir -p /mnt
echo "@@GUEST before=fs:$(find_dev 0x105a) pmem:$(find_dev 0x105b)"
echo "@@GUEST ready=1"
wait_for '[ -n "$(find_dev 0x105a)" ] && [ -b /dev/pmem0 ]'
FS=$(find_dev 0x105a); PMEM=$(find_dev 0x105b)
echo "@@GUEST found=fs:$FS pmem:$PMEM"
echo "@@GUEST fs_bars=$(bar $FS 0) $(bar $FS 2)"
echo "@@GUEST pmem_bars=$(bar $PMEM 0) $(bar $PMEM 2)"
wait_for 'mount -t virtiofs hot /mnt -o dax=always 2>/dev/null'; echo "@@GUEST mount_rc=$?"
echo "@@GUEST statx=$(cd /mnt && daxprobe statx data.bin)"
echo "@@GUEST data_md5=$(md5sum < /mnt/data.bin | cut -d' ' -f1)"
echo "@@GUEST mmap_md5=$(daxprobe mmap-copy /mnt/data.bin /tmp/copy && md5sum < /tmp/copy | cut -d' ' -f1)"
rm -f /tmp/copy
echo "@@GUEST pmem_marker=$(head -c 16 /dev/pmem0)"
printf 'guest-was-here' | dd of=/dev/pmem0 bs=1M seek=1 conv=fsync 2>/dev/null; echo "@@GUEST pmem_write_rc=$?"
umount /mnt; echo "@@GUEST umount_rc=$?"
echo "@@GUEST used=1"
wait_for '[ ! -e /sys/bus/pci/devices/$FS ] && [ ! -e /sys/bus/pci/devices/$PMEM ]'
echo "@@GUEST gone=fs:$([ -e /sys/bus/pci/devices/$FS ] && echo present || echo gone) pmem:$([ -e /sys/bus/pci/devices/$PMEM ] && echo present || echo gone) blk:$([ -b /dev/pmem0 ] && echo present || echo gone)"
echo "@@GUEST removed=1"
wait_for '[ -b /dev/pmem0 ]'
echo "@@GUEST replugged=$(find_dev 0x105b) $(head -c 16 /dev/pmem0)"
mkdir -p /mnt2
wait_for 'mount -t virtiofs doomed /mnt2 -o dax=always 2>/dev/null'; echo "@@GUEST doomed_mount_rc=$?"
echo "@@GUEST big_md5=$(daxprobe mmap-copy /mnt2/big.bin /tmp/big && md5sum < /tmp/big | cut -d' ' -f1)"
rm -f /tmp/big
# One mapping read over and over; the host kills the daemon meanwhile.
daxprobe mmap-scan /mnt2/big.bin 8 > /tmp/scan 2> /tmp/scan.err &
wait_for 'grep -q "first pass" /tmp/scan.err'
echo "@@GUEST reading=1"
# Not `wait`: the scan's exit closes the file, and that FUSE_FLUSH never
# gets an answer from a dead daemon (I/O on the share does not complete).
wait_for 'grep -q passes /tmp/scan'
echo "@@GUEST scan=$(cat /tmp/scan)"
echo "@@GUEST alive=$(cut -d' ' -f1 /proc/uptime)"
sleep 2
echo "@@GUEST hotplug_errors=$(dmesg | grep -i 'acpiphp\|pci 0000:00' | grep -ci 'fail\|error\|conflict\|no space')"
sleep 1
# No sync: the dead daemon's share would never answer it.
poweroff -n -f
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn fs_and_pmem_hot_plug_into_a_running_guest_and_eject() {
    let mut guest = Guest::through_api_with_daemon(
        "hotplug",
        GUEST_SCRIPT,
        HOST_BEFORE,
        API_SCRIPT,
        HOST_AFTER,
    )
    .expect("rig tools");
    guest.guest_modules = vec!["nd_pmem".into(), "virtio_pmem".into()];
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");
    assert_eq!(
        run.guest("before"),
        Some("fs: pmem:"),
        "nothing plugged at boot\n{tail}"
    );

    // Added while running: 200 with where the device went, as CH answers.
    let bdf = |key: &str| -> String {
        let reply = run.host(key).unwrap_or_default();
        assert!(reply.starts_with("status=200"), "{key}: {reply}\n{tail}");
        let at = reply.find("\"bdf\":\"").expect(&tail) + 7;
        reply[at..at + 12].to_string()
    };
    let (fs_bdf, pmem_bdf) = (bdf("add_fs"), bdf("add_pmem"));
    assert!(
        run.host("add_fs").unwrap().contains("\"id\":\"fs0\""),
        "{tail}"
    );
    assert_eq!(
        run.guest("found"),
        Some(format!("fs:{fs_bdf} pmem:{pmem_bdf}").as_str()),
        "the guest found both devices where the VMM said\n{tail}"
    );
    assert!(
        run.host("add_mmio")
            .is_some_and(|r| r.starts_with("status=400") && r.contains("virtio-PCI only")),
        "{tail}"
    );
    assert!(
        run.host("info_plugged")
            .is_some_and(|i| i.contains("\"id\":\"fs0\"") && i.contains("\"id\":\"pmem0\"")),
        "{tail}"
    );

    // The hot-plugged share works with DAX, wherever its BARs ended up.
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("statx"), Some("data.bin:1"), "{tail}");
    let data = run.host("data_md5").expect(&tail);
    assert_eq!(run.guest("data_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("mmap_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("pmem_marker"), Some("pmem-marker-0042"), "{tail}");
    assert_eq!(run.guest("pmem_write_rc"), Some("0"), "{tail}");

    // Removal: ejected by the guest, gone from the VMM and its config.
    assert!(
        run.host("remove_unknown")
            .is_some_and(|r| r.starts_with("status=404")),
        "{tail}"
    );
    assert_eq!(run.host("remove_fs"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("remove_pmem"), Some("status=204 body="), "{tail}");
    assert_eq!(
        run.guest("gone"),
        Some("fs:gone pmem:gone blk:gone"),
        "{tail}"
    );
    let text = run.text();
    for id in ["fs0", "pmem0"] {
        assert!(
            text.contains(&format!("{id}: ejected by the guest")),
            "the VMM removed {id} on the guest's eject\n{tail}"
        );
    }
    assert_eq!(
        run.host("daemon_after_remove"),
        Some("exited"),
        "the daemon saw the device go\n{tail}"
    );
    let info = run.host("info_removed").unwrap_or_default();
    assert!(
        !info.contains("fs0") && !info.contains("pmem0"),
        "vm.info after removal: {info}\n{tail}"
    );
    assert_eq!(run.host("pmem_written"), Some("guest-was-here"), "{tail}");

    // Plugged again into a freed slot.
    assert!(
        run.host("replug")
            .is_some_and(|r| r.starts_with("status=200")),
        "{tail}"
    );
    assert!(
        run.guest("replugged")
            .is_some_and(|r| r.ends_with("pmem-marker-0042")),
        "{tail}"
    );
    assert_eq!(run.guest("hotplug_errors"), Some("0"), "{tail}");

    // The second share's daemon dies under a guest reading through DAX:
    // the VM lives on, the API answers, and the stray reads are counted.
    assert!(
        run.host("add_doomed")
            .is_some_and(|r| r.starts_with("status=200")),
        "{tail}"
    );
    assert_eq!(run.guest("doomed_mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("big_md5"), run.host("big_md5"), "{tail}");
    assert_eq!(run.host("killed"), Some("0"), "{tail}");
    assert!(run.guest("alive").is_some(), "the guest runs on\n{tail}");
    // What the guest read changed once the window showed the scratch.
    let scan = run.guest("scan").unwrap_or_default();
    assert!(
        scan.starts_with("passes=") && !scan.ends_with("changed=0"),
        "{scan}\n{tail}"
    );
    assert_eq!(run.host("ping_after_kill"), Some("status=200"), "{tail}");
    let stray: u64 = run.host("stray").and_then(|s| s.parse().ok()).expect(&tail);
    assert!(stray > 0, "reads where the file was are counted\n{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new("hotplug");
    results.record_run("fs + pmem hot-plug, eject, re-plug", &run);
    let moved = text
        .lines()
        .filter(|l| l.contains("moved") && l.contains("BAR"))
        .count();
    results.record("BAR moves the VMM followed", moved.to_string());
    results.record("stray bytes after the daemon was killed", stray.to_string());
    results.record(
        "guest mmap scan across the kill",
        run.guest("scan").unwrap_or("?"),
    );
    results.record(
        "guest BARs (fs, pmem)",
        format!(
            "{} / {}",
            run.guest("fs_bars").unwrap_or("?"),
            run.guest("pmem_bars").unwrap_or("?")
        ),
    );
    results.save().expect("write results");
}
