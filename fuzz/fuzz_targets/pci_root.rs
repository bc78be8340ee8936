//! The VMM's PCI root as a guest reaches it: ports 0xCF8/0xCFC, ECAM, the ACPI PCI hot-plug registers, the GED and ACPI PM ports, with devices coming and going.
//!
//! The buses are laid out as the VMM lays them out (vm.rs, device_manager.rs,
//! devices/virtio_pci.rs), with two PCI segments (segment 0 also behind the
//! config ports); slot 1 of each holds a virtio-PCI function. Each input
//! byte group is a port or memory access of any width KVM can exit with,
//! at any offset in and around the devices, or a hot-plug (add, remove,
//! GED notification, the control thread taking the ejections).
#![no_main]

use std::sync::{Arc, Mutex};

use dax_vmm_fuzz::{memory, take, take_u8, FuzzDevice};
use libfuzzer_sys::fuzz_target;
use pci::msix::MsixEntry;
use virtio_devices::transport::pci::device::{MsiSender, VirtioPciDevice};
use vm_memory::GuestMemoryAtomic;
use vmm::arch::x86_64::layout::{pci_ecam_start, PCI_ECAM_SIZE, PCI_ECAM_START};
use vmm::bus::Bus;
use vmm::device_manager::hotplug_controller::{
    self as pci_hotplug, PciHotplugController, HOTPLUG_SLOTS,
};
use vmm::device_manager::pci_root::{
    PciConfigIo, PciEcam, PciFunction, PciRoot, PCI_CONFIG_IO_PORT,
};
use vmm::exit::ExitHandle;
use vmm::legacy::acpi_pm::{self, AcpiPm};
use vmm::legacy::ged::{self, Ged};
use vmm_sys_util::eventfd::EventFd;

struct Sink;

impl MsiSender for Sink {
    fn send(&self, _vector: u16, _entry: MsixEntry) -> std::io::Result<()> {
        Ok(())
    }
}

/// A virtio-PCI function's configuration space, as the VMM puts it on the
/// root (its BAR moves are the placer's business, not exercised here).
struct Function(VirtioPciDevice);

impl PciFunction for Function {
    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        self.0.read_config(offset, data);
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        self.0.write_config(offset, data)
    }
}

fn function() -> Option<Arc<Mutex<dyn PciFunction>>> {
    let dev = VirtioPciDevice::new(
        Box::new(FuzzDevice {
            shm_guest_addr: 0x2_0000_0000,
        }),
        GuestMemoryAtomic::new(memory()),
        0xc000_0000,
        Some((0x2_0000_0000, 2 << 20)),
        3,
        Arc::new(Sink),
    )
    .ok()?;
    Some(Arc::new(Mutex::new(Function(dev))))
}

/// Port ranges on the I/O bus: (base, length).
const PORTS: [(u64, u64); 4] = [
    (PCI_CONFIG_IO_PORT, 8),
    (
        pci_hotplug::PCI_HOTPLUG_PORT as u64,
        pci_hotplug::PCI_HOTPLUG_PORT_COUNT,
    ),
    (acpi_pm::SLEEP_CONTROL_PORT as u64, acpi_pm::PORT_COUNT),
    (ged::GED_PORT as u64, 1),
];

/// PCI segments in the fuzzed VM.
const SEGMENTS: u16 = 2;

fuzz_target!(|data: &[u8]| {
    let pio = Bus::new();
    let mmio = Bus::new();
    let roots: Vec<Arc<Mutex<PciRoot>>> = (0..SEGMENTS)
        .map(|_| Arc::new(Mutex::new(PciRoot::new())))
        .collect();
    let root = roots[0].clone();
    let hotplug = PciHotplugController::new(SEGMENTS).unwrap();
    let ejects = hotplug.eject_requests();
    let hotplug = Arc::new(Mutex::new(hotplug));
    let ged_irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let ged = Arc::new(Mutex::new(Ged::new(ged_irq.try_clone().unwrap())));
    let exit = Arc::new(ExitHandle::new().unwrap());
    pio.insert(
        Arc::new(Mutex::new(PciConfigIo::new(root.clone()))),
        PORTS[0].0,
        PORTS[0].1,
    )
    .unwrap();
    pio.insert(hotplug.clone(), PORTS[1].0, PORTS[1].1).unwrap();
    pio.insert(
        Arc::new(Mutex::new(AcpiPm::new(exit.clone()))),
        PORTS[2].0,
        PORTS[2].1,
    )
    .unwrap();
    pio.insert(ged.clone(), PORTS[3].0, PORTS[3].1).unwrap();
    for (segment, r) in roots.iter().enumerate() {
        mmio.insert(
            Arc::new(Mutex::new(PciEcam::new(r.clone()))),
            pci_ecam_start(u16::try_from(segment).expect("SEGMENTS roots")),
            PCI_ECAM_SIZE,
        )
        .unwrap();
        if let Some(f) = function() {
            r.lock().unwrap().add(f);
        }
    }
    let ecam_span = PCI_ECAM_SIZE * u64::from(SEGMENTS);

    let mut pos = 0;
    while pos < data.len() {
        let op = take_u8(data, &mut pos);
        let value = take::<8>(data, &mut pos);
        match op & 7 {
            // Port I/O: 1, 2 or 4 bytes, in and just around each device.
            0..=2 => {
                let (base, len) = PORTS[usize::from(op >> 3 & 3)];
                let addr = (base + (value >> 32) % (len + 4)).wrapping_sub(2);
                let size = [1, 2, 4, 4][usize::from(op >> 5 & 3)];
                let bytes = value.to_le_bytes();
                if op & 1 == 0 {
                    pio.write(addr, &bytes[..size]);
                } else {
                    let mut buf = vec![0u8; size];
                    pio.read(addr, &mut buf);
                }
            }
            // ECAM: 1, 2, 4 or 8 bytes anywhere in (and past) the window.
            3 | 4 => {
                let addr = PCI_ECAM_START + (value >> 32) % (ecam_span + 0x1000);
                let size = [1, 2, 4, 8][usize::from(op >> 5 & 3)];
                let bytes = value.to_le_bytes();
                if op & 7 == 3 {
                    mmio.write(addr, &bytes[..size]);
                } else {
                    let mut buf = vec![0u8; size];
                    // Only function 0 of each slot exists.
                    if mmio.read(addr, &mut buf) && (addr - PCI_ECAM_START) >> 12 & 7 != 0 {
                        assert!(
                            buf.iter().all(|&b| b == 0xff),
                            "function {addr:#x} answered"
                        );
                    }
                }
            }
            // Hot-plug: a device into the first free slot of a segment,
            // announced.
            5 => {
                let segment = segment_of(value);
                if let Some(f) = function() {
                    if let Some(slot) = roots[usize::from(segment)].lock().unwrap().add(f) {
                        assert!(HOTPLUG_SLOTS.contains(&slot), "slot {slot}");
                        hotplug.lock().unwrap().announce_add(segment, slot);
                        let _ = ged.lock().unwrap().raise(ged::EVENT_PCI_HOTPLUG);
                    }
                }
            }
            // Hot-unplug of any slot, announced; or the control thread
            // taking the slots the guest ejected and removing them.
            6 => {
                let slot = u8::try_from(value % 32).expect("below 32");
                let segment = segment_of(value);
                if roots[usize::from(segment)]
                    .lock()
                    .unwrap()
                    .remove(slot)
                    .is_some()
                {
                    hotplug.lock().unwrap().announce_remove(segment, slot);
                    let _ = ged.lock().unwrap().raise(ged::EVENT_PCI_HOTPLUG);
                }
            }
            _ => {
                for (segment, slot) in ejects.take() {
                    assert!(HOTPLUG_SLOTS.contains(&slot), "ejected slot {slot}");
                    assert!(segment < SEGMENTS, "ejected on segment {segment}");
                    roots[usize::from(segment)].lock().unwrap().remove(slot);
                }
            }
        }
    }
    let _ = (ged_irq.read(), exit.reason());
});

/// The segment an operation's `value` names: bits 8..24, modulo the
/// segment count.
fn segment_of(value: u64) -> u16 {
    let b = value.to_le_bytes();
    u16::from_le_bytes([b[1], b[2]]) % SEGMENTS
}
