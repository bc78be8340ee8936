//! The net devices' taps: opened by name (created if missing, given the
//! configured host address) or taken as an fd an operator passed, and
//! for a tap opened by its own name, how to open it again (a migration's
//! switch over the network closes it for the receiving VMM and, should the
//! migration fail, opens it again).

use std::os::fd::AsFd;
use std::sync::Arc;

use virtio_devices::net::header::allowed_offloads;
use virtio_devices::net::{Net, NetDeviceConfig, Tap, TapError, TapLike, TapReopen};

use super::{DeviceManager, DeviceManagerError, PciAddress};
use crate::config::NetConfig;

impl DeviceManager {
    /// Opens the device's tap and puts a virtio-net device on it on its
    /// transport.
    pub(super) fn add_net_device(
        &mut self,
        n: &NetConfig,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let tap = open_tap(n)?;
        let tap_name = tap.name().to_string();
        let copy =
            tap.as_fd()
                .try_clone_to_owned()
                .map_err(|source| DeviceManagerError::HostFd {
                    id: n.id.clone(),
                    source,
                })?;
        let tap = Arc::new(tap);
        let device = Net::new(NetDeviceConfig {
            id: n.id.clone(),
            tap,
            mac: n.mac,
            mtu: n.mtu,
            queue_size: n.queue_size,
            allowed_offloads: allowed_offloads(n.offload_csum, n.offload_tso),
            reopen: NamedTap::reopen(n),
        });
        let slot = self.place(&n.id, Box::new(device), n.transport, n.pci_segment, None)?;
        self.taps.push((n.id.clone(), Some(copy)));
        tracing::info!(device = %n.id, "net {}: tap {tap_name}, guest MAC {}", n.id, n.mac);
        Ok(slot)
    }
}

/// Opens the tap a net config names, creating it if it does not exist (a
/// new `vmtap<N>` without a name), and gives its host side the configured
/// address and MTU and brings it up. As in Cloud Hypervisor, a tap that
/// existed before keeps the address it has.
fn open_tap(n: &NetConfig) -> Result<Tap, TapError> {
    if let Some(fd) = n.fds.0.first() {
        // A tap someone else set up (Kata): its address is theirs, as in
        // Cloud Hypervisor, which ignores ip/mask with fds.
        let fd = fd.try_clone().map_err(|e| TapError::NotATap {
            fd: std::os::fd::AsRawFd::as_raw_fd(fd),
            why: format!("dup: {e}"),
        })?;
        return Tap::from_fd(fd);
    }
    NamedTap::of(n).open()
}

/// How a net device's tap is opened by name: kept by the device of a tap
/// named in its config (`tap=NAME`, not a `%d` template) so that a
/// migration's switch can close it and open it again. A tap this VMM
/// created goes when closed; opened again it is created again and given
/// the configured address again. A template name is not kept: a receiving
/// VMM gets a tap of its own from it, so there is nothing to let go of.
#[derive(Clone)]
struct NamedTap {
    id: String,
    name: Option<String>,
    ip: Option<std::net::Ipv4Addr>,
    mask: Option<std::net::Ipv4Addr>,
    mtu: Option<u16>,
}

impl NamedTap {
    fn of(n: &NetConfig) -> Self {
        NamedTap {
            id: n.id.clone(),
            name: n.tap.clone(),
            ip: n.ip,
            mask: n.mask,
            mtu: n.mtu,
        }
    }

    /// What opens the tap again, for a tap opened by its own name.
    fn reopen(n: &NetConfig) -> Option<TapReopen> {
        // A tap a local migration passed is still this VM's by name.
        let by_name = n.fds.0.is_empty() || n.fds_from_migration;
        let named = by_name && n.tap.as_ref().is_some_and(|t| !t.contains('%'));
        let tap = Self::of(n);
        named.then(|| {
            Box::new(move || {
                let opened = tap.open()?;
                tracing::info!(
                    "net {}: tap {} opened again (a migration did not complete)",
                    tap.id,
                    opened.name()
                );
                Ok(Arc::new(opened) as Arc<dyn TapLike>)
            }) as TapReopen
        })
    }

    fn open(&self) -> Result<Tap, TapError> {
        let name = self
            .name
            .as_deref()
            .unwrap_or(crate::config::DEFAULT_TAP_NAME);
        let existed = self
            .name
            .as_ref()
            .is_some_and(|t| std::path::Path::new("/sys/class/net").join(t).exists());
        let tap = Tap::open_named(name)?;
        if self.mask.is_some() && self.ip.is_none() {
            tracing::warn!(
                "net {}: mask= without ip= gives the tap no address",
                self.id
            );
        }
        let (ip, mask) = if existed {
            if self.ip.is_some() {
                tracing::warn!(
                    "net {}: tap {name} exists already; its address is left as it is",
                    self.id
                );
            }
            (None, None)
        } else {
            (self.ip, self.mask)
        };
        tap.configure_host_side(ip, mask, self.mtu)?;
        Ok(tap)
    }
}
