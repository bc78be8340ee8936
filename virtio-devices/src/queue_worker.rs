//! The thread behind a device whose single request queue the VMM serves
//! itself (virtio-pmem, virtio-rng): it waits for the guest's kicks, hands
//! the queue to the device's `process` function, and interrupts the guest
//! when buffers were used and the driver wants to hear of it (on the
//! shared [`crate::event_loop`]). Dropping the worker stops and joins the
//! thread.

use std::os::fd::AsRawFd;
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
        let what = device.clone();
        let thread = events.spawn(thread_name, what, move |_, _, _| {
            let _ = kick.read();
            let guard = mem.memory();
            let used = match process(&mut queue, &guard) {
                Ok(used) => used,
                Err(e) => {
                    crate::error_limited!("{device}: request queue stopped: {e:?}");
                    return Flow::Stop;
                }
            };
            if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
                if let Err(e) = interrupt.trigger(Interrupt::Queue(0)) {
                    crate::error_limited!("{device}: request queue stopped: interrupt: {e}");
                    return Flow::Stop;
                }
            }
            Flow::Continue
        })?;
        Ok(QueueWorker { _thread: thread })
    }
}
