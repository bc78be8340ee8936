//! virtio-net (virtio 1.2 §5.1) on a tap: one RX/TX queue pair served by
//! its own thread ([`worker`]), the virtio-net header passed through to the
//! tap ([`header`]) with the checksum and TSO offloads the tap accepts,
//! the MAC from the config (or a random local one), link status up, and
//! the MTU when one is configured.
//!
//! The tap is opened on the main thread ([`tap::Tap::open_named`], or taken
//! from an fd); activation tells it which offloads the guest acked
//! (`TUNSETOFFLOAD`) and starts the worker, whose seccomp kind is
//! [`NET_WORKER_THREAD`].

pub mod header;
pub mod iov;
pub mod mac;
pub mod queues;
pub mod rx;
pub mod tap;
pub mod worker;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_MTU, VIRTIO_NET_F_STATUS,
    VIRTIO_NET_S_LINK_UP,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::GuestMemoryAtomic;

use crate::device::{
    event_idx_queues, read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue,
    VirtioDevice, VirtioInterrupt,
};
use crate::device_state::{invalid, DeviceStateError, SavedQueue, StateFields};
use crate::{DeviceCounters, GuestMemoryMmap};
pub use header::{MAX_FRAME_LEN, VNET_HDR_LEN};
pub use mac::MacAddr;
use queues::NetCounters;
pub use tap::{FrameIo, Tap, TapError};
use worker::{PairSetup, PairWorker};

pub const VIRTIO_ID_NET: u32 = 1;
/// The seccomp thread kind of a net device's queue-pair threads.
pub const NET_WORKER_THREAD: &str = "net-worker";
/// Queues this device has: one RX/TX pair (Cloud Hypervisor's
/// `num_queues=2`).
pub const NUM_QUEUES: usize = 2;
/// Smallest MTU virtio-net allows (68, IPv4's minimum) and the largest a
/// frame of [`MAX_FRAME_LEN`] can carry.
pub const MIN_MTU: u16 = 68;
pub const MAX_MTU: u16 = 65535 - 14 - 4;
/// virtio_net_config up to `mtu`: mac[6], status, max_virtqueue_pairs, mtu.
const CONFIG_LEN: usize = 12;

/// What a virtio-net device is made from (the tap already open).
pub struct NetDeviceConfig {
    pub id: String,
    pub tap: Arc<dyn TapLike>,
    pub mac: MacAddr,
    pub mtu: Option<u16>,
    pub queue_size: u16,
    /// Offload features the config allows (`offload_csum`, `offload_tso`);
    /// offered where the tap takes them too.
    pub allowed_offloads: u64,
    /// How to open the tap again by its name, set up as the first time:
    /// given for a tap opened by name, which a migration's switch then
    /// closes (see [`VirtioDevice::release_for_switch`]). None for a tap
    /// passed as an fd, which is never closed: it could not be opened
    /// again, and a receiving VMM gets fds of its own.
    pub reopen: Option<TapReopen>,
}

/// Opens a net device's tap again (on the thread that takes it back: the
/// VMM's main thread, whose seccomp filter lets it open files).
pub type TapReopen = Box<dyn Fn() -> Result<Arc<dyn TapLike>, TapError> + Send>;

/// The host side as the device uses it: frames, and the offload switch.
/// A [`Tap`] in the VMM; a stand-in in tests.
pub trait TapLike: FrameIo {
    /// `TUNSETOFFLOAD` with these `TUN_F_*` flags.
    fn set_offload(&self, flags: u32) -> std::io::Result<()>;
    /// Offloads the host side can take, as virtio-net feature bits.
    fn offload_features(&self) -> u64;
}

impl TapLike for Tap {
    fn set_offload(&self, flags: u32) -> std::io::Result<()> {
        Tap::set_offload(self, flags)
    }

    fn offload_features(&self) -> u64 {
        // A tap that refuses the offloads (an old kernel, or an fd from
        // elsewhere that is no real tap) gets none offered.
        let all = header::tap_offload_flags(header::OFFLOAD_FEATURES);
        let ok = Tap::set_offload(self, all).is_ok() && Tap::set_offload(self, 0).is_ok();
        if ok {
            header::OFFLOAD_FEATURES
        } else {
            0
        }
    }
}

pub struct Net {
    id: String,
    /// None while a migration's switch closed it.
    tap: Option<Arc<dyn TapLike>>,
    reopen: Option<TapReopen>,
    mac: MacAddr,
    mtu: Option<u16>,
    offloads: u64,
    queue_sizes: [u16; NUM_QUEUES],
    acked: AckedFeatures,
    worker: Option<PairWorker>,
    counters: Arc<DeviceCounters>,
    /// Restored from a snapshot: the next activation serves what the
    /// queues hold without waiting for a kick (the guest's last kicks went
    /// to the old process).
    restored: bool,
}

impl Net {
    pub fn new(c: NetDeviceConfig) -> Self {
        let offloads = c.tap.offload_features() & c.allowed_offloads;
        Net {
            id: c.id,
            tap: Some(c.tap),
            reopen: c.reopen,
            mac: c.mac,
            mtu: c.mtu,
            offloads,
            queue_sizes: [c.queue_size; NUM_QUEUES],
            acked: AckedFeatures::default(),
            worker: None,
            counters: DeviceCounters::new(&NetCounters::NAMES),
            restored: false,
        }
    }

    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    fn config(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        c[..6].copy_from_slice(&self.mac.0);
        c[6..8].copy_from_slice(
            &(const { narrow::u16_of(VIRTIO_NET_S_LINK_UP as u64) }).to_le_bytes(),
        );
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c[10..12].copy_from_slice(&self.mtu.unwrap_or(0).to_le_bytes());
        c
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        // EVENT_IDX: the guest kicks and is interrupted once per batch
        // (see worker.rs). MRG_RXBUF: the guest posts page-sized receive
        // buffers and a frame spans as many as it needs (see rx.rs),
        // instead of one chain of 17 pages per TSO frame.
        let mut f = (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_NET_F_MRG_RXBUF)
            | (1 << VIRTIO_NET_F_MAC)
            | (1 << VIRTIO_NET_F_STATUS)
            | self.offloads;
        if self.mtu.is_some() {
            f |= 1 << VIRTIO_NET_F_MTU;
        }
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
        let queues = event_idx_queues(queues, NUM_QUEUES..=NUM_QUEUES, self.acked.bits())?;
        // The previous worker (if any) stops before the new one starts.
        self.worker = None;
        let Some(tap) = &self.tap else {
            return Err(ActivateError::BackendGone {
                device: format!("virtio-net {}", self.id),
                why: "its tap is closed (a migration's switch released it)",
            });
        };
        let flags = header::tap_offload_flags(self.acked.bits());
        tap.set_offload(flags)
            .map_err(|source| ActivateError::TapOffload {
                device: format!("virtio-net {}", self.id),
                flags,
                source,
            })?;
        let Ok([rx, tx]) = <[ActivatedQueue; NUM_QUEUES]>::try_from(queues) else {
            unreachable!("two queues were counted");
        };
        if std::mem::take(&mut self.restored) {
            rx.kick.write(1)?;
            tx.kick.write(1)?;
        }
        let io: Arc<dyn FrameIo> = Arc::new(TapFrames(tap.clone()));
        self.worker = Some(PairWorker::spawn(
            NET_WORKER_THREAD,
            format!("net-{}", self.id),
            PairSetup {
                device: format!("virtio-net {}", self.id),
                rx,
                tx,
                io,
                acked: self.acked.bits(),
                counters: self.counters.clone(),
            },
            mem,
            interrupt,
        )?);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.worker = None;
        self.acked.reset();
        true
    }

    fn counters(&self) -> Option<Arc<DeviceCounters>> {
        Some(self.counters.clone())
    }

    fn state_name(&self) -> String {
        format!("virtio-net {}", self.id)
    }

    /// See [`PairWorker::pause`]: RX buffers held for the next frame stay
    /// the guest's, a frame read from the tap and not yet delivered may be
    /// dropped by a restore.
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        let Some(worker) = &mut self.worker else {
            return Ok(Vec::new());
        };
        worker.pause().map_err(|reason| DeviceStateError::Pause {
            device: self.state_name(),
            reason,
        })
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        let Some(worker) = &mut self.worker else {
            return Ok(());
        };
        worker.resume().map_err(|reason| DeviceStateError::Pause {
            device: self.state_name(),
            reason: format!("resuming: {reason}"),
        })
    }

    /// The MAC the guest knows (a device configured without `mac=` got a
    /// random one, which the restored device takes back), and what must
    /// match: the MTU, the queue size, the offloads offered (the guest may
    /// have acked them).
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        Ok(serde_json::json!({
            "mac": self.mac.to_string(),
            "mtu": self.mtu,
            "queue_size": self.queue_sizes[0],
            "offloads": self.offloads,
        }))
    }

    /// No announcement follows the restore: `VIRTIO_NET_F_GUEST_ANNOUNCE`
    /// requires the control queue (`VIRTIO_NET_F_CTRL_VQ`), which this
    /// device does not have, so the guest cannot have acked it.
    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        let name = self.state_name();
        let mut f = StateFields::new(&name, state)?;
        let mac: String = f.take("mac")?;
        let mtu: Option<u16> = f.take("mtu")?;
        let queue_size: u16 = f.take("queue_size")?;
        let offloads: u64 = f.take("offloads")?;
        f.finish()?;
        let mac: MacAddr = mac.parse().map_err(|e| invalid(&name, "mac", e))?;
        if !mac.is_unicast() {
            return Err(invalid(
                &name,
                "mac",
                format!("{mac} is a multicast address"),
            ));
        }
        if mtu != self.mtu {
            return Err(invalid(
                &name,
                "mtu",
                format!("saved {mtu:?}, configured {:?}", self.mtu),
            ));
        }
        if queue_size != self.queue_sizes[0] {
            return Err(invalid(
                &name,
                "queue_size",
                format!("saved {queue_size}, configured {}", self.queue_sizes[0]),
            ));
        }
        if offloads != self.offloads {
            return Err(invalid(
                &name,
                "offloads",
                format!(
                    "saved {offloads:#x}, this tap and configuration offer {:#x}",
                    self.offloads
                ),
            ));
        }
        self.mac = mac;
        self.restored = true;
        Ok(())
    }

    /// The tap is reopened by name (or given again) by whoever builds the
    /// restored device; nothing here ties the device to this process.
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Ok(())
    }

    /// A tap opened by name is single-queue: the receiving VMM cannot open
    /// it while this one holds it. The worker lets go of it and it is
    /// closed (the caller closes its own copies); a tap this VMM created
    /// goes with its last fd, and the receiver creates it again. A tap
    /// passed as an fd is kept (Ok(false)).
    fn release_for_switch(&mut self) -> Result<bool, DeviceStateError> {
        if self.reopen.is_none() {
            return Ok(false);
        }
        if let Some(worker) = &mut self.worker {
            worker
                .take_io()
                .map_err(|reason| DeviceStateError::Switch {
                    device: format!("virtio-net {}", self.id),
                    step: "releasing",
                    reason,
                })?;
        }
        self.tap = None;
        Ok(true)
    }

    /// Opens the tap again by name (set up as at first, the offloads the
    /// guest acked given again) and hands it to the worker; Ok(Some(fd)):
    /// a copy of the new tap's fd.
    fn reclaim_after_switch(&mut self) -> Result<Option<OwnedFd>, DeviceStateError> {
        let (None, Some(reopen)) = (&self.tap, &self.reopen) else {
            return Ok(None);
        };
        let fail = |reason: String| DeviceStateError::Switch {
            device: format!("virtio-net {}", self.id),
            step: "reclaiming",
            reason,
        };
        let tap = reopen().map_err(|e| fail(e.to_string()))?;
        if let Some(worker) = &mut self.worker {
            let flags = header::tap_offload_flags(self.acked.bits());
            tap.set_offload(flags)
                .map_err(|e| fail(format!("TUNSETOFFLOAD {flags:#x}: {e}")))?;
            worker
                .put_io(Arc::new(TapFrames(tap.clone())))
                .map_err(fail)?;
        }
        // SAFETY: `tap` owns the fd and lives through this borrow.
        let copy = unsafe { BorrowedFd::borrow_raw(tap.as_raw_fd()) }
            .try_clone_to_owned()
            .map_err(|e| fail(format!("duplicating the tap's fd: {e}")));
        self.tap = Some(tap);
        copy.map(Some)
    }
}

/// The tap seen as frames only, for the worker.
struct TapFrames(Arc<dyn TapLike>);

impl std::os::fd::AsRawFd for TapFrames {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

impl FrameIo for TapFrames {}

#[cfg(test)]
mod test_util;

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "pause_tests.rs"]
mod pause_tests;

#[cfg(test)]
#[path = "switch_tests.rs"]
mod switch_tests;
