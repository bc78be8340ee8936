//! virtio-blk's I/O engine: the worker pool the device uses against
//! io_uring, for the same request stream on the same image file.
//!
//! Both engines serve reads into guest memory (a `GuestMemoryMmap`) with
//! `queue depth` requests in flight, as a guest's queue keeps them:
//! - pool: the device's own path — a queue thread hands each request to
//!   [`IO_THREADS`] I/O threads over a channel, each runs
//!   `DiskFile::execute` (`preadv` into the guest's pages), and the
//!   completion comes back over a channel;
//! - io_uring: one thread submits `Readv` operations straight into the
//!   guest's pages and reaps completions, refilling the ring.
//!
//! Workloads: random 4 KiB reads at depth 32, sequential 1 MiB reads at
//! depth 8, over a 64 MiB image in the temporary directory (page cache
//! warm: what is measured is each engine's own cost per request, not the
//! storage). `cargo bench -p virtio-devices --bench blk_engine`.

use std::os::fd::AsRawFd;
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use virtio_devices::block::io::IO_THREADS;
use virtio_devices::block::request::{Action, Segment};
use virtio_devices::block::DiskFile;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

const IMAGE: u64 = 64 << 20;
const MEM: usize = 64 << 20;

struct Rig {
    _image: vmm_sys_util::tempfile::TempFile,
    /// The device's own view of the image (the pool's).
    disk: Arc<DiskFile>,
    /// The same image opened for io_uring.
    file: std::fs::File,
    mem: GuestMemoryMmap<()>,
}

fn rig() -> Rig {
    let image = vmm_sys_util::tempfile::TempFile::new().unwrap();
    std::fs::write(
        image.as_path(),
        vec![0x5au8; usize::try_from(IMAGE).unwrap()],
    )
    .unwrap();
    let disk = Arc::new(DiskFile::open(image.as_path(), true, false).unwrap());
    let file = std::fs::File::open(image.as_path()).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    Rig {
        _image: image,
        disk,
        file,
        mem,
    }
}

/// The `i`th request's disk offset and guest buffer (xorshift for random).
fn request(i: u64, block: u64, random: bool, depth: u64) -> (u64, GuestAddress) {
    let blocks = IMAGE / block;
    let n = if random {
        let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % blocks
    } else {
        i % blocks
    };
    (n * block, GuestAddress((i % depth) * block))
}

fn pool(r: &Rig, ops: u64, block: u64, depth: u64, random: bool) -> Duration {
    let (jobs, done) = (channel::<(u64, Action)>(), channel::<u64>());
    let jobs_rx = Arc::new(std::sync::Mutex::new(jobs.1));
    let serial = [0u8; 20];
    std::thread::scope(|s| {
        for _ in 0..IO_THREADS {
            let (rx, tx) = (jobs_rx.clone(), done.0.clone());
            let (disk, mem) = (&r.disk, &r.mem);
            s.spawn(move || loop {
                let Ok((i, action)) = rx.lock().unwrap().recv() else {
                    return;
                };
                let (status, _) = disk.execute(mem, &action, &serial);
                assert_eq!(status, 0);
                tx.send(i).unwrap();
            });
        }
        let submit = |i: u64| {
            let (offset, addr) = request(i, block, random, depth);
            let data = vec![Segment { addr, len: block }];
            jobs.0.send((i, Action::Read { offset, data })).unwrap();
        };
        let start = Instant::now();
        let mut next = 0;
        while next < depth.min(ops) {
            submit(next);
            next += 1;
        }
        for _ in 0..ops {
            done.1.recv().unwrap();
            if next < ops {
                submit(next);
                next += 1;
            }
        }
        let took = start.elapsed();
        drop(jobs.0);
        took
    })
}

fn uring(r: &Rig, ops: u64, block: u64, depth: u64, random: bool) -> Duration {
    use io_uring::{opcode, types, IoUring};
    let mut ring = IoUring::new(u32::try_from(depth).unwrap().next_power_of_two()).unwrap();
    let fd = types::Fd(r.file.as_raw_fd());
    let iovecs: Vec<libc::iovec> = (0..depth)
        .map(|slot| {
            let addr = GuestAddress(slot * block);
            let host = r.mem.get_host_address(addr).unwrap();
            libc::iovec {
                iov_base: host.cast(),
                iov_len: usize::try_from(block).unwrap(),
            }
        })
        .collect();
    let push = |ring: &mut IoUring, i: u64| {
        let (offset, _) = request(i, block, random, depth);
        let slot = usize::try_from(i % depth).unwrap();
        let read = opcode::Readv::new(fd, &iovecs[slot], 1)
            .offset(offset)
            .build()
            .user_data(i);
        // SAFETY: the iovec and the guest memory it points at outlive the
        // operation (reaped before this function returns).
        unsafe { ring.submission().push(&read).unwrap() };
    };
    let start = Instant::now();
    let mut next = 0;
    while next < depth.min(ops) {
        push(&mut ring, next);
        next += 1;
    }
    let mut reaped = 0;
    while reaped < ops {
        ring.submit_and_wait(1).unwrap();
        let done: Vec<i32> = ring.completion().map(|c| c.result()).collect();
        for res in done {
            assert_eq!(u64::try_from(res).unwrap(), block);
            reaped += 1;
            if next < ops {
                push(&mut ring, next);
                next += 1;
            }
        }
    }
    start.elapsed()
}

fn engines(c: &mut Criterion) {
    let r = rig();
    let mut g = c.benchmark_group("blk_engine");
    for (name, block, depth, random) in [
        ("rand4k_qd32", 4096u64, 32u64, true),
        ("seq1m_qd8", 1 << 20, 8, false),
    ] {
        g.throughput(Throughput::Bytes(block));
        g.bench_with_input(BenchmarkId::new("pool", name), &(), |b, ()| {
            b.iter_custom(|ops| pool(&r, ops, block, depth, random))
        });
        g.bench_with_input(BenchmarkId::new("io_uring", name), &(), |b, ()| {
            b.iter_custom(|ops| uring(&r, ops, block, depth, random))
        });
    }
    g.finish();
}

criterion_group!(benches, engines);
criterion_main!(benches);
