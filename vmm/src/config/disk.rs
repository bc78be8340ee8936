//! `--disk path=<path>[,readonly=on|off][,direct=on|off][,id=<id>][,num_queues=<n>][,queue_size=<n>][,serial=<s>][,transport=pci|mmio]`:
//! Cloud Hypervisor's keys (its others accepted with their defaults only)
//! plus our `transport`.

use std::path::PathBuf;

use super::option_parser::{parse_toggle, parse_u32, OptionValues};
use super::{ConfigError, Transport};

/// Request queues a disk may have (Kata asks for one per vCPU).
pub const MAX_NUM_QUEUES: u32 = 64;
/// Largest queue: Kata asks for 1024, Cloud Hypervisor allows up to this.
pub const MAX_QUEUE_SIZE: u32 = 32768;
/// GET_ID answers with at most 20 bytes.
pub const MAX_SERIAL_LEN: usize = 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub readonly: bool,
    pub direct: bool,
    pub id: String,
    pub num_queues: u16,
    pub queue_size: u16,
    pub serial: Option<String>,
    pub transport: Transport,
    /// The PCI segment the device is on (virtio-PCI only).
    pub pci_segment: u16,
}

/// Keys `--disk` accepts: Cloud Hypervisor's, and `transport`. Those after
/// `transport` are Cloud Hypervisor's that this VMM does not implement:
/// accepted only with the value that changes nothing.
pub const DISK_KEYS: &[&str] = &[
    "path",
    "readonly",
    "direct",
    "id",
    "num_queues",
    "queue_size",
    "serial",
    "transport",
    "iommu",
    "pci_segment",
    "vhost_user",
    "socket",
    "image_type",
    "sparse",
    "backing_files",
    "bw_size",
    "bw_one_time_burst",
    "bw_refill_time",
    "ops_size",
    "ops_one_time_burst",
    "ops_refill_time",
    "rate_limit_group",
    "queue_affinity",
    "lock_granularity",
];

impl DiskConfig {
    /// `index` names devices given without `id=` (`_disk0`, … as Cloud
    /// Hypervisor does).
    pub fn parse(input: &str, index: usize) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("disk", input, DISK_KEYS)?, index)
    }

    /// Checks and converts the values of `--disk` (or of an API DiskConfig).
    pub fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        o.check_ch_defaults()?;
        let (transport, pci_segment) = o.transport_and_segment()?;
        if o.convert("vhost_user", parse_toggle)?.unwrap_or(false) {
            return Err(o.unsupported("vhost_user", "only disk images the VMM opens itself"));
        }
        if o.convert("backing_files", parse_toggle)?.unwrap_or(false) {
            return Err(o.unsupported("backing_files", "raw images only"));
        }
        if !o.convert("sparse", parse_toggle)?.unwrap_or(true) {
            return Err(o.unsupported("sparse", "images are used as they are (sparse=on)"));
        }
        if o.get("image_type")
            .is_some_and(|t| !matches!(t, "raw" | "Raw" | "Unknown"))
        {
            return Err(o.unsupported("image_type", "raw images only"));
        }
        o.refuse_any(
            &[
                "socket",
                "bw_size",
                "bw_one_time_burst",
                "bw_refill_time",
                "ops_size",
                "ops_one_time_burst",
                "ops_refill_time",
                "rate_limit_group",
                "queue_affinity",
            ],
            "no rate limits, queue affinity or vhost-user socket here",
        )?;
        if o.get("lock_granularity")
            .is_some_and(|v| !matches!(v, "byte-range" | "ByteRange"))
        {
            return Err(o.unsupported("lock_granularity", "only the default byte-range"));
        }
        let path = o.get("path").ok_or(ConfigError::MissingKey {
            option: "disk",
            key: "path",
        })?;
        if path.is_empty() {
            return Err(o.invalid("path", "", "the path of a raw disk image"));
        }
        let num_queues = o.convert("num_queues", parse_u32)?.unwrap_or(1);
        let num_queues = o.checked_u16(
            "num_queues",
            num_queues,
            (1..=MAX_NUM_QUEUES).contains(&num_queues),
            "1 to 64 queues",
        )?;
        // Cloud Hypervisor's default.
        let queue_size = o.convert("queue_size", parse_u32)?.unwrap_or(128);
        let queue_size = o.checked_u16(
            "queue_size",
            queue_size,
            queue_size.is_power_of_two() && (4..=MAX_QUEUE_SIZE).contains(&queue_size),
            "a power of two from 4 to 32768",
        )?;
        let serial = match o.get("serial") {
            Some(s)
                if s.len() > MAX_SERIAL_LEN || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) =>
            {
                return Err(o.invalid(
                    "serial",
                    s,
                    "at most 20 printable ASCII characters (virtio-blk's GET_ID)",
                ))
            }
            Some(s) => Some(s.to_string()),
            None => None,
        };
        Ok(DiskConfig {
            path: PathBuf::from(path),
            readonly: o.convert("readonly", parse_toggle)?.unwrap_or(false),
            direct: o.convert("direct", parse_toggle)?.unwrap_or(false),
            id: o.device_id("disk", index)?,
            num_queues,
            queue_size,
            serial,
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
        let c = DiskConfig::parse(
            "path=/img,readonly=on,direct=on,id=root,num_queues=4,queue_size=1024,serial=ABC,transport=mmio",
            0,
        )
        .unwrap();
        assert_eq!(
            c,
            DiskConfig {
                path: "/img".into(),
                readonly: true,
                direct: true,
                id: "root".into(),
                num_queues: 4,
                queue_size: 1024,
                serial: Some("ABC".into()),
                transport: Transport::Mmio,
                pci_segment: 0,
            }
        );
        let c = DiskConfig::parse("path=/img", 2).unwrap();
        assert_eq!(
            (
                c.readonly,
                c.direct,
                c.id.as_str(),
                c.num_queues,
                c.queue_size,
                c.transport
            ),
            (false, false, "_disk2", 1, 128, Transport::Pci)
        );
        // Cloud Hypervisor's defaults for what is not implemented.
        assert!(DiskConfig::parse(
            "path=/img,iommu=off,pci_segment=0,vhost_user=off,image_type=raw,sparse=on,backing_files=off",
            0
        )
        .is_ok());
    }

    #[test]
    fn errors_name_the_key_and_the_limit() {
        let e = |s: &str| DiskConfig::parse(s, 0).unwrap_err().to_string();
        assert_eq!(e("readonly=on"), "--disk: missing required key \"path\"");
        assert_eq!(
            e("path=x,num_queues=65"),
            "--disk: num_queues=\"65\" is invalid: expected 1 to 64 queues"
        );
        assert!(e("path=x,queue_size=100")
            .contains("queue_size=\"100\" is invalid: expected a power of two from 4 to 32768"));
        assert!(e("path=x,queue_size=65536").contains("32768"));
        assert!(e("path=x,serial=123456789012345678901").contains(
            "serial=\"123456789012345678901\" is invalid: expected at most 20 printable ASCII"
        ));
        assert!(
            e("path=x,readonly=yes").contains("readonly=\"yes\" is invalid: expected on or off")
        );
        assert!(e("path=x,vhost_user=on").contains("vhost_user=on is not supported"));
        assert!(e("path=x,image_type=qcow2")
            .contains("image_type=qcow2 is not supported: raw images only"));
        assert!(e("path=x,bw_size=1000").contains("bw_size=1000 is not supported"));
        assert!(e("path=x,iommu=on").contains("iommu=on"));
        assert!(e("path=x,pci_segment=1,transport=mmio").contains(
            "pci_segment=1 is not supported: a transport=mmio device is on no PCI segment"
        ));
        assert!(e("path=x,pci_segment=-1").contains("pci_segment=\"-1\" is invalid"));
        assert!(e("path=x,cache=none").contains("unknown key \"cache\""));
        assert!(e("path=").contains("path=\"\" is invalid"));
    }
}
