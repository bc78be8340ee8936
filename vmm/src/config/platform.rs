//! `--platform num_pci_segments=<n>`: how many PCI segments (host bridges,
//! each with its own bus 0, ECAM range and BAR windows) the VM has. Cloud
//! Hypervisor's other `--platform` keys (IOMMU segments, SMBIOS strings,
//! confidential guests) have no meaning here and are refused by name.

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlatformConfig {
    /// PCI segments 0..num_pci_segments exist; 1 (Cloud Hypervisor's
    /// default) is bus 0 of segment 0 only.
    pub num_pci_segments: u16,
}

impl Default for PlatformConfig {
    fn default() -> Self {
        PlatformConfig {
            num_pci_segments: 1,
        }
    }
}

impl PlatformConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("platform", input, PLATFORM_KEYS)?)
    }

    pub fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        o.refuse_any(
            &PLATFORM_KEYS[1..],
            "no IOMMU, SMBIOS strings or confidential guests here",
        )?;
        let num_pci_segments = o
            .convert("num_pci_segments", |v| {
                v.parse::<u16>()
                    .ok()
                    .filter(|n| (1..=MAX_PCI_SEGMENTS).contains(n))
                    .ok_or("1 to 96 PCI segments (Cloud Hypervisor's limit)")
            })?
            .unwrap_or(1);
        Ok(PlatformConfig { num_pci_segments })
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
