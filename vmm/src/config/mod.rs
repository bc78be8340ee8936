//! The VM configuration and its parsing from Cloud Hypervisor's command-line syntax.

mod ch_fields;
mod checks;
mod cpus;
mod disk;
mod fs;
pub mod json;
mod net;
mod option_parser;
mod platform;
mod pmem;
mod rng;
mod vsock;

pub use checks::Transport;
pub use cpus::{CpuTopology, CpusConfig, CPUS_KEYS, MAX_VCPUS};
pub use disk::{DiskConfig, DISK_KEYS};
pub use fs::FsConfig;
pub use net::{NetConfig, DEFAULT_TAP_NAME, NET_KEYS};
pub use platform::{PlatformConfig, MAX_PCI_SEGMENTS, PLATFORM_KEYS};
pub use pmem::PmemConfig;
pub use rng::{RngConfig, DEFAULT_RNG_SOURCE, RNG_KEYS};
pub use vsock::{VsockConfig, VSOCK_KEYS};

use std::path::PathBuf;

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryConfig {
    pub size: u64,
    /// Back RAM with a memfd mapped `MAP_SHARED`, so a vhost-user backend can map it.
    pub shared: bool,
    /// Back RAM with huge pages (`MFD_HUGETLB`); implies a memfd.
    pub hugepages: bool,
    /// Guest-physical space reserved above RAM for ACPI memory hot-plug
    /// (`vm.resize` with `desired_ram`); None: no hot-plug.
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
        let mut cfg = MemoryConfig::default();
        if let Some(size) = o.convert("size", parse_size)? {
            if !(MIN_MEMORY..=MAX_MEMORY).contains(&size) {
                return Err(o.invalid("size", o.get("size").unwrap_or(""), "between 32M and 512G"));
            }
            if size % 4096 != 0 {
                return Err(o.invalid("size", o.get("size").unwrap_or(""), "a multiple of 4K"));
            }
            cfg.size = size;
        }
        cfg.shared = o.convert("shared", parse_toggle)?.unwrap_or(false);
        cfg.hugepages = o.convert("hugepages", parse_toggle)?.unwrap_or(false);
        if cfg.hugepages && cfg.size % (2 << 20) != 0 {
            return Err(o.invalid(
                "size",
                o.get("size").unwrap_or(""),
                "a multiple of 2M with hugepages=on",
            ));
        }
        cfg.hotplug_size = Self::parse_hotplug(&o, cfg.size)?;
        Ok(cfg)
    }

    /// `hotplug_size` and `hotplug_method`: ACPI hot-plug only, at least
    /// one block, and RAM plus the hot-plug area within [`MAX_MEMORY`].
    fn parse_hotplug(o: &OptionValues, size: u64) -> Result<Option<u64>, ConfigError> {
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
        let Some(hotplug) = o.convert("hotplug_size", parse_size)? else {
            return Ok(None);
        };
        let given = o.get("hotplug_size").unwrap_or("");
        let limit = MAX_MEMORY - size;
        if !(HOTPLUG_BLOCK..=limit).contains(&hotplug) {
            return Err(o.invalid(
                "hotplug_size",
                given,
                &format!(
                    "between 128M (one hot-plug block) and {limit} bytes \
                     (size plus hotplug_size at most 512G)"
                ),
            ));
        }
        if hotplug % 4096 != 0 {
            return Err(o.invalid("hotplug_size", given, "a multiple of 4K"));
        }
        Ok(Some(hotplug))
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

/// `--console`: Cloud Hypervisor's virtio-console. Only `off` exists here.
pub fn parse_console(input: &str) -> Result<(), ConfigError> {
    match input {
        "off" => Ok(()),
        other => Err(ConfigError::Unsupported {
            option: "console",
            message: format!(
                "\"{other}\" needs a virtio-console, which this VMM does not have; \
                 use --console off and --serial tty"
            ),
        }),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadConfig {
    pub kernel: PathBuf,
    pub initramfs: Option<PathBuf>,
    pub cmdline: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmConfig {
    pub payload: PayloadConfig,
    pub cpus: CpusConfig,
    pub memory: MemoryConfig,
    pub serial: SerialMode,
    pub pmem: Vec<PmemConfig>,
    pub fs: Vec<FsConfig>,
    pub disks: Vec<DiskConfig>,
    /// virtio-net devices on taps.
    pub net: Vec<NetConfig>,
    /// The virtio-rng device (on by default, as in Cloud Hypervisor).
    pub rng: Option<RngConfig>,
    /// The virtio-vsock device (at most one, as in Cloud Hypervisor).
    pub vsock: Option<VsockConfig>,
    /// The pvpanic device (I/O port 0x505): the guest reports a panic and
    /// the VMM exits with status 3. On unless a VmConfig says `false`.
    pub pvpanic: bool,
    /// The PCI segments the devices' `pci_segment` choose from.
    pub platform: PlatformConfig,
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
        assert!(parse_console("off").is_ok());
        assert!(parse_console("tty")
            .unwrap_err()
            .to_string()
            .contains("virtio-console"));
    }
}
