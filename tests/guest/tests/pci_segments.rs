//! Two PCI segments, as Kata Containers' Cloud Hypervisor driver asks for
//! them: `platform.num_pci_segments: 2` and its virtio-fs share on
//! `pci_segment: 1`. One boot, driven through the API, checks:
//! - the guest's kernel finds both host bridges (ACPI `_SEG`, MCFG) and the
//!   share at `0001:00:01.0`, a pmem device on segment 0;
//! - the share mounts with `dax=always` and a file reads back through it,
//!   by `read` and through a DAX mapping of the window, whose BAR lies in
//!   segment 1's 64-bit window;
//! - `vm.add-pmem` with `pci_segment: 1` on the running VM answers 200 with
//!   a BDF on segment 1, the guest finds the device there by itself (ACPI
//!   hot-plug on segment 1) and reads the file, `vm.info` lists it with its
//!   BDF; a segment the VM does not have is refused (400);
//! - `vm.remove-device` makes the guest eject it from segment 1, and the
//!   VMM takes it away.
//!
//! Run with `cargo test -p guest-tests -- --ignored pci_segments::`.

use test_infra::results::Results;
use test_infra::rig::{self, Guest};

/// Where segment 1's 64-bit BAR window lies in a 512 MiB guest: the 512 GiB
/// 64-bit PCI area starts at 4 GiB (above RAM) and two segments share it
/// in halves (vmm/src/device_manager/address_space.rs).
const SEGMENT1_MMIO64: std::ops::Range<u64> = 0x41_0000_0000..0x81_0000_0000;

const HOST_BEFORE: &str = r#"
mkdir -p share
dd if=/dev/urandom of=share/data.bin bs=1M count=4 2>/dev/null
echo "@@HOST data_md5=$(md5sum < share/data.bin | cut -d' ' -f1)"
dd if=/dev/zero of=pmem0.img bs=1M count=4 2>/dev/null
printf 'segment-zero-pmem' | dd of=pmem0.img conv=notrunc 2>/dev/null
dd if=/dev/zero of=pmem1.img bs=1M count=4 2>/dev/null
printf 'segment-one-pmem' | dd of=pmem1.img conv=notrunc 2>/dev/null
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
i=0; while [ ! -S /tmp/fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
"#;

/// The create body has Kata's fields for the share (no id, no cache_size:
/// the daemon declares its window).
const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912,"shared":true},"serial":{"mode":"File","file":"'$WORK'/serial.log"},"platform":{"num_pci_segments":2},"fs":[{"tag":"kataShared","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024,"pci_segment":1}],"pmem":[{"file":"'$WORK'/pmem0.img","id":"pmem0","pci_segment":0}]}'
follow serial.log
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST add_nowhere=$(api PUT /api/v1/vm.add-pmem '{"file":"'$WORK'/pmem1.img","id":"pmem9","pci_segment":2}')"
echo "@@HOST add_seg1=$(api PUT /api/v1/vm.add-pmem '{"file":"'$WORK'/pmem1.img","id":"pmem1","pci_segment":1}')"
echo "@@HOST info_tree=$(api GET /api/v1/vm.info | grep -o '"pci_bdf":"[0-9a-f:.]*"' | tr '\n' ' ')"
seen '@@GUEST used=1'
echo "@@HOST remove_seg1=$(api PUT /api/v1/vm.remove-device '{"id":"pmem1"}')"
seen '@@GUEST removed=1'
echo "@@HOST info_after=$(api GET /api/v1/vm.info | grep -o '"pci_bdf":"[0-9a-f:.]*"' | tr '\n' ' ')"
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL; kill $DAEMON 2>/dev/null
"#;

const GUEST_SCRIPT: &str = r#"
# Virtio PCI functions by device id (0x105a fs, 0x105b pmem): their addresses.
find_dev() { for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = "$1" ] && basename $d; done; }
bar() { sed -n "$(($2+1))p" /sys/bus/pci/devices/$1/resource | cut -d' ' -f1; }
wait_for() { i=0; until eval "$1"; do [ $i -ge 1200 ] && return 1; sleep 0.1; i=$((i+1)); done; }
mkdir -p /mnt
wait_for '[ -n "$(find_dev 0x105a)" ] && [ -b /dev/pmem0 ]'
echo "@@GUEST bridges=$(dmesg | grep -o 'PCI host bridge to bus [0-9a-f:]*' | sed 's/.* //' | tr '\n' ' ')"
echo "@@GUEST fs=$(find_dev 0x105a)"
echo "@@GUEST pmem=$(find_dev 0x105b | tr '\n' ' ')"
FS=$(find_dev 0x105a)
echo "@@GUEST fs_bar2=$(bar $FS 2)"
echo "@@GUEST pmem0_marker=$(head -c 17 /dev/pmem0)"
wait_for 'mount -t virtiofs kataShared /mnt -o dax=always 2>/dev/null'; echo "@@GUEST mount_rc=$?"
echo "@@GUEST statx=$(cd /mnt && daxprobe statx data.bin)"
echo "@@GUEST data_md5=$(md5sum < /mnt/data.bin | cut -d' ' -f1)"
echo "@@GUEST mmap_md5=$(daxprobe mmap-copy /mnt/data.bin /tmp/copy && md5sum < /tmp/copy | cut -d' ' -f1)"
rm -f /tmp/copy
echo "@@GUEST ready=1"
wait_for '[ -b /dev/pmem1 ]'
echo "@@GUEST pmem_after_add=$(find_dev 0x105b | tr '\n' ' ')"
echo "@@GUEST pmem1_marker=$(head -c 16 /dev/pmem1)"
echo "@@GUEST used=1"
wait_for '[ ! -b /dev/pmem1 ] && [ -z "$(find_dev 0x105b | grep ^0001:)" ]'
echo "@@GUEST pmem_after_remove=$(find_dev 0x105b | tr '\n' ' ')"
echo "@@GUEST removed=1"
sleep 1
echo "@@GUEST pci_errors=$(dmesg | grep -i 'acpiphp\|pci 000[01]:00\|mmconfig\|ecam' | grep -ci 'fail\|error\|conflict\|no space\|not reserved')"
umount /mnt
poweroff -f
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn kata_share_on_segment_one_and_hot_plug_there() {
    let mut guest = Guest::through_api_with_daemon(
        "pci-segments",
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
    assert_eq!(run.host("create"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");

    // Both host bridges, the share on segment 1, the pmem device on 0.
    assert_eq!(
        run.guest("bridges").map(str::trim),
        Some("0000:00 0001:00"),
        "{tail}"
    );
    assert_eq!(run.guest("fs"), Some("0001:00:01.0"), "{tail}");
    let pmem = run.guest("pmem").unwrap_or_default();
    assert!(pmem.starts_with("0000:00:"), "{pmem}\n{tail}");
    assert_eq!(
        run.guest("pmem0_marker"),
        Some("segment-zero-pmem"),
        "{tail}"
    );
    // The DAX window's BAR is in segment 1's 64-bit window.
    let bar2 = run
        .guest("fs_bar2")
        .and_then(|b| u64::from_str_radix(b.trim_start_matches("0x"), 16).ok())
        .expect(&tail);
    assert!(
        SEGMENT1_MMIO64.contains(&bar2),
        "BAR 2 at {bar2:#x}\n{tail}"
    );

    // The share works, by read and through the DAX window.
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("statx"), Some("data.bin:1"), "{tail}");
    let data = run.host("data_md5").expect(&tail);
    assert_eq!(run.guest("data_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("mmap_md5"), Some(data), "{tail}");

    // Hot-plug on segment 1: the reply's BDF is where the guest finds it.
    let nowhere = run.host("add_nowhere").unwrap_or_default();
    assert!(
        nowhere.starts_with("status=400") && nowhere.contains("pci_segment=2"),
        "{nowhere}\n{tail}"
    );
    let added = run.host("add_seg1").unwrap_or_default();
    assert!(added.starts_with("status=200"), "{added}\n{tail}");
    let at = added.find("\"bdf\":\"").expect(&tail) + 7;
    let bdf = &added[at..at + 12];
    assert!(bdf.starts_with("0001:00:"), "{added}\n{tail}");
    assert!(
        run.guest("pmem_after_add")
            .is_some_and(|p| p.split(' ').any(|d| d == bdf)),
        "the guest found {bdf}\n{tail}"
    );
    assert_eq!(
        run.guest("pmem1_marker"),
        Some("segment-one-pmem"),
        "{tail}"
    );
    let tree = run.host("info_tree").unwrap_or_default();
    assert!(
        tree.contains(&format!("\"pci_bdf\":\"{bdf}\""))
            && tree.contains("\"pci_bdf\":\"0001:00:01.0\""),
        "vm.info's device_tree: {tree}\n{tail}"
    );

    // Ejected from segment 1 by the guest, removed by the VMM.
    assert_eq!(run.host("remove_seg1"), Some("status=204 body="), "{tail}");
    let left = run.guest("pmem_after_remove").unwrap_or_default();
    assert!(!left.contains("0001:"), "{left}\n{tail}");
    assert!(
        run.text()
            .contains(&format!("pmem1: ejected by the guest from {bdf}")),
        "{tail}"
    );
    let after = run.host("info_after").unwrap_or_default();
    assert!(!after.contains(bdf), "{after}\n{tail}");
    assert_eq!(run.guest("pci_errors"), Some("0"), "{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new("pci-segments");
    results.record_run("Kata share on segment 1, hot-plug there, eject", &run);
    results.record("fs BAR 2 (segment 1)", format!("{bar2:#x}"));
    results.record("hot-plugged on segment 1", bdf.to_string());
    results.save().expect("write results");
}
