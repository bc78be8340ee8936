//! The queue thread's and the I/O threads' shared ring: limits, kicks,
//! completions, stops.

use std::sync::mpsc::channel;

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_FLUSH;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;

use super::*;
use crate::block::request::{DiskLimits, SECTOR_SIZE};

fn shared() -> Shared {
    let t = vmm_sys_util::tempfile::TempFile::new().unwrap();
    std::fs::write(t.as_path(), vec![0u8; 4096]).unwrap();
    let disk = DiskFile::open(t.as_path(), false, false).unwrap();
    Shared {
        name: "test".into(),
        limits: DiskLimits {
            capacity: 4096 / SECTOR_SIZE,
            readonly: false,
            discard: false,
            write_zeroes: false,
            max_segments: 16,
            max_ranges: 1,
            max_range_sectors: 1,
        },
        disk: Arc::new(disk),
        serial: [0; ID_BYTES],
        counters: DeviceCounters::new(&COUNTER_NAMES),
        broken: AtomicBool::new(false),
        io_gate: None,
    }
}

/// `count` flush requests published at once on a queue of 16.
fn flushes(mem: &GuestMemoryMmap, count: u16) -> MockSplitQueue<'_, GuestMemoryMmap> {
    let vq = MockSplitQueue::new(mem, 16);
    mem.write_obj(VIRTIO_BLK_T_FLUSH, GuestAddress(0x1000))
        .unwrap();
    let mut descs = Vec::new();
    for i in 0..count {
        let (n, w) = (
            const { narrow::u16_of(VRING_DESC_F_NEXT as u64) },
            const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
        );
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            0x1000,
            16,
            n,
            2 * i + 1,
        )));
        descs.push(RawDescriptor::from(SplitDescriptor::new(
            0x2000 + u64::from(i),
            1,
            w,
            0,
        )));
    }
    vq.build_multiple_desc_chains(&descs).unwrap();
    vq
}

/// Counts the interrupts the device raises.
#[derive(Default)]
struct Counted(std::sync::atomic::AtomicUsize);

impl VirtioInterrupt for Counted {
    fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}

/// The queue of `vq` shared as the device shares it, with room for
/// `limit` requests in flight.
fn shared_queue(
    vq: &MockSplitQueue<'_, GuestMemoryMmap>,
    limit: usize,
) -> (Arc<SharedQueue>, Arc<Counted>) {
    let counted = Arc::new(Counted::default());
    let q = super::shared_queue(&shared(), 0, vq.create_queue().unwrap(), counted.clone()).unwrap();
    let mut q = Arc::into_inner(q).unwrap();
    q.limit = limit;
    (Arc::new(q), counted)
}

fn interrupts(counted: &Counted) -> usize {
    counted.0.load(std::sync::atomic::Ordering::SeqCst)
}

fn used_idx(mem: &GuestMemoryMmap, vq: &MockSplitQueue<'_, GuestMemoryMmap>) -> u16 {
    use vm_memory::Address;
    mem.read_obj(vq.used_addr().unchecked_add(2)).unwrap()
}

/// Three flush requests published at once: with room for two in the
/// pool, two are handed over and the third waits in the ring until a
/// completion makes room (a driver cannot queue more than that).
#[test]
fn requests_in_flight_never_exceed_the_limit() {
    let shared = shared();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = flushes(&mem, 3);
    let (queue, _) = shared_queue(&vq, 2);
    let (tx, rx) = channel();
    let serve = || serve_available(&shared, &queue, &mem, &tx).unwrap();
    assert_eq!(serve(), 0, "nothing answered here");
    assert_eq!((queue.lock().in_flight, rx.try_iter().count()), (2, 2));
    assert_eq!(serve(), 0);
    assert_eq!(
        (queue.lock().in_flight, rx.try_iter().count()),
        (2, 0),
        "the pool is full"
    );
    queue.complete(&mem, 0, 1).unwrap();
    serve();
    assert_eq!(
        (queue.lock().in_flight, rx.try_iter().count()),
        (2, 1),
        "the third one now"
    );
}

/// Without EVENT_IDX the device turns the guest's kicks off with the
/// used ring's NO_NOTIFY flag while it serves. Once idle with room in
/// the pool, they are back on; with the pool full they stay off and
/// the queue is stalled: the completion that makes room wakes the
/// queue thread (`room`), and the next pass turns them on again.
#[test]
fn kicks_are_off_while_serving_and_back_on_when_idle() {
    let shared = shared();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = flushes(&mem, 3);
    let (queue, _) = shared_queue(&vq, 2);
    let (tx, rx) = channel();
    let used_flags = || mem.read_obj::<u16>(vq.used_addr()).unwrap();
    let no_notify = const { narrow::u16_of(VRING_USED_F_NO_NOTIFY as u64) };
    serve_until_idle(&shared, &queue, &mem, &tx).unwrap();
    assert_eq!((queue.lock().in_flight, rx.try_iter().count()), (2, 2));
    assert_eq!(used_flags(), no_notify, "pool full: kicks stay off");
    assert!(queue.lock().stalled);
    assert!(queue.room.read().is_err(), "no wake-up before a completion");
    queue.complete(&mem, 0, 1).unwrap();
    assert_eq!(queue.room.read().unwrap(), 1, "the completion woke it");
    queue.complete(&mem, 2, 1).unwrap();
    assert!(queue.room.read().is_err(), "one wake-up per stall");
    serve_until_idle(&shared, &queue, &mem, &tx).unwrap();
    assert_eq!((queue.lock().in_flight, rx.try_iter().count()), (1, 1));
    assert_eq!(used_flags(), 0, "idle with room: kicks on");
    assert!(!queue.lock().stalled);
    // A chain published after the device went idle is found on the
    // next kick, and the flag is still 0 afterwards.
    assert!(!queue.lock().queue.enable_notification(&mem).unwrap());
}

/// The I/O thread's side: a completion goes into the used ring with
/// its length, and interrupts only when the guest's `used_event`
/// (EVENT_IDX) lies behind the new used index: with `used_event` = 1,
/// the first completion (used index 1) raises nothing, the second
/// (index 2) raises one.
#[test]
fn a_completion_is_used_and_interrupts_only_when_the_guest_asks() {
    use vm_memory::Address;
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = flushes(&mem, 2);
    let (queue, counted) = shared_queue(&vq, 16);
    queue.lock().queue.set_event_idx(true);
    let used_event_at = vq.avail_addr().unchecked_add(4 + 2 * 16);
    mem.write_obj(1u16, used_event_at).unwrap();
    let (shared, (tx, _rx)) = (shared(), channel());
    serve_available(&shared, &queue, &mem, &tx).unwrap();
    queue.complete(&mem, 2, 1).unwrap();
    assert_eq!((used_idx(&mem, &vq), interrupts(&counted)), (1, 0));
    let entry = vq.used_addr().unchecked_add(4);
    assert_eq!(mem.read_obj::<u32>(entry).unwrap(), 2, "the chain's head");
    assert_eq!(mem.read_obj::<u32>(entry.unchecked_add(4)).unwrap(), 1);
    queue.complete(&mem, 0, 1).unwrap();
    assert_eq!((used_idx(&mem, &vq), interrupts(&counted)), (2, 1));
    assert_eq!(queue.lock().in_flight, 0);
}

/// A reset stops the queue before the threads are joined: a request
/// that finishes its I/O afterwards (it was in flight) writes neither
/// ring nor raises an interrupt, and a stalled queue thread is not
/// woken (it is being stopped).
#[test]
fn completions_after_a_stop_touch_no_ring_and_raise_nothing() {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let vq = flushes(&mem, 2);
    let (queue, counted) = shared_queue(&vq, 1);
    let (shared, (tx, _rx)) = (shared(), channel());
    serve_until_idle(&shared, &queue, &mem, &tx).unwrap();
    assert!(queue.lock().stalled);
    queue.lock().stopped = true;
    queue.complete(&mem, 0, 1).unwrap();
    assert_eq!((used_idx(&mem, &vq), interrupts(&counted)), (0, 0));
    assert!(queue.room.read().is_err(), "not woken");
    assert_eq!(queue.lock().in_flight, 1, "nothing changed");
}
