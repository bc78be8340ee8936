//! The VM configuration: one serde type per part (Cloud Hypervisor's JSON
//! field names and defaults), filled by the command line (Cloud
//! Hypervisor's `key=value` syntax) and by the API ([`json`]) alike, each
//! checked by its own `validate`.

mod ch_fields;
mod checks;
mod cpus;
mod device;
mod disk;
mod fs;
pub mod json;
mod net;
mod option_parser;
mod passed;
mod platform;
mod pmem;
mod restore;
mod rng;
mod vsock;

pub use checks::Transport;
pub use cpus::{CpuTopology, CpusConfig, MAX_VCPUS};
pub use device::DeviceConfig;
pub use disk::DiskConfig;
pub use fs::FsConfig;
pub use net::{NetConfig, TapFds, DEFAULT_TAP_NAME};
pub use passed::PassedFd;
pub use platform::{PlatformConfig, MAX_PCI_SEGMENTS};
pub use pmem::PmemConfig;
pub use restore::{file_url_dir, RestoreConfig, RestoredNet, SnapshotConfig, FILE_URL_EXPECTED};
pub use rng::{RngConfig, DEFAULT_RNG_SOURCE};
pub use vsock::VsockConfig;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use checks::invalid;
pub use option_parser::{parse_size, parse_toggle, OptionValues};

/// Smallest guest RAM a Linux kernel plus initramfs can sensibly boot in.
pub const MIN_MEMORY: u64 = 32 << 20;
/// Largest guest RAM: keeps every guest-physical address below 1 TiB, well
/// inside the physical address width of every x86-64 host.
pub const MAX_MEMORY: u64 = 512 << 30;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--{option}: unknown key \"{key}\" (accepted keys: {accepted})")]
    UnknownKey {
        option: &'static str,
        key: String,
        accepted: String,
    },
    #[error("--{option}: \"{item}\" is not key=value (accepted keys: {accepted})")]
    Malformed {
        option: &'static str,
        item: String,
        accepted: String,
    },
    #[error("--{option}: key \"{key}\" given twice")]
    DuplicateKey { option: &'static str, key: String },
    #[error("--{option}: {key}=\"{value}\" is invalid: expected {expected}")]
    InvalidValue {
        option: &'static str,
        key: &'static str,
        value: String,
        expected: String,
    },
    #[error("--{option}: missing required key \"{key}\"")]
    MissingKey {
        option: &'static str,
        key: &'static str,
    },
    #[error("--{option}: {message}")]
    Unsupported {
        option: &'static str,
        message: String,
    },
    #[error("--{option}: device id \"{id}\" is used twice")]
    DuplicateId { option: &'static str, id: String },
}

/// Guest RAM: the part of Cloud Hypervisor's MemoryConfig this VMM
/// implements (its JSON field names and defaults; the rest is checked by
/// [`ch_fields`]), what `--memory` and `vm.create` both fill and
/// [`MemoryConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    pub size: u64,
    /// Back RAM with a memfd mapped `MAP_SHARED`, so a vhost-user backend can map it.
    #[serde(default)]
    pub shared: bool,
    /// Back RAM with huge pages (`MFD_HUGETLB`); implies a memfd.
    #[serde(default)]
    pub hugepages: bool,
    /// Guest-physical space reserved above RAM for ACPI memory hot-plug
    /// (`vm.resize` with `desired_ram`); None: no hot-plug.
    #[serde(default)]
    pub hotplug_size: Option<u64>,
}

/// ACPI memory hot-plug adds RAM in blocks of this size (Linux's memory
/// block and section size on x86-64; Cloud Hypervisor's DIMM granularity).
pub const HOTPLUG_BLOCK: u64 = 128 << 20;

impl Default for MemoryConfig {
    fn default() -> Self {
        // Cloud Hypervisor's default.
        MemoryConfig {
            size: 512 << 20,
            shared: false,
            hugepages: false,
            hotplug_size: None,
        }
    }
}

impl MemoryConfig {
    /// Fills a config from `--memory` and checks it.
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        let o = OptionValues::parse(
            "memory",
            input,
            &[
                "size",
                "shared",
                "hugepages",
                "hotplug_size",
                "hotplug_method",
            ],
        )?;
        // Cloud Hypervisor's other hot-plug method, on its command line
        // only (its JSON's is checked by ch_fields).
        match o.get("hotplug_method") {
            None | Some("acpi") => {}
            Some("virtio-mem") => {
                return Err(o.unsupported(
                    "hotplug_method",
                    "there is no virtio-mem device; use hotplug_method=acpi",
                ))
            }
            Some(other) => return Err(o.invalid("hotplug_method", other, "acpi")),
        }
        let config = MemoryConfig {
            size: o
                .convert("size", parse_size)?
                .unwrap_or(MemoryConfig::default().size),
            shared: o.toggle("shared")?.unwrap_or(false),
            hugepages: o.toggle("hugepages")?.unwrap_or(false),
            hotplug_size: o.convert("hotplug_size", parse_size)?,
        };
        config.validate()?;
        Ok(config)
    }

    /// The size limits of RAM and of its hot-plug area, for the command
    /// line and the API alike.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "memory";
        let size = self.size;
        let shown = dax_abi::size_text(size);
        if !(MIN_MEMORY..=MAX_MEMORY).contains(&size) {
            return Err(invalid(OPTION, "size", shown, "between 32M and 512G"));
        }
        if !size.is_multiple_of(4096) {
            return Err(invalid(OPTION, "size", shown, "a multiple of 4K"));
        }
        if self.hugepages && !size.is_multiple_of(2 << 20) {
            return Err(invalid(
                OPTION,
                "size",
                shown,
                "a multiple of 2M with hugepages=on",
            ));
        }
        let Some(hotplug) = self.hotplug_size else {
            return Ok(());
        };
        // At least one block, and RAM plus the hot-plug area within MAX_MEMORY.
        let given = dax_abi::size_text(hotplug);
        let limit = MAX_MEMORY - size;
        if !(HOTPLUG_BLOCK..=limit).contains(&hotplug) {
            return Err(invalid(
                OPTION,
                "hotplug_size",
                given,
                format!(
                    "between 128M (one hot-plug block) and {limit} bytes \
                     (size plus hotplug_size at most 512G)"
                ),
            ));
        }
        if !hotplug.is_multiple_of(4096) {
            return Err(invalid(OPTION, "hotplug_size", given, "a multiple of 4K"));
        }
        Ok(())
    }

    /// RAM plus the whole hot-plug area: what `vm.resize` can grow RAM to.
    pub fn max_size(&self) -> u64 {
        self.size + self.hotplug_size.unwrap_or(0)
    }
}

/// Where the 16550 serial port's output goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialMode {
    /// No serial device at all.
    Off,
    /// The device exists; its output is discarded.
    Null,
    /// Output to the VMM's stdout, input from its stdin.
    Tty,
    File(PathBuf),
}

impl SerialMode {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        match input {
            "off" => Ok(SerialMode::Off),
            "null" => Ok(SerialMode::Null),
            "tty" => Ok(SerialMode::Tty),
            "pty" | "socket" => Err(ConfigError::Unsupported {
                option: "serial",
                message: format!("\"{input}\" is not supported; use tty, off, null or file=PATH"),
            }),
            _ => {
                let o = OptionValues::parse("serial", input, &["file"])?;
                match o.get("file") {
                    Some("") | None => Err(ConfigError::MissingKey {
                        option: "serial",
                        key: "file",
                    }),
                    Some(path) => Ok(SerialMode::File(PathBuf::from(path))),
                }
            }
        }
    }
}

impl SerialMode {
    /// Cloud Hypervisor's ConsoleConfig `mode` (any case) and `file`, as
    /// `option` (`serial` or `console`) has them.
    fn from_mode(
        mode: &str,
        file: Option<PathBuf>,
        option: &'static str,
    ) -> Result<Self, ConfigError> {
        match (mode.to_ascii_lowercase().as_str(), file) {
            ("file", Some(f)) => Ok(SerialMode::File(f)),
            ("file", None) => Err(ConfigError::MissingKey {
                option,
                key: "file",
            }),
            (m, _) => SerialMode::parse(m),
        }
    }

    /// Cloud Hypervisor's spelling of the mode in JSON.
    fn mode_name(&self) -> &'static str {
        match self {
            SerialMode::Off => "Off",
            SerialMode::Null => "Null",
            SerialMode::Tty => "Tty",
            SerialMode::File(_) => "File",
        }
    }
}

/// Cloud Hypervisor's ConsoleConfig: `{"mode": …, "file": …}`, the file
/// only with mode `File`.
impl Serialize for SerialMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("mode", self.mode_name())?;
        if let SerialMode::File(f) = self {
            map.serialize_entry("file", f)?;
        }
        map.end()
    }
}

/// The fields of Cloud Hypervisor's ConsoleConfig this VMM reads (the
/// others are checked by [`ch_fields`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleFields {
    mode: String,
    file: Option<PathBuf>,
}

impl<'de> Deserialize<'de> for SerialMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let f = ConsoleFields::deserialize(d)?;
        SerialMode::from_mode(&f.mode, f.file, "serial").map_err(serde::de::Error::custom)
    }
}

/// A VmConfig's `console`: only mode `Off`.
fn deserialize_console<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SerialMode, D::Error> {
    let f = ConsoleFields::deserialize(d)?;
    match f.mode.to_ascii_lowercase().as_str() {
        "off" => Ok(SerialMode::Off),
        other => Err(serde::de::Error::custom(ConfigError::Unsupported {
            option: "console",
            message: format!(
                "mode \"{other}\" needs a virtio-console, which this VMM does not have; use \"Off\""
            ),
        })),
    }
}

/// `--console` (and a VmConfig's `console`): Cloud Hypervisor's
/// virtio-console. Only off exists here.
pub fn parse_console(input: &str) -> Result<SerialMode, ConfigError> {
    match input {
        "off" => Ok(SerialMode::Off),
        other => Err(no_console(other)),
    }
}

/// Why a console other than off is refused, and what to use instead.
fn no_console(given: &str) -> ConfigError {
    ConfigError::Unsupported {
        option: "console",
        message: format!(
            "\"{given}\" needs a virtio-console, which this VMM does not have; \
             use --console off and --serial tty"
        ),
    }
}

/// The kernel and how it boots: Cloud Hypervisor's PayloadConfig (its
/// JSON field names; firmware and the confidential-guest fields are
/// checked by [`ch_fields`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    /// Required: empty only where a VmConfig left it out, which
    /// [`json::vm_config_from_json`] refuses by name first.
    #[serde(default)]
    pub kernel: PathBuf,
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: String,
}

impl PayloadConfig {
    /// The schema's minLength 1: an empty path would pass here and fail
    /// only at boot, after the VM was reported created.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.kernel.as_os_str().is_empty() {
            return Err(ConfigError::InvalidValue {
                option: "kernel",
                key: "payload.kernel",
                value: String::new(),
                expected: "a path to the kernel image (not empty)".into(),
            });
        }
        Ok(())
    }
}

/// The VM's whole configuration: Cloud Hypervisor's VmConfig (its JSON
/// field names and defaults, the parts this VMM implements), what the
/// command line and `vm.create` both fill, [`VmConfig::validated`] checks
/// and `vm.info` reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub payload: PayloadConfig,
    #[serde(default)]
    pub cpus: CpusConfig,
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Null when a VmConfig has none.
    #[serde(default = "serial_null")]
    pub serial: SerialMode,
    /// Always off (there is no virtio-console): [`parse_console`].
    #[serde(default = "console_off", deserialize_with = "deserialize_console")]
    pub console: SerialMode,
    #[serde(default)]
    pub pmem: Vec<PmemConfig>,
    #[serde(default)]
    pub fs: Vec<FsConfig>,
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// virtio-net devices on taps.
    #[serde(default)]
    pub net: Vec<NetConfig>,
    /// The virtio-rng device (on by default, as in Cloud Hypervisor, whose
    /// VmConfig always has one).
    #[serde(default = "rng_on", skip_serializing_if = "Option::is_none")]
    pub rng: Option<RngConfig>,
    /// The virtio-vsock device (at most one, as in Cloud Hypervisor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// The pvpanic device (I/O port 0x505): the guest reports a panic and
    /// the VMM exits with status 3. On unless a VmConfig says `false`.
    #[serde(default = "pvpanic_on")]
    pub pvpanic: bool,
    /// The PCI segments the devices' `pci_segment` choose from.
    #[serde(default)]
    pub platform: PlatformConfig,
}

fn serial_null() -> SerialMode {
    SerialMode::Null
}

fn console_off() -> SerialMode {
    SerialMode::Off
}

fn rng_on() -> Option<RngConfig> {
    Some(RngConfig::default())
}

fn pvpanic_on() -> bool {
    true
}

impl VmConfig {
    /// Drops the fs, pmem, disk, net or vsock device named `id`; false if
    /// there is none.
    pub fn remove_device(&mut self, id: &str) -> bool {
        let count = |c: &Self| {
            c.fs.len() + c.pmem.len() + c.disks.len() + c.net.len() + usize::from(c.vsock.is_some())
        };
        let before = count(self);
        self.fs.retain(|f| f.id != id);
        self.pmem.retain(|p| p.id != id);
        self.disks.retain(|d| d.id != id);
        self.net.retain(|n| n.id != id);
        if self.vsock.as_ref().is_some_and(|v| v.id == id) {
            self.vsock = None;
        }
        count(self) != before
    }

    /// Names the devices given without an id, checks every part and then
    /// the whole: what `vm.create` does with a VmConfig it deserialized
    /// (the command line checks each part as it parses it).
    pub fn validated(mut self) -> Result<Self, ConfigError> {
        fn each<T>(
            items: Vec<T>,
            check: impl Fn(T, usize) -> Result<T, ConfigError>,
        ) -> Result<Vec<T>, ConfigError> {
            items
                .into_iter()
                .enumerate()
                .map(|(i, item)| check(item, i))
                .collect()
        }
        self.payload.validate()?;
        self.cpus = self.cpus.validated()?;
        self.memory.validate()?;
        if self.console != SerialMode::Off {
            return Err(no_console(&self.console.mode_name().to_ascii_lowercase()));
        }
        self.pmem = each(self.pmem, PmemConfig::validated)?;
        self.fs = each(self.fs, FsConfig::validated)?;
        self.disks = each(self.disks, DiskConfig::validated)?;
        self.net = each(self.net, NetConfig::validated)?;
        if let Some(rng) = &self.rng {
            rng.validate()?;
        }
        self.vsock = self.vsock.map(VsockConfig::validated).transpose()?;
        self.platform.validate()?;
        self.validate()?;
        Ok(self)
    }

    /// Checks what no single option can: ids are unique, vhost-user devices
    /// have RAM they can map.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.fs.is_empty() && !self.memory.shared {
            return Err(ConfigError::Unsupported {
                option: "fs",
                message: "a vhost-user daemon must map guest RAM: add shared=on to --memory".into(),
            });
        }
        let mut ids: Vec<(&str, &'static str)> = self
            .pmem
            .iter()
            .map(|p| (p.id.as_str(), "pmem"))
            .chain(self.fs.iter().map(|f| (f.id.as_str(), "fs")))
            .chain(self.disks.iter().map(|d| (d.id.as_str(), "disk")))
            .chain(self.vsock.iter().map(|v| (v.id.as_str(), "vsock")))
            .chain(self.net.iter().map(|n| (n.id.as_str(), "net")))
            .collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ConfigError::DuplicateId {
                option: w[1].1,
                id: w[0].0.to_string(),
            });
        }
        self.check_pci_segments()
    }

    /// Every device's `pci_segment` names a segment the VM has.
    fn check_pci_segments(&self) -> Result<(), ConfigError> {
        let segments = self
            .pmem
            .iter()
            .map(|p| ("pmem", p.id.as_str(), p.pci_segment))
            .chain(self.fs.iter().map(|f| ("fs", f.id.as_str(), f.pci_segment)))
            .chain(
                self.disks
                    .iter()
                    .map(|d| ("disk", d.id.as_str(), d.pci_segment)),
            )
            .chain(
                self.net
                    .iter()
                    .map(|n| ("net", n.id.as_str(), n.pci_segment)),
            )
            .chain(
                self.vsock
                    .iter()
                    .map(|v| ("vsock", v.id.as_str(), v.pci_segment)),
            )
            .chain(self.rng.iter().map(|r| ("rng", "_rng", r.pci_segment)));
        let limit = self.platform.num_pci_segments;
        for (option, id, segment) in segments {
            if segment >= limit {
                return Err(ConfigError::Unsupported {
                    option,
                    message: format!(
                        "device \"{id}\": pci_segment={segment} does not exist: the VM has {limit} PCI segment(s), \
                         so pci_segment must be below {limit} (raise platform num_pci_segments, at most {MAX_PCI_SEGMENTS})"
                    ),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory() {
        let m = MemoryConfig::parse("size=1G,shared=on").unwrap();
        assert_eq!(
            m,
            MemoryConfig {
                size: 1 << 30,
                shared: true,
                hugepages: false,
                hotplug_size: None,
            }
        );
        assert!(!MemoryConfig::parse("size=512M").unwrap().shared);
        assert!(MemoryConfig::parse("size=1M")
            .unwrap_err()
            .to_string()
            .contains("between 32M and 512G"));
        assert!(MemoryConfig::parse("size=1T").is_err());
        assert!(MemoryConfig::parse("size=33554433")
            .unwrap_err()
            .to_string()
            .contains("multiple of 4K"));
        assert!(MemoryConfig::parse("size=1G,shared=yes")
            .unwrap_err()
            .to_string()
            .contains("on or off"));
        assert!(MemoryConfig::parse("size=33M,hugepages=on")
            .unwrap_err()
            .to_string()
            .contains("2M"));
    }

    #[test]
    fn memory_hotplug_keys() {
        let m = MemoryConfig::parse("size=512M,hotplug_size=1G,hotplug_method=acpi").unwrap();
        assert_eq!(m.hotplug_size, Some(1 << 30));
        assert_eq!(m.max_size(), 3 << 29);
        assert_eq!(
            MemoryConfig::parse("size=512M,hotplug_size=1G")
                .unwrap()
                .hotplug_size,
            Some(1 << 30),
            "acpi is the default method"
        );
        let err = |s: &str| MemoryConfig::parse(s).unwrap_err().to_string();
        let e = err("size=512M,hotplug_size=1G,hotplug_method=virtio-mem");
        assert!(
            e.contains("hotplug_method=virtio-mem") && e.contains("virtio-mem device"),
            "{e}"
        );
        let e = err("hotplug_size=1G,hotplug_method=dimm");
        assert!(e.contains("hotplug_method") && e.contains("acpi"), "{e}");
        let e = err("size=512M,hotplug_size=64M");
        assert!(e.contains("hotplug_size") && e.contains("128M"), "{e}");
        let e = err("size=256G,hotplug_size=257G");
        assert!(
            e.contains("hotplug_size") && e.contains(&(256u64 << 30).to_string()),
            "{e}"
        );
        let e = err("size=512M,hotplug_size=134218240");
        assert!(e.contains("hotplug_size") && e.contains("4K"), "{e}");
        assert!(MemoryConfig::parse("size=256G,hotplug_size=256G").is_ok());
    }

    #[test]
    fn every_devices_segment_must_exist() {
        let mut cfg = VmConfig {
            payload: PayloadConfig {
                kernel: "k".into(),
                initramfs: None,
                cmdline: String::new(),
            },
            cpus: CpusConfig::default(),
            memory: MemoryConfig::parse("size=512M,shared=on").unwrap(),
            serial: SerialMode::Off,
            console: SerialMode::Off,
            pmem: vec![PmemConfig::parse("file=p,id=pm", 0).unwrap()],
            fs: vec![FsConfig::parse("tag=t,socket=s,id=share,pci_segment=1", 0).unwrap()],
            disks: vec![DiskConfig::parse("path=d,id=root", 0).unwrap()],
            net: vec![],
            rng: RngConfig::parse("src=/dev/urandom,pci_segment=1").unwrap(),
            vsock: None,
            pvpanic: true,
            platform: PlatformConfig::default(),
        };
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "--fs: device \"share\": pci_segment=1 does not exist: the VM has 1 PCI segment(s), \
             so pci_segment must be below 1 (raise platform num_pci_segments, at most 96)"
        );
        cfg.platform = PlatformConfig::parse("num_pci_segments=2").unwrap();
        assert!(cfg.validate().is_ok());
        cfg.disks[0].pci_segment = 2;
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.starts_with("--disk: device \"root\": pci_segment=2 does not exist")
                && e.contains("below 2"),
            "{e}"
        );
        cfg.disks[0].pci_segment = 0;
        cfg.rng.as_mut().unwrap().pci_segment = 5;
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("--rng: device \"_rng\": pci_segment=5"));
    }

    #[test]
    fn fs_needs_shared_memory_and_ids_are_unique() {
        let mut cfg = VmConfig {
            payload: PayloadConfig {
                kernel: "k".into(),
                initramfs: None,
                cmdline: String::new(),
            },
            cpus: CpusConfig::default(),
            memory: MemoryConfig::default(),
            serial: SerialMode::Off,
            console: SerialMode::Off,
            pmem: vec![PmemConfig::parse("file=p,id=dev0", 0).unwrap()],
            fs: vec![FsConfig::parse("tag=t,socket=s,id=dev1", 0).unwrap()],
            disks: vec![DiskConfig::parse("path=d,id=dev2", 0).unwrap()],
            net: vec![NetConfig::parse("tap=t0,id=dev4", 0).unwrap()],
            rng: None,
            vsock: None,
            pvpanic: true,
            platform: PlatformConfig::default(),
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("shared=on"));
        cfg.memory.shared = true;
        assert!(cfg.validate().is_ok());
        cfg.fs[0].id = "dev0".into();
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("\"dev0\" is used twice"));
        cfg.fs[0].id = "dev1".into();
        cfg.disks[0].id = "dev1".into();
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "--fs: device id \"dev1\" is used twice"
        );
        cfg.fs[0].id = "dev3".into();
        cfg.pmem[0].id = "dev1".into();
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("\"dev1\" is used twice"));
        cfg.pmem[0].id = "dev4".into();
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("\"dev4\" is used twice"));
        cfg.pmem[0].id = "dev0".into();
        assert!(cfg.remove_device("dev0") && cfg.pmem.is_empty());
        cfg.fs.clear();
        assert!(cfg.remove_device("dev1") && cfg.disks.is_empty());
        assert!(!cfg.remove_device("dev1"));
        assert!(cfg.remove_device("dev4") && cfg.net.is_empty());
        assert!(!cfg.remove_device("dev4"));
    }

    #[test]
    fn serial_and_console() {
        assert_eq!(SerialMode::parse("tty").unwrap(), SerialMode::Tty);
        assert_eq!(SerialMode::parse("off").unwrap(), SerialMode::Off);
        assert_eq!(SerialMode::parse("null").unwrap(), SerialMode::Null);
        assert_eq!(
            SerialMode::parse("file=/tmp/x").unwrap(),
            SerialMode::File("/tmp/x".into())
        );
        assert!(SerialMode::parse("file=").is_err());
        assert!(SerialMode::parse("pty")
            .unwrap_err()
            .to_string()
            .contains("not supported"));
        assert!(SerialMode::parse("bogus")
            .unwrap_err()
            .to_string()
            .starts_with("--serial:"));
        assert_eq!(parse_console("off").unwrap(), SerialMode::Off);
        assert!(parse_console("tty")
            .unwrap_err()
            .to_string()
            .contains("virtio-console"));
    }
}
