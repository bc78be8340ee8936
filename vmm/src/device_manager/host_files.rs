//! The devices on host files that a local migration hands to the new VMM
//! as they are, open: a blk device's image (its lock with it) and the
//! vsock device's listening socket. Each is built on the file a sender
//! passed when its config carries one (checked first), and keeps a copy
//! of its fd for a migration of its own.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixListener;

use virtio_devices::block::{Block, BlockDeviceConfig, DiskFile};
use virtio_devices::vsock::{SocketName, Vsock};

use super::{DeviceManager, DeviceManagerError, PciAddress};
use crate::config::{DiskConfig, VsockConfig};

impl DeviceManager {
    /// Each blk device's id and open image.
    pub fn disk_images(&self) -> impl Iterator<Item = (&str, BorrowedFd<'_>)> {
        self.disk_images
            .iter()
            .map(|(id, fd)| (id.as_str(), fd.as_fd()))
    }

    /// The vsock device's id and listening socket, if there is one.
    pub fn vsock_listener(&self) -> Option<(&str, BorrowedFd<'_>)> {
        self.vsock_listener
            .as_ref()
            .and_then(|(id, fd, _)| Some((id.as_str(), fd.as_ref()?.as_fd())))
    }

    /// Whether the vsock device (if there is one) removes its socket's
    /// name when it goes: a local migration's receiver claims the name of
    /// the socket it was passed once it has the whole VM.
    pub fn vsock_socket_name(&self) -> Option<&SocketName> {
        self.vsock_listener.as_ref().map(|(_, _, name)| name)
    }

    /// Opens the disk image (or takes the one a local migration's sender
    /// passed, once checked) and puts a virtio-blk device for it on its
    /// transport.
    pub(super) fn add_disk_device(
        &mut self,
        d: &DiskConfig,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let c = BlockDeviceConfig {
            id: d.id.clone(),
            path: d.path.clone(),
            readonly: d.readonly,
            direct: d.direct,
            num_queues: d.num_queues,
            queue_size: d.queue_size,
            serial: d.serial.clone(),
        };
        let dup_err = |source| DeviceManagerError::HostFd {
            id: d.id.clone(),
            source,
        };
        let device = match d.passed_file.try_clone() {
            Some(fd) => {
                let file = std::fs::File::from(fd.map_err(dup_err)?);
                Block::with_disk(
                    &c,
                    DiskFile::from_passed(&d.path, file, d.readonly, d.direct)?,
                )
            }
            None => Block::new(&c)?,
        };
        let image = device
            .image()
            .as_fd()
            .try_clone_to_owned()
            .map_err(dup_err)?;
        let size = device.size();
        let slot = self.place(&d.id, Box::new(device), d.transport, d.pci_segment, None)?;
        tracing::info!(
            "disk {}: {size} bytes of {}{}",
            d.id,
            d.path.display(),
            if d.readonly { " (read-only)" } else { "" }
        );
        self.disk_images.push((d.id.clone(), image));
        Ok(slot)
    }

    /// Binds the vsock device's socket (or serves the listener a local
    /// migration's sender passed, once checked) and puts the device on its
    /// transport.
    pub(super) fn add_vsock_device(
        &mut self,
        v: &VsockConfig,
    ) -> Result<Option<PciAddress>, DeviceManagerError> {
        let dup_err = |source| DeviceManagerError::HostFd {
            id: v.id.clone(),
            source,
        };
        let device = match v.passed_listener.try_clone() {
            Some(fd) => Vsock::with_listener(
                v.id.clone(),
                v.cid,
                v.socket.clone(),
                UnixListener::from(fd.map_err(dup_err)?),
            )?,
            None => Vsock::new(v.id.clone(), v.cid, v.socket.clone())?,
        };
        let listener = device
            .listener()
            .map(|l| l.try_clone_to_owned())
            .transpose()
            .map_err(dup_err)?;
        let name = device.socket_name().clone();
        let slot = self.place(&v.id, Box::new(device), v.transport, v.pci_segment, None)?;
        tracing::info!(
            "vsock {}: guest cid {}, host socket {}",
            v.id,
            v.cid,
            v.socket.display()
        );
        self.vsock_listener = Some((v.id.clone(), listener, name));
        Ok(slot)
    }
}
