//! Pausing, saving and restoring the device: positions, nothing served
//! while paused, and the transport reset a restored device posts so the
//! guest drops the connections that died with the old process; a
//! migration's switch that gives the socket path up and binds it again.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};

use super::packet::*;
use super::*;
use crate::device::Interrupt;
use crate::test_util::CountingInterrupt;

const RX_BUF: u64 = 0x8_0000;
const TX_BUF: u64 = 0x9_0000;
const EVENT_BUF: u64 = 0xa_0000;

fn used_idx(mem: &GuestMemoryMmap, q: &MockSplitQueue<GuestMemoryMmap>) -> u16 {
    mem.read_obj::<u16>(q.used_addr().unchecked_add(2)).unwrap()
}

/// Waits until the used index reaches `n`; a bound for a hang, not a speed
/// figure.
fn wait_used(mem: &GuestMemoryMmap, q: &MockSplitQueue<GuestMemoryMmap>, n: u16) {
    let end = Instant::now() + Duration::from_secs(30);
    while used_idx(mem, q) != n && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(used_idx(mem, q), n);
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("vsock-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The guest asks for host port 6000 (no listener there): the device
/// answers RST on RX.
fn request(slot: u16) -> Header {
    Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 700 + u32::from(slot),
        dst_port: 6000,
        len: 0,
        type_: TYPE_STREAM,
        op: OP_REQUEST,
        flags: 0,
        buf_alloc: 65536,
        fwd_cnt: 0,
    }
}

fn activate(
    dev: &mut Vsock,
    mem: &GuestMemoryMmap,
    queues: Vec<virtio_queue::Queue>,
) -> (Vec<EventFd>, Arc<CountingInterrupt>) {
    let interrupt = Arc::new(CountingInterrupt::default());
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let queues = queues
        .into_iter()
        .zip(&kicks)
        .enumerate()
        .map(|(i, (queue, k))| ActivatedQueue {
            index: u16::try_from(i).unwrap(),
            queue,
            kick: k.try_clone().unwrap(),
        })
        .collect();
    dev.ack_features(dev.features());
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        interrupt.clone(),
        queues,
    )
    .unwrap();
    (kicks, interrupt)
}

/// Three TX requests answered with three RSTs: paused at 3 of 3 on both.
/// A fourth request kicked while paused stays in the ring, a host
/// process's CONNECT waits, and nothing is raised; resumed, both reach the
/// guest, and no event is posted (the connections live on in this
/// process). Paused again with a fifth request kicked for the old process
/// only, saved, and restored into a new device on the same socket:
/// activated on the saved queues it answers the fifth without a kick, its
/// used entries follow the old ones, and the event queue carries a
/// transport reset (id 0, 4 bytes) with an interrupt.
#[test]
fn positions_continue_and_a_restored_device_posts_a_transport_reset() {
    let dir = scratch_dir("pause");
    let path = dir.join("v.sock");
    let mut dev = Vsock::new("vs".into(), 3, path.clone()).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let [rxq, txq, evq] =
        [0, 0x1_0000, 0x2_0000].map(|at| MockSplitQueue::create(&mem, GuestAddress(at), 16));
    let rx_buf = |n: u16| {
        let d = SplitDescriptor::new(
            RX_BUF + u64::from(n) * 0x1000,
            44 + 64,
            const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
            0,
        );
        rxq.add_desc_chains(&[RawDescriptor::from(d)], n).unwrap();
    };
    let tx_packet = |n: u16| {
        let at = TX_BUF + u64::from(n) * 0x100;
        mem.write_slice(&request(n).to_bytes(), GuestAddress(at))
            .unwrap();
        let d = SplitDescriptor::new(at, 44, 0, 0);
        txq.add_desc_chains(&[RawDescriptor::from(d)], n).unwrap();
    };
    let header_at = |n: u64| {
        let mut b = [0u8; HEADER_LEN];
        mem.read_slice(&mut b, GuestAddress(RX_BUF + n * 0x1000))
            .unwrap();
        Header::from_bytes(&b)
    };
    let rst_port = |n: u64| {
        let h = header_at(n);
        assert_eq!(h.op, OP_RST);
        h.dst_port
    };
    let (kicks, interrupt) = activate(
        &mut dev,
        &mem,
        [&rxq, &txq, &evq].map(|q| q.create_queue().unwrap()).into(),
    );
    for n in 0..3 {
        rx_buf(n);
        tx_packet(n);
    }
    kicks[1].write(1).unwrap();
    wait_used(&mem, &txq, 3);
    wait_used(&mem, &rxq, 3);
    assert_eq!((rst_port(0), rst_port(2)), (700, 702));

    let saved = dev.pause().unwrap();
    let at = |i: usize| (saved[i].next_avail, saved[i].next_used);
    assert_eq!((at(0), at(1), at(2)), ((3, 3), (3, 3), (0, 0)));
    let raised = interrupt.0.load(Ordering::SeqCst);
    rx_buf(3);
    rx_buf(4);
    tx_packet(3);
    // The host side goes on while paused, but what it owes the guest waits.
    let mut host = std::os::unix::net::UnixStream::connect(&path).unwrap();
    std::io::Write::write_all(&mut host, b"CONNECT 5000\n").unwrap();
    let event = SplitDescriptor::new(
        EVENT_BUF,
        8,
        const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
        0,
    );
    mem.write_obj(u32::MAX, GuestAddress(EVENT_BUF)).unwrap();
    evq.add_desc_chains(&[RawDescriptor::from(event)], 0)
        .unwrap();
    for k in &kicks {
        k.write(1).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((used_idx(&mem, &rxq), used_idx(&mem, &txq)), (3, 3));
    assert_eq!(interrupt.0.load(Ordering::SeqCst), raised, "nothing raised");

    dev.resume().unwrap();
    wait_used(&mem, &txq, 4);
    wait_used(&mem, &rxq, 5);
    let mut answered = [3, 4].map(|n| (header_at(n).op, header_at(n).dst_port));
    answered.sort();
    assert_eq!(answered, [(OP_REQUEST, 5000), (OP_RST, 703)]);
    assert_eq!(used_idx(&mem, &evq), 0, "no event without a restore");

    let saved = dev.pause().unwrap();
    let at = |i: usize| (saved[i].next_avail, saved[i].next_used);
    assert_eq!((at(0), at(1), at(2)), ((5, 5), (4, 4), (0, 0)));
    rx_buf(5);
    tx_packet(4);
    kicks[1].write(1).unwrap(); // reaches the old process only
    let state = dev.save_state().unwrap();
    assert_eq!(state, serde_json::json!({"cid": 3}));
    drop(dev);

    let mut dev = Vsock::new("vs".into(), 3, path.clone()).unwrap();
    dev.restore_state(&state).unwrap();
    let (_kicks, interrupt) = activate(
        &mut dev,
        &mem,
        saved.iter().map(|s| s.to_queue().unwrap()).collect(),
    );
    wait_used(&mem, &evq, 1);
    assert_eq!(
        mem.read_obj::<u32>(GuestAddress(EVENT_BUF)).unwrap(),
        VIRTIO_VSOCK_EVENT_TRANSPORT_RESET_ID
    );
    let event_len: u32 = mem.read_obj(evq.used_addr().unchecked_add(8)).unwrap();
    assert_eq!(event_len, 4);
    wait_used(&mem, &txq, 5);
    wait_used(&mem, &rxq, 6);
    assert_eq!(rst_port(5), 704);
    let head: u32 = mem
        .read_obj(rxq.used_addr().unchecked_add(4 + 8 * 5))
        .unwrap();
    assert_eq!(head, 5, "the sixth used entry names the sixth buffer");
    drop(host);
    assert!(interrupt.0.load(Ordering::SeqCst) >= 1);
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The id a transport reset carries (virtio 1.2 §5.10.6.6.1).
const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET_ID: u32 = 0;

/// The saved cid must be the configured one; a refusal names the field
/// and applies nothing (no transport reset at the next activation).
#[test]
fn a_restore_with_another_cid_is_refused_by_field() {
    let dir = scratch_dir("cid");
    let mut dev = Vsock::new("vs".into(), 3, dir.join("v.sock")).unwrap();
    assert!(dev.check_movable().is_ok());
    assert_eq!(dev.pause().unwrap(), Vec::new(), "not activated");
    dev.resume().unwrap();
    for (state, field) in [
        (serde_json::json!({"cid": 4}), "cid"),
        (serde_json::json!({"cid": "three"}), "cid"),
        (serde_json::json!({}), "cid"),
        (serde_json::json!({"cid": 3, "port": 1}), "port"),
        (serde_json::json!([3]), "state"),
    ] {
        match dev.restore_state(&state) {
            Err(DeviceStateError::Invalid { field: got, .. }) => assert_eq!(got, field, "{state}"),
            other => panic!("{state}: {other:?}"),
        }
        assert!(!dev.restored, "{state}: nothing applied");
    }
    let e = dev
        .restore_state(&serde_json::json!({"cid": 4}))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "virtio-vsock vs: saved state: cid: saved 4, configured 3"
    );
    dev.restore_state(&serde_json::json!({"cid": 3})).unwrap();
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reset goes into the first event buffer that can hold it (a
/// smaller one is used empty), once; with no buffer it stays pending
/// until the driver gives one.
#[test]
fn the_transport_reset_waits_for_a_buffer_that_holds_it() {
    struct NoInterrupt;
    impl VirtioInterrupt for NoInterrupt {
        fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
            Ok(())
        }
        fn notifier(&self, _: Interrupt) -> Option<EventFd> {
            None
        }
    }
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let [rxq, txq, evq] =
        [0, 0x1_0000, 0x2_0000].map(|at| MockSplitQueue::create(&mem, GuestAddress(at), 16));
    let mut q = queues::ActiveQueues::new(
        rxq.create_queue().unwrap(),
        txq.create_queue().unwrap(),
        evq.create_queue().unwrap(),
        Arc::new(NoInterrupt),
    );
    q.transport_reset = true;
    queues::post_transport_reset(&mut q, &mem).unwrap();
    assert!(q.transport_reset, "pending without a buffer");
    let w = const { narrow::u16_of(VRING_DESC_F_WRITE as u64) };
    mem.write_obj(u32::MAX, GuestAddress(EVENT_BUF)).unwrap();
    mem.write_obj(u32::MAX, GuestAddress(EVENT_BUF + 0x10))
        .unwrap();
    evq.add_desc_chains(
        &[
            RawDescriptor::from(SplitDescriptor::new(EVENT_BUF, 2, w, 0)),
            RawDescriptor::from(SplitDescriptor::new(EVENT_BUF + 0x10, 4, w, 0)),
            RawDescriptor::from(SplitDescriptor::new(EVENT_BUF + 0x20, 4, w, 0)),
        ],
        0,
    )
    .unwrap();
    queues::post_transport_reset(&mut q, &mem).unwrap();
    assert!(!q.transport_reset);
    assert_eq!(used_idx(&mem, &evq), 2, "the small buffer and the next");
    let len = |i: u64| -> u32 {
        mem.read_obj(evq.used_addr().unchecked_add(4 + 8 * i + 4))
            .unwrap()
    };
    assert_eq!((len(0), len(1)), (0, 4));
    assert_eq!(
        mem.read_obj::<u32>(GuestAddress(EVENT_BUF)).unwrap(),
        u32::MAX
    );
    assert_eq!(
        mem.read_obj::<u32>(GuestAddress(EVENT_BUF + 0x10)).unwrap(),
        queues::VIRTIO_VSOCK_EVENT_TRANSPORT_RESET
    );
    queues::post_transport_reset(&mut q, &mem).unwrap();
    assert_eq!(used_idx(&mem, &evq), 2, "posted once");
}

/// A migration's switch over the network, on an activated and paused
/// device: released, the socket file is gone and another device (the
/// receiving VMM's) binds the path and takes its connections; taking it
/// back while that one listens is refused naming the path. Once it is
/// gone, taken back: bound again, its name this device's, and resumed, a
/// host process's CONNECT reaches the guest as a REQUEST; the name goes
/// with the device at the end.
#[test]
fn a_switch_gives_the_socket_path_up_and_binds_it_again() {
    let dir = scratch_dir("switch");
    let path = dir.join("v.sock");
    let mut dev = Vsock::new("vs".into(), 3, path.clone()).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let [rxq, txq, evq] =
        [0, 0x1_0000, 0x2_0000].map(|at| MockSplitQueue::create(&mem, GuestAddress(at), 16));
    let (_kicks, _interrupt) = activate(
        &mut dev,
        &mem,
        [&rxq, &txq, &evq].map(|q| q.create_queue().unwrap()).into(),
    );
    dev.pause().unwrap();
    assert!(dev.release_for_switch().unwrap());
    assert!(dev.listener().is_none());
    assert!(!path.exists(), "the socket file is removed");
    let receiver = Vsock::new("vs".into(), 3, path.clone()).expect("the path is free");
    let e = dev.reclaim_after_switch().unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "virtio-vsock vs: reclaiming its host side for a migration's switch: \
             vsock socket={}: a process listens on it already",
            path.display()
        )
    );
    drop(receiver);
    assert!(!path.exists(), "the receiver removed its socket");

    let given = dev.reclaim_after_switch().unwrap().expect("a new listener");
    assert!(dev.socket_name().is_owned());
    assert!(dev.listener().is_some());
    drop(given);
    let w = const { narrow::u16_of(VRING_DESC_F_WRITE as u64) };
    let d = SplitDescriptor::new(RX_BUF, 44 + 64, w, 0);
    rxq.add_desc_chains(&[RawDescriptor::from(d)], 0).unwrap();
    dev.resume().unwrap();
    let mut host = std::os::unix::net::UnixStream::connect(&path).expect("bound again");
    std::io::Write::write_all(&mut host, b"CONNECT 5000\n").unwrap();
    wait_used(&mem, &rxq, 1);
    let mut b = [0u8; HEADER_LEN];
    mem.read_slice(&mut b, GuestAddress(RX_BUF)).unwrap();
    let h = Header::from_bytes(&b);
    assert_eq!((h.op, h.dst_port), (OP_REQUEST, 5000));
    drop((host, dev));
    assert!(!path.exists(), "the name goes with the device");
    let _ = std::fs::remove_dir_all(&dir);
}
