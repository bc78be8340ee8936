//! The device through its queues, as a driver drives it: activation, a
//! guest request reaching a host listener, bytes both ways, reset.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::packet::*;
use super::*;
use crate::device::Interrupt;
use crate::test_util::{ChannelInterrupt, CountingInterrupt};

const RX_BUF: u64 = 0x8_0000;
const TX_BUF: u64 = 0x9_0000;
const BUF_LEN: u32 = 44 + 4096;

fn used_idx(mem: &GuestMemoryMmap, q: &MockSplitQueue<GuestMemoryMmap>) -> u16 {
    mem.read_obj::<u16>(q.used_addr().unchecked_add(2)).unwrap()
}

fn wait_used(mem: &GuestMemoryMmap, q: &MockSplitQueue<GuestMemoryMmap>, n: u16) {
    let end = Instant::now() + Duration::from_secs(5);
    while used_idx(mem, q) < n {
        assert!(Instant::now() < end, "the device used no buffer");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn rx_header(mem: &GuestMemoryMmap, slot: u64) -> Header {
    let mut b = [0u8; HEADER_LEN];
    mem.read_slice(&mut b, GuestAddress(RX_BUF + slot * 0x2000))
        .unwrap();
    Header::from_bytes(&b)
}

use vm_memory::Address;

#[test]
fn a_driver_connects_to_a_host_listener_and_bytes_flow_both_ways() {
    let dir = std::env::temp_dir().join(format!("vsock-dev-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("v.sock");
    let listener = UnixListener::bind(dir.join("v.sock_5000")).unwrap();
    let mut dev = Vsock::new("vs".into(), 3, path.clone()).unwrap();
    assert_eq!(dev.device_type(), VIRTIO_ID_VSOCK);
    let mut cfg = [0u8; 8];
    dev.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg), 3);

    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), 16);
    let evq = MockSplitQueue::create(&mem, GuestAddress(0x2_0000), 16);
    let rx_desc = |i: u64| {
        RawDescriptor::from(SplitDescriptor::new(
            RX_BUF + i * 0x2000,
            BUF_LEN,
            const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
            0,
        ))
    };
    rxq.add_desc_chains(&[rx_desc(0), rx_desc(1)], 0).unwrap();
    let tx_packet = |slot: u16, h: Header, data: &[u8]| {
        let addr = TX_BUF + u64::from(slot) * 0x2000;
        mem.write_slice(&h.to_bytes(), GuestAddress(addr)).unwrap();
        mem.write_slice(data, GuestAddress(addr + 44)).unwrap();
        let len = 44 + u32::try_from(data.len()).unwrap();
        txq.add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(addr, len, 0, 0))],
            slot,
        )
        .unwrap();
    };
    let guest = |op, len| Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 777,
        dst_port: 5000,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 65536,
        fwd_cnt: 0,
    };
    tx_packet(0, guest(OP_REQUEST, 0), &[]);

    let interrupt = Arc::new(CountingInterrupt::default());
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let queues = [&rxq, &txq, &evq]
        .iter()
        .zip(&kicks)
        .enumerate()
        .map(|(i, (q, k))| ActivatedQueue {
            index: u16::try_from(i).unwrap(),
            queue: q.create_queue().unwrap(),
            kick: k.try_clone().unwrap(),
        })
        .collect();
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        interrupt.clone(),
        queues,
    )
    .unwrap();
    kicks[1].write(1).unwrap();
    wait_used(&mem, &rxq, 1);
    let h = rx_header(&mem, 0);
    assert_eq!(
        (h.op, h.src_port, h.dst_port, h.dst_cid),
        (OP_RESPONSE, 5000, 777, 3)
    );
    let (mut host, _) = listener.accept().unwrap();

    // Header and payload in three descriptors, as Linux splits a large
    // send's payload over pages.
    let at = TX_BUF + 0x2000;
    mem.write_slice(&guest(OP_RW, 5).to_bytes(), GuestAddress(at))
        .unwrap();
    mem.write_slice(b"hel", GuestAddress(at + 0x100)).unwrap();
    mem.write_slice(b"lo", GuestAddress(at + 0x200)).unwrap();
    let next = const { narrow::u16_of(VRING_DESC_F_NEXT as u64) };
    txq.add_desc_chains(
        &[
            RawDescriptor::from(SplitDescriptor::new(at, 44, next, 2)),
            RawDescriptor::from(SplitDescriptor::new(at + 0x100, 3, next, 3)),
            RawDescriptor::from(SplitDescriptor::new(at + 0x200, 2, 0, 0)),
        ],
        1,
    )
    .unwrap();
    kicks[1].write(1).unwrap();
    let mut got = [0u8; 5];
    host.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");
    host.write_all(b"world").unwrap();
    wait_used(&mem, &rxq, 2);
    let h = rx_header(&mem, 1);
    assert_eq!((h.op, h.len), (OP_RW, 5));
    let mut data = [0u8; 5];
    mem.read_slice(&mut data, GuestAddress(RX_BUF + 0x2000 + 44))
        .unwrap();
    assert_eq!(&data, b"world");
    assert!(interrupt.0.load(Ordering::SeqCst) >= 2);

    // A reset ends every connection: the host stream sees EOF.
    assert!(dev.reset());
    let mut rest = Vec::new();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0);
    // A wrong queue count is refused.
    assert!(dev
        .activate(GuestMemoryAtomic::new(mem.clone()), interrupt, Vec::new())
        .is_err());
    drop(dev);
    // The device's socket goes with it (its thread drops the backend).
    assert!(!path.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A driver publishes a TX available index 16 + 5 ahead of the device on
/// a queue of 16 and kicks: the device stops its queues (no retry on each
/// kick or host event), shows DEVICE_NEEDS_RESET after one configuration
/// interrupt, and a reset clears it.
#[test]
fn an_impossible_available_index_stops_the_queues_until_a_reset() {
    let dir = std::env::temp_dir().join(format!("vsock-hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut dev = Vsock::new("vs".into(), 3, dir.join("v.sock")).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let qs = [0, 0x1_0000, 0x2_0000].map(|at| MockSplitQueue::create(&mem, GuestAddress(at), 16));
    mem.write_obj(16u16 + 5, qs[1].avail_addr().unchecked_add(2))
        .unwrap();
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let queues = qs
        .iter()
        .zip(&kicks)
        .enumerate()
        .map(|(i, (q, k))| ActivatedQueue {
            index: u16::try_from(i).unwrap(),
            queue: q.create_queue().unwrap(),
            kick: k.try_clone().unwrap(),
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let interrupt = Arc::new(ChannelInterrupt(std::sync::Mutex::new(tx)));
    dev.activate(GuestMemoryAtomic::new(mem.clone()), interrupt, queues)
        .unwrap();
    assert!(!dev.needs_reset());
    kicks[1].write(1).unwrap();
    // A bound for a hang, not a speed figure.
    let got = rx.recv_timeout(Duration::from_secs(30));
    assert_eq!(
        got.ok(),
        Some(Interrupt::Config),
        "no configuration interrupt"
    );
    assert!(dev.needs_reset(), "DEVICE_NEEDS_RESET");
    kicks[1].write(1).unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "one interrupt"
    );
    assert_eq!(used_idx(&mem, &qs[1]), 0);
    assert!(dev.reset());
    assert!(!dev.needs_reset(), "a reset clears it");
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether a host connection to `path` is taken: the device has no
/// driver, so it takes it and closes it (EOF at once); one nobody takes
/// waits in the queue, and the read times out.
fn taken(path: &std::path::Path) -> bool {
    let stream = std::os::unix::net::UnixStream::connect(path).expect("the socket is there");
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    matches!((&stream).read(&mut [0u8; 1]), Ok(0))
}

/// A local migration's source lets go of its socket: its device stops
/// taking host connections (the receiver's device, built on the same
/// listener, takes them) and leaves the socket's name when it goes. The
/// receiver's device removes the name only once it claimed it (its VMM has
/// the whole VM): one whose migration failed leaves it to the sender. A
/// resume (the migration failed) gives the socket back to the sender:
/// served, and removed at the end.
#[test]
fn a_released_socket_is_left_to_the_receiver_and_a_resume_takes_it_back() {
    let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
    let path = dir.as_path().join("v.sock");
    let mut source = Vsock::new("vsock0".into(), 3, path.clone()).unwrap();
    assert!(taken(&path));
    assert!(source.socket_name().is_owned());
    let listener = source.listener().unwrap().try_clone_to_owned().unwrap();
    let passed = || UnixListener::from(listener.try_clone().unwrap());
    source.release_backend();
    assert!(!source.socket_name().is_owned());
    assert!(!taken(&path), "the released device takes no connection");
    let failed = Vsock::with_listener("vsock0".into(), 3, path.clone(), passed()).unwrap();
    assert!(taken(&path), "the receiver's device takes them");
    assert!(!failed.socket_name().is_owned());
    drop(failed);
    assert!(
        path.exists(),
        "a receiver that did not claim the name leaves it"
    );
    let receiver = Vsock::with_listener("vsock0".into(), 3, path.clone(), passed()).unwrap();
    receiver.socket_name().claim();
    drop(source);
    assert!(path.exists(), "the released device leaves the name");
    assert!(taken(&path));
    drop(receiver);
    assert!(!path.exists(), "the name goes with the receiver's device");

    let mut source = Vsock::new("vsock0".into(), 3, path.clone()).unwrap();
    source.release_backend();
    source.resume().unwrap();
    assert!(taken(&path), "a resume takes the socket back");
    assert!(source.socket_name().is_owned());
    drop(source);
    assert!(!path.exists(), "and removes it at the end");
}
