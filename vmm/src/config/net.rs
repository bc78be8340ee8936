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

use super::option_parser::{parse_toggle, parse_u32, OptionValues};
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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The tap's name; None: a new `vmtap<N>` (or the fds given).
    pub tap: Option<String>,
    pub ip: Option<Ipv4Addr>,
    pub mask: Option<Ipv4Addr>,
    /// The guest's MAC (a random local one when not configured, chosen
    /// when the config is read so `vm.info` shows the one the guest has).
    pub mac: MacAddr,
    pub mtu: Option<u16>,
    pub num_queues: u16,
    pub queue_size: u16,
    pub id: String,
    /// TSO offered (where the tap takes it); only with `offload_csum`,
    /// since segmentation needs checksum offload.
    pub offload_tso: bool,
    pub offload_csum: bool,
    pub transport: Transport,
    /// The PCI segment the device is on (virtio-PCI only).
    pub pci_segment: u16,
    /// Tap fds passed with the request; when there are any, the device
    /// uses them instead of opening `tap` (and leaves their address alone).
    pub fds: TapFds,
}

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

    /// Checks and converts the values of `--net` (or of an API NetConfig).
    pub fn from_values(o: &OptionValues, index: usize) -> Result<Self, ConfigError> {
        o.check_ch_defaults()?;
        let (transport, pci_segment) = o.transport_and_segment()?;
        if o.convert("vhost_user", parse_toggle)?.unwrap_or(false) {
            return Err(o.unsupported("vhost_user", "only taps the VMM serves itself"));
        }
        if o.get("vhost_mode")
            .is_some_and(|m| !matches!(m, "client" | "Client"))
        {
            return Err(o.unsupported("vhost_mode", "no vhost-user net here"));
        }
        o.refuse_any(
            &[
                "socket",
                "host_mac",
                "fd",
                "bw_size",
                "bw_one_time_burst",
                "bw_refill_time",
                "ops_size",
                "ops_one_time_burst",
                "ops_refill_time",
            ],
            "no vhost-user socket, host MAC, rate limits or inherited fds on the command line (vm.add-net takes fds)",
        )?;
        let tap = o.get("tap").map(str::to_string);
        if let Some(t) = &tap {
            check_tap_name(t).map_err(|_| {
                o.invalid(
                    "tap",
                    t,
                    "an interface name of 1 to 15 bytes without '/' or spaces",
                )
            })?;
        }
        let ip = o.convert("ip", parse_ipv4)?;
        let mask = o.convert("mask", parse_ipv4)?;
        let mac = match o.get("mac") {
            None => MacAddr::random_local(),
            Some(m) => {
                let mac: MacAddr = m
                    .parse()
                    .map_err(|_| o.invalid("mac", m, "six hex bytes such as 52:54:00:12:34:56"))?;
                if !mac.is_unicast() {
                    return Err(o.invalid("mac", m, "a unicast address (first byte even)"));
                }
                mac
            }
        };
        let mtu = o
            .convert("mtu", parse_u32)?
            .map(|m| {
                o.checked_u16(
                    "mtu",
                    m,
                    (u32::from(MIN_MTU)..=u32::from(MAX_MTU)).contains(&m),
                    &format!("{MIN_MTU} to {MAX_MTU} bytes"),
                )
            })
            .transpose()?;
        let num_queues = o.convert("num_queues", parse_u32)?.unwrap_or(2);
        let num_queues = o.checked_u16(
            "num_queues",
            num_queues,
            num_queues as usize == NUM_QUEUES,
            "2 (one RX/TX queue pair; multiqueue taps are not supported)",
        )?;
        let queue_size = o
            .convert("queue_size", parse_u32)?
            .unwrap_or(u32::from(DEFAULT_QUEUE_SIZE));
        let queue_size = o.checked_u16(
            "queue_size",
            queue_size,
            queue_size.is_power_of_two() && (2..=MAX_QUEUE_SIZE).contains(&queue_size),
            "a power of two from 2 to 32768",
        )?;
        let offload_tso = o.convert("offload_tso", parse_toggle)?.unwrap_or(true);
        let offload_csum = o.convert("offload_csum", parse_toggle)?.unwrap_or(true);
        // UFO is never offered (the kernel segments UDP); on or off changes nothing.
        o.convert("offload_ufo", parse_toggle)?;
        Ok(NetConfig {
            tap,
            ip,
            mask,
            mac,
            mtu,
            num_queues,
            queue_size,
            id: o.device_id("net", index)?,
            offload_tso,
            offload_csum,
            transport,
            pci_segment,
            fds: TapFds::default(),
        })
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
