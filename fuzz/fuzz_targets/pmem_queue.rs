//! The virtio-pmem request queue on arbitrary descriptor chains and ring
//! indices: every chain is used once, answered or dropped, never a crash;
//! an available index more than the queue's size ahead is an error (the
//! worker stops the queue), never "nothing to do" on every kick.
#![no_main]

use dax_vmm_fuzz::{memory, queue_at_indices};
use libfuzzer_sys::fuzz_target;
use virtio_devices::pmem::request::process_queue;

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let (mut q, impossible) = queue_at_indices(&mem, data);
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
    if impossible {
        assert!(used.is_err(), "an impossible available index was served");
    }
    if let Ok(used) = used {
        assert!(flushes <= used);
    }
});
