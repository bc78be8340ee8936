//! The virtio-blk request parser on arbitrary descriptor chains, and the
//! disk I/O each accepted request turns into: every chain parses to an
//! answer or a refusal, an accepted request lies inside the disk and
//! guest memory, and running it never crashes.
#![no_main]

use std::sync::OnceLock;

use dax_vmm_fuzz::{memory, queue_from};
use libfuzzer_sys::fuzz_target;
use virtio_devices::block::request::{parse, Action, DiskLimits, ID_BYTES, SECTOR_SIZE};
use virtio_devices::block::DiskFile;
use virtio_queue::QueueT;

/// 128 sectors; the fuzzer's writes land in it and stay there.
fn disk() -> &'static DiskFile {
    static DISK: OnceLock<DiskFile> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("blk-fuzz-{}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 128 * 512]).expect("disk image");
        let disk = DiskFile::open(&path, false, false).expect("disk image");
        let _ = std::fs::remove_file(&path);
        disk
    })
}

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let mut q = queue_from(&mem, data);
    let flags = data.last().copied().unwrap_or(0);
    let limits = DiskLimits {
        capacity: disk().sectors(),
        readonly: flags & 1 == 1,
        discard: flags & 2 == 2 && disk().can_discard(),
        write_zeroes: flags & 4 == 4 && disk().can_write_zeroes(),
        max_segments: 16,
        max_ranges: 4,
        max_range_sectors: 64,
    };
    while let Some(chain) = q.pop_descriptor_chain(&mem) {
        let descriptors = chain.map(|d| (d.addr(), d.len(), d.is_write_only()));
        let request = parse(&mem, descriptors, &limits);
        let Ok(action) = request.action else {
            continue;
        };
        assert!(
            request.status.is_some(),
            "an accepted request has a status byte"
        );
        let end = limits.capacity * SECTOR_SIZE;
        match &action {
            Action::Read { offset, data } | Action::Write { offset, data } => {
                let len: u64 = data.iter().map(|s| s.len).sum();
                assert!(offset + len <= end && len.is_multiple_of(SECTOR_SIZE));
                assert!(!(limits.readonly && matches!(action, Action::Write { .. })));
            }
            Action::Discard(r) | Action::WriteZeroes(r) => {
                assert!(!limits.readonly && r.len() <= 4);
                assert!(r.iter().all(|r| r.offset + r.len <= end));
            }
            Action::Flush | Action::GetId { .. } => {}
        }
        let _ = disk().execute(&mem, &action, &[b'f'; ID_BYTES]);
    }
});
