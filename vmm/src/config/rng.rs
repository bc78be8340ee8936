//! `--rng src=<path>[,iommu=off][,transport=pci|mmio]` (Cloud Hypervisor's
//! keys plus our `transport`), or `--rng off`. As in Cloud Hypervisor every
//! VM has a virtio-rng device fed from `/dev/urandom` unless told otherwise.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::checks::{invalid, no_iommu, transport_and_segment};
use super::option_parser::OptionValues;
use super::{ConfigError, Transport};

pub const DEFAULT_RNG_SOURCE: &str = "/dev/urandom";
pub const RNG_KEYS: &[&str] = &["src", "iommu", "transport", "pci_segment"];

/// The virtio-rng device: Cloud Hypervisor's RngConfig (its JSON field
/// names and defaults) plus our `transport`, what `--rng` and `vm.create`
/// both fill and [`RngConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngConfig {
    #[serde(default = "default_src")]
    pub src: PathBuf,
    #[serde(default)]
    pub iommu: bool,
    /// The PCI segment the device is on (virtio-PCI only).
    #[serde(default)]
    pub pci_segment: u16,
    #[serde(default)]
    pub transport: Transport,
}

fn default_src() -> PathBuf {
    PathBuf::from(DEFAULT_RNG_SOURCE)
}

impl Default for RngConfig {
    fn default() -> Self {
        RngConfig {
            src: default_src(),
            iommu: false,
            transport: Transport::Pci,
            pci_segment: 0,
        }
    }
}

impl RngConfig {
    /// None for `off` (no device).
    pub fn parse(input: &str) -> Result<Option<Self>, ConfigError> {
        if input == "off" {
            return Ok(None);
        }
        Self::from_values(&OptionValues::parse("rng", input, RNG_KEYS)?).map(Some)
    }

    /// Fills a config from the values of `--rng` and checks it.
    fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        let config = RngConfig {
            src: o.get("src").map_or_else(default_src, PathBuf::from),
            iommu: o.toggle("iommu")?.unwrap_or(false),
            pci_segment: o.pci_segment()?,
            transport: o.transport()?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Every check of the rng device's config, for the command line and
    /// the API alike.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "rng";
        no_iommu(OPTION, self.iommu)?;
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        // An empty path would pass here and fail only at boot, after the
        // VM was reported created.
        if self.src.as_os_str().is_empty() {
            return Err(invalid(
                OPTION,
                "src",
                "",
                "a path to the entropy source (not empty)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_keys() {
        assert_eq!(
            RngConfig::parse("src=/dev/urandom").unwrap(),
            Some(RngConfig::default())
        );
        assert_eq!(RngConfig::parse("off").unwrap(), None);
        let c = RngConfig::parse("src=/dev/random,transport=mmio")
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.src.to_str(), c.transport),
            (Some("/dev/random"), Transport::Mmio)
        );
        assert_eq!(
            RngConfig::parse("src=/x,iommu=on").unwrap_err().to_string(),
            "--rng: iommu=on is not supported"
        );
        assert!(RngConfig::parse("source=/x")
            .unwrap_err()
            .to_string()
            .contains("unknown key \"source\""));
        assert!(RngConfig::parse("src=")
            .unwrap_err()
            .to_string()
            .contains("src=\"\" is invalid"));
    }
}
