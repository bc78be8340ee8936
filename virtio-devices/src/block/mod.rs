//! virtio-blk (virtio 1.2 §5.2) on a raw image: read, write, flush,
//! get-id, and discard / write-zeroes where the host file can do them;
//! `readonly` offers `VIRTIO_BLK_F_RO` and fails every write with
//! `VIRTIO_BLK_S_IOERR`. Requests are checked by [`request`], run by the
//! threads of [`io`] against the [`disk`], never on a vCPU.

pub mod disk;
pub mod io;
pub mod request;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::GuestMemoryAtomic;

use crate::device::{
    event_idx_queues, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    VirtioDevice, VirtioInterrupt,
};
use crate::device_state::{invalid, DeviceStateError, SavedQueue, StateFields};
use crate::{DeviceCounters, GuestMemoryMmap};
pub use disk::{DiskError, DiskFile};
use request::{DiskLimits, ID_BYTES, SECTOR_SIZE};

pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Ranges one DISCARD or WRITE_ZEROES request may carry.
pub const MAX_RANGES: u32 = 16;
/// Sectors one range may cover (4 GiB less a sector: a u32 of bytes).
pub const MAX_RANGE_SECTORS: u32 = u32::MAX >> 9;
/// Discards are aligned to 4 KiB, the host's page, so a punched hole frees
/// whole blocks.
const DISCARD_ALIGNMENT_SECTORS: u32 = 8;
/// Size of the config space this device fills (up to `write_zeroes_may_unmap`).
const CONFIG_LEN: usize = 60;

/// What a virtio-blk device is made from.
#[derive(Clone, Debug)]
pub struct BlockDeviceConfig {
    pub id: String,
    pub path: PathBuf,
    pub readonly: bool,
    pub direct: bool,
    pub num_queues: u16,
    pub queue_size: u16,
    /// What GET_ID answers (at most 20 bytes); the device id if None.
    pub serial: Option<String>,
}

pub struct Block {
    shared: Arc<io::Shared>,
    /// The image's path, which errors name.
    path: PathBuf,
    /// A migration's switch let go of the image's lock.
    unlocked: bool,
    queue_sizes: Vec<u16>,
    acked: AckedFeatures,
    running: Option<io::BlockQueues>,
    /// Restored from a snapshot: the next activation serves what the
    /// queues hold without waiting for a kick (the guest's last kicks went
    /// to the old process).
    restored: bool,
}

/// What a saved virtio-blk state must match: the device's configuration
/// as the guest saw it (the guest cannot change any of it: no writeback
/// toggle is offered).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct BlockState {
    capacity: u64,
    readonly: bool,
    discard: bool,
    write_zeroes: bool,
    num_queues: usize,
    queue_size: u16,
    serial: Vec<u8>,
}

impl Block {
    /// Opens the image; the device is ready for a transport.
    pub fn new(c: &BlockDeviceConfig) -> Result<Self, DiskError> {
        Ok(Self::with_disk(
            c,
            DiskFile::open(&c.path, c.readonly, c.direct)?,
        ))
    }

    /// The device on an image opened already (`c.path`, `c.readonly` and
    /// `c.direct` are what it was opened or checked as).
    pub fn with_disk(c: &BlockDeviceConfig, disk: DiskFile) -> Self {
        let mut serial = [0u8; ID_BYTES];
        let given = c.serial.as_deref().unwrap_or(&c.id).as_bytes();
        let n = given.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&given[..n]);
        let limits = DiskLimits {
            capacity: disk.sectors(),
            readonly: disk.readonly(),
            discard: disk.can_discard(),
            write_zeroes: disk.can_write_zeroes(),
            max_segments: usize::from(c.queue_size),
            max_ranges: MAX_RANGES,
            max_range_sectors: MAX_RANGE_SECTORS,
        };
        Block {
            path: c.path.clone(),
            unlocked: false,
            shared: Arc::new(io::Shared {
                name: format!("virtio-blk {}", c.id),
                disk: Arc::new(disk),
                limits,
                serial,
                counters: DeviceCounters::new(&io::COUNTER_NAMES),
                broken: AtomicBool::new(false),
                #[cfg(test)]
                io_gate: None,
            }),
            queue_sizes: vec![c.queue_size; usize::from(c.num_queues.max(1))],
            acked: AckedFeatures::default(),
            running: None,
            restored: false,
        }
    }

    /// The open image (a local migration passes it on, its lock with it).
    pub fn image(&self) -> &std::fs::File {
        self.shared.disk.file()
    }

    /// Size of the disk in bytes.
    pub fn size(&self) -> u64 {
        self.shared.limits.capacity * SECTOR_SIZE
    }

    fn state(&self) -> BlockState {
        let l = &self.shared.limits;
        BlockState {
            capacity: l.capacity,
            readonly: l.readonly,
            discard: l.discard,
            write_zeroes: l.write_zeroes,
            num_queues: self.queue_sizes.len(),
            queue_size: self.queue_sizes[0],
            serial: self.shared.serial.to_vec(),
        }
    }

    /// virtio_blk_config, little-endian, as far as this device fills it.
    fn config(&self) -> [u8; CONFIG_LEN] {
        let l = &self.shared.limits;
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &l.capacity.to_le_bytes());
        // seg_max: data descriptors per request (the chain less header and status).
        let seg_max = u32::from(self.queue_sizes[0]).saturating_sub(2).max(1);
        put(12, &seg_max.to_le_bytes());
        put(20, &const { narrow::u32_of(SECTOR_SIZE) }.to_le_bytes());
        put(34, &narrow::sat_u16(self.queue_sizes.len()).to_le_bytes());
        if l.discard {
            put(36, &MAX_RANGE_SECTORS.to_le_bytes());
            put(40, &MAX_RANGES.to_le_bytes());
            put(44, &DISCARD_ALIGNMENT_SECTORS.to_le_bytes());
        }
        if l.write_zeroes {
            put(48, &MAX_RANGE_SECTORS.to_le_bytes());
            put(52, &MAX_RANGES.to_le_bytes());
            // Unmapping while zeroing is allowed where holes can be punched.
            put(56, &[u8::from(l.discard)]);
        }
        c
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let l = &self.shared.limits;
        // EVENT_IDX: the guest kicks and is interrupted once per batch,
        // not per request (see io.rs). INDIRECT_DESC: a request takes one
        // ring slot whatever its segments (a 1 MiB request of 4 KiB pages
        // would otherwise fill a 128-slot ring by itself).
        let mut f = (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_FLUSH);
        let mut offer = |yes: bool, bit: u32| {
            if yes {
                f |= 1 << bit;
            }
        };
        offer(l.readonly, VIRTIO_BLK_F_RO);
        offer(l.discard, VIRTIO_BLK_F_DISCARD);
        offer(l.write_zeroes, VIRTIO_BLK_F_WRITE_ZEROES);
        offer(self.queue_sizes.len() > 1, VIRTIO_BLK_F_MQ);
        f
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
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        // Without MQ the driver sets up only the first queue.
        let queues = event_idx_queues(queues, 1..=self.queue_sizes.len(), self.acked.bits())?;
        // The previous threads (if any) finish before new ones start.
        self.running = None;
        if std::mem::take(&mut self.restored) {
            for q in &queues {
                q.kick.write(1)?;
            }
        }
        self.running = Some(io::start(self.shared.clone(), queues, mem, interrupt)?);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.running = None;
        self.acked.reset();
        self.shared.broken.store(false, Ordering::SeqCst);
        true
    }

    fn needs_reset(&self) -> bool {
        self.shared.broken.load(Ordering::SeqCst)
    }

    fn counters(&self) -> Option<Arc<DeviceCounters>> {
        Some(self.shared.counters.clone())
    }

    fn state_name(&self) -> String {
        self.shared.name.clone()
    }

    /// Every request taken is completed (its I/O done, its used entry
    /// written, its interrupt raised) before this returns.
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        let Some(running) = &mut self.running else {
            return Ok(Vec::new());
        };
        running.pause().map_err(|reason| DeviceStateError::Pause {
            device: self.shared.name.clone(),
            reason,
        })
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        let Some(running) = &mut self.running else {
            return Ok(());
        };
        running.resume().map_err(|reason| DeviceStateError::Pause {
            device: self.shared.name.clone(),
            reason: format!("resuming: {reason}"),
        })
    }

    /// The configuration the guest saw, for the restore to check; the
    /// image's contents are the image's (the snapshot does not copy them).
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        serde_json::to_value(self.state()).map_err(|e| DeviceStateError::Invalid {
            device: self.shared.name.clone(),
            field: "state".into(),
            reason: e.to_string(),
        })
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        let name = self.shared.name.clone();
        let mut f = StateFields::new(&name, state)?;
        let saved = BlockState {
            capacity: f.take("capacity")?,
            readonly: f.take("readonly")?,
            discard: f.take("discard")?,
            write_zeroes: f.take("write_zeroes")?,
            num_queues: f.take("num_queues")?,
            queue_size: f.take("queue_size")?,
            serial: f.take("serial")?,
        };
        f.finish()?;
        let now = self.state();
        let differs = |field: &str, saved: &dyn std::fmt::Debug, now: &dyn std::fmt::Debug| {
            Err(invalid(
                &name,
                field,
                format!("saved {saved:?}, this disk has {now:?}"),
            ))
        };
        if saved.capacity != now.capacity {
            return differs("capacity", &saved.capacity, &now.capacity);
        }
        if saved.readonly != now.readonly {
            return differs("readonly", &saved.readonly, &now.readonly);
        }
        if saved.discard != now.discard {
            return differs("discard", &saved.discard, &now.discard);
        }
        if saved.write_zeroes != now.write_zeroes {
            return differs("write_zeroes", &saved.write_zeroes, &now.write_zeroes);
        }
        if saved.num_queues != now.num_queues {
            return differs("num_queues", &saved.num_queues, &now.num_queues);
        }
        if saved.queue_size != now.queue_size {
            return differs("queue_size", &saved.queue_size, &now.queue_size);
        }
        if saved.serial != now.serial {
            return differs("serial", &saved.serial, &now.serial);
        }
        self.restored = true;
        Ok(())
    }

    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Ok(())
    }

    /// The receiving VMM locks the image itself (shared storage): the lock
    /// goes, the image stays open (the device is paused: no I/O meanwhile).
    fn release_for_switch(&mut self) -> Result<bool, DeviceStateError> {
        if self.unlocked {
            return Ok(true);
        }
        self.shared
            .disk
            .unlock(&self.path)
            .map_err(|e| DeviceStateError::Switch {
                device: self.shared.name.clone(),
                step: "releasing",
                reason: e.to_string(),
            })?;
        self.unlocked = true;
        Ok(true)
    }

    /// The lock again (exclusive when writable, shared when read-only). A
    /// process that took it meanwhile keeps it: the error says so, and the
    /// disk serves on without the lock.
    fn reclaim_after_switch(&mut self) -> Result<Option<std::os::fd::OwnedFd>, DeviceStateError> {
        if !std::mem::take(&mut self.unlocked) {
            return Ok(None);
        }
        match self.shared.disk.relock(&self.path) {
            Ok(()) => Ok(None),
            Err(e) => {
                tracing::error!(
                    "{}: {e}: the image's lock could not be taken back after a failed \
                     migration; this VM runs on WITHOUT it (another process may write the image)",
                    self.shared.name
                );
                Err(DeviceStateError::Switch {
                    device: self.shared.name.clone(),
                    step: "reclaiming",
                    reason: format!("{e}; the disk serves on without the lock"),
                })
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
