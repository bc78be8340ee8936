//! Places virtio devices on the MMIO bus through the virtio-MMIO transport:
//! a register page, an ioeventfd per queue, an irqfd on an IOAPIC pin, and a
//! DSDT entry (`LNRO0005`) through which Linux's `virtio_mmio` finds it.

use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use kvm_ioctls::{IoEventAddress, VmFd};
use virtio_devices::transport::mmio::{MmioTransport, MMIO_REGION_SIZE};
use virtio_devices::VirtioDevice;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::layout::{
    VIRTIO_MMIO_IRQ_BASE, VIRTIO_MMIO_MAX_DEVICES, VIRTIO_MMIO_START,
};
use crate::bus::{Bus, BusDevice};
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum VirtioMmioError {
    #[error("too many virtio-MMIO devices (at most {VIRTIO_MMIO_MAX_DEVICES})")]
    TooMany,
    #[error("virtio-MMIO device {index}: {what}: {source}")]
    Kvm {
        index: u64,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("virtio-MMIO device {index}: {source}")]
    Io { index: u64, source: std::io::Error },
    #[error("virtio-MMIO device {index}: {message}")]
    Bus { index: u64, message: String },
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        MmioTransport::read(self, offset, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        MmioTransport::write(self, offset, data);
    }
}

/// One placed device: its id, its register page and its transport (the
/// same the bus serves).
pub struct MmioPlaced {
    pub id: String,
    pub base: u64,
    pub transport: Arc<Mutex<MmioTransport>>,
}

/// Adds virtio-MMIO devices one after the other and collects their AML.
pub struct MmioDeviceManager {
    next_index: u64,
    aml: Vec<u8>,
    placed: Vec<MmioPlaced>,
}

impl Default for MmioDeviceManager {
    fn default() -> Self {
        Self::new()
    }
}

impl MmioDeviceManager {
    pub fn new() -> Self {
        MmioDeviceManager {
            next_index: 0,
            aml: Vec::new(),
            placed: Vec::new(),
        }
    }

    /// Puts `device`, named `id`, on the next register page.
    pub fn add(
        &mut self,
        id: &str,
        vm: &VmFd,
        bus: &Bus,
        mem: &GuestMemoryAtomic<GuestMemoryMmap>,
        device: Box<dyn VirtioDevice>,
        activator: Arc<dyn virtio_devices::transport::common::Activator>,
    ) -> Result<(), VirtioMmioError> {
        let index = self.next_index;
        if index >= VIRTIO_MMIO_MAX_DEVICES {
            return Err(VirtioMmioError::TooMany);
        }
        let base = VIRTIO_MMIO_START + index * MMIO_REGION_SIZE;
        // Below VIRTIO_MMIO_MAX_DEVICES, the index, its GSI and its
        // registers (below the PCI ECAM, a layout assert) fit in 32 bits.
        let too_many = |_| VirtioMmioError::TooMany;
        let index32 = u32::try_from(index).map_err(too_many)?;
        let base32 = u32::try_from(base).map_err(too_many)?;
        let gsi = VIRTIO_MMIO_IRQ_BASE + index32;
        let io = |source| VirtioMmioError::Io { index, source };
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(io)?;
        vm.register_irqfd(&irqfd, gsi)
            .map_err(|source| VirtioMmioError::Kvm {
                index,
                what: "irqfd",
                source,
            })?;
        let mut transport = MmioTransport::new(device, mem.clone(), irqfd).map_err(io)?;
        transport.set_activator(activator);
        for (evt, offset, queue) in transport.queue_notifiers() {
            vm.register_ioevent(evt, &IoEventAddress::Mmio(base + offset), queue)
                .map_err(|source| VirtioMmioError::Kvm {
                    index,
                    what: "ioeventfd",
                    source,
                })?;
        }
        let transport = Arc::new(Mutex::new(transport));
        bus.insert(transport.clone(), base, MMIO_REGION_SIZE)
            .map_err(|e| VirtioMmioError::Bus {
                index,
                message: e.to_string(),
            })?;
        append_aml(&mut self.aml, index32, base32, gsi);
        self.next_index += 1;
        self.placed.push(MmioPlaced {
            id: id.to_string(),
            base,
            transport,
        });
        Ok(())
    }

    pub fn aml(&self) -> &[u8] {
        &self.aml
    }

    /// The devices placed so far, in the order they were added.
    pub fn placed(&self) -> &[MmioPlaced] {
        &self.placed
    }
}

fn append_aml(sink: &mut Vec<u8>, index: u32, base: u32, gsi: u32) {
    aml::Device::new(
        format!("_SB_.VM{index:02X}").as_str().into(),
        vec![
            &aml::Name::new("_HID".into(), &"LNRO0005"),
            &aml::Name::new("_UID".into(), &index),
            &aml::Name::new(
                "_CRS".into(),
                &aml::ResourceTemplate::new(vec![
                    &aml::Memory32Fixed::new(
                        true,
                        base,
                        const { narrow::u32_of(MMIO_REGION_SIZE) },
                    ),
                    &aml::Interrupt::new(true, true, false, false, gsi),
                ]),
            ),
        ],
    )
    .to_aml_bytes(sink);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aml_names_the_driver_page_and_pin() {
        let mut aml = Vec::new();
        append_aml(
            &mut aml,
            1,
            narrow::u32_of(VIRTIO_MMIO_START + 0x1000),
            VIRTIO_MMIO_IRQ_BASE + 1,
        );
        assert!(aml.windows(8).any(|w| w == b"LNRO0005"));
        assert!(aml.windows(4).any(|w| w == b"VM01"));
        // Memory32Fixed: tag 0x86, length 9, read-write, base, length.
        let mut fixed = vec![0x86, 0x09, 0x00, 0x01];
        fixed.extend_from_slice(&0xd000_1000u32.to_le_bytes());
        fixed.extend_from_slice(&0x1000u32.to_le_bytes());
        assert!(aml.windows(fixed.len()).any(|w| w == fixed), "{aml:x?}");
        assert!(aml
            .windows(9)
            .any(|w| w == [0x89, 0x06, 0x00, 0x03, 0x01, 0x06, 0x00, 0x00, 0x00]));
    }
}
