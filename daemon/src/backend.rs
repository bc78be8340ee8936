//! The vhost-user side of the daemon: what it offers the VMM (features,
//! queues, the DAX window size in GET_SHMEM_CONFIG), the queue loop that
//! feeds requests to the FUSE [`Server`], and the device-state transfer
//! (SET_DEVICE_STATE_FD / CHECK_DEVICE_STATE, [`crate::migration`]).

use std::fs::File;
use std::io;
use std::sync::{Arc, RwLock};

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserShMemConfig, VhostUserVirtioFeatures,
};
use vhost::vhost_user::Backend;
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::DescriptorChain;
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::fuse::chain;
use crate::fuse::server::Server;
use crate::inflight::{InFlight, STOP_WAIT};
use crate::migration::transfer::{self, Transfers, CHECK_WAIT};
use crate::vring::FsVring;
use crate::workers::WorkerPool;
use crate::GuestMemoryMmap;

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;
type MemGuard = GuestMemoryLoadGuard<GuestMemoryMmap>;
pub type Vring = FsVring<Mem>;

pub struct FsBackend {
    server: Arc<Server>,
    num_queues: usize,
    queue_size: usize,
    dax: bool,
    event_idx: std::sync::atomic::AtomicBool,
    mem: RwLock<Option<Mem>>,
    /// `--thread-pool-size`: workers shared by all queues, or none.
    pool: Option<WorkerPool>,
    /// Requests taken from each queue and not yet answered.
    inflight: Arc<InFlight>,
    /// Offer DEVICE_STATE (`--migration-mode`).
    migration: bool,
    transfers: Transfers,
}

/// Marks `vring` broken (once): it is served no more until the VMM sets it
/// up again, and the VMM hears of it through the queue's error eventfd.
fn broken(vring: &Vring, queue: u16, why: &str) {
    if vring.mark_broken() {
        crate::error_limited!(
            "queue {queue}: {why}; the queue is stopped and the VMM told (DEVICE_NEEDS_RESET)"
        );
    }
}

/// Set from `--bench-unacked-maps` (a measurement build's flag): SHMEM_MAP
/// and SHMEM_UNMAP go without asking the VMM for an ack.
#[cfg(feature = "bench-unacked-maps")]
pub static UNACKED_MAPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl FsBackend {
    /// `num_request_queues` request queues plus the hiprio queue; requests
    /// are served by `pool` if given, else by each queue's thread.
    pub fn new(
        server: Arc<Server>,
        num_request_queues: usize,
        queue_size: usize,
        dax: bool,
        pool: Option<WorkerPool>,
    ) -> Self {
        FsBackend {
            pool,
            server,
            inflight: InFlight::new(num_request_queues + 1),
            migration: false,
            transfers: Transfers::default(),
            num_queues: num_request_queues + 1,
            queue_size,
            dax,
            event_idx: Default::default(),
            mem: RwLock::new(None),
        }
    }

    /// Offers the device-state transfer (vhost-user DEVICE_STATE), with
    /// which the VMM moves the daemon's state to a new daemon.
    pub fn with_migration(mut self, on: bool) -> Self {
        self.migration = on;
        self
    }

    /// Serves every request on the queue: here, or on the worker pool when
    /// there is one (the worker then completes the request itself). A queue
    /// that cannot be served is marked broken, never retried in a loop.
    fn process_queue(&self, queue: u16, vring: &Vring) {
        let Some(atomic) = self.mem.read().unwrap_or_else(|p| p.into_inner()).clone() else {
            return broken(vring, queue, "kicked before the memory table arrived");
        };
        let mem = atomic.memory();
        while !vring.is_broken() {
            let next = {
                let mut state = vring.get_mut();
                // `iter` checks the guest's avail index against the queue
                // size; `pop_descriptor_chain` would hide that error as "empty".
                state
                    .get_queue_mut()
                    .iter(mem.clone())
                    .map(|mut it| it.next())
            };
            let chain = match next {
                Ok(Some(chain)) => chain,
                Ok(None) => break,
                // GET_VRING_BASE stopped the queue meanwhile: stop popping.
                Err(virtio_queue::Error::QueueNotReady) => break,
                Err(e) => {
                    return broken(
                        vring,
                        queue,
                        &format!("the guest's available ring is invalid: {e}"),
                    )
                }
            };
            let busy = self.inflight.begin(usize::from(queue));
            let Some(pool) = &self.pool else {
                serve(&self.server, chain, queue, vring);
                drop(busy);
                continue;
            };
            let (server, worker_vring) = (self.server.clone(), vring.clone());
            let job = move || {
                serve(&server, chain, queue, &worker_vring);
                drop(busy);
            };
            if let Err(job) = pool.submit(job) {
                self.server.count_worker_queue_full(pool.depth() as u64);
                job();
            }
        }
    }
}

/// Serves one request and puts it on the used ring, interrupting the guest
/// if it asked to be.
fn serve(server: &Server, chain: DescriptorChain<MemGuard>, queue: u16, vring: &Vring) {
    let popped = std::time::Instant::now();
    let head = chain.head_index();
    let mem = chain.memory();
    let (written, opcode) = match chain::split(mem, chain.clone()) {
        Ok((r, w)) => server.handle_with_opcode(r, w),
        Err(e) => {
            crate::warn_limited!("malformed descriptor chain {head}: {e}");
            (0, None)
        }
    };
    // `handle` never writes more than its reply header's u32 length says.
    let written = u32::try_from(written).unwrap_or(u32::MAX);
    let mut state = vring.get_mut();
    if let Err(e) = state.add_used(head, written) {
        drop(state);
        return broken(
            vring,
            queue,
            &format!("putting descriptor {head} on the used ring: {e}"),
        );
    }
    if state.needs_notification().unwrap_or(true) {
        if let Err(e) = state.signal_used_queue() {
            crate::warn_limited!("queue {queue}: interrupting the guest: {e}");
        }
    }
    drop(state);
    server.served(opcode, popped);
}

impl VhostUserBackend for FsBackend {
    type Bitmap = BitmapMmapRegion;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        self.queue_size
    }

    /// LOG_ALL: the daemon logs what it writes into guest memory once the
    /// VMM gives it a log (SET_LOG_BASE), as pre-copy migration needs. The
    /// VMM passes only the ring features on to the guest.
    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    /// What the VMM's frontend asks for (the two sides share the set), and
    /// LOG_SHMFD (the dirty log as a shared memory fd, for a migration;
    /// the VMM acks only what it asks for). With migration on,
    /// DEVICE_STATE too (which the VMM asks for only when it moves the
    /// daemon's state).
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let features = dax_abi::protocol_features(self.dax) | VhostUserProtocolFeatures::LOG_SHMFD;
        if self.migration {
            features | VhostUserProtocolFeatures::DEVICE_STATE
        } else {
            features
        }
    }

    /// GET_VRING_BASE: the queue is already marked not ready, so nothing
    /// more is popped from it; wait for what was (bounded by [`STOP_WAIT`]).
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let queue = usize::try_from(queue_index).unwrap_or(usize::MAX);
        self.inflight.wait_idle(queue, STOP_WAIT).map_err(|n| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("queue {queue_index}: {n} requests still in flight after {STOP_WAIT:?}"),
            )
        })
    }

    /// Starts the transfer on its own thread and answers at once: the
    /// front-end reads (SAVE) or writes (LOAD) `file` after this reply.
    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) -> io::Result<Option<File>> {
        if !self.migration {
            return Err(io::Error::other("device-state transfer is not offered"));
        }
        if phase != VhostTransferStatePhase::STOPPED {
            return Err(io::Error::other(format!(
                "transfer phase {phase:?} is not served"
            )));
        }
        let server = self.server.clone();
        match direction {
            VhostTransferStateDirection::SAVE => self.transfers.start("save", move || {
                let blob = server.save_state().map_err(|e| e.to_string())?;
                transfer::write_blob(file, &blob)
            }),
            VhostTransferStateDirection::LOAD => self.transfers.start("load", move || {
                let mut file = file;
                let loaded = transfer::read_blob(&mut file)
                    .and_then(|blob| server.load_state(&blob).map_err(|e| e.to_string()));
                if let Err(reason) = &loaded {
                    transfer::write_reason(&mut file, reason);
                }
                loaded
            }),
        }?;
        Ok(None)
    }

    /// The transfer's result (vhost-user's reply says only ok or not; a
    /// failed LOAD's reason went back on its descriptor, and the daemon's
    /// log names it too).
    fn check_device_state(&self) -> io::Result<()> {
        self.transfers.check(CHECK_WAIT)
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx
            .store(enabled, std::sync::atomic::Ordering::SeqCst);
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *self.mem.write().unwrap_or_else(|p| p.into_inner()) = Some(mem);
        Ok(())
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        // A measurement build asked for it (see the feature in
        // Cargo.toml): the VMM is not asked for acks, so nothing waits.
        #[cfg(feature = "bench-unacked-maps")]
        if UNACKED_MAPS.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "--bench-unacked-maps: the guest is answered before the VMM maps its ranges (for measuring only, never for use)"
            );
            backend.set_reply_ack_flag(false);
        }
        self.server.connect_vmm_channel(backend);
    }

    /// One thread per request queue: requests on different queues are
    /// served in parallel (the server is shared and internally locked).
    /// The high-priority queue (FORGET, INTERRUPT: rare and quick) shares
    /// the first request queue's thread, as virtiofsd serves both of its
    /// queues on one; the framework starts every thread with the daemon.
    fn queues_per_thread(&self) -> Vec<u64> {
        // Thread 0: hiprio (queue 0) and the first request queue (1).
        let first = if self.num_queues > 1 { 0b11 } else { 0b1 };
        std::iter::once(first)
            .chain((2..self.num_queues).map(|q| 1u64 << q))
            .collect()
    }

    /// Lets the framework stop each queue thread when the VMM goes away
    /// (without it, dropping the daemon would wait on them forever).
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn get_shmem_config(&self) -> io::Result<VhostUserShMemConfig> {
        // One region, the DAX window, at the id the VMM reads it from.
        const REGIONS: u32 = dax_abi::DAX_SHM_REGION_ID as u32 + 1;
        let mut sizes = [0; REGIONS as usize];
        sizes[usize::from(dax_abi::DAX_SHM_REGION_ID)] = self.server.window_size();
        Ok(VhostUserShMemConfig::new(REGIONS, &sizes))
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        _thread: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!(
                "unexpected events {evset:?} on queue {device_event}"
            )));
        }
        let vring = vrings.get(usize::from(device_event)).ok_or_else(|| {
            io::Error::other(format!(
                "event for queue {device_event}, which does not exist"
            ))
        })?;
        if self.event_idx.load(std::sync::atomic::Ordering::SeqCst) {
            // Keep going until no request arrived while notifications were
            // off. Each round pops at least one request or ends: a queue
            // whose ring is invalid is broken, which stops the loop.
            while !vring.is_broken() {
                if let Err(e) = vring.disable_notification() {
                    broken(
                        vring,
                        device_event,
                        &format!("disabling notifications: {e}"),
                    );
                    break;
                }
                self.process_queue(device_event, vring);
                match vring.enable_notification() {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => broken(vring, device_event, &format!("enabling notifications: {e}")),
                }
            }
        } else {
            self.process_queue(device_event, vring);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd};

    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;
    use vmm_sys_util::tempdir::TempDir;

    use super::*;
    use crate::dax::DaxMapper;
    use crate::passthrough::{openat, CachePolicy, PassthroughFs};
    use crate::policy::DaxPolicy;

    /// A passthrough file system over `dir` with the default policy, as
    /// the daemon builds one (no DAX window yet).
    fn passthrough_on(dir: &TempDir) -> (PassthroughFs, Arc<DaxPolicy>) {
        let root = openat(
            libc::AT_FDCWD,
            &std::ffi::CString::new(dir.as_path().to_str().unwrap()).unwrap(),
            libc::O_PATH,
            0,
        )
        .unwrap();
        let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
        let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
        let fs = PassthroughFs::new(root, proc_fd, CachePolicy::Never, policy.clone()).unwrap();
        (fs, policy)
    }

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;

    /// Finding 5: a guest that publishes an available index more than a
    /// queue ahead made the EVENT_IDX loop spin at 100 % CPU (and a failed
    /// add_used ended the queue's thread silently). Now the queue is marked
    /// broken, the VMM's error eventfd is written once, and the event
    /// handler returns (an error would end the thread).
    #[test]
    fn an_impossible_avail_index_breaks_the_queue_once_and_tells_the_vmm_instead_of_spinning() {
        let dir = TempDir::new().unwrap();
        let (fs, policy) = passthrough_on(&dir);
        let backend = Arc::new(FsBackend::new(
            Arc::new(Server::new(
                fs,
                DaxMapper::new(2 << 20, policy.clone()),
                policy,
            )),
            1,
            64,
            false,
            None,
        ));
        backend.set_event_idx(true);
        let mem = GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap(),
        );
        backend.update_memory(mem.clone()).unwrap();
        let vrings: Vec<Vring> = (0..2)
            .map(|_| Vring::new(mem.clone(), 64).unwrap())
            .collect();
        let err = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let q = &vrings[1];
        q.set_queue_size(64);
        q.set_queue_info(DESC, AVAIL, USED).unwrap();
        q.set_queue_event_idx(true);
        q.set_queue_ready(true);
        q.set_enabled(true);
        // SAFETY: a duplicate of the eventfd, owned by the File from here on.
        q.set_err(Some(unsafe {
            std::fs::File::from_raw_fd(libc::dup(err.as_raw_fd()))
        }));
        // avail.idx = 1000 with next_avail 0: 1000 requests in a 64-entry ring.
        mem.memory()
            .write_obj(1000u16, GuestAddress(AVAIL + 2))
            .unwrap();

        let (done, finished) = std::sync::mpsc::channel();
        let (b, v) = (backend.clone(), vrings.clone());
        std::thread::spawn(move || {
            let r = b.handle_event(1, EventSet::IN, &v, 0);
            let _ = done.send(r.is_ok());
        });
        // A hang detector, not a speed assertion: the old code never returned.
        let returned = finished.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(
            returned,
            Ok(true),
            "handle_event returned Ok (the queue thread lives on)"
        );
        assert!(q.is_broken());
        assert_eq!(err.read().unwrap(), 1, "the VMM was told once");
        // Further kicks are ignored, with no second report.
        assert!(backend.handle_event(1, EventSet::IN, &vrings, 0).is_ok());
        assert!(err.read().is_err(), "no second error signal");
        // The VMM setting the queue up again makes it servable.
        q.set_queue_info(DESC, AVAIL, USED).unwrap();
        assert!(!q.is_broken());
    }

    /// GET_VRING_BASE's stop_vring waits for a request already taken from
    /// the queue (here queued behind a busy worker) before the VMM reads
    /// the ring's position; and a kick on a queue it stopped does not
    /// break the queue.
    #[test]
    fn stopping_a_queue_waits_for_its_taken_requests_and_a_stopped_queue_is_not_broken() {
        let dir = TempDir::new().unwrap();
        let (fs, policy) = passthrough_on(&dir);
        let server = Server::new(fs, DaxMapper::new(2 << 20, policy.clone()), policy);
        let pool = WorkerPool::new(1, 8).unwrap();
        let backend = Arc::new(FsBackend::new(Arc::new(server), 1, 64, false, Some(pool)));
        let mem = GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap(),
        );
        backend.update_memory(mem.clone()).unwrap();
        let vrings: Vec<Vring> = (0..2)
            .map(|_| Vring::new(mem.clone(), 64).unwrap())
            .collect();
        let q = &vrings[1];
        q.set_queue_size(64);
        q.set_queue_info(DESC, AVAIL, USED).unwrap();
        q.set_queue_ready(true);
        q.set_enabled(true);
        // One request: a single readable descriptor (answered as malformed).
        let m = mem.memory();
        m.write_obj(0x8000u64, GuestAddress(DESC)).unwrap();
        m.write_obj(16u32, GuestAddress(DESC + 8)).unwrap();
        m.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap();
        m.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
        // The only worker is busy: the request waits behind it.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        assert!(backend
            .pool
            .as_ref()
            .unwrap()
            .submit(move || {
                let _ = wait.recv();
            })
            .is_ok());
        backend.handle_event(1, EventSet::IN, &vrings, 0).unwrap();
        // GET_VRING_BASE: the queue is marked not ready, then stop_vring.
        q.set_queue_ready(false);
        backend.handle_event(1, EventSet::IN, &vrings, 0).unwrap();
        assert!(!q.is_broken(), "a stopped queue is not a broken one");
        let (done, stopped) = std::sync::mpsc::channel();
        let b = backend.clone();
        std::thread::spawn(move || {
            let _ = done.send(b.stop_vring(1).is_ok());
        });
        assert!(
            stopped
                .recv_timeout(std::time::Duration::from_millis(100))
                .is_err(),
            "stop_vring returned with the request unanswered"
        );
        assert_eq!(m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(), 0);
        release.send(()).unwrap();
        assert_eq!(
            stopped.recv_timeout(std::time::Duration::from_secs(60)),
            Ok(true)
        );
        assert_eq!(
            m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(),
            1,
            "answered before stop_vring returned"
        );
    }
}
