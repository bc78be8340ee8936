//! `--fs tag=<tag>,socket=<path>[,num_queues=<n>][,queue_size=<n>][,id=<id>][,dax=on|off][,cache_size=<size>][,dax_prefault=on|off][,transport=pci|mmio][,control_socket=<path>]`:
//! Cloud Hypervisor's keys, with its old `dax`/`cache_size` back, our `transport`,
//! `dax_prefault`, and the daemon's `control_socket` for DAX policy pushes.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::checks::{invalid, name_device, non_empty_id, transport_and_segment, yes};
use super::option_parser::{parse_size, OptionValues};
use super::{ConfigError, Transport};

/// The virtio-fs config space holds the tag in 36 bytes.
pub const MAX_TAG_LEN: usize = 36;
/// Request queues a device may have (the hiprio queue comes on top).
pub const MAX_NUM_QUEUES: u32 = 64;
/// Largest split virtqueue.
pub const MAX_QUEUE_SIZE: u32 = 32768;

// The largest window (`cache_size`, or what the daemon announces) has room
// in either area a window is placed in: the 64-bit PCI window and the
// virtio-MMIO device area. Checked when the VMM is built.
const _: () = {
    use crate::arch::x86_64::layout::{MMIO_DEVICE_MEMORY_SIZE, PCI_MMIO64_SIZE};
    assert!(dax_abi::MAX_WINDOW_SIZE <= PCI_MMIO64_SIZE);
    assert!(dax_abi::MAX_WINDOW_SIZE <= MMIO_DEVICE_MEMORY_SIZE);
};

/// A virtio-fs device: Cloud Hypervisor's FsConfig (its JSON field names
/// and defaults) with its old `dax`/`cache_size` back and our fields, what
/// `--fs` and `vm.add-fs` both fill and [`FsConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    pub tag: String,
    pub socket: PathBuf,
    #[serde(default = "one")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// Empty when not given: [`FsConfig::validated`] names it `_fs<N>`.
    #[serde(default, deserialize_with = "non_empty_id")]
    pub id: String,
    /// The PCI segment the device is on (virtio-PCI only).
    #[serde(default)]
    pub pci_segment: u16,
    #[serde(default = "yes")]
    pub dax: bool,
    /// None: take the size the daemon declares (GET_SHMEM_CONFIG).
    #[serde(default)]
    pub cache_size: Option<u64>,
    /// Map each new DAX range (up to the end of the file) into the guest's
    /// view when it is mapped, not page by page as the guest touches it.
    #[serde(default = "yes")]
    pub dax_prefault: bool,
    #[serde(default)]
    pub transport: Transport,
    /// The daemon's control socket, through which the API pushes DAX policies.
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    /// The DAX policy the device was configured with (`vm.create`,
    /// `vm.add-fs`), validated and normalized. The API's policy controller
    /// starts the device's desired policy from it and owns it from then on
    /// (`vm.dax-policy` changes it there; `vm.info` shows the desired one).
    #[serde(default)]
    pub dax_policy: Option<serde_json::Value>,
}

fn one() -> u16 {
    1
}

/// Cloud Hypervisor's default.
fn default_queue_size() -> u16 {
    1024
}

const NUM_QUEUES_EXPECTED: &str = "1 to 64 request queues";
const QUEUE_SIZE_EXPECTED: &str = "a power of two up to 32768";

/// Keys `--fs` accepts.
pub const FS_KEYS: &[&str] = &[
    "tag",
    "socket",
    "num_queues",
    "queue_size",
    "id",
    "dax",
    "cache_size",
    "dax_prefault",
    "transport",
    "pci_segment",
    "control_socket",
];

impl FsConfig {
    /// The daemon's control socket: the one given, else the one
    /// dax-virtiofsd serves by default beside its vhost-user socket if a
    /// socket is there now (a daemon without one, such as virtiofsd, has
    /// none, and policy pushes say so).
    pub fn effective_control_socket(&self) -> Option<PathBuf> {
        use std::os::unix::fs::FileTypeExt;
        if let Some(given) = &self.control_socket {
            return Some(given.clone());
        }
        let default = control_protocol::default_control_socket(&self.socket);
        std::fs::symlink_metadata(&default)
            .is_ok_and(|m| m.file_type().is_socket())
            .then_some(default)
    }

    pub fn parse(input: &str, index: usize) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("fs", input, FS_KEYS)?, index)
    }

    /// Fills a config from the values of `--fs` and checks it.
    fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        let required = |key| {
            o.text(key)
                .ok_or(ConfigError::MissingKey { option: "fs", key })
        };
        FsConfig {
            tag: required("tag")?,
            socket: PathBuf::from(required("socket")?),
            num_queues: o.u16_value("num_queues", NUM_QUEUES_EXPECTED)?.unwrap_or(1),
            queue_size: o
                .u16_value("queue_size", QUEUE_SIZE_EXPECTED)?
                .unwrap_or_else(default_queue_size),
            id: o.id()?,
            pci_segment: o.pci_segment()?,
            dax: o.toggle("dax")?.unwrap_or(true),
            cache_size: o.convert("cache_size", parse_size)?,
            dax_prefault: o.toggle("dax_prefault")?.unwrap_or(true),
            transport: o.transport()?,
            control_socket: o.text("control_socket").map(PathBuf::from),
            dax_policy: None,
        }
        .validated(index)
    }

    /// Names the device `_fs<index>` if it has no id, normalizes its DAX
    /// policy, and checks it.
    pub fn validated(mut self, index: usize) -> Result<Self, ConfigError> {
        name_device(&mut self.id, "fs", index);
        self.validate()?;
        if let Some(doc) = &self.dax_policy {
            let policy = policies::Policy::parse_json(&doc.to_string()).map_err(|e| {
                ConfigError::Unsupported {
                    option: "fs",
                    message: format!("dax_policy: {e}"),
                }
            })?;
            self.dax_policy = Some(policy.to_value());
        }
        Ok(self)
    }

    /// Every check of an fs device's config, for the command line and the
    /// API alike (the DAX policy is the policy parser's: [`Self::validated`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "fs";
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        if self.tag.is_empty() || self.tag.len() > MAX_TAG_LEN {
            return Err(invalid(
                OPTION,
                "tag",
                &self.tag,
                "1 to 36 bytes (the virtio-fs config space)",
            ));
        }
        if self.socket.as_os_str().is_empty() {
            return Err(invalid(
                OPTION,
                "socket",
                "",
                "the path of the daemon's vhost-user socket",
            ));
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
        if !(q.is_power_of_two() && q <= MAX_QUEUE_SIZE) {
            return Err(invalid(OPTION, "queue_size", q, QUEUE_SIZE_EXPECTED));
        }
        if let Some(size) = self.cache_size {
            if !self.dax {
                return Err(ConfigError::Unsupported {
                    option: OPTION,
                    message: "cache_size= needs dax=on".into(),
                });
            }
            // The bounds the daemon's policy has too (dax_abi).
            if !dax_abi::window_size_fits(size) {
                let limits = format!(
                    "a multiple of {} between {} and {}",
                    dax_abi::size_text(dax_abi::GUEST_RANGE_SIZE),
                    dax_abi::size_text(dax_abi::MIN_WINDOW_SIZE),
                    dax_abi::size_text(dax_abi::MAX_WINDOW_SIZE)
                );
                return Err(invalid(
                    OPTION,
                    "cache_size",
                    dax_abi::size_text(size),
                    limits,
                ));
            }
        }
        if self
            .control_socket
            .as_ref()
            .is_some_and(|c| c.as_os_str().is_empty())
        {
            return Err(invalid(
                OPTION,
                "control_socket",
                "",
                "the path of the daemon's --control-socket",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cloud_hypervisor_keys_and_ours() {
        let c = FsConfig::parse("tag=myfs,socket=/tmp/fs.sock,num_queues=2,queue_size=512,id=fs0,dax=on,cache_size=64M,transport=mmio", 0)
            .unwrap();
        assert_eq!(c.tag, "myfs");
        assert_eq!(c.socket, PathBuf::from("/tmp/fs.sock"));
        assert_eq!((c.num_queues, c.queue_size, c.id.as_str()), (2, 512, "fs0"));
        assert_eq!(
            (c.dax, c.cache_size, c.transport),
            (true, Some(64 << 20), Transport::Mmio)
        );
        let c = FsConfig::parse("tag=t,socket=s", 1).unwrap();
        assert_eq!(
            (c.num_queues, c.queue_size, c.id.as_str()),
            (1, 1024, "_fs1")
        );
        assert_eq!(
            (c.dax, c.cache_size, c.transport, c.dax_prefault),
            (true, None, Transport::Pci, true)
        );
        let c = FsConfig::parse("tag=t,socket=s,dax_prefault=off", 0).unwrap();
        assert!(!c.dax_prefault);
        assert!(FsConfig::parse("tag=t,socket=s,dax_prefault=maybe", 0)
            .unwrap_err()
            .to_string()
            .contains("dax_prefault"));
        assert!(!FsConfig::parse("tag=t,socket=s,dax=off", 0).unwrap().dax);
    }

    #[test]
    fn the_control_socket_is_the_given_one_or_the_daemons_default_if_there() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let socket = dir.as_path().join("vhost-fs.sock");
        let input = format!("tag=t,socket={}", socket.display());
        let c = FsConfig::parse(&input, 0).unwrap();
        assert_eq!(c.effective_control_socket(), None, "nothing there yet");
        let default = dir.as_path().join("vhost-fs.sock.control");
        std::fs::write(&default, b"").unwrap();
        assert_eq!(c.effective_control_socket(), None, "not a socket");
        std::fs::remove_file(&default).unwrap();
        let _daemon = std::os::unix::net::UnixListener::bind(&default).unwrap();
        assert_eq!(c.effective_control_socket(), Some(default));
        let given = FsConfig::parse(&format!("{input},control_socket=/c"), 0).unwrap();
        assert_eq!(given.effective_control_socket(), Some(PathBuf::from("/c")));
    }

    #[test]
    fn errors_name_the_key_and_the_limit() {
        let e = |s: &str| FsConfig::parse(s, 0).unwrap_err().to_string();
        assert_eq!(e("socket=s"), "--fs: missing required key \"tag\"");
        assert_eq!(e("tag=t"), "--fs: missing required key \"socket\"");
        assert!(e(&format!("tag={},socket=s", "x".repeat(37))).contains("1 to 36 bytes"));
        assert!(e("tag=t,socket=s,num_queues=0").contains("num_queues=\"0\""));
        assert!(e("tag=t,socket=s,queue_size=1000").contains("power of two"));
        assert!(
            e("tag=t,socket=s,cache_size=3M").contains("cache_size=\"3M\"")
                && e("tag=t,socket=s,cache_size=3M").contains("multiple of 2M")
        );
        assert!(e("tag=t,socket=s,cache_size=512G").contains("256G"));
        assert!(e("tag=t,socket=s,dax=off,cache_size=8M").contains("needs dax=on"));
        assert!(e("tag=t,socket=s,transport=vsock").contains("pci or mmio"));
        assert!(e("tag=t,socket=s,cache=always").contains("unknown key \"cache\""));
    }

    #[test]
    fn the_largest_window_the_daemon_may_announce_is_taken_and_placed() {
        // The daemon's policy is held to dax_abi's bounds; the VMM takes
        // the same as cache_size (and has room for it: see the `const _` above).
        let largest = dax_abi::size_text(dax_abi::MAX_WINDOW_SIZE);
        let c = FsConfig::parse(&format!("tag=t,socket=s,cache_size={largest}"), 0).unwrap();
        assert_eq!(c.cache_size, Some(dax_abi::MAX_WINDOW_SIZE));
    }
}
