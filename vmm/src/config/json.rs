//! The VM configuration as Cloud Hypervisor's REST API spells it (VmConfig,
//! FsConfig, PmemConfig, DiskConfig, NetConfig, VsockConfig JSON; and the
//! VmSnapshotConfig and RestoreConfig bodies), into
//! and out of the same config types as the command line, through the same
//! checks, so both give the same limits and messages.
//!
//! Every body first goes through [`super::ch_fields`], which decides what
//! a Cloud Hypervisor body may carry: fields this VMM implements are passed
//! on; Cloud Hypervisor's others only with its default, and refused with
//! their path and value otherwise; fields Cloud Hypervisor does not have
//! are ignored, as it ignores them. What is left deserializes into the
//! config types the command line fills too (`deny_unknown_fields` on them
//! catches a table and a type that disagree, not a client's extra field),
//! and their `validated` checks it.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::ch_fields::{self, reduce_object};
use super::restore::{RestoreBody, SnapshotBody};
use super::{
    file_url_dir, ConfigError, DiskConfig, FsConfig, NetConfig, PmemConfig, RestoreConfig,
    SnapshotConfig, VmConfig, VsockConfig, FILE_URL_EXPECTED,
};

/// A body that does not fit its schema; the text names the field.
#[derive(Debug, thiserror::Error)]
pub enum JsonConfigError {
    #[error("{field}: {source}")]
    Shape {
        /// The body's type and the field's path in it
        /// (`VmConfig.disks[0].queue_size`), so a value its type cannot
        /// hold (70000 for a u16) is named.
        field: String,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A Cloud Hypervisor field this VMM does not implement, with a value
    /// other than the default (the text names its path and value).
    #[error("{0}")]
    Unsupported(String),
    /// A value of the right type that means nothing here (a URL of another
    /// scheme than `file://`).
    #[error("{field}={value} is invalid: expected {expected}")]
    Invalid {
        field: &'static str,
        value: Value,
        expected: &'static str,
    },
}

/// Checks `body` against Cloud Hypervisor's fields ([`ch_fields`]) and
/// deserializes what this VMM implements into `T`.
fn typed<T: DeserializeOwned>(
    what: &'static str,
    body: &Value,
    rules: &[(&str, ch_fields::Rule)],
) -> Result<T, JsonConfigError> {
    let ours = reduce_object(what, body, rules).map_err(JsonConfigError::Unsupported)?;
    serde_path_to_error::deserialize(&ours).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            what.to_owned()
        } else {
            format!("{what}.{path}")
        };
        JsonConfigError::Shape {
            field,
            source: e.into_inner(),
        }
    })
}

/// Parses a `vm.create` body into a checked [`VmConfig`].
pub fn vm_config_from_json(body: &Value) -> Result<VmConfig, JsonConfigError> {
    let config: VmConfig = typed("VmConfig", body, ch_fields::VM_CONFIG)?;
    // Required, though Cloud Hypervisor's PayloadConfig has it optional
    // (for firmware, which this VMM does not boot).
    if body["payload"]["kernel"].is_null() {
        return Err(ConfigError::MissingKey {
            option: "kernel",
            key: "payload.kernel",
        }
        .into());
    }
    Ok(config.validated()?)
}

/// Parses a `vm.add-fs` body; `index` names a device given without an id.
pub fn fs_config_from_json(body: &Value, index: usize) -> Result<FsConfig, JsonConfigError> {
    let config: FsConfig = typed("FsConfig", body, ch_fields::FS)?;
    Ok(config.validated(index)?)
}

/// Parses a `vm.add-pmem` body; `index` names a device given without an id.
pub fn pmem_config_from_json(body: &Value, index: usize) -> Result<PmemConfig, JsonConfigError> {
    let config: PmemConfig = typed("PmemConfig", body, ch_fields::PMEM)?;
    Ok(config.validated(index)?)
}

/// Parses a `vm.add-net` body; `index` names a device given without an id.
pub fn net_config_from_json(body: &Value, index: usize) -> Result<NetConfig, JsonConfigError> {
    let config: NetConfig = typed("NetConfig", body, ch_fields::NET)?;
    Ok(config.validated(index)?)
}

/// Parses a `vm.add-disk` body; `index` names a device given without an id.
pub fn disk_config_from_json(body: &Value, index: usize) -> Result<DiskConfig, JsonConfigError> {
    let config: DiskConfig = typed("DiskConfig", body, ch_fields::DISK)?;
    // Required, though Cloud Hypervisor's DiskConfig has it optional (for
    // vhost-user disks, which this VMM does not have).
    if body["path"].is_null() {
        return Err(ConfigError::MissingKey {
            option: "disk",
            key: "path",
        }
        .into());
    }
    Ok(config.validated(index)?)
}

/// Parses a `vm.add-vsock` body.
pub fn vsock_config_from_json(body: &Value) -> Result<VsockConfig, JsonConfigError> {
    let config: VsockConfig = typed("VsockConfig", body, ch_fields::VSOCK)?;
    Ok(config.validated()?)
}

/// A snapshot's or a restore's URL: the directory it names.
fn url_dir(field: &'static str, url: String) -> Result<std::path::PathBuf, JsonConfigError> {
    file_url_dir(&url).ok_or(JsonConfigError::Invalid {
        field,
        value: Value::String(url),
        expected: FILE_URL_EXPECTED,
    })
}

/// Parses a `vm.snapshot` body (Cloud Hypervisor's VmSnapshotConfig).
pub fn snapshot_config_from_json(body: &Value) -> Result<SnapshotConfig, JsonConfigError> {
    let b: SnapshotBody = typed("VmSnapshotConfig", body, ch_fields::SNAPSHOT)?;
    Ok(SnapshotConfig {
        destination_dir: url_dir("VmSnapshotConfig.destination_url", b.destination_url)?,
    })
}

/// Parses a `vm.restore` body (Cloud Hypervisor's RestoreConfig).
pub fn restore_config_from_json(body: &Value) -> Result<RestoreConfig, JsonConfigError> {
    let b: RestoreBody = typed("RestoreConfig", body, ch_fields::RESTORE)?;
    let mut named = std::collections::HashSet::new();
    for n in &b.net_fds {
        if !named.insert(n.id.as_str()) {
            return Err(JsonConfigError::Invalid {
                field: "RestoreConfig.net_fds[].id",
                value: Value::String(n.id.clone()),
                expected: "each net device named once",
            });
        }
        if n.num_fds == 0 {
            return Err(JsonConfigError::Invalid {
                field: "RestoreConfig.net_fds[].num_fds",
                value: Value::from(n.num_fds),
                expected: "one tap fd per queue pair of the device, at least 1",
            });
        }
    }
    Ok(RestoreConfig {
        source_dir: url_dir("RestoreConfig.source_url", b.source_url)?,
        prefault: b.prefault,
        resume: b.resume,
        net_fds: b.net_fds,
    })
}

/// The configuration as `vm.info` reports it: Cloud Hypervisor's whole
/// VmConfig with its defaults filled in (what its own `vm.info` returns,
/// and so what generated clients send back to `vm.create`), plus this
/// VMM's own fields (`dax`, `cache_size`, `transport`, `control_socket`):
/// the config's own fields, then the defaults [`ch_fields`] lists for
/// what this VMM does not implement.
pub fn vm_config_to_json(c: &VmConfig) -> Value {
    // Only a path that is not UTF-8 (a `--kernel` or `--initramfs` given
    // so) has no JSON; the config is then reported as null, not the VMM
    // stopped.
    let mut v = serde_json::to_value(c).unwrap_or_else(|e| {
        tracing::error!("vm.info: the VmConfig does not serialize: {e}");
        Value::Null
    });
    ch_fields::report_defaults(&mut v);
    v
}

#[cfg(test)]
#[path = "json_tests.rs"]
mod tests;
