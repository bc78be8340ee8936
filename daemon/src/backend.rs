//! The vhost-user side of the daemon: what it offers the VMM (features,
//! queues, the DAX window size in GET_SHMEM_CONFIG) and the queue loop that
//! feeds requests to the FUSE [`Server`].

use std::io;
use std::sync::{Arc, RwLock};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserVirtioFeatures};
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use virtio_queue::DescriptorChain;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::fuse::chain;
use crate::fuse::server::Server;
use crate::workers::WorkerPool;
use crate::GuestMemoryMmap;

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;
type MemGuard = GuestMemoryLoadGuard<GuestMemoryMmap>;

pub struct FsBackend {
    pub server: Arc<Server>,
    num_queues: usize,
    queue_size: usize,
    dax: bool,
    event_idx: std::sync::atomic::AtomicBool,
    mem: RwLock<Option<Mem>>,
    /// `--thread-pool-size`: workers shared by all queues, or none.
    pool: Option<WorkerPool>,
}

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
            num_queues: num_request_queues + 1,
            queue_size,
            dax,
            event_idx: Default::default(),
            mem: RwLock::new(None),
        }
    }

    /// Serves every request on the queue: here, or on the worker pool when
    /// there is one (the worker then completes the request itself).
    fn process_queue(&self, vring: &VringRwLock<Mem>) -> io::Result<()> {
        let Some(atomic) = self.mem.read().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Err(io::Error::other("queue kicked before the memory table arrived"));
        };
        let mem = atomic.memory();
        loop {
            let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            match &self.pool {
                None => serve(&self.server, chain, vring)?,
                Some(pool) => {
                    let (server, vring) = (self.server.clone(), vring.clone());
                    pool.submit(move || {
                        if let Err(e) = serve(&server, chain, &vring) {
                            log::error!("completing a request: {e}");
                        }
                    });
                }
            }
        }
        Ok(())
    }
}

/// Serves one request and puts it on the used ring, interrupting the guest
/// if it asked to be.
fn serve(server: &Server, chain: DescriptorChain<MemGuard>, vring: &VringRwLock<Mem>) -> io::Result<()> {
    let head = chain.head_index();
    let mem = chain.memory();
    let written = match chain::split(mem, chain.clone()) {
        Ok((r, w)) => server.handle(r, w),
        Err(e) => {
            log::warn!("malformed descriptor chain {head}: {e}");
            0
        }
    };
    let mut state = vring.get_mut();
    state.add_used(head, written as u32).map_err(|e| io::Error::other(format!("add_used: {e}")))?;
    if state.needs_notification().unwrap_or(true) {
        state.signal_used_queue()?;
    }
    Ok(())
}

impl VhostUserBackend for FsBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        self.queue_size
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let mut f = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
        if self.dax {
            f |= VhostUserProtocolFeatures::BACKEND_REQ
                | VhostUserProtocolFeatures::BACKEND_SEND_FD
                | VhostUserProtocolFeatures::SHMEM;
        }
        f
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, std::sync::atomic::Ordering::SeqCst);
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *self.mem.write().unwrap_or_else(|p| p.into_inner()) = Some(mem);
        Ok(())
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        self.server.dax.set_backend(backend);
    }

    /// One thread per queue: requests on different queues are served in
    /// parallel (the server is shared and internally locked).
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.num_queues).map(|q| 1u64 << q).collect()
    }

    /// Lets the framework stop each queue thread when the VMM goes away
    /// (without it, dropping the daemon would wait on them forever).
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn get_shmem_config(&self) -> io::Result<VhostUserShMemConfig> {
        Ok(VhostUserShMemConfig::new(1, &[self.server.dax.window_size()]))
    }

    fn handle_event(&self, device_event: u16, evset: EventSet, vrings: &[Self::Vring], _thread: usize) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected events {evset:?} on queue {device_event}")));
        }
        let vring = vrings
            .get(usize::from(device_event))
            .ok_or_else(|| io::Error::other(format!("event for queue {device_event}, which does not exist")))?;
        if self.event_idx.load(std::sync::atomic::Ordering::SeqCst) {
            // Keep going until no request arrived while notifications were off.
            loop {
                vring.disable_notification().map_err(|e| io::Error::other(e.to_string()))?;
                self.process_queue(vring)?;
                if !vring.enable_notification().map_err(|e| io::Error::other(e.to_string()))? {
                    break;
                }
            }
        } else {
            self.process_queue(vring)?;
        }
        Ok(())
    }
}
