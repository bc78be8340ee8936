//! virtio-blk's whole request path: a `Block` device activated on a split
//! queue in guest memory, and a driver on the bench's thread that keeps
//! `depth` reads in flight as Linux's virtio_blk does — it publishes
//! chains in the available ring, kicks only when the device's `avail_event`
//! asks for it, and sleeps on the interrupt only when the used ring has
//! nothing new past its `used_event` (EVENT_IDX negotiated).
//!
//! What is measured is the device's cost per request, everything included:
//! the queue thread's parsing and hand-off, the I/O threads' `preadv`, the
//! used ring and the interrupts (page cache warm, so not the storage).
//! Workloads: random 4 KiB reads at depth 32, sequential 1 MiB reads at
//! depth 8, on a 128-slot queue (Cloud Hypervisor's default size).
//! `cargo bench -p virtio-devices --bench blk_device`.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use virtio_bindings::virtio_blk::VIRTIO_BLK_T_IN;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_devices::block::{Block, BlockDeviceConfig};
use virtio_devices::device::ActivatedQueue;
use virtio_devices::GuestMemoryMmap;
use virtio_devices::{Interrupt, VirtioDevice, VirtioInterrupt};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

const IMAGE: u64 = 64 << 20;
const MEM: usize = 16 << 20;
const QUEUE_SIZE: u16 = 128;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HEADERS: u64 = 0x4000;
const STATUS: u64 = 0x5000;
const DATA: u64 = 0x10_0000;
const SECTOR: u64 = 512;

/// Requests, kicks and interrupts over a benchmark's runs, to print what
/// each request cost in notifications beside its time.
static REQUESTS: AtomicU64 = AtomicU64::new(0);
static KICKS: AtomicU64 = AtomicU64::new(0);
static INTERRUPTS: AtomicU64 = AtomicU64::new(0);

/// The interrupt as the guest gets it: an eventfd the driver sleeps on.
struct Irq(EventFd);

impl VirtioInterrupt for Irq {
    fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
        INTERRUPTS.fetch_add(1, Ordering::Relaxed);
        self.0.write(1)
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}

struct Rig {
    _image: vmm_sys_util::tempfile::TempFile,
    dev: Block,
    mem: GuestMemoryMmap,
}

fn rig() -> Rig {
    let image = vmm_sys_util::tempfile::TempFile::new().unwrap();
    std::fs::write(
        image.as_path(),
        vec![0x5au8; usize::try_from(IMAGE).unwrap()],
    )
    .unwrap();
    let dev = Block::new(&BlockDeviceConfig {
        id: "bench".into(),
        path: image.as_path().into(),
        readonly: true,
        direct: false,
        num_queues: 1,
        queue_size: QUEUE_SIZE,
        serial: None,
    })
    .unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    Rig {
        _image: image,
        dev,
        mem,
    }
}

fn queue() -> Queue {
    let mut q = Queue::new(QUEUE_SIZE).unwrap();
    q.set_size(QUEUE_SIZE);
    let halves = |a: u64| (Some(u32::try_from(a).unwrap()), Some(0));
    let (lo, hi) = halves(DESC);
    q.set_desc_table_address(lo, hi);
    let (lo, hi) = halves(AVAIL);
    q.set_avail_ring_address(lo, hi);
    let (lo, hi) = halves(USED);
    q.set_used_ring_address(lo, hi);
    q.set_ready(true);
    q
}

fn u16_of(x: impl TryInto<u16>) -> u16 {
    x.try_into().ok().unwrap()
}

fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// Serves `ops` reads of `block` bytes with `depth` in flight; returns the
/// time from the first publish to the last completion.
fn run(r: &mut Rig, ops: u64, block: u64, depth: u64, random: bool) -> Duration {
    let mem = &r.mem;
    let n = u64::from(QUEUE_SIZE);
    // Fresh rings for every run: the device starts from index 0.
    mem.write_slice(&[0u8; 0x3000], GuestAddress(0)).unwrap();
    // Slot s: descriptors 3s (header), 3s+1 (data), 3s+2 (status).
    let (next, write) = (u16_of(VRING_DESC_F_NEXT), u16_of(VRING_DESC_F_WRITE));
    for s in 0..depth {
        let descs: [(u64, u32, u16, u16); 3] = [
            (HEADERS + 16 * s, 16, next, u16_of(3 * s + 1)),
            (
                DATA + block * s,
                u32::try_from(block).unwrap(),
                next | write,
                u16_of(3 * s + 2),
            ),
            (STATUS + s, 1, write, 0),
        ];
        for (i, (addr, len, flags, nx)) in descs.into_iter().enumerate() {
            let at = GuestAddress(DESC + 16 * (3 * s + u64::try_from(i).unwrap()));
            mem.write_obj(addr, at).unwrap();
            mem.write_obj(len, GuestAddress(at.0 + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(at.0 + 12)).unwrap();
            mem.write_obj(nx, GuestAddress(at.0 + 14)).unwrap();
        }
    }
    let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let irq = Arc::new(Irq(EventFd::new(0).unwrap()));
    r.dev.ack_features(r.dev.features());
    r.dev
        .activate(
            GuestMemoryAtomic::new(mem.clone()),
            irq.clone(),
            vec![ActivatedQueue {
                index: 0,
                queue: queue(),
                kick: kick.try_clone().unwrap(),
            }],
        )
        .unwrap();
    let blocks = IMAGE / block;
    let sector_of = |i: u64| {
        let b = if random {
            let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % blocks
        } else {
            i % blocks
        };
        b * block / SECTOR
    };
    let (mut avail_idx, mut last_used) = (0u16, 0u16);
    let (mut submitted, mut completed) = (0u64, 0u64);
    let publish = |slot: u64, avail_idx: &mut u16, submitted: &mut u64| {
        let h = HEADERS + 16 * slot;
        mem.write_obj(VIRTIO_BLK_T_IN, GuestAddress(h)).unwrap();
        mem.write_obj(sector_of(*submitted), GuestAddress(h + 8))
            .unwrap();
        let at = AVAIL + 4 + 2 * (u64::from(*avail_idx) % n);
        mem.write_obj(u16_of(3 * slot), GuestAddress(at)).unwrap();
        *avail_idx = avail_idx.wrapping_add(1);
        *submitted += 1;
    };
    let kick_if_asked = |old: u16, new: u16| {
        mem.store(new, GuestAddress(AVAIL + 2), Ordering::Release)
            .unwrap();
        fence(Ordering::SeqCst);
        let event: u16 = mem
            .load(GuestAddress(USED + 4 + 8 * n), Ordering::Acquire)
            .unwrap();
        if need_event(event, new, old) {
            KICKS.fetch_add(1, Ordering::Relaxed);
            kick.write(1).unwrap();
        }
    };
    let start = Instant::now();
    while submitted < depth.min(ops) {
        publish(submitted, &mut avail_idx, &mut submitted);
    }
    kick_if_asked(0, avail_idx);
    while completed < ops {
        mem.store(
            last_used,
            GuestAddress(AVAIL + 4 + 2 * n),
            Ordering::Release,
        )
        .unwrap();
        fence(Ordering::SeqCst);
        let used_idx: u16 = mem.load(GuestAddress(USED + 2), Ordering::Acquire).unwrap();
        if used_idx == last_used {
            irq.0.read().unwrap();
            continue;
        }
        let old = avail_idx;
        while last_used != used_idx {
            let at = USED + 4 + 8 * (u64::from(last_used) % n);
            let id: u32 = mem.read_obj(GuestAddress(at)).unwrap();
            let slot = u64::from(id) / 3;
            assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS + slot)).unwrap(), 0);
            last_used = last_used.wrapping_add(1);
            completed += 1;
            if submitted < ops {
                publish(slot, &mut avail_idx, &mut submitted);
            }
        }
        if avail_idx != old {
            kick_if_asked(old, avail_idx);
        }
    }
    let took = start.elapsed();
    r.dev.reset();
    REQUESTS.fetch_add(ops, Ordering::Relaxed);
    took
}

fn device(c: &mut Criterion) {
    let mut r = rig();
    let mut g = c.benchmark_group("blk_device");
    for (name, block, depth, random) in [
        ("rand4k_qd32", 4096u64, 32u64, true),
        ("seq1m_qd8", 1 << 20, 8, false),
    ] {
        g.throughput(Throughput::Bytes(block));
        g.bench_with_input(BenchmarkId::new("read", name), &(), |b, ()| {
            b.iter_custom(|ops| run(&mut r, ops, block, depth, random))
        });
        let requests = REQUESTS.swap(0, Ordering::Relaxed).max(1) as f64;
        let per = |n: &AtomicU64| n.swap(0, Ordering::Relaxed) as f64 / requests;
        eprintln!(
            "{name}: {:.3} kicks and {:.3} interrupts per request",
            per(&KICKS),
            per(&INTERRUPTS)
        );
    }
    g.finish();
}

criterion_group!(benches, device);
criterion_main!(benches);
