//! The `vm.send-migration` and `vm.receive-migration` bodies as ch-remote
//! sends them (Cloud Hypervisor's `VmSendMigrationData` and
//! `VmReceiveMigrationData`): every field but the URL has a default, and
//! fields this VMM does not know are ignored, as Cloud Hypervisor's serde
//! structs ignore them. What a local migration cannot honour yet is
//! refused by name.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use super::unix_path;

/// A `vm.send-migration` this VMM carries out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendMigration {
    /// The receiver's unix socket.
    pub path: PathBuf,
}

/// A `vm.receive-migration` this VMM carries out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveMigration {
    /// Where to listen.
    pub path: PathBuf,
}

fn precopy() -> String {
    "Precopy".to_string()
}

fn one() -> u64 {
    1
}

#[derive(Deserialize)]
struct SendBody {
    destination_url: String,
    #[serde(default)]
    local: bool,
    #[serde(default)]
    preserve_source: bool,
    // Read for their types; a local migration's downtime is the pause
    // for the state, whatever they say.
    #[serde(default)]
    #[allow(dead_code)]
    downtime_ms: u64,
    #[serde(default)]
    #[allow(dead_code)]
    timeout_s: u64,
    #[serde(default)]
    #[allow(dead_code)]
    timeout_strategy: Option<String>,
    #[serde(default = "one")]
    connections: u64,
    #[serde(default)]
    tls_dir: Option<PathBuf>,
    #[serde(default = "precopy")]
    memory_mode: String,
}

#[derive(Deserialize)]
struct ReceiveBody {
    receiver_url: String,
    #[serde(default)]
    tls_dir: Option<PathBuf>,
    #[serde(default = "precopy")]
    memory_mode: String,
    #[serde(default)]
    vfio_fds: Option<Value>,
    #[serde(default)]
    iommufd_fd: Option<Value>,
    #[serde(default)]
    zone_updates: Option<Vec<Value>>,
}

/// Why a body is refused: 400, naming the field or option.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("{endpoint}: {0}", endpoint = .1)]
    Parse(String, &'static str),
    #[error("{endpoint}: {option} is not supported yet")]
    Unsupported {
        endpoint: &'static str,
        option: String,
    },
    #[error("{endpoint}: {reason}")]
    Url {
        endpoint: &'static str,
        reason: String,
    },
}

const SEND: &str = "vm.send-migration";
const RECEIVE: &str = "vm.receive-migration";

fn unsupported(endpoint: &'static str, option: impl Into<String>) -> BodyError {
    BodyError::Unsupported {
        endpoint,
        option: option.into(),
    }
}

/// Parses a `vm.send-migration` body: `local=on` over a `unix:` URL only.
pub fn send_migration_from_json(body: &Value) -> Result<SendMigration, BodyError> {
    let b: SendBody = serde_json::from_value(body.clone())
        .map_err(|e| BodyError::Parse(format!("VmSendMigrationData: {e}"), SEND))?;
    if !b.local {
        return Err(unsupported(SEND, "local=off"));
    }
    if b.preserve_source {
        return Err(unsupported(SEND, "preserve_source"));
    }
    if b.connections != 1 {
        return Err(unsupported(SEND, format!("connections={}", b.connections)));
    }
    if b.tls_dir.is_some() {
        return Err(unsupported(SEND, "tls_dir"));
    }
    if b.memory_mode != "Precopy" {
        return Err(unsupported(SEND, format!("memory_mode={}", b.memory_mode)));
    }
    let path = unix_path("destination_url", &b.destination_url).map_err(|e| BodyError::Url {
        endpoint: SEND,
        reason: e.to_string(),
    })?;
    Ok(SendMigration { path })
}

/// Parses a `vm.receive-migration` body: a `unix:` URL, nothing passed.
pub fn receive_migration_from_json(body: &Value) -> Result<ReceiveMigration, BodyError> {
    let b: ReceiveBody = serde_json::from_value(body.clone())
        .map_err(|e| BodyError::Parse(format!("VmReceiveMigrationData: {e}"), RECEIVE))?;
    if b.tls_dir.is_some() {
        return Err(unsupported(RECEIVE, "tls_dir"));
    }
    if b.memory_mode != "Precopy" {
        return Err(unsupported(
            RECEIVE,
            format!("memory_mode={}", b.memory_mode),
        ));
    }
    // null and [] both mean none, as in Cloud Hypervisor (and the schema).
    if b.vfio_fds
        .as_ref()
        .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(unsupported(RECEIVE, "vfio_fds"));
    }
    if b.iommufd_fd.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported(RECEIVE, "iommufd_fd"));
    }
    if b.zone_updates.as_ref().is_some_and(|z| !z.is_empty()) {
        return Err(unsupported(RECEIVE, "zone_updates"));
    }
    let path = unix_path("receiver_url", &b.receiver_url).map_err(|e| BodyError::Url {
        endpoint: RECEIVE,
        reason: e.to_string(),
    })?;
    Ok(ReceiveMigration { path })
}
