//! virtio-net's TX and RX paths on arbitrary descriptor chains, with a
//! datagram pair standing in for the tap: every TX chain is used once
//! (sent or dropped), a sent frame is exactly what the header check let
//! through and never longer than the bound; RX fills what fits and drops
//! the rest; never a crash. The header check is also run on the raw input.
#![no_main]

use std::os::unix::net::UnixDatagram;

use dax_vmm_fuzz::{memory, queue_from};
use libfuzzer_sys::fuzz_target;
use virtio_devices::net::header::{check_tx, OFFLOAD_FEATURES};
use virtio_devices::net::queues::{NetCounters, RxPath, TxPath};
use virtio_devices::net::MAX_FRAME_LEN;

fuzz_target!(|data: &[u8]| {
    let acked = if data.first().is_some_and(|b| b & 1 == 1) {
        OFFLOAD_FEATURES
    } else {
        0
    };
    let _ = check_tx(data, acked);

    let (tap, peer) = UnixDatagram::pair().expect("socket pair");
    tap.set_nonblocking(true).expect("non-blocking");
    peer.set_nonblocking(true).expect("non-blocking");
    let mem = memory();
    let mut counters = NetCounters::default();

    let mut q = queue_from(&mem, data);
    let mut tx = TxPath::default();
    if let Ok((used, _)) = tx.process(&mut q, &mem, &tap, acked, &mut counters) {
        assert_eq!(used as u64, counters.tx_frames + counters.tx_dropped);
    }
    let mut buf = vec![0u8; MAX_FRAME_LEN + 1];
    while let Ok(n) = peer.recv(&mut buf) {
        assert!(n <= MAX_FRAME_LEN);
        assert!(check_tx(&buf[..n], acked).is_ok());
    }

    // The same chains as RX buffers, for two frames from the "tap".
    let mut q = queue_from(&mem, data);
    let len = data.len().clamp(12, 4096);
    let _ = peer.send(&data.iter().copied().cycle().take(len).collect::<Vec<_>>());
    let _ = peer.send(&[0u8; 5]);
    let mut rx = RxPath::default();
    let mut counters = NetCounters::default();
    if let Ok((_, used, _)) = rx.process(&mut q, &mem, &tap, &mut counters) {
        assert!(used as u64 <= counters.rx_frames + counters.rx_dropped);
    }
});
