//! The loop every device worker thread runs: an epoll set, a stop eventfd,
//! the device-worker seccomp filter, and a handler called for each ready fd.
//! Dropping the [`WorkerThread`] stops and joins it.

use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// The token of the stop eventfd; handlers never see it.
const STOP: u64 = u64::MAX;

/// What the handler wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// End the thread (an error the handler has logged).
    Stop,
}

/// The fds a worker waits on, before its thread starts and from inside
/// its handler.
pub struct EventLoop {
    epoll: Epoll,
    stop: EventFd,
}

impl EventLoop {
    pub fn new() -> std::io::Result<Self> {
        let l = EventLoop {
            epoll: Epoll::new()?,
            stop: EventFd::new(libc::EFD_NONBLOCK)?,
        };
        l.add(l.stop.as_raw_fd(), EventSet::IN, STOP)?;
        Ok(l)
    }

    /// Watches `fd` for `events`; the handler gets `token` (not u64::MAX).
    pub fn add(&self, fd: RawFd, events: EventSet, token: u64) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }

    /// Stops watching `fd` (it hung up, or its channel broke).
    pub fn remove(&self, fd: RawFd) {
        let _ = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
    }

    /// Starts the thread `name`; `what` names the worker in logs.
    pub fn spawn(
        self,
        name: String,
        what: String,
        handle: impl FnMut(&EventLoop, u64, EventSet) -> Flow + Send + 'static,
    ) -> std::io::Result<WorkerThread> {
        self.spawn_as(crate::DEVICE_WORKER_THREAD, name, what, handle)
    }

    /// [`Self::spawn`] for a worker with a seccomp list of its own
    /// (`thread_kind`), such as the vsock device's.
    pub fn spawn_as(
        self,
        thread_kind: &'static str,
        name: String,
        what: String,
        mut handle: impl FnMut(&EventLoop, u64, EventSet) -> Flow + Send + 'static,
    ) -> std::io::Result<WorkerThread> {
        let stop = self.stop.try_clone()?;
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            if let Err(e) = seccomp::enter_thread(thread_kind) {
                return crate::error_limited!("{what}: {e}; the worker does not run");
            }
            let mut events = vec![EpollEvent::default(); 16];
            loop {
                let n = match self.epoll.wait(-1, &mut events) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return crate::error_limited!("{what}: epoll: {e}"),
                };
                for ev in &events[..n] {
                    if ev.data() == STOP {
                        return;
                    }
                    if handle(&self, ev.data(), ev.event_set()) == Flow::Stop {
                        return;
                    }
                }
            }
        })?;
        Ok(WorkerThread {
            stop,
            thread: Some(thread),
        })
    }
}

/// A running worker; dropping it stops and joins the thread.
pub struct WorkerThread {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl Drop for WorkerThread {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;

    #[test]
    fn handles_ready_fds_until_dropped_or_told_to_stop() {
        let l = EventLoop::new().unwrap();
        let a = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        l.add(a.as_raw_fd(), EventSet::IN, 7).unwrap();
        let (tx, rx) = channel();
        let a2 = a.try_clone().unwrap();
        let worker = l
            .spawn("t".into(), "test".into(), move |_, token, _| {
                let _ = a2.read();
                tx.send(token).unwrap();
                Flow::Continue
            })
            .unwrap();
        a.write(1).unwrap();
        assert_eq!(rx.recv().unwrap(), 7);
        drop(worker); // stops and joins

        let l = EventLoop::new().unwrap();
        let b = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        l.add(b.as_raw_fd(), EventSet::IN, 1).unwrap();
        let (tx, rx) = channel();
        let _worker = l
            .spawn("t".into(), "test".into(), move |_, _, _| {
                tx.send(()).unwrap();
                Flow::Stop
            })
            .unwrap();
        b.write(1).unwrap();
        rx.recv().unwrap();
        // The thread ended on Stop: a second event is not handled.
        b.write(1).unwrap();
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(100))
            .is_err());
    }
}
