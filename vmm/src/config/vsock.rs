//! `--vsock cid=<cid>,socket=<path>[,id=<id>][,iommu=off][,pci_segment=0][,transport=pci|mmio]`:
//! Cloud Hypervisor's keys plus our `transport`. One device per VM, as in
//! Cloud Hypervisor.

use std::path::PathBuf;

use virtio_devices::vsock::{MAX_GUEST_CID, MIN_GUEST_CID};

use super::option_parser::OptionValues;
use super::{ConfigError, Transport};

pub const VSOCK_KEYS: &[&str] = &["cid", "socket", "id", "iommu", "pci_segment", "transport"];

/// Longest unix socket path: sun_path holds 108 bytes with the NUL, and a
/// guest-to-host connection to port P connects to `<socket>_<P>` (up to 11
/// more bytes).
pub const MAX_SOCKET_PATH: usize = 107 - 11;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VsockConfig {
    pub cid: u64,
    pub socket: PathBuf,
    pub id: String,
    pub transport: Transport,
    /// The PCI segment the device is on (virtio-PCI only).
    pub pci_segment: u16,
}

impl VsockConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("vsock", input, VSOCK_KEYS)?)
    }

    pub fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        o.check_ch_defaults()?;
        let (transport, pci_segment) = o.transport_and_segment()?;
        let cid_text = o.get("cid").ok_or(ConfigError::MissingKey {
            option: "vsock",
            key: "cid",
        })?;
        let expected = "a guest context id from 3 to 4294967294";
        let cid: u64 = cid_text
            .parse()
            .map_err(|_| o.invalid("cid", cid_text, expected))?;
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
            return Err(o.invalid("cid", cid_text, expected));
        }
        let socket = o.get("socket").ok_or(ConfigError::MissingKey {
            option: "vsock",
            key: "socket",
        })?;
        if socket.is_empty() || socket.len() > MAX_SOCKET_PATH {
            return Err(o.invalid(
                "socket",
                socket,
                &format!("a unix socket path of 1 to {MAX_SOCKET_PATH} bytes"),
            ));
        }
        Ok(VsockConfig {
            cid,
            socket: PathBuf::from(socket),
            // Cloud Hypervisor names it `_vsock0`.
            id: o.device_id("vsock", 0)?,
            transport,
            pci_segment,
        })
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
