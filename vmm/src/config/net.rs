//! `--net tap=<name>[,ip=<ipv4>][,mask=<ipv4>][,mac=<mac>][,mtu=<n>][,num_queues=2][,queue_size=<n>][,id=<id>][,offload_tso=on|off][,offload_csum=on|off][,transport=pci|mmio]`:
//! Cloud Hypervisor's keys (its others accepted with their defaults only)
//! plus our `transport`. The VMM opens the tap `tap=` (creating it if it
//! does not exist; without `tap=` the kernel names a new one `vmtap<N>`),
//! and gives its host side `ip`/`mask` when it created it.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use virtio_devices::net::tap::check_tap_name;
use virtio_devices::net::{MacAddr, MAX_MTU, MIN_MTU, NUM_QUEUES};

use serde::{Deserialize, Serialize};

use super::checks::{
    invalid, name_device, no_iommu, no_pci_device_id, non_empty_id, transport_and_segment,
    unsupported, yes,
};
use super::option_parser::OptionValues;
use super::{ConfigError, Transport};

/// Largest queue, as Cloud Hypervisor allows.
pub const MAX_QUEUE_SIZE: u32 = 32768;
/// Cloud Hypervisor's default queue size (and Kata's).
pub const DEFAULT_QUEUE_SIZE: u16 = 256;
/// The name a tap created without `tap=` gets (the kernel fills in N).
pub const DEFAULT_TAP_NAME: &str = "vmtap%d";

/// Tap fds another process opened and passed with `vm.add-net` as
/// SCM_RIGHTS (Kata's `fds`), shared by the config's copies; compared by
/// fd number.
#[derive(Clone, Default)]
pub struct TapFds(pub Arc<Vec<OwnedFd>>);

impl TapFds {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn numbers(&self) -> Vec<i32> {
        self.0.iter().map(AsRawFd::as_raw_fd).collect()
    }
}

impl PartialEq for TapFds {
    fn eq(&self, other: &Self) -> bool {
        self.numbers() == other.numbers()
    }
}

impl Eq for TapFds {}

impl std::fmt::Debug for TapFds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TapFds{:?}", self.numbers())
    }
}

/// A virtio-net device on a tap: Cloud Hypervisor's NetConfig (its JSON
/// field names and defaults; Kata's driver sends `mac`, `ip`/`mask`,
/// `num_queues`, `queue_size`, `iommu`, `vhost_user`, `vhost_mode`, the
/// `offload_*` toggles and, with `vm.add-net`, its tap fds) plus our
/// `transport`, what `--net` and `vm.add-net` both fill and
/// [`NetConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// The tap's name; None: a new `vmtap<N>` (or the fds given).
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    pub ip: Option<Ipv4Addr>,
    #[serde(default)]
    pub mask: Option<Ipv4Addr>,
    /// The guest's MAC (a random local one when not configured, chosen
    /// when the config is read so `vm.info` shows the one the guest has).
    #[serde(default = "MacAddr::random_local", with = "mac_text")]
    pub mac: MacAddr,
    #[serde(default, skip_serializing)]
    pub host_mac: Option<String>,
    #[serde(default)]
    pub mtu: Option<u16>,
    #[serde(default)]
    pub iommu: bool,
    #[serde(default = "default_num_queues")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    #[serde(default)]
    pub vhost_user: bool,
    #[serde(default, skip_serializing)]
    pub vhost_socket: Option<String>,
    /// Only `Client` (`vm.info` says so, from [`super::ch_fields`]).
    #[serde(default, skip_serializing)]
    pub vhost_mode: Option<String>,
    /// Empty when not given: [`NetConfig::validated`] names it `_net<N>`.
    #[serde(default, deserialize_with = "non_empty_id")]
    pub id: String,
    /// Numbers in the sender's process, meaningless here: the fds
    /// themselves travel as SCM_RIGHTS with the request ([`Self::fds`]).
    /// Ignored, as Cloud Hypervisor ignores them.
    #[serde(default, rename = "fds", skip_serializing)]
    pub fd_numbers: Option<Vec<i32>>,
    /// Only null: there is no rate limiter.
    #[serde(default, skip_serializing)]
    pub rate_limiter_config: Option<serde_json::Value>,
    /// The PCI segment the device is on (virtio-PCI only).
    #[serde(default)]
    pub pci_segment: u16,
    /// Cloud Hypervisor's requested PCI slot: null only (slots are assigned).
    #[serde(default, skip_serializing)]
    pub pci_device_id: Option<u8>,
    /// TSO offered (where the tap takes it); only with `offload_csum`,
    /// since segmentation needs checksum offload.
    #[serde(default = "yes")]
    pub offload_tso: bool,
    /// UFO is never offered (the kernel segments UDP); on or off changes
    /// nothing (`vm.info` says true, Cloud Hypervisor's default).
    #[serde(default, skip_serializing)]
    pub offload_ufo: Option<bool>,
    #[serde(default = "yes")]
    pub offload_csum: bool,
    #[serde(default)]
    pub transport: Transport,
    /// Tap fds passed with the request; when there are any, the device
    /// uses them instead of opening `tap` (and leaves their address alone).
    #[serde(skip)]
    pub fds: TapFds,
    /// `fds` is the tap a local migration's sender passed for `tap` (it
    /// could not be opened by name while the sender held it): the tap is
    /// still this VM's by name, so a later migration's switch closes it and
    /// opens it again by name, as for a tap the VMM opened itself.
    #[serde(skip)]
    pub fds_from_migration: bool,
}

fn default_num_queues() -> u16 {
    2
}

fn default_queue_size() -> u16 {
    DEFAULT_QUEUE_SIZE
}

/// A MAC address as text, `52:54:00:12:34:56`.
mod mac_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use virtio_devices::net::MacAddr;

    pub fn serialize<S: Serializer>(mac: &MacAddr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(mac)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<MacAddr, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(|_| {
            serde::de::Error::custom(format!(
                "mac=\"{text}\" is invalid: expected {}",
                super::MAC_EXPECTED
            ))
        })
    }
}

const MAC_EXPECTED: &str = "six hex bytes such as 52:54:00:12:34:56";
const NUM_QUEUES_EXPECTED: &str = "2 (one RX/TX queue pair; multiqueue taps are not supported)";
const QUEUE_SIZE_EXPECTED: &str = "a power of two from 2 to 32768";
/// Why the keys Cloud Hypervisor has for vhost-user, host MACs, rate
/// limits and inherited fds are refused.
const NOT_HERE: &str = "no vhost-user socket, host MAC, rate limits or inherited fds on the command line (vm.add-net takes fds)";

/// Keys `--net` accepts: Cloud Hypervisor's, and `transport`. Those after
/// `transport` are Cloud Hypervisor's that this VMM does not implement:
/// accepted only with the value that changes nothing.
pub const NET_KEYS: &[&str] = &[
    "tap",
    "ip",
    "mask",
    "mac",
    "mtu",
    "num_queues",
    "queue_size",
    "id",
    "offload_tso",
    "offload_ufo",
    "offload_csum",
    "transport",
    "iommu",
    "pci_segment",
    "host_mac",
    "vhost_user",
    "socket",
    "vhost_mode",
    "fd",
    "bw_size",
    "bw_one_time_burst",
    "bw_refill_time",
    "ops_size",
    "ops_one_time_burst",
    "ops_refill_time",
];

fn parse_ipv4(v: &str) -> Result<Ipv4Addr, &'static str> {
    v.parse()
        .map_err(|_| "an IPv4 address such as 192.168.249.1")
}

fn mtu_expected() -> String {
    format!("{MIN_MTU} to {MAX_MTU} bytes")
}

impl NetConfig {
    /// Gives the device the tap fds a client passed: one, since the
    /// device has one queue pair (a multiqueue tap would pass one per pair).
    pub fn with_fds(mut self, fds: Vec<OwnedFd>) -> Result<Self, ConfigError> {
        if fds.len() > NUM_QUEUES / 2 {
            return Err(ConfigError::InvalidValue {
                option: "net",
                key: "fds",
                value: format!("{} fds", fds.len()),
                expected: "one tap fd (one queue pair, num_queues=2)".into(),
            });
        }
        if !fds.is_empty() && self.transport == Transport::Mmio {
            return Err(ConfigError::Unsupported {
                option: "net",
                message: "passed tap fds are for hot-plug over PCI (transport=pci)".into(),
            });
        }
        self.fds = TapFds(Arc::new(fds));
        Ok(self)
    }

    /// `index` names devices given without `id=` (`_net0`, … as Cloud
    /// Hypervisor does).
    pub fn parse(input: &str, index: usize) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("net", input, NET_KEYS)?, index)
    }

    /// Fills a config from the values of `--net`
    /// and checks it.
    fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        // Keys with no field here: Cloud Hypervisor's command-line spelling
        // of inherited fds and of its rate limiter.
        o.refuse_any(
            &[
                "fd",
                "bw_size",
                "bw_one_time_burst",
                "bw_refill_time",
                "ops_size",
                "ops_one_time_burst",
                "ops_refill_time",
            ],
            NOT_HERE,
        )?;
        let mac = match o.get("mac") {
            None => MacAddr::random_local(),
            Some(m) => m.parse().map_err(|_| o.invalid("mac", m, MAC_EXPECTED))?,
        };
        NetConfig {
            tap: o.text("tap"),
            ip: o.convert("ip", parse_ipv4)?,
            mask: o.convert("mask", parse_ipv4)?,
            mac,
            host_mac: o.text("host_mac"),
            mtu: o.u16_value("mtu", &mtu_expected())?,
            iommu: o.toggle("iommu")?.unwrap_or(false),
            num_queues: o
                .u16_value("num_queues", NUM_QUEUES_EXPECTED)?
                .unwrap_or_else(default_num_queues),
            queue_size: o
                .u16_value("queue_size", QUEUE_SIZE_EXPECTED)?
                .unwrap_or(DEFAULT_QUEUE_SIZE),
            vhost_user: o.toggle("vhost_user")?.unwrap_or(false),
            vhost_socket: o.text("socket"),
            vhost_mode: o.text("vhost_mode"),
            id: o.id()?,
            fd_numbers: None,
            rate_limiter_config: None,
            pci_segment: o.pci_segment()?,
            pci_device_id: None,
            offload_tso: o.toggle("offload_tso")?.unwrap_or(true),
            offload_ufo: o.toggle("offload_ufo")?,
            offload_csum: o.toggle("offload_csum")?.unwrap_or(true),
            transport: o.transport()?,
            fds: TapFds::default(),
            fds_from_migration: false,
        }
        .validated(index)
    }

    /// Names the device `_net<index>` if it has no id, and checks it.
    pub fn validated(mut self, index: usize) -> Result<Self, ConfigError> {
        name_device(&mut self.id, "net", index);
        self.validate()?;
        // Cloud Hypervisor's api_client (runtime-rs, ch-remote) lists the
        // numbers of the fds it passes with every such request: normal,
        // so not worth more than a debug line.
        if self.fd_numbers.as_ref().is_some_and(|f| !f.is_empty()) {
            tracing::debug!("vm.add-net: fd numbers in the body are ignored; the fds come as SCM_RIGHTS with the request");
        }
        // What holds only what changes nothing is forgotten (so the config
        // `vm.info` shows creates the same one).
        self.fd_numbers = None;
        self.vhost_mode = None;
        self.offload_ufo = None;
        Ok(self)
    }

    /// Every check of a net device's config, for the command line and
    /// the API alike.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "net";
        no_pci_device_id(OPTION, self.pci_device_id)?;
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
        no_iommu(OPTION, self.iommu)?;
        transport_and_segment(OPTION, self.transport, self.pci_segment)?;
        if self.vhost_user {
            return Err(unsupported(
                OPTION,
                "vhost_user",
                "on",
                "only taps the VMM serves itself",
            ));
        }
        if let Some(m) = self
            .vhost_mode
            .as_ref()
            .filter(|m| !matches!(m.as_str(), "client" | "Client"))
        {
            return Err(unsupported(
                OPTION,
                "vhost_mode",
                m,
                "no vhost-user net here",
            ));
        }
        if let Some(s) = &self.vhost_socket {
            return Err(unsupported(OPTION, "socket", s, NOT_HERE));
        }
        if let Some(m) = &self.host_mac {
            return Err(unsupported(OPTION, "host_mac", m, NOT_HERE));
        }
        if let Some(t) = &self.tap {
            check_tap_name(t).map_err(|_| {
                invalid(
                    OPTION,
                    "tap",
                    t,
                    "an interface name of 1 to 15 bytes without '/' or spaces",
                )
            })?;
        }
        if !self.mac.is_unicast() {
            return Err(invalid(
                OPTION,
                "mac",
                self.mac,
                "a unicast address (first byte even)",
            ));
        }
        if let Some(m) = self.mtu.filter(|m| !(MIN_MTU..=MAX_MTU).contains(m)) {
            return Err(invalid(OPTION, "mtu", m, mtu_expected()));
        }
        if usize::from(self.num_queues) != NUM_QUEUES {
            return Err(invalid(
                OPTION,
                "num_queues",
                self.num_queues,
                NUM_QUEUES_EXPECTED,
            ));
        }
        let q = u32::from(self.queue_size);
        if !(q.is_power_of_two() && (2..=MAX_QUEUE_SIZE).contains(&q)) {
            return Err(invalid(OPTION, "queue_size", q, QUEUE_SIZE_EXPECTED));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_defaults_and_limits() {
        let n = NetConfig::parse(
            "tap=tap0,ip=192.168.249.1,mask=255.255.255.0,mac=52:54:00:00:00:01,mtu=1400,id=eth0",
            0,
        )
        .unwrap();
        assert_eq!(n.tap.as_deref(), Some("tap0"));
        assert_eq!(n.ip, Some(Ipv4Addr::new(192, 168, 249, 1)));
        assert_eq!(n.mac.to_string(), "52:54:00:00:00:01");
        assert_eq!((n.mtu, n.num_queues, n.queue_size), (Some(1400), 2, 256));
        assert_eq!((n.id.as_str(), n.transport), ("eth0", Transport::Pci));
        let d = NetConfig::parse("", 3).unwrap();
        assert_eq!((d.tap, d.ip, d.id.as_str()), (None, None, "_net3"));
        assert_eq!(d.mac.0[0] & 3, 2, "random, local, unicast");
        // Cloud Hypervisor's defaults as ch-remote sends them.
        assert!(NetConfig::parse(
            "tap=t,num_queues=2,queue_size=256,iommu=off,vhost_user=off,vhost_mode=client,offload_ufo=on,pci_segment=0",
            0
        )
        .is_ok());
        let e = |s: &str| NetConfig::parse(s, 0).unwrap_err().to_string();
        assert_eq!(
            e("num_queues=4"),
            "--net: num_queues=\"4\" is invalid: expected 2 (one RX/TX queue pair; multiqueue taps are not supported)"
        );
        assert!(e("queue_size=100").contains("a power of two from 2 to 32768"));
        assert!(e("mtu=67").contains("68 to 65517 bytes"));
        assert!(e("mtu=65518").contains("68 to 65517 bytes"));
        assert!(e("mac=01:00:00:00:00:01").contains("a unicast address"));
        assert!(e("mac=52:54:00").contains("six hex bytes"));
        assert!(e("ip=300.1.1.1").contains("an IPv4 address"));
        assert!(e("ip=fe80::1").contains("an IPv4 address"));
        assert!(e("tap=a/b").contains("tap=\"a/b\""));
        assert!(e("tap=0123456789abcdef").contains("1 to 15 bytes"));
        assert!(e("vhost_user=on").contains("vhost_user=on is not supported"));
        assert!(e("fd=3").contains("fd=3 is not supported"));
        assert!(e("bw_size=10").contains("rate limits"));
        assert!(NetConfig::parse("offload_csum=off,offload_tso=off", 0).is_ok());
        assert!(e("speed=1").contains("unknown key \"speed\""));
        assert!(e("iommu=on").contains("iommu=on is not supported"));
    }
}
