//! Pausing, saving and restoring the device: nothing in flight after a
//! pause, positions that continue after a resume or a restore, and a saved
//! state that must fit the disk; a migration's switch that lets go of the
//! image's lock and takes it back.

use std::sync::mpsc::channel;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_IN;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::tests::{config, desc, image};
use super::*;
use crate::device::Interrupt;
use crate::test_util::ChannelInterrupt;

/// The shared rig (queue_worker::pausing) on a read-only disk (several
/// devices may hold it at once, as the rig builds them): flush requests,
/// the n-th at descriptors 2n and 2n + 1.
#[test]
fn pause_resume_and_restore_continue_from_the_saved_position() {
    let t = image(8);
    let make =
        || Box::new(Block::new(&config(t.as_path(), true)).unwrap()) as Box<dyn VirtioDevice>;
    crate::queue_worker::pausing::pause_resume_and_restore(&make, &|n| {
        vec![
            desc(0x1000, 16, VRING_DESC_F_NEXT, 2 * n + 1),
            desc(0x2000 + u64::from(n), 1, VRING_DESC_F_WRITE, 0),
        ]
    });
}

/// A read held in the I/O pool (a slow disk) when the pause comes: the
/// pause waits for it, and when it returns the data, the status, the used
/// entry and the interrupt are all there.
#[test]
fn a_request_in_flight_is_answered_before_pause_returns() {
    let t = image(8);
    let mut dev = Block::new(&config(t.as_path(), false)).unwrap();
    let gate = Arc::new(io::IoGate::default());
    Arc::get_mut(&mut dev.shared).unwrap().io_gate = Some(gate.clone());
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&VIRTIO_BLK_T_IN.to_le_bytes());
    h[8..16].copy_from_slice(&5u64.to_le_bytes());
    mem.write_slice(&h, GuestAddress(0x1000)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
    let (n, w) = (VRING_DESC_F_NEXT, VRING_DESC_F_WRITE);
    vq.add_desc_chains(
        &[
            desc(0x1000, 16, n, 1),
            desc(0x4000, 512, n | w, 2),
            desc(0x9000, 1, w, 0),
        ],
        0,
    )
    .unwrap();
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let (tx, interrupts) = channel();
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
    kick.write(1).unwrap();
    // Bounds for a hang, not speed figures.
    let deadline = Instant::now() + Duration::from_secs(30);
    while gate.arrived.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        gate.arrived.load(Ordering::SeqCst),
        1,
        "the read is in flight"
    );

    let (done, paused) = channel();
    let pausing = std::thread::spawn(move || {
        let r = dev.pause();
        done.send(()).unwrap();
        (dev, r)
    });
    assert!(
        paused.recv_timeout(Duration::from_millis(200)).is_err(),
        "the pause returned with a request in flight"
    );
    gate.open();
    let (_dev, saved) = pausing.join().unwrap();
    let saved = saved.unwrap();
    assert_eq!((saved[0].next_avail, saved[0].next_used), (1, 1));
    let used_idx: u16 = mem.read_obj(vq.used_addr().unchecked_add(2)).unwrap();
    assert_eq!(used_idx, 1);
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap(),
        0,
        "status OK"
    );
    let mut data = [0u8; 512];
    mem.read_slice(&mut data, GuestAddress(0x4000)).unwrap();
    assert_eq!(data, [5u8; 512], "sector 5 read");
    assert_eq!(
        interrupts.try_recv().ok(),
        Some(Interrupt::Queue(0)),
        "the interrupt came before the pause returned"
    );
}

/// A saved state is checked against this disk field by field; a mismatch
/// is refused naming the field and nothing is applied.
#[test]
fn a_restore_that_does_not_fit_the_disk_is_refused_by_field() {
    let t = image(8);
    let mut dev = Block::new(&config(t.as_path(), true)).unwrap();
    let good = dev.save_state().unwrap();
    assert_eq!(good["capacity"], 8);
    let mut fresh = Block::new(&config(t.as_path(), true)).unwrap();
    for (field, value) in [
        ("capacity", serde_json::json!(16)),
        ("readonly", serde_json::json!(false)),
        ("num_queues", serde_json::json!(2)),
        ("queue_size", serde_json::json!(64)),
        ("serial", serde_json::json!([1, 2, 3])),
        ("discard", serde_json::json!("yes")),
    ] {
        let mut state = good.clone();
        state[field] = value;
        match fresh.restore_state(&state) {
            Err(DeviceStateError::Invalid { field: got, .. }) => assert_eq!(got, field),
            other => panic!("{field}: {other:?}"),
        }
        assert!(!fresh.restored, "{field}: nothing applied");
    }
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("write_zeroes");
    let e = fresh.restore_state(&missing).unwrap_err().to_string();
    assert_eq!(e, "virtio-blk disk0: saved state: write_zeroes: missing");
    fresh.restore_state(&good).unwrap();
    assert!(fresh.restored);

    // A bigger image under the same path: refused by capacity.
    drop((dev, fresh));
    std::fs::write(t.as_path(), vec![0u8; 16 * 512]).unwrap();
    let mut grown = Block::new(&config(t.as_path(), true)).unwrap();
    let e = grown.restore_state(&good).unwrap_err().to_string();
    assert!(e.contains("capacity: saved 8, this disk has 16"), "{e}");
}

/// A device the driver never activated has no queue to give back.
#[test]
fn a_device_never_activated_pauses_with_no_queues() {
    let t = image(8);
    let mut dev = Block::new(&config(t.as_path(), true)).unwrap();
    assert_eq!(dev.pause().unwrap(), Vec::new(), "not activated");
    assert!(dev.resume().is_ok());
    assert!(dev.check_movable().is_ok());
}

/// A migration's switch over the network: released, the writable disk's
/// image is free for another open to lock as writable (the receiving VMM
/// on shared storage) while the device keeps it open; taken back, a
/// second user is refused again. Taken back while another holds it: the
/// error names the disk and the image's path, and nothing is released
/// any more. A read-only disk takes back a shared lock: readers share the
/// image again, a writer is refused.
#[test]
fn a_switch_lets_go_of_the_images_lock_and_takes_it_back() {
    let t = image(8);
    let path = t.as_path();
    let locked = |readonly| {
        matches!(
            DiskFile::open(path, readonly, false),
            Err(DiskError::Locked { .. })
        )
    };
    let mut dev = Block::new(&config(path, false)).unwrap();
    assert!(locked(false) && locked(true), "held at first");
    assert!(dev.release_for_switch().unwrap());
    let receiver = DiskFile::open(path, false, false).expect("free once released");
    drop(receiver);
    assert!(dev.reclaim_after_switch().unwrap().is_none(), "the same fd");
    assert!(locked(false) && locked(true), "held again");

    assert!(dev.release_for_switch().unwrap());
    let other = DiskFile::open(path, false, false).unwrap();
    let e = dev.reclaim_after_switch().unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "virtio-blk disk0: reclaiming its host side for a migration's switch: \
             disk path={}: locked by another process (a writable disk needs the image \
             to itself; read-only disks share it); the disk serves on without the lock",
            path.display()
        )
    );
    assert!(
        dev.reclaim_after_switch().unwrap().is_none(),
        "nothing left"
    );
    drop((other, dev));

    let mut ro = Block::new(&config(path, true)).unwrap();
    assert!(ro.release_for_switch().unwrap());
    drop(DiskFile::open(path, false, false).expect("a writer gets it"));
    ro.reclaim_after_switch().unwrap();
    assert!(locked(false), "a writer is refused again");
    drop(DiskFile::open(path, true, false).expect("readers share it"));
}
