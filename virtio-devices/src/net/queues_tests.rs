//! The TX path through real split queues in test memory, with a datagram
//! socket pair standing in for the tap.

use virtio_bindings::virtio_net::VIRTIO_NET_HDR_GSO_TCPV4;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::super::header::{VnetHeader, OFFLOAD_FEATURES};
use super::super::test_util::{desc, memory, pair, used};
use super::*;
use crate::GuestMemoryMmap;

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
    let mut tx = TxPath;
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

#[test]
fn tx_header_split_over_descriptors_is_checked_and_the_frame_goes_out_whole() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    let n = VRING_DESC_F_NEXT;
    let csum = VnetHeader {
        flags: 1,
        csum_start: 34,
        csum_offset: 16,
        ..VnetHeader::default()
    };
    let h = csum.to_bytes();
    // The header as 5 + 0 + 7 bytes, the 7 followed by the packet's first
    // bytes in the same buffer, then the rest.
    mem.write_slice(&h[..5], GuestAddress(0x10000)).unwrap();
    let mut second = h[5..].to_vec();
    second.extend_from_slice(&[0xa5; 93]);
    mem.write_slice(&second, GuestAddress(0x11000)).unwrap();
    mem.write_slice(&[0x5a; 400], GuestAddress(0x12000))
        .unwrap();
    // A checksum past the end of a short packet: refused although the
    // header is whole only across buffers.
    vq.build_multiple_desc_chains(&[
        desc(0x10000, 5, n, 1),
        desc(0x13000, 0, n, 2),
        desc(0x11000, 100, n, 3),
        desc(0x12000, 400, 0, 0),
        desc(0x10000, 5, n, 5),
        desc(0x11000, 40, 0, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let mut c = NetCounters::default();
    let (used_n, drop) = TxPath
        .process(&mut q, &mem, &tap, OFFLOAD_FEATURES, &mut c)
        .unwrap();
    assert_eq!(used_n, 2);
    assert!(matches!(
        drop,
        Some(ChainError::Header(HeaderError::ChecksumOutside {
            len: 33,
            ..
        }))
    ));
    assert_eq!((c.tx_frames, c.tx_dropped, c.tx_bytes), (1, 1, 505));
    let mut buf = vec![0u8; MAX_FRAME_LEN];
    let got = peer.recv(&mut buf).unwrap();
    let mut want = h.to_vec();
    want.extend_from_slice(&[0xa5; 93]);
    want.extend_from_slice(&[0x5a; 400]);
    assert_eq!(&buf[..got], &want[..]);
    assert!(peer.recv(&mut buf).is_err(), "only one frame was sent");
}

#[test]
fn tx_chains_across_regions_or_of_too_many_buffers_are_dropped() {
    // Two regions that touch at 2 MiB.
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x20_0000),
        (GuestAddress(0x20_0000), 0x20_0000),
    ])
    .unwrap();
    let vq = MockSplitQueue::new(&mem, 4096);
    let n = VRING_DESC_F_NEXT;
    mem.write_slice(&VnetHeader::default().to_bytes(), GuestAddress(0x10_0000))
        .unwrap();
    // 0: 100 bytes across the regions' boundary. 1: the header and 1022
    // one-byte buffers (1023 in all: sent). 2: the header and 1023 (too
    // many vectors for one writev with the header's copy).
    let mut descs = vec![desc(0x10_0000, 12, n, 1), desc(0x20_0000 - 50, 100, 0, 0)];
    for (first, count) in [(2u16, 1022u16), (1025, 1023)] {
        descs.push(desc(0x10_0000, 12, n, first + 1));
        for i in 0..count {
            let at = first + 1 + i;
            let (flags, next) = if i + 1 == count { (0, 0) } else { (n, at + 1) };
            descs.push(desc(0x11_0000 + u64::from(i), 1, flags, next));
        }
    }
    vq.add_desc_chains(&descs, 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let mut c = NetCounters::default();
    let (used_n, drop) = TxPath.process(&mut q, &mem, &tap, 0, &mut c).unwrap();
    assert_eq!(used_n, 3);
    assert!(matches!(drop, Some(ChainError::TooManyBuffers)), "{drop:?}");
    assert_eq!((c.tx_frames, c.tx_dropped, c.tx_bytes), (1, 2, 12 + 1022));
    let mut buf = vec![0u8; MAX_FRAME_LEN];
    assert_eq!(peer.recv(&mut buf).unwrap(), 12 + 1022);
    assert!(peer.recv(&mut buf).is_err());
}

/// A TSO header the tap's kernel would take with its offsets pointing
/// elsewhere (the checksum at UDP's offset 6) is dropped and counted, and
/// never reaches the tap.
#[test]
fn tx_tso_with_a_wrong_checksum_offset_is_dropped_and_counted() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    let bad = VnetHeader {
        flags: 1,
        gso_type: const { narrow::u8_of(VIRTIO_NET_HDR_GSO_TCPV4 as u64) },
        gso_size: 1448,
        hdr_len: 54,
        csum_start: 34,
        csum_offset: 6,
        num_buffers: 0,
    };
    mem.write_slice(&bad.to_bytes(), GuestAddress(0x10000))
        .unwrap();
    vq.build_multiple_desc_chains(&[
        desc(0x10000, 12, VRING_DESC_F_NEXT, 1),
        desc(0x20000, 3000, 0, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let mut c = NetCounters::default();
    let (used_n, drop) = TxPath
        .process(&mut q, &mem, &tap, OFFLOAD_FEATURES, &mut c)
        .unwrap();
    assert_eq!(used_n, 1);
    assert!(matches!(
        drop,
        Some(ChainError::Header(HeaderError::TcpChecksumOffset(6)))
    ));
    assert_eq!((c.tx_frames, c.tx_dropped), (0, 1));
    let mut buf = vec![0u8; MAX_FRAME_LEN];
    assert!(peer.recv(&mut buf).is_err(), "nothing reached the tap");
}
