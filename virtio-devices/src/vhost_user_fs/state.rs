//! Snapshot and restore of a vhost-user-fs device, with its DAX window
//! kept alive, in Cloud Hypervisor's model: the daemon's own state moves
//! through `SET_DEVICE_STATE_FD` / `CHECK_DEVICE_STATE`, the rings stop with
//! `GET_VRING_BASE` and start again from the bases it gave.
//!
//! The window's contents are the host's page cache and are never saved:
//! the state carries the window's guest base, its size and its record
//! (what file range is mapped where, [`WindowRecord`]). On restore the new
//! daemon maps its record again through the backend request channel, which
//! this side serves while the load runs; the window must then equal the
//! saved record exactly, or the restore fails naming the first difference.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vm_state::SectionState;
use vmm_sys_util::eventfd::EventFd;

use super::file_watch::FileKey;
use super::window::record::WindowRecord;
use super::{arm_watchdog, VhostUserFs, VHOST_USER_TIMEOUT};
use crate::device_state::{invalid, DeviceStateError, SavedQueue, StateFields};

/// The largest daemon state a save reads (the daemon's own cap is the same).
pub const MAX_BACKEND_STATE: usize = 64 << 20;

/// The window's part of the saved state: where the guest saw it and what
/// was mapped in it (as a `vm-state` section: kind, version, state).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedWindow {
    pub guest_base: u64,
    pub size: u64,
    pub record: WindowSection,
}

/// A [`WindowRecord`] in its `vm-state` envelope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowSection {
    pub kind: String,
    pub version: u32,
    pub state: WindowRecord,
}

impl WindowSection {
    fn of(record: WindowRecord) -> Self {
        WindowSection {
            kind: WindowRecord::KIND.to_string(),
            version: WindowRecord::VERSION,
            state: record,
        }
    }
}

/// Why the daemon's side of a save or a restore failed; shown inside a
/// [`DeviceStateError`] naming the device.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("vhost-user {step}: {source}")]
    Vhost {
        step: &'static str,
        source: vhost::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the daemon's state is longer than the limit of {MAX_BACKEND_STATE} bytes")]
    TooLarge,
    #[error("the daemon did not answer within {}s", VHOST_USER_TIMEOUT.as_secs())]
    Timeout,
    /// The daemon refused the state and wrote back why (ours does).
    #[error("{reason}")]
    Refused { reason: String },
}

/// Bytes of a daemon's refusal read back at most.
const MAX_REFUSAL_BYTES: u64 = 1024;

/// What a daemon that refused a LOAD wrote back on the state socket
/// before its CHECK_DEVICE_STATE answer: at most [`MAX_REFUSAL_BYTES`],
/// waiting at most a second, printable characters only (it goes into
/// logs and API answers). None when it wrote nothing.
fn refusal_reason(socket: &UnixStream) -> Option<String> {
    use std::io::Read;
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(1)))
        .ok()?;
    let mut bytes = Vec::new();
    // A read error (the daemon closed without a word, or waited past
    // the bound) leaves what came before.
    let _ = socket.take(MAX_REFUSAL_BYTES).read_to_end(&mut bytes);
    vm_state::protocol::printable_reason(&bytes)
}

fn vhost<T>(step: &'static str, r: vhost::Result<T>) -> Result<T, TransferError> {
    r.map_err(|source| TransferError::Vhost { step, source })
}

fn io<T>(what: &'static str, r: std::io::Result<T>) -> Result<T, TransferError> {
    r.map_err(|source| TransferError::Io { what, source })
}

impl VhostUserFs {
    pub(super) fn state_error(&self, reason: impl std::fmt::Display) -> DeviceStateError {
        DeviceStateError::Pause {
            device: self.state_name_of(),
            reason: reason.to_string(),
        }
    }

    pub(super) fn state_name_of(&self) -> String {
        self.id.clone()
    }

    /// Whether the daemon can hand its state over (it acked DEVICE_STATE).
    pub(super) fn movable(&self) -> Result<(), DeviceStateError> {
        if self
            .protocol
            .contains(VhostUserProtocolFeatures::DEVICE_STATE)
        {
            return Ok(());
        }
        Err(DeviceStateError::NotMovable {
            device: self.id.clone(),
            reason: format!(
                "its daemon at {} cannot hand over its state (vhost-user DEVICE_STATE not offered)",
                self.socket.display()
            ),
        })
    }

    /// GET_VRING_BASE on every active queue: the daemon stops the ring
    /// (after answering what it took) and gives its next available index.
    /// The worker stops too; the window stays mapped.
    pub(super) fn pause_rings(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        if let Some(paused) = &self.paused {
            return Ok(paused.clone());
        }
        let Some(activation) = &self.activation else {
            return Ok(Vec::new());
        };
        let dog = arm_watchdog(self.frontend.as_raw_fd()).map_err(|e| self.state_error(e))?;
        let mut saved = Vec::with_capacity(activation.queues.len());
        for (layout, _) in &activation.queues {
            let i = usize::from(layout.index);
            let base = self
                .frontend
                .get_vring_base(i)
                .map_err(|e| self.state_error(format!("GET_VRING_BASE of queue {i}: {e}")))?;
            // The daemon answered every chain it took before it answered:
            // used caught up with available.
            let next = u16::try_from(base & 0xffff).unwrap_or(0);
            saved.push(SavedQueue {
                next_avail: next,
                next_used: next,
                ..layout.queue
            });
        }
        if dog.fired() {
            self.failed.store(true, Ordering::SeqCst);
            return Err(self.state_error(TransferError::Timeout));
        }
        drop(dog);
        self.stop_worker();
        self.paused = Some(saved.clone());
        Ok(saved)
    }

    /// The rings again from where [`Self::pause_rings`] stopped them.
    pub(super) fn resume_rings(&mut self) -> Result<(), DeviceStateError> {
        let Some(paused) = self.paused.take() else {
            return Ok(());
        };
        let Some(activation) = self.activation.take() else {
            return Ok(());
        };
        let queues = activation
            .restart(&paused)
            .map_err(|e| self.state_error(e))?;
        use crate::device::VirtioDevice;
        self.activate(activation.mem, activation.interrupt, queues)
            .map_err(|e| self.state_error(e))
    }

    /// SET_DEVICE_STATE_FD(SAVE): the daemon's blob, read to EOF (at most
    /// [`MAX_BACKEND_STATE`], bounded by the vhost-user watchdog), then
    /// CHECK_DEVICE_STATE.
    fn save_backend_state(&mut self) -> Result<Vec<u8>, TransferError> {
        let dog = io(
            "arming the watchdog",
            arm_watchdog(self.frontend.as_raw_fd()),
        )?;
        let result = (|| {
            let (ours, theirs) = io("socket pair", UnixStream::pair())?;
            io(
                "read timeout",
                ours.set_read_timeout(Some(VHOST_USER_TIMEOUT)),
            )?;
            let own = vhost(
                "SET_DEVICE_STATE_FD(SAVE)",
                self.frontend.set_device_state_fd(
                    VhostTransferStateDirection::SAVE,
                    VhostTransferStatePhase::STOPPED,
                    OwnedFd::from(theirs),
                ),
            )?;
            let reader: Box<dyn Read> = match own {
                Some(file) => Box::new(file),
                None => Box::new(ours),
            };
            let mut blob = Vec::new();
            let cap = u64::try_from(MAX_BACKEND_STATE).unwrap_or(u64::MAX);
            io(
                "reading the daemon's state",
                reader.take(cap.saturating_add(1)).read_to_end(&mut blob),
            )?;
            if blob.len() > MAX_BACKEND_STATE {
                return Err(TransferError::TooLarge);
            }
            vhost("CHECK_DEVICE_STATE", self.frontend.check_device_state())?;
            Ok(blob)
        })();
        if dog.fired() {
            self.failed.store(true, Ordering::SeqCst);
            return Err(TransferError::Timeout);
        }
        result
    }

    /// While paused: CH's `VhostUserState` shape plus the window.
    pub(super) fn save(&mut self) -> Result<serde_json::Value, DeviceStateError> {
        self.movable()?;
        if self.activation.is_some() && self.paused.is_none() {
            return Err(self.state_error("save_state before pause"));
        }
        let backend_state = self.save_backend_state().map_err(|e| {
            self.state_error(format!(
                "the daemon refused to save its state (see its log): {e}"
            ))
        })?;
        let state = FsState {
            acked_features: self.acked.bits(),
            acked_protocol_features: self.protocol.bits(),
            config: self.config_space.clone(),
            num_queues: self.queue_sizes.len(),
            vring_bases: self
                .paused
                .iter()
                .flatten()
                .map(|q| u64::from(q.next_avail))
                .collect(),
            backend_state,
            window: self.window.as_ref().map(|w| SavedWindow {
                guest_base: self.window_guest_addr,
                size: w.size(),
                record: WindowSection::of(w.mappings()),
            }),
        };
        serde_json::to_value(state).map_err(|e| self.state_error(e))
    }

    /// On a device just connected to a fresh daemon (same configuration):
    /// takes back the saved features, hands the daemon its state while
    /// serving its SHMEM_MAPs, and checks the window is the saved one.
    /// A local migration's receiver: the files the sender's window had
    /// mapped, by (dev, ino), for [`Self::restore`] to map the window again
    /// from (each through the window's checks) before the daemon replays.
    pub fn set_window_files(&mut self, files: std::collections::HashMap<FileKey, std::fs::File>) {
        self.window_files = Some(files);
    }

    /// A local migration's source, once the state is sent: the worker
    /// stops and the connection to the daemon is shut down, so the daemon
    /// (which serves one VMM) exits and a fresh one on the same socket
    /// path can serve the receiving VMM, as in Cloud Hypervisor. The
    /// window stays mapped here until this process exits: the guest's
    /// pages are the files', not this process's.
    pub(super) fn release_daemon(&mut self) {
        self.stop_worker();
        // SAFETY: shutdown(2) on the frontend's socket, which it owns and
        // keeps open; later requests on it fail with an error, no fd is
        // closed or reused.
        if unsafe { libc::shutdown(self.frontend.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
            tracing::warn!(
                "fs {}: shutting down the connection to its daemon: {}",
                self.id,
                std::io::Error::last_os_error()
            );
        }
    }

    pub(super) fn restore(&mut self, state: &serde_json::Value) -> Result<(), DeviceStateError> {
        self.movable()?;
        if self.activation.is_some() {
            return Err(self.state_error(
                "restore_state on an activated device (it takes a freshly connected one)",
            ));
        }
        let id = self.id.clone();
        let mut fields = StateFields::new(&id, state)?;
        let acked: u64 = fields.take("acked_features")?;
        let protocol: u64 = fields.take("acked_protocol_features")?;
        let config: Vec<u8> = fields.take("config")?;
        let num_queues: usize = fields.take("num_queues")?;
        let vring_bases: Vec<u64> = fields.take("vring_bases")?;
        let backend_state: Vec<u8> = fields.take("backend_state")?;
        let window: Option<SavedWindow> = fields.take("window")?;
        fields.finish()?;
        let bad = |field: &str, reason: String| invalid(&id, field, reason);
        if protocol != self.protocol.bits() {
            return Err(bad(
                "acked_protocol_features",
                format!(
                    "{protocol:#x}, the new daemon agreed on {:#x}",
                    self.protocol.bits()
                ),
            ));
        }
        if config != self.config_space {
            return Err(bad(
                "config",
                "the tag or the queue count differ from the configuration's".into(),
            ));
        }
        if num_queues != self.queue_sizes.len() {
            return Err(bad(
                "num_queues",
                format!("{num_queues}, configured {}", self.queue_sizes.len()),
            ));
        }
        if vring_bases.len() > num_queues {
            return Err(bad(
                "vring_bases",
                format!("{} entries for {num_queues} queues", vring_bases.len()),
            ));
        }
        if acked & !self.features_offered() != 0 {
            return Err(bad(
                "acked_features",
                format!(
                    "{acked:#x} has bits the new daemon does not offer ({:#x})",
                    self.features_offered()
                ),
            ));
        }
        let window = match (&self.window, window) {
            (None, None) => None,
            (Some(w), Some(saved)) => {
                if saved.size != w.size() || saved.record.state.size != w.size() {
                    return Err(bad(
                        "window.size",
                        format!(
                            "{:#x}, the new daemon declares {:#x} (GET_SHMEM_CONFIG)",
                            saved.size,
                            w.size()
                        ),
                    ));
                }
                if saved.record.kind != WindowRecord::KIND
                    || saved.record.version != WindowRecord::VERSION
                {
                    return Err(bad(
                        "window.record",
                        format!(
                            "a {} section of version {}, expected {} version {}",
                            saved.record.kind,
                            saved.record.version,
                            WindowRecord::KIND,
                            WindowRecord::VERSION
                        ),
                    ));
                }
                Some((w.clone(), saved))
            }
            (ours, _) => {
                return Err(bad(
                    "window",
                    format!(
                        "saved {} DAX window, configured {}",
                        if ours.is_some() {
                            "without a"
                        } else {
                            "with a"
                        },
                        if ours.is_some() { "dax=on" } else { "dax=off" }
                    ),
                ))
            }
        };
        let mut acked_features = crate::device::AckedFeatures::default();
        acked_features.ack(self.features_offered(), acked);
        if let Some((w, saved)) = &window {
            self.window_guest_addr = saved.guest_base;
            w.set_guest_base(saved.guest_base);
            // A local migration passed the mapped files: the window is
            // mapped again from them, through the same checks as any map,
            // and the daemon's replay below then finds each range in place.
            if let Some(files) = self.window_files.take() {
                if let Err(e) = w.replay(&saved.record.state, &files) {
                    w.clear();
                    return Err(invalid(&id, "window.record", e));
                }
            }
            w.set_replaying(true);
        }
        let loaded = self.load_backend_state(acked_features.bits(), &backend_state);
        let verified = loaded
            .map_err(|e| {
                invalid(
                    &id,
                    "backend_state",
                    format!(
                        "the daemon at {} refused the saved state: {e}",
                        self.socket.display()
                    ),
                )
            })
            .and_then(|()| match &window {
                Some((w, saved)) => w
                    .verify(&saved.record.state)
                    .map_err(|e| invalid(&id, "window.record", e)),
                None => Ok(()),
            });
        if let Some((w, _)) = &window {
            w.set_replaying(false);
            if verified.is_err() {
                w.clear();
            }
        }
        verified?;
        self.acked = acked_features;
        self.restored = true;
        Ok(())
    }

    /// SET_FEATURES with the saved `acked` ones, SET_DEVICE_STATE_FD(LOAD), the
    /// blob written and closed, CHECK_DEVICE_STATE; the backend request
    /// channel is served meanwhile (the daemon maps its record again).
    fn load_backend_state(&mut self, acked: u64, blob: &[u8]) -> Result<(), TransferError> {
        let dog = io(
            "arming the watchdog",
            arm_watchdog(self.frontend.as_raw_fd()),
        )?;
        // Wakes the server at once when the load is over: the guest of an
        // incoming migration is paused until then.
        let stop = Arc::new(io(
            "the server's stop eventfd",
            EventFd::new(libc::EFD_NONBLOCK),
        )?);
        let server = self.requests.clone().map(|requests| {
            let (id, stop, window) = (self.id.clone(), stop.clone(), self.window.clone());
            std::thread::spawn(move || serve_requests_until(&id, &requests, window, &stop))
        });
        let result = (|| {
            let features =
                acked | (self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
            vhost("SET_FEATURES", self.frontend.set_features(features))?;
            let (mut ours, theirs) = io("socket pair", UnixStream::pair())?;
            io(
                "write timeout",
                ours.set_write_timeout(Some(VHOST_USER_TIMEOUT)),
            )?;
            let own = vhost(
                "SET_DEVICE_STATE_FD(LOAD)",
                self.frontend.set_device_state_fd(
                    VhostTransferStateDirection::LOAD,
                    VhostTransferStatePhase::STOPPED,
                    OwnedFd::from(theirs),
                ),
            )?;
            match own {
                Some(mut file) => io("writing the state", file.write_all(blob))?,
                None => io("writing the state", ours.write_all(blob))?,
            }
            // The end of the blob; the socket stays open for the reason a
            // daemon that refuses it writes back.
            io(
                "closing the state",
                ours.shutdown(std::net::Shutdown::Write),
            )?;
            vhost("CHECK_DEVICE_STATE", self.frontend.check_device_state()).map_err(|e| {
                match refusal_reason(&ours) {
                    Some(reason) => TransferError::Refused { reason },
                    None => e,
                }
            })
        })();
        if let Err(e) = stop.write(1) {
            // Never expected of an eventfd; the server then ends on its own
            // once the daemon's side closes or its poll times out.
            tracing::warn!("fs {}: waking the request server: {e}", self.id);
        }
        if let Some(server) = server {
            let _ = server.join();
        }
        if dog.fired() {
            self.failed.store(true, Ordering::SeqCst);
            return Err(TransferError::Timeout);
        }
        result
    }

    fn features_offered(&self) -> u64 {
        use crate::device::VirtioDevice;
        self.features()
    }
}

/// Serves the backend request channel (the daemon's SHMEM_MAPs of its
/// record) until `stop` is written or the channel fails (the daemon
/// closed it), and runs each new range's pre-fault after its ack
/// as the worker does; the device's worker is not running yet.
fn serve_requests_until(
    id: &str,
    requests: &std::sync::Mutex<
        vhost::vhost_user::FrontendReqHandler<super::backend_req::DaxRequestHandler>,
    >,
    window: Option<Arc<super::window::DaxWindow>>,
    stop: &EventFd,
) {
    let fd = requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_raw_fd();
    loop {
        let mut p = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds that outlive the call; the handler keeps fd
        // open and `stop` is borrowed for the whole loop.
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, STOP_POLL_MS) };
        if p[1].revents != 0 {
            return;
        }
        if n <= 0 || p[0].revents == 0 {
            continue;
        }
        let mut r = requests.lock().unwrap_or_else(|p| p.into_inner());
        let served = super::worker::serve_one(
            id,
            &mut r,
            vmm_sys_util::epoll::EventSet::IN,
            VHOST_USER_TIMEOUT,
        );
        drop(r);
        if !served {
            return;
        }
        if let Some(w) = &window {
            w.run_deferred_prefault(&|| readable(fd));
        }
    }
}

/// The request server's poll timeout (it wakes for its stop or a request;
/// this only makes it look again now and then).
const STOP_POLL_MS: i32 = 1000;

/// Whether `fd` has something to read now.
fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd that outlives the call; a zero timeout never blocks.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// What [`VhostUserFs::save`] writes: Cloud Hypervisor's `VhostUserState`
/// fields and the window.
#[derive(Serialize)]
struct FsState {
    acked_features: u64,
    acked_protocol_features: u64,
    config: Vec<u8>,
    num_queues: usize,
    vring_bases: Vec<u64>,
    backend_state: Vec<u8>,
    window: Option<SavedWindow>,
}

/// What an activation was given, kept to set the rings up again after a
/// pause (resume).
pub(super) struct Activation {
    pub mem: vm_memory::GuestMemoryAtomic<crate::GuestMemoryMmap>,
    pub interrupt: Arc<dyn crate::device::VirtioInterrupt>,
    pub queues: Vec<(QueueLayout, vmm_sys_util::eventfd::EventFd)>,
}

pub(super) struct QueueLayout {
    pub index: u16,
    pub queue: SavedQueue,
}

impl Activation {
    /// The queues again, each at the position `paused` gives.
    fn restart(
        &self,
        paused: &[SavedQueue],
    ) -> Result<Vec<crate::device::ActivatedQueue>, DeviceStateError> {
        self.queues
            .iter()
            .zip(paused)
            .map(|((layout, kick), saved)| {
                Ok(crate::device::ActivatedQueue {
                    index: layout.index,
                    queue: saved.to_queue()?,
                    kick: kick.try_clone().map_err(|e| DeviceStateError::Pause {
                        device: "fs".into(),
                        reason: e.to_string(),
                    })?,
                })
            })
            .collect()
    }
}
