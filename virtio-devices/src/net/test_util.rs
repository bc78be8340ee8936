//! What the RX and TX tests share: test memory, a datagram socket pair
//! standing in for the tap (it keeps frame boundaries as a tap does), and
//! readers of the used ring.

use std::os::unix::net::UnixDatagram;

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};

use super::header::VnetHeader;
use crate::GuestMemoryMmap;

pub fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(
        addr,
        len,
        u16::try_from(flags).unwrap(),
        next,
    ))
}

pub fn pair() -> (UnixDatagram, UnixDatagram) {
    let (a, b) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    // Room for a few maximum-size frames in the stand-in's queue.
    for s in [&a, &b] {
        let size: libc::c_int = 1 << 20;
        // SAFETY: SO_SNDBUF reads an int from the pointer given.
        unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(s),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&size as *const libc::c_int).cast(),
                4,
            )
        };
    }
    (a, b)
}

pub fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
}

/// The used ring's (id, len) entries.
pub fn used(
    mem: &GuestMemoryMmap,
    vq: &MockSplitQueue<GuestMemoryMmap>,
    n: u64,
) -> Vec<(u32, u32)> {
    (0..n)
        .map(|i| {
            let at = vq.used_addr().unchecked_add(4 + 8 * i);
            (
                mem.read_obj::<u32>(at).unwrap(),
                mem.read_obj::<u32>(at.unchecked_add(4)).unwrap(),
            )
        })
        .collect()
}

pub fn frame(packet: &[u8]) -> Vec<u8> {
    let mut f = VnetHeader::default().to_bytes().to_vec();
    f.extend_from_slice(packet);
    f
}
