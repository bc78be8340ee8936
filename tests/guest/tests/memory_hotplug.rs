//! ACPI memory hot-plug as Kata drives it through the API. One boot:
//! - `vm.create` with Kata's memory config (`size` 512 MiB, `hotplug_size`
//!   1 GiB, `hotplug_method: "Acpi"`, shared for virtio-fs) and a DAX share;
//! - `vm.resize` `{"desired_ram": 1 GiB}` → 204; the guest's MemTotal grows
//!   by ~512 MiB with no help (the kernel onlines hot-added blocks itself),
//!   `vm.info` shows `memory_actual_size` and `config.memory.size` at 1 GiB;
//! - the guest fills a tmpfs past its boot RAM (the pages come from the
//!   hot-added zone), then reads and writes the share through DAX and
//!   through FUSE requests whose buffers may now lie in the new RAM;
//! - refused: above `size + hotplug_size` (400 naming desired_ram and the
//!   limit), a size that is not a whole number of 128 MiB blocks (400);
//!   a smaller size changes nothing (204, as Cloud Hypervisor answers).
//!
//! Run with `cargo test -p guest-tests -- --ignored memory_hotplug::`.

use test_infra::results::Results;
use test_infra::rig::{self, Guest};

const HOST_BEFORE: &str = r#"
mkdir -p share
dd if=/dev/urandom of=share/data.bin bs=1M count=8 2>/dev/null
echo "@@HOST data_md5=$(md5sum < share/data.bin | cut -d' ' -f1)"
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
i=0; while [ ! -S /tmp/fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
"#;

const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
actual() { api GET /api/v1/vm.info | grep -o '"memory_actual_size":[0-9]*' | cut -d: -f2; }
configured() { api GET /api/v1/vm.info | sed -n 's/.*"memory":{[^}]*"size":\([0-9]*\).*/\1/p'; }
MEMORY='{"size":536870912,"hotplug_size":1073741824,"mergeable":false,"hotplug_method":"Acpi","shared":true,"hugepages":false,"prefault":false,"thp":true}'
FS='[{"tag":"share","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024,"id":"fs0","cache_size":33554432}]'
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":'$MEMORY',"fs":'$FS',"serial":{"mode":"File","file":"'$WORK'/serial.log"}}'
: > serial.log; tail -n +1 -f serial.log & TAIL=$!
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST before=$(actual) $(configured)"
echo "@@HOST grow=$(api PUT /api/v1/vm.resize '{"desired_ram":1073741824}')"
echo "@@HOST after=$(actual) $(configured)"
echo "@@HOST above=$(api PUT /api/v1/vm.resize '{"desired_ram":2147483648}')"
echo "@@HOST partial=$(api PUT /api/v1/vm.resize '{"desired_ram":1258291200}')"
echo "@@HOST shrink=$(api PUT /api/v1/vm.resize '{"desired_ram":536870912}')"
echo "@@HOST after_refusals=$(actual) $(configured)"
seen '@@GUEST done=1'
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
echo "@@HOST copy_md5=$(md5sum < share/copy.bin | cut -d' ' -f1)"
"#;

const GUEST_SCRIPT: &str = r#"
mem_kib() { sed -n "s/^$1: *\([0-9]*\) kB/\1/p" /proc/meminfo; }
wait_for() { i=0; until eval "$1"; do [ $i -ge 1200 ] && return 1; sleep 0.1; i=$((i+1)); done; }
# Free and managed pages of the zones only hot-added RAM can be in (boot
# RAM is all below 4 GiB, in DMA and DMA32).
high_zones() { awk '/^Node .* zone/ { z = $4 } z ~ /Normal|Movable/ && $1 == "nr_free_pages" { f += $2 } z ~ /Normal|Movable/ && $1 == "managed" { m += $2 } END { print f + 0, m + 0 }' /proc/zoneinfo; }
mkdir -p /mnt
BEFORE=$(mem_kib MemTotal)
echo "@@GUEST memtotal_before=$BEFORE"
echo "@@GUEST high_before=$(high_zones)"
echo "@@GUEST ready=1"
wait_for '[ $(mem_kib MemTotal) -gt $((BEFORE + 400 * 1024)) ]'
echo "@@GUEST memtotal_after=$(mem_kib MemTotal)"
# Hot-plugged RAM at 4 GiB: memory blocks 32..35 of 128 MiB.
echo "@@GUEST blocks=$(for b in 32 33 34 35; do cat /sys/devices/system/memory/memory$b/state 2>/dev/null || echo missing; done | tr '\n' ' ' | sed 's/ $//')"
dmesg | grep -i 'memory' | grep -i 'fail\|error' | sed 's/^/memhp: /'
echo "@@GUEST memhp_errors=$(dmesg | grep -i 'memory' | grep -ci 'fail\|error')"
# Fill RAM past what boot RAM could hold.
mkdir -p /fill && mount -t tmpfs -o size=900M tmpfs /fill
dd if=/dev/zero of=/fill/a bs=1M count=700 2>/dev/null; echo "@@GUEST fill_rc=$?"
echo "@@GUEST high_filled=$(high_zones)"
echo "@@GUEST shmem_kib=$(mem_kib Shmem)"
wait_for 'mount -t virtiofs share /mnt -o dax=always 2>/dev/null'; echo "@@GUEST dax_mount_rc=$?"
echo "@@GUEST dax_md5=$(md5sum < /mnt/data.bin | cut -d' ' -f1)"
echo "@@GUEST mmap_md5=$(daxprobe mmap-copy /mnt/data.bin /tmp/copy && md5sum < /tmp/copy | cut -d' ' -f1)"
rm -f /tmp/copy
umount /mnt
# Without DAX every byte goes in FUSE READ/WRITE buffers in guest RAM.
mount -t virtiofs share /mnt -o dax=never; echo "@@GUEST fuse_mount_rc=$?"
echo 3 > /proc/sys/vm/drop_caches
echo "@@GUEST fuse_md5=$(md5sum < /mnt/data.bin | cut -d' ' -f1)"
cp /mnt/data.bin /mnt/copy.bin && sync; echo "@@GUEST write_rc=$?"
umount /mnt
rm -f /fill/a
echo "@@GUEST done=1"
sleep 1
poweroff -f
"#;

fn pair(s: Option<&str>) -> (u64, u64) {
    let mut it = s
        .unwrap_or_default()
        .split(' ')
        .map(|v| v.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn ram_grows_by_acpi_hotplug_as_kata_resizes_it() {
    let guest = Guest::through_api_with_daemon(
        "memory_hotplug",
        GUEST_SCRIPT,
        HOST_BEFORE,
        API_SCRIPT,
        HOST_AFTER,
    )
    .expect("rig tools");
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.host("create"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");
    const MIB: u64 = 1 << 20;

    // vm.info before and after, as Kata reads it.
    assert_eq!(run.host("before"), Some("536870912 536870912"), "{tail}");
    assert_eq!(run.host("grow"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("after"), Some("1073741824 1073741824"), "{tail}");

    // The guest saw ~512 MiB more and onlined it by itself.
    let before: u64 = run
        .guest("memtotal_before")
        .and_then(|v| v.parse().ok())
        .expect(&tail);
    let after: u64 = run
        .guest("memtotal_after")
        .and_then(|v| v.parse().ok())
        .expect(&tail);
    let grown = after - before;
    assert!(
        (500 * 1024..=512 * 1024).contains(&grown),
        "MemTotal grew by {grown} KiB\n{tail}"
    );
    assert_eq!(
        run.guest("blocks"),
        Some("online online online online"),
        "{tail}"
    );
    assert_eq!(run.guest("memhp_errors"), Some("0"), "{tail}");
    assert_eq!(
        pair(run.guest("high_before")).1,
        0,
        "no high zone at boot\n{tail}"
    );

    // Memory past the boot size is usable, and used from the new zone.
    assert_eq!(run.guest("fill_rc"), Some("0"), "{tail}");
    let shmem: u64 = run
        .guest("shmem_kib")
        .and_then(|v| v.parse().ok())
        .expect(&tail);
    assert!(shmem >= 700 * 1024, "tmpfs holds {shmem} KiB\n{tail}");
    let (free, managed) = pair(run.guest("high_filled"));
    assert!(
        managed * 4096 >= 500 * MIB && free < managed / 2,
        "hot-added zone: {free} of {managed} pages free after the fill\n{tail}"
    );

    // Refusals and the no-op shrink leave the size where it was.
    let above = run.host("above").unwrap_or_default();
    assert!(
        above.starts_with("status=400")
            && above.contains("desired_ram=2147483648")
            && above.contains("1610612736"),
        "{above}\n{tail}"
    );
    let partial = run.host("partial").unwrap_or_default();
    assert!(
        partial.starts_with("status=400") && partial.contains("128 MiB"),
        "{partial}\n{tail}"
    );
    assert_eq!(run.host("shrink"), Some("status=204 body="), "{tail}");
    assert_eq!(
        run.host("after_refusals"),
        Some("1073741824 1073741824"),
        "{tail}"
    );

    // The share still works, through DAX and through FUSE buffers.
    let data = run.host("data_md5").expect(&tail);
    assert_eq!(run.guest("dax_mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("dax_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("mmap_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("fuse_mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("fuse_md5"), Some(data), "{tail}");
    assert_eq!(run.guest("write_rc"), Some("0"), "{tail}");
    assert_eq!(run.host("copy_md5"), Some(data), "{tail}");
    assert!(
        run.text()
            .contains("RAM: 536870912 bytes added at 0x100000000 (1 daemon(s) told)"),
        "{tail}"
    );
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new("memory_hotplug");
    results.record_run("ACPI memory hot-plug, 512 MiB + 512 MiB", &run);
    results.record("guest MemTotal growth (KiB)", grown.to_string());
    results.record(
        "hot-added zone after a 700 MiB fill (free/managed pages)",
        format!("{free}/{managed}"),
    );
    results.save().expect("write results");
}
