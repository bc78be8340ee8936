//! The RX path through real split queues in test memory, with a datagram
//! socket pair standing in for the tap: frames read straight into the
//! guest's chains, merged over several, copied when the room is short,
//! kept while buffers are missing, and malformed chains refused.

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};

use super::super::header::VnetHeader;
use super::super::test_util::{desc, frame, memory, pair, used};
use super::*;
use crate::GuestMemoryMmap;

const W: u32 = VRING_DESC_F_WRITE;

/// A frame of `len` bytes, header included, with a recognisable packet.
fn big_frame(len: usize) -> Vec<u8> {
    let packet: Vec<u8> = (0..len - VNET_HDR_LEN)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    frame(&packet)
}

/// `count` one-buffer chains of `len` bytes from `at`, 64 KiB apart.
fn chains(count: u16, at: u64, len: u32) -> Vec<virtio_queue::desc::RawDescriptor> {
    (0..count)
        .map(|i| desc(at + u64::from(i) * 0x1_0000, len, W, 0))
        .collect()
}

fn read(mem: &GuestMemoryMmap, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(at)).unwrap();
    v
}

fn num_buffers(mem: &GuestMemoryMmap, at: u64) -> u16 {
    VnetHeader::parse(&read(mem, at, VNET_HDR_LEN))
        .unwrap()
        .num_buffers
}

#[test]
fn without_mrg_small_chains_get_copies_and_a_bad_chain_costs_no_frame() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    // Chain 0: 12 + 20 bytes over two buffers. Chain 2: 8 bytes, no room
    // for a header. Chain 3: a readable descriptor. Chain 4: 2 KiB.
    vq.build_multiple_desc_chains(&[
        desc(0x10000, 12, W | VRING_DESC_F_NEXT, 1),
        desc(0x11000, 20, W, 0),
        desc(0x12000, 8, W, 0),
        desc(0x13000, 100, 0, 0),
        desc(0x14000, 2048, W, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let packets: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 20]).collect();
    for p in &packets {
        peer.send(&frame(p)).unwrap();
    }
    peer.send(&[1, 2, 3]).unwrap();
    peer.send(&frame(b"last")).unwrap();
    let mut rx = RxPath::new(false);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    // The bad chains went back empty; the frames went to the good ones;
    // then the ring was empty and the tap was left with the rest.
    assert_eq!((progress, n), (RxProgress::NoBuffers, 4));
    assert!(!rx.has_pending(), "nothing is read without a buffer");
    assert!(matches!(drop, Some(ChainError::Direction(..))));
    assert_eq!(used(&mem, &vq, 4), [(0, 32), (2, 0), (3, 0), (4, 32)]);
    let mut got = read(&mem, 0x10000, 12);
    got.extend(read(&mem, 0x11000, 20));
    assert_eq!(VnetHeader::parse(&got).unwrap().num_buffers, 1);
    assert_eq!(&got[12..], &packets[0][..]);
    assert_eq!(&read(&mem, 0x14000 + 12, 20), &packets[1]);
    assert_eq!((c.rx_frames, c.rx_dropped), (2, 2));
    // No chain holds any frame: each was copied.
    assert_eq!(rx.bounced(), 2);

    // A fresh ring of three: the next three frames.
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x20_0000), 16);
    vq.build_multiple_desc_chains(&chains(3, 0x30_0000, 2048))
        .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 3));
    assert_eq!(used(&mem, &vq, 3), [(0, 32), (1, 32), (2, 32)]);
    assert_eq!(&read(&mem, 0x32_0000 + 12, 20), &packets[4]);

    // Then the runt is dropped, the last frame placed, the tap is dry.
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x20_0000), 16);
    vq.build_multiple_desc_chains(&chains(2, 0x30_0000, 2048))
        .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::TapDrained, 1));
    assert!(matches!(
        drop,
        Some(ChainError::Header(HeaderError::Short(3)))
    ));
    assert_eq!(used(&mem, &vq, 1), [(0, 16)]);
    assert_eq!(&read(&mem, 0x30_0000 + 12, 4), b"last");
    assert_eq!((c.rx_frames, c.rx_dropped, c.rx_bytes), (6, 3, 32 * 5 + 16));
}

#[test]
fn without_mrg_a_chain_for_any_frame_is_read_into_without_a_copy() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    let room = u32::try_from(MAX_FRAME_LEN - 12).unwrap();
    vq.build_multiple_desc_chains(&[
        desc(0x10_0000, 12, W | VRING_DESC_F_NEXT, 1),
        desc(0x11_0000, room, W, 0),
        desc(0x13_0000, 4096, W, 0),
    ])
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let f = big_frame(3012);
    peer.send(&f).unwrap();
    let mut rx = RxPath::new(false);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!(
        (progress, n, drop.is_none()),
        (RxProgress::TapDrained, 1, true)
    );
    assert_eq!(rx.bounced(), 0);
    assert_eq!(used(&mem, &vq, 1), [(0, 3012)]);
    assert_eq!(num_buffers(&mem, 0x10_0000), 1);
    assert_eq!(read(&mem, 0x11_0000, 3000), &f[12..]);
    // The next chain (4 KiB) is held for the next frame.
    assert_eq!(rx.held_chains(), 1);
}

#[test]
fn with_mrg_a_64k_frame_spans_merged_buffers_in_one_read() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 32);
    vq.build_multiple_desc_chains(&chains(20, 0x10_0000, 4096))
        .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let f = big_frame(MAX_FRAME_LEN);
    peer.send(&f).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!(
        (progress, n, drop.is_none()),
        (RxProgress::TapDrained, 17, true)
    );
    assert_eq!(rx.bounced(), 0, "read straight into the guest's buffers");
    let mut want: Vec<(u32, u32)> = (0..16).map(|i| (i, 4096)).collect();
    want.push((16, u32::try_from(MAX_FRAME_LEN - 16 * 4096).unwrap()));
    assert_eq!(used(&mem, &vq, 17), want);
    assert_eq!(num_buffers(&mem, 0x10_0000), 17);
    let mut got = Vec::new();
    for i in 0..17u64 {
        let len = (MAX_FRAME_LEN - got.len()).min(4096);
        got.extend(read(&mem, 0x10_0000 + i * 0x1_0000, len));
    }
    assert_eq!(&got[12..], &f[12..]);
    assert_eq!(rx.held_chains(), 3);
    assert_eq!((c.rx_frames, c.rx_bytes), (1, MAX_FRAME_LEN as u64));

    // Three chains hold less than any frame may be: the next frame is
    // copied into the first of them.
    peer.send(&big_frame(100)).unwrap();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::TapDrained, 1));
    assert_eq!(rx.bounced(), 1);
    assert_eq!(used(&mem, &vq, 18)[17], (17, 100));
    assert_eq!(num_buffers(&mem, 0x10_0000 + 17 * 0x1_0000), 1);
}

#[test]
fn with_mrg_num_buffers_lands_in_a_header_split_over_two_descriptors() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 32);
    // The first chain: 11 bytes, then 4085 (num_buffers straddles them).
    let mut descs = vec![
        desc(0x10_0000, 11, W | VRING_DESC_F_NEXT, 1),
        desc(0x3f_0000, 4085, W, 0),
    ];
    descs.extend(chains(16, 0x11_0000, 4096));
    vq.build_multiple_desc_chains(&descs).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let f = big_frame(6000);
    peer.send(&f).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!(rx.bounced(), 0);
    assert_eq!(used(&mem, &vq, 2), [(0, 4096), (2, 6000 - 4096)]);
    assert_eq!(read(&mem, 0x10_0000 + 10, 1), [2]);
    assert_eq!(read(&mem, 0x3f_0000, 2), [0, f[12]]);
    let mut got = read(&mem, 0x10_0000, 11);
    got.extend(read(&mem, 0x3f_0000, 4085));
    got.extend(read(&mem, 0x11_0000, 6000 - 4096));
    assert_eq!(&got[12..], &f[12..]);
}

#[test]
fn with_mrg_a_frame_waits_for_enough_buffers_and_the_tap_is_left_alone() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 16);
    vq.add_desc_chains(&chains(2, 0x10_0000, 4096), 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let first = big_frame(10_000);
    let second = big_frame(200);
    peer.send(&first).unwrap();
    peer.send(&second).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 0));
    assert!(rx.has_pending());
    assert_eq!(c, NetCounters::default(), "nothing delivered, nothing lost");
    // Asked again without new buffers: still waiting, the tap not read.
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n, rx.bounced()), (RxProgress::NoBuffers, 0, 1));

    // One more chain: the frame goes over three; the ring is empty again
    // and the second frame stays in the tap.
    vq.add_desc_chains(&chains(1, 0x12_0000, 4096), 2).unwrap();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 3));
    assert_eq!(
        used(&mem, &vq, 3),
        [(0, 4096), (1, 4096), (2, 10_000 - 8192)]
    );
    assert_eq!(num_buffers(&mem, 0x10_0000), 3);
    let mut got = read(&mem, 0x10_0000, 4096);
    got.extend(read(&mem, 0x11_0000, 4096));
    got.extend(read(&mem, 0x12_0000, 10_000 - 8192));
    assert_eq!(&got[12..], &first[12..]);
    assert!(!rx.has_pending());

    vq.add_desc_chains(&chains(1, 0x13_0000, 4096), 3).unwrap();
    // The last chain used, the path waits for buffers before it reads on.
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 1));
    assert_eq!(used(&mem, &vq, 4)[3], (3, 200));
    assert_eq!(read(&mem, 0x13_0000 + 12, 188), &second[12..]);
    assert_eq!((c.rx_frames, c.rx_dropped, c.rx_bytes), (2, 0, 10_200));
}

#[test]
fn a_frame_no_buffers_can_hold_is_dropped_and_the_chains_go_back() {
    let mem = memory();
    let (tap, peer) = pair();
    // With MRG_RXBUF: a ring of four 16-byte chains holds 64 bytes at most.
    let vq = MockSplitQueue::new(&mem, 4);
    vq.add_desc_chains(&chains(4, 0x10_0000, 16), 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    peer.send(&big_frame(100)).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 4));
    assert!(matches!(
        drop,
        Some(ChainError::RxNoRoom {
            frame: 100,
            room: 64
        })
    ));
    assert_eq!(used(&mem, &vq, 4), [(0, 0), (1, 0), (2, 0), (3, 0)]);
    assert!(!rx.has_pending());
    assert_eq!((c.rx_frames, c.rx_dropped), (0, 1));

    // Without it: a 64-byte chain for a 100-byte frame.
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x20_0000), 4);
    vq.add_desc_chains(&chains(2, 0x10_0000, 64), 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    peer.send(&big_frame(100)).unwrap();
    peer.send(&big_frame(60)).unwrap();
    let mut rx = RxPath::new(false);
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 2));
    assert_eq!(used(&mem, &vq, 2), [(0, 0), (1, 60)]);
    assert_eq!((c.rx_frames, c.rx_dropped), (1, 2));
}

#[test]
fn malformed_chains_go_back_empty_and_counted_and_frames_find_the_good_one() {
    // Two regions that touch at 2 MiB.
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x20_0000),
        (GuestAddress(0x20_0000), 0x20_0000),
    ])
    .unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    vq.add_desc_chains(
        &[
            desc(0x10_0000, 100, 0, 0),
            desc(0x1000_0000, 100, W, 0),
            desc(0x20_0000 - 50, 100, W, 0),
            desc(0x11_0000, 8, W, 0),
            desc(0x12_0000, 2048, W, 0),
        ],
        0,
    )
    .unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    peer.send(&big_frame(62)).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::NoBuffers, 5));
    assert!(matches!(drop, Some(ChainError::RxChainShort(8))));
    assert_eq!(
        used(&mem, &vq, 5),
        [(0, 0), (1, 0), (2, 0), (3, 0), (4, 62)]
    );
    assert_eq!((c.rx_frames, c.rx_dropped), (1, 4));
}

#[test]
fn with_mrg_a_runt_read_into_held_chains_is_dropped_and_they_stay() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 32);
    vq.add_desc_chains(&chains(17, 0x10_0000, 4096), 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    peer.send(&[9; 5]).unwrap();
    peer.send(&big_frame(70)).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, drop) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::TapDrained, 1));
    assert!(matches!(
        drop,
        Some(ChainError::Header(HeaderError::Short(5)))
    ));
    assert_eq!(used(&mem, &vq, 1), [(0, 70)]);
    assert_eq!(num_buffers(&mem, 0x10_0000), 1);
    assert_eq!((c.rx_frames, c.rx_dropped, rx.bounced()), (1, 1, 0));
    assert_eq!(rx.held_chains(), 16);
}

#[test]
fn with_mrg_held_buffers_stop_at_one_readv_worth_and_the_frame_is_copied() {
    let mem = memory();
    let vq = MockSplitQueue::new(&mem, 2048);
    // 1100 chains of 60 bytes: 66000 bytes in all, but only 1024 buffers
    // (61440 bytes) are held, less than a frame may be.
    let descs: Vec<_> = (0..1100u64)
        .map(|i| desc(0x10_0000 + i * 64, 60, W, 0))
        .collect();
    vq.add_desc_chains(&descs, 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let (tap, peer) = pair();
    let f = big_frame(3000);
    peer.send(&f).unwrap();
    let mut rx = RxPath::new(true);
    let mut c = NetCounters::default();
    let (progress, n, _) = rx.process(&mut q, &mem, &tap, &mut c).unwrap();
    assert_eq!((progress, n), (RxProgress::TapDrained, 50));
    assert_eq!(rx.bounced(), 1);
    assert_eq!(num_buffers(&mem, 0x10_0000), 50);
    let u = used(&mem, &vq, 50);
    assert!(u.iter().all(|(_, len)| *len == 60));
    let mut got = Vec::new();
    for i in 0..50u64 {
        got.extend(read(&mem, 0x10_0000 + i * 64, 60));
    }
    assert_eq!(&got[12..], &f[12..]);
}
