//! Host drains: the operator marks a host as draining in etcd, and its
//! agent moves each selected VM to another host by a live migration.
//!
//! The two agents meet in etcd; each VMM call that answers only when a
//! migration is over runs as a task of its own, which reports to the
//! agent's loop through [`Event`]s, so the loop never waits for one.
//!
//! - The source's agent ([`source`]) reads `<prefix>/drain/<host>`, picks
//!   the VMs its selector matches, one at a time, places each on a
//!   destination ([`doc::place`]) and asks that host for a receiver
//!   (`<prefix>/incoming/<destination>/<vm>`). Once answered it calls
//!   `vm.send-migration` on the VM's VMM, and writes the progress and the
//!   result to `<prefix>/drain-status/<host>/<vm>`.
//! - The destination's agent ([`receive`]) takes a free spare VMM from its
//!   `receive` configuration, calls `vm.receive-migration` on it, answers
//!   with the URL once the spare listens, and when the VM has arrived
//!   adopts the spare as that VM (`<prefix>/adopted/<host>/<vm>`): its
//!   policies then apply there.
//!
//! See docs/fleet.md ("Draining a host").

pub mod doc;
pub mod receive;
pub mod source;

/// What a drain's task reports to the agent's loop.
#[derive(Debug)]
pub enum Event {
    /// Destination side: a spare listens for `vm` at `url` (advertised).
    ReceiverReady { vm: String, url: String },
    /// Destination side: the spare's `vm.receive-migration` for `vm`
    /// answered (or never listened).
    Received {
        vm: String,
        result: Result<(), String>,
    },
    /// Source side: `vm.send-migration` of `vm` answered.
    Sent {
        vm: String,
        result: Result<(), String>,
    },
}

/// Where tasks send their [`Event`]s.
pub type Events = tokio::sync::mpsc::UnboundedSender<Event>;
