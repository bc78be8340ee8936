//! `--platform num_pci_segments=<n>`: how many PCI segments (host bridges,
//! each with its own bus 0, ECAM range and BAR windows) the VM has. Cloud
//! Hypervisor's other `--platform` keys (IOMMU segments, SMBIOS strings,
//! confidential guests) have no meaning here and are refused by name.

use serde::{Deserialize, Serialize};

use super::checks::invalid;
use super::option_parser::OptionValues;
use super::ConfigError;

/// Cloud Hypervisor's limit on `num_pci_segments`.
pub const MAX_PCI_SEGMENTS: u16 = 96;

/// Keys `--platform` accepts: ours, then Cloud Hypervisor's that are refused.
pub const PLATFORM_KEYS: &[&str] = &[
    "num_pci_segments",
    "iommu_segments",
    "iommu_address_width",
    "serial_number",
    "uuid",
    "oem_strings",
    "tdx",
    "sev_snp",
];

/// The part of Cloud Hypervisor's PlatformConfig this VMM implements (its
/// JSON field names and defaults; the rest is checked by
/// [`super::ch_fields`]), what `--platform` and `vm.create` both fill and
/// [`PlatformConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlatformConfig {
    /// PCI segments 0..num_pci_segments exist; 1 (Cloud Hypervisor's
    /// default) is bus 0 of segment 0 only.
    #[serde(default = "one")]
    pub num_pci_segments: u16,
}

fn one() -> u16 {
    1
}

impl Default for PlatformConfig {
    fn default() -> Self {
        PlatformConfig {
            num_pci_segments: 1,
        }
    }
}

const SEGMENTS_EXPECTED: &str = "1 to 96 PCI segments (Cloud Hypervisor's limit)";

impl PlatformConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("platform", input, PLATFORM_KEYS)?)
    }

    /// Fills a config from the values of `--platform` and checks it.
    fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        o.refuse_any(
            &PLATFORM_KEYS[1..],
            "no IOMMU, SMBIOS strings or confidential guests here",
        )?;
        let config = PlatformConfig {
            num_pci_segments: o
                .convert("num_pci_segments", |v| {
                    v.parse::<u16>().map_err(|_| SEGMENTS_EXPECTED)
                })?
                .unwrap_or(1),
        };
        config.validate()?;
        Ok(config)
    }

    /// The segment count is within Cloud Hypervisor's limit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_PCI_SEGMENTS).contains(&self.num_pci_segments) {
            return Err(invalid(
                "platform",
                "num_pci_segments",
                self.num_pci_segments,
                SEGMENTS_EXPECTED,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_count_within_cloud_hypervisors_limit() {
        assert_eq!(
            PlatformConfig::parse("").unwrap(),
            PlatformConfig::default()
        );
        assert_eq!(
            PlatformConfig::parse("num_pci_segments=2")
                .unwrap()
                .num_pci_segments,
            2
        );
        assert_eq!(
            PlatformConfig::parse("num_pci_segments=96")
                .unwrap()
                .num_pci_segments,
            MAX_PCI_SEGMENTS
        );
        for bad in ["0", "97", "65536", "two", "-1"] {
            assert_eq!(
                PlatformConfig::parse(&format!("num_pci_segments={bad}"))
                    .unwrap_err()
                    .to_string(),
                format!(
                    "--platform: num_pci_segments=\"{bad}\" is invalid: expected 1 to 96 PCI segments (Cloud Hypervisor's limit)"
                )
            );
        }
        assert_eq!(
            PlatformConfig::parse("num_pci_segments=2,iommu_segments=[0]")
                .unwrap_err()
                .to_string(),
            "--platform: iommu_segments=[0] is not supported: no IOMMU, SMBIOS strings or confidential guests here"
        );
        assert!(PlatformConfig::parse("segments=2")
            .unwrap_err()
            .to_string()
            .contains("unknown key \"segments\""));
    }
}
