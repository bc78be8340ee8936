//! The `vm.send-migration` and `vm.receive-migration` bodies as ch-remote
//! sends them (Cloud Hypervisor's `VmSendMigrationData` and
//! `VmReceiveMigrationData`): every field but the URL has a default, and
//! fields this VMM does not know are ignored, as Cloud Hypervisor's serde
//! structs ignore them. What this VMM cannot honour yet is refused by
//! name.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::{MigrationUrl, PrecopyLimits, TimeoutStrategy};

/// A `vm.send-migration` this VMM carries out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendMigration {
    /// The receiver.
    pub url: MigrationUrl,
    /// `local=on`: RAM passed as fds (a `unix:` URL only).
    pub local: bool,
    /// The pre-copy's downtime target and time bound (not `local`).
    pub limits: PrecopyLimits,
}

/// A `vm.receive-migration` this VMM carries out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiveMigration {
    /// Where to listen.
    pub url: MigrationUrl,
}

fn precopy() -> String {
    "Precopy".to_string()
}

fn one() -> u64 {
    1
}

/// Cloud Hypervisor's (and QEMU's) defaults.
fn default_downtime_ms() -> u64 {
    300
}
fn default_timeout_s() -> u64 {
    3600
}

#[derive(Deserialize)]
struct SendBody {
    destination_url: String,
    #[serde(default)]
    local: bool,
    #[serde(default)]
    preserve_source: bool,
    // A local migration's downtime is the pause for the state, whatever
    // these say; they bound a pre-copy.
    #[serde(default = "default_downtime_ms")]
    downtime_ms: u64,
    #[serde(default = "default_timeout_s")]
    timeout_s: u64,
    #[serde(default)]
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

/// Parses a `vm.send-migration` body: `local=on` over a `unix:` URL, or
/// a pre-copy over `unix:` or `tcp:`.
pub fn send_migration_from_json(body: &Value) -> Result<SendMigration, BodyError> {
    let b: SendBody = serde_json::from_value(body.clone())
        .map_err(|e| BodyError::Parse(format!("VmSendMigrationData: {e}"), SEND))?;
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
    let url =
        MigrationUrl::parse("destination_url", &b.destination_url).map_err(|e| BodyError::Url {
            endpoint: SEND,
            reason: e.to_string(),
        })?;
    if b.local && !matches!(url, MigrationUrl::Unix(_)) {
        return Err(BodyError::Url {
            endpoint: SEND,
            reason: format!(
                "destination_url: {url}: local=on passes guest RAM as fds, which needs a unix: socket"
            ),
        });
    }
    let field = |name: &str, reason: &str| BodyError::Url {
        endpoint: SEND,
        reason: format!("{name}: {reason}"),
    };
    if b.downtime_ms == 0 {
        return Err(field("downtime_ms", "must be at least 1"));
    }
    if b.timeout_s == 0 {
        return Err(field("timeout_s", "must be at least 1"));
    }
    // Cloud Hypervisor's spellings: `cancel`/`ignore` on ch-remote's
    // command line, `Cancel`/`Ignore` in JSON.
    let strategy = match b.timeout_strategy.as_deref() {
        None | Some("Cancel" | "cancel") => TimeoutStrategy::Cancel,
        Some("Ignore" | "ignore") => TimeoutStrategy::Ignore,
        Some(other) => {
            return Err(field(
                "timeout_strategy",
                &format!("{other:?} is neither Cancel nor Ignore"),
            ))
        }
    };
    Ok(SendMigration {
        url,
        local: b.local,
        limits: PrecopyLimits {
            downtime: Duration::from_millis(b.downtime_ms),
            timeout: Duration::from_secs(b.timeout_s),
            strategy,
        },
    })
}

/// Parses a `vm.receive-migration` body: a `unix:` or `tcp:` URL, nothing
/// passed.
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
    let url = MigrationUrl::parse("receiver_url", &b.receiver_url).map_err(|e| BodyError::Url {
        endpoint: RECEIVE,
        reason: e.to_string(),
    })?;
    Ok(ReceiveMigration { url })
}
