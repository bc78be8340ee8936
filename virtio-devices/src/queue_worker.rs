//! The thread behind a device whose single request queue the VMM serves
//! itself (virtio-pmem, virtio-rng): it waits for the guest's kicks, hands
//! the queue to the device's `process` function, and interrupts the guest
//! when buffers were used and the driver wants to hear of it. Dropping the
//! worker stops and joins the thread.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
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
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

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
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let stop_worker = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::DEVICE_WORKER_THREAD) {
                    return log::error!("{device}: {e}; the request queue is not served");
                }
                if let Err(e) = serve(q.queue, q.kick, stop_worker, mem, interrupt, process) {
                    log::error!("{device}: request queue stopped: {e}");
                }
            })?;
        Ok(QueueWorker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for QueueWorker {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    mut queue: Queue,
    kick: EventFd,
    stop: EventFd,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
    mut process: impl ProcessQueue,
) -> std::io::Result<()> {
    const KICK: u64 = 0;
    const STOP: u64 = 1;
    let epoll = Epoll::new()?;
    epoll.ctl(
        ControlOperation::Add,
        kick.as_raw_fd(),
        EpollEvent::new(EventSet::IN, KICK),
    )?;
    epoll.ctl(
        ControlOperation::Add,
        stop.as_raw_fd(),
        EpollEvent::new(EventSet::IN, STOP),
    )?;
    let mut events = vec![EpollEvent::default(); 2];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for ev in &events[..n] {
            if ev.data() == STOP {
                return Ok(());
            }
            let _ = kick.read();
            let guard = mem.memory();
            let used =
                process(&mut queue, &guard).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
            if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
                interrupt.trigger(Interrupt::Queue(0))?;
            }
        }
    }
}
