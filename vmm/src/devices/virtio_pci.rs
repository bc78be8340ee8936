//! Places virtio devices on PCI bus 0 through the virtio-PCI transport: BAR 0
//! in the 32-bit window on the MMIO bus, an ioeventfd per queue notify
//! address, MSI-X vectors as irqfds on routed GSIs, and the host bridge
//! described in the DSDT so Linux enumerates the bus.

use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use virtio_devices::transport::pci::device::{VirtioPciDevice, VirtioPciError, BAR0_SIZE};
use virtio_devices::VirtioDevice;
use vm_memory::GuestMemoryAtomic;

use super::gsi_routing::{GsiError, GsiRouter, IrqfdMsi};
use super::pci_root::{PciFunction, PciRoot, PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_SIZE};
use super::{Bus, BusDevice};
use crate::arch::x86_64::layout::{
    PCI_ECAM_SIZE, PCI_ECAM_START, PCI_MMIO32_SIZE, PCI_MMIO32_START, PCI_MMIO64_SIZE,
};
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum VirtioPciSetupError {
    #[error("PCI bus 0 is full")]
    BusFull,
    #[error("the 32-bit PCI window is full")]
    WindowFull,
    #[error("virtio-PCI device: {0}")]
    Device(#[from] VirtioPciError),
    #[error("virtio-PCI ioeventfd: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("PCI: {0}")]
    Bus(String),
    #[error("MSI-X routing: {0}")]
    Gsi(GsiError),
}

struct ConfigSpace(Arc<Mutex<VirtioPciDevice>>);

impl PciFunction for ConfigSpace {
    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read_config(offset, data);
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        let moved = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_config(offset, data);
        if let Some(bar) = moved {
            // The VMM places BARs inside the bridge's windows and Linux keeps
            // them; a guest that moves one loses that BAR's contents.
            log::warn!(
                "virtio-pci: the guest moved BAR {bar}; the VMM does not follow BAR relocation"
            );
        }
        moved
    }
}

struct Bar0(Arc<Mutex<VirtioPciDevice>>);

impl BusDevice for Bar0 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read_bar0(offset, data);
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_bar0(offset, data);
    }
}

pub struct PciDeviceManager {
    root: Arc<Mutex<PciRoot>>,
    router: Arc<GsiRouter>,
    next_bar0: u64,
    mmio64_start: u64,
}

impl PciDeviceManager {
    /// Puts configuration access on the buses: ports 0xCF8/0xCFC and ECAM.
    pub fn new(
        vm: &Arc<VmFd>,
        pio: &Bus,
        mmio: &Bus,
        mmio64_start: u64,
    ) -> Result<Self, VirtioPciSetupError> {
        let router = GsiRouter::new(vm.clone()).map_err(VirtioPciSetupError::Gsi)?;
        let root = Arc::new(Mutex::new(PciRoot::new()));
        let io = super::pci_root::PciConfigIo::new(root.clone());
        let bus_err = |e: super::bus::BusError| VirtioPciSetupError::Bus(e.to_string());
        pio.insert(
            Arc::new(Mutex::new(io)),
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_SIZE,
        )
        .map_err(bus_err)?;
        let ecam = super::pci_root::PciEcam::new(root.clone());
        mmio.insert(Arc::new(Mutex::new(ecam)), PCI_ECAM_START, PCI_ECAM_SIZE)
            .map_err(bus_err)?;
        Ok(PciDeviceManager {
            root,
            router,
            next_bar0: PCI_MMIO32_START,
            mmio64_start,
        })
    }

    /// Adds `device`; `shm_bar` is (guest address, size) of its shared memory
    /// BAR, which the caller has already backed with a KVM memory slot.
    pub fn add(
        &mut self,
        vm: &Arc<VmFd>,
        mmio: &Bus,
        mem: &GuestMemoryAtomic<GuestMemoryMmap>,
        device: Box<dyn VirtioDevice>,
        shm_bar: Option<(u64, u64)>,
    ) -> Result<(), VirtioPciSetupError> {
        let bar0 = self.next_bar0;
        if bar0 + BAR0_SIZE > PCI_MMIO32_START + PCI_MMIO32_SIZE {
            return Err(VirtioPciSetupError::WindowFull);
        }
        let vectors = device.queue_max_sizes().len() as u16 + 1;
        let msi = IrqfdMsi::new(self.router.clone(), vectors).map_err(VirtioPciSetupError::Gsi)?;
        let dev = VirtioPciDevice::new(device, mem.clone(), bar0, shm_bar, vectors, Arc::new(msi))?;
        for (evt, offset, _queue) in dev.queue_notifiers() {
            vm.register_ioevent(evt, &IoEventAddress::Mmio(bar0 + offset), NoDatamatch)
                .map_err(VirtioPciSetupError::Kvm)?;
        }
        let dev = Arc::new(Mutex::new(dev));
        self.root
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(Arc::new(Mutex::new(ConfigSpace(dev.clone()))))
            .ok_or(VirtioPciSetupError::BusFull)?;
        mmio.insert(Arc::new(Mutex::new(Bar0(dev))), bar0, BAR0_SIZE)
            .map_err(|e| VirtioPciSetupError::Bus(e.to_string()))?;
        self.next_bar0 += BAR0_SIZE;
        Ok(())
    }

    /// The host bridge: bus 0, the config ports, the 32- and 64-bit windows.
    pub fn append_aml(&self, sink: &mut Vec<u8>) {
        let mmio64_end = self.mmio64_start + PCI_MMIO64_SIZE - 1;
        aml::Device::new(
            "_SB_.PCI0".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08")),
                &aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03")),
                &aml::Name::new("_ADR".into(), &aml::ZERO),
                &aml::Name::new("_SEG".into(), &aml::ZERO),
                &aml::Name::new("_UID".into(), &aml::ZERO),
                &aml::Name::new("_BBN".into(), &aml::ZERO),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![
                        &aml::AddressSpace::new_bus_number(0x0u16, 0x0u16),
                        &aml::IO::new(
                            PCI_CONFIG_IO_PORT as u16,
                            PCI_CONFIG_IO_PORT as u16,
                            1,
                            PCI_CONFIG_IO_SIZE as u8,
                        ),
                        &aml::AddressSpace::new_memory(
                            aml::AddressSpaceCacheable::NotCacheable,
                            true,
                            PCI_MMIO32_START as u32,
                            (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32,
                            None,
                        ),
                        &aml::AddressSpace::new_memory(
                            aml::AddressSpaceCacheable::PreFetchable,
                            true,
                            self.mmio64_start,
                            mmio64_end,
                            None,
                        ),
                    ]),
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
}
