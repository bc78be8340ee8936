//! PCI segments: each one a host bridge with its own bus 0, ECAM range and
//! BAR windows, as Cloud Hypervisor has them (`--platform
//! num_pci_segments`). Segment 0 is also reached through the legacy
//! configuration ports 0xCF8/0xCFC, as on real hardware; the others only
//! through their ECAM range, which the MCFG lists.
//!
//! Unlike Cloud Hypervisor, every segment has a host bridge function in
//! slot 0 (Cloud Hypervisor's segments above 0 start their devices at slot
//! 0), so hot-plug slots are 1..=31 on every segment.

use std::fmt;

use acpi_tables::{aml, Aml};

use super::address_space::SegmentWindows;
use super::hotplug_controller::{host_bridge_path, slot_aml};
use super::pci_root::{PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_SIZE};
use crate::arch::x86_64::hotplug_aml::RawAml;

/// Where a function sits: its segment and its slot on the segment's bus 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciAddress {
    pub segment: u16,
    pub slot: u8,
}

impl fmt::Display for PciAddress {
    /// `SSSS:00:DD.0`, as Cloud Hypervisor reports a BDF.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:00:{:02x}.0", self.segment, self.slot)
    }
}

/// Segment `segment`'s host bridge in the DSDT: `_SEG`, `_UID` and `_BBN 0`,
/// its resources (bus 0, the config ports on segment 0, its 32- and 64-bit
/// windows) and its hot-plug slots.
/// An address in a segment's 32-bit window as the descriptor's 32-bit
/// field: the windows are carved from PCI_MMIO32, below 4 GiB (a layout
/// assert), so this never refuses.
fn below_4g(addr: u64) -> u32 {
    narrow::u32_of(addr)
}

pub fn host_bridge_aml(segment: u16, windows: &SegmentWindows, sink: &mut Vec<u8>) {
    let mut slots = Vec::new();
    slot_aml(&mut slots, segment);
    let slots = RawAml(slots);
    let (m32_start, m32_size) = windows.mmio32;
    let (m64_start, m64_size) = windows.mmio64;
    let bus = aml::AddressSpace::new_bus_number(0x0u16, 0x0u16);
    let ports = aml::IO::new(
        const { narrow::u16_of(PCI_CONFIG_IO_PORT) },
        const { narrow::u16_of(PCI_CONFIG_IO_PORT) },
        1,
        const { narrow::u8_of(PCI_CONFIG_IO_SIZE) },
    );
    let mmio32 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::NotCacheable,
        true,
        below_4g(m32_start),
        below_4g(m32_start + m32_size - 1),
        None,
    );
    let mmio64 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::PreFetchable,
        true,
        m64_start,
        m64_start + m64_size - 1,
        None,
    );
    // The ECAM range is the MCFG's to give (a range in _CRS would be a
    // window the bridge forwards).
    let mut resources: Vec<&dyn Aml> = vec![&bus];
    if segment == 0 {
        resources.push(&ports);
    }
    resources.extend([&mmio32 as &dyn Aml, &mmio64]);
    let path = host_bridge_path(segment);
    aml::Device::new(
        path.as_str().into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08")),
            &aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03")),
            &aml::Name::new("_ADR".into(), &aml::ZERO),
            &aml::Name::new("_SEG".into(), &segment),
            &aml::Name::new("_UID".into(), &segment),
            &aml::Name::new("_BBN".into(), &aml::ZERO),
            &aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(resources)),
            &slots,
        ],
    )
    .to_aml_bytes(sink);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_manager::address_space::segment_windows;

    #[test]
    fn bdf_carries_the_segment() {
        let a = PciAddress {
            segment: 1,
            slot: 2,
        };
        assert_eq!(a.to_string(), "0001:00:02.0");
        let b = PciAddress {
            segment: 0x5f,
            slot: 31,
        };
        assert_eq!(b.to_string(), "005f:00:1f.0");
    }

    /// The bytes after `name` in `aml` (a Name object's value).
    fn after<'a>(aml: &'a [u8], name: &[u8]) -> &'a [u8] {
        let at = aml
            .windows(name.len())
            .position(|w| w == name)
            .unwrap_or_else(|| panic!("{} in the AML", String::from_utf8_lossy(name)));
        &aml[at + name.len()..]
    }

    #[test]
    fn each_bridge_names_its_segment_and_windows() {
        let windows = segment_windows(512 << 20, 0, 2);
        let mut seg1 = Vec::new();
        host_bridge_aml(1, &windows[1], &mut seg1);
        // Device(\_SB_.PC01) with _SEG 1, _UID 1 (OneOp) and _BBN 0 (ZeroOp).
        assert!(seg1.windows(8).any(|w| w == b"_SB_PC01"));
        assert_eq!(after(&seg1, b"_SEG")[0], 0x01);
        assert_eq!(after(&seg1, b"_UID")[0], 0x01);
        assert_eq!(after(&seg1, b"_BBN")[0], 0x00);
        // Its own 32-bit window (DWord address space descriptor, min/max).
        let (start, size) = windows[1].mmio32;
        let mut range = below_4g(start).to_le_bytes().to_vec();
        range.extend_from_slice(&below_4g(start + size - 1).to_le_bytes());
        assert!(seg1.windows(8).any(|w| w == range.as_slice()));
        // Its own 64-bit window (QWord address space descriptor, min/max).
        let (start, size) = windows[1].mmio64;
        let mut range = start.to_le_bytes().to_vec();
        range.extend_from_slice(&(start + size - 1).to_le_bytes());
        assert!(seg1.windows(16).any(|w| w == range.as_slice()));
        // Its slots eject on segment 1.
        assert!(seg1.windows(4).any(|w| w == b"S031"));
        assert!(seg1.windows(4).any(|w| w == b"PEJ_"));

        let mut seg0 = Vec::new();
        host_bridge_aml(0, &windows[0], &mut seg0);
        assert!(seg0.windows(8).any(|w| w == b"_SB_PCI0"));
        assert_eq!(after(&seg0, b"_SEG")[0], 0x00);
        // The config ports: an IO descriptor (0x47) at 0xcf8, 8 ports.
        let io = [0x47, 1, 0xf8, 0x0c, 0xf8, 0x0c, 1, 8];
        assert!(seg0.windows(io.len()).any(|w| w == io));
        assert!(
            !seg1.windows(io.len()).any(|w| w == io),
            "only segment 0 decodes the config ports"
        );
    }
}
