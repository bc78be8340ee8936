//! Descriptor chains split into readable and writable byte streams, then
//! read, written and turned into buffers (guest RAM iovecs or DAX window
//! stretches, with a window the input places) at offsets and lengths the
//! input chooses: nothing may touch memory outside the chain's buffers, and
//! no window stretch may leave the window.
#![no_main]

use api::WindowLocation;
use daemon::fuse::chain::{split, Buf};
use dax_vmm_fuzz::{daemon_memory, queue_from, take, take_u16};
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddress, GuestMemoryBackend};

fuzz_target!(|data: &[u8]| {
    let mem = daemon_memory();
    let mut q = queue_from(&mem, data);
    let Ok(iter) = q.iter(&mem) else { return };
    let mut pos = data.len().saturating_sub(16);
    for chain in iter {
        let Ok((mut r, mut w)) = split(&mem, chain) else {
            continue;
        };
        let (a, b) = (
            usize::from(take_u16(data, &mut pos)),
            usize::from(take_u16(data, &mut pos)),
        );
        let window = WindowLocation {
            gpa: take::<2>(data, &mut pos) << 12,
            size: (take::<1>(data, &mut pos) + 1) << 12,
        };
        let readable = r.available();
        if let Ok(bufs) = r.bufs(a, Some(window)) {
            assert!(a <= readable);
            for buf in bufs {
                match buf {
                    Buf::Ram(iov) => {
                        let start = iov.iov_base as u64;
                        let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
                        assert!(
                            start >= host
                                && start + iov.iov_len as u64 <= host + dax_vmm_fuzz::MEM_SIZE
                        );
                    }
                    Buf::Window { offset, len } => {
                        assert!(offset + len as u64 <= window.size);
                    }
                }
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
        let _ = w.bufs(a % 64, b, Some(window));
    }
});
