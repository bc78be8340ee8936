//! The vsock device's queue side on arbitrary descriptor chains: TX chains
//! parsed (rust-vmm's virtio-vsock checks plus the fallback that reads a
//! refused chain's header to reset its connection) and handed to the
//! backend, then RX chains filled with what it owes, with arbitrary ring
//! indices. Every chain is used once or the queue reports its error; a TX
//! available index more than the queue's size ahead is such an error (the
//! device stops its queues); never a crash.
#![no_main]

use std::sync::{Arc, OnceLock};

use dax_vmm_fuzz::{memory, queue_at_indices, queue_from};
use libfuzzer_sys::fuzz_target;
use virtio_devices::vsock::backend::UnixBackend;
use virtio_devices::vsock::queues::{fill_rx, process_tx, ActiveQueues};
use virtio_devices::{Interrupt, VirtioInterrupt};
use vmm_sys_util::eventfd::EventFd;

struct NoInterrupt;

impl VirtioInterrupt for NoInterrupt {
    fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
        Ok(())
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}

fn socket() -> &'static std::path::PathBuf {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vsock-queues-fuzz-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        dir.join("v.sock")
    })
}

fuzz_target!(|data: &[u8]| {
    let mem = memory();
    let Ok(mut backend) = UnixBackend::new(3, socket()) else {
        return;
    };
    backend.set_active(true);
    // The driver may well point the queues at the same rings; TX's
    // indices are written last, so they are the ones in memory.
    let (rx, event) = (queue_from(&mem, data), queue_from(&mem, data));
    let (tx, impossible) = queue_at_indices(&mem, data);
    let mut q = ActiveQueues::new(rx, tx, event, Arc::new(NoInterrupt));
    let sent = process_tx(&mut q, &mem, &mut backend);
    if impossible {
        assert!(sent.is_err(), "an impossible available index was served");
    }
    let _ = fill_rx(&mut q, &mem, &mut backend);
});
