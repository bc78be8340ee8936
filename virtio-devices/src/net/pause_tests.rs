//! Pausing, saving and restoring the device: TX and RX positions, nothing
//! moved while paused, RX buffers held for the next frame left to the
//! restored device, the MAC the guest knows taken back.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::test_util::{desc, frame, memory, pair};
use super::*;
use crate::device::Interrupt;
use crate::device_state::DeviceStateError;
use crate::test_util::ChannelInterrupt;

/// A tap stand-in: one end of a datagram socket pair.
struct FakeTap(UnixDatagram);

impl AsRawFd for FakeTap {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl FrameIo for FakeTap {}

impl TapLike for FakeTap {
    fn set_offload(&self, _: u32) -> std::io::Result<()> {
        Ok(())
    }
    fn offload_features(&self) -> u64 {
        0
    }
}

fn net(tap: &Arc<FakeTap>, mac: &str, mtu: Option<u16>) -> Net {
    Net::new(NetDeviceConfig {
        id: "net0".into(),
        tap: tap.clone(),
        mac: mac.parse().unwrap(),
        mtu,
        queue_size: 16,
        allowed_offloads: header::OFFLOAD_FEATURES,
        reopen: None,
    })
}

fn used_idx(mem: &GuestMemoryMmap, q: &MockSplitQueue<'_, GuestMemoryMmap>) -> u16 {
    mem.read_obj(q.used_addr().unchecked_add(2)).unwrap()
}

/// Waits until the used index reaches `want`; a bound for a hang, not a
/// speed figure.
fn wait_used(mem: &GuestMemoryMmap, q: &MockSplitQueue<'_, GuestMemoryMmap>, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while used_idx(mem, q) != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(used_idx(mem, q), want);
}

fn activate(
    dev: &mut Net,
    mem: &GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
) -> (EventFd, EventFd, Receiver<Interrupt>) {
    let kicks = (
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    let (itx, irx) = channel();
    dev.ack_features(1 << VIRTIO_F_VERSION_1);
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(itx))),
        vec![
            ActivatedQueue {
                index: 0,
                queue: rx,
                kick: kicks.0.try_clone().unwrap(),
            },
            ActivatedQueue {
                index: 1,
                queue: tx,
                kick: kicks.1.try_clone().unwrap(),
            },
        ],
    )
    .unwrap();
    (kicks.0, kicks.1, irx)
}

const RX_BUFS: u64 = 0x20_0000;
const TX_BUFS: u64 = 0x30_0000;

/// The n-th RX chain: one 2 KiB writable buffer at descriptor n.
fn rx_chain(q: &MockSplitQueue<'_, GuestMemoryMmap>, n: u16) {
    let at = RX_BUFS + u64::from(n) * 0x1000;
    q.add_desc_chains(&[desc(at, 2048, VRING_DESC_F_WRITE, 0)], n)
        .unwrap();
}

/// The n-th TX frame, "tx-<n>", at descriptor n.
fn tx_frame(mem: &GuestMemoryMmap, q: &MockSplitQueue<'_, GuestMemoryMmap>, n: u16) {
    let f = frame(format!("tx-{n}").as_bytes());
    let at = TX_BUFS + u64::from(n) * 0x100;
    mem.write_slice(&f, GuestAddress(at)).unwrap();
    q.add_desc_chains(&[desc(at, u32::try_from(f.len()).unwrap(), 0, 0)], n)
        .unwrap();
}

fn received(peer: &UnixDatagram) -> Vec<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while let Ok(n) = peer.recv(&mut buf) {
        got.push(String::from_utf8_lossy(&buf[VNET_HDR_LEN..n]).into_owned());
    }
    got
}

/// Waits for `n` frames at the peer (bounded, for a hang).
fn receive(peer: &UnixDatagram, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        got.extend(received(peer));
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// The RX frame in the `n`-th RX buffer.
fn delivered(mem: &GuestMemoryMmap, n: u64, len: usize) -> Vec<u8> {
    let mut got = vec![0u8; len];
    mem.read_slice(&mut got, GuestAddress(RX_BUFS + n * 0x1000 + 12))
        .unwrap();
    got
}

/// TX: 3 frames sent, paused at 3 of 3. RX: a frame delivered into the
/// first of two buffers; the second is held for the next frame, and the
/// saved RX position leaves it in the ring (1 of 1). Nothing moves while
/// paused (a frame from the host, a frame from the guest with its kick);
/// resumed, both go. Paused again with an RX buffer held, saved, a new
/// device (another MAC, as a random one would be) restored and activated
/// on the saved queues: it takes the held buffer again for the host's
/// next frame, sends the frame the guest queued while paused without a
/// new kick, and shows the saved MAC.
#[test]
fn positions_continue_across_pause_resume_and_restore() {
    let (ours, peer) = pair();
    let tap = Arc::new(FakeTap(ours));
    let mut dev = net(&tap, "52:54:00:12:34:56", None);
    let mem = memory();
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x10_0000), 16);
    let (rx_kick, tx_kick, irq) = activate(
        &mut dev,
        &mem,
        rxq.create_queue().unwrap(),
        txq.create_queue().unwrap(),
    );
    for n in 0..3 {
        tx_frame(&mem, &txq, n);
    }
    tx_kick.write(1).unwrap();
    wait_used(&mem, &txq, 3);
    assert_eq!(receive(&peer, 3), ["tx-0", "tx-1", "tx-2"]);
    rx_chain(&rxq, 0);
    rx_chain(&rxq, 1);
    rx_kick.write(1).unwrap();
    peer.send(&frame(b"rx-0")).unwrap();
    wait_used(&mem, &rxq, 1);
    assert_eq!(delivered(&mem, 0, 4), b"rx-0");

    let saved = dev.pause().unwrap();
    assert_eq!(saved.len(), 2);
    assert_eq!((saved[0].next_avail, saved[0].next_used), (1, 1), "RX");
    assert_eq!((saved[1].next_avail, saved[1].next_used), (3, 3), "TX");
    while irq.try_recv().is_ok() {}
    peer.send(&frame(b"rx-1")).unwrap();
    tx_frame(&mem, &txq, 3);
    tx_kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((used_idx(&mem, &rxq), used_idx(&mem, &txq)), (1, 3));
    assert!(received(&peer).is_empty(), "nothing sent while paused");
    assert!(irq.try_recv().is_err(), "no interrupt while paused");

    rx_chain(&rxq, 2);
    dev.resume().unwrap();
    wait_used(&mem, &rxq, 2);
    wait_used(&mem, &txq, 4);
    assert_eq!(delivered(&mem, 1, 4), b"rx-1");
    assert_eq!(receive(&peer, 1), ["tx-3"]);

    // The third RX buffer is held for the next frame now.
    let saved = dev.pause().unwrap();
    assert_eq!((saved[0].next_avail, saved[0].next_used), (2, 2), "RX");
    assert_eq!((saved[1].next_avail, saved[1].next_used), (4, 4), "TX");
    tx_frame(&mem, &txq, 4);
    tx_kick.write(1).unwrap(); // reaches the old process only
    peer.send(&frame(b"rx-2")).unwrap();
    let state = dev.save_state().unwrap();
    drop(dev);

    let mut dev = net(&tap, "02:00:00:00:00:01", None);
    dev.restore_state(&state).unwrap();
    let mut mac = [0u8; 6];
    dev.read_config(0, &mut mac);
    assert_eq!(mac, [0x52, 0x54, 0, 0x12, 0x34, 0x56], "the saved MAC");
    let (_rx_kick, _tx_kick, _irq) = activate(
        &mut dev,
        &mem,
        saved[0].to_queue().unwrap(),
        saved[1].to_queue().unwrap(),
    );
    wait_used(&mem, &txq, 5);
    assert_eq!(receive(&peer, 1), ["tx-4"]);
    wait_used(&mem, &rxq, 3);
    assert_eq!(
        delivered(&mem, 2, 4),
        b"rx-2",
        "into the buffer held before"
    );
    let head: u32 = mem
        .read_obj(rxq.used_addr().unchecked_add(4 + 8 * 2))
        .unwrap();
    assert_eq!(head, 2);
}

/// The saved MTU, queue size and offloads must be this device's, the MAC
/// one a device can have; a refusal names the field and applies nothing.
#[test]
fn a_restore_that_does_not_fit_is_refused_by_field() {
    let (ours, _peer) = pair();
    let tap = Arc::new(FakeTap(ours));
    let good = net(&tap, "52:54:00:12:34:56", Some(1400))
        .save_state()
        .unwrap();
    let mut dev = net(&tap, "02:00:00:00:00:01", Some(1400));
    for (field, value) in [
        ("mac", serde_json::json!("52:54:00:12:34")),
        ("mac", serde_json::json!("01:00:5e:00:00:01")),
        ("mac", serde_json::json!(7)),
        ("mtu", serde_json::json!(9000)),
        ("mtu", serde_json::json!(null)),
        ("queue_size", serde_json::json!(256)),
        ("offloads", serde_json::json!(1u64 << 7)),
    ] {
        let mut state = good.clone();
        state[field] = value.clone();
        match dev.restore_state(&state) {
            Err(DeviceStateError::Invalid { field: got, .. }) => {
                assert_eq!(got, field, "{value}")
            }
            other => panic!("{field} {value}: {other:?}"),
        }
        assert_eq!(
            dev.mac().to_string(),
            "02:00:00:00:00:01",
            "nothing applied"
        );
        assert!(!dev.restored);
    }
    assert!(dev.check_movable().is_ok());
    dev.restore_state(&good).unwrap();
    assert_eq!(dev.mac().to_string(), "52:54:00:12:34:56");
}
