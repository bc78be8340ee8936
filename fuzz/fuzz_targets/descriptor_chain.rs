//! Descriptor chains split into readable and writable byte streams, then
//! read, written and turned into iovecs at offsets and lengths the input
//! chooses: nothing may touch memory outside the chain's buffers.
#![no_main]

use daemon::fuse::chain::split;
use dax_vmm_fuzz::{memory, queue_from, take};
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddress, GuestMemoryBackend};

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let mut q = queue_from(&mem, data);
    let Ok(iter) = q.iter(&mem) else { return };
    let mut pos = data.len().saturating_sub(16);
    for chain in iter {
        let Ok((mut r, mut w)) = split(&mem, chain) else {
            continue;
        };
        let (a, b) = (
            take::<2>(data, &mut pos) as usize,
            take::<2>(data, &mut pos) as usize,
        );
        let readable = r.available();
        if let Ok(iovs) = r.iovecs(a) {
            assert!(a <= readable);
            for iov in iovs {
                let start = iov.iov_base as u64;
                let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
                assert!(
                    start >= host && start + iov.iov_len as u64 <= host + dax_vmm_fuzz::MEM_SIZE
                );
            }
        }
        if let Ok(bytes) = r.read_bytes(a) {
            assert_eq!(bytes.len(), a);
            assert_eq!(r.available(), readable - a);
        }
        let writable = w.available();
        let payload = vec![0x5a; b.min(4096)];
        if w.write_at(a % 64, &payload).is_ok() {
            assert!(a % 64 + payload.len() <= writable);
        }
        let _ = w.iovecs(a % 64, b);
    }
});
