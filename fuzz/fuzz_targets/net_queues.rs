//! virtio-net's TX and RX paths on arbitrary descriptor chains, with a
//! datagram pair standing in for the tap: every TX chain is used once
//! (sent or dropped), a sent frame is exactly what the header check let
//! through and never longer than the bound; RX, with or without
//! MRG_RXBUF, reads frames straight into the guest's chains or copies
//! them, fills what fits, drops the rest, and the used lengths add up to
//! the bytes it counted; never a crash. The header check is also run on
//! the raw input. Every header let through (raw, or reaching the "tap")
//! passes what Linux's `virtio_net_hdr_to_skb` and tun check: the checksum
//! field, and for TCP GSO a whole TCP header, inside the frame, at the TCP
//! checksum's offset, past the smallest network header; a real segment
//! size; `hdr_len` inside the frame.
#![no_main]

use std::os::unix::net::UnixDatagram;

use dax_vmm_fuzz::{memory, queue_from, Memory, DATA, DESC_TABLE, MEM_SIZE, QUEUE_SIZE, USED_RING};
use libfuzzer_sys::fuzz_target;
use virtio_devices::net::header::{check_tx, VnetHeader, OFFLOAD_FEATURES, VNET_HDR_LEN};
use virtio_devices::net::queues::{NetCounters, TxPath};
use virtio_devices::net::rx::RxPath;
use virtio_devices::net::MAX_FRAME_LEN;
use vm_memory::{Bytes, GuestAddress};

/// Gives every descriptor a length under 68 KiB and an address that keeps
/// it inside guest memory past the rings, so chains are often whole and
/// large enough to be read into directly.
fn fold_lengths(mem: &Memory) {
    for i in 0..u64::from(QUEUE_SIZE) {
        let at = GuestAddress(DESC_TABLE + 16 * i);
        let addr: u64 = mem.read_obj(at).expect("descriptor in memory");
        let len: u32 = mem
            .read_obj(GuestAddress(at.0 + 8))
            .expect("descriptor in memory");
        let len = len % 0x1_1000;
        let room = MEM_SIZE - DATA - u64::from(len);
        mem.write_obj(DATA + addr % room, at)
            .expect("descriptor in memory");
        mem.write_obj(len, GuestAddress(at.0 + 8))
            .expect("descriptor in memory");
    }
}

/// Whether a device-writable descriptor's buffer overlaps the used ring.
fn rx_buffer_covers_used_ring(mem: &Memory) -> bool {
    let used_end = USED_RING + 6 + 8 * u64::from(QUEUE_SIZE);
    (0..u64::from(QUEUE_SIZE)).any(|i| {
        let at = DESC_TABLE + 16 * i;
        let addr: u64 = mem
            .read_obj(GuestAddress(at))
            .expect("descriptor in memory");
        let len: u32 = mem
            .read_obj(GuestAddress(at + 8))
            .expect("descriptor in memory");
        let flags: u16 = mem
            .read_obj(GuestAddress(at + 12))
            .expect("descriptor in memory");
        flags & 2 == 2 && addr < used_end && addr.saturating_add(u64::from(len)) > USED_RING
    })
}

/// What the tap's kernel requires of a header before a packet of
/// `packet_len` bytes (see the module).
fn assert_linux_takes(h: VnetHeader, packet_len: usize) {
    let start = usize::from(h.csum_start);
    if h.flags & 1 == 1 {
        assert!(
            start + usize::from(h.csum_offset) + 2 <= packet_len,
            "{h:?}"
        );
        assert!(h.csum_start >= 20, "{h:?}");
    }
    let gso = h.gso_type & 0x7f;
    if gso == 1 || gso == 4 {
        assert_eq!(h.csum_offset, 16, "{h:?}");
        assert!(start + 20 <= packet_len, "{h:?}");
        assert!(h.gso_size != 0 && h.gso_size != 0xffff, "{h:?}");
        assert!(gso == 1 || h.csum_start >= 40, "{h:?}");
    }
    assert!(usize::from(h.hdr_len) <= packet_len, "{h:?}");
}

fuzz_target!(|data: &[u8]| {
    let flags = data.first().copied().unwrap_or(0);
    let acked = if flags & 1 == 1 { OFFLOAD_FEATURES } else { 0 };
    let mergeable = flags & 2 == 2;
    if let Ok(h) = check_tx(data, acked) {
        assert_linux_takes(h, data.len() - VNET_HDR_LEN);
    }

    let (tap, peer) = UnixDatagram::pair().expect("socket pair");
    tap.set_nonblocking(true).expect("non-blocking");
    peer.set_nonblocking(true).expect("non-blocking");
    let mem = memory();
    let mut counters = NetCounters::default();

    let mut q = queue_from(&mem, data);
    if flags & 4 == 4 {
        fold_lengths(&mem);
    }
    if let Ok((used, _)) = TxPath.process(&mut q, &mem, &tap, acked, &mut counters) {
        assert_eq!(used as u64, counters.tx_frames + counters.tx_dropped);
    }
    let mut buf = vec![0u8; MAX_FRAME_LEN + 1];
    while let Ok(n) = peer.recv(&mut buf) {
        assert!(n <= MAX_FRAME_LEN);
        let h = check_tx(&buf[..n], acked).expect("a sent frame passes the check");
        assert_linux_takes(h, n - VNET_HDR_LEN);
    }

    // The same chains as RX buffers, for three frames from the "tap": one
    // of the input's length, a runt, one up to the largest there is.
    let mut q = queue_from(&mem, data);
    if flags & 4 == 4 {
        fold_lengths(&mem);
    }
    let frame = |len: usize| data.iter().copied().cycle().take(len).collect::<Vec<_>>();
    let _ = peer.send(&frame(data.len().clamp(12, 4096)));
    let _ = peer.send(&[0u8; 5]);
    let big = (usize::from(data.get(1).copied().unwrap_or(0)) * 300).clamp(12, MAX_FRAME_LEN);
    let _ = peer.send(&frame(big));
    let mut rx = RxPath::new(mergeable);
    let mut counters = NetCounters::default();
    let mut used = 0;
    // Twice: the second pass finds no new buffer, a frame may be waiting.
    for _ in 0..2 {
        let Ok((_, n, _)) = rx.process(&mut q, &mem, &tap, &mut counters) else {
            return;
        };
        used += n;
    }
    // A guest may give an RX buffer over the used ring itself: the frames
    // then overwrite the used lengths and there is nothing to add up.
    if rx_buffer_covers_used_ring(&mem) {
        return;
    }
    // queue_from publishes at most 7 chains: the used ring does not wrap.
    let mut used_bytes = 0u64;
    for i in 0..used as u64 {
        let len: u32 = mem
            .read_obj(GuestAddress(USED_RING + 4 + 8 * i + 4))
            .expect("used ring in memory");
        used_bytes += u64::from(len);
    }
    assert_eq!(used_bytes, counters.rx_bytes);
    assert!(counters.rx_frames <= used as u64);
    if !mergeable {
        assert!(used as u64 <= counters.rx_frames + counters.rx_dropped);
    }
});
