//! `--pmem file=<path>[,size=<size>][,discard_writes=on|off][,id=<id>][,transport=pci|mmio]`,
//! Cloud Hypervisor's keys plus our `transport`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::checks::{
    invalid, name_device, no_iommu, no_pci_device_id, non_empty_id, transport_and_segment,
};
use super::option_parser::{parse_size, OptionValues};
use super::{ConfigError, Transport};

/// A virtio-pmem device: Cloud Hypervisor's PmemConfig (its JSON field
/// names and defaults) plus our `transport`, what `--pmem` and
/// `vm.add-pmem` both fill and [`PmemConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemConfig {
    pub file: PathBuf,
    /// None: the file's own size.
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub iommu: bool,
    #[serde(default)]
    pub discard_writes: bool,
    /// Empty when not given: [`PmemConfig::validated`] names it `_pmem<N>`.
    #[serde(default, deserialize_with = "non_empty_id")]
    pub id: String,
    /// The PCI segment the device is on (virtio-PCI only).
    #[serde(default)]
    pub pci_segment: u16,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    #[serde(default, skip_serializing)]
    pub pci_device_id: Option<u8>,
    #[serde(default)]
    pub transport: Transport,
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

    /// Fills a config from the values of `--pmem` and checks it.
    fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        let file = o.get("file").ok_or(ConfigError::MissingKey {
            option: "pmem",
            key: "file",
        })?;
        PmemConfig {
            file: PathBuf::from(file),
            size: o.convert("size", parse_size)?,
            iommu: o.toggle("iommu")?.unwrap_or(false),
            discard_writes: o.toggle("discard_writes")?.unwrap_or(false),
            id: o.id()?,
            pci_segment: o.pci_segment()?,
            pci_device_id: None,
            transport: o.transport()?,
        }
        .validated(index)
    }

    /// Names the device `_pmem<index>` if it has no id, and checks it.
    pub fn validated(mut self, index: usize) -> Result<Self, ConfigError> {
        name_device(&mut self.id, "pmem", index);
        self.validate()?;
        Ok(self)
    }

    /// Every check of a pmem device's config, for the command line and
    /// the API alike.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "pmem";
        no_pci_device_id(OPTION, self.pci_device_id)?;
        // Cloud Hypervisor's defaults are accepted, since ch-remote sends them.
        no_iommu(OPTION, self.iommu)?;
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        if self.file.as_os_str().is_empty() {
            return Err(invalid(OPTION, "file", "", "a file or directory path"));
        }
        if let Some(size) = self.size {
            if size == 0 || size % TWO_MIB != 0 {
                return Err(invalid(
                    OPTION,
                    "size",
                    dax_abi::size_text(size),
                    "a non-zero multiple of 2M",
                ));
            }
        }
        Ok(())
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
