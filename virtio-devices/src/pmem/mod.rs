//! virtio-pmem: a host file mapped into guest-physical memory, announced in
//! config space (`start`, `size`) and as shared memory region 0, with a
//! request queue on which the guest asks for the file to be flushed.

pub mod backing;
pub mod request;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{
    read_config_bytes, ActivateError, ActivatedQueue, Interrupt, SharedMemoryRegion, VirtioDevice,
    VirtioInterrupt,
};
use crate::GuestMemoryMmap;

pub use backing::{PmemBacking, PmemError};

pub const VIRTIO_ID_PMEM: u32 = 27;
/// The driver may use shared memory region 0 instead of the config space range.
pub const VIRTIO_PMEM_F_SHMEM_REGION: u64 = 1 << 0;
pub const PMEM_SHM_REGION_ID: u8 = 0;
const QUEUE_SIZES: &[u16] = &[256];

struct Worker {
    stop: EventFd,
    thread: JoinHandle<()>,
}

pub struct Pmem {
    id: String,
    file: Arc<File>,
    guest_addr: u64,
    size: u64,
    host_addr: u64,
    acked: u64,
    worker: Option<Worker>,
}

impl Pmem {
    /// `host_addr` is where the VMM mapped `backing` and `guest_addr` where
    /// it registered that mapping with KVM.
    pub fn new(id: String, backing: &PmemBacking, guest_addr: u64) -> std::io::Result<Self> {
        Ok(Pmem {
            id,
            file: Arc::new(backing.file().try_clone()?),
            guest_addr,
            size: backing.size(),
            host_addr: backing.host_addr(),
            acked: 0,
            worker: None,
        })
    }

    fn config(&self) -> [u8; 16] {
        let mut cfg = [0u8; 16];
        cfg[..8].copy_from_slice(&self.guest_addr.to_le_bytes());
        cfg[8..].copy_from_slice(&self.size.to_le_bytes());
        cfg
    }

    fn stop_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            let _ = w.stop.write(1);
            let _ = w.thread.join();
        }
    }
}

impl VirtioDevice for Pmem {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_PMEM
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1) | VIRTIO_PMEM_F_SHMEM_REGION
    }

    fn ack_features(&mut self, features: u64) {
        self.acked = features & self.features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        mut queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 1 {
            return Err(ActivateError::QueueCount {
                got: queues.len(),
                needed: 1,
            });
        }
        self.stop_worker();
        let q = queues.remove(0);
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let stop_worker = stop.try_clone()?;
        let file = self.file.clone();
        let id = self.id.clone();
        let thread = std::thread::Builder::new()
            .name(format!("pmem-{}", self.id))
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::DEVICE_WORKER_THREAD) {
                    return log::error!("virtio-pmem {id}: {e}; the request queue is not served");
                }
                if let Err(e) = serve(q.queue, q.kick, stop_worker, mem, interrupt, &file) {
                    log::error!("virtio-pmem {id}: request queue stopped: {e}");
                }
            })?;
        self.worker = Some(Worker { stop, thread });
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        self.acked = 0;
        true
    }

    fn shm_regions(&self) -> Vec<SharedMemoryRegion> {
        vec![SharedMemoryRegion {
            id: PMEM_SHM_REGION_ID,
            guest_addr: self.guest_addr,
            len: self.size,
            host_addr: self.host_addr,
        }]
    }
}

impl Drop for Pmem {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// The worker: waits for kicks, serves flush requests, interrupts the guest.
fn serve(
    mut queue: Queue,
    kick: EventFd,
    stop: EventFd,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
    file: &File,
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
            match ev.data() {
                STOP => return Ok(()),
                _ => {
                    let _ = kick.read();
                    let guard = mem.memory();
                    let used = request::process_queue(&mut queue, &*guard, || file.sync_all())
                        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
                    if used > 0 && queue.needs_notification(&*guard).unwrap_or(true) {
                        interrupt.trigger(Interrupt::Queue(0))?;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_features_and_region_describe_the_same_range() {
        let dir = std::env::temp_dir();
        let backing = PmemBacking::open(&dir, Some(4 << 20), false).unwrap();
        let mut dev = Pmem::new("pmem0".into(), &backing, 0x1_4000_0000).unwrap();
        assert_eq!(dev.device_type(), 27);
        assert_eq!(
            dev.features(),
            (1 << VIRTIO_F_VERSION_1) | VIRTIO_PMEM_F_SHMEM_REGION
        );
        let mut cfg = [0u8; 16];
        dev.read_config(0, &mut cfg);
        assert_eq!(
            u64::from_le_bytes(cfg[..8].try_into().unwrap()),
            0x1_4000_0000
        );
        assert_eq!(u64::from_le_bytes(cfg[8..].try_into().unwrap()), 4 << 20);
        let regions = dev.shm_regions();
        assert_eq!(regions.len(), 1);
        assert_eq!(
            (regions[0].id, regions[0].guest_addr, regions[0].len),
            (0, 0x1_4000_0000, 4 << 20)
        );
        assert_eq!(regions[0].host_addr, backing.host_addr());
        dev.ack_features(u64::MAX);
        assert_eq!(dev.acked, dev.features());
        assert!(dev.reset());
    }
}
