//! The VM configuration and its parsing from Cloud Hypervisor's command-line syntax.

mod ch_fields;
mod cpus;
mod disk;
mod fs;
pub mod json;
mod net;
mod option_parser;
mod pmem;
mod rng;
mod vsock;

pub use cpus::{CpuTopology, CpusConfig, CPUS_KEYS, MAX_VCPUS};
pub use disk::{DiskConfig, DISK_KEYS};
pub use fs::FsConfig;
pub use net::{NetConfig, DEFAULT_TAP_NAME, NET_KEYS};
pub use pmem::{PmemConfig, Transport};
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
}

impl Default for MemoryConfig {
    fn default() -> Self {
        // Cloud Hypervisor's default.
        MemoryConfig {
            size: 512 << 20,
            shared: false,
            hugepages: false,
        }
    }
}

impl MemoryConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        let o = OptionValues::parse("memory", input, &["size", "shared", "hugepages"])?;
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
        Ok(cfg)
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
                hugepages: false
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
