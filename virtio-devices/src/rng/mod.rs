//! virtio-rng (entropy device, virtio 1.2 §5.4): one request queue whose
//! buffers the device fills with bytes from a host source (Cloud
//! Hypervisor's `rng src=`, `/dev/urandom` by default). Cloud Hypervisor
//! gives every VM one, so this VMM does too.
//!
//! Each chain's device-writable buffers are filled (at most
//! [`MAX_BYTES_PER_REQUEST`] per chain, so a guest cannot make one request
//! read without bound); a chain with none is used with length 0.

use std::fs::File;
use std::io::Read;
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestMemory, GuestMemoryAtomic};

use crate::device::{
    check_queue_count, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    VirtioDevice, VirtioInterrupt,
};
use crate::device_state::{DeviceStateError, SavedQueue, StateFields};
use crate::queue_worker::QueueWorker;
use crate::GuestMemoryMmap;

pub const VIRTIO_ID_RNG: u32 = 4;
const QUEUE_SIZES: &[u16] = &[256];
/// Bytes given for one request at most (the Linux driver asks for up to a
/// page at a time).
pub const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("rng src={path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("rng src={path}: not a character device or regular file")]
    Kind { path: String },
}

pub struct Rng {
    id: String,
    source: Arc<Mutex<File>>,
    acked: AckedFeatures,
    worker: Option<QueueWorker>,
    /// Restored from a snapshot: the next activation serves what the queue
    /// holds without waiting for a kick (the guest's last kicks went to the
    /// old process).
    restored: bool,
}

impl Rng {
    /// Opens `src` (a character device such as `/dev/urandom`, or a file).
    pub fn new(id: String, src: &std::path::Path) -> Result<Self, RngError> {
        let path = src.display().to_string();
        let file = File::open(src).map_err(|source| RngError::Open {
            path: path.clone(),
            source,
        })?;
        let kind = file
            .metadata()
            .map_err(|source| RngError::Open {
                path: path.clone(),
                source,
            })?
            .file_type();
        use std::os::unix::fs::FileTypeExt;
        if !kind.is_char_device() && !kind.is_file() {
            return Err(RngError::Kind { path });
        }
        Ok(Rng {
            id,
            source: Arc::new(Mutex::new(file)),
            acked: AckedFeatures::default(),
            worker: None,
            restored: false,
        })
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
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

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // virtio-rng has no configuration space.
        read_config_bytes(&[], offset, data);
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
        let source = self.source.clone();
        let queue = queues.remove(0);
        if std::mem::take(&mut self.restored) {
            queue.kick.write(1)?;
        }
        self.worker = Some(QueueWorker::spawn(
            format!("rng-{}", self.id),
            format!("virtio-rng {}", self.id),
            queue,
            mem,
            interrupt,
            move |queue, mem| process_queue(queue, mem, &source),
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

    fn state_name(&self) -> String {
        format!("virtio-rng {}", self.id)
    }

    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        self.worker.iter_mut().map(QueueWorker::pause).collect()
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        self.worker.as_mut().map_or(Ok(()), QueueWorker::resume)
    }

    /// Nothing beyond the queue: the source is the configuration's.
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        Ok(serde_json::json!({}))
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        StateFields::new(&self.state_name(), state)?.finish()?;
        self.restored = true;
        Ok(())
    }

    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Ok(())
    }
}

/// Fills every available chain's writable buffers from `source`; returns
/// how many chains were used.
pub fn process_queue<M: GuestMemory>(
    queue: &mut Queue,
    mem: &M,
    source: &Mutex<File>,
) -> Result<usize, virtio_queue::Error> {
    let mut used = 0;
    let mut buf = vec![0u8; 4096];
    while let Some(chain) = queue.iter(mem)?.next() {
        let head = chain.head_index();
        let mut written = 0usize;
        for desc in chain.writable() {
            let mut addr = desc.addr();
            let mut left = (desc.len() as usize).min(MAX_BYTES_PER_REQUEST - written);
            while left > 0 {
                let n = left.min(buf.len());
                let got = match source
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(&mut buf[..n])
                {
                    Ok(0) | Err(_) => break,
                    Ok(got) => got,
                };
                // A buffer outside guest RAM ends the chain; what was written counts.
                if mem.write_slice(&buf[..got], addr).is_err() {
                    left = 0;
                    break;
                }
                written += got;
                left -= got;
                addr = match addr.checked_add(got as u64) {
                    Some(a) => a,
                    None => break,
                };
            }
            if written >= MAX_BYTES_PER_REQUEST || left > 0 {
                break;
            }
        }
        queue.add_used(mem, head, narrow::sat_u32(written))?;
        used += 1;
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    use super::*;

    #[test]
    fn fills_writable_buffers_from_the_source_and_caps_a_request() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap();
        let vq = MockSplitQueue::new(&mem, 16);
        // Chain 0: 100 writable bytes. Chain 1: 2 x 48 KiB (capped at 64 KiB).
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(
                0x10000,
                100,
                const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
                0,
            )),
            RawDescriptor::from(SplitDescriptor::new(
                0x20000,
                48 << 10,
                const { narrow::u16_of((VRING_DESC_F_WRITE | VRING_DESC_F_NEXT) as u64) },
                2,
            )),
            RawDescriptor::from(SplitDescriptor::new(
                0x40000,
                48 << 10,
                const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
                0,
            )),
        ];
        vq.build_multiple_desc_chains(&descs).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        let tmp = vmm_sys_util::tempfile::TempFile::new().unwrap();
        std::fs::write(tmp.as_path(), vec![0x5au8; 200 << 10]).unwrap();
        let source = Mutex::new(File::open(tmp.as_path()).unwrap());
        assert_eq!(process_queue(&mut q, &mem, &source).unwrap(), 2);
        let mut got = [0u8; 100];
        mem.read_slice(&mut got, GuestAddress(0x10000)).unwrap();
        assert_eq!(got, [0x5a; 100]);
        let used_len = |i: u64| {
            mem.read_obj::<u32>(vq.used_addr().unchecked_add(4 + 8 * i + 4))
                .unwrap()
        };
        assert_eq!(
            (used_len(0), used_len(1)),
            (100, u32::try_from(MAX_BYTES_PER_REQUEST).unwrap())
        );
        assert!(Rng::new("rng0".into(), std::path::Path::new("/dev/urandom")).is_ok());
        assert!(Rng::new("rng0".into(), std::path::Path::new("/"))
            .err()
            .unwrap()
            .to_string()
            .contains("not a character device"));
    }

    /// Paused, the queue's position is what was served and nothing more
    /// is; resumed or restored, serving goes on from there.
    #[test]
    fn pause_resume_and_restore_continue_from_the_saved_position() {
        let make = || {
            Box::new(Rng::new("rng0".into(), std::path::Path::new("/dev/urandom")).unwrap())
                as Box<dyn VirtioDevice>
        };
        crate::queue_worker::pausing::pause_resume_and_restore(&make, &|at| {
            vec![RawDescriptor::from(SplitDescriptor::new(
                0x10000 + u64::from(at) * 0x100,
                16,
                const { narrow::u16_of(VRING_DESC_F_WRITE as u64) },
                0,
            ))]
        });
    }

    /// The request queue with an available index the queue refuses: the
    /// worker stops and the device asks for a reset.
    #[test]
    fn an_impossible_available_index_stops_the_queue_until_a_reset() {
        let mut dev = Rng::new("rng0".into(), std::path::Path::new("/dev/urandom")).unwrap();
        crate::queue_worker::hostile::an_impossible_index_stops_the_queue(&mut dev);
    }
}
