//! virtio-pmem over virtio-MMIO in a real guest: the guest finds the device
//! through the DSDT, sees /dev/pmem0 of the configured size, and what it
//! writes and syncs is in the host's backing file after power-off.
//! (virtio-PCI comes with the PCI root bus.)

use guest_tests::rig::{self, Guest};

const PATTERN: &str = "DAXVMM-PMEM-PATTERN";

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn pmem_over_mmio_writes_reach_the_host_file() {
    let script = format!(
        r#"
i=0; while [ ! -b /dev/pmem0 ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST pmem_bytes=$(( $(cat /sys/block/pmem0/size) * 512 ))"
echo "@@GUEST virtio_mmio_devices=$(ls /sys/bus/platform/drivers/virtio-mmio 2>/dev/null | grep -c LNRO0005)"
printf '{PATTERN}' > /tmp/pattern
dd if=/tmp/pattern of=/dev/pmem0 bs=4096 seek=1 conv=fsync 2>/dev/null
sync
echo "@@GUEST readback=$(dd if=/dev/pmem0 bs=4096 skip=1 count=1 2>/dev/null | head -c {len})"
"#,
        len = PATTERN.len()
    );
    let mut guest = Guest::new("pmem-mmio", &script);
    guest.cpus = 2;
    guest.guest_modules = vec!["virtio_mmio".into(), "nd_pmem".into(), "virtio_pmem".into()];
    guest.host_before = "dd if=/dev/zero of=pmem.img bs=1M count=16 2>/dev/null".into();
    guest.vmm_args = vec!["--pmem".into(), "file=pmem.img,size=32M,transport=mmio,id=pm0".into()];
    guest.host_after = format!(
        "echo \"@@HOST file_bytes=$(wc -c < pmem.img)\"\necho \"@@HOST pattern=$(dd if=pmem.img bs=4096 skip=1 count=1 2>/dev/null | head -c {})\"",
        PATTERN.len()
    );
    let run = rig::run(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.guest("virtio_mmio_devices"), Some("1"), "{tail}");
    assert_eq!(run.guest("pmem_bytes"), Some((32u64 << 20).to_string().as_str()), "{tail}");
    assert_eq!(run.guest("readback"), Some(PATTERN), "{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    // The 16 MiB file was extended to size=32M, and the guest's write is in it.
    assert_eq!(run.host("file_bytes"), Some((32u64 << 20).to_string().as_str()), "{tail}");
    assert_eq!(run.host("pattern"), Some(PATTERN), "{tail}");
}
