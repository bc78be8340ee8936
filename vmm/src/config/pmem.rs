//! `--pmem file=<path>[,size=<size>][,discard_writes=on|off][,id=<id>][,transport=pci|mmio]`,
//! Cloud Hypervisor's keys plus our `transport`.

use std::path::PathBuf;

use super::option_parser::{parse_size, parse_toggle, OptionValues};
use super::ConfigError;

/// How a virtio device reaches the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Transport {
    #[default]
    Pci,
    Mmio,
}

impl Transport {
    pub fn parse(v: &str) -> Result<Self, &'static str> {
        match v {
            "pci" => Ok(Transport::Pci),
            "mmio" => Ok(Transport::Mmio),
            _ => Err("pci or mmio"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmemConfig {
    pub file: PathBuf,
    /// None: the file's own size.
    pub size: Option<u64>,
    pub discard_writes: bool,
    pub id: String,
    pub transport: Transport,
    /// The PCI segment the device is on (virtio-PCI only).
    pub pci_segment: u16,
}

const TWO_MIB: u64 = 2 << 20;

/// Keys `--pmem` accepts.
pub const PMEM_KEYS: &[&str] = &[
    "file",
    "size",
    "discard_writes",
    "id",
    "transport",
    "iommu",
    "pci_segment",
];

impl PmemConfig {
    /// `index` names devices given without `id=` (`_pmem0`, `_pmem1`, … as
    /// Cloud Hypervisor does).
    pub fn parse(input: &str, index: usize) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("pmem", input, PMEM_KEYS)?, index)
    }

    /// Checks and converts the values of `--pmem` (or of an API PmemConfig).
    pub fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        // Cloud Hypervisor's defaults are accepted, since ch-remote sends them.
        o.check_ch_defaults()?;
        let (transport, pci_segment) = o.transport_and_segment()?;
        let file = o.get("file").ok_or(ConfigError::MissingKey {
            option: "pmem",
            key: "file",
        })?;
        if file.is_empty() {
            return Err(o.invalid("file", "", "a file or directory path"));
        }
        let size = o.convert("size", parse_size)?;
        if let Some(size) = size {
            if size == 0 || size % TWO_MIB != 0 {
                return Err(o.invalid(
                    "size",
                    o.get("size").unwrap_or(""),
                    "a non-zero multiple of 2M",
                ));
            }
        }
        Ok(PmemConfig {
            file: PathBuf::from(file),
            size,
            discard_writes: o.convert("discard_writes", parse_toggle)?.unwrap_or(false),
            id: o.device_id("pmem", index)?,
            transport,
            pci_segment,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cloud_hypervisor_keys_and_ours() {
        let c = PmemConfig::parse(
            "file=/tmp/p,size=4M,discard_writes=on,id=disk1,transport=mmio",
            0,
        )
        .unwrap();
        assert_eq!(c.file, PathBuf::from("/tmp/p"));
        assert_eq!(c.size, Some(4 << 20));
        assert!(c.discard_writes);
        assert_eq!(c.id, "disk1");
        assert_eq!(c.transport, Transport::Mmio);
        let c = PmemConfig::parse("file=/tmp/p", 3).unwrap();
        assert_eq!(
            (c.size, c.discard_writes, c.id.as_str(), c.transport),
            (None, false, "_pmem3", Transport::Pci)
        );
    }

    #[test]
    fn errors_name_the_key_and_the_limit() {
        let e = PmemConfig::parse("size=2M", 0).unwrap_err().to_string();
        assert_eq!(e, "--pmem: missing required key \"file\"");
        let e = PmemConfig::parse("file=x,size=3M", 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("size=\"3M\"") && e.contains("multiple of 2M"),
            "{e}"
        );
        let e = PmemConfig::parse("file=x,transport=virtio", 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("transport=\"virtio\"") && e.contains("pci or mmio"),
            "{e}"
        );
        let e = PmemConfig::parse("file=x,discard_writes=maybe", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("discard_writes"), "{e}");
        let e = PmemConfig::parse("file=x,readonly=on", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown key \"readonly\""), "{e}");
    }
}
