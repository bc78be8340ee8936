//! The VM configuration as Cloud Hypervisor's REST API spells it (VmConfig,
//! FsConfig, PmemConfig, DiskConfig, NetConfig JSON), converted through the same checks as the
//! command line so both give the same limits and messages.
//!
//! Every body first goes through [`super::ch_fields`], which decides what
//! a Cloud Hypervisor body may carry: fields this VMM implements are parsed
//! here; Cloud Hypervisor's others only with its default, and refused with
//! their path and value otherwise; fields Cloud Hypervisor does not have
//! are ignored, as it ignores them. The typed structs below then see only
//! the fields they implement (`deny_unknown_fields` on them catches a table
//! and a struct that disagree, not a client's extra field).

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{json, Value};

use super::ch_fields::{self, reduce_object};
use super::fs::FS_KEYS;
use super::option_parser::OptionValues;
use super::pmem::PMEM_KEYS;
use super::{
    ConfigError, CpuTopology, CpusConfig, FsConfig, MemoryConfig, PayloadConfig, PlatformConfig,
    PmemConfig, RngConfig, SerialMode, Transport, VmConfig, VsockConfig, CPUS_KEYS, PLATFORM_KEYS,
    RNG_KEYS, VSOCK_KEYS,
};
use super::{DiskConfig, DISK_KEYS};
use super::{NetConfig, NET_KEYS};

/// A body that does not fit its schema; the text names the field.
#[derive(Debug, thiserror::Error)]
pub enum JsonConfigError {
    #[error("{what}: {source}")]
    Shape {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A Cloud Hypervisor field this VMM does not implement, with a value
    /// other than the default (the text names its path and value).
    #[error("{0}")]
    Unsupported(String),
}

/// Cloud Hypervisor's requested PCI slot: only null, since slots are assigned.
fn no_pci_device_id(option: &'static str, slot: Option<u8>) -> Result<(), ConfigError> {
    match slot {
        Some(slot) => Err(ConfigError::Unsupported {
            option,
            message: format!("pci_device_id={slot} is not supported (slots are assigned)"),
        }),
        None => Ok(()),
    }
}

fn toggle(b: bool) -> String {
    if b { "on" } else { "off" }.to_string()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfigJson {
    tag: String,
    socket: PathBuf,
    num_queues: Option<u32>,
    queue_size: Option<u32>,
    id: Option<String>,
    pci_segment: Option<u16>,
    dax: Option<bool>,
    cache_size: Option<u64>,
    dax_prefault: Option<bool>,
    transport: Option<String>,
    control_socket: Option<PathBuf>,
    /// The DAX policy the daemon should have (a policy document).
    dax_policy: Option<Value>,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    pci_device_id: Option<u8>,
}

impl FsConfigJson {
    fn into_config(self, index: usize) -> Result<FsConfig, ConfigError> {
        no_pci_device_id("fs", self.pci_device_id)?;
        let mut pairs = vec![
            ("tag", self.tag),
            ("socket", self.socket.display().to_string()),
        ];
        let mut opt = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        };
        opt("num_queues", self.num_queues.map(|v| v.to_string()));
        opt("queue_size", self.queue_size.map(|v| v.to_string()));
        opt("id", self.id);
        opt("pci_segment", self.pci_segment.map(|v| v.to_string()));
        opt("dax", self.dax.map(toggle));
        opt("cache_size", self.cache_size.map(|v| v.to_string()));
        opt("dax_prefault", self.dax_prefault.map(toggle));
        opt("transport", self.transport);
        opt(
            "control_socket",
            self.control_socket.map(|p| p.display().to_string()),
        );
        let mut config =
            FsConfig::from_values(&OptionValues::from_pairs("fs", pairs, FS_KEYS)?, index)?;
        if let Some(doc) = self.dax_policy {
            let policy = policies::Policy::parse_json(&doc.to_string()).map_err(|e| {
                ConfigError::Unsupported {
                    option: "fs",
                    message: format!("dax_policy: {e}"),
                }
            })?;
            config.dax_policy = Some(policy.to_value());
        }
        Ok(config)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfigJson {
    file: PathBuf,
    size: Option<u64>,
    iommu: Option<bool>,
    discard_writes: Option<bool>,
    id: Option<String>,
    pci_segment: Option<u16>,
    transport: Option<String>,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    pci_device_id: Option<u8>,
}

impl PmemConfigJson {
    fn into_config(self, index: usize) -> Result<PmemConfig, ConfigError> {
        no_pci_device_id("pmem", self.pci_device_id)?;
        let mut pairs = vec![("file", self.file.display().to_string())];
        let mut opt = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        };
        opt("size", self.size.map(|v| v.to_string()));
        opt("iommu", self.iommu.map(toggle));
        opt("discard_writes", self.discard_writes.map(toggle));
        opt("id", self.id);
        opt("pci_segment", self.pci_segment.map(|v| v.to_string()));
        opt("transport", self.transport);
        PmemConfig::from_values(&OptionValues::from_pairs("pmem", pairs, PMEM_KEYS)?, index)
    }
}

/// Cloud Hypervisor's NetConfig, every field: Kata's driver sends
/// `mac`, `ip`/`mask` (its defaults 192.168.249.1/255.255.255.0),
/// `num_queues`, `queue_size`, `iommu`, `vhost_user`, `vhost_mode`, the
/// `offload_*` toggles and, with `vm.add-net`, its tap fds.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfigJson {
    tap: Option<String>,
    ip: Option<String>,
    mask: Option<String>,
    mac: Option<String>,
    host_mac: Option<String>,
    mtu: Option<u32>,
    iommu: Option<bool>,
    num_queues: Option<u32>,
    queue_size: Option<u32>,
    vhost_user: Option<bool>,
    vhost_socket: Option<String>,
    vhost_mode: Option<String>,
    id: Option<String>,
    /// Numbers in the sender's process, meaningless here: the fds
    /// themselves travel as SCM_RIGHTS with the request. Ignored, as
    /// Cloud Hypervisor ignores them.
    fds: Option<Vec<i32>>,
    /// Only null: there is no rate limiter.
    rate_limiter_config: Option<Value>,
    pci_segment: Option<u16>,
    pci_device_id: Option<u8>,
    offload_tso: Option<bool>,
    offload_ufo: Option<bool>,
    offload_csum: Option<bool>,
    transport: Option<String>,
}

impl NetConfigJson {
    fn into_config(self, index: usize) -> Result<NetConfig, ConfigError> {
        no_pci_device_id("net", self.pci_device_id)?;
        let unsupported = |message: String| ConfigError::Unsupported {
            option: "net",
            message,
        };
        if self
            .rate_limiter_config
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Err(unsupported(
                "rate_limiter_config is not supported (only null)".into(),
            ));
        }
        // Cloud Hypervisor's api_client (runtime-rs, ch-remote) lists the
        // numbers of the fds it passes with every such request: normal,
        // so not worth more than a debug line.
        if self.fds.as_ref().is_some_and(|f| !f.is_empty()) {
            log::debug!("vm.add-net: fd numbers in the body are ignored; the fds come as SCM_RIGHTS with the request");
        }
        let mut pairs = Vec::new();
        let mut opt = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        };
        opt("tap", self.tap);
        opt("ip", self.ip);
        opt("mask", self.mask);
        opt("mac", self.mac);
        opt("host_mac", self.host_mac);
        opt("mtu", self.mtu.map(|v| v.to_string()));
        opt("iommu", self.iommu.map(toggle));
        opt("num_queues", self.num_queues.map(|v| v.to_string()));
        opt("queue_size", self.queue_size.map(|v| v.to_string()));
        opt("vhost_user", self.vhost_user.map(toggle));
        opt("socket", self.vhost_socket);
        opt("vhost_mode", self.vhost_mode);
        opt("id", self.id);
        opt("pci_segment", self.pci_segment.map(|v| v.to_string()));
        opt("offload_tso", self.offload_tso.map(toggle));
        opt("offload_ufo", self.offload_ufo.map(toggle));
        opt("offload_csum", self.offload_csum.map(toggle));
        opt("transport", self.transport);
        NetConfig::from_values(&OptionValues::from_pairs("net", pairs, NET_KEYS)?, index)
    }
}

/// Cloud Hypervisor's DiskConfig, every field (Kata sends most of them).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfigJson {
    path: Option<PathBuf>,
    readonly: Option<bool>,
    direct: Option<bool>,
    iommu: Option<bool>,
    num_queues: Option<u32>,
    queue_size: Option<u32>,
    vhost_user: Option<bool>,
    vhost_socket: Option<String>,
    rate_limit_group: Option<String>,
    /// Only null: there is no rate limiter.
    rate_limiter_config: Option<Value>,
    pci_segment: Option<u16>,
    pci_device_id: Option<u8>,
    id: Option<String>,
    serial: Option<String>,
    /// Only null or empty.
    queue_affinity: Option<Value>,
    backing_files: Option<bool>,
    sparse: Option<bool>,
    image_type: Option<String>,
    lock_granularity: Option<String>,
    /// In Cloud Hypervisor's vm.info though not in its API: false only.
    disable_io_uring: Option<bool>,
    disable_aio: Option<bool>,
    transport: Option<String>,
}

impl DiskConfigJson {
    fn into_config(self, index: usize) -> Result<DiskConfig, ConfigError> {
        no_pci_device_id("disk", self.pci_device_id)?;
        let only_null = |key: &str, v: &Option<Value>| match v {
            Some(v) if !(v.is_null() || v.as_array().is_some_and(|a| a.is_empty())) => {
                Err(ConfigError::Unsupported {
                    option: "disk",
                    message: format!("{key}={v} is not supported (only null)"),
                })
            }
            _ => Ok(()),
        };
        if self
            .rate_limiter_config
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Err(ConfigError::Unsupported {
                option: "disk",
                message: "rate_limiter_config is not supported (only null)".into(),
            });
        }
        only_null("queue_affinity", &self.queue_affinity)?;
        for (key, on) in [
            ("disable_io_uring", self.disable_io_uring),
            ("disable_aio", self.disable_aio),
        ] {
            if on == Some(true) {
                return Err(ConfigError::Unsupported {
                    option: "disk",
                    message: format!("{key}=true is not supported (only false)"),
                });
            }
        }
        let mut pairs = Vec::new();
        let mut opt = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        };
        opt("path", self.path.map(|p| p.display().to_string()));
        opt("readonly", self.readonly.map(toggle));
        opt("direct", self.direct.map(toggle));
        opt("iommu", self.iommu.map(toggle));
        opt("num_queues", self.num_queues.map(|v| v.to_string()));
        opt("queue_size", self.queue_size.map(|v| v.to_string()));
        opt("vhost_user", self.vhost_user.map(toggle));
        opt("socket", self.vhost_socket);
        opt("rate_limit_group", self.rate_limit_group);
        opt("pci_segment", self.pci_segment.map(|v| v.to_string()));
        opt("id", self.id);
        opt("serial", self.serial);
        opt("backing_files", self.backing_files.map(toggle));
        opt("sparse", self.sparse.map(toggle));
        opt("image_type", self.image_type);
        opt("lock_granularity", self.lock_granularity);
        opt("transport", self.transport);
        DiskConfig::from_values(&OptionValues::from_pairs("disk", pairs, DISK_KEYS)?, index)
    }
}

/// Cloud Hypervisor's VsockConfig (Kata's driver sends `cid`, `socket` and
/// `iommu`, from CH's generated Go client) plus our `transport`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfigJson {
    cid: u64,
    socket: PathBuf,
    iommu: Option<bool>,
    id: Option<String>,
    pci_segment: Option<u16>,
    transport: Option<String>,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    pci_device_id: Option<u8>,
}

impl VsockConfigJson {
    fn into_config(self) -> Result<VsockConfig, ConfigError> {
        no_pci_device_id("vsock", self.pci_device_id)?;
        let mut pairs = vec![
            ("cid", self.cid.to_string()),
            ("socket", self.socket.display().to_string()),
        ];
        let mut opt = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        };
        opt("iommu", self.iommu.map(toggle));
        opt("id", self.id);
        opt("pci_segment", self.pci_segment.map(|v| v.to_string()));
        opt("transport", self.transport);
        VsockConfig::from_values(&OptionValues::from_pairs("vsock", pairs, VSOCK_KEYS)?)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RngJson {
    src: Option<PathBuf>,
    iommu: Option<bool>,
    pci_segment: Option<u16>,
    transport: Option<String>,
}

impl RngJson {
    fn into_config(self) -> Result<RngConfig, ConfigError> {
        let mut pairs = Vec::new();
        if let Some(src) = self.src {
            pairs.push(("src", src.display().to_string()));
        }
        if let Some(i) = self.iommu {
            pairs.push(("iommu", toggle(i)));
        }
        if let Some(s) = self.pci_segment {
            pairs.push(("pci_segment", s.to_string()));
        }
        if let Some(t) = self.transport {
            pairs.push(("transport", t));
        }
        RngConfig::from_values(&OptionValues::from_pairs("rng", pairs, RNG_KEYS)?)
    }
}

/// The part of Cloud Hypervisor's PlatformConfig this VMM implements (the
/// rest is checked by [`super::ch_fields`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlatformJson {
    num_pci_segments: Option<u16>,
}

impl PlatformJson {
    fn into_config(self) -> Result<PlatformConfig, ConfigError> {
        let pairs = self
            .num_pci_segments
            .map(|n| ("num_pci_segments", n.to_string()))
            .into_iter()
            .collect();
        PlatformConfig::from_values(&OptionValues::from_pairs("platform", pairs, PLATFORM_KEYS)?)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PayloadJson {
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    cmdline: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CpusJson {
    boot_vcpus: u32,
    max_vcpus: Option<u32>,
    topology: Option<CpuTopologyJson>,
}

/// Cloud Hypervisor's CpuTopology: every part is required, as there.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CpuTopologyJson {
    threads_per_core: u16,
    cores_per_die: u16,
    dies_per_package: u16,
    packages: u16,
}

impl CpusJson {
    fn into_config(self) -> Result<CpusConfig, ConfigError> {
        let mut pairs = vec![("boot", self.boot_vcpus.to_string())];
        if let Some(m) = self.max_vcpus {
            pairs.push(("max", m.to_string()));
        }
        if let Some(t) = self.topology {
            let t = CpuTopology {
                threads_per_core: t.threads_per_core,
                cores_per_die: t.cores_per_die,
                dies_per_package: t.dies_per_package,
                packages: t.packages,
            };
            pairs.push(("topology", t.to_option()));
        }
        CpusConfig::from_values(&OptionValues::from_pairs("cpus", pairs, CPUS_KEYS)?)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryJson {
    size: u64,
    shared: Option<bool>,
    hugepages: Option<bool>,
    hotplug_size: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleJson {
    mode: String,
    file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VmConfigJson {
    payload: PayloadJson,
    cpus: Option<CpusJson>,
    memory: Option<MemoryJson>,
    serial: Option<ConsoleJson>,
    console: Option<ConsoleJson>,
    fs: Option<Vec<FsConfigJson>>,
    pmem: Option<Vec<PmemConfigJson>>,
    disks: Option<Vec<DiskConfigJson>>,
    net: Option<Vec<NetConfigJson>>,
    rng: Option<RngJson>,
    vsock: Option<VsockConfigJson>,
    pvpanic: Option<bool>,
    platform: Option<PlatformJson>,
}

fn serial_mode(c: &ConsoleJson, option: &'static str) -> Result<SerialMode, ConfigError> {
    let mode = c.mode.to_ascii_lowercase();
    match (mode.as_str(), &c.file) {
        ("file", Some(f)) => Ok(SerialMode::File(f.clone())),
        ("file", None) => Err(ConfigError::MissingKey { option, key: "file" }),
        (m, _) if option == "serial" => SerialMode::parse(m),
        ("off", _) => Ok(SerialMode::Off),
        (other, _) => Err(ConfigError::Unsupported {
            option,
            message: format!("mode \"{other}\" needs a virtio-console, which this VMM does not have; use \"Off\""),
        }),
    }
}

/// Parses a `vm.create` body into a checked [`VmConfig`].
pub fn vm_config_from_json(body: &Value) -> Result<VmConfig, JsonConfigError> {
    let ours = super::ch_fields::reduce_vm_config(body).map_err(JsonConfigError::Unsupported)?;
    let j = VmConfigJson::deserialize(&ours).map_err(|source| JsonConfigError::Shape {
        what: "VmConfig",
        source,
    })?;
    let kernel = j.payload.kernel.ok_or(ConfigError::MissingKey {
        option: "kernel",
        key: "payload.kernel",
    })?;
    // The schema's minLength 1: an empty path would pass here and fail
    // only at vm.boot, after the VM was reported created.
    if kernel.as_os_str().is_empty() {
        return Err(ConfigError::InvalidValue {
            option: "kernel",
            key: "payload.kernel",
            value: String::new(),
            expected: "a path to the kernel image (not empty)".into(),
        }
        .into());
    }
    let cpus = match j.cpus {
        None => CpusConfig::default(),
        Some(c) => c.into_config()?,
    };
    let memory = match j.memory {
        None => MemoryConfig::default(),
        Some(m) => MemoryConfig::parse(&format!(
            "size={},shared={},hugepages={}{}",
            m.size,
            toggle(m.shared.unwrap_or(false)),
            toggle(m.hugepages.unwrap_or(false)),
            m.hotplug_size
                .map(|h| format!(",hotplug_size={h}"))
                .unwrap_or_default()
        ))?,
    };
    let console = match &j.console {
        Some(c) => serial_mode(c, "console")?,
        None => SerialMode::Off,
    };
    let config = VmConfig {
        payload: PayloadConfig {
            kernel,
            initramfs: j.payload.initramfs,
            cmdline: j.payload.cmdline.unwrap_or_default(),
        },
        cpus,
        memory,
        serial: j
            .serial
            .as_ref()
            .map(|s| serial_mode(s, "serial"))
            .transpose()?
            .unwrap_or(SerialMode::Null),
        console,
        pmem: j
            .pmem
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, p)| p.into_config(i))
            .collect::<Result<_, _>>()?,
        fs: j
            .fs
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, f)| f.into_config(i))
            .collect::<Result<_, _>>()?,
        disks: j
            .disks
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, d)| d.into_config(i))
            .collect::<Result<_, _>>()?,
        net: j
            .net
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, n)| n.into_config(i))
            .collect::<Result<_, _>>()?,
        // On by default, as in Cloud Hypervisor, whose VmConfig always has one.
        rng: Some(
            j.rng
                .map(RngJson::into_config)
                .transpose()?
                .unwrap_or_default(),
        ),
        vsock: j.vsock.map(VsockConfigJson::into_config).transpose()?,
        pvpanic: j.pvpanic.unwrap_or(true),
        platform: j
            .platform
            .map(PlatformJson::into_config)
            .transpose()?
            .unwrap_or_default(),
    };
    config.validate()?;
    Ok(config)
}

/// Parses a `vm.add-fs` body; `index` names a device given without an id.
pub fn fs_config_from_json(body: &Value, index: usize) -> Result<FsConfig, JsonConfigError> {
    let body =
        reduce_object("FsConfig", body, ch_fields::FS).map_err(JsonConfigError::Unsupported)?;
    let j = FsConfigJson::deserialize(&body).map_err(|source| JsonConfigError::Shape {
        what: "FsConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-pmem` body; `index` names a device given without an id.
pub fn pmem_config_from_json(body: &Value, index: usize) -> Result<PmemConfig, JsonConfigError> {
    let body =
        reduce_object("PmemConfig", body, ch_fields::PMEM).map_err(JsonConfigError::Unsupported)?;
    let j = PmemConfigJson::deserialize(&body).map_err(|source| JsonConfigError::Shape {
        what: "PmemConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-net` body; `index` names a device given without an id.
pub fn net_config_from_json(body: &Value, index: usize) -> Result<NetConfig, JsonConfigError> {
    let body =
        reduce_object("NetConfig", body, ch_fields::NET).map_err(JsonConfigError::Unsupported)?;
    let j = NetConfigJson::deserialize(&body).map_err(|source| JsonConfigError::Shape {
        what: "NetConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-disk` body; `index` names a device given without an id.
pub fn disk_config_from_json(body: &Value, index: usize) -> Result<DiskConfig, JsonConfigError> {
    let body =
        reduce_object("DiskConfig", body, ch_fields::DISK).map_err(JsonConfigError::Unsupported)?;
    let j = DiskConfigJson::deserialize(&body).map_err(|source| JsonConfigError::Shape {
        what: "DiskConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-vsock` body.
pub fn vsock_config_from_json(body: &Value) -> Result<VsockConfig, JsonConfigError> {
    let body = reduce_object("VsockConfig", body, ch_fields::VSOCK)
        .map_err(JsonConfigError::Unsupported)?;
    let j = VsockConfigJson::deserialize(&body).map_err(|source| JsonConfigError::Shape {
        what: "VsockConfig",
        source,
    })?;
    Ok(j.into_config()?)
}

fn transport(t: Transport) -> &'static str {
    match t {
        Transport::Pci => "pci",
        Transport::Mmio => "mmio",
    }
}

/// The configuration as `vm.info` reports it: Cloud Hypervisor's whole
/// VmConfig with its defaults filled in (what its own `vm.info` returns,
/// and so what generated clients send back to `vm.create`), plus this
/// VMM's own fields (`dax`, `cache_size`, `transport`, `control_socket`).
pub fn vm_config_to_json(c: &VmConfig) -> Value {
    let serial = match &c.serial {
        SerialMode::Off => json!({"mode": "Off"}),
        SerialMode::Null => json!({"mode": "Null"}),
        SerialMode::Tty => json!({"mode": "Tty"}),
        SerialMode::File(f) => json!({"mode": "File", "file": f}),
    };
    let mut v = json!({
        "payload": {"kernel": c.payload.kernel, "initramfs": c.payload.initramfs, "cmdline": c.payload.cmdline},
        "cpus": {"boot_vcpus": c.cpus.boot_vcpus, "max_vcpus": c.cpus.max_vcpus, "kvm_hyperv": false, "max_phys_bits": 46,
                 "features": {"amx": false}, "nested": true, "core_scheduling": "Vm", "profile": "Host"},
        "memory": {"size": c.memory.size, "hotplug_size": c.memory.hotplug_size, "mergeable": false, "hotplug_method": "Acpi", "shared": c.memory.shared,
                   "hugepages": c.memory.hugepages, "prefault": false, "reserve": false, "thp": true},
        "serial": serial,
        "console": {"mode": "Off", "pci_segment": 0},
        "debug_console": {"mode": "Off", "iobase": 0xe9},
        "fs": c.fs.iter().map(|f| json!({
            "tag": f.tag, "socket": f.socket, "num_queues": f.num_queues, "queue_size": f.queue_size,
            "id": f.id, "pci_segment": f.pci_segment, "dax": f.dax, "cache_size": f.cache_size, "dax_prefault": f.dax_prefault,
            "transport": transport(f.transport), "control_socket": f.control_socket,
            "dax_policy": f.dax_policy,
        })).collect::<Vec<_>>(),
        "pmem": c.pmem.iter().map(|p| json!({
            "file": p.file, "size": p.size, "iommu": false, "discard_writes": p.discard_writes,
            "id": p.id, "pci_segment": p.pci_segment, "transport": transport(p.transport),
        })).collect::<Vec<_>>(),
        "disks": c.disks.iter().map(|d| json!({
            "path": d.path, "readonly": d.readonly, "direct": d.direct, "iommu": false,
            "num_queues": d.num_queues, "queue_size": d.queue_size, "vhost_user": false,
            "id": d.id, "serial": d.serial, "pci_segment": d.pci_segment, "backing_files": false, "sparse": true,
            "image_type": "Raw", "transport": transport(d.transport),
        })).collect::<Vec<_>>(),
        "net": c.net.iter().map(|n| json!({
            "tap": n.tap, "ip": n.ip.map(|a| a.to_string()), "mask": n.mask.map(|a| a.to_string()),
            "mac": n.mac.to_string(), "mtu": n.mtu, "iommu": false, "num_queues": n.num_queues,
            "queue_size": n.queue_size, "vhost_user": false, "vhost_mode": "Client", "id": n.id,
            "pci_segment": n.pci_segment, "offload_tso": n.offload_tso, "offload_ufo": true,
            "offload_csum": n.offload_csum, "transport": transport(n.transport),
        })).collect::<Vec<_>>(),
        "pvpanic": c.pvpanic,
        "platform": {"num_pci_segments": c.platform.num_pci_segments},
        "iommu": false,
        "watchdog": false,
        "landlock_enable": false,
    });
    if let Some(t) = c.cpus.topology {
        v["cpus"]["topology"] = json!({"threads_per_core": t.threads_per_core, "cores_per_die": t.cores_per_die,
                                       "dies_per_package": t.dies_per_package, "packages": t.packages});
    }
    if let Some(r) = &c.rng {
        v["rng"] = json!({"src": r.src, "iommu": false, "pci_segment": r.pci_segment, "transport": transport(r.transport)});
    }
    if let Some(s) = &c.vsock {
        v["vsock"] = json!({"cid": s.cid, "socket": s.socket, "iommu": false, "id": s.id,
                            "pci_segment": s.pci_segment, "transport": transport(s.transport)});
    }
    v
}

#[cfg(test)]
#[path = "json_tests.rs"]
mod tests;
