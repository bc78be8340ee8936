//! The thread behind a device whose single request queue the VMM serves
//! itself (virtio-pmem, virtio-rng): it waits for the guest's kicks, hands
//! the queue to the device's `process` function, and interrupts the guest
//! when buffers were used and the driver wants to hear of it (on the
//! shared [`crate::event_loop`]). Dropping the worker stops and joins the
//! thread. [`QueueWorker::pause`] stops the thread and gives the queue's
//! position; [`QueueWorker::resume`] serves the same queue again.
//!
//! A queue `process` fails on (an available index more than the queue's
//! size ahead, a used ring it cannot write) is not served again: the thread
//! ends, the worker is [`QueueWorker::is_broken`] (the device shows
//! DEVICE_NEEDS_RESET) and the driver gets a configuration interrupt, once.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
use crate::device_state::{DeviceStateError, SavedQueue};
use crate::event_loop::{EventLoop, Flow, WorkerThread, STOP_TIMEOUT};
use crate::GuestMemoryMmap;

/// Serves the queue's available chains; returns how many were used.
pub trait ProcessQueue:
    FnMut(&mut Queue, &GuestMemoryMmap) -> Result<usize, virtio_queue::Error> + Send + 'static
{
}
impl<
        F: FnMut(&mut Queue, &GuestMemoryMmap) -> Result<usize, virtio_queue::Error> + Send + 'static,
    > ProcessQueue for F
{
}

type BoxedProcess =
    Box<dyn FnMut(&mut Queue, &GuestMemoryMmap) -> Result<usize, virtio_queue::Error> + Send>;

/// What the thread serves, kept by the worker too so that a pause can
/// read the queue's position after the thread ended and a resume can serve
/// the same queue again.
struct Served {
    queue: Queue,
    kick: EventFd,
    process: BoxedProcess,
}

pub struct QueueWorker {
    /// None while paused (or after the queue broke and a resume found it
    /// so).
    thread: Option<WorkerThread>,
    served: Arc<Mutex<Served>>,
    broken: Arc<AtomicBool>,
    thread_name: String,
    device: String,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
    paused: bool,
}

/// The token of the queue's kick eventfd.
const KICK: u64 = 0;

impl QueueWorker {
    /// Starts the thread `thread_name`; `device` names the device in logs.
    pub fn spawn(
        thread_name: String,
        device: String,
        q: ActivatedQueue,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        process: impl ProcessQueue,
    ) -> std::io::Result<Self> {
        let mut worker = QueueWorker {
            thread: None,
            served: Arc::new(Mutex::new(Served {
                queue: q.queue,
                kick: q.kick,
                process: Box::new(process),
            })),
            broken: Arc::new(AtomicBool::new(false)),
            thread_name,
            device,
            mem,
            interrupt,
            paused: false,
        };
        worker.thread = Some(worker.start_thread()?);
        Ok(worker)
    }

    fn start_thread(&self) -> std::io::Result<WorkerThread> {
        let events = EventLoop::new()?;
        events.add(lock(&self.served).kick.as_raw_fd(), EventSet::IN, KICK)?;
        let served = self.served.clone();
        let (mem, interrupt) = (self.mem.clone(), self.interrupt.clone());
        let device = self.device.clone();
        let mark = self.broken.clone();
        let stop = move |why: String| {
            mark.store(true, Ordering::SeqCst);
            crate::error_limited!(
                "{device}: request queue stopped until the driver resets the device \
                 (DEVICE_NEEDS_RESET): {why}"
            );
            let _ = interrupt.trigger(Interrupt::Config);
            Flow::Stop
        };
        let interrupt_queue = self.interrupt.clone();
        events.spawn(
            self.thread_name.clone(),
            self.device.clone(),
            move |_, _, _| {
                let mut served = lock(&served);
                let Served {
                    queue,
                    kick,
                    process,
                } = &mut *served;
                let _ = kick.read();
                let guard = mem.memory();
                let used = match process(queue, &guard) {
                    Ok(used) => used,
                    Err(e) => return stop(e.to_string()),
                };
                if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
                    if let Err(e) = interrupt_queue.trigger(Interrupt::Queue(0)) {
                        return stop(format!("interrupt: {e}"));
                    }
                }
                Flow::Continue
            },
        )
    }

    /// The queue stopped on an error: the device needs a reset.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// Stops the thread (bounded): `process` answers every chain it takes
    /// before returning, so once the thread has ended the queue's position
    /// is final and nothing touches guest memory or raises an interrupt.
    /// Kicks that come meanwhile wait in the kick eventfd for
    /// [`Self::resume`].
    pub fn pause(&mut self) -> Result<SavedQueue, DeviceStateError> {
        self.paused = true;
        if let Some(thread) = self.thread.take() {
            if let Err(still) = thread.stop_and_wait() {
                self.thread = Some(still);
                return Err(DeviceStateError::Pause {
                    device: self.device.clone(),
                    reason: format!(
                        "its request queue thread did not stop within {STOP_TIMEOUT:?}"
                    ),
                });
            }
        }
        Ok(SavedQueue::from(lock(&self.served).queue.state()))
    }

    /// Serves the queue again from where [`Self::pause`] left it (a queue
    /// that broke stays stopped until the driver resets the device).
    pub fn resume(&mut self) -> Result<(), DeviceStateError> {
        if !self.paused {
            return Ok(());
        }
        if let Some(thread) = self.thread.take() {
            // A pause that timed out: that thread must be gone before
            // another serves the queue.
            if let Err(still) = thread.stop_and_wait() {
                self.thread = Some(still);
                return Err(DeviceStateError::Pause {
                    device: self.device.clone(),
                    reason:
                        "resuming: its request queue thread from before the pause is still running"
                            .into(),
                });
            }
        }
        if !self.is_broken() {
            self.thread = Some(self.start_thread().map_err(|e| DeviceStateError::Pause {
                device: self.device.clone(),
                reason: format!("resuming: starting its thread: {e}"),
            })?);
        }
        self.paused = false;
        Ok(())
    }
}

fn lock(served: &Mutex<Served>) -> std::sync::MutexGuard<'_, Served> {
    served.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the devices' tests share: a device with one request queue driven
/// through its real worker with an impossible available index.
#[cfg(test)]
pub(crate) mod hostile {
    use std::sync::mpsc::channel;
    use std::sync::Mutex;
    use std::time::Duration;

    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::device::VirtioDevice;
    use crate::test_util::ChannelInterrupt;

    /// Activates `dev` on a queue of 16 whose available index is 16 + 5
    /// ahead of the device and kicks it: the worker stops, the device
    /// shows DEVICE_NEEDS_RESET after one configuration interrupt, nothing
    /// is used, and a reset clears it.
    pub(crate) fn an_impossible_index_stops_the_queue(dev: &mut dyn VirtioDevice) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let vq = MockSplitQueue::new(&mem, 16);
        mem.write_obj(16u16 + 5, vq.avail_addr().unchecked_add(2))
            .unwrap();
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
        assert!(!dev.needs_reset());
        kick.write(1).unwrap();
        // A bound for a hang, not a speed figure.
        let got = rx.recv_timeout(Duration::from_secs(30));
        assert_eq!(
            got.ok(),
            Some(Interrupt::Config),
            "no configuration interrupt"
        );
        assert!(dev.needs_reset(), "DEVICE_NEEDS_RESET");
        kick.write(1).unwrap();
        let used_idx: u16 = mem.read_obj(vq.used_addr().unchecked_add(2)).unwrap();
        assert_eq!(used_idx, 0);
        assert!(
            rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "one interrupt"
        );
        assert!(dev.reset());
        assert!(!dev.needs_reset(), "a reset clears it");
    }
}

/// The pause/save/restore rig for a device with one request queue (rng,
/// pmem), driven through its real worker.
#[cfg(test)]
pub(crate) mod pausing {
    use std::sync::mpsc::{channel, Receiver};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};

    use super::*;
    use crate::device::VirtioDevice;

    use crate::test_util::ChannelInterrupt;

    fn used_idx(mem: &GuestMemoryMmap, vq: &MockSplitQueue<'_, GuestMemoryMmap>) -> u16 {
        mem.read_obj(vq.used_addr().unchecked_add(2)).unwrap()
    }

    /// Waits until the used index reaches `want`; a bound for a hang, not a
    /// speed figure.
    fn wait_used(mem: &GuestMemoryMmap, vq: &MockSplitQueue<'_, GuestMemoryMmap>, want: u16) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while used_idx(mem, vq) != want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(used_idx(mem, vq), want, "chains used");
    }

    fn activate(
        dev: &mut dyn VirtioDevice,
        mem: &GuestMemoryMmap,
        queue: Queue,
    ) -> (EventFd, Receiver<Interrupt>) {
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
        (kick, rx)
    }

    /// Three chains served, then paused: the position is 3 used of 3
    /// taken; a fourth chain kicked while paused stays untouched and raises
    /// nothing; resumed, it is served. Paused again and saved, a new
    /// device restored from that state and activated on the saved queue
    /// serves a chain published (and kicked) while the old one was paused,
    /// without a new kick, and its used entries follow the old ones. A
    /// saved state that is not the device's is refused by field.
    /// `chain(n)` is the device's n-th request, its descriptors placed at
    /// index `n * len`.
    pub(crate) fn pause_resume_and_restore(
        make: &dyn Fn() -> Box<dyn VirtioDevice>,
        chain: &dyn Fn(u16) -> Vec<RawDescriptor>,
    ) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let vq = MockSplitQueue::new(&mem, 16);
        let put = |n: u16| {
            let descs = chain(n);
            let at = n * narrow::sat_u16(descs.len());
            vq.add_desc_chains(&descs, at).unwrap();
        };
        let mut dev = make();
        assert!(dev.check_movable().is_ok());
        let (kick, rx) = activate(&mut *dev, &mem, vq.create_queue().unwrap());
        for n in 0..3 {
            put(n);
        }
        kick.write(1).unwrap();
        wait_used(&mem, &vq, 3);

        let saved = dev.pause().unwrap();
        assert_eq!(saved.len(), 1);
        assert_eq!((saved[0].next_avail, saved[0].next_used), (3, 3));
        while rx.try_recv().is_ok() {}
        put(3);
        kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(used_idx(&mem, &vq), 3, "nothing served while paused");
        assert!(rx.try_recv().is_err(), "no interrupt while paused");
        assert_eq!(dev.pause().unwrap(), saved, "a second pause sees the same");

        dev.resume().unwrap();
        wait_used(&mem, &vq, 4);

        let saved = dev.pause().unwrap();
        assert_eq!((saved[0].next_avail, saved[0].next_used), (4, 4));
        put(4);
        kick.write(1).unwrap(); // reaches the old process only
        let state = dev.save_state().unwrap();
        drop(dev);
        assert_eq!(used_idx(&mem, &vq), 4);

        // Not an object; an object with a field no device saves (named,
        // or the first field the device misses is).
        let mut bad = make();
        let mut with_extra = state.clone();
        with_extra["no such field"] = 1.into();
        for (garbage, field) in [
            (serde_json::json!(7), "state"),
            (with_extra, "no such field"),
        ] {
            match bad.restore_state(&garbage) {
                Err(crate::device_state::DeviceStateError::Invalid { field: got, .. }) => {
                    assert_eq!(got, field)
                }
                other => panic!("{other:?}"),
            }
        }

        let mut dev = make();
        dev.restore_state(&state).unwrap();
        let (_kick, _rx) = activate(&mut *dev, &mem, saved[0].to_queue().unwrap());
        wait_used(&mem, &vq, 5);
        // The fifth used entry names the fifth chain's head.
        let head: u32 = mem
            .read_obj(vq.used_addr().unchecked_add(4 + 8 * 4))
            .unwrap();
        let len = u32::from(narrow::sat_u16(chain(4).len()));
        assert_eq!(head, 4 * len);
        assert_eq!(
            dev.pause().unwrap()[0].next_used,
            5,
            "positions continue from the saved ones"
        );
    }
}
