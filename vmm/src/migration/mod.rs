//! Migration, as Cloud Hypervisor's users drive it: `ch-remote
//! receive-migration receiver_url=URL` on a new VMM without a VM, then
//! `ch-remote send-migration destination_url=URL[,local=on]` on the old
//! one, over a unix socket or TCP ([`channel`]).
//!
//! A local migration (the VMM upgrade path, `unix:` with `local=on`) does
//! not copy guest RAM: its memfds are passed over the unix socket and the
//! new VMM maps the same pages. Any other is a pre-copy live migration
//! ([`precopy`]): RAM is sent while the guest runs, then the pages written
//! meanwhile, round after round, until what is left fits the downtime
//! target; then the guest is paused and the rest and the state go.
//!
//! The wire protocol is Cloud Hypervisor's (`vm_state::protocol`); the
//! sequences, sender side in [`send`] and [`precopy`], receiver side in
//! [`receive`]:
//!
//! ```text
//! local:    Start, MemoryFd ×N, WindowFd ×N, TapFd ×N, DiskFd ×N, [VsockFd] (ours),
//!           Config, [source pauses], State, Complete | CompletePaused
//! pre-copy: Start, Config, Memory ×N, [source pauses], Memory ×N,
//!           State, Complete | CompletePaused
//!           (Abandon at any time)
//! ```
//!
//! `Config` carries the VM's configuration and its RAM layout with a
//! format name and version of its own; `State` the same state document a
//! snapshot writes as `state.json` (built by the snapshot module's code).
//! The sender checks that everything can be carried before it pauses the
//! VM, and resumes it on any failure before the receiver took it.

mod bodies;
pub mod channel;
mod exchange;
mod precopy;
pub mod ram_stream;
mod receive;
mod send;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use vm_state::protocol::{Command, ProtocolError, Status};

pub use bodies::{
    receive_migration_from_json, send_migration_from_json, BodyError, ReceiveMigration,
    SendMigration,
};
pub use channel::MigrationUrl;
pub use precopy::{PrecopyLimits, TimeoutStrategy, MAX_ROUNDS};
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
    #[error("{field}: {url}: {reason}")]
    BadUrl {
        field: &'static str,
        url: String,
        reason: String,
    },
    /// Cloud Hypervisor's words for the same refusal.
    #[error("Local migration requires shared memory or hugepages enabled (guest RAM at {gpa:#x} is private; boot with --memory shared=on)")]
    NotShared { gpa: u64 },
    #[error("the VM cannot be migrated: {0}")]
    NotMovable(#[source] SnapshotError),
    #[error("{url}: {what}: {source}")]
    Socket {
        url: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{url}: no sender connected within {}s", ACCEPT_TIMEOUT.as_secs())]
    AcceptTimeout { url: String },
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("{0}")]
    MemoryFd(#[from] MemoryFdError),
    #[error("the receiver reported an error at {command:?} (answered {status:?}; see its log)")]
    ReceiverError { command: Command, status: Status },
    /// A receiver of ours says why.
    #[error("the receiver refused {command:?}: {reason}")]
    ReceiverRefused { command: Command, reason: String },
    #[error("{command:?} was not expected {when}")]
    Unexpected {
        command: Command,
        when: &'static str,
    },
    #[error("{0:?}: this VMM does not take it (no post-copy)")]
    NotTaken(Command),
    #[error("guest RAM: {0}")]
    Ram(String),
    #[error("{0}")]
    DirtyLog(#[from] crate::memory::dirty_log::DirtyLogError),
    #[error("{0}")]
    DidNotConverge(String),
    #[error("{0}")]
    NotOverThisChannel(String),

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

#[cfg(test)]
#[path = "migration_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "host_fds_tests.rs"]
mod host_fds_tests;

#[cfg(test)]
#[path = "precopy_tests.rs"]
mod precopy_tests;
