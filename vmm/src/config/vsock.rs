//! `--vsock cid=<cid>,socket=<path>[,id=<id>][,iommu=off][,pci_segment=0][,transport=pci|mmio]`:
//! Cloud Hypervisor's keys plus our `transport`. One device per VM, as in
//! Cloud Hypervisor.

use std::path::PathBuf;

use virtio_devices::vsock::{MAX_GUEST_CID, MIN_GUEST_CID};

use serde::{Deserialize, Serialize};

use super::checks::{
    invalid, name_device, no_iommu, no_pci_device_id, non_empty_id, transport_and_segment,
};
use super::option_parser::OptionValues;
use super::{ConfigError, PassedFd, Transport};

pub const VSOCK_KEYS: &[&str] = &["cid", "socket", "id", "iommu", "pci_segment", "transport"];

/// Longest unix socket path: sun_path holds 108 bytes with the NUL, and a
/// guest-to-host connection to port P connects to `<socket>_<P>` (up to 11
/// more bytes).
pub const MAX_SOCKET_PATH: usize = 107 - 11;

/// The virtio-vsock device: Cloud Hypervisor's VsockConfig (its JSON field
/// names) plus our `transport`, what `--vsock` and `vm.add-vsock` both
/// fill and [`VsockConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    pub cid: u64,
    pub socket: PathBuf,
    #[serde(default)]
    pub iommu: bool,
    /// Empty when not given: [`VsockConfig::validated`] names it `_vsock0`.
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
    /// The listener a local migration's sender bound at `socket` and
    /// passed: the device serves it (once checked to be a listening unix
    /// socket bound there) instead of binding `socket`.
    #[serde(skip)]
    pub passed_listener: PassedFd,
}

const CID_EXPECTED: &str = "a guest context id from 3 to 4294967294";

impl VsockConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("vsock", input, VSOCK_KEYS)?)
    }

    /// Fills a config from the values of `--vsock` and checks it.
    fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        let cid = o
            .convert("cid", |v| v.parse::<u64>().map_err(|_| CID_EXPECTED))?
            .ok_or(ConfigError::MissingKey {
                option: "vsock",
                key: "cid",
            })?;
        let socket = o.get("socket").ok_or(ConfigError::MissingKey {
            option: "vsock",
            key: "socket",
        })?;
        VsockConfig {
            cid,
            socket: PathBuf::from(socket),
            iommu: o.toggle("iommu")?.unwrap_or(false),
            id: o.id()?,
            pci_segment: o.pci_segment()?,
            pci_device_id: None,
            transport: o.transport()?,
            passed_listener: PassedFd::default(),
        }
        .validated()
    }

    /// Names the device `_vsock0` (as Cloud Hypervisor does) if it has no
    /// id, and checks it.
    pub fn validated(mut self) -> Result<Self, ConfigError> {
        name_device(&mut self.id, "vsock", 0);
        self.validate()?;
        Ok(self)
    }

    /// Every check of the vsock device's config, for the command line and
    /// the API alike.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "vsock";
        no_pci_device_id(OPTION, self.pci_device_id)?;
        no_iommu(OPTION, self.iommu)?;
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&self.cid) {
            return Err(invalid(OPTION, "cid", self.cid, CID_EXPECTED));
        }
        let socket = self.socket.as_os_str();
        if socket.is_empty() || socket.len() > MAX_SOCKET_PATH {
            return Err(invalid(
                OPTION,
                "socket",
                self.socket.display(),
                format!("a unix socket path of 1 to {MAX_SOCKET_PATH} bytes"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cloud_hypervisors_keys_and_ours() {
        let c = VsockConfig::parse("cid=3,socket=/tmp/v.sock").unwrap();
        assert_eq!(
            c,
            VsockConfig {
                cid: 3,
                socket: "/tmp/v.sock".into(),
                id: "_vsock0".into(),
                transport: Transport::Pci,
                pci_segment: 0,
                iommu: false,
                pci_device_id: None,
                passed_listener: PassedFd::default(),
            }
        );
        let c = VsockConfig::parse(
            "cid=4294967294,socket=/s,id=v,iommu=off,pci_segment=0,transport=mmio",
        )
        .unwrap();
        assert_eq!(
            (c.cid, c.id.as_str(), c.transport),
            (0xffff_fffe, "v", Transport::Mmio)
        );
    }

    #[test]
    fn errors_name_the_key_and_the_limit() {
        let e = |s: &str| VsockConfig::parse(s).unwrap_err().to_string();
        assert_eq!(e("socket=/s"), "--vsock: missing required key \"cid\"");
        assert_eq!(e("cid=3"), "--vsock: missing required key \"socket\"");
        for bad in ["2", "0", "4294967295", "x", "-3"] {
            let m = e(&format!("cid={bad},socket=/s"));
            assert!(
                m.contains(&format!("cid=\"{bad}\"")) && m.contains("3 to 4294967294"),
                "{m}"
            );
        }
        let long = "x".repeat(MAX_SOCKET_PATH + 1);
        let m = e(&format!("cid=3,socket={long}"));
        assert!(m.contains("1 to 96 bytes"), "{m}");
        assert!(e("cid=3,socket=/s,iommu=on").contains("iommu=on"));
        assert_eq!(
            VsockConfig::parse("cid=3,socket=/s,pci_segment=1")
                .unwrap()
                .pci_segment,
            1,
            "whether segment 1 exists is the VM's to say"
        );
        assert!(e("cid=3,socket=/s,pci_segment=1,transport=mmio").contains("transport=mmio"));
        assert!(e("cid=3,socket=/s,pci_segment=96").contains("below 96"));
        assert!(e("cid=3,socket=/s,transport=virtio").contains("pci or mmio"));
        assert!(e("cid=3,socket=/s,port=1").contains("unknown key \"port\""));
    }
}
