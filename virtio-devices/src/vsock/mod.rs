//! virtio-vsock (virtio 1.2 §5.10) with the hybrid unix-socket backend of
//! Firecracker and Cloud Hypervisor ([`backend`]): stream sockets between
//! the guest and processes on the host, without a vhost-vsock kernel
//! module or a host-wide context id.
//!
//! The device's thread starts with the device, on the thread that creates
//! it (the VMM's main thread), not on the device activator: it holds the
//! host listener from the start, and its seccomp list
//! ([`VSOCK_WORKER_THREAD`]) allows accept/connect on unix sockets, which
//! the activator's does not. Activation and reset hand it the queues and
//! take them back over a channel; a pause has it stop serving them (the
//! host side goes on) and give their positions. A device restored from a
//! snapshot posts a transport reset on the event queue at activation, so
//! the guest drops the connections that died with the old process (as
//! Firecracker does after a snapshot load).

pub mod backend;
pub mod connection;
pub mod packet;
pub mod queues;
pub mod socket_path;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::device::{
    check_queue_count, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    VirtioDevice, VirtioInterrupt,
};
use crate::device_state::{invalid, DeviceStateError, SavedQueue, StateFields};
use crate::event_loop::{EventLoop, Flow, WorkerThread};
use crate::GuestMemoryMmap;

pub use backend::{BackendError, SocketName, TakenListener, UnixBackend};
use queues::{ActiveQueues, RX_QUEUE, TX_QUEUE};
use socket_path::SocketId;

pub const VIRTIO_ID_VSOCK: u32 = 19;
/// The seccomp thread kind of the device's thread (see the VMM's
/// `seccomp_filters`).
pub const VSOCK_WORKER_THREAD: &str = "vsock-worker";
/// rx, tx, event.
const QUEUE_SIZES: &[u16] = &[256, 256, 256];
/// Guest cids 0-2 are reserved (hypervisor, local, host) and
/// 0xffffffff is VMADDR_CID_ANY; Linux takes 32-bit cids.
pub const MIN_GUEST_CID: u64 = 3;
pub const MAX_GUEST_CID: u64 = 0xffff_fffe;
/// How long a reset waits for the thread to give the queues back.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);

const TOKEN_COMMAND: u64 = 0;
const TOKEN_RX: u64 = 1;
const TOKEN_TX: u64 = 2;
/// TOKEN_RX + 2 is the event queue's kick.
const TOKEN_HOST: u64 = 4;

/// What the device asks of its thread.
enum Command {
    Activate {
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        queues: Box<ActiveQueues>,
        kicks: Vec<EventFd>,
    },
    /// Drop the queues and every connection; answer when done.
    Reset(SyncSender<()>),
    /// Stop serving the queues (the host side goes on) and answer with
    /// their positions (none before an activation).
    Pause(SyncSender<Vec<SavedQueue>>),
    /// Serve the same queues again; answer when done.
    Resume(SyncSender<()>),
    /// Stop accepting on the host socket and leave its name (a local
    /// migration moved it; a resume takes it back); answer when done.
    Release(SyncSender<()>),
    /// A migration's switch: stop accepting and answer with the listener.
    TakeListener(SyncSender<Option<TakenListener>>),
    /// That migration failed: serve this listener, bound again at the path.
    PutListener {
        listener: UnixListener,
        socket_id: Option<SocketId>,
        done: SyncSender<Result<(), BackendError>>,
    },
}

pub struct Vsock {
    id: String,
    cid: u64,
    acked: AckedFeatures,
    commands: Mutex<Sender<Command>>,
    wake: EventFd,
    /// The queues stopped on the guest's error: the device needs a reset.
    broken: Arc<AtomicBool>,
    /// Restored from a snapshot: the next activation posts a transport
    /// reset on the event queue (the guest's connections died with the
    /// old process) and serves what the queues hold without a kick.
    restored: bool,
    /// The host listener (the thread's backend serves it): a local
    /// migration passes it on. None while a migration's switch released it.
    listener: Option<OwnedFd>,
    /// Where the socket is bound (a switch's reclaim binds it again).
    path: PathBuf,
    /// Whether the backend removes the socket's name when it goes.
    name: SocketName,
    _thread: WorkerThread,
}

/// The thread's state between events.
struct Worker {
    id: String,
    backend: UnixBackend,
    commands: Receiver<Command>,
    mem: Option<GuestMemoryAtomic<GuestMemoryMmap>>,
    queues: Option<Box<ActiveQueues>>,
    kicks: Vec<EventFd>,
    broken: Arc<AtomicBool>,
    /// Paused: the queues are kept, not served, their kicks not watched.
    paused: bool,
}

impl Vsock {
    /// Binds `path` and starts the device's thread.
    pub fn new(id: String, cid: u64, path: PathBuf) -> Result<Self, BackendError> {
        let backend = UnixBackend::new(cid, &path)?;
        Self::start(id, cid, path, backend)
    }

    /// Starts the device's thread on the listener another process bound
    /// at `path` and passed (a local migration's sender), once checked
    /// (see [`UnixBackend::adopt`]).
    pub fn with_listener(
        id: String,
        cid: u64,
        path: PathBuf,
        listener: std::os::unix::net::UnixListener,
    ) -> Result<Self, BackendError> {
        let backend = UnixBackend::adopt(cid, &path, listener)?;
        Self::start(id, cid, path, backend)
    }

    /// The host listener: the socket host clients connect to (None while
    /// a migration's switch released it).
    pub fn listener(&self) -> Option<BorrowedFd<'_>> {
        self.listener.as_ref().map(AsFd::as_fd)
    }

    /// Whether the socket's name goes with the device; a device on a
    /// passed listener claims it once its VMM has the whole VM.
    pub fn socket_name(&self) -> &SocketName {
        &self.name
    }

    fn start(
        id: String,
        cid: u64,
        path: PathBuf,
        backend: UnixBackend,
    ) -> Result<Self, BackendError> {
        let listener = backend
            .listener()
            .map(|l| l.as_fd().try_clone_to_owned())
            .transpose()
            .map_err(BackendError::Epoll)?;
        let name = backend.name().clone();
        let events = EventLoop::new().map_err(BackendError::Epoll)?;
        let wake = EventFd::new(libc::EFD_NONBLOCK).map_err(BackendError::Epoll)?;
        events
            .add(wake.as_raw_fd(), EventSet::IN, TOKEN_COMMAND)
            .map_err(BackendError::Epoll)?;
        events
            .add(backend.epoll_fd(), EventSet::IN, TOKEN_HOST)
            .map_err(BackendError::Epoll)?;
        let (tx, rx) = channel();
        let wake_in_thread = wake.try_clone().map_err(BackendError::Epoll)?;
        let broken = Arc::new(AtomicBool::new(false));
        let mut worker = Worker {
            broken: broken.clone(),
            id: id.clone(),
            backend,
            commands: rx,
            mem: None,
            queues: None,
            kicks: Vec::new(),
            paused: false,
        };
        let thread = events
            .spawn_as(
                VSOCK_WORKER_THREAD,
                format!("vsock-{id}"),
                format!("virtio-vsock {id}"),
                move |events, token, _| {
                    if token == TOKEN_COMMAND {
                        let _ = wake_in_thread.read();
                    }
                    worker.handle(events, token)
                },
            )
            .map_err(BackendError::Epoll)?;
        Ok(Vsock {
            id,
            cid,
            acked: AckedFeatures::default(),
            commands: Mutex::new(tx),
            wake,
            broken,
            restored: false,
            listener,
            path,
            name,
            _thread: thread,
        })
    }

    fn send(&self, c: Command) -> Result<(), ActivateError> {
        self.commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(c)
            .map_err(|_| ActivateError::BackendGone {
                device: format!("virtio-vsock {}", self.id),
                why: "its thread is gone",
            })?;
        self.wake.write(1)?;
        Ok(())
    }
}

impl Worker {
    fn handle(&mut self, events: &EventLoop, token: u64) -> Flow {
        match token {
            TOKEN_COMMAND => {
                while let Ok(c) = self.commands.try_recv() {
                    self.command(events, c);
                }
                return Flow::Continue;
            }
            TOKEN_HOST => self.backend.poll_host(),
            _ => {
                let index = token
                    .checked_sub(TOKEN_RX)
                    .and_then(|i| usize::try_from(i).ok());
                if let Some(k) = index.and_then(|i| self.kicks.get(i)) {
                    let _ = k.read();
                }
            }
        }
        let (Some(mem), Some(q)) = (&self.mem, self.queues.as_mut()) else {
            return Flow::Continue;
        };
        if self.paused {
            return Flow::Continue;
        }
        let guard = mem.memory();
        let served = (|| -> Result<(), String> {
            queues::post_transport_reset(q, &guard)?;
            if token == TOKEN_TX {
                let n = queues::process_tx(q, &guard, &mut self.backend)
                    .map_err(|e| format!("{e:?}"))?;
                queues::notify(&mut q.tx, TX_QUEUE, n, &guard, &*q.interrupt)
                    .map_err(|e| e.to_string())?;
            }
            let n = queues::fill_rx(q, &guard, &mut self.backend).map_err(|e| format!("{e:?}"))?;
            queues::notify(&mut q.rx, RX_QUEUE, n, &guard, &*q.interrupt).map_err(|e| e.to_string())
        })();
        match served {
            Ok(()) => Flow::Continue,
            Err(e) => {
                crate::error_limited!(
                    "virtio-vsock {}: queues stopped until the driver resets the device \
                     (DEVICE_NEEDS_RESET): {e}",
                    self.id
                );
                // The device is broken until the driver resets it; the
                // host side stays, so a reset brings it back.
                self.broken.store(true, Ordering::SeqCst);
                let _ = q.interrupt.trigger(crate::device::Interrupt::Config);
                self.drop_queues(events);
                Flow::Continue
            }
        }
    }

    fn drop_queues(&mut self, events: &EventLoop) {
        for k in self.kicks.drain(..) {
            events.remove(k.as_raw_fd());
        }
        self.paused = false;
        self.queues = None;
        self.mem = None;
        self.backend.set_active(false);
    }

    fn command(&mut self, events: &EventLoop, c: Command) {
        match c {
            Command::Activate { mem, queues, kicks } => {
                self.drop_queues(events);
                self.kicks = kicks;
                self.watch_kicks(events);
                self.mem = Some(mem);
                self.queues = Some(queues);
                self.backend.set_active(true);
            }
            Command::Reset(done) => {
                self.drop_queues(events);
                self.broken.store(false, Ordering::SeqCst);
                let _ = done.send(());
            }
            Command::Pause(done) => {
                let saved = match &self.queues {
                    Some(q) => {
                        for k in &self.kicks {
                            events.remove(k.as_raw_fd());
                        }
                        self.paused = true;
                        [&q.rx, &q.tx, &q.event]
                            .map(|q| SavedQueue::from(q.state()))
                            .to_vec()
                    }
                    None => Vec::new(),
                };
                let _ = done.send(saved);
            }
            Command::Resume(done) => {
                // A migration that released the socket failed: it is ours.
                self.backend.reclaim();
                if self.paused {
                    self.paused = false;
                    self.watch_kicks(events);
                    // What came while paused waits in the rings.
                    for k in &self.kicks {
                        let _ = k.write(1);
                    }
                }
                let _ = done.send(());
            }
            Command::Release(done) => {
                self.backend.release();
                let _ = done.send(());
            }
            Command::TakeListener(done) => {
                let _ = done.send(self.backend.take_listener());
            }
            Command::PutListener {
                listener,
                socket_id,
                done,
            } => {
                let _ = done.send(self.backend.put_listener(listener, socket_id));
            }
        }
    }

    fn watch_kicks(&self, events: &EventLoop) {
        for (i, k) in self.kicks.iter().enumerate() {
            // i < 3: the queue count was checked.
            if let Err(e) = events.add(k.as_raw_fd(), EventSet::IN, TOKEN_RX + i as u64) {
                crate::error_limited!("virtio-vsock {}: watching queue {i}: {e}", self.id);
            }
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn ack_features(&mut self, features: u64) {
        self.acked.ack(self.features(), features);
    }

    /// `le64 guest_cid`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.cid.to_le_bytes(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        check_queue_count(queues.len(), QUEUE_SIZES.len()..=QUEUE_SIZES.len())?;
        let mut qs = queues.into_iter();
        let mut next = || qs.next().expect("three queues");
        let (rx, tx, event) = (next(), next(), next());
        let kicks = vec![rx.kick, tx.kick, event.kick];
        let mut queues = Box::new(ActiveQueues::new(
            rx.queue,
            tx.queue,
            event.queue,
            interrupt,
        ));
        if std::mem::take(&mut self.restored) {
            queues.transport_reset = true;
            // The thread serves the queues at once: the reset, and what
            // the guest queued for the old process.
            for k in &kicks {
                k.write(1)?;
            }
        }
        self.send(Command::Activate { mem, queues, kicks })
    }

    fn reset(&mut self) -> bool {
        let (done, wait) = sync_channel(1);
        self.acked.reset();
        // Until the thread answers it may still touch guest memory.
        self.send(Command::Reset(done)).is_ok() && wait.recv_timeout(RESET_TIMEOUT).is_ok()
    }

    fn needs_reset(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    fn state_name(&self) -> String {
        format!("virtio-vsock {}", self.id)
    }

    /// The thread stops serving the queues (between two events, so every
    /// chain it took is used) and keeps the host side: connections stay
    /// open for a resume here; a restore elsewhere resets them.
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        let fail = |reason: &str| DeviceStateError::Pause {
            device: self.state_name(),
            reason: reason.into(),
        };
        if self.broken.load(Ordering::SeqCst) {
            return Err(fail(
                "its queues stopped on the guest's error (DEVICE_NEEDS_RESET); \
                 their positions are gone",
            ));
        }
        let (done, wait) = sync_channel(1);
        self.send(Command::Pause(done))
            .map_err(|_| fail("its thread is gone"))?;
        wait.recv_timeout(RESET_TIMEOUT)
            .map_err(|_| fail("its thread did not answer within 5s"))
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        let fail = |reason: &str| DeviceStateError::Pause {
            device: self.state_name(),
            reason: format!("resuming: {reason}"),
        };
        let (done, wait) = sync_channel(1);
        self.send(Command::Resume(done))
            .map_err(|_| fail("its thread is gone"))?;
        wait.recv_timeout(RESET_TIMEOUT)
            .map_err(|_| fail("its thread did not answer within 5s"))
    }

    /// The guest's cid (the configuration's; checked on restore).
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        Ok(serde_json::json!({ "cid": self.cid }))
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        let name = self.state_name();
        let mut f = StateFields::new(&name, state)?;
        let cid: u64 = f.take("cid")?;
        f.finish()?;
        if cid != self.cid {
            return Err(invalid(
                &name,
                "cid",
                format!("saved {cid}, configured {}", self.cid),
            ));
        }
        self.restored = true;
        Ok(())
    }

    /// The receiving VMM serves the host socket now, on the listener it
    /// was passed: this device stops accepting on it and leaves the
    /// socket's name for the receiver (until a resume here: the migration
    /// failed).
    fn release_backend(&mut self) {
        let (done, wait) = sync_channel(1);
        let released =
            self.send(Command::Release(done)).is_ok() && wait.recv_timeout(RESET_TIMEOUT).is_ok();
        if !released {
            tracing::warn!(
                "virtio-vsock {}: its thread did not let go of the host socket",
                self.id
            );
        }
    }

    /// Open connections do not stop it: the restored device tells the
    /// guest they are gone (a transport reset).
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Ok(())
    }

    /// The receiving VMM binds the socket's path itself: the thread stops
    /// accepting and gives the listener up, every copy of it here is
    /// closed (a client waiting in its queue is refused) and the socket
    /// file removed if it still is the one this device bound; a client
    /// connecting meanwhile finds no socket, then the receiver's. Host
    /// connections already open stay: they cannot move over the network,
    /// and end with this VMM (the receiving guest hears a transport reset)
    /// or go on if the migration fails. The caller closes its own copies.
    fn release_for_switch(&mut self) -> Result<bool, DeviceStateError> {
        let fail = |reason: &str| DeviceStateError::Switch {
            device: self.state_name(),
            step: "releasing",
            reason: reason.into(),
        };
        let (done, wait) = sync_channel(1);
        self.send(Command::TakeListener(done))
            .map_err(|_| fail("its thread is gone"))?;
        let taken = wait
            .recv_timeout(RESET_TIMEOUT)
            .map_err(|_| fail("its thread did not answer within 5s"))?;
        self.listener = None;
        if let Some(t) = taken {
            if t.ours {
                socket_path::remove_if_bound(&self.path, t.socket_id);
            }
            drop(t.listener);
        }
        Ok(true)
    }

    /// Binds the socket's path again (a stale socket there, the
    /// receiver's once it is gone, is replaced; a live one is an error
    /// naming the path) and serves it; the name is this device's again.
    fn reclaim_after_switch(&mut self) -> Result<Option<OwnedFd>, DeviceStateError> {
        if self.listener.is_some() {
            return Ok(None);
        }
        let fail = |reason: String| DeviceStateError::Switch {
            device: self.state_name(),
            step: "reclaiming",
            reason,
        };
        let (listener, socket_id) =
            socket_path::bind(&self.path).map_err(|e| fail(e.to_string()))?;
        let served = (|| {
            listener
                .set_nonblocking(true)
                .map_err(|e| format!("making the listener non-blocking: {e}"))?;
            let copy = |l: &UnixListener| {
                l.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| format!("duplicating the listener: {e}"))
            };
            let (kept, given) = (copy(&listener)?, copy(&listener)?);
            let (done, wait) = sync_channel(1);
            self.send(Command::PutListener {
                listener,
                socket_id,
                done,
            })
            .map_err(|_| "its thread is gone".to_string())?;
            wait.recv_timeout(RESET_TIMEOUT)
                .map_err(|_| "its thread did not answer within 5s".to_string())?
                .map_err(|e| e.to_string())?;
            Ok((kept, given))
        })();
        match served {
            Ok((kept, given)) => {
                self.listener = Some(kept);
                Ok(Some(given))
            }
            Err(reason) => {
                socket_path::remove_if_bound(&self.path, socket_id);
                Err(fail(reason))
            }
        }
    }
}

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "pause_tests.rs"]
mod pause_tests;
