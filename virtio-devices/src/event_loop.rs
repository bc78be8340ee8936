//! The loop every device worker thread runs: an epoll set, a stop eventfd,
//! a seccomp filter (the device workers' kind, or a device's own kind with
//! [`EventLoop::spawn_as`]), and a handler called for each ready fd.
//! Dropping the [`WorkerThread`] stops and joins it.
//!
//! Stopping never waits without bound: a thread that has not ended within
//! [`STOP_TIMEOUT`] of being told (a handler stuck in a loop, an I/O that
//! does not return) is left running, detached, with an error logged, so a
//! reset, an eject or a shutdown always completes. A caller that holds a
//! lock others need (the transport's device lock, which vCPU config reads
//! take) stops its workers inside [`deferring_joins`] and waits for their
//! threads only after releasing it.

use std::cell::RefCell;
use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
        let label = what.clone();
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
            what: label,
            thread: Some(thread),
            timeout: STOP_TIMEOUT,
        })
    }
}

/// How long stopping waits for a device thread before leaving it detached.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A thread being stopped: what it is (for the log) and its handle.
struct Stopping {
    what: String,
    thread: JoinHandle<()>,
}

thread_local! {
    /// Threads told to stop inside [`deferring_joins`] on this thread.
    static DEFERRED: RefCell<Option<Vec<Stopping>>> = const { RefCell::new(None) };
}

/// Runs `f`; the threads of workers stopped meanwhile on this thread
/// (dropped [`WorkerThread`]s, [`join_bounded`] calls) are told to stop at
/// once but waited for only when the returned [`PendingJoins`] is dropped,
/// so the caller can release its locks first.
pub fn deferring_joins<R>(f: impl FnOnce() -> R) -> (R, PendingJoins) {
    let outer = DEFERRED.with(|d| d.borrow_mut().replace(Vec::new()));
    let r = f();
    let threads = DEFERRED.with(|d| std::mem::replace(&mut *d.borrow_mut(), outer));
    (r, PendingJoins(threads.unwrap_or_default()))
}

/// Threads told to stop; dropping waits for them, within [`STOP_TIMEOUT`].
#[must_use = "dropping it waits for the threads"]
pub struct PendingJoins(Vec<Stopping>);

impl Drop for PendingJoins {
    fn drop(&mut self) {
        join_all(std::mem::take(&mut self.0), STOP_TIMEOUT);
    }
}

/// Waits for `thread`, which was told to stop, at most [`STOP_TIMEOUT`]
/// (or defers that to the enclosing [`deferring_joins`]).
pub fn join_bounded(what: String, thread: JoinHandle<()>) {
    join_within(what, thread, STOP_TIMEOUT);
}

fn join_within(what: String, thread: JoinHandle<()>, timeout: Duration) {
    let stopping = Stopping { what, thread };
    let deferred = DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(list) => {
            list.push(stopping);
            None
        }
        None => Some(stopping),
    });
    if let Some(s) = deferred {
        join_all(vec![s], timeout);
    }
}

/// Joins each thread that ends before `timeout` (one deadline for all);
/// the others are detached with an error.
fn join_all(threads: Vec<Stopping>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    for Stopping { what, thread } in threads {
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            crate::error_limited!(
                "{what}: the thread did not stop within {timeout:?}; it is left running, detached"
            );
        }
    }
}

/// A running worker; dropping it stops and joins the thread (bounded).
pub struct WorkerThread {
    stop: EventFd,
    what: String,
    thread: Option<JoinHandle<()>>,
    timeout: Duration,
}

impl WorkerThread {
    /// Whether the thread has ended (its handler returned [`Flow::Stop`],
    /// or it failed to start).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Tells the thread to stop and waits for it, at most this worker's
    /// stop timeout, without detaching it (pausing a device: the caller
    /// then reads what the thread shared with it). Err gives the worker
    /// back when the thread has not ended in time: it has been told to
    /// stop, and may still be in its handler.
    pub fn stop_and_wait(mut self) -> Result<(), WorkerThread> {
        let _ = self.stop.write(1);
        let deadline = Instant::now() + self.timeout;
        while !self.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.is_finished() {
            return Err(self);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        Ok(())
    }

    /// How long stopping waits for this thread (tests: a stuck thread
    /// that must not be given up on).
    #[cfg(test)]
    pub(crate) fn set_stop_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
}

impl Drop for WorkerThread {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            join_within(std::mem::take(&mut self.what), t, self.timeout);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::channel;
    use std::sync::Arc;

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

    /// A worker whose handler is stuck and a flag that releases it.
    pub(crate) fn stuck_worker() -> (WorkerThread, Arc<AtomicBool>) {
        let l = EventLoop::new().unwrap();
        let a = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        l.add(a.as_raw_fd(), EventSet::IN, 1).unwrap();
        let release = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel();
        let released = release.clone();
        let worker = l
            .spawn("t".into(), "stuck".into(), move |_, _, _| {
                let _ = tx.send(());
                // Never back to epoll: the stop eventfd is not seen.
                while !released.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Flow::Continue
            })
            .unwrap();
        a.write(1).unwrap();
        rx.recv().unwrap();
        (worker, release)
    }

    /// A handler that never returns: dropping its worker gives up after
    /// the timeout and leaves the thread detached instead of hanging the
    /// caller (a reset on the activator, an eject, a shutdown).
    #[test]
    fn dropping_a_worker_whose_handler_never_returns_does_not_hang() {
        let (mut worker, release) = stuck_worker();
        worker.set_stop_timeout(Duration::from_millis(20));
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            drop(worker);
            tx.send(()).unwrap();
        });
        // A bound for a hang, not a speed figure: without the bounded join
        // the drop never returns.
        let dropped = rx.recv_timeout(Duration::from_secs(60));
        release.store(true, Ordering::SeqCst);
        assert!(dropped.is_ok(), "dropping the worker hung");
    }

    /// Pausing waits for the thread to end but never without bound: a
    /// handler that does not return gives the worker back (still told to
    /// stop), and once it returns the thread ends and a second wait
    /// succeeds.
    #[test]
    fn stop_and_wait_gives_a_stuck_worker_back_and_succeeds_once_it_ends() {
        let (mut worker, release) = stuck_worker();
        worker.set_stop_timeout(Duration::from_millis(20));
        let mut worker = worker.stop_and_wait().expect_err("the handler is stuck");
        assert!(!worker.is_finished());
        release.store(true, Ordering::SeqCst);
        // A bound for a hang, not a speed figure.
        worker.set_stop_timeout(Duration::from_secs(60));
        assert!(worker.stop_and_wait().is_ok());

        let l = EventLoop::new().unwrap();
        let w = l
            .spawn("t".into(), "idle".into(), |_, _, _| Flow::Continue)
            .unwrap();
        assert!(w.stop_and_wait().is_ok(), "an idle worker stops at once");
    }

    /// Inside `deferring_joins` a dropped worker is told to stop but not
    /// waited for: the caller gets its result at once, with the thread to
    /// wait for once its locks are released.
    #[test]
    fn deferred_joins_wait_only_when_the_caller_lets_go() {
        let (worker, release) = stuck_worker();
        let ((), pending) = deferring_joins(|| drop(worker));
        assert_eq!(pending.0.len(), 1, "not joined inside the scope");
        assert!(!pending.0[0].thread.is_finished());
        release.store(true, Ordering::SeqCst);
        drop(pending);
        // Outside the scope nothing is deferred any more.
        assert!(DEFERRED.with(|d| d.borrow().is_none()));
    }
}
