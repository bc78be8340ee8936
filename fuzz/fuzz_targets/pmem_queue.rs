//! The virtio-pmem request queue on arbitrary descriptor chains: every
//! chain is used once, answered or dropped, never a crash.
#![no_main]

use dax_vmm_fuzz::{memory, queue_from};
use libfuzzer_sys::fuzz_target;
use virtio_devices::pmem::request::process_queue;

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let mut q = queue_from(&mem, data);
    let mut flushes = 0;
    let fail = data.last().is_some_and(|b| b & 1 == 1);
    let used = process_queue(&mut q, &mem, || {
        flushes += 1;
        if fail {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            Ok(())
        }
    });
    if let Ok(used) = used {
        assert!(flushes <= used);
    }
});
