//! The virtio-MMIO register state machine under any sequence of reads and
//! writes a driver could make (status, features, queues, shared memory,
//! config space).
#![no_main]

use dax_vmm_fuzz::{accesses, memory, FuzzDevice};
use libfuzzer_sys::fuzz_target;
use virtio_devices::transport::mmio::MmioTransport;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

fuzz_target!(|data: &[u8]| {
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let dev = Box::new(FuzzDevice {
        shm_guest_addr: 1 << 32,
    });
    let mut t = MmioTransport::new(dev, GuestMemoryAtomic::new(memory()), irq).unwrap();
    for (write, offset, mut bytes) in accesses(data, 0x200) {
        if write {
            t.write(offset, &bytes);
        } else {
            t.read(offset, &mut bytes);
        }
    }
});
