//! How a virtio-blk device serves its queues: one thread per queue parses
//! the guest's chains and hands each request to a pool of I/O threads; the
//! I/O thread that runs a request against the disk also completes it: it
//! puts the chain in the used ring and interrupts the guest when the
//! guest's `used_event` asks for it. A request thus crosses one thread
//! hand-off, not two (the queue thread sleeps until the next kick rather
//! than waking for every completion). The queue's two rings are shared
//! under one lock ([`SharedQueue`]), held only to take a chain or to use
//! one, never across I/O.
//!
//! Why a pool and not io_uring: the pool's threads make only `preadv`,
//! `pwritev`, `fdatasync` and `fallocate`, each checked by their own
//! seccomp filter ([`crate::BLOCK_IO_THREAD`]); operations submitted
//! through io_uring are not seen by seccomp at all, so one filter could
//! no longer say what the I/O may do. It needs no new dependency and no
//! kernel setting (io_uring can be disabled by sysctl). Several requests
//! are in flight at once, up to [`IO_THREADS`].
//!
//! A queue the guest broke (an available index more than the queue's
//! size ahead of the device, a used ring the device cannot write) is not
//! served any more: its thread stops, the device shows DEVICE_NEEDS_RESET
//! and raises a configuration interrupt, once, until the driver resets it
//! (virtio 1.2 §2.1.2). Nothing retries it, so nothing spins or floods the
//! log.
//!
//! A pause ([`BlockQueues::pause`]) stops taking chains, stops the queue
//! threads and waits, bounded, until the pool has completed every request
//! taken (used entry and interrupt included); a resume starts the queue
//! threads again on the same queues.
//!
//! Bounds: a queue thread hands the pool at most its queue's size of
//! requests at a time (a driver that publishes chains faster, or the same
//! chain again while it is in flight, waits for completions), so jobs never
//! exceed the sum of the queue sizes; a job holds one segment list no
//! longer than its chain, which the parser bounds by the queue's size.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::disk::DiskFile;
use super::request::{self, Action, DiskLimits, ID_BYTES};
use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
use crate::device_state::SavedQueue;
use crate::event_loop::{join_bounded, EventLoop, Flow, WorkerThread, STOP_TIMEOUT};
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
    /// A queue stopped on the guest's error: the device needs a reset.
    pub broken: AtomicBool,
    /// Tests: holds each request before its I/O until opened (a slow disk).
    #[cfg(test)]
    pub(crate) io_gate: Option<Arc<IoGate>>,
}

/// Tests: a slow disk's stand-in. Requests wait at the gate (bounded)
/// until it opens.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct IoGate {
    open: Mutex<bool>,
    changed: std::sync::Condvar,
    /// Requests that reached the gate.
    pub(crate) arrived: std::sync::atomic::AtomicUsize,
}

#[cfg(test)]
impl IoGate {
    pub(crate) fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.changed.notify_all();
    }

    fn pass(&self) {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        // A bound for a test that forgets to open it, not a speed figure.
        let _ = self
            .changed
            .wait_timeout_while(open, std::time::Duration::from_secs(60), |o| !*o);
    }
}

impl Shared {
    /// Marks the device broken (DEVICE_NEEDS_RESET) and tells the driver
    /// with a configuration interrupt; logs `why` the first time only.
    pub fn mark_broken(&self, interrupt: &dyn VirtioInterrupt, why: &str) {
        if self.broken.swap(true, Ordering::SeqCst) {
            return;
        }
        crate::error_limited!(
            "{}: {why}; the queue is stopped until the driver resets the device (DEVICE_NEEDS_RESET)",
            self.name
        );
        if let Err(e) = interrupt.trigger(Interrupt::Config) {
            crate::error_limited!("{}: configuration interrupt: {e}", self.name);
        }
    }
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

/// One queue as its queue thread and the I/O threads share it: the queue
/// thread takes chains from the available ring, the I/O thread that
/// finishes a request puts it in the used ring and interrupts the guest.
/// Both sides of the ring go through `state`'s lock.
struct SharedQueue {
    index: u16,
    name: String,
    state: Mutex<QueueState>,
    /// Most requests in flight at once: the queue's size.
    limit: usize,
    /// Written by a completion that makes room while the queue thread
    /// waits for room (see [`QueueState::stalled`]).
    room: EventFd,
    interrupt: Arc<dyn VirtioInterrupt>,
}

struct QueueState {
    queue: Queue,
    /// Chains taken from the available ring and not yet used. A driver may
    /// publish the same chain again while it is in flight; counting keeps
    /// what is queued for the pool within the queue's size regardless.
    in_flight: usize,
    /// The queue thread stopped taking chains at `limit` and left the
    /// guest's kicks off: the next completion wakes it through `room`.
    stalled: bool,
    /// The device is stopping: nothing more goes into the rings and no
    /// more interrupts are raised (requests still running finish their
    /// I/O, as the guest's memory stays mapped until the threads are
    /// joined).
    stopped: bool,
    /// The device is pausing: no chain is taken; requests already taken
    /// are completed as usual.
    paused: bool,
    /// Requests handed to the pool whose job has not finished (its I/O,
    /// its used entry and its interrupt): a pause waits for none.
    jobs: usize,
}

impl SharedQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `head` in the used ring with `len` bytes written, frees its
    /// place, and raises the queue's interrupt if the guest asked for it
    /// (EVENT_IDX: only when the used index passes its `used_event`, so
    /// completions the guest has not yet asked about raise nothing).
    /// Nothing happens once the queue is stopped.
    fn complete(&self, mem: &GuestMemoryMmap, head: u16, len: u32) -> Result<(), String> {
        let mut st = self.lock();
        if st.stopped {
            return Ok(());
        }
        st.in_flight = st.in_flight.saturating_sub(1);
        let wake = std::mem::take(&mut st.stalled);
        if let Err(e) = st.queue.add_used(mem, head, len) {
            // A broken used ring: the queue serves nothing more.
            st.stopped = true;
            return Err(format!("stopped: used ring: {e:?}"));
        }
        let notify = st.queue.needs_notification(mem).unwrap_or(true);
        drop(st);
        if notify {
            self.interrupt
                .trigger(Interrupt::Queue(self.index))
                .map_err(|e| format!("interrupt: {e}"))?;
        }
        if wake {
            self.room
                .write(1)
                .map_err(|e| format!("room eventfd: {e}"))?;
        }
        Ok(())
    }
}

struct Job {
    head: u16,
    status: GuestAddress,
    action: Action,
    queue: Arc<SharedQueue>,
}

/// The running threads; dropping stops the queues, lets the pool finish
/// the jobs it holds without touching the rings, and joins everything.
pub struct BlockQueues {
    queues: Vec<Arc<SharedQueue>>,
    queue_threads: Vec<WorkerThread>,
    io_threads: Vec<JoinHandle<()>>,
    /// What a resume needs to start the queue threads again: the kicks
    /// (one per queue, as `queues`), the pool's sender, the device and
    /// guest memory.
    kicks: Vec<EventFd>,
    jobs: Option<Sender<Job>>,
    shared: Arc<Shared>,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    /// Between a pause (even one that failed) and a resume.
    paused: bool,
}

impl Drop for BlockQueues {
    fn drop(&mut self) {
        for q in &self.queues {
            q.lock().stopped = true;
        }
        // The queue threads and `jobs` hold every job sender; when they
        // are gone the pool's channel disconnects once drained.
        // Bounded: an I/O stuck in the host's kernel leaves its thread
        // detached rather than hanging a reset.
        self.queue_threads.clear();
        self.jobs = None;
        for t in self.io_threads.drain(..) {
            join_bounded("virtio-blk I/O thread".into(), t);
        }
    }
}

impl BlockQueues {
    /// Stops taking chains, stops the queue threads and waits until every
    /// request taken has been completed (its used entry written and its
    /// interrupt raised), each wait at most [`STOP_TIMEOUT`]; returns each
    /// queue's position. Afterwards the device writes nothing to guest
    /// memory and raises no interrupt until [`Self::resume`]. Err says
    /// what did not stop.
    pub fn pause(&mut self) -> Result<Vec<SavedQueue>, String> {
        self.paused = true;
        for q in &self.queues {
            q.lock().paused = true;
        }
        let mut late = Vec::new();
        for t in self.queue_threads.drain(..) {
            if let Err(t) = t.stop_and_wait() {
                late.push(t);
            }
        }
        if !late.is_empty() {
            let n = late.len();
            self.queue_threads = late;
            return Err(format!(
                "{n} queue thread(s) did not stop within {STOP_TIMEOUT:?}"
            ));
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            let busy: usize = self.queues.iter().map(|q| q.lock().jobs).sum();
            if busy == 0 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{busy} request(s) still in flight after {STOP_TIMEOUT:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(self
            .queues
            .iter()
            .map(|q| SavedQueue::from(q.lock().queue.state()))
            .collect())
    }

    /// Serves the same queues again (a queue the guest broke stays
    /// stopped); each queue thread starts with a kick of its own, which
    /// serves what came while paused and turns the guest's kicks back on.
    pub fn resume(&mut self) -> Result<(), String> {
        if !self.paused {
            return Ok(());
        }
        // A pause that gave up on a queue thread: it must be gone before
        // another serves its queue.
        let mut late = Vec::new();
        for t in self.queue_threads.drain(..) {
            if let Err(t) = t.stop_and_wait() {
                late.push(t);
            }
        }
        if !late.is_empty() {
            self.queue_threads = late;
            return Err("a queue thread from before the pause is still running".into());
        }
        let jobs = self.jobs.as_ref().ok_or("the I/O threads are gone")?;
        for (queue, kick) in self.queues.iter().zip(&self.kicks) {
            {
                let mut st = queue.lock();
                if st.stopped {
                    continue;
                }
                st.paused = false;
            }
            let start =
                |e: std::io::Error| format!("queue {}: starting its thread: {e}", queue.index);
            self.queue_threads.push(
                queue_thread(
                    self.shared.clone(),
                    queue.clone(),
                    kick.try_clone().map_err(start)?,
                    self.mem.clone(),
                    jobs.clone(),
                )
                .map_err(start)?,
            );
            kick.write(1).map_err(start)?;
        }
        self.paused = false;
        Ok(())
    }

    /// Whether every queue thread has ended (tests).
    #[cfg(test)]
    pub(super) fn queue_threads_finished(&self) -> bool {
        self.queue_threads.iter().all(WorkerThread::is_finished)
    }
}

const KICK: u64 = 0;
const ROOM: u64 = 1;

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
        queues: Vec::new(),
        queue_threads: Vec::new(),
        io_threads: Vec::new(),
        kicks: Vec::new(),
        jobs: None,
        shared: shared.clone(),
        mem: mem.clone(),
        paused: false,
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
        let queue = shared_queue(&shared, q.index, q.queue, interrupt.clone())?;
        running.queues.push(queue.clone());
        running.kicks.push(q.kick.try_clone()?);
        running.queue_threads.push(queue_thread(
            shared.clone(),
            queue,
            q.kick,
            mem.clone(),
            tx.clone(),
        )?);
    }
    running.jobs = Some(tx);
    Ok(running)
}

fn shared_queue(
    shared: &Shared,
    index: u16,
    queue: Queue,
    interrupt: Arc<dyn VirtioInterrupt>,
) -> std::io::Result<Arc<SharedQueue>> {
    Ok(Arc::new(SharedQueue {
        index,
        name: format!("{} queue {index}", shared.name),
        limit: usize::from(queue.size()),
        state: Mutex::new(QueueState {
            queue,
            in_flight: 0,
            stalled: false,
            stopped: false,
            paused: false,
            jobs: 0,
        }),
        room: EventFd::new(libc::EFD_NONBLOCK)?,
        interrupt,
    }))
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
        run_job(shared, &mem.memory(), job);
    }
}

/// Runs a request against the disk and completes it (an I/O thread's work).
fn run_job(shared: &Shared, mem: &GuestMemoryMmap, job: Job) {
    #[cfg(test)]
    if let Some(gate) = &shared.io_gate {
        gate.pass();
    }
    let (status, written) = shared.disk.execute(mem, &job.action, &shared.serial);
    count(&shared.counters, &job.action, status);
    // The status byte was checked to be in guest memory when parsed.
    let used = match mem.write_obj(status, job.status) {
        Ok(()) => written.saturating_add(1),
        Err(_) => 0,
    };
    if let Err(e) = job.queue.complete(mem, job.head, used) {
        shared.mark_broken(
            &*job.queue.interrupt,
            &format!("queue {}: {e}", job.queue.index),
        );
    }
    let mut st = job.queue.lock();
    st.jobs = st.jobs.saturating_sub(1);
}

/// Serves `queue` on the calling thread as the device's threads serve it
/// (the queue thread's [`serve_until_idle`], then each request it handed
/// over run and completed as an I/O thread does), until the queue is idle
/// or stopped, for at most `passes` passes. The fuzz targets drive the
/// real serve loop through it without threads. Returns the chains used,
/// or why the queue stopped (the device is then marked broken).
#[doc(hidden)]
pub fn serve_inline(
    shared: &Shared,
    queue: Queue,
    mem: &GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    passes: usize,
) -> Result<usize, String> {
    let queue = shared_queue(shared, 0, queue, interrupt).map_err(|e| e.to_string())?;
    let (tx, rx) = channel();
    let mut used = 0;
    for _ in 0..passes {
        match serve_until_idle(shared, &queue, mem, &tx) {
            Ok(n) => used += n,
            Err(e) => {
                queue.lock().stopped = true;
                shared.mark_broken(&*queue.interrupt, &format!("queue 0: {e}"));
                return Err(e);
            }
        }
        let jobs: Vec<Job> = rx.try_iter().collect();
        if jobs.is_empty() {
            break;
        }
        used += jobs.len();
        for job in jobs {
            run_job(shared, mem, job);
        }
        if shared.broken.load(Ordering::SeqCst) {
            return Err("a completion stopped the queue".into());
        }
    }
    Ok(used)
}

fn queue_thread(
    shared: Arc<Shared>,
    queue: Arc<SharedQueue>,
    kick: EventFd,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    jobs: Sender<Job>,
) -> std::io::Result<WorkerThread> {
    let events = EventLoop::new()?;
    events.add(kick.as_raw_fd(), EventSet::IN, KICK)?;
    events.add(queue.room.as_raw_fd(), EventSet::IN, ROOM)?;
    let name = queue.name.clone();
    let index = queue.index;
    events.spawn(format!("blk-q{index}"), name.clone(), move |_, token, _| {
        let guard = mem.memory();
        let _ = if token == KICK {
            kick.read()
        } else {
            queue.room.read()
        };
        let used = match serve_until_idle(&shared, &queue, &guard, &jobs) {
            Ok(n) => n,
            Err(e) => {
                queue.lock().stopped = true;
                shared.mark_broken(&*queue.interrupt, &format!("queue {index}: {e}"));
                return Flow::Stop;
            }
        };
        // Chains answered here (bad requests); the I/O threads signal
        // their own.
        let notify = used > 0
            && queue
                .lock()
                .queue
                .needs_notification(&*guard)
                .unwrap_or(true);
        if notify {
            if let Err(e) = queue.interrupt.trigger(Interrupt::Queue(index)) {
                queue.lock().stopped = true;
                shared.mark_broken(&*queue.interrupt, &format!("queue {index}: interrupt: {e}"));
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
/// in the meantime are served, unless the queue's limit of requests is in
/// flight: then the queue is marked stalled and the completion that makes
/// room wakes this thread, which turns them on.
fn serve_until_idle(
    shared: &Shared,
    queue: &Arc<SharedQueue>,
    mem: &GuestMemoryMmap,
    jobs: &Sender<Job>,
) -> Result<usize, String> {
    let ring = |e: virtio_queue::Error| format!("notification flags: {e:?}");
    let mut used = 0;
    loop {
        queue.lock().queue.disable_notification(mem).map_err(ring)?;
        used += serve_available(shared, queue, mem, jobs)?;
        let mut st = queue.lock();
        if st.stopped || st.paused {
            // Paused: the resume's kick comes back here and turns the
            // guest's kicks on again.
            return Ok(used);
        }
        if st.in_flight >= queue.limit {
            st.stalled = true;
            return Ok(used);
        }
        if !st.queue.enable_notification(mem).map_err(ring)? {
            return Ok(used);
        }
    }
}

/// Parses available chains while fewer than the queue's limit are in
/// flight: valid requests go to the pool, the others are answered here.
/// Returns how many chains were used here. The queue's lock is held only
/// to take each chain, not while parsing it. An available index the queue
/// refuses (more than its size ahead) is an error: the caller stops the
/// queue (`pop_descriptor_chain` would say "nothing" and leave the index
/// unchanged, so the caller's loop would find work again at once).
fn serve_available(
    shared: &Shared,
    queue: &Arc<SharedQueue>,
    mem: &GuestMemoryMmap,
    jobs: &Sender<Job>,
) -> Result<usize, String> {
    let mut used = 0;
    loop {
        let chain = {
            let mut st = queue.lock();
            if st.in_flight >= queue.limit || st.stopped || st.paused {
                break;
            }
            let next = st
                .queue
                .iter(mem)
                .map_err(|e| format!("available ring: {e}"))?
                .next();
            let Some(chain) = next else {
                break;
            };
            st.in_flight += 1;
            chain
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
                    queue: Arc::clone(queue),
                };
                queue.lock().jobs += 1;
                if jobs.send(job).is_err() {
                    queue.lock().jobs -= 1;
                    return Err("the I/O threads are gone".to_string());
                }
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
        let mut st = queue.lock();
        st.in_flight = st.in_flight.saturating_sub(1);
        st.queue
            .add_used(mem, head, len)
            .map_err(|e| format!("used ring: {e:?}"))?;
        used += 1;
    }
    Ok(used)
}

#[cfg(test)]
#[path = "io_tests.rs"]
mod tests;
