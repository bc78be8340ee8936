//! The device without a guest: config space, features, and requests served
//! through a real queue by the device's own threads.

use std::sync::mpsc::channel;
use std::sync::Mutex;
use std::time::Duration;

use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::device::Interrupt;
use crate::test_util::ChannelInterrupt;

/// An image whose sector `n` is filled with the byte `n`.
pub(super) fn image(sectors: usize) -> vmm_sys_util::tempfile::TempFile {
    let t = vmm_sys_util::tempfile::TempFile::new().unwrap();
    let data: Vec<u8> = (0..sectors * 512)
        .map(|i| (i / 512).to_le_bytes()[0])
        .collect();
    std::fs::write(t.as_path(), data).unwrap();
    t
}

pub(super) fn config(path: &std::path::Path, readonly: bool) -> BlockDeviceConfig {
    BlockDeviceConfig {
        id: "disk0".into(),
        path: path.into(),
        readonly,
        direct: false,
        num_queues: 1,
        queue_size: 16,
        serial: Some("SERIAL-1".into()),
    }
}

pub(super) fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(
        addr,
        len,
        u16::try_from(flags).unwrap(),
        next,
    ))
}

fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(at)).unwrap();
}

#[test]
fn config_space_and_features_follow_the_image() {
    let t = image(128);
    let dev = Block::new(&config(t.as_path(), true)).unwrap();
    assert_eq!(dev.device_type(), 2);
    assert_eq!(dev.size(), 128 * 512);
    let f = dev.features();
    assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0, "read-only is advertised");
    assert_eq!(
        f & ((1 << VIRTIO_BLK_F_DISCARD) | (1 << VIRTIO_BLK_F_WRITE_ZEROES)),
        0
    );
    assert_eq!(f & (1 << VIRTIO_BLK_F_MQ), 0);
    let mut cfg = [0u8; CONFIG_LEN];
    dev.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg[0..8].try_into().unwrap()), 128);
    assert_eq!(
        u32::from_le_bytes(cfg[12..16].try_into().unwrap()),
        14,
        "seg_max"
    );
    assert_eq!(
        u32::from_le_bytes(cfg[20..24].try_into().unwrap()),
        512,
        "blk_size"
    );
    assert_eq!(
        u16::from_le_bytes(cfg[34..36].try_into().unwrap()),
        1,
        "num_queues"
    );

    // A second device on the image while this one holds it: refused
    // (the image lock), a writer needs it to itself.
    assert!(Block::new(&config(t.as_path(), false)).is_err());
    drop(dev);
    let mut c = config(t.as_path(), false);
    c.num_queues = 4;
    let dev = Block::new(&c).unwrap();
    assert_eq!(dev.queue_max_sizes(), &[16, 16, 16, 16]);
    assert_eq!(dev.features() & (1 << VIRTIO_BLK_F_RO), 0);
    assert_ne!(dev.features() & (1 << VIRTIO_BLK_F_MQ), 0);
    dev.read_config(34, &mut cfg[..2]);
    assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), 4);
}

/// One queue with three chains: a read of sectors 5–6, a write to sector 0
/// (refused on a read-only disk), a GET_ID. Returns the status bytes, the
/// used lengths, the data read and the file afterwards.
/// What the guest and the host see after [`serve_three_requests`].
struct Served {
    status: Vec<u8>,
    lens: Vec<u32>,
    read: Vec<u8>,
    id: Vec<u8>,
    file: Vec<u8>,
    counters: Vec<(&'static str, u64)>,
}

fn serve_three_requests(readonly: bool) -> Served {
    let t = image(64);
    let mut dev = Block::new(&config(t.as_path(), readonly)).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    header(&mem, 0x1000, VIRTIO_BLK_T_IN, 5);
    header(&mem, 0x1100, VIRTIO_BLK_T_OUT, 0);
    header(&mem, 0x1200, VIRTIO_BLK_T_GET_ID, 0);
    mem.write_slice(&[0xee; 512], GuestAddress(0x5000)).unwrap();
    let (n, w) = (VRING_DESC_F_NEXT, VRING_DESC_F_WRITE);
    let descs = [
        desc(0x1000, 16, n, 1),
        desc(0x4000, 1024, n | w, 2),
        desc(0x9000, 1, w, 0),
        desc(0x1100, 16, n, 4),
        desc(0x5000, 512, n, 5),
        desc(0x9001, 1, w, 0),
        desc(0x1200, 16, n, 7),
        desc(0x6000, 20, n | w, 8),
        desc(0x9002, 1, w, 0),
    ];
    vq.build_multiple_desc_chains(&descs).unwrap();
    mem.write_slice(&[0xff; 3], GuestAddress(0x9000)).unwrap();
    let queue: Queue = vq.create_queue().unwrap();
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let (tx, rx) = channel();
    dev.ack_features(dev.features());
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(tx))),
        vec![ActivatedQueue {
            index: 0,
            queue,
            kick: kick.try_clone().unwrap(),
        }],
    )
    .unwrap();
    kick.write(1).unwrap();
    let used_idx = || {
        mem.read_obj::<u16>(vq.used_addr().unchecked_add(2))
            .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while used_idx() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "requests not completed"
        );
        let _ = rx.recv_timeout(Duration::from_millis(100));
    }
    assert!(dev.reset());
    let mut status = vec![0u8; 3];
    mem.read_slice(&mut status, GuestAddress(0x9000)).unwrap();
    // The used ring in completion order: map each entry to its chain's head.
    let mut lens = vec![0u32; 3];
    for i in 0..3u64 {
        let at = vq.used_addr().unchecked_add(4 + 8 * i);
        let head = mem.read_obj::<u32>(at).unwrap();
        let len = mem.read_obj::<u32>(at.unchecked_add(4)).unwrap();
        lens[head as usize / 3] = len;
    }
    let mut read = vec![0u8; 1024];
    mem.read_slice(&mut read, GuestAddress(0x4000)).unwrap();
    let mut id = vec![0u8; 20];
    mem.read_slice(&mut id, GuestAddress(0x6000)).unwrap();
    Served {
        status,
        lens,
        read,
        id,
        file: std::fs::read(t.as_path()).unwrap(),
        counters: dev
            .counters()
            .expect("virtio-blk keeps counters")
            .snapshot(),
    }
}

#[test]
fn requests_are_served_off_the_calling_thread_and_answered() {
    let Served {
        status,
        lens,
        read,
        id,
        file,
        counters,
    } = serve_three_requests(false);
    assert_eq!(status, [0, 0, 0]);
    assert_eq!(
        lens,
        [1025, 1, 21],
        "data written to the guest plus the status byte"
    );
    assert!(read[..512].iter().all(|&b| b == 5) && read[512..].iter().all(|&b| b == 6));
    assert_eq!(&id[..8], b"SERIAL-1");
    assert!(id[8..].iter().all(|&b| b == 0));
    assert!(
        file[..512].iter().all(|&b| b == 0xee),
        "the write reached the file"
    );
    // GET_ID moves bytes too, but is neither a read nor a write of the disk.
    assert_eq!(
        counters,
        [
            ("read_bytes", 1024),
            ("write_bytes", 512),
            ("read_ops", 1),
            ("write_ops", 1)
        ]
    );
}

#[test]
fn a_readonly_disk_answers_a_write_with_ioerr_and_keeps_its_bytes() {
    let Served {
        status,
        lens,
        read,
        file,
        counters,
        ..
    } = serve_three_requests(true);
    assert_eq!(status, [0, 1, 0]);
    assert_eq!(lens[1], 1);
    assert!(read[..512].iter().all(|&b| b == 5));
    assert!(file[..512].iter().all(|&b| b == 0), "the file is unchanged");
    assert_eq!(
        counters,
        [
            ("read_bytes", 1024),
            ("write_bytes", 0),
            ("read_ops", 1),
            ("write_ops", 0)
        ],
        "a refused write is not counted"
    );
}

#[test]
fn event_idx_and_indirect_descriptors_are_offered() {
    use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
    let t = image(8);
    let dev = Block::new(&config(t.as_path(), false)).unwrap();
    assert_ne!(dev.features() & (1 << VIRTIO_RING_F_EVENT_IDX), 0);
    assert_ne!(dev.features() & (1 << VIRTIO_RING_F_INDIRECT_DESC), 0);
}

/// A read given as Linux gives it with INDIRECT_DESC (one ring descriptor
/// pointing to a table of header, data and status), served with EVENT_IDX
/// negotiated: the data arrives, and once idle the device has set the
/// used ring's `avail_event` to the next chain it expects, which is what
/// makes the guest kick again (left at 0 it would never kick past it).
#[test]
fn an_indirect_chain_is_served_and_the_device_asks_for_the_next_kick() {
    use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;
    let t = image(16);
    let mut dev = Block::new(&config(t.as_path(), false)).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let size = 16u16;
    let vq = MockSplitQueue::new(&mem, size);
    header(&mem, 0x1000, VIRTIO_BLK_T_IN, 3);
    let (n, w) = (
        const { narrow::u16_of(VRING_DESC_F_NEXT as u64) },
        const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
    );
    let table = [
        SplitDescriptor::new(0x1000, 16, n, 1),
        SplitDescriptor::new(0x4000, 512, n | w, 2),
        SplitDescriptor::new(0x9000, 1, w, 0),
    ];
    for (i, d) in table.iter().enumerate() {
        mem.write_obj(*d, GuestAddress(0x8000 + 16 * i as u64))
            .unwrap();
    }
    mem.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
    vq.build_desc_chain(&[RawDescriptor::from(SplitDescriptor::new(
        0x8000,
        48,
        const { narrow::u16_of(VRING_DESC_F_INDIRECT as u64) },
        0,
    ))])
    .unwrap();
    let queue: Queue = vq.create_queue().unwrap();
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let (tx, rx) = channel();
    dev.ack_features(dev.features());
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(tx))),
        vec![ActivatedQueue {
            index: 0,
            queue,
            kick: kick.try_clone().unwrap(),
        }],
    )
    .unwrap();
    kick.write(1).unwrap();
    let used_idx = || {
        mem.read_obj::<u16>(vq.used_addr().unchecked_add(2))
            .unwrap()
    };
    let avail_event_at = vq.used_addr().unchecked_add(4 + 8 * u64::from(size));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // The interrupt follows the used ring; an I/O thread sends both, while
    // the queue thread turns kicks back on (writes `avail_event`) once it
    // has handed the chain over, maybe after the completion: wait for all
    // three (a bound for a hang, not a speed figure).
    let mut interrupted = false;
    loop {
        interrupted |= rx.try_recv().is_ok();
        let avail_event = mem.read_obj::<u16>(avail_event_at).unwrap();
        if used_idx() >= 1 && interrupted && avail_event == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "request not completed (used {}, interrupt {interrupted}) or the next kick not asked for (avail_event {avail_event})",
            used_idx()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(dev.reset());
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap(),
        0,
        "status"
    );
    let mut read = [0u8; 512];
    mem.read_slice(&mut read, GuestAddress(0x4000)).unwrap();
    assert!(read.iter().all(|&b| b == 3), "sector 3's bytes");
}

/// A driver reads sector 0, then publishes an available index 16 + 5
/// past the device's position on a queue of 16 and kicks: the queue
/// thread stops instead of spinning on an index it cannot serve, the
/// device shows DEVICE_NEEDS_RESET and raises a configuration interrupt,
/// nothing more is used, and a reset returns and clears it.
#[test]
fn an_impossible_available_index_stops_the_queue_until_a_reset() {
    let t = image(64);
    let mut dev = Block::new(&config(t.as_path(), false)).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    header(&mem, 0x1000, VIRTIO_BLK_T_IN, 0);
    let (n, w) = (VRING_DESC_F_NEXT, VRING_DESC_F_WRITE);
    let descs = [
        desc(0x1000, 16, n, 1),
        desc(0x4000, 512, n | w, 2),
        desc(0x9000, 1, w, 0),
    ];
    vq.build_multiple_desc_chains(&descs).unwrap();
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let (tx, rx) = channel();
    dev.ack_features(dev.features());
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(tx))),
        vec![ActivatedQueue {
            index: 0,
            queue: vq.create_queue().unwrap(),
            kick: kick.try_clone().unwrap(),
        }],
    )
    .unwrap();
    let used_idx = || {
        mem.read_obj::<u16>(vq.used_addr().unchecked_add(2))
            .unwrap()
    };
    // Bounds for a hang, not speed figures.
    let wait_for = |what: Interrupt| loop {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(i) if i == what => return,
            Ok(_) => {}
            Err(e) => panic!("no {what:?} interrupt: {e}"),
        }
    };
    kick.write(1).unwrap();
    wait_for(Interrupt::Queue(0));
    assert_eq!(used_idx(), 1);
    assert!(!dev.needs_reset());

    mem.write_obj(1u16 + 16 + 5, vq.avail_addr().unchecked_add(2))
        .unwrap();
    kick.write(1).unwrap();
    wait_for(Interrupt::Config);
    assert!(dev.needs_reset(), "DEVICE_NEEDS_RESET");
    let running = dev.running.as_ref().expect("activated");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !running.queue_threads_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the queue thread runs on"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Further kicks find no thread: nothing used, no second interrupt.
    kick.write(1).unwrap();
    assert_eq!(used_idx(), 1);
    assert!(rx.try_recv().is_err());

    assert!(dev.reset());
    assert!(!dev.needs_reset(), "a reset clears it");
}
