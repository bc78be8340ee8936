//! virtio-pmem: a host file mapped into guest-physical memory, announced in
//! config space (`start`, `size`) and as shared memory region 0, with a
//! request queue on which the guest asks for the file to be flushed.

pub mod backing;
pub mod request;

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::GuestMemoryAtomic;

use crate::device::{
    check_queue_count, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    SharedMemoryRegion, VirtioDevice, VirtioInterrupt,
};
use crate::device_state::{invalid, DeviceStateError, SavedQueue, StateFields};
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
    /// The backing's `file=`, `discard_writes` and whether the file is an
    /// unnamed temporary one (see [`PmemBacking`]).
    path: PathBuf,
    discard_writes: bool,
    unnamed: bool,
    /// Restored from a snapshot: the next activation serves what the queue
    /// holds without waiting for a kick.
    restored: bool,
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
            path: backing.path().to_path_buf(),
            discard_writes: backing.discard_writes(),
            unnamed: backing.unnamed(),
            restored: false,
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
        let queue = queues.remove(0);
        if std::mem::take(&mut self.restored) {
            queue.kick.write(1)?;
        }
        self.worker = Some(QueueWorker::spawn(
            format!("pmem-{}", self.id),
            format!("virtio-pmem {}", self.id),
            queue,
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

    fn state_name(&self) -> String {
        format!("virtio-pmem {}", self.id)
    }

    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        self.worker.iter_mut().map(QueueWorker::pause).collect()
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        self.worker.as_mut().map_or(Ok(()), QueueWorker::resume)
    }

    /// The file and its size (checked against the configuration on
    /// restore) and the `start` the guest reads in config space. The
    /// file's contents are the file's: the snapshot does not copy them.
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        Ok(serde_json::json!({
            "file": self.path,
            "size": self.size,
            "discard_writes": self.discard_writes,
            "start": self.guest_addr,
        }))
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        let name = self.state_name();
        let mut f = StateFields::new(&name, state)?;
        let file: PathBuf = f.take("file")?;
        let size: u64 = f.take("size")?;
        let discard_writes: bool = f.take("discard_writes")?;
        let start: u64 = f.take("start")?;
        f.finish()?;
        if file != self.path {
            return Err(invalid(
                &name,
                "file",
                format!(
                    "saved {}, configured {}",
                    file.display(),
                    self.path.display()
                ),
            ));
        }
        if size != self.size {
            return Err(invalid(
                &name,
                "size",
                format!("saved {size}, configured {}", self.size),
            ));
        }
        if discard_writes != self.discard_writes {
            return Err(invalid(
                &name,
                "discard_writes",
                format!("saved {discard_writes}, configured {}", self.discard_writes),
            ));
        }
        // Where the guest last saw the range (the transport places the
        // region there again and may say so through set_shm_base too).
        self.guest_addr = start;
        self.restored = true;
        Ok(())
    }

    /// What the guest wrote lives only in this process when the file is an
    /// unnamed temporary one or writes are discarded (a private copy): a
    /// restored VM would find the file without them.
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        let why = if self.unnamed {
            "its file is an unnamed temporary file (file= names a directory); \
             the guest's data in it does not outlive this process"
        } else if self.discard_writes {
            "discard_writes=on keeps the guest's writes in this process only; \
             a restored VM would not see them"
        } else {
            return Ok(());
        };
        Err(DeviceStateError::NotMovable {
            device: self.state_name(),
            reason: why.into(),
        })
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

    fn named_file(size: u64) -> vmm_sys_util::tempfile::TempFile {
        let t = vmm_sys_util::tempfile::TempFile::new().unwrap();
        t.as_file().set_len(size).unwrap();
        t
    }

    /// Paused, the flush queue's position is what was served and nothing
    /// more is; resumed or restored, serving goes on from there.
    #[test]
    fn pause_resume_and_restore_continue_from_the_saved_position() {
        use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
        use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
        let t = named_file(2 << 20);
        let backing = PmemBacking::open(t.as_path(), None, false).unwrap();
        let make = || {
            Box::new(Pmem::new("pmem0".into(), &backing, 0x1_4000_0000).unwrap())
                as Box<dyn VirtioDevice>
        };
        crate::queue_worker::pausing::pause_resume_and_restore(&make, &|n| {
            let at = 2 * n;
            vec![
                RawDescriptor::from(SplitDescriptor::new(
                    0x10000,
                    4,
                    const { narrow::u16_of(VRING_DESC_F_NEXT as u64) },
                    at + 1,
                )),
                RawDescriptor::from(SplitDescriptor::new(
                    0x20000 + u64::from(n) * 0x10,
                    4,
                    const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
                    0,
                )),
            ]
        });
    }

    /// The saved file, size and mode must be the configured ones; a
    /// mismatch is refused by field and changes nothing (not even the
    /// `start` the guest reads).
    #[test]
    fn a_restore_that_does_not_fit_the_configuration_is_refused_by_field() {
        let t = named_file(2 << 20);
        let backing = PmemBacking::open(t.as_path(), None, false).unwrap();
        let mut dev = Pmem::new("pmem0".into(), &backing, 0x1_4000_0000).unwrap();
        dev.set_shm_base(0x2_0000_0000);
        let good = dev.save_state().unwrap();
        assert_eq!(good["start"], 0x2_0000_0000u64);
        let mut fresh = Pmem::new("pmem0".into(), &backing, 0x1_4000_0000).unwrap();
        for (field, value) in [
            ("file", serde_json::json!("/elsewhere")),
            ("size", serde_json::json!(4u64 << 20)),
            ("discard_writes", serde_json::json!(true)),
            ("start", serde_json::json!("high")),
        ] {
            let mut state = good.clone();
            state[field] = value;
            match fresh.restore_state(&state) {
                Err(DeviceStateError::Invalid { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
            assert_eq!(fresh.guest_addr, 0x1_4000_0000, "{field}: nothing applied");
            assert!(!fresh.restored);
        }
        fresh.restore_state(&good).unwrap();
        let mut cfg = [0u8; 8];
        fresh.read_config(0, &mut cfg);
        assert_eq!(u64::from_le_bytes(cfg), 0x2_0000_0000, "the saved start");
    }

    /// A file nothing can open again, or writes kept in a private copy,
    /// cannot be carried: refused by name before anything pauses.
    #[test]
    fn only_a_named_shared_file_is_movable() {
        let t = named_file(2 << 20);
        let shared = PmemBacking::open(t.as_path(), None, false).unwrap();
        let dev = Pmem::new("pmem0".into(), &shared, 0).unwrap();
        assert!(dev.check_movable().is_ok());
        let private = PmemBacking::open(t.as_path(), None, true).unwrap();
        let e = Pmem::new("pmem1".into(), &private, 0)
            .unwrap()
            .check_movable()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("virtio-pmem pmem1: cannot be saved: discard_writes=on"),
            "{e}"
        );
        let unnamed = PmemBacking::open(&std::env::temp_dir(), Some(2 << 20), false).unwrap();
        let e = Pmem::new("pmem2".into(), &unnamed, 0)
            .unwrap()
            .check_movable()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unnamed temporary file"), "{e}");
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
