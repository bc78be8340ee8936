//! virtio-blk's serve loop (the queue thread's passes over the available
//! ring, the requests it hands to the I/O threads run and completed
//! inline) on arbitrary descriptor chains and ring indices: the loop ends
//! (a bound on the passes, and libFuzzer's timeout for one that spins), an
//! available index more than the queue's size ahead stops the queue with
//! the device marked broken, and a valid one never does by itself.
#![no_main]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use dax_vmm_fuzz::{memory, queue_at_indices};
use libfuzzer_sys::fuzz_target;
use virtio_devices::block::io::{serve_inline, Shared, COUNTER_NAMES};
use virtio_devices::block::request::{DiskLimits, ID_BYTES};
use virtio_devices::block::DiskFile;
use virtio_devices::{DeviceCounters, Interrupt, VirtioInterrupt};
use vmm_sys_util::eventfd::EventFd;

struct NoInterrupt;

impl VirtioInterrupt for NoInterrupt {
    fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
        Ok(())
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}

/// 128 sectors; the fuzzer's writes land in it and stay there.
fn disk() -> Arc<DiskFile> {
    static DISK: OnceLock<Arc<DiskFile>> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("blk-queue-fuzz-{}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 128 * 512]).expect("disk image");
        let disk = DiskFile::open(&path, false, false).expect("disk image");
        let _ = std::fs::remove_file(&path);
        Arc::new(disk)
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let (queue, impossible) = queue_at_indices(&mem, data);
    let disk = disk();
    let shared = Shared {
        name: "virtio-blk fuzz".into(),
        limits: DiskLimits {
            capacity: disk.sectors(),
            readonly: false,
            discard: disk.can_discard(),
            write_zeroes: disk.can_write_zeroes(),
            max_segments: 16,
            max_ranges: 4,
            max_range_sectors: 64,
        },
        disk,
        serial: [b'f'; ID_BYTES],
        counters: DeviceCounters::new(&COUNTER_NAMES),
        broken: AtomicBool::new(false),
    };
    let served = serve_inline(&shared, queue, &mem, Arc::new(NoInterrupt), 8);
    if impossible {
        assert!(served.is_err(), "an impossible available index was served");
    }
    assert_eq!(served.is_err(), shared.broken.load(Ordering::SeqCst));
});
