//! virtio-blk's part of the devices boot. Two disks at boot: a read-only
//! one holding an ext4 image built on the build host (`mke2fs -d`) and a
//! writable raw one with two queues, both found by their serial numbers
//! (GET_ID). The guest
//! - mounts the ext4 disk, reads a small file and a 4 MiB one (md5 as on
//!   the host), cannot write to it (the kernel took `VIRTIO_BLK_F_RO`: the
//!   disk shows read-only and opening it for writing fails) — and the
//!   host's image is unchanged afterwards;
//! - writes a pattern to the raw disk, reads it back after dropping its
//!   caches, discards a MiB of it (punched out of the host file), and
//!   times 16 MiB each way.
//!
//! PCI: the disks are in the VmConfig given to `vm.create`, as Kata's
//! client fills DiskConfig; a third disk is hot-added with `vm.add-disk`
//! (200 with its id and PCI address), read by the guest, and removed with
//! `vm.remove-device` (the guest ejects it); adding the writable disk's
//! image a second time is refused (the image lock).

use test_infra::images;
use test_infra::results::Results;
use test_infra::rig::{ImageFile, Run};

const MIB: u64 = 1 << 20;
const PATTERN: &str = "blk-pattern-0042";
const HOT_MARKER: &str = "hot-disk-marker7";

pub const GUEST_MODULES: &[&str] = &["virtio_blk"];

const GUEST_BOOT: &str = r#"
dev_of() { for b in /sys/block/vd*; do [ "$(cat $b/serial 2>/dev/null)" = "$1" ] && echo ${b##*/}; done; }
wait_for() { i=0; until eval "$1"; do [ $i -ge 1200 ] && return 1; sleep 0.1; i=$((i+1)); done; }
up() { cut -d' ' -f1 /proc/uptime; }
wait_for '[ -n "$(dev_of ro-ext4)" ] && [ -n "$(dev_of rw-raw)" ]'
RO=$(dev_of ro-ext4); RW=$(dev_of rw-raw)
echo "@@GUEST found=ro:${RO:+yes} rw:${RW:+yes}"
echo "@@GUEST ro_flags=$(cat /sys/block/$RO/ro) $(cat /sys/block/$RW/ro)"
echo "@@GUEST sectors=$(cat /sys/block/$RO/size) $(cat /sys/block/$RW/size)"
echo "@@GUEST rw_queues=$(ls /sys/block/$RW/mq | wc -l)"
mkdir -p /mnt; mount -t ext4 -o ro /dev/$RO /mnt; echo "@@GUEST mount_rc=$?"
echo "@@GUEST hello=$(cat /mnt/hello.txt)"
echo "@@GUEST big_md5=$(md5sum < /mnt/big.bin | cut -d' ' -f1)"
if echo x > /mnt/new.txt 2>/dev/null; then echo "@@GUEST fs_write=accepted"; else echo "@@GUEST fs_write=refused"; fi
umount /mnt
if dd if=/dev/zero of=/dev/$RO bs=4096 count=1 seek=1 conv=fsync 2>/dev/null; then echo "@@GUEST dev_write=accepted"; else echo "@@GUEST dev_write=refused"; fi
printf 'PATTERN' > /tmp/p; dd if=/tmp/p of=/dev/$RW bs=512 seek=8 conv=fsync 2>/dev/null; echo "@@GUEST rw_write_rc=$?"
echo 3 > /proc/sys/vm/drop_caches
echo "@@GUEST rw_readback=$(dd if=/dev/$RW bs=512 skip=8 count=1 2>/dev/null | head -c PATTERN_LEN)"
echo "@@GUEST discard_max=$(cat /sys/block/$RW/queue/discard_max_bytes)"
dd if=/dev/zero bs=1M count=1 2>/dev/null | tr '\000' '\377' | dd of=/dev/$RW bs=1M seek=1 conv=fsync 2>/dev/null
blkdiscard -o 1048576 -l 1048576 /dev/$RW 2>/dev/null; echo "@@GUEST discard_rc=$?"
t0=$(up); dd if=/dev/zero of=/dev/$RW bs=1M seek=2 count=16 conv=fsync 2>/dev/null; t1=$(up)
echo 3 > /proc/sys/vm/drop_caches
dd if=/dev/$RW of=/dev/null bs=1M skip=2 count=16 2>/dev/null; t2=$(up)
echo "@@GUEST write16_s=$(awk "BEGIN{print $t1-$t0}")"
echo "@@GUEST read16_s=$(awk "BEGIN{print $t2-$t1}")"
"#;

/// After the boot checks, PCI only: the hot-added disk (added by the host
/// once the guest said `ready`) is read, then the host removes it.
const GUEST_HOT: &str = r#"
wait_for '[ -n "$(dev_of hot-raw)" ]'
HOT=$(dev_of hot-raw)
echo "@@GUEST hot_marker=$(head -c HOT_LEN /dev/$HOT)"
echo "@@GUEST hot_used=1"
wait_for '[ -z "$(dev_of hot-raw)" ]'
echo "@@GUEST hot_gone=$([ -z "$(dev_of hot-raw)" ] && echo yes || echo no)"
echo "@@GUEST hotplug_errors=$(dmesg | grep -i 'acpiphp\|pci 0000:00' | grep -ci 'fail\|error\|conflict\|no space')"
"#;

const GUEST_END: &str = r#"
echo "@@GUEST blk_errors=$(dmesg | grep -ci 'virtio_blk.*\(error\|fail\)')"
sync
"#;

/// Images in L1's tmpfs (which can punch holes); the md5 of the read-only
/// one before the guest runs.
const HOST_BEFORE: &str = r#"
cp fs.img /tmp/ro.img; cp big.bin /tmp/big.bin
echo "@@HOST ro_md5=$(md5sum < /tmp/ro.img | cut -d' ' -f1)"
echo "@@HOST big_md5=$(md5sum < /tmp/big.bin | cut -d' ' -f1)"
dd if=/dev/zero of=/tmp/rw.img bs=1M count=20 2>/dev/null
dd if=/dev/zero of=/tmp/hot.img bs=1M count=4 2>/dev/null
printf 'HOT_MARKER' | dd of=/tmp/hot.img conv=notrunc 2>/dev/null
"#;

const HOST_AFTER: &str = r#"
echo "@@HOST ro_md5_after=$(md5sum < /tmp/ro.img | cut -d' ' -f1)"
echo "@@HOST rw_pattern=$(dd if=/tmp/rw.img bs=512 skip=8 count=1 2>/dev/null | head -c PATTERN_LEN)"
echo "@@HOST discarded_nonzero=$(dd if=/tmp/rw.img bs=1M skip=1 count=1 2>/dev/null | tr -d '\000' | wc -c)"
echo "@@HOST rw_kib_used=$(du -k /tmp/rw.img | cut -f1)"
"#;

/// The boot disks as Kata's client fills DiskConfig (every field it sends).
pub const CREATE_DISKS: &str = r#"[{"path":"/tmp/ro.img","readonly":true,"direct":false,"iommu":false,"num_queues":1,"queue_size":1024,"vhost_user":false,"image_type":"Raw","backing_files":false,"sparse":true,"pci_segment":0,"id":"ro","serial":"ro-ext4"},{"path":"/tmp/rw.img","num_queues":2,"queue_size":256,"id":"rw","serial":"rw-raw"}]"#;

/// Once the guest runs: the hot disk and the refusals.
const API_ADD: &str = r#"
echo "@@HOST add_disk=$(api PUT /api/v1/vm.add-disk '{"path":"/tmp/hot.img","readonly":true,"num_queues":1,"queue_size":128,"vhost_user":false,"image_type":"Raw","id":"hot","serial":"hot-raw"}')"
echo "@@HOST disk_add_again=$(api PUT /api/v1/vm.add-disk '{"path":"/tmp/hot.img","id":"hot"}')"
echo "@@HOST add_mmio=$(api PUT /api/v1/vm.add-disk '{"path":"/tmp/hot.img","id":"hot9","transport":"mmio"}')"
echo "@@HOST add_bad=$(api PUT /api/v1/vm.add-disk '{"path":"/tmp/hot.img","id":"hot8","queue_size":1000}')"
echo "@@HOST add_locked=$(api PUT /api/v1/vm.add-disk '{"path":"/tmp/rw.img","id":"rw2"}')"
echo "@@HOST info_plugged=$(api GET /api/v1/vm.info | grep -o '"id":"[a-z0-9_]*"' | tr '\n' ' ')"
"#;

/// In step with [`GUEST_HOT`].
const API_HOT: &str = r#"
seen '@@GUEST hot_used=1'
echo "@@HOST remove_hot=$(api PUT /api/v1/vm.remove-device '{"id":"hot"}')"
seen '@@GUEST hot_gone='
echo "@@HOST info_removed=$(api GET /api/v1/vm.info | grep -o '"id":"[a-z0-9_]*"' | tr '\n' ' ')"
"#;

/// The script fragments with their placeholders filled.
pub struct Scripts {
    pub guest_boot: String,
    pub guest_hot: String,
    pub guest_end: String,
    pub host_before: String,
    pub host_after: String,
    pub api_add: String,
    pub api_hot: String,
}

pub fn scripts() -> Scripts {
    let fill = |s: &str| {
        s.replace("PATTERN_LEN", &PATTERN.len().to_string())
            .replace("'PATTERN'", &format!("'{PATTERN}'"))
            .replace("HOT_LEN", &HOT_MARKER.len().to_string())
            .replace("'HOT_MARKER'", &format!("'{HOT_MARKER}'"))
    };
    Scripts {
        guest_boot: fill(GUEST_BOOT),
        guest_hot: fill(GUEST_HOT),
        guest_end: GUEST_END.into(),
        host_before: fill(HOST_BEFORE),
        host_after: fill(HOST_AFTER),
        api_add: API_ADD.into(),
        api_hot: API_HOT.into(),
    }
}

pub fn mmio_args() -> Vec<String> {
    vec![
        "--disk".into(),
        "path=/tmp/ro.img,readonly=on,serial=ro-ext4,transport=mmio".into(),
        "path=/tmp/rw.img,serial=rw-raw,num_queues=2,transport=mmio".into(),
    ]
}

/// The ext4 image and the big file to compare it with, for `$WORK`.
pub fn host_files() -> Vec<ImageFile> {
    let big = images::incompressible(4 * MIB);
    let files = [
        ("hello.txt", &b"hello from a read-only disk\n"[..]),
        ("big.bin", &big[..]),
    ];
    vec![
        ImageFile {
            path: "fs.img".into(),
            perm: 0o644,
            data: images::ext4_image("blk-ext4", 16 * MIB, &files),
        },
        ImageFile {
            path: "big.bin".into(),
            perm: 0o644,
            data: big,
        },
    ]
}

pub fn check(run: &Run, pci: bool, tail: &str) {
    assert_eq!(run.guest("found"), Some("ro:yes rw:yes"), "{tail}");
    assert_eq!(
        run.guest("ro_flags"),
        Some("1 0"),
        "F_RO reached the guest\n{tail}"
    );
    assert_eq!(
        run.guest("sectors"),
        Some(format!("{} {}", 16 * MIB / 512, 20 * MIB / 512).as_str()),
        "{tail}"
    );
    assert_eq!(run.guest("rw_queues"), Some("2"), "two queues\n{tail}");
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    assert_eq!(
        run.guest("hello"),
        Some("hello from a read-only disk"),
        "{tail}"
    );
    assert_eq!(run.guest("big_md5"), run.host("big_md5"), "{tail}");
    assert!(run.host("big_md5").is_some(), "{tail}");
    assert_eq!(run.guest("fs_write"), Some("refused"), "{tail}");
    assert_eq!(run.guest("dev_write"), Some("refused"), "{tail}");
    assert_eq!(run.host("ro_md5_after"), run.host("ro_md5"), "{tail}");
    assert_eq!(run.guest("rw_write_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("rw_readback"), Some(PATTERN), "{tail}");
    assert_eq!(run.host("rw_pattern"), Some(PATTERN), "{tail}");
    // Discard is offered where L1's tmpfs punches holes, and then the MiB
    // the guest filled with 0xff and discarded is zeroes in the host file.
    if discard_max(run, tail) > 0 {
        assert_eq!(run.guest("discard_rc"), Some("0"), "{tail}");
        assert_eq!(run.host("discarded_nonzero"), Some("0"), "{tail}");
    }
    assert_eq!(run.guest("blk_errors"), Some("0"), "{tail}");
    if pci {
        check_hot_plug(run, tail);
    }
}

fn discard_max(run: &Run, tail: &str) -> u64 {
    run.guest("discard_max")
        .and_then(|v| v.parse().ok())
        .expect(tail)
}

fn check_hot_plug(run: &Run, tail: &str) {
    let added = run.host("add_disk").unwrap_or_default();
    assert!(
        added.starts_with("status=200")
            && added.contains("\"id\":\"hot\"")
            && added.contains("\"bdf\":\"0000:00:"),
        "{added}\n{tail}"
    );
    assert!(
        run.host("disk_add_again")
            .is_some_and(|r| r.starts_with("status=409")),
        "{tail}"
    );
    assert!(
        run.host("add_mmio")
            .is_some_and(|r| r.starts_with("status=400") && r.contains("virtio-PCI only")),
        "{tail}"
    );
    assert!(
        run.host("add_bad")
            .is_some_and(|r| r.starts_with("status=400") && r.contains("queue_size")),
        "{tail}"
    );
    assert!(
        run.host("add_locked")
            .is_some_and(|r| r.contains("locked by another process")),
        "{tail}"
    );
    assert!(
        run.host("info_plugged")
            .is_some_and(|i| i.contains("\"id\":\"hot\"")),
        "{tail}"
    );
    assert_eq!(run.guest("hot_marker"), Some(HOT_MARKER), "{tail}");
    assert_eq!(run.host("remove_hot"), Some("status=204 body="), "{tail}");
    assert_eq!(run.guest("hot_gone"), Some("yes"), "{tail}");
    assert_eq!(run.guest("hotplug_errors"), Some("0"), "{tail}");
    assert!(
        run.host("info_removed")
            .is_some_and(|i| !i.contains("\"id\":\"hot\"") && i.contains("\"id\":\"rw\"")),
        "{tail}"
    );
}

pub fn record(results: &mut Results, run: &Run, transport: &str, tail: &str) {
    results.record(
        &format!("virtio-blk over virtio-{transport}: discard offered (discard_max_bytes)"),
        discard_max(run, tail).to_string(),
    );
    for (k, what) in [
        (
            "write16_s",
            "write 16 MiB to /dev/vdX (dd bs=1M conv=fsync)",
        ),
        (
            "read16_s",
            "read 16 MiB from /dev/vdX (dd bs=1M, caches dropped)",
        ),
    ] {
        results.record(
            &format!("virtio-blk over virtio-{transport}: {what}, guest clock"),
            format!("{} s", run.guest(k).unwrap_or("n/a")),
        );
    }
}
