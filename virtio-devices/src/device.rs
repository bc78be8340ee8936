//! The device model both transports serve.

use std::ops::RangeInclusive;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use crate::device_state::{DeviceStateError, SavedQueue};
use crate::GuestMemoryMmap;

/// Which interrupt a device raises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interrupt {
    /// A used buffer in this queue.
    Queue(u16),
    /// The device configuration changed.
    Config,
}

/// How a device notifies the driver; each transport provides its own (an
/// IOAPIC line for MMIO, MSI-X vectors for PCI).
pub trait VirtioInterrupt: Send + Sync {
    fn trigger(&self, interrupt: Interrupt) -> std::io::Result<()>;
    /// The eventfd that raises this interrupt when written, so a vhost-user
    /// backend can signal the guest without going through the VMM.
    fn notifier(&self, interrupt: Interrupt) -> Option<EventFd>;
}

/// A virtio shared memory region (virtio 1.2 §2.10): an id, where it sits in
/// guest-physical memory, and the host mapping behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMemoryRegion {
    pub id: u8,
    pub guest_addr: u64,
    pub len: u64,
    /// Host virtual address of the mapping that backs the region.
    pub host_addr: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver set up {got} queues; the device needs {needed}")]
    QueueCount { got: usize, needed: usize },
    /// What serves the device (its vhost-user daemon, its worker thread)
    /// is gone; `device` is its kind and id.
    #[error("activating the device: {device}: {why}")]
    BackendGone { device: String, why: &'static str },
    /// The vhost-user daemon failed one of the requests that set up the
    /// rings.
    #[error("activating the device: {device}: {request}: {source}")]
    VhostUser {
        device: String,
        request: &'static str,
        source: vhost::Error,
    },
    /// A ring the driver set up is not in guest RAM.
    #[error("activating the device: {device}: queue {ring} at {addr:#x}: {source}")]
    RingAddress {
        device: String,
        ring: &'static str,
        addr: u64,
        source: vm_memory::GuestMemoryError,
    },
    /// The tap refused the offloads the driver accepted.
    #[error("activating the device: {device}: TUNSETOFFLOAD {flags:#x}: {source}")]
    TapOffload {
        device: String,
        flags: u32,
        source: std::io::Error,
    },
    /// The vhost-user-fs device's own error (its daemon's memory table, a
    /// daemon that stopped answering), which names the device. Boxed: that
    /// type lives with the device, which implements this trait.
    #[error("activating the device: {0}")]
    Fs(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A queue handed to a device on activation: its index, its state as the
/// driver configured it, and the eventfd the guest's notifications arrive on.
pub struct ActivatedQueue {
    pub index: u16,
    pub queue: Queue,
    pub kick: EventFd,
}

/// The feature bits the driver accepted, kept the same way by every device:
/// only bits the device offered survive the driver's write, and a reset
/// forgets them (Cloud Hypervisor keeps its devices' in `VirtioCommon`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AckedFeatures(u64);

impl AckedFeatures {
    /// The driver accepted `requested`; keeps what the device `offered` of it.
    pub fn ack(&mut self, offered: u64, requested: u64) {
        self.0 = offered & requested;
    }

    /// The accepted bits (zero before negotiation and after a reset).
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Forgets the negotiation (the driver reset the device).
    pub fn reset(&mut self) {
        self.0 = 0;
    }
}

/// Checks at activation that the driver set up between `counts.start()`
/// and `counts.end()` queues.
pub(crate) fn check_queue_count(
    got: usize,
    counts: RangeInclusive<usize>,
) -> Result<(), ActivateError> {
    if counts.contains(&got) {
        return Ok(());
    }
    Err(ActivateError::QueueCount {
        got,
        needed: *counts.end(),
    })
}

/// The queues an activation gets, checked and set up as the devices that
/// offer `VIRTIO_RING_F_EVENT_IDX` (virtio-blk, virtio-net) need them: the
/// driver set up between `counts.start()` and `counts.end()` of them, and
/// each suppresses notifications the EVENT_IDX way exactly when the driver
/// accepted that feature (in `acked`).
pub(crate) fn event_idx_queues(
    mut queues: Vec<ActivatedQueue>,
    counts: RangeInclusive<usize>,
    acked: u64,
) -> Result<Vec<ActivatedQueue>, ActivateError> {
    check_queue_count(queues.len(), counts)?;
    let event_idx = acked & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
    for q in &mut queues {
        q.queue.set_event_idx(event_idx);
    }
    Ok(queues)
}

pub trait VirtioDevice: Send {
    /// Virtio device id (e.g. 26 for fs, 27 for pmem).
    fn device_type(&self) -> u32;

    /// Maximum size of each queue; the number of entries is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];

    /// Features the device offers (must include `VIRTIO_F_VERSION_1`).
    fn features(&self) -> u64;

    /// The features the driver accepted, a subset of [`Self::features`].
    fn ack_features(&mut self, features: u64);

    /// Reads device config space; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Writes device config space; devices with a read-only config ignore it.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let _ = (offset, data);
    }

    /// Starts the device once the driver sets DRIVER_OK.
    fn activate(
        &mut self,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError>;

    /// Stops the device when the driver resets it; afterwards it can be
    /// activated again. Returns false if the device cannot be reset, in which
    /// case the transport sets DEVICE_NEEDS_RESET and the device stays as it is.
    fn reset(&mut self) -> bool;

    /// True when the device found itself broken while running (e.g. its
    /// vhost-user backend reported a queue error): the transport then shows
    /// DEVICE_NEEDS_RESET in the status the driver reads.
    fn needs_reset(&self) -> bool {
        false
    }

    /// The transport placed the device's shared memory at `base` (or the
    /// guest moved the BAR holding it): regions are reported from there, and
    /// a device that shows the address in its config space (virtio-pmem's
    /// `start`) shows this one.
    fn set_shm_base(&mut self, base: u64) {
        let _ = base;
    }

    /// Shared memory regions the device owns, by id.
    fn shm_regions(&self) -> Vec<SharedMemoryRegion> {
        Vec::new()
    }

    /// The device's counters for `vm.counters`, if it keeps any.
    fn counters(&self) -> Option<Arc<crate::DeviceCounters>> {
        None
    }

    /// A name for the device in the errors of the methods below (its kind
    /// and id where the device knows them).
    fn state_name(&self) -> String {
        format!("virtio device type {}", self.device_type())
    }

    /// Stops serving: waits (bounded) until every chain the device has
    /// taken is answered, then returns each activated queue's position in
    /// queue index order (empty if the device is not activated).
    /// Afterwards nothing in guest memory changes and the device raises no
    /// interrupt until [`Self::resume`] (or a reset).
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        Err(DeviceStateError::NotSupported {
            device: self.state_name(),
        })
    }

    /// Serves the same queues again from where [`Self::pause`] stopped.
    fn resume(&mut self) -> Result<(), DeviceStateError> {
        Err(DeviceStateError::NotSupported {
            device: self.state_name(),
        })
    }

    /// While paused: the device's own state beyond its queues (not the
    /// acked features, which the transport saves): what the guest can
    /// change in config space and what identifies the device to the guest.
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        Err(DeviceStateError::NotSupported {
            device: self.state_name(),
        })
    }

    /// On a device just built from the same configuration, before the
    /// transport activates it with the queues of [`SavedQueue::to_queue`]
    /// and the saved acked features: takes back what [`Self::save_state`]
    /// gave. Everything is checked first; a value that does not fit the
    /// device's configuration is refused by field name and nothing is
    /// applied. The activation that follows serves what the queues hold
    /// without waiting for a kick (the guest's last kicks reached the old
    /// process only).
    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        let _ = state;
        Err(DeviceStateError::NotSupported {
            device: self.state_name(),
        })
    }

    /// The source of a local migration, once this device's state is saved
    /// and sent: let go of an outside backend that serves one VMM at a time
    /// (a vhost-user daemon), so that a fresh one can serve the receiving
    /// VMM. The device serves nothing afterwards.
    fn release_backend(&mut self) {}

    /// A migration over the network, at the switch (the device paused, its
    /// state saved): the receiving VMM cannot be handed this VMM's fds and
    /// opens the device's host side itself by its configured name (a disk
    /// image on shared storage, a tap by name, the vsock's socket path), so
    /// the device lets go of what would stop it: an image's lock, a tap
    /// opened by name, the socket's name and listener. Ok(true) when it let
    /// go of something. Until [`Self::reclaim_after_switch`] the device does
    /// not serve that host side (a net device refuses to resume).
    fn release_for_switch(&mut self) -> Result<bool, DeviceStateError> {
        Ok(false)
    }

    /// The migration failed: takes back what [`Self::release_for_switch`]
    /// let go of (nothing if it let go of nothing), so the device serves as
    /// before once resumed. Ok(Some(fd)): it serves a new host fd now (a tap
    /// opened again, a socket bound again), of which this is a copy for
    /// the VMM's own list. Err names the device and what could not be taken
    /// back: a disk then serves on without its lock (it is not released
    /// any more), a net device stays without its tap (its resume is
    /// refused) and the vsock device without its socket; for those two a
    /// later call tries again.
    fn reclaim_after_switch(&mut self) -> Result<Option<OwnedFd>, DeviceStateError> {
        Ok(None)
    }

    /// Asked before anything is paused: Err says why this device cannot be
    /// snapshotted or moved.
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Err(DeviceStateError::NotSupported {
            device: self.state_name(),
        })
    }
}

/// Copies `src[offset..]` into `data`, zero-filling past the end: the usual
/// body of `read_config` for a device whose config is a byte array.
pub fn read_config_bytes(src: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(offset) = usize::try_from(offset) else {
        return;
    };
    if let Some(tail) = src.get(offset..) {
        let n = tail.len().min(data.len());
        data[..n].copy_from_slice(&tail[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reads_zero_fill_past_the_end() {
        let cfg = [1u8, 2, 3, 4];
        let mut d = [0xaa; 4];
        read_config_bytes(&cfg, 2, &mut d);
        assert_eq!(d, [3, 4, 0, 0]);
        read_config_bytes(&cfg, 9, &mut d);
        assert_eq!(d, [0; 4]);
        read_config_bytes(&cfg, u64::MAX, &mut d);
        assert_eq!(d, [0; 4]);
    }

    #[test]
    fn acked_features_keep_only_what_was_offered_until_a_reset() {
        let mut acked = AckedFeatures::default();
        assert_eq!(acked.bits(), 0);
        acked.ack(0b1011, 0b0110);
        assert_eq!(acked.bits(), 0b0010);
        acked.ack(0b1011, u64::MAX);
        assert_eq!(acked.bits(), 0b1011);
        acked.reset();
        assert_eq!(acked.bits(), 0);
    }

    #[test]
    fn queue_counts_outside_the_range_name_what_was_needed() {
        assert!(check_queue_count(3, 3..=3).is_ok());
        assert!(check_queue_count(1, 1..=4).is_ok());
        assert!(matches!(
            check_queue_count(2, 3..=3),
            Err(ActivateError::QueueCount { got: 2, needed: 3 })
        ));
        assert!(matches!(
            check_queue_count(5, 1..=4),
            Err(ActivateError::QueueCount { got: 5, needed: 4 })
        ));
    }

    fn queues(n: u16) -> Vec<ActivatedQueue> {
        (0..n)
            .map(|index| ActivatedQueue {
                index,
                queue: Queue::new(16).expect("queue"),
                kick: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
            })
            .collect()
    }

    #[test]
    fn event_idx_queues_checks_the_count_and_follows_the_driver() {
        let e = event_idx_queues(queues(0), 1..=4, 0).err();
        assert!(matches!(
            e,
            Some(ActivateError::QueueCount { got: 0, needed: 4 })
        ));
        let e = event_idx_queues(queues(3), 2..=2, 0).err();
        assert!(matches!(
            e,
            Some(ActivateError::QueueCount { got: 3, needed: 2 })
        ));
        let on = event_idx_queues(queues(2), 1..=2, 1 << VIRTIO_RING_F_EVENT_IDX).expect("two");
        assert!(on.iter().all(|q| q.queue.state().event_idx_enabled));
        assert_eq!(on.iter().map(|q| q.index).collect::<Vec<_>>(), [0, 1]);
        let off = event_idx_queues(queues(1), 1..=2, !(1 << VIRTIO_RING_F_EVENT_IDX)).expect("one");
        assert!(!off[0].queue.state().event_idx_enabled);
    }

    /// A device that has not implemented pausing is refused by name for
    /// each step, before anything is paused.
    #[test]
    fn a_device_without_pause_support_is_refused_by_name() {
        struct Plain;
        impl VirtioDevice for Plain {
            fn device_type(&self) -> u32 {
                99
            }
            fn queue_max_sizes(&self) -> &[u16] {
                &[16]
            }
            fn features(&self) -> u64 {
                0
            }
            fn ack_features(&mut self, _: u64) {}
            fn read_config(&self, _: u64, _: &mut [u8]) {}
            fn activate(
                &mut self,
                _: GuestMemoryAtomic<GuestMemoryMmap>,
                _: Arc<dyn VirtioInterrupt>,
                _: Vec<ActivatedQueue>,
            ) -> Result<(), ActivateError> {
                Ok(())
            }
            fn reset(&mut self) -> bool {
                true
            }
        }
        let mut d = Plain;
        let e = d.check_movable().unwrap_err();
        assert_eq!(
            e.to_string(),
            "virtio device type 99: cannot be paused/saved (not supported for this device)"
        );
        assert!(matches!(
            d.pause(),
            Err(DeviceStateError::NotSupported { .. })
        ));
        assert!(matches!(
            d.resume(),
            Err(DeviceStateError::NotSupported { .. })
        ));
        assert!(matches!(
            d.save_state(),
            Err(DeviceStateError::NotSupported { .. })
        ));
        assert!(matches!(
            d.restore_state(&serde_json::Value::Null),
            Err(DeviceStateError::NotSupported { .. })
        ));
    }

    /// Each activation failure says which device, what step and why, in
    /// the words the logs had before the variants were typed, and keeps
    /// its cause as the error's source.
    #[test]
    fn activation_errors_name_the_device_the_step_and_keep_the_cause() {
        use std::error::Error;
        let e = ActivateError::TapOffload {
            device: "virtio-net net0".into(),
            flags: 0x11,
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert!(
            e.to_string()
                .starts_with("activating the device: virtio-net net0: TUNSETOFFLOAD 0x11: "),
            "{e}"
        );
        assert!(e.source().is_some());
        let e = ActivateError::VhostUser {
            device: "fs fs0".into(),
            request: "SET_VRING_ADDR",
            source: vhost::Error::UsedAddress,
        };
        assert!(
            e.to_string()
                .starts_with("activating the device: fs fs0: SET_VRING_ADDR: "),
            "{e}"
        );
        assert!(e.source().is_some());
        let e = ActivateError::BackendGone {
            device: "virtio-vsock vsock0".into(),
            why: "its thread is gone",
        };
        assert_eq!(
            e.to_string(),
            "activating the device: virtio-vsock vsock0: its thread is gone"
        );
        let e = ActivateError::RingAddress {
            device: "fs fs0".into(),
            ring: "used ring",
            addr: 0x1000,
            source: vm_memory::GuestMemoryError::InvalidGuestAddress(vm_memory::GuestAddress(
                0x1000,
            )),
        };
        assert!(
            e.to_string()
                .starts_with("activating the device: fs fs0: queue used ring at 0x1000: "),
            "{e}"
        );
    }
}
