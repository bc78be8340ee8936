//! The VM configuration as Cloud Hypervisor's REST API spells it (VmConfig,
//! FsConfig, PmemConfig, DiskConfig, NetConfig JSON), converted through the same checks as the
//! command line so both give the same limits and messages.
//!
//! Every field of Cloud Hypervisor's VmConfig is accepted ([`super::ch_fields`]):
//! those this VMM implements are parsed here; the others only with Cloud
//! Hypervisor's default, and refused with their path and value otherwise.
//! Fields Cloud Hypervisor does not have are refused with their name, so a
//! setting is never silently dropped.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{json, Value};

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
        if self.fds.as_ref().is_some_and(|f| !f.is_empty()) {
            log::warn!("vm.add-net: fd numbers in the body are ignored; the fds come as SCM_RIGHTS with the request");
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
    if let Some(c) = &j.console {
        serial_mode(c, "console")?;
    }
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
    let j = FsConfigJson::deserialize(body).map_err(|source| JsonConfigError::Shape {
        what: "FsConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-pmem` body; `index` names a device given without an id.
pub fn pmem_config_from_json(body: &Value, index: usize) -> Result<PmemConfig, JsonConfigError> {
    let j = PmemConfigJson::deserialize(body).map_err(|source| JsonConfigError::Shape {
        what: "PmemConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-net` body; `index` names a device given without an id.
pub fn net_config_from_json(body: &Value, index: usize) -> Result<NetConfig, JsonConfigError> {
    let j = NetConfigJson::deserialize(body).map_err(|source| JsonConfigError::Shape {
        what: "NetConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-disk` body; `index` names a device given without an id.
pub fn disk_config_from_json(body: &Value, index: usize) -> Result<DiskConfig, JsonConfigError> {
    let j = DiskConfigJson::deserialize(body).map_err(|source| JsonConfigError::Shape {
        what: "DiskConfig",
        source,
    })?;
    Ok(j.into_config(index)?)
}

/// Parses a `vm.add-vsock` body.
pub fn vsock_config_from_json(body: &Value) -> Result<VsockConfig, JsonConfigError> {
    let j = VsockConfigJson::deserialize(body).map_err(|source| JsonConfigError::Shape {
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
mod tests {
    use super::*;

    #[test]
    fn ch_remote_add_fs_body_is_accepted_with_our_fields() {
        // What ch-remote puts on the wire for `add-fs tag=myfs,socket=/tmp/x.sock`.
        let body = json!({"pci_segment":0,"tag":"myfs","socket":"/tmp/x.sock","num_queues":1,"queue_size":1024});
        let f = fs_config_from_json(&body, 2).unwrap();
        assert_eq!(
            (f.tag.as_str(), f.id.as_str(), f.dax, f.cache_size),
            ("myfs", "_fs2", true, None)
        );
        let body = json!({"tag":"t","socket":"s","dax":true,"cache_size":67108864,"transport":"mmio","id":"fs0","control_socket":"/c","dax_prefault":false});
        let f = fs_config_from_json(&body, 0).unwrap();
        assert_eq!(
            (f.cache_size, f.transport, f.control_socket, f.dax_prefault),
            (Some(64 << 20), Transport::Mmio, Some("/c".into()), false)
        );
        // A policy document comes back normalized, and round-trips.
        let body =
            json!({"tag":"t","socket":"s","dax_policy":{"rules":[{"min_size":"1M","dax":true}]}});
        let f = fs_config_from_json(&body, 0).unwrap();
        let doc = f.dax_policy.clone().expect("kept");
        assert_eq!(doc["rules"][0]["dax"], true, "{doc}");
        assert!(doc.get("default").is_some(), "normalized: {doc}");
        let mut c = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).unwrap();
        c.fs.push(f);
        let info = vm_config_to_json(&c);
        assert_eq!(info["fs"][0]["dax_policy"], doc);
        let again = json!({"tag":"t","socket":"s","dax_policy":{"mode":"sometimes"}});
        assert!(fs_config_from_json(&again, 0)
            .unwrap_err()
            .to_string()
            .contains("dax_policy: mode"));
    }

    #[test]
    fn bad_bodies_name_the_field() {
        let e = |v: Value| fs_config_from_json(&v, 0).unwrap_err().to_string();
        assert!(
            e(json!({"tag":"t","socket":"s","cache":"always"})).contains("unknown field `cache`")
        );
        assert!(e(json!({"socket":"s"})).contains("missing field `tag`"));
        assert!(
            e(json!({"tag":"t","socket":"s","num_queues":"two"})).contains("num_queues")
                || e(json!({"tag":"t","socket":"s","num_queues":"two"})).contains("invalid type")
        );
        assert!(e(json!({"tag":"t","socket":"s","cache_size":3145728})).contains("multiple of 2M"));
        assert!(e(json!({"tag":"t","socket":"s","transport":"vsock"})).contains("pci or mmio"));
        let p = |v: Value| pmem_config_from_json(&v, 0).unwrap_err().to_string();
        assert!(p(json!({"file":"f","iommu":true})).contains("iommu"));
        assert!(p(json!({"file":"f","size":1000})).contains("multiple of 2M"));
        assert!(pmem_config_from_json(
            &json!({"pci_segment":0,"file":"/tmp/p.img","size":67108864,"discard_writes":false}),
            0
        )
        .is_ok());
    }

    #[test]
    fn net_bodies_as_kata_and_ch_remote_send_them() {
        // Kata's clh.go: NewNetConfig's defaults plus the endpoint's MAC
        // (its tap fds travel beside the body).
        let kata = json!({"ip": "192.168.249.1", "mask": "255.255.255.0", "mac": "02:42:ac:11:00:02",
            "iommu": false, "num_queues": 2, "queue_size": 256, "vhost_user": false,
            "vhost_mode": "Client", "offload_tso": true, "offload_ufo": true, "offload_csum": true});
        let n = net_config_from_json(&kata, 1).unwrap();
        assert_eq!(
            (n.mac.to_string().as_str(), n.id.as_str()),
            ("02:42:ac:11:00:02", "_net1")
        );
        assert_eq!(
            (n.num_queues, n.queue_size, n.tap.is_none()),
            (2, 256, true)
        );
        // ch-remote add-net tap=tap0,mtu=1400.
        let n = net_config_from_json(&json!({"tap": "tap0", "mtu": 1400, "pci_segment": 0}), 0)
            .unwrap();
        assert_eq!((n.tap.as_deref(), n.mtu), (Some("tap0"), Some(1400)));
        let e = |b: Value| net_config_from_json(&b, 0).unwrap_err().to_string();
        assert!(e(json!({"tap": "t", "num_queues": 4})).contains("num_queues=\"4\""));
        // Fd numbers in a body mean nothing in this process: ignored.
        let n = net_config_from_json(&json!({"tap": "t", "fds": [3, 4]}), 0).unwrap();
        assert!(n.fds.is_empty());
        let two = vec![
            std::fs::File::open("/dev/null").unwrap().into(),
            std::fs::File::open("/dev/null").unwrap().into(),
        ];
        assert!(n
            .clone()
            .with_fds(two)
            .unwrap_err()
            .to_string()
            .contains("expected one tap fd"));
        let one = vec![std::fs::File::open("/dev/null").unwrap().into()];
        assert_eq!(n.with_fds(one).unwrap().fds.0.len(), 1);
        assert!(e(json!({"tap": "t", "vhost_user": true})).contains("vhost_user=on"));
        assert!(e(
            json!({"tap": "t", "rate_limiter_config": {"bandwidth": {"size": 1, "refill_time": 1}}})
        )
        .contains("rate_limiter_config"));
        assert!(e(json!({"tap": "t", "speed": 1})).contains("unknown field `speed`"));
        assert!(e(json!({"tap": "t", "pci_device_id": 3})).contains("pci_device_id"));
        // In a VmConfig, and back out of vm.info with the same MAC.
        let body = json!({"payload": {"kernel": "/k"}, "net": [{"tap": "tap1", "ip": "10.0.0.1", "mask": "255.0.0.0"}]});
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(c.net[0].id, "_net0");
        let info = vm_config_to_json(&c);
        assert_eq!(info["net"][0]["vhost_mode"], "Client");
        assert_eq!(vm_config_from_json(&info).unwrap(), c);
    }

    #[test]
    fn kata_disk_bodies_are_accepted_and_round_trip() {
        // What Kata's clh.go sends for a hot-plugged block device (its Go
        // client fills the defaults NewDiskConfig sets).
        let body = json!({"path": "/run/kata/img", "readonly": true, "direct": false, "iommu": false,
            "num_queues": 2, "queue_size": 1024, "vhost_user": false, "image_type": "Raw",
            "backing_files": false, "sparse": true, "pci_segment": 0});
        let d = disk_config_from_json(&body, 3).unwrap();
        assert_eq!(
            (d.readonly, d.num_queues, d.queue_size, d.id.as_str()),
            (true, 2, 1024, "_disk3")
        );
        let mut c =
            vm_config_from_json(&json!({"payload": {"kernel": "/k"}, "disks": [body]})).unwrap();
        assert_eq!(c.disks[0].id, "_disk0");
        c.disks[0].serial = Some("S1".into());
        let info = vm_config_to_json(&c);
        assert_eq!(info["disks"][0]["image_type"], "Raw");
        assert_eq!(vm_config_from_json(&info).unwrap(), c);
        let e = |v: Value| disk_config_from_json(&v, 0).unwrap_err().to_string();
        assert!(e(json!({"path": "/d", "rate_limiter_config": {"bandwidth": {"size": 1, "refill_time": 1}}}))
            .contains("rate_limiter_config is not supported"));
        assert!(
            e(json!({"path": "/d", "vhost_user": true})).contains("vhost_user=on is not supported")
        );
        assert!(e(json!({"path": "/d", "num_queues": 0})).contains("num_queues=\"0\""));
        assert!(e(json!({"path": "/d", "cache": "none"})).contains("unknown field `cache`"));
        assert!(e(json!({"readonly": true})).contains("missing required key \"path\""));
        assert!(e(json!({"path": "/d", "pci_device_id": 3})).contains("pci_device_id=3"));
    }

    #[test]
    fn vsock_bodies_as_kata_and_ch_remote_send_them() {
        // Kata's clh.go: NewVsockConfig(cid, path) and SetIommu(false).
        let v = vsock_config_from_json(
            &json!({"cid": 3, "socket": "/run/vc/vm/x/clh.sock", "iommu": false}),
        )
        .unwrap();
        assert_eq!((v.cid, v.id.as_str()), (3, "_vsock0"));
        // An id, as other clients send.
        let v = vsock_config_from_json(&json!({"cid": 3, "socket": "/s", "id": "vsock0"})).unwrap();
        assert_eq!(v.id, "vsock0");
        // ch-remote add-vsock: its defaults too.
        let v = vsock_config_from_json(
            &json!({"cid": 4, "socket": "/s", "iommu": false, "pci_segment": 0}),
        )
        .unwrap();
        assert_eq!((v.id.as_str(), v.transport), ("_vsock0", Transport::Pci));
        let e = |b: Value| vsock_config_from_json(&b).unwrap_err().to_string();
        assert!(e(json!({"cid": 2, "socket": "/s"})).contains("cid=\"2\""));
        assert!(e(json!({"socket": "/s"})).contains("missing field `cid`"));
        assert!(e(json!({"cid": 3, "socket": "/s", "port": 1})).contains("unknown field `port`"));
        assert!(e(json!({"cid": 3, "socket": "/s", "pci_device_id": 5})).contains("pci_device_id"));
        // In a VmConfig, and back out of vm.info.
        let body =
            json!({"payload": {"kernel": "/k"}, "vsock": {"cid": 5, "socket": "/v", "id": "vs"}});
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(c.vsock.as_ref().map(|v| v.cid), Some(5));
        assert_eq!(vm_config_from_json(&vm_config_to_json(&c)).unwrap(), c);
        let mut dup = body.clone();
        dup["pmem"] = json!([{"file": "/p", "id": "vs"}]);
        assert!(vm_config_from_json(&dup)
            .unwrap_err()
            .to_string()
            .contains("\"vs\" is used twice"));
    }

    /// The cpus part of the VmConfig Kata's Cloud Hypervisor driver sends
    /// (clh.go: NewCpusConfig(boot, DefaultMaxVCPUs) and a topology of
    /// 1 thread x max cores x 1 die x 1 package), as its generated client
    /// writes it.
    #[test]
    fn katas_cpus_with_max_and_topology_are_taken_and_reported() {
        let kata = json!({"boot_vcpus": 1, "max_vcpus": 4, "kvm_hyperv": false, "nested": true,
            "topology": {"threads_per_core": 1, "cores_per_die": 4, "dies_per_package": 1, "packages": 1}});
        let body = json!({"payload": {"kernel": "/k"}, "cpus": kata});
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!((c.cpus.boot_vcpus, c.cpus.max_vcpus), (1, 4));
        assert_eq!(c.cpus.topology, Some(CpuTopology::flat(4)));
        let info = vm_config_to_json(&c);
        assert_eq!(info["cpus"]["max_vcpus"], 4);
        assert_eq!(info["cpus"]["topology"], kata["topology"]);
        assert_eq!(vm_config_from_json(&info).unwrap(), c);

        let e = |cpus: Value| {
            vm_config_from_json(&json!({"payload": {"kernel": "/k"}, "cpus": cpus}))
                .unwrap_err()
                .to_string()
        };
        assert!(e(json!({"boot_vcpus": 1, "max_vcpus": 4,
            "topology": {"threads_per_core": 1, "cores_per_die": 2, "dies_per_package": 1, "packages": 1}}))
        .contains("topology=\"1:2:1:1\" is invalid: expected parts whose product (2) equals max=4"));
        assert!(
            e(json!({"boot_vcpus": 1, "max_vcpus": 4, "topology": {"threads_per_core": 1}}))
                .contains("missing field `cores_per_die`")
        );
        assert!(e(json!({"boot_vcpus": 5, "max_vcpus": 4})).contains("at most max=4"));
        assert!(e(json!({"boot_vcpus": 1, "max_vcpus": 300})).contains("1 to 254 vCPUs"));
    }

    #[test]
    fn vm_config_round_trips_through_info() {
        let body = json!({
            "payload": {"kernel": "/k", "initramfs": "/i", "cmdline": "console=ttyS0"},
            "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
            "memory": {"size": 536870912u64, "shared": true},
            "serial": {"mode": "Tty"},
            "fs": [{"tag": "t", "socket": "/s", "num_queues": 1, "queue_size": 1024, "id": "fs0", "cache_size": 33554432}],
        });
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(
            (c.cpus.boot_vcpus, c.memory.size, c.serial.clone()),
            (2, 512 << 20, SerialMode::Tty)
        );
        assert_eq!(vm_config_from_json(&vm_config_to_json(&c)).unwrap(), c);
    }

    #[test]
    fn cloud_hypervisors_own_vm_info_config_creates_a_vm_and_round_trips() {
        // Every field CH's vm.info fills; CH's defaults are accepted.
        let body = crate::config::ch_fields::tests::ch_vm_info_config();
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(
            c.rng,
            Some(RngConfig::default()),
            "rng is on, from /dev/urandom, as in CH"
        );
        assert!(!c.pvpanic, "pvpanic: false is honoured (no device)");
        let info = vm_config_to_json(&c);
        for key in [
            "kvm_hyperv",
            "max_phys_bits",
            "nested",
            "core_scheduling",
            "profile",
        ] {
            assert!(info["cpus"].get(key).is_some(), "vm.info has cpus.{key}");
        }
        assert_eq!(info["memory"]["thp"], true);
        assert_eq!(info["debug_console"]["iobase"], 233);
        assert_eq!(
            vm_config_from_json(&info).unwrap(),
            c,
            "vm.info's config creates the same VM"
        );
        // Without rng or pvpanic: both on.
        let c = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).unwrap();
        assert!(c.rng.is_some() && c.pvpanic);
    }

    #[test]
    fn kata_puts_its_share_on_segment_one_of_two() {
        // What Kata's clh driver sends: platform.num_pci_segments 2 and the
        // virtio-fs share with pci_segment 1 (generated client's defaults).
        let body = json!({
            "payload": {"kernel": "/k"},
            "memory": {"size": 536870912u64, "shared": true},
            "platform": {"num_pci_segments": 2, "iommu_segments": null, "tdx": false},
            "fs": [{"tag": "kataShared", "socket": "/run/vc/vm/x/vhost-fs.sock", "num_queues": 1,
                    "queue_size": 1024, "pci_segment": 1}],
            "disks": [{"path": "/d", "pci_segment": 0}],
        });
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(c.platform.num_pci_segments, 2);
        assert_eq!((c.fs[0].pci_segment, c.disks[0].pci_segment), (1, 0));
        let info = vm_config_to_json(&c);
        assert_eq!(info["platform"]["num_pci_segments"], 2);
        assert_eq!(info["fs"][0]["pci_segment"], 1);
        assert_eq!(vm_config_from_json(&info).unwrap(), c);

        let e = |v: Value| vm_config_from_json(&v).unwrap_err().to_string();
        let mut one = body.clone();
        one["platform"] = json!({"num_pci_segments": 1});
        assert!(e(one).starts_with("--fs: device \"_fs0\": pci_segment=1 does not exist"));
        let mut many = body.clone();
        many["platform"]["num_pci_segments"] = json!(97);
        assert!(e(many).contains("num_pci_segments=\"97\" is invalid: expected 1 to 96"));
        let mut apertures = body.clone();
        apertures["pci_segments"] = json!([{"pci_segment": 1, "mmio32_aperture_weight": 2}]);
        assert!(e(apertures).starts_with("VmConfig.pci_segments=[{"));
        let mut iommu = body.clone();
        iommu["platform"]["iommu_segments"] = json!([0]);
        assert!(e(iommu).starts_with("VmConfig.platform.iommu_segments=[0] is not supported"));
        let mut mmio = body;
        mmio["fs"][0]["transport"] = json!("mmio");
        assert!(e(mmio).contains("--fs: pci_segment=1 is not supported: a transport=mmio device"));
        // A hot-plug body names its segment the same way.
        let f =
            fs_config_from_json(&json!({"tag": "t", "socket": "/s", "pci_segment": 1}), 0).unwrap();
        assert_eq!(f.pci_segment, 1);
    }

    #[test]
    fn vm_config_errors() {
        let e = |v: Value| vm_config_from_json(&v).unwrap_err().to_string();
        assert!(e(
            json!({"payload": {"kernel": "/k"}, "rng": {"src": "/dev/urandom", "iommu": true}})
        )
        .contains("iommu=on"));
        assert!(e(json!({"payload": {"kernel": "/k"}, "frobnicate": 1}))
            .contains("VmConfig.frobnicate: unknown field"));
        assert!(e(
            json!({"payload": {"kernel": "/k"}, "disks": [{"path": "/d", "vhost_user": true}]})
        )
        .contains("--disk: vhost_user=on is not supported"));
        assert!(
            e(json!({"payload": {"kernel": "/k"}, "vdpa": [{"path": "/v"}]}))
                .contains("VmConfig.vdpa=[{\"path\":\"/v\"}] is not supported")
        );
        assert!(e(json!({"payload": {}})).contains("payload.kernel"));
        // docs/openapi.yaml: kernel has minLength 1 (the fuzzer's vm.create
        // with "" was created, then failed only at boot).
        assert!(e(json!({"payload": {"kernel": ""}}))
            .contains("payload.kernel=\"\" is invalid: expected a path to the kernel image"));
        assert!(
            e(json!({"payload": {"kernel": "/k"}, "memory": {"size": 1024}}))
                .contains("between 32M and 512G")
        );
        assert!(
            e(json!({"payload": {"kernel": "/k"}, "fs": [{"tag": "t", "socket": "s"}]}))
                .contains("shared=on")
        );
        assert!(
            e(json!({"payload": {"kernel": "/k"}, "console": {"mode": "Tty"}}))
                .contains("virtio-console")
        );
    }

    #[test]
    fn kata_memory_with_acpi_hotplug_is_accepted_and_round_trips() {
        // clh.go: NewMemoryConfig(size)'s defaults, shared for virtio-fs,
        // HotplugSize from default_maxmemory; Go's omitempty drops the rest.
        let body = json!({"payload": {"kernel": "/k"},
            "memory": {"size": 536870912u64, "hotplug_size": 1073741824u64, "mergeable": false,
                       "hotplug_method": "Acpi", "shared": true, "hugepages": false,
                       "prefault": false, "thp": true}});
        let c = vm_config_from_json(&body).unwrap();
        assert_eq!(c.memory.hotplug_size, Some(1 << 30));
        let info = vm_config_to_json(&c);
        assert_eq!(info["memory"]["hotplug_size"], 1u64 << 30);
        assert_eq!(info["memory"]["hotplug_method"], "Acpi");
        assert_eq!(vm_config_from_json(&info).unwrap(), c);
        let mut virtio_mem = body.clone();
        virtio_mem["memory"]["hotplug_method"] = json!("VirtioMem");
        let e = vm_config_from_json(&virtio_mem).unwrap_err().to_string();
        assert!(e.contains("memory.hotplug_method=\"VirtioMem\""), "{e}");
        let mut small = body;
        small["memory"]["hotplug_size"] = json!(64u64 << 20);
        let e = vm_config_from_json(&small).unwrap_err().to_string();
        assert!(e.contains("hotplug_size") && e.contains("128M"), "{e}");
    }
}
