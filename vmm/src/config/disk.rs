//! `--disk path=<path>[,readonly=on|off][,direct=on|off][,id=<id>][,num_queues=<n>][,queue_size=<n>][,serial=<s>][,transport=pci|mmio]`:
//! Cloud Hypervisor's keys (its others accepted with their defaults only)
//! plus our `transport`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{
    invalid, name_device, no_iommu, no_pci_device_id, non_empty_id, transport_and_segment,
    unsupported, yes,
};
use super::option_parser::OptionValues;
use super::{ConfigError, PassedFd, Transport};

/// Request queues a disk may have (Kata asks for one per vCPU).
pub const MAX_NUM_QUEUES: u32 = 64;
/// Largest queue: Kata asks for 1024, Cloud Hypervisor allows up to this.
pub const MAX_QUEUE_SIZE: u32 = 32768;
/// GET_ID answers with at most 20 bytes.
pub const MAX_SERIAL_LEN: usize = 20;

/// A virtio-blk device: Cloud Hypervisor's DiskConfig (its JSON field
/// names and defaults), what `--disk` and `vm.add-disk` both fill and
/// [`DiskConfig::validate`] checks. The fields of Cloud Hypervisor's that
/// this VMM does not implement are here to be refused by name unless they
/// hold the value that changes nothing; `vm.info` shows those Cloud
/// Hypervisor's `vm.info` shows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    #[serde(default)]
    pub path: PathBuf,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub direct: bool,
    #[serde(default)]
    pub iommu: bool,
    #[serde(default = "one")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    #[serde(default)]
    pub vhost_user: bool,
    #[serde(default, skip_serializing)]
    pub vhost_socket: Option<String>,
    #[serde(default, skip_serializing)]
    pub rate_limit_group: Option<String>,
    /// Only null: there is no rate limiter.
    #[serde(default, skip_serializing)]
    pub rate_limiter_config: Option<Value>,
    /// Empty when not given: [`DiskConfig::validate`] names it `_disk<N>`.
    #[serde(default, deserialize_with = "non_empty_id")]
    pub id: String,
    #[serde(default)]
    pub serial: Option<String>,
    /// The PCI segment the device is on (virtio-PCI only).
    #[serde(default)]
    pub pci_segment: u16,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    #[serde(default, skip_serializing)]
    pub pci_device_id: Option<u8>,
    /// Only null or empty.
    #[serde(default, skip_serializing)]
    pub queue_affinity: Option<Value>,
    #[serde(default)]
    pub backing_files: bool,
    #[serde(default = "yes")]
    pub sparse: bool,
    /// Only raw images (`Raw`, or `Unknown` for "find out"); `vm.info`
    /// says `Raw` (from [`super::ch_fields`]).
    #[serde(default, skip_serializing)]
    pub image_type: Option<String>,
    #[serde(default, skip_serializing)]
    pub lock_granularity: Option<String>,
    /// In Cloud Hypervisor's vm.info though not in its API: false only.
    #[serde(default, skip_serializing)]
    pub disable_io_uring: bool,
    #[serde(default, skip_serializing)]
    pub disable_aio: bool,
    #[serde(default)]
    pub transport: Transport,
    /// The image opened by a local migration's sender, its lock with it:
    /// the device is built on it (once checked to be the file `path`
    /// names, opened as configured) instead of opening `path`.
    #[serde(skip)]
    pub passed_file: PassedFd,
}

fn one() -> u16 {
    1
}

/// Cloud Hypervisor's default.
fn default_queue_size() -> u16 {
    128
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

const NUM_QUEUES_EXPECTED: &str = "1 to 64 queues";
const QUEUE_SIZE_EXPECTED: &str = "a power of two from 4 to 32768";

impl DiskConfig {
    /// `index` names devices given without `id=` (`_disk0`, … as Cloud
    /// Hypervisor does).
    pub fn parse(input: &str, index: usize) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("disk", input, DISK_KEYS)?, index)
    }

    /// Fills a config from the values of `--disk` and checks it.
    fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        // Keys with no field here: Cloud Hypervisor's rate limiter, spelled
        // out on its command line.
        o.refuse_any(
            &[
                "bw_size",
                "bw_one_time_burst",
                "bw_refill_time",
                "ops_size",
                "ops_one_time_burst",
                "ops_refill_time",
            ],
            "no rate limits, queue affinity or vhost-user socket here",
        )?;
        let path = o.get("path").ok_or(ConfigError::MissingKey {
            option: "disk",
            key: "path",
        })?;
        let config = DiskConfig {
            path: PathBuf::from(path),
            readonly: o.toggle("readonly")?.unwrap_or(false),
            direct: o.toggle("direct")?.unwrap_or(false),
            iommu: o.toggle("iommu")?.unwrap_or(false),
            num_queues: o.u16_value("num_queues", NUM_QUEUES_EXPECTED)?.unwrap_or(1),
            queue_size: o
                .u16_value("queue_size", QUEUE_SIZE_EXPECTED)?
                .unwrap_or_else(default_queue_size),
            vhost_user: o.toggle("vhost_user")?.unwrap_or(false),
            vhost_socket: o.text("socket"),
            rate_limit_group: o.text("rate_limit_group"),
            rate_limiter_config: None,
            id: o.id()?,
            serial: o.text("serial"),
            pci_segment: o.pci_segment()?,
            pci_device_id: None,
            queue_affinity: o.text("queue_affinity").map(Value::String),
            backing_files: o.toggle("backing_files")?.unwrap_or(false),
            sparse: o.toggle("sparse")?.unwrap_or(true),
            image_type: o.text("image_type"),
            lock_granularity: o.text("lock_granularity"),
            disable_io_uring: false,
            disable_aio: false,
            transport: o.transport()?,
            passed_file: PassedFd::default(),
        };
        config.validated(index)
    }

    /// Names the device `_disk<index>` if it has no id, checks it, and
    /// forgets the fields that hold only what changes nothing (so the
    /// config `vm.info` shows creates the same one).
    pub fn validated(mut self, index: usize) -> Result<Self, ConfigError> {
        name_device(&mut self.id, "disk", index);
        self.validate()?;
        self.image_type = None;
        self.lock_granularity = None;
        self.queue_affinity = None;
        Ok(self)
    }

    /// Every check of a disk's config, for the command line and the API
    /// alike: each error names the key and the limit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "disk";
        no_pci_device_id(OPTION, self.pci_device_id)?;
        no_iommu(OPTION, self.iommu)?;
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        self.check_unimplemented()?;
        if self.path.as_os_str().is_empty() {
            return Err(invalid(OPTION, "path", "", "the path of a raw disk image"));
        }
        if !(1..=MAX_NUM_QUEUES).contains(&u32::from(self.num_queues)) {
            return Err(invalid(
                OPTION,
                "num_queues",
                self.num_queues,
                NUM_QUEUES_EXPECTED,
            ));
        }
        let q = u32::from(self.queue_size);
        if !(q.is_power_of_two() && (4..=MAX_QUEUE_SIZE).contains(&q)) {
            return Err(invalid(OPTION, "queue_size", q, QUEUE_SIZE_EXPECTED));
        }
        if let Some(s) = &self.serial {
            if s.len() > MAX_SERIAL_LEN || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                return Err(invalid(
                    OPTION,
                    "serial",
                    s,
                    "at most 20 printable ASCII characters (virtio-blk's GET_ID)",
                ));
            }
        }
        Ok(())
    }

    /// Cloud Hypervisor's fields this VMM does not implement: only the
    /// value that changes nothing.
    fn check_unimplemented(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "disk";
        let refuse = |key: &str, value: &dyn std::fmt::Display, why: &str| {
            Err(unsupported(OPTION, key, value, why))
        };
        if self
            .rate_limiter_config
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Err(ConfigError::Unsupported {
                option: OPTION,
                message: "rate_limiter_config is not supported (only null)".into(),
            });
        }
        if let Some(v) = &self.queue_affinity {
            if !(v.is_null() || v.as_array().is_some_and(|a| a.is_empty())) {
                // The command line's text as it was given; JSON as JSON.
                let shown = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                return refuse(
                    "queue_affinity",
                    &shown,
                    "no rate limits, queue affinity or vhost-user socket here",
                );
            }
        }
        for (key, on) in [
            ("disable_io_uring", self.disable_io_uring),
            ("disable_aio", self.disable_aio),
        ] {
            if on {
                return Err(ConfigError::Unsupported {
                    option: OPTION,
                    message: format!("{key}=true is not supported (only false)"),
                });
            }
        }
        if self.vhost_user {
            return refuse("vhost_user", &"on", "only disk images the VMM opens itself");
        }
        if self.backing_files {
            return refuse("backing_files", &"on", "raw images only");
        }
        if !self.sparse {
            return refuse("sparse", &"off", "images are used as they are (sparse=on)");
        }
        if let Some(t) = self
            .image_type
            .as_ref()
            .filter(|t| !matches!(t.as_str(), "raw" | "Raw" | "Unknown"))
        {
            return refuse("image_type", t, "raw images only");
        }
        let why = "no rate limits, queue affinity or vhost-user socket here";
        if let Some(s) = &self.vhost_socket {
            return refuse("socket", s, why);
        }
        if let Some(g) = &self.rate_limit_group {
            return refuse("rate_limit_group", g, why);
        }
        if let Some(l) = self
            .lock_granularity
            .as_ref()
            .filter(|v| !matches!(v.as_str(), "byte-range" | "ByteRange"))
        {
            return refuse("lock_granularity", l, "only the default byte-range");
        }
        Ok(())
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
                ..DiskConfig::parse("path=/x", 0).unwrap()
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
