//! How a virtio-blk device serves its queues: one thread per queue parses
//! the guest's chains and hands each request to a pool of I/O threads,
//! which run it against the disk and hand back a completion; the queue
//! thread then puts the chain in the used ring and interrupts the guest.
//!
//! Why a pool and not io_uring: the pool's threads make only `preadv`,
//! `pwritev`, `fdatasync` and `fallocate`, each checked by their own
//! seccomp filter ([`crate::BLOCK_IO_THREAD`]); operations submitted
//! through io_uring are not seen by seccomp at all, so one filter could
//! no longer say what the I/O may do. It needs no new dependency and no
//! kernel setting (io_uring can be disabled by sysctl). Several requests
//! are in flight at once, up to [`IO_THREADS`].
//!
//! Bounds: a queue thread hands the pool at most its queue's size of
//! requests at a time (a driver that publishes chains faster, or the same
//! chain again while it is in flight, waits for completions), so jobs never
//! exceed the sum of the queue sizes; a job holds one segment list no
//! longer than its chain, which the parser bounds by the queue's size.

use std::os::fd::AsRawFd;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::disk::DiskFile;
use super::request::{self, Action, DiskLimits, ID_BYTES};
use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
use crate::event_loop::{EventLoop, Flow, WorkerThread};
use crate::DeviceCounters;
use crate::GuestMemoryMmap;

/// I/O threads per device.
pub const IO_THREADS: usize = 4;

/// What the device shares with its threads.
pub struct Shared {
    pub name: String,
    pub disk: Arc<DiskFile>,
    pub limits: DiskLimits,
    pub serial: [u8; ID_BYTES],
    /// [`COUNTER_NAMES`], for `vm.counters`.
    pub counters: Arc<DeviceCounters>,
}

/// Cloud Hypervisor's virtio-blk counters: bytes and requests that
/// completed, by direction.
pub const COUNTER_NAMES: [&str; 4] = ["read_bytes", "write_bytes", "read_ops", "write_ops"];
const READ_BYTES: usize = 0;
const WRITE_BYTES: usize = 1;
const READ_OPS: usize = 2;
const WRITE_OPS: usize = 3;

/// Adds a finished request to the counters: reads and writes that
/// succeeded, with their lengths.
fn count(counters: &DeviceCounters, action: &Action, status: u8) {
    if u32::from(status) != VIRTIO_BLK_S_OK {
        return;
    }
    let total = |segs: &[request::Segment]| segs.iter().fold(0u64, |t, s| t.saturating_add(s.len));
    match action {
        Action::Read { data, .. } => {
            counters.add(READ_BYTES, total(data));
            counters.add(READ_OPS, 1);
        }
        Action::Write { data, .. } => {
            counters.add(WRITE_BYTES, total(data));
            counters.add(WRITE_OPS, 1);
        }
        _ => {}
    }
}

/// Chains the pool finished for one queue, and the eventfd that says so.
struct Completions {
    done: Mutex<Vec<(u16, u32)>>,
    ready: EventFd,
}

struct Job {
    head: u16,
    status: GuestAddress,
    action: Action,
    to: Arc<Completions>,
}

/// The running threads; dropping stops the queue threads, lets the pool
/// finish the jobs it holds, and joins everything.
pub struct BlockQueues {
    queue_threads: Vec<WorkerThread>,
    io_threads: Vec<JoinHandle<()>>,
}

impl Drop for BlockQueues {
    fn drop(&mut self) {
        // The queue threads hold every job sender; when they are gone the
        // pool's channel disconnects once drained.
        self.queue_threads.clear();
        for t in self.io_threads.drain(..) {
            let _ = t.join();
        }
    }
}

const KICK: u64 = 0;
const DONE: u64 = 1;

/// Starts the pool and one thread per queue.
pub fn start(
    shared: Arc<Shared>,
    queues: Vec<ActivatedQueue>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
) -> std::io::Result<BlockQueues> {
    // Declared first so it drops last: on an early return the sender and
    // receiver below are gone before its Drop joins the I/O threads.
    let mut running = BlockQueues {
        queue_threads: Vec::new(),
        io_threads: Vec::new(),
    };
    let (tx, rx) = channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..IO_THREADS {
        let (rx, shared, mem) = (rx.clone(), shared.clone(), mem.clone());
        let t = std::thread::Builder::new()
            .name(format!("blk-io-{i}"))
            .spawn(move || io_thread(&shared, &rx, &mem))?;
        running.io_threads.push(t);
    }
    for q in queues {
        running.queue_threads.push(queue_thread(
            shared.clone(),
            q,
            mem.clone(),
            interrupt.clone(),
            tx.clone(),
        )?);
    }
    Ok(running)
}

fn io_thread(
    shared: &Shared,
    jobs: &Mutex<Receiver<Job>>,
    mem: &GuestMemoryAtomic<GuestMemoryMmap>,
) {
    if let Err(e) = seccomp::enter_thread(crate::BLOCK_IO_THREAD) {
        return crate::error_limited!("{}: {e}; the I/O thread does not run", shared.name);
    }
    loop {
        let job = match jobs.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return, // the queue threads are gone
        };
        let guard = mem.memory();
        let (status, written) = shared.disk.execute(&*guard, &job.action, &shared.serial);
        count(&shared.counters, &job.action, status);
        // The status byte was checked to be in guest memory when parsed.
        let used = match guard.write_obj(status, job.status) {
            Ok(()) => written.saturating_add(1),
            Err(_) => 0,
        };
        job.to
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((job.head, used));
        if let Err(e) = job.to.ready.write(1) {
            crate::error_limited!("{}: completion eventfd: {e}", shared.name);
        }
    }
}

fn queue_thread(
    shared: Arc<Shared>,
    q: ActivatedQueue,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
    jobs: Sender<Job>,
) -> std::io::Result<WorkerThread> {
    let completions = Arc::new(Completions {
        done: Mutex::new(Vec::new()),
        ready: EventFd::new(libc::EFD_NONBLOCK)?,
    });
    let events = EventLoop::new()?;
    events.add(q.kick.as_raw_fd(), EventSet::IN, KICK)?;
    events.add(completions.ready.as_raw_fd(), EventSet::IN, DONE)?;
    let (index, mut queue, kick) = (q.index, q.queue, q.kick);
    let name = format!("{} queue {index}", shared.name);
    // Requests handed to the pool and not yet completed. A driver may
    // publish the same chain again while it is in flight; counting keeps
    // what is queued for the pool within the queue's size regardless.
    let mut in_flight = 0usize;
    let limit = usize::from(queue.size());
    events.spawn(format!("blk-q{index}"), name.clone(), move |_, token, _| {
        let guard = mem.memory();
        let mut used = 0usize;
        if token == KICK {
            let _ = kick.read();
        } else {
            let _ = completions.ready.read();
            let done =
                std::mem::take(&mut *completions.done.lock().unwrap_or_else(|p| p.into_inner()));
            for (head, len) in done {
                if let Err(e) = queue.add_used(&*guard, head, len) {
                    crate::error_limited!("{name}: stopped: used ring: {e:?}");
                    return Flow::Stop;
                }
                in_flight = in_flight.saturating_sub(1);
                used += 1;
            }
        }
        // After completions too: chains left waiting while the pool was full.
        match serve_until_idle(
            &shared,
            &mut queue,
            &guard,
            &completions,
            &jobs,
            &mut in_flight,
            limit,
        ) {
            Ok(n) => used += n,
            Err(e) => {
                crate::error_limited!("{name}: stopped: {e}");
                return Flow::Stop;
            }
        }
        if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
            if let Err(e) = interrupt.trigger(Interrupt::Queue(index)) {
                crate::error_limited!("{name}: stopped: interrupt: {e}");
                return Flow::Stop;
            }
        }
        Flow::Continue
    })
}

/// [`serve_available`] with the guest's kicks off meanwhile: the guest
/// does not kick for chains it publishes while this thread is serving
/// (with EVENT_IDX it kicks only past the index this thread last asked
/// for). Before returning, kicks are turned back on and chains that came
/// in the meantime are served, unless `limit` requests are in flight: a
/// completion brings the thread back then, and turns them on.
fn serve_until_idle(
    shared: &Shared,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    completions: &Arc<Completions>,
    jobs: &Sender<Job>,
    in_flight: &mut usize,
    limit: usize,
) -> Result<usize, String> {
    let ring = |e: virtio_queue::Error| format!("notification flags: {e:?}");
    let mut used = 0;
    loop {
        queue.disable_notification(mem).map_err(ring)?;
        used += serve_available(shared, queue, mem, completions, jobs, in_flight, limit)?;
        if *in_flight >= limit || !queue.enable_notification(mem).map_err(ring)? {
            return Ok(used);
        }
    }
}

/// Parses available chains while fewer than `limit` are in flight: valid
/// requests go to the pool, the others are answered here. Returns how many
/// chains were used here.
fn serve_available(
    shared: &Shared,
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    completions: &Arc<Completions>,
    jobs: &Sender<Job>,
    in_flight: &mut usize,
    limit: usize,
) -> Result<usize, String> {
    let mut used = 0;
    let mut pending = *in_flight;
    while pending < limit {
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            break;
        };
        let head = chain.head_index();
        let descriptors = chain.map(|d| (d.addr(), d.len(), d.is_write_only()));
        let parsed = request::parse(mem, descriptors, &shared.limits);
        let answer = match (parsed.status, parsed.action) {
            (Some(status), Ok(action)) => {
                let job = Job {
                    head,
                    status,
                    action,
                    to: completions.clone(),
                };
                jobs.send(job)
                    .map_err(|_| "the I/O threads are gone".to_string())?;
                pending += 1;
                continue;
            }
            (status, Err(e)) => {
                crate::warn_limited!("{}: bad request: {e}", shared.name);
                status.map(|at| (at, e.status()))
            }
            (None, Ok(_)) => None, // parse() never gives this
        };
        let len = match answer {
            Some((at, status)) if mem.write_obj(status, at).is_ok() => 1,
            _ => 0,
        };
        queue
            .add_used(mem, head, len)
            .map_err(|e| format!("used ring: {e:?}"))?;
        used += 1;
    }
    *in_flight = pending;
    Ok(used)
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use virtio_bindings::virtio_blk::VIRTIO_BLK_T_FLUSH;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
    };
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

    fn completions() -> Arc<Completions> {
        Arc::new(Completions {
            done: Mutex::new(Vec::new()),
            ready: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        })
    }

    /// Three flush requests published at once: with room for two in the
    /// pool, two are handed over and the third waits in the ring until a
    /// completion makes room (a driver cannot queue more than that).
    #[test]
    fn requests_in_flight_never_exceed_the_limit() {
        let shared = shared();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let vq = flushes(&mem, 3);
        let mut queue: Queue = vq.create_queue().unwrap();
        let completions = completions();
        let (tx, rx) = channel();
        let mut in_flight = 0;
        let serve = |queue: &mut Queue, in_flight: &mut usize| {
            serve_available(&shared, queue, &mem, &completions, &tx, in_flight, 2).unwrap()
        };
        assert_eq!(
            serve(&mut queue, &mut in_flight),
            0,
            "nothing answered here"
        );
        assert_eq!((in_flight, rx.try_iter().count()), (2, 2));
        assert_eq!(serve(&mut queue, &mut in_flight), 0);
        assert_eq!(
            (in_flight, rx.try_iter().count()),
            (2, 0),
            "the pool is full"
        );
        in_flight = 1; // one completed
        serve(&mut queue, &mut in_flight);
        assert_eq!(
            (in_flight, rx.try_iter().count()),
            (2, 1),
            "the third one now"
        );
    }

    /// Without EVENT_IDX the device turns the guest's kicks off with the
    /// used ring's NO_NOTIFY flag while it serves. Once idle with room in
    /// the pool, they are back on; with the pool full they stay off (a
    /// completion will serve the ring anyway), and the next pass with room
    /// turns them on again.
    #[test]
    fn kicks_are_off_while_serving_and_back_on_when_idle() {
        let shared = shared();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let vq = flushes(&mem, 3);
        let mut queue: Queue = vq.create_queue().unwrap();
        let completions = completions();
        let (tx, rx) = channel();
        let used_flags = || mem.read_obj::<u16>(vq.used_addr()).unwrap();
        let no_notify = const { narrow::u16_of(VRING_USED_F_NO_NOTIFY as u64) };
        let mut in_flight = 0;
        serve_until_idle(
            &shared,
            &mut queue,
            &mem,
            &completions,
            &tx,
            &mut in_flight,
            2,
        )
        .unwrap();
        assert_eq!((in_flight, rx.try_iter().count()), (2, 2));
        assert_eq!(used_flags(), no_notify, "pool full: kicks stay off");
        in_flight = 0; // both completed
        serve_until_idle(
            &shared,
            &mut queue,
            &mem,
            &completions,
            &tx,
            &mut in_flight,
            2,
        )
        .unwrap();
        assert_eq!((in_flight, rx.try_iter().count()), (1, 1));
        assert_eq!(used_flags(), 0, "idle with room: kicks on");
        // A chain published after the device went idle is found on the
        // next kick, and the flag is still 0 afterwards.
        assert!(!queue.enable_notification(&mem).unwrap());
    }
}
