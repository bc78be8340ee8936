//! Local migration (the VMM upgrade path), as Cloud Hypervisor's users drive
//! it: `ch-remote receive-migration receiver_url=unix:/PATH` on a new VMM without a VM,
//! then `ch-remote send-migration destination_url=unix:/PATH,local=on` on
//! the old one. Guest RAM is not copied: its memfds are passed over the
//! unix socket and the new VMM maps the same pages.
//!
//! The wire protocol is Cloud Hypervisor's (`vm_state::protocol`); the
//! sequence, sender side in [`send`], receiver side in [`receive`]:
//!
//! ```text
//! Start, MemoryFd ×N, WindowFd ×N, TapFd ×N, DiskFd ×N, [VsockFd] (ours),
//! Config, [source pauses],
//! State, Complete | CompletePaused          (Abandon at any time)
//! ```
//!
//! `Config` carries the VM's configuration and its RAM layout with a
//! format name and version of its own; `State` the same state document a
//! snapshot writes as `state.json` (built by the snapshot module's code).
//! The sender checks that everything can be carried before it pauses the
//! VM, and resumes it on any failure before the receiver took it.

mod bodies;
mod receive;
mod send;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vm_state::protocol::{Command, ProtocolError, Status};

pub use bodies::{
    receive_migration_from_json, send_migration_from_json, BodyError, ReceiveMigration,
    SendMigration,
};
pub use receive::{receive_migration, Received};
pub use send::send_migration;

use crate::memory::migration_fds::MemoryFdError;
use crate::memory::snapshot::MemoryLayoutState;
use crate::snapshot::SnapshotError;

/// `Config`'s format name and version: a receiver refuses others by name.
pub const CONFIG_FORMAT: &str = "dax-vmm";
pub const CONFIG_VERSION: u32 = 1;

/// Longest either side waits for the other's next message or answer once
/// connected (a bound, not an expected time: each step takes little).
pub const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `vm.receive-migration` waits for the sender to connect: Cloud
/// Hypervisor's default migration timeout (`timeout_s`, an hour).
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(3600);

/// `Config`'s payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationConfig {
    pub format: String,
    pub version: u32,
    /// The VM's configuration, as `vm.info` reports it.
    pub vm_config: serde_json::Value,
    /// Where each received memory fd's region lies.
    pub memory: MemoryLayoutState,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("{field}: {url}: only unix:<path> is supported (local migration)")]
    BadUrl { field: &'static str, url: String },
    /// Cloud Hypervisor's words for the same refusal.
    #[error("Local migration requires shared memory or hugepages enabled (guest RAM at {gpa:#x} is private; boot with --memory shared=on)")]
    NotShared { gpa: u64 },
    #[error("the VM cannot be migrated: {0}")]
    NotMovable(#[source] SnapshotError),
    #[error("{}: {what}: {source}", path.display())]
    Socket {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{}: no sender connected within {}s", path.display(), ACCEPT_TIMEOUT.as_secs())]
    AcceptTimeout { path: PathBuf },
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("{0}")]
    MemoryFd(#[from] MemoryFdError),
    #[error("the receiver reported an error at {command:?} (answered {status:?}; see its log)")]
    ReceiverError { command: Command, status: Status },
    #[error("{command:?} was not expected {when}")]
    Unexpected {
        command: Command,
        when: &'static str,
    },
    #[error("{0:?}: this VMM receives local migrations only (memory as fds)")]
    NotLocal(Command),
    #[error("Config: {0}")]
    Config(String),
    #[error("{label}: {reason}")]
    PassedFd { label: String, reason: String },
    #[error("Config: building the VM: {0}")]
    Prepare(#[source] crate::vm::VmError),
    #[error("State: {0}")]
    State(#[source] SnapshotError),
    #[error("saving the VM's state: {0}")]
    Save(#[source] SnapshotError),
    #[error("the sender abandoned the migration")]
    Abandoned,
}

/// The socket path of a `unix:` URL (Cloud Hypervisor strips the scheme
/// and takes the rest as the path).
pub fn unix_path(field: &'static str, url: &str) -> Result<PathBuf, MigrationError> {
    match url.strip_prefix("unix:") {
        Some(path) if !path.is_empty() => Ok(PathBuf::from(path)),
        _ => Err(MigrationError::BadUrl {
            field,
            url: url.to_string(),
        }),
    }
}

#[cfg(test)]
#[path = "migration_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "host_fds_tests.rs"]
mod host_fds_tests;
