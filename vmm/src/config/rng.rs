//! `--rng src=<path>[,iommu=off][,transport=pci|mmio]` (Cloud Hypervisor's
//! keys plus our `transport`), or `--rng off`. As in Cloud Hypervisor every
//! VM has a virtio-rng device fed from `/dev/urandom` unless told otherwise.

use std::path::PathBuf;

use super::option_parser::OptionValues;
use super::{ConfigError, Transport};

pub const DEFAULT_RNG_SOURCE: &str = "/dev/urandom";
pub const RNG_KEYS: &[&str] = &["src", "iommu", "transport", "pci_segment"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RngConfig {
    pub src: PathBuf,
    pub transport: Transport,
    /// The PCI segment the device is on (virtio-PCI only).
    pub pci_segment: u16,
}

impl Default for RngConfig {
    fn default() -> Self {
        RngConfig {
            src: PathBuf::from(DEFAULT_RNG_SOURCE),
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

    pub fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        o.check_ch_defaults()?;
        let (transport, pci_segment) = o.transport_and_segment()?;
        let src = o.get("src").unwrap_or(DEFAULT_RNG_SOURCE);
        // An empty path would pass here and fail only at boot, after the
        // VM was reported created.
        if src.is_empty() {
            return Err(o.invalid("src", src, "a path to the entropy source (not empty)"));
        }
        Ok(RngConfig {
            src: PathBuf::from(src),
            transport,
            pci_segment,
        })
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
