//! The RX and TX paths through real split queues in test memory, with a
//! datagram socket pair standing in for the tap (it keeps frame
//! boundaries as a tap does).

use std::os::unix::net::UnixDatagram;

use virtio_bindings::virtio_net::VIRTIO_NET_HDR_GSO_TCPV4;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::super::header::{VnetHeader, OFFLOAD_FEATURES};
use super::*;
use crate::GuestMemoryMmap;

fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(
        addr,
        len,
        u16::try_from(flags).unwrap(),
        next,
    ))
}

fn pair() -> (UnixDatagram, UnixDatagram) {
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

fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
}

/// The used ring's (id, len) entries.
fn used(mem: &GuestMemoryMmap, vq: &MockSplitQueue<GuestMemoryMmap>, n: u64) -> Vec<(u32, u32)> {
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

fn frame(packet: &[u8]) -> Vec<u8> {
    let mut f = VnetHeader::default().to_bytes().to_vec();
    f.extend_from_slice(packet);
    f
}

#[test]
fn rx_fills_buffers_and_stops_reading_when_they_run_out() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    let w = VRING_DESC_F_WRITE;
    // Chain 0: 12 + 20 bytes split over two buffers. Chain 1: 8 bytes, too
    // small. Chain 2: a readable descriptor. Chain 3: 2 KiB.
    vq.build_multiple_desc_chains(&[
        desc(0x10000, 12, w | VRING_DESC_F_NEXT, 1),
        desc(0x11000, 20, w, 0),
        desc(0x12000, 8, w, 0),
        desc(0x13000, 100, 0, 0),
        desc(0x14000, 2048, w, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let packets: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 20]).collect();
    for p in &packets {
        peer.send(&frame(p)).unwrap();
    }
    // A runt without a header is dropped before any buffer is spent.
    peer.send(&[1, 2, 3]).unwrap();
    peer.send(&frame(b"last")).unwrap();
    let mut rx = RxPath::default();
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 4));
    assert!(rx.has_pending(), "the fifth frame waits for a buffer");
    assert!(drop.is_some());
    assert_eq!(used(&mem, &vq, 4), [(0, 32), (2, 0), (3, 0), (4, 32)]);
    let mut got = [0u8; 32];
    mem.read_slice(&mut got[..12], GuestAddress(0x10000))
        .unwrap();
    mem.read_slice(&mut got[12..], GuestAddress(0x11000))
        .unwrap();
    assert_eq!(VnetHeader::parse(&got).unwrap().num_buffers, 1);
    assert_eq!(&got[12..], &packets[0][..]);
    mem.read_slice(&mut got, GuestAddress(0x14000)).unwrap();
    assert_eq!(&got[12..], &packets[3][..]);
    assert_eq!((c.rx_frames, c.rx_dropped), (2, 2));

    // The guest gives buffers again (a fresh ring here): the waiting frame
    // goes first, the runt is dropped, then the rest, then the tap is dry.
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x20_0000), 16);
    vq.build_multiple_desc_chains(&[
        desc(0x30000, 2048, w, 0),
        desc(0x31000, 2048, w, 0),
        desc(0x32000, 2048, w, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::TapDrained, 2));
    assert_eq!(used(&mem, &vq, 2), [(0, 32), (1, 16)]);
    mem.read_slice(&mut got, GuestAddress(0x30000)).unwrap();
    assert_eq!(&got[12..], &packets[4][..]);
    let mut last = [0u8; 4];
    mem.read_slice(&mut last, GuestAddress(0x31000 + 12))
        .unwrap();
    assert_eq!(&last, b"last");
    assert!(!rx.has_pending());
    assert_eq!((c.rx_frames, c.rx_dropped, c.rx_bytes), (4, 3, 32 * 3 + 16));
}

#[test]
fn tx_gathers_checks_and_sends_each_chain_once() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 32);
    let n = VRING_DESC_F_NEXT;
    let tso = VnetHeader {
        flags: 1,
        gso_type: const { narrow::u8_of(VIRTIO_NET_HDR_GSO_TCPV4 as u64) },
        gso_size: 1448,
        hdr_len: 54,
        csum_start: 34,
        csum_offset: 16,
        num_buffers: 0,
    };
    mem.write_slice(&VnetHeader::default().to_bytes(), GuestAddress(0x10000))
        .unwrap();
    mem.write_slice(&tso.to_bytes(), GuestAddress(0x11000))
        .unwrap();
    let payload: Vec<u8> = (0..3000u32).map(|i| i.to_le_bytes()[0]).collect();
    mem.write_slice(&payload, GuestAddress(0x20000)).unwrap();
    vq.build_multiple_desc_chains(&[
        // 0: header, then the payload in two pieces.
        desc(0x10000, 12, n, 1),
        desc(0x20000, 1000, n, 2),
        desc(0x20000 + 1000, 2000, 0, 0),
        // 1: a TSO frame, refused when HOST_TSO4 was not acked.
        desc(0x11000, 12, n, 4),
        desc(0x20000, 3000, 0, 0),
        // 2: a device-writable descriptor.
        desc(0x10000, 12, n, 6),
        desc(0x20000, 100, VRING_DESC_F_WRITE, 0),
        // 3: longer than a frame may be.
        desc(0x10000, 12, n, 8),
        desc(0x20000, u32::try_from(MAX_FRAME_LEN).unwrap(), 0, 0),
        // 4: outside guest memory.
        desc(0x10000, 12, n, 10),
        desc(0x4000_0000, 100, 0, 0),
        // 5: lengths that overflow when added.
        desc(0x10000, u32::MAX, n, 12),
        desc(0x10000, u32::MAX, 0, 0),
        // 6: shorter than the header.
        desc(0x10000, 6, 0, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let mut tx = TxPath::default();
    let mut c = NetCounters::default();
    let acked = OFFLOAD_FEATURES & !(1 << virtio_bindings::virtio_net::VIRTIO_NET_F_HOST_TSO4);
    let (used_n, drop) = tx.process(&mut q, &mem, &tap, acked, &mut c).unwrap();
    assert_eq!(used_n, 7);
    assert!(matches!(
        drop,
        Some(ChainError::Header(HeaderError::Short(6)))
    ));
    assert!(used(&mem, &vq, 7).iter().all(|(_, len)| *len == 0));
    assert_eq!((c.tx_frames, c.tx_dropped, c.tx_bytes), (1, 6, 3012));
    let mut buf = vec![0u8; MAX_FRAME_LEN];
    let got = peer.recv(&mut buf).unwrap();
    assert_eq!(got, 3012);
    assert_eq!(&buf[12..got], &payload[..]);
    assert!(peer.recv(&mut buf).is_err(), "only one frame was sent");

    // With HOST_TSO4 acked the TSO frame goes through.
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x20_0000), 16);
    vq.build_multiple_desc_chains(&[desc(0x11000, 12, n, 1), desc(0x20000, 3000, 0, 0)])
        .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (used_n, drop) = tx
        .process(&mut q, &mem, &tap, OFFLOAD_FEATURES, &mut c)
        .unwrap();
    assert_eq!((used_n, drop.is_none()), (1, true));
    assert_eq!(peer.recv(&mut buf).unwrap(), 3012);
    assert_eq!(VnetHeader::parse(&buf).unwrap(), tso);
}
