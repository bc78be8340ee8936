//! The VMM's REST API: HTTP/1.1 over a unix socket, served by axum on a
//! thread of its own.
//!
//! - `routes`: Cloud Hypervisor's endpoints (`/api/v1/vmm.*`, `/api/v1/vm.*`),
//!   so `ch-remote` works unchanged. Each becomes a [`VmmAction`] sent to the
//!   VMM's control loop, which owns the VM and answers on a oneshot channel.
//! - `dax`: the DAX policy controller, the one owner of each fs device's
//!   desired policy, its generation, the reconcile loop and the client of
//!   the device's daemon (its control socket); the routes call it.
//! - `metrics`: Prometheus metrics from one snapshot; `events`: the event
//!   stream.
//!
//! The crate knows nothing of the VMM's types: bodies travel as JSON values
//! and the VMM checks them with the same code as its command line.

pub mod client;
mod connections;
mod dax;
pub mod events;
mod http1;
mod if_match;
pub mod ignored_fields;
pub mod metrics;
pub mod passed_fds;
mod routes;
pub mod server;

/// The seccomp thread kind of the API thread (see the VMM's `seccomp_filters`).
pub const API_THREAD: &str = "api";

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::oneshot;
use vmm_sys_util::eventfd::EventFd;

pub use control_protocol::WindowLocation;
pub use dax::{DaemonNotice, DaemonNotices};
pub use events::{DaxEvent, EventBus};
pub use metrics::{KvmCounters, WindowStats};
/// The router alone, for the fuzz target (`fuzz/fuzz_targets/api_router.rs`).
#[doc(hidden)]
pub use routes::router;
pub use server::{ApiServer, ServerError};

/// What the API asks of the VMM.
#[derive(Debug)]
pub enum VmmAction {
    ShutdownVmm,
    /// A `vm.create` body (VmConfig JSON).
    Create(Value),
    /// Forgets the configuration (stopping the VM first if it runs).
    Delete,
    Boot,
    Info,
    ShutdownVm,
    Reboot,
    Pause,
    Resume,
    /// ACPI power button press.
    PowerButton,
    /// A `vm.add-fs` body (FsConfig JSON).
    AddFs(Value),
    /// A `vm.add-pmem` body (PmemConfig JSON).
    AddPmem(Value),
    /// A `vm.add-disk` body (DiskConfig JSON).
    AddDisk(Value),
    /// A `vm.add-vsock` body (VsockConfig JSON).
    AddVsock(Value),
    /// A `vm.add-net` body (NetConfig JSON) and the tap fds sent with it
    /// as SCM_RIGHTS (Kata's way; none when the body names a tap).
    AddNet(Value, Vec<std::os::fd::OwnedFd>),
    RemoveDevice(String),
    /// A `vm.resize` body (Cloud Hypervisor's VmResize JSON).
    Resize(Value),
    Counters,
    /// The fs devices, configured or running; with `window_stats`, each window's counters too
    /// (which cost a `mincore` over its mappings).
    DaxStatus {
        window_stats: bool,
    },
    /// KVM's counters for the running VM, if there is one and KVM has them.
    KvmCounters,
    /// A `vm.snapshot` body (Cloud Hypervisor's VmSnapshotConfig JSON).
    Snapshot(Value),
    /// A `vm.restore` body (Cloud Hypervisor's RestoreConfig JSON) and the
    /// fds sent with it as SCM_RIGHTS (ch-remote sends its `net_fds` so).
    Restore(Value, Vec<std::os::fd::OwnedFd>),
    /// A `vm.send-migration` body (Cloud Hypervisor's VmSendMigrationData
    /// JSON); answered when the migration has ended.
    SendMigration(Value),
    /// A `vm.receive-migration` body (Cloud Hypervisor's
    /// VmReceiveMigrationData JSON); answered when the VM has arrived or
    /// the migration failed.
    ReceiveMigration(Value),
}

/// What the VMM knows of one fs device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FsDaxStatus {
    pub id: String,
    pub control_socket: Option<PathBuf>,
    /// None before boot, without DAX, or when not asked for (it costs a
    /// `mincore` over the window's mappings).
    pub window: Option<WindowStats>,
    /// Where the window sits in guest-physical memory (None before boot,
    /// without DAX, or before the transport placed it).
    pub window_location: Option<control_protocol::WindowLocation>,
    /// The daemon went away while the VM ran.
    pub failed: bool,
    /// The policy the device was configured with (`vm.create`,
    /// `vm.add-fs`), normalized: where the API's policy controller starts
    /// the desired one. None without one.
    pub configured_policy: Option<serde_json::Value>,
}

/// The VMM's answer.
#[derive(Debug)]
pub enum VmmReply {
    /// 204.
    NoContent,
    /// 200 with a JSON body.
    Json(Value),
    Dax(Vec<FsDaxStatus>),
    Kvm(Option<KvmCounters>),
}

/// A refused action: the status and a message saying what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: 404,
            message: message.into(),
        }
    }
    /// The request is valid but the VM is in the wrong state for it.
    pub fn conflict(message: impl Into<String>) -> Self {
        ApiError {
            status: 409,
            message: message.into(),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            message: message.into(),
        }
    }
    /// Busy with an earlier request that has not finished: Cloud
    /// Hypervisor's answer to a resize while a vCPU removal waits for the
    /// guest, which Kata retries (and no other failure).
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        ApiError {
            status: 429,
            message: message.into(),
        }
    }
    /// A daemon behind the VMM failed or could not be reached.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        ApiError {
            status: 502,
            message: message.into(),
        }
    }
}

pub type VmmResult = Result<VmmReply, ApiError>;

/// One action on its way to the VMM, with where to answer.
pub struct ApiRequest {
    pub action: VmmAction,
    pub reply: oneshot::Sender<VmmResult>,
}

/// The API's end of the channel to the VMM: requests go in the queue and
/// the eventfd wakes the control loop, which polls it with its other fds.
#[derive(Clone)]
pub struct VmmChannel {
    tx: mpsc::Sender<ApiRequest>,
    wake: Arc<EventFd>,
    /// What the VMM's devices tell their daemons through the API.
    notices: DaemonNotices,
}

/// The VMM's end of the channel.
pub struct VmmReceiver {
    rx: mpsc::Receiver<ApiRequest>,
    wake: Arc<EventFd>,
    notices: DaemonNotices,
}

pub fn vmm_channel() -> std::io::Result<(VmmChannel, VmmReceiver)> {
    let (tx, rx) = mpsc::channel();
    let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?);
    let notices = DaemonNotices::default();
    Ok((
        VmmChannel {
            tx,
            wake: wake.clone(),
            notices: notices.clone(),
        },
        VmmReceiver { rx, wake, notices },
    ))
}

impl VmmChannel {
    /// Sends `action` to the VMM and waits for its answer.
    pub async fn call(&self, action: VmmAction) -> VmmResult {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(ApiRequest { action, reply })
            .map_err(|_| ApiError::internal("the VMM is shutting down"))?;
        // A full counter already means "wake up".
        let _ = self.wake.write(1);
        answer
            .await
            .map_err(|_| ApiError::internal("the VMM dropped the request"))?
    }

    /// The notices the VMM's devices left for their daemons.
    pub(crate) fn notices(&self) -> &DaemonNotices {
        &self.notices
    }
}

impl VmmReceiver {
    /// Polled by the control loop: readable when requests are queued.
    pub fn eventfd(&self) -> &EventFd {
        &self.wake
    }

    /// The queued requests, oldest first.
    pub fn drain(&self) -> Vec<ApiRequest> {
        let _ = self.wake.read();
        self.rx.try_iter().collect()
    }

    /// Where the VMM's devices leave notices for their daemons (the API's
    /// policy controller delivers them).
    pub fn notices(&self) -> DaemonNotices {
        self.notices.clone()
    }
}
