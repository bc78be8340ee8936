//! The device without a guest: config space, features, and frames moved
//! both ways by its own thread through real queues, with a datagram socket
//! pair standing in for the tap.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::mpsc::channel;
use std::sync::Mutex;
use std::time::Duration;

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::header::VnetHeader;
use super::*;
use crate::device::Interrupt;
use crate::test_util::ChannelInterrupt;

/// A tap stand-in that records the offloads it was given.
struct FakeTap {
    sock: UnixDatagram,
    offload: Mutex<Vec<u32>>,
    offers: u64,
}

impl AsRawFd for FakeTap {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl FrameIo for FakeTap {}

impl TapLike for FakeTap {
    fn set_offload(&self, flags: u32) -> std::io::Result<()> {
        self.offload.lock().unwrap().push(flags);
        Ok(())
    }
    fn offload_features(&self) -> u64 {
        self.offers
    }
}

fn device(mtu: Option<u16>, offers: u64) -> (Net, Arc<FakeTap>, UnixDatagram) {
    let (a, b) = UnixDatagram::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let tap = Arc::new(FakeTap {
        sock: a,
        offload: Mutex::new(Vec::new()),
        offers,
    });
    let net = Net::new(NetDeviceConfig {
        id: "net0".into(),
        tap: tap.clone(),
        mac: "52:54:00:12:34:56".parse().unwrap(),
        mtu,
        queue_size: 16,
        allowed_offloads: header::OFFLOAD_FEATURES,
        reopen: None,
    });
    (net, tap, b)
}

fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(
        addr,
        len,
        u16::try_from(flags).unwrap(),
        next,
    ))
}

#[test]
fn config_space_and_features() {
    let (net, _, _) = device(None, header::OFFLOAD_FEATURES);
    assert_eq!(net.device_type(), 1);
    assert_eq!(net.queue_max_sizes(), &[16, 16]);
    let f = net.features();
    for bit in [
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_STATUS,
        VIRTIO_NET_F_CSUM,
        VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_MRG_RXBUF,
    ] {
        assert_ne!(f & (1 << bit), 0, "bit {bit}");
    }
    assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
    assert_eq!(f & (1 << VIRTIO_NET_F_MTU), 0, "no MTU unless configured");
    let mut cfg = [0u8; 12];
    net.read_config(0, &mut cfg);
    assert_eq!(&cfg[..6], &[0x52, 0x54, 0, 0x12, 0x34, 0x56]);
    assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1, "link up");
    assert_eq!(u16::from_le_bytes([cfg[8], cfg[9]]), 1, "one queue pair");

    let (net, _, _) = device(Some(1400), 0);
    assert_ne!(net.features() & (1 << VIRTIO_NET_F_MTU), 0);
    assert_eq!(
        net.features() & header::OFFLOAD_FEATURES,
        0,
        "the tap offers none"
    );
    let mut mtu = [0u8; 2];
    net.read_config(10, &mut mtu);
    assert_eq!(u16::from_le_bytes(mtu), 1400);
}

#[test]
fn frames_move_both_ways_through_the_devices_thread() {
    let (mut net, tap, peer) = device(None, header::OFFLOAD_FEATURES);
    let acked =
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_GUEST_CSUM) | (1 << VIRTIO_NET_F_CSUM);
    net.ack_features(acked);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x10_0000), 16);
    rxq.build_multiple_desc_chains(&[desc(0x20_0000, 2048, VRING_DESC_F_WRITE, 0)])
        .unwrap();
    let mut hdr = VnetHeader::default().to_bytes().to_vec();
    hdr.extend_from_slice(b"from the guest");
    mem.write_slice(&hdr[..12], GuestAddress(0x30_0000))
        .unwrap();
    mem.write_slice(&hdr[12..], GuestAddress(0x30_1000))
        .unwrap();
    txq.build_multiple_desc_chains(&[
        desc(0x30_0000, 12, VRING_DESC_F_NEXT, 1),
        desc(0x30_1000, 14, 0, 0),
    ])
    .unwrap();
    let (rx_kick, tx_kick) = (
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    let queues = vec![
        ActivatedQueue {
            index: 0,
            queue: rxq.create_queue::<Queue>().unwrap(),
            kick: rx_kick.try_clone().unwrap(),
        },
        ActivatedQueue {
            index: 1,
            queue: txq.create_queue::<Queue>().unwrap(),
            kick: tx_kick.try_clone().unwrap(),
        },
    ];
    let (itx, irx) = channel();
    net.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(itx))),
        queues,
    )
    .unwrap();
    assert_eq!(*tap.offload.lock().unwrap(), [libc::TUN_F_CSUM]);

    // Host → guest: the tap becomes readable, the frame lands in the RX
    // buffer and queue 0 is interrupted.
    let mut frame = VnetHeader::default().to_bytes().to_vec();
    frame.extend_from_slice(b"from the host");
    peer.send(&frame).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(0)
    );
    let mut got = vec![0u8; frame.len()];
    mem.read_slice(&mut got, GuestAddress(0x20_0000)).unwrap();
    assert_eq!(&got[12..], b"from the host");
    let used_len = mem
        .read_obj::<u32>(rxq.used_addr().unchecked_add(8))
        .unwrap();
    assert_eq!(used_len as usize, frame.len());

    // Guest → host on a TX kick.
    tx_kick.write(1).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(1)
    );
    let mut buf = [0u8; 64];
    let n = peer.recv(&mut buf).unwrap();
    assert_eq!(&buf[12..n], b"from the guest");

    // With no RX buffer left, a second frame waits (the tap is not
    // watched); a reset stops the thread and the device can start again.
    peer.send(&frame).unwrap();
    assert!(irx.recv_timeout(Duration::from_millis(200)).is_err());
    assert!(net.reset());
    let _ = rx_kick;

    // vm.counters: one frame each way, the bytes with their vnet header;
    // the waiting frame was neither delivered nor dropped.
    let counters = net
        .counters()
        .expect("virtio-net keeps counters")
        .snapshot();
    assert_eq!(
        counters,
        [
            ("rx_bytes", frame.len() as u64),
            ("rx_frames", 1),
            ("tx_bytes", hdr.len() as u64),
            ("tx_frames", 1),
            ("rx_dropped", 0),
            ("tx_dropped", 0)
        ]
    );
}

/// With EVENT_IDX the guest kicks only at the ring index the device last
/// asked for (the used ring's `avail_event`, 0 until the device writes it):
/// after sending a frame the device asks for the next TX chain, and once a
/// frame waits with no RX buffer it asks for the next RX buffer — which,
/// added and kicked, gets the frame.
#[test]
fn with_event_idx_the_device_asks_for_the_next_kicks() {
    use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
    let (mut net, _tap, peer) = device(None, header::OFFLOAD_FEATURES);
    assert_ne!(net.features() & (1 << VIRTIO_RING_F_EVENT_IDX), 0);
    net.ack_features((1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
    let size = 16u16;
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), size);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x10_0000), size);
    // The mock lays its used ring over the avail ring's `used_event`:
    // each queue's used ring goes a page further instead.
    let (rx_used, tx_used) = (GuestAddress(0x8000), GuestAddress(0x10_8000));
    let relocated = |q: &MockSplitQueue<GuestMemoryMmap>, used: GuestAddress| {
        let mut queue = q.create_queue::<Queue>().unwrap();
        queue.set_used_ring_address(Some(u32::try_from(used.0).unwrap()), Some(0));
        queue
    };
    let avail_event = |used: GuestAddress| {
        mem.read_obj::<u16>(used.unchecked_add(4 + 8 * u64::from(size)))
            .unwrap()
    };
    rxq.build_multiple_desc_chains(&[desc(0x20_0000, 2048, VRING_DESC_F_WRITE, 0)])
        .unwrap();
    let mut frame = VnetHeader::default().to_bytes().to_vec();
    frame.extend_from_slice(b"a frame");
    mem.write_slice(&frame, GuestAddress(0x30_0000)).unwrap();
    txq.build_multiple_desc_chains(&[desc(0x30_0000, u32::try_from(frame.len()).unwrap(), 0, 0)])
        .unwrap();
    let (rx_kick, tx_kick) = (
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    let (itx, irx) = channel();
    net.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(itx))),
        vec![
            ActivatedQueue {
                index: 0,
                queue: relocated(&rxq, rx_used),
                kick: rx_kick.try_clone().unwrap(),
            },
            ActivatedQueue {
                index: 1,
                queue: relocated(&txq, tx_used),
                kick: tx_kick.try_clone().unwrap(),
            },
        ],
    )
    .unwrap();
    tx_kick.write(1).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(1)
    );
    let mut buf = [0u8; 64];
    let n = peer.recv(&mut buf).unwrap();
    assert_eq!(&buf[12..n], b"a frame");
    assert_eq!(avail_event(tx_used), 1, "the next TX chain is asked for");

    // Two frames, one buffer: the first is delivered, the second waits
    // and the device asks for a kick at the next buffer.
    peer.send(&frame).unwrap();
    peer.send(&frame).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(0)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while avail_event(rx_used) != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "RX avail_event stayed {}",
            avail_event(rx_used)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The guest wants an interrupt once used entry 1 is in (`used_event`;
    // left at 0 it would ask for none after the first, which the device
    // honours too), adds a buffer at ring slot 1 and kicks, as Linux would.
    let avail = rxq.avail_addr();
    mem.write_obj(1u16, avail.unchecked_add(4 + 2 * u64::from(size)))
        .unwrap();
    let chain = desc(0x21_0000, 2048, VRING_DESC_F_WRITE, 0);
    mem.write_obj(chain, rxq.desc_table_addr().unchecked_add(16))
        .unwrap();
    mem.write_obj(1u16, avail.unchecked_add(4 + 2)).unwrap();
    mem.write_obj(2u16, avail.unchecked_add(2)).unwrap();
    rx_kick.write(1).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(0)
    );
    let mut got = vec![0u8; frame.len()];
    mem.read_slice(&mut got, GuestAddress(0x21_0000)).unwrap();
    assert_eq!(
        got[12..],
        frame[12..],
        "the waiting frame reached the new buffer"
    );
    assert!(net.reset());
}

/// With MRG_RXBUF acked, the worker's RX path merges: a frame larger than
/// one buffer spans two chains (without it, it would be dropped).
#[test]
fn with_mrg_rxbuf_acked_a_frame_spans_two_receive_chains() {
    let (mut net, _tap, peer) = device(None, 0);
    net.ack_features((1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_MRG_RXBUF));
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x10_0000), 16);
    rxq.build_multiple_desc_chains(&[
        desc(0x20_0000, 2048, VRING_DESC_F_WRITE, 0),
        desc(0x21_0000, 2048, VRING_DESC_F_WRITE, 0),
    ])
    .unwrap();
    let kick = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let (itx, irx) = channel();
    net.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(itx))),
        vec![
            ActivatedQueue {
                index: 0,
                queue: rxq.create_queue::<Queue>().unwrap(),
                kick: kick(),
            },
            ActivatedQueue {
                index: 1,
                queue: txq.create_queue::<Queue>().unwrap(),
                kick: kick(),
            },
        ],
    )
    .unwrap();
    let mut frame = VnetHeader::default().to_bytes().to_vec();
    frame.resize(3000, 0x42);
    peer.send(&frame).unwrap();
    assert_eq!(
        irx.recv_timeout(Duration::from_secs(5)).unwrap(),
        Interrupt::Queue(0)
    );
    let used = |i: u64| {
        let at = rxq.used_addr().unchecked_add(4 + 8 * i);
        (
            mem.read_obj::<u32>(at).unwrap(),
            mem.read_obj::<u32>(at.unchecked_add(4)).unwrap(),
        )
    };
    assert_eq!([used(0), used(1)], [(0, 2048), (1, 952)]);
    let mut header = [0u8; 12];
    mem.read_slice(&mut header, GuestAddress(0x20_0000))
        .unwrap();
    assert_eq!(VnetHeader::parse(&header).unwrap().num_buffers, 2);
    assert!(net.reset());
}
