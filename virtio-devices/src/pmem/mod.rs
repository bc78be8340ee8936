//! virtio-pmem: a host file mapped into guest-physical memory, announced in
//! config space (`start`, `size`) and as shared memory region 0, with a
//! request queue on which the guest asks for the file to be flushed.

pub mod backing;
pub mod request;

use std::fs::File;
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::GuestMemoryAtomic;

use crate::device::{
    check_queue_count, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    SharedMemoryRegion, VirtioDevice, VirtioInterrupt,
};
use crate::queue_worker::QueueWorker;
use crate::GuestMemoryMmap;

pub use backing::{PmemBacking, PmemError};

pub const VIRTIO_ID_PMEM: u32 = 27;
/// The driver may use shared memory region 0 instead of the config space range.
pub const VIRTIO_PMEM_F_SHMEM_REGION: u64 = 1 << 0;
pub const PMEM_SHM_REGION_ID: u8 = 0;
const QUEUE_SIZES: &[u16] = &[256];

pub struct Pmem {
    id: String,
    file: Arc<File>,
    guest_addr: u64,
    size: u64,
    host_addr: u64,
    acked: AckedFeatures,
    worker: Option<QueueWorker>,
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
            acked: AckedFeatures::default(),
            worker: None,
        })
    }

    fn config(&self) -> [u8; 16] {
        let mut cfg = [0u8; 16];
        cfg[..8].copy_from_slice(&self.guest_addr.to_le_bytes());
        cfg[8..].copy_from_slice(&self.size.to_le_bytes());
        cfg
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
        self.acked.ack(self.features(), features);
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
        check_queue_count(queues.len(), 1..=1)?;
        // The previous worker (if any) is stopped before the new one starts.
        self.worker = None;
        let file = self.file.clone();
        self.worker = Some(QueueWorker::spawn(
            format!("pmem-{}", self.id),
            format!("virtio-pmem {}", self.id),
            queues.remove(0),
            mem,
            interrupt,
            move |queue, mem| request::process_queue(queue, mem, || file.sync_all()),
        )?);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.worker = None;
        self.acked.reset();
        true
    }

    fn needs_reset(&self) -> bool {
        self.worker.as_ref().is_some_and(QueueWorker::is_broken)
    }

    fn set_shm_base(&mut self, base: u64) {
        self.guest_addr = base;
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
        assert_eq!(dev.acked.bits(), dev.features());
        assert!(dev.reset());
        // The guest moved the BAR: config `start` and the region follow.
        dev.set_shm_base(0x2_0000_0000);
        dev.read_config(0, &mut cfg);
        assert_eq!(
            u64::from_le_bytes(cfg[..8].try_into().unwrap()),
            0x2_0000_0000
        );
        assert_eq!(dev.shm_regions()[0].guest_addr, 0x2_0000_0000);
    }

    /// The flush queue with an available index the queue refuses: the
    /// worker stops and the device asks for a reset instead of serving
    /// (or logging) it on every kick.
    #[test]
    fn an_impossible_available_index_stops_the_queue_until_a_reset() {
        let backing = PmemBacking::open(&std::env::temp_dir(), Some(2 << 20), false).unwrap();
        let mut dev = Pmem::new("pmem0".into(), &backing, 0x1_4000_0000).unwrap();
        crate::queue_worker::hostile::an_impossible_index_stops_the_queue(&mut dev);
    }
}
