//! virtio-pmem over virtio-MMIO and over virtio-PCI in real guests. For each
//! transport, one emulated host runs the VMM twice:
//! 1. three devices at once, on both transports — a 128 MiB shared one (extended from a 16 MiB
//!    file), a pre-formatted ext4 image, a `discard_writes=on` one; the guest
//!    finds them through the DSDT, checks sizes, times 64 MiB through
//!    /dev/pmem with dd, writes a pattern, mounts the ext4 one with `-o dax`;
//! 2. the first device again: the guest reads the pattern back.
//!
//! The host checks its files afterwards.

use test_infra::images;
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile};

const PATTERN: &str = "DAXVMM-PMEM-PATTERN";
const MIB: u64 = 1 << 20;

/// Finds each device by its size, as probe order is not fixed.
const GUEST_SCRIPT: &str = r#"
dev_of_size() { for b in /sys/block/pmem*; do [ "$(( $(cat $b/size) * 512 ))" = "$1" ] && echo /dev/${b##*/}; done; }
up() { cut -d' ' -f1 /proc/uptime; }
i=0; while [ "$(ls /dev/pmem* 2>/dev/null | wc -l)" -lt "$(grep -o 'pmem_count=[0-9]*' /proc/cmdline | cut -d= -f2)" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST pmem_devices=$(ls /dev/pmem* 2>/dev/null | tr '\n' ' ')"
echo "@@GUEST mmio_devices=$(ls /sys/bus/platform/drivers/virtio-mmio 2>/dev/null | grep -c LNRO0005)"
echo "@@GUEST pci_pmem_devices=$(grep -l 0x105b /sys/bus/pci/devices/*/device 2>/dev/null | wc -l)"
P0=$(dev_of_size 134217728)
if grep -q phase=2 /proc/cmdline; then
    echo "@@GUEST phase2_readback=$(dd if=$P0 bs=4096 skip=1 count=1 2>/dev/null | head -c PATTERN_LEN)"
    exit 0
fi
P1=$(dev_of_size 16777216); P2=$(dev_of_size 4194304)
echo "@@GUEST sizes_found=${P0:+128M}${P1:+,16M}${P2:+,4M}"
t0=$(up); dd if=/dev/zero of=$P0 bs=1M count=64 conv=fsync 2>/dev/null; t1=$(up)
echo 3 > /proc/sys/vm/drop_caches
dd if=$P0 of=/dev/null bs=1M count=64 2>/dev/null; t2=$(up)
echo "@@GUEST write64_s=$(awk "BEGIN{print $t1-$t0}")"
echo "@@GUEST read64_s=$(awk "BEGIN{print $t2-$t1}")"
printf 'PATTERN' > /tmp/pattern
dd if=/tmp/pattern of=$P0 bs=4096 seek=1 conv=fsync 2>/dev/null
dd if=/tmp/pattern of=$P2 bs=4096 seek=1 conv=fsync 2>/dev/null
sync
echo "@@GUEST readback=$(dd if=$P0 bs=4096 skip=1 count=1 2>/dev/null | head -c PATTERN_LEN)"
mkdir -p /mnt && mount -t ext4 -o dax $P1 /mnt; echo "@@GUEST mount_rc=$?"
echo "@@GUEST mount_opts=$(grep " /mnt " /proc/mounts | cut -d' ' -f4)"
echo "@@GUEST queue_dax=$(cat /sys/block/${P1##*/}/queue/dax)"
echo "@@GUEST dax_complaints=$(dmesg | grep -i 'dax' | grep -ci 'unsupported\|disabl\|not supported')"
echo "@@GUEST hello=$(cat /mnt/hello.txt)"
echo written-by-guest > /mnt/guest.txt && sync && umount /mnt && echo "@@GUEST umount=ok"
echo "@@GUEST ecam=$(dmesg | grep -c 'ECAM \[mem 0xe0000000-0xe00fffff\].*reserved')"
echo "@@GUEST msix_irqs=$(grep -c 'PCI-MSIX' /proc/interrupts)"
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn pmem_over_mmio() {
    pmem_test("mmio", "pci");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn pmem_over_pci() {
    pmem_test("pci", "mmio");
}

/// The shared and discard_writes devices use `transport`, the ext4 one
/// `other`: two transports at once.
fn pmem_test(transport: &str, other: &str) {
    let script = GUEST_SCRIPT
        .replace("PATTERN_LEN", &PATTERN.len().to_string())
        .replace("'PATTERN'", &format!("'{PATTERN}'"));
    let mut guest = Guest::new(&format!("pmem-{transport}"), &script);
    guest.cpus = 2;
    guest.cmdline = "pmem_count=3".into();
    guest.guest_modules = vec!["virtio_mmio".into(), "nd_pmem".into(), "virtio_pmem".into()];
    guest.host_files = vec![ImageFile {
        path: "fs.img".into(),
        perm: 0o644,
        data: images::ext4_image("ext4", 16 * MIB, &[("hello.txt", b"hello from the host\n")]),
    }];
    guest.host_before = "dd if=/dev/zero of=pmem.img bs=1M count=16 2>/dev/null\n\
                         dd if=/dev/zero of=discard.img bs=1M count=4 2>/dev/null"
        .into();
    guest.vmm_args = vec![
        "--pmem".into(),
        format!("file=pmem.img,size=128M,transport={transport},id=pm0"),
        format!("file=fs.img,transport={other},id=fs"),
        format!("file=discard.img,discard_writes=on,transport={transport},id=ro"),
    ];
    let cmdline2 = guest
        .cmdline()
        .replace("pmem_count=3", "pmem_count=1 phase=2");
    guest.host_after = format!(
        "echo \"@@HOST file_bytes=$(wc -c < pmem.img)\"\n\
         echo \"@@HOST pattern=$(dd if=pmem.img bs=4096 skip=1 count=1 2>/dev/null | head -c {len})\"\n\
         echo \"@@HOST discard_nonzero=$(tr -d '\\000' < discard.img | wc -c)\"\n\
         echo \"@@HOST ext4_has_guest_file=$(grep -c written-by-guest fs.img)\"\n\
         \"$VMM\" --kernel \"$KERNEL\" --initramfs \"$INITRAMFS\" --cmdline '{cmdline2}' --cpus boot=1 --memory size=512M \
           --pmem file=pmem.img,transport={transport} </dev/null\n\
         echo \"@@HOST vmm2_exit=$?\"",
        len = PATTERN.len()
    );
    let run = rig::run(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    let (mmio, pci) = if transport == "mmio" {
        ("2", "1")
    } else {
        ("1", "2")
    };
    // Only the first boot reports these; the second has one device.
    assert_eq!(run.guest("mmio_devices"), Some(mmio), "{tail}");
    assert_eq!(run.guest("pci_pmem_devices"), Some(pci), "{tail}");
    assert_eq!(run.guest("sizes_found"), Some("128M,16M,4M"), "{tail}");
    assert_eq!(run.guest("readback"), Some(PATTERN), "{tail}");
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    assert!(
        run.guest("mount_opts")
            .is_some_and(|o| o.split(',').any(|x| x.starts_with("dax"))),
        "{tail}"
    );
    // 6.12's ext4 logs nothing when DAX works and fails the mount with
    // "DAX unsupported by block device" when it cannot: the mount succeeding
    // with dax=always on a queue that advertises DAX is the evidence.
    assert_eq!(run.guest("queue_dax"), Some("1"), "{tail}");
    assert_eq!(run.guest("dax_complaints"), Some("0"), "{tail}");
    assert_eq!(run.guest("hello"), Some("hello from the host"), "{tail}");
    assert_eq!(run.guest("umount"), Some("ok"), "{tail}");
    // Linux takes ECAM from the MCFG table (the range is reserved in e820).
    assert_eq!(run.guest("ecam"), Some("1"), "{tail}");
    // virtio-PCI devices interrupt through MSI-X (config + one queue each).
    let msix: u32 = run
        .guest("msix_irqs")
        .and_then(|v| v.parse().ok())
        .expect(&tail);
    assert!(
        msix >= 2,
        "expected MSI-X vectors in /proc/interrupts, found {msix}\n{tail}"
    );
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    // The 16 MiB file was extended to size=128M; the guest's writes are in it
    // and in the ext4 image; the discard_writes file is untouched.
    assert_eq!(
        run.host("file_bytes"),
        Some((128 * MIB).to_string().as_str()),
        "{tail}"
    );
    assert_eq!(run.host("pattern"), Some(PATTERN), "{tail}");
    assert_eq!(run.host("discard_nonzero"), Some("0"), "{tail}");
    assert_eq!(run.host("ext4_has_guest_file"), Some("1"), "{tail}");
    // Second boot of the same file.
    assert_eq!(run.guest("phase2_readback"), Some(PATTERN), "{tail}");
    assert_eq!(run.host("vmm2_exit"), Some("0"), "{tail}");

    let mut results = Results::new(&format!("pmem-{transport}"));
    results.record_run(&format!("pmem over virtio-{transport}"), &run);
    for (k, what) in [
        (
            "write64_s",
            "write 64 MiB to /dev/pmem (dd bs=1M conv=fsync)",
        ),
        (
            "read64_s",
            "read 64 MiB from /dev/pmem (dd bs=1M, caches dropped)",
        ),
    ] {
        results.record(
            &format!("virtio-{transport}: {what}, guest clock"),
            format!("{} s", run.guest(k).unwrap_or("n/a")),
        );
    }
    results.save().expect("write results");
}
