//! The thread that runs beside an active vhost-user-fs device: it relays the
//! daemon's used-buffer notifications (vring call eventfds) to the
//! transport's interrupt, serves the backend request channel, and notices
//! when the daemon goes away.
//!
//! Calls are relayed only where the transport has no irqfd to hand the
//! daemon: virtio-MMIO keeps an InterruptStatus register the driver reads to
//! learn why it was interrupted, which only `trigger` sets. On virtio-PCI
//! with MSI-X the daemon writes the vector's irqfd and this thread is not
//! involved.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::FrontendReqHandler;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::backend_req::DaxRequestHandler;
use super::metrics::MapStage;
use super::window::DaxWindow;
use crate::device::{Interrupt, VirtioInterrupt};
use crate::event_loop::{EventLoop, Flow, WorkerThread};

pub struct WorkerContext {
    pub id: String,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// The queues whose calls this thread relays: (queue index, call eventfd).
    pub calls: Vec<(u16, EventFd)>,
    /// Every queue's error eventfd (SET_VRING_ERR): the daemon writes it when
    /// it stops serving the queue.
    pub errors: Vec<(u16, EventFd)>,
    /// Set when a queue error arrives: the transport shows DEVICE_NEEDS_RESET.
    pub queue_error: Arc<AtomicBool>,
    pub requests: Option<Arc<Mutex<FrontendReqHandler<DaxRequestHandler>>>>,
    pub window: Option<Arc<DaxWindow>>,
    pub failed: Arc<AtomicBool>,
    /// The main vhost-user socket, watched for the daemon hanging up (the
    /// backend request channel cannot tell: this side holds both its ends).
    pub main_socket: RawFd,
}

const REQUESTS: u64 = u64::MAX - 1;
const MAIN_SOCKET: u64 = u64::MAX - 2;
/// The window's inotify fd: a mapped file was modified (maybe truncated).
const FILE_WATCH: u64 = u64::MAX - 3;
/// Once a second: the window's scratch budget and unwatched files.
const WINDOW_TICK: u64 = u64::MAX - 4;
/// Error eventfds are registered as ERROR_BASE + their index in `errors`.
const ERROR_BASE: u64 = 1 << 32;

/// Starts the worker on the shared event loop; dropping the returned
/// thread stops it.
pub fn spawn(ctx: WorkerContext) -> std::io::Result<WorkerThread> {
    let events = EventLoop::new()?;
    for (slot, (_, call)) in ctx.calls.iter().enumerate() {
        events.add(call.as_raw_fd(), EventSet::IN, slot as u64)?;
    }
    for (slot, (_, error)) in ctx.errors.iter().enumerate() {
        events.add(error.as_raw_fd(), EventSet::IN, ERROR_BASE + slot as u64)?;
    }
    events.add(ctx.main_socket, EventSet::READ_HANG_UP, MAIN_SOCKET)?;
    if let Some(r) = &ctx.requests {
        let fd = r.lock().unwrap_or_else(|p| p.into_inner()).as_raw_fd();
        events.add(fd, EventSet::IN, REQUESTS)?;
    }
    let mut tick = None;
    if let Some(w) = &ctx.window {
        if let Some(fd) = w.file_watch_fd() {
            events.add(fd, EventSet::IN, FILE_WATCH)?;
        }
        let mut timer = vmm_sys_util::timerfd::TimerFd::new()?;
        let second = std::time::Duration::from_secs(1);
        timer.reset(second, Some(second))?;
        events.add(timer.as_raw_fd(), EventSet::IN, WINDOW_TICK)?;
        tick = Some(timer);
    }
    let (name, what) = (format!("fs-{}", ctx.id), format!("fs {}", ctx.id));
    events.spawn(name, what, move |events, token, set| {
        match (token, &ctx.window, &mut tick) {
            (FILE_WATCH, Some(w), _) => {
                w.on_file_events();
            }
            (WINDOW_TICK, Some(w), Some(timer)) => {
                let _ = timer.wait();
                w.tick();
            }
            _ => handle(&ctx, events, token, set),
        }
        Flow::Continue
    })
}

fn handle(ctx: &WorkerContext, events: &EventLoop, token: u64, set: EventSet) {
    match token {
        MAIN_SOCKET => {
            events.remove(ctx.main_socket);
            daemon_gone(ctx);
        }
        REQUESTS => {
            if !serve_request(ctx, events, set) {
                daemon_gone(ctx);
            }
        }
        slot if slot >= ERROR_BASE => {
            let Some((queue, error)) = ctx.errors.get(narrow::usize_of(slot - ERROR_BASE)) else {
                return;
            };
            if error.read().is_ok() {
                queue_error(ctx, *queue);
            }
        }
        slot => {
            let Some((queue, call)) = ctx.calls.get(narrow::usize_of(slot)) else {
                return;
            };
            if call.read().is_ok() {
                if let Err(e) = ctx.interrupt.trigger(Interrupt::Queue(*queue)) {
                    crate::warn_limited!("fs {}: interrupt for queue {queue}: {e}", ctx.id);
                }
            }
        }
    }
}

/// vhost-user message header: request, flags, payload size (u32 each).
const HEADER_LEN: usize = 12;
/// Largest payload a vhost-user message may carry (the crate's MAX_MSG_SIZE).
const MAX_PAYLOAD: usize = 0x1000;

/// Waits (at most `patience`, [`super::VHOST_USER_TIMEOUT`] in use) until a whole message is queued
/// on the request channel `fd`: `handle_request` reads until it has one and
/// retries on its own, so a daemon that sent half a message and stopped
/// would hold this thread, and the lock a reset takes, for ever. Anything
/// that is not a half message (end of file, an error, a size over the
/// limit) is left for `handle_request` to report.
fn whole_message_queued(fd: RawFd, patience: std::time::Duration) -> bool {
    let mut buf = [0u8; HEADER_LEN + MAX_PAYLOAD];
    let deadline = std::time::Instant::now() + patience;
    loop {
        // SAFETY: `buf` is writable for its whole length; MSG_PEEK leaves
        // the bytes (and any fds) queued for the real read.
        let n = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match usize::try_from(n) {
            Ok(0) => return true,
            Ok(n) if n >= HEADER_LEN => {
                let size = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
                if size > MAX_PAYLOAD || n >= HEADER_LEN + size {
                    return true;
                }
            }
            Ok(_) => {}
            Err(_) => {
                if std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
                    return true;
                }
            }
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        // Rare (a message split across writes): poll would not help, the
        // socket stays readable while part of a message is queued.
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Serves one backend request; false when the channel is closed.
fn serve_request(ctx: &WorkerContext, loop_: &EventLoop, events: EventSet) -> bool {
    let Some(requests) = &ctx.requests else {
        return true;
    };
    let mut requests = requests.lock().unwrap_or_else(|p| p.into_inner());
    let maps_before = ctx
        .window
        .as_ref()
        .map(|w| w.metrics.maps.load(Ordering::Relaxed));
    let started = std::time::Instant::now();
    if let Some(w) = &ctx.window {
        w.metrics.request_started(Some(started));
    }
    let served = serve_one(&ctx.id, &mut requests, events, super::VHOST_USER_TIMEOUT);
    // A map was served (message read, mapped, ack written): its whole time here.
    if let (Some(w), Some(before)) = (&ctx.window, maps_before) {
        if w.metrics.maps.load(Ordering::Relaxed) != before {
            w.metrics.record_stage(MapStage::Request, started.elapsed());
        }
        w.metrics.request_started(None);
    }
    let fd = requests.as_raw_fd();
    drop(requests);
    // The daemon has its ack: now the new range's pre-fault, off the
    // SETUPMAPPING round trip (the guest waits for that, not for this).
    // It gives way, step by step, to the next request: a SHMEM_MAP that
    // waited behind a whole range's pre-fault was most of a cold
    // SETUPMAPPING's cost (docs/benchmarks.md).
    if let Some(w) = &ctx.window {
        w.run_deferred_prefault(&|| served && readable(fd));
    }
    if !served {
        // Hang-up, or a broken channel: stop watching it.
        loop_.remove(fd);
    }
    served
}

/// Whether `fd` has something to read now.
fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd that outlives the call; a zero timeout never blocks.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// Reads and answers one backend request from the channel `requests` that
/// the event loop reported with `events`, waiting at most `patience` for
/// the rest of a half-sent one; false when the channel is closed or broken
/// (the caller stops watching it). Public for the fuzz target that feeds
/// the channel a daemon's bytes (fuzz/fuzz_targets/backend_requests.rs).
pub fn serve_one(
    id: &str,
    requests: &mut FrontendReqHandler<DaxRequestHandler>,
    events: EventSet,
    patience: std::time::Duration,
) -> bool {
    if events.contains(EventSet::IN) && !whole_message_queued(requests.as_raw_fd(), patience) {
        tracing::error!(
            "fs {id}: backend request channel: the daemon sent part of a request and nothing more for {}s",
            patience.as_secs()
        );
    } else if events.contains(EventSet::IN) {
        match requests.handle_request() {
            Ok(_) | Err(vhost::vhost_user::Error::ReqHandlerError(_)) => return true,
            Err(vhost::vhost_user::Error::InvalidMessage) => {
                crate::warn_limited!("fs {id}: malformed backend request ignored");
                return true;
            }
            Err(
                e @ (vhost::vhost_user::Error::Disconnected
                | vhost::vhost_user::Error::PartialMessage
                | vhost::vhost_user::Error::SocketBroken(_)
                | vhost::vhost_user::Error::SocketError(_)),
            ) => {
                tracing::error!("fs {id}: backend request channel: {e}");
            }
            Err(e) => {
                crate::warn_limited!("fs {id}: backend request failed: {e}");
                return true;
            }
        }
    }
    false
}

/// The daemon stopped serving `queue`: the driver is told the device needs
/// a reset (status bit and a configuration interrupt); logged once.
fn queue_error(ctx: &WorkerContext, queue: u16) {
    if !ctx.queue_error.swap(true, Ordering::SeqCst) {
        tracing::error!(
            "fs {}: the daemon stopped serving queue {queue} (see its log for why); DEVICE_NEEDS_RESET is set, \
             the VM and its other devices keep running",
            ctx.id
        );
    }
    if let Err(e) = ctx.interrupt.trigger(Interrupt::Config) {
        crate::warn_limited!("fs {}: configuration interrupt: {e}", ctx.id);
    }
}

fn daemon_gone(ctx: &WorkerContext) {
    if !ctx.failed.swap(true, Ordering::SeqCst) {
        tracing::error!(
            "fs {}: the vhost-user daemon disconnected; the device is failed (guest I/O on it will not complete), \
             the VM and its other devices keep running",
            ctx.id
        );
        if let Some(w) = &ctx.window {
            w.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;

    fn header(size: u32) -> Vec<u8> {
        let mut h = 9u32.to_le_bytes().to_vec(); // SHMEM_MAP
        h.extend_from_slice(&1u32.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h
    }

    #[test]
    fn a_half_sent_request_is_noticed_instead_of_blocking_the_worker() {
        let patience = Duration::from_millis(50);
        let (a, mut b) = UnixStream::pair().unwrap();
        // Half a message: the header promises 40 bytes, 20 come.
        b.write_all(&header(40)).unwrap();
        b.write_all(&[0u8; 20]).unwrap();
        assert!(!whole_message_queued(a.as_raw_fd(), patience));
        // The rest arrives: whole.
        b.write_all(&[0u8; 20]).unwrap();
        assert!(whole_message_queued(a.as_raw_fd(), patience));
        // Only part of a header is not a message either.
        let (c, mut d) = UnixStream::pair().unwrap();
        d.write_all(&[1, 2, 3]).unwrap();
        assert!(!whole_message_queued(c.as_raw_fd(), patience));
        // End of file and oversized messages are left to handle_request.
        drop(d);
        let (e, f) = UnixStream::pair().unwrap();
        drop(f);
        assert!(whole_message_queued(e.as_raw_fd(), patience));
        let (g, mut h) = UnixStream::pair().unwrap();
        h.write_all(&header(1 << 20)).unwrap();
        assert!(whole_message_queued(g.as_raw_fd(), patience));
    }
}
