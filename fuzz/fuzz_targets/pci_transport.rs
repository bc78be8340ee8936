//! The virtio-PCI function under any sequence of configuration-space and
//! BAR0 accesses (common config, ISR, device config, notify, the MSI-X table
//! and PBA), as a driver — or a guest poking at the device — could make.
#![no_main]

use std::sync::Arc;

use dax_vmm_fuzz::{accesses, memory, FuzzDevice};
use libfuzzer_sys::fuzz_target;
use pci::msix::MsixEntry;
use virtio_devices::transport::pci::device::{MsiSender, VirtioPciDevice, BAR0_SIZE};
use vm_memory::GuestMemoryAtomic;

struct Sink;

impl MsiSender for Sink {
    fn send(&self, _vector: u16, _entry: MsixEntry) -> std::io::Result<()> {
        Ok(())
    }
}

const BAR0: u64 = 0xe000_0000;
const SHM: u64 = 0x2_0000_0000;

fuzz_target!(|data: &[u8]| {
    let dev = Box::new(FuzzDevice {
        shm_guest_addr: SHM,
    });
    let Ok(mut pci) = VirtioPciDevice::new(
        dev,
        GuestMemoryAtomic::new(memory()),
        BAR0,
        Some((SHM, 2 << 20)),
        3,
        Arc::new(Sink),
    ) else {
        return;
    };
    for (write, offset, mut bytes) in accesses(data, 0x100 + BAR0_SIZE) {
        match (offset < 0x100, write) {
            (true, true) => {
                let _ = pci.write_config(offset, &bytes);
            }
            (true, false) => pci.read_config(offset, &mut bytes),
            (false, true) => pci.write_bar0(offset - 0x100, &bytes),
            (false, false) => pci.read_bar0(offset - 0x100, &mut bytes),
        }
    }
});
