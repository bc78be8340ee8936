//! The sender's requests that expect one answer each, shared by a local
//! migration ([`super::send`]) and a pre-copy ([`super::precopy`]).

use std::io::Write;

use vm_state::protocol::{Command, Request, Response, Status};

use super::channel::Channel;
use super::{MigrationConfig, MigrationError, CONFIG_FORMAT, CONFIG_VERSION};
use crate::config::json::vm_config_to_json;
use crate::config::VmConfig;
use crate::memory::snapshot::MemoryLayoutState;
use crate::snapshot::{state_error, MEMORY_SECTION};
use crate::step_times::StepTimes;
use vm_state::StateDocument;

/// Tells a receiver still listening that this is over; it may be gone
/// already, which is no further error.
pub(super) fn abandon(channel: &Channel) {
    let _ = Request::new(Command::Abandon, 0).and_then(|r| r.write_to(&mut &*channel));
}

/// `Config`: the VM's configuration and RAM layout.
pub(super) fn send_config(
    channel: &Channel,
    config: &VmConfig,
    layout: &MemoryLayoutState,
) -> Result<(), MigrationError> {
    let payload = MigrationConfig {
        format: CONFIG_FORMAT.to_string(),
        version: CONFIG_VERSION,
        vm_config: vm_config_to_json(config),
        memory: layout.clone(),
    };
    let payload =
        serde_json::to_vec(&payload).map_err(|e| MigrationError::Config(e.to_string()))?;
    send_payload(channel, Command::Config, &payload)
}

/// The switch's last steps, the guest paused: `State` (the document
/// with the memory section `layout`, encoded compact), then `Complete`
/// or `CompletePaused`; each step timed into `downtime`. Returns the
/// State's size.
pub(super) fn send_state_and_complete(
    channel: &Channel,
    mut doc: StateDocument,
    layout: &MemoryLayoutState,
    was_paused: bool,
    downtime: &mut StepTimes,
) -> Result<usize, MigrationError> {
    doc.put(MEMORY_SECTION, layout)
        .map_err(|e| MigrationError::Save(state_error(e)))?;
    let state = doc
        .to_compact_json()
        .map_err(|e| MigrationError::Save(state_error(e)))?;
    downtime.step("encode");
    send_payload(channel, Command::State, &state)?;
    downtime.step("receiver restored");
    complete(channel, was_paused)?;
    downtime.step("receiver resumed");
    Ok(state.len())
}

/// `Complete` (the receiver resumes the VM) or `CompletePaused`.
pub(super) fn complete(channel: &Channel, was_paused: bool) -> Result<(), MigrationError> {
    let complete = if was_paused {
        Command::CompletePaused
    } else {
        Command::Complete
    };
    Request::new(complete, 0)?.write_to(&mut &*channel)?;
    expect_ok(channel, complete)
}

pub(super) fn send_payload(
    channel: &Channel,
    command: Command,
    payload: &[u8],
) -> Result<(), MigrationError> {
    let length = u64::try_from(payload.len()).unwrap_or(u64::MAX);
    Request::new(command, length)?.write_to(&mut &*channel)?;
    (&*channel)
        .write_all(payload)
        .map_err(vm_state::protocol::ProtocolError::Io)?;
    expect_ok(channel, command)
}

/// The receiver's answer to `command`: Ok, or the error that it was not.
pub(super) fn expect_ok(channel: &Channel, command: Command) -> Result<(), MigrationError> {
    let response = Response::read_from(&mut &*channel)?;
    match response.status() {
        Status::Ok if response.length() == 0 => Ok(()),
        status => match response.read_reason(&mut &*channel)? {
            Some(reason) => {
                // Our receiver's reasons name the step already.
                let prefix = format!("{command:?}: ");
                let reason = reason
                    .strip_prefix(&prefix)
                    .map(str::to_string)
                    .unwrap_or(reason);
                Err(MigrationError::ReceiverRefused { command, reason })
            }
            None => Err(MigrationError::ReceiverError { command, status }),
        },
    }
}
