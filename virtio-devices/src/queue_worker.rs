//! The thread behind a device whose single request queue the VMM serves
//! itself (virtio-pmem, virtio-rng): it waits for the guest's kicks, hands
//! the queue to the device's `process` function, and interrupts the guest
//! when buffers were used and the driver wants to hear of it (on the
//! shared [`crate::event_loop`]). Dropping the worker stops and joins the
//! thread.
//!
//! A queue `process` fails on (an available index more than the queue's
//! size ahead, a used ring it cannot write) is not served again: the thread
//! ends, the worker is [`QueueWorker::is_broken`] (the device shows
//! DEVICE_NEEDS_RESET) and the driver gets a configuration interrupt, once.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;

use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
use crate::event_loop::{EventLoop, Flow, WorkerThread};
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

pub struct QueueWorker {
    _thread: WorkerThread,
    broken: Arc<AtomicBool>,
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
        mut process: impl ProcessQueue,
    ) -> std::io::Result<Self> {
        let events = EventLoop::new()?;
        events.add(q.kick.as_raw_fd(), EventSet::IN, KICK)?;
        let (mut queue, kick) = (q.queue, q.kick);
        let interrupt_queue = interrupt.clone();
        let what = device.clone();
        let broken = Arc::new(AtomicBool::new(false));
        let mark = broken.clone();
        let stop = move |why: String| {
            mark.store(true, Ordering::SeqCst);
            crate::error_limited!(
                "{device}: request queue stopped until the driver resets the device \
                 (DEVICE_NEEDS_RESET): {why}"
            );
            let _ = interrupt.trigger(Interrupt::Config);
            Flow::Stop
        };
        let thread = events.spawn(thread_name, what, move |_, _, _| {
            let _ = kick.read();
            let guard = mem.memory();
            let used = match process(&mut queue, &guard) {
                Ok(used) => used,
                Err(e) => return stop(e.to_string()),
            };
            if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
                if let Err(e) = interrupt_queue.trigger(Interrupt::Queue(0)) {
                    return stop(format!("interrupt: {e}"));
                }
            }
            Flow::Continue
        })?;
        Ok(QueueWorker {
            _thread: thread,
            broken,
        })
    }

    /// The queue stopped on an error: the device needs a reset.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }
}

/// What the devices' tests share: a device with one request queue driven
/// through its real worker with an impossible available index.
#[cfg(test)]
pub(crate) mod hostile {
    use std::sync::mpsc::{channel, Sender};
    use std::sync::Mutex;
    use std::time::Duration;

    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::device::VirtioDevice;

    struct Sent(Mutex<Sender<Interrupt>>);

    impl VirtioInterrupt for Sent {
        fn trigger(&self, i: Interrupt) -> std::io::Result<()> {
            let _ = self.0.lock().unwrap().send(i);
            Ok(())
        }
        fn notifier(&self, _: Interrupt) -> Option<EventFd> {
            None
        }
    }

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
            Arc::new(Sent(Mutex::new(tx))),
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
