//! vhost-user-fs: a virtio-fs device whose queues a separate daemon serves
//! over a vhost-user socket, with the DAX cache window as shared memory
//! region 0.
//!
//! The path of a DAX mapping through this module: the guest sends
//! FUSE_SETUPMAPPING on a request queue → the daemon reads it and sends
//! SHMEM_MAP on the backend request channel → [`worker`] receives it →
//! [`backend_req::DaxRequestHandler`] → [`window::DaxWindow::map`] checks it
//! and `mmap(MAP_FIXED)`s the file into the window, which KVM already
//! translates as guest memory.

pub mod backend_req;
pub mod dirty_log;
pub mod file_watch;
pub mod map_budget;
pub mod mapped_files;
pub mod memory_table;
pub mod metrics;
pub mod scratch;
pub mod state;
pub mod watch_budget;
mod watchdog;
pub mod window;
pub mod worker;

use std::os::fd::AsRawFd;

use file_watch::FileKey;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, FrontendReqHandler, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{
    read_config_bytes, AckedFeatures, ActivateError, ActivatedQueue, Interrupt, SharedMemoryRegion,
    VirtioDevice, VirtioInterrupt,
};
use crate::device_state::DeviceStateError;
use crate::GuestMemoryMmap;
use backend_req::DaxRequestHandler;
use dax_abi::DAX_SHM_REGION_ID;
use window::DaxWindow;

pub const VIRTIO_ID_FS: u32 = 26;
/// Bytes of the tag in config space.
pub const TAG_LEN: usize = 36;

/// Virtio features passed through from the daemon to the guest; the daemon
/// serves the rings, so it decides which of these it supports.
const PASSTHROUGH_FEATURES: u64 =
    1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX | 1 << VIRTIO_RING_F_INDIRECT_DESC;

/// How long the VMM gives the daemon for one run of vhost-user exchanges
/// (the handshake, an activation, a reset): a daemon that accepts the
/// connection and then stops answering fails the operation after this
/// instead of holding the thread that asked (boot, hot-plug, a vCPU) for
/// ever (see `watchdog`). A daemon's real answers take microseconds.
pub const VHOST_USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a restore or an incoming migration tries the daemon's socket
/// until the fresh daemon listens: in a migration the guest is paused
/// meanwhile, so a long interval is downtime; a failed connect to a path
/// nothing listens on costs microseconds.
pub const CONNECT_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("fs {id}: connecting to the daemon at {socket}: {source}")]
    Connect {
        id: String,
        socket: PathBuf,
        source: vhost::Error,
    },
    #[error(
        "fs {id}: the daemon did not answer within {}s (is it stuck?); the connection is closed ({during})",
        VHOST_USER_TIMEOUT.as_secs()
    )]
    Timeout { id: String, during: String },
    #[error("fs {id}: vhost-user {step}: {source}")]
    Negotiate {
        id: String,
        step: &'static str,
        source: vhost::Error,
    },
    #[error("fs {id}: the daemon lacks {what}")]
    Missing { id: String, what: String },
    #[error(
        "fs {id}: cache_size={ours} but the daemon declares a {theirs}-byte window (GET_SHMEM_CONFIG); \
         give the same size to both, or omit cache_size to take the daemon's"
    )]
    WindowMismatch { id: String, ours: u64, theirs: u64 },
    #[error("fs {id}: {source}")]
    Window {
        id: String,
        source: window::WindowError,
    },
}

/// What the VMM needs to create a vhost-user-fs device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsDeviceConfig {
    pub id: String,
    pub tag: String,
    pub socket: PathBuf,
    /// Request queues (the hiprio queue comes on top).
    pub num_request_queues: u16,
    pub queue_size: u16,
    pub dax: bool,
    /// Window size; None takes the size the daemon declares.
    pub cache_size: Option<u64>,
}

pub struct VhostUserFs {
    id: String,
    config_space: Vec<u8>,
    queue_sizes: Vec<u16>,
    frontend: Frontend,
    /// `CONFIGURE_MEM_SLOTS` was negotiated (`ADD_MEM_REG`/`REM_MEM_REG`).
    mem_slots: bool,
    /// `REPLY_ACK` was negotiated.
    reply_ack: bool,
    backend_features: u64,
    acked: AckedFeatures,
    window: Option<Arc<DaxWindow>>,
    window_guest_addr: u64,
    /// Serves SHMEM_MAP/UNMAP; shared with the worker while the device runs.
    requests: Option<Arc<Mutex<FrontendReqHandler<DaxRequestHandler>>>>,
    /// Set once the daemon is gone; the device then stays failed.
    failed: Arc<AtomicBool>,
    /// Set when the daemon reports a queue error (SET_VRING_ERR eventfd);
    /// cleared by a reset.
    queue_error: Arc<AtomicBool>,
    worker: Option<crate::event_loop::WorkerThread>,
    active_queues: usize,
    /// The daemon's socket, for messages.
    socket: PathBuf,
    /// The protocol features in use (DEVICE_STATE among them when the
    /// daemon can hand its state over).
    protocol: VhostUserProtocolFeatures,
    /// What the last activation was given, to set the rings up again on
    /// resume.
    activation: Option<state::Activation>,
    /// The queues' positions while paused.
    paused: Option<Vec<crate::device_state::SavedQueue>>,
    /// Restored from a saved state: the next activation kicks every queue
    /// once (the guest's last kicks went to the old daemon).
    restored: bool,
    /// The mapped files a local migration's sender passed, by (dev, ino):
    /// [`VirtioDevice::restore_state`] maps the window again from them
    /// before the new daemon replays its record (which then finds every
    /// range in place).
    window_files: Option<std::collections::HashMap<FileKey, std::fs::File>>,
    /// The virtio features last sent with SET_FEATURES, which the dirty log
    /// sends again with `LOG_ALL` added.
    features_in_use: Arc<AtomicU64>,
    /// The dirty log the daemon writes, while a migration logs.
    dirty_log: Arc<Mutex<Option<Arc<dirty_log::SharedDirtyLog>>>>,
}

fn step<T>(id: &str, step: &'static str, r: vhost::Result<T>) -> Result<T, FsError> {
    r.map_err(|source| FsError::Negotiate {
        id: id.to_string(),
        step,
        source,
    })
}

/// Arms a [`watchdog::Watchdog`] of [`VHOST_USER_TIMEOUT`] on the connection `fd`.
fn arm_watchdog(fd: std::os::fd::RawFd) -> std::io::Result<watchdog::Watchdog> {
    // SAFETY: `fd` is the open vhost-user socket the caller holds for the
    // whole call; it is only borrowed here to be duplicated.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    watchdog::Watchdog::arm(borrowed.try_clone_to_owned()?, VHOST_USER_TIMEOUT)
}

impl VhostUserFs {
    /// Connects to the daemon, negotiates protocol features and, with DAX,
    /// reserves the window; the window gets its guest address later
    /// (`VirtioDevice::set_shm_base`).
    pub fn connect(cfg: &FsDeviceConfig) -> Result<Self, FsError> {
        let id = cfg.id.as_str();
        let connect_err = |e| FsError::Connect {
            id: id.into(),
            socket: cfg.socket.clone(),
            source: vhost::vhost_user::Error::SocketConnect(e).into(),
        };
        let stream = std::os::unix::net::UnixStream::connect(&cfg.socket).map_err(connect_err)?;
        let dog = arm_watchdog(stream.as_raw_fd()).map_err(connect_err)?;
        let result = Self::handshake(
            cfg,
            Frontend::from_stream(stream, u64::from(cfg.num_request_queues) + 1),
        );
        if dog.fired() {
            return Err(FsError::Timeout {
                id: id.into(),
                during: match result {
                    Err(e) => e.to_string(),
                    Ok(_) => "the handshake".into(),
                },
            });
        }
        result
    }

    /// [`Self::connect`] for a restore: the operator starts a fresh daemon
    /// on the same socket path, maybe after this process, so the socket is
    /// tried every [`CONNECT_RETRY`] for up to `patience` (Cloud Hypervisor
    /// waits 60 s).
    pub fn connect_retrying(
        cfg: &FsDeviceConfig,
        patience: std::time::Duration,
    ) -> Result<Self, FsError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match Self::connect(cfg) {
                Err(FsError::Connect { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(CONNECT_RETRY);
                }
                other => return other,
            }
        }
    }

    /// The handshake on a fresh connection: owner, features, protocol
    /// features, shared memory, the backend request channel.
    fn handshake(cfg: &FsDeviceConfig, mut frontend: Frontend) -> Result<Self, FsError> {
        let id = cfg.id.as_str();
        let total_queues = usize::from(cfg.num_request_queues) + 1;
        let (backend_features, protocol) = negotiate(cfg, &mut frontend)?;
        let (window, requests) = if cfg.dax {
            let (window, requests) = open_dax_window(cfg, &mut frontend, protocol)?;
            (Some(window), Some(requests))
        } else {
            (None, None)
        };
        tracing::info!(
            "fs {id}: daemon at {} (features {backend_features:#x}, protocol {protocol:?}){}",
            cfg.socket.display(),
            window.as_ref().map_or(String::new(), |w| format!(
                ", DAX window {} MiB",
                w.size() >> 20
            ))
        );
        Ok(VhostUserFs {
            id: id.to_string(),
            config_space: config_space(&cfg.tag, cfg.num_request_queues),
            queue_sizes: vec![cfg.queue_size; total_queues],
            frontend,
            mem_slots: protocol.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS),
            reply_ack: protocol.contains(VhostUserProtocolFeatures::REPLY_ACK),
            backend_features,
            acked: AckedFeatures::default(),
            window,
            window_guest_addr: 0,
            requests,
            failed: Arc::new(AtomicBool::new(false)),
            queue_error: Arc::new(AtomicBool::new(false)),
            worker: None,
            active_queues: 0,
            socket: cfg.socket.clone(),
            protocol,
            activation: None,
            paused: None,
            restored: false,
            window_files: None,
            features_in_use: Arc::new(AtomicU64::new(0)),
            dirty_log: Arc::new(Mutex::new(None)),
        })
    }

    pub fn window(&self) -> Option<&Arc<DaxWindow>> {
        self.window.as_ref()
    }

    /// What the VMM uses to give the daemon RAM added while the guest runs.
    pub fn daemon_memory(&self) -> memory_table::DaemonMemory {
        memory_table::DaemonMemory::new(
            &self.id,
            self.frontend.clone(),
            self.mem_slots,
            self.reply_ack,
            self.failed.clone(),
            self.backend_features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0
                && self.protocol.contains(VhostUserProtocolFeatures::LOG_SHMFD),
            self.features_in_use.clone(),
            self.dirty_log.clone(),
        )
    }

    /// The flag [`Self::failed`] reads, for whoever reports on the device.
    pub fn failed_flag(&self) -> Arc<AtomicBool> {
        self.failed.clone()
    }

    /// True once the daemon has gone away.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn stop_worker(&mut self) {
        // Dropping the thread stops and joins it.
        self.worker = None;
    }

    /// Hands the daemon guest RAM and the rings. Each queue's used-buffer
    /// notifications go straight to the transport's irqfd when it has one
    /// (virtio-PCI with MSI-X); otherwise to an eventfd the device's worker
    /// relays through `trigger` — returned as (queue index, eventfd), with
    /// every queue's error eventfd (SET_VRING_ERR), which the worker watches.
    #[allow(clippy::type_complexity)]
    fn setup_rings(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &[ActivatedQueue],
        interrupt: &dyn VirtioInterrupt,
    ) -> Result<(Vec<(u16, EventFd)>, Vec<(u16, EventFd)>), ActivateError> {
        let id = self.id.clone();
        let err = |request: &'static str, source: vhost::Error| ActivateError::VhostUser {
            device: format!("fs {id}"),
            request,
            source,
        };
        let features = self.acked.bits()
            | (self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        // A guest that resets and activates the device again while a
        // migration logs (a driver reload, a reboot) must not stop the
        // daemon's log: LOG_ALL stays on, and the log base is sent again
        // after the new memory table (whose regions the daemon would
        // otherwise write unlogged).
        let logging = self
            .dirty_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let log_all = if logging {
            VhostUserVirtioFeatures::LOG_ALL.bits()
        } else {
            0
        };
        self.frontend
            .set_features(features | log_all)
            .map_err(|e| err("SET_FEATURES", e))?;
        self.features_in_use.store(features, Ordering::SeqCst);
        memory_table::send_memory_table(&id, &mut self.frontend, self.mem_slots, mem)
            .map_err(|e| ActivateError::Fs(Box::new(e)))?;
        if logging {
            self.daemon_memory()
                .resend_log_base(&mut self.frontend)
                .map_err(|e| ActivateError::Fs(Box::new(e)))?;
        }
        let hva = |addr: GuestAddress, ring: &'static str| {
            mem.get_host_address(addr)
                .map(|p| p as u64)
                .map_err(|source| ActivateError::RingAddress {
                    device: format!("fs {id}"),
                    ring,
                    addr: addr.0,
                    source,
                })
        };
        let mut relayed = Vec::new();
        let mut errors = Vec::new();
        for q in queues {
            let i = usize::from(q.index);
            let queue = &q.queue;
            let ring = VringConfigData {
                queue_max_size: queue.max_size(),
                queue_size: queue.size(),
                flags: 0,
                desc_table_addr: hva(GuestAddress(queue.desc_table()), "descriptor table")?,
                used_ring_addr: hva(GuestAddress(queue.used_ring()), "used ring")?,
                avail_ring_addr: hva(GuestAddress(queue.avail_ring()), "available ring")?,
                log_addr: None,
            };
            self.frontend
                .set_vring_num(i, queue.size())
                .map_err(|e| err("SET_VRING_NUM", e))?;
            self.frontend
                .set_vring_addr(i, &ring)
                .map_err(|e| err("SET_VRING_ADDR", e))?;
            self.frontend
                .set_vring_base(i, queue.next_avail())
                .map_err(|e| err("SET_VRING_BASE", e))?;
            match interrupt.notifier(Interrupt::Queue(q.index)) {
                Some(irqfd) => self
                    .frontend
                    .set_vring_call(i, &irqfd)
                    .map_err(|e| err("SET_VRING_CALL", e))?,
                None => {
                    let call = EventFd::new(libc::EFD_NONBLOCK)?;
                    self.frontend
                        .set_vring_call(i, &call)
                        .map_err(|e| err("SET_VRING_CALL", e))?;
                    relayed.push((q.index, call));
                }
            }
            self.frontend
                .set_vring_kick(i, &q.kick)
                .map_err(|e| err("SET_VRING_KICK", e))?;
            let error = EventFd::new(libc::EFD_NONBLOCK)?;
            self.frontend
                .set_vring_err(i, &error)
                .map_err(|e| err("SET_VRING_ERR", e))?;
            errors.push((q.index, error));
        }
        for q in queues {
            self.frontend
                .set_vring_enable(usize::from(q.index), true)
                .map_err(|e| err("SET_VRING_ENABLE", e))?;
        }
        crate::info_limited!(
            "fs {}: queue interrupts: {} straight from the daemon (irqfd), {} relayed by the VMM",
            self.id,
            queues.len() - relayed.len(),
            relayed.len()
        );
        Ok((relayed, errors))
    }
}

impl VirtioDevice for VhostUserFs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        self.backend_features & PASSTHROUGH_FEATURES
    }

    fn ack_features(&mut self, features: u64) {
        self.acked.ack(self.features(), features);
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.failed() {
            return Err(ActivateError::BackendGone {
                device: format!("fs {}", self.id),
                why: "the daemon has gone away",
            });
        }
        let dog = arm_watchdog(self.frontend.as_raw_fd())?;
        let rings = self.setup_rings(&mem.memory(), &queues, interrupt.as_ref());
        if dog.fired() {
            self.failed.store(true, Ordering::SeqCst);
            return Err(ActivateError::Fs(Box::new(FsError::Timeout {
                id: self.id.clone(),
                during: "activation".into(),
            })));
        }
        drop(dog);
        let (calls, errors) = rings?;
        self.queue_error.store(false, Ordering::SeqCst);
        self.active_queues = queues.len();
        let mut kept = Vec::with_capacity(queues.len());
        for q in &queues {
            let layout = state::QueueLayout {
                index: q.index,
                queue: crate::device_state::SavedQueue::from(q.queue.state()),
            };
            kept.push((layout, q.kick.try_clone()?));
        }
        if std::mem::take(&mut self.restored) {
            // The daemon serves what the rings hold now, not at the next kick.
            for q in &queues {
                q.kick.write(1)?;
            }
        }
        self.activation = Some(state::Activation {
            mem,
            interrupt: interrupt.clone(),
            queues: kept,
        });
        self.paused = None;
        let thread = worker::spawn(worker::WorkerContext {
            id: self.id.clone(),
            interrupt,
            calls,
            errors,
            queue_error: self.queue_error.clone(),
            requests: self.requests.clone(),
            window: self.window.clone(),
            failed: self.failed.clone(),
            main_socket: self.frontend.as_raw_fd(),
        })?;
        self.worker = Some(thread);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        // GET_VRING_BASE stops each ring in the daemon before it is forgotten.
        if !self.failed() {
            let dog = arm_watchdog(self.frontend.as_raw_fd());
            for i in 0..self.active_queues {
                if let Err(e) = self.frontend.get_vring_base(i) {
                    crate::warn_limited!("fs {}: stopping queue {i}: {e}", self.id);
                }
            }
            if dog.is_ok_and(|d| d.fired()) {
                crate::error_limited!(
                    "fs {}: the daemon did not answer the reset within {}s; the device is failed",
                    self.id,
                    VHOST_USER_TIMEOUT.as_secs()
                );
                self.failed.store(true, Ordering::SeqCst);
            }
        }
        self.stop_worker();
        if let Some(w) = &self.window {
            w.clear();
        }
        self.active_queues = 0;
        self.activation = None;
        self.paused = None;
        self.acked.reset();
        self.queue_error.store(false, Ordering::SeqCst);
        true
    }

    fn needs_reset(&self) -> bool {
        self.queue_error.load(Ordering::SeqCst)
    }

    fn set_shm_base(&mut self, base: u64) {
        self.window_guest_addr = base;
        if let Some(w) = &self.window {
            w.set_guest_base(base);
        }
    }

    fn state_name(&self) -> String {
        self.state_name_of()
    }

    /// GET_VRING_BASE on each active queue (the daemon stops the ring once
    /// every chain it took is answered).
    fn pause(&mut self) -> Result<Vec<crate::device_state::SavedQueue>, DeviceStateError> {
        self.pause_rings()
    }

    fn resume(&mut self) -> Result<(), DeviceStateError> {
        self.resume_rings()
    }

    /// The features, config, ring bases, the daemon's state
    /// (SET_DEVICE_STATE_FD) and the window's record; see [`state`].
    fn save_state(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        self.save()
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        self.restore(state)
    }

    fn check_movable(&self) -> Result<(), DeviceStateError> {
        self.movable()
    }

    fn release_backend(&mut self) {
        self.release_daemon();
    }

    fn shm_regions(&self) -> Vec<SharedMemoryRegion> {
        self.window
            .iter()
            .map(|w| SharedMemoryRegion {
                id: DAX_SHM_REGION_ID,
                guest_addr: self.window_guest_addr,
                len: w.size(),
                host_addr: w.host_addr(),
            })
            .collect()
    }
}

impl Drop for VhostUserFs {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// Every live DAX window of the process, for the vCPUs' memory-fault path:
/// a vCPU that KVM could not fault a page in for holds no device, only a
/// guest-physical address (or, on kernels without
/// `KVM_CAP_MEMORY_FAULT_INFO`, not even that).
static WINDOWS: std::sync::Mutex<Vec<std::sync::Weak<DaxWindow>>> =
    std::sync::Mutex::new(Vec::new());

/// The handshake's first part: takes ownership of the daemon, and agrees
/// on features and protocol features (those dax=on needs, refused if the
/// daemon lacks them) and on the number of queues. Returns the daemon's
/// features and the protocol features in use.
fn negotiate(
    cfg: &FsDeviceConfig,
    frontend: &mut Frontend,
) -> Result<(u64, VhostUserProtocolFeatures), FsError> {
    let id = cfg.id.as_str();
    let total_queues = usize::from(cfg.num_request_queues) + 1;
    step(id, "SET_OWNER", frontend.set_owner())?;
    let backend_features = step(id, "GET_FEATURES", frontend.get_features())?;
    if backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
        return Err(FsError::Missing {
            id: id.into(),
            what: "VHOST_USER_F_PROTOCOL_FEATURES".into(),
        });
    }
    let offered = step(
        id,
        "GET_PROTOCOL_FEATURES",
        frontend.get_protocol_features(),
    )?;
    let needed = dax_abi::protocol_features(cfg.dax);
    // DEVICE_STATE when the daemon has it: only a snapshot needs it, and
    // `check_movable` refuses one without it. LOG_SHMFD likewise: only a
    // live migration's dirty log needs it (`dirty_log`), and nothing is
    // logged before it sends SET_LOG_BASE.
    let wanted =
        needed | VhostUserProtocolFeatures::DEVICE_STATE | VhostUserProtocolFeatures::LOG_SHMFD;
    if cfg.dax {
        // Only memory slots may be missing: without them the memory
        // table goes whole (SET_MEM_TABLE).
        let missing = (needed - VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS) - offered;
        if !missing.is_empty() {
            return Err(FsError::Missing {
                id: id.into(),
                what: format!(
                    "protocol features {missing:?} needed for dax=on (SHMEM is bit 22, SHMEM_MAP/SHMEM_UNMAP); \
                     use dax=off or a DAX-capable daemon"
                ),
            });
        }
    }
    let protocol = wanted & offered;
    step(
        id,
        "SET_PROTOCOL_FEATURES",
        frontend.set_protocol_features(protocol),
    )?;
    if protocol.contains(VhostUserProtocolFeatures::MQ) {
        let n = step(id, "GET_QUEUE_NUM", frontend.get_queue_num())?;
        if n < total_queues as u64 {
            return Err(FsError::Missing {
                id: id.into(),
                what: format!(
                    "{total_queues} queues (num_queues={} + hiprio); it serves {n} (dax-virtiofsd serves more request queues with --max-request-queues)",
                    cfg.num_request_queues
                ),
            });
        }
    }
    Ok((backend_features, protocol))
}

/// The handshake's dax=on part: the window of the size the daemon declares
/// (GET_SHMEM_CONFIG; a `cache_size` that differs is refused), and the
/// channel its SHMEM_MAP/UNMAP requests come on.
#[allow(clippy::type_complexity)]
fn open_dax_window(
    cfg: &FsDeviceConfig,
    frontend: &mut Frontend,
    protocol: VhostUserProtocolFeatures,
) -> Result<
    (
        Arc<DaxWindow>,
        Arc<Mutex<FrontendReqHandler<DaxRequestHandler>>>,
    ),
    FsError,
> {
    let id = cfg.id.as_str();
    let declared = step(id, "GET_SHMEM_CONFIG", frontend.get_shmem_config())?;
    let theirs = if declared.nregions >= 1 {
        declared.memory_sizes[usize::from(DAX_SHM_REGION_ID)]
    } else {
        0
    };
    if theirs == 0 {
        return Err(FsError::Missing {
            id: id.into(),
            what: "a DAX window in GET_SHMEM_CONFIG (region 0 has size 0)".into(),
        });
    }
    let size = match cfg.cache_size {
        Some(ours) if ours != theirs => {
            return Err(FsError::WindowMismatch {
                id: id.into(),
                ours,
                theirs,
            })
        }
        _ => theirs,
    };
    let window = Arc::new(DaxWindow::new(size).map_err(|source| FsError::Window {
        id: id.into(),
        source,
    })?);
    register_window(&window);
    let handler = DaxRequestHandler::new(id.to_string(), window.clone());
    let mut requests =
        FrontendReqHandler::new(Arc::new(handler)).map_err(|source| FsError::Negotiate {
            id: id.into(),
            step: "backend request channel",
            source: source.into(),
        })?;
    requests.set_reply_ack_flag(protocol.contains(VhostUserProtocolFeatures::REPLY_ACK));
    step(
        id,
        "SET_BACKEND_REQ_FD",
        frontend.set_backend_request_fd(&requests.get_tx_raw_fd()),
    )?;
    Ok((window, Arc::new(Mutex::new(requests))))
}

/// virtio-fs config space: the tag (NUL-padded) and the number of request
/// queues.
fn config_space(tag: &str, num_request_queues: u16) -> Vec<u8> {
    let mut config_space = vec![0u8; TAG_LEN + 4];
    config_space[..tag.len()].copy_from_slice(tag.as_bytes());
    config_space[TAG_LEN..].copy_from_slice(&u32::from(num_request_queues).to_le_bytes());
    config_space
}

fn register_window(window: &Arc<DaxWindow>) {
    let mut windows = WINDOWS.lock().unwrap_or_else(|p| p.into_inner());
    windows.retain(|w| w.strong_count() > 0);
    windows.push(Arc::downgrade(window));
}

/// KVM could not fault in guest memory: resolves the DAX windows' guarded
/// pages and shows the scratch over every DAX page whose file shrank on the
/// host (only in the window holding `gpa`, when KVM said where; see
/// [`DaxWindow::repair_after_fault`]). Returns the bytes repaired; 0 means
/// the fault was not the windows' doing.
pub fn repair_windows_after_fault(gpa: Option<u64>) -> u64 {
    let windows: Vec<Arc<DaxWindow>> = WINDOWS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    windows
        .iter()
        .filter(|w| gpa.is_none_or(|gpa| w.contains_gpa(gpa)))
        .map(|w| w.repair_after_fault(gpa))
        .sum()
}
