//! The virtqueue side of the device: TX chains from the guest parsed by
//! rust-vmm's `virtio-vsock` crate (header in a readable descriptor of at
//! least 44 bytes, payload contiguous and as long as `len` says, at most
//! [`MAX_PAYLOAD`]) and handed to the backend; RX chains filled with what
//! the backend owes the guest.

use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::backend::UnixBackend;
use super::packet::{Header, HEADER_LEN, MAX_PAYLOAD};
use crate::device::{Interrupt, VirtioInterrupt};
use crate::GuestMemoryMmap;

pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;

/// The device's queues once the driver started it.
pub struct ActiveQueues {
    pub rx: Queue,
    pub tx: Queue,
    /// The event queue: the driver fills it; this device sends no events
    /// (they announce a transport reset after migration).
    pub event: Queue,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// One packet's payload, reused.
    scratch: Vec<u8>,
}

impl ActiveQueues {
    pub fn new(rx: Queue, tx: Queue, event: Queue, interrupt: Arc<dyn VirtioInterrupt>) -> Self {
        ActiveQueues {
            rx,
            tx,
            event,
            interrupt,
            scratch: vec![0; MAX_PAYLOAD as usize],
        }
    }
}

fn header_of(p: &VsockPacket<'_, ()>) -> Header {
    Header {
        src_cid: p.src_cid(),
        dst_cid: p.dst_cid(),
        src_port: p.src_port(),
        dst_port: p.dst_port(),
        len: p.len(),
        type_: p.type_(),
        op: p.op(),
        flags: p.flags(),
        buf_alloc: p.buf_alloc(),
        fwd_cnt: p.fwd_cnt(),
    }
}

/// Reads the header at `addr` when the crate refused the chain, so the
/// connection it names can be reset.
fn raw_header<M: GuestMemory>(mem: &M, addr: GuestAddress, len: u32) -> Option<Header> {
    if (len as usize) < HEADER_LEN {
        return None;
    }
    let mut b = [0u8; HEADER_LEN];
    mem.read_slice(&mut b, addr).ok()?;
    Some(Header::from_bytes(&b))
}

/// Hands every TX packet to the backend; returns how many chains were used.
pub fn process_tx(
    q: &mut ActiveQueues,
    mem: &GuestMemoryMmap,
    backend: &mut UnixBackend,
) -> Result<usize, virtio_queue::Error> {
    let mut used = 0;
    while let Some(mut chain) = q.tx.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let first = chain
            .clone()
            .next()
            .map(|d| (d.addr(), d.len(), d.is_write_only()));
        match VsockPacket::from_tx_virtq_chain(mem, &mut chain, MAX_PAYLOAD) {
            Ok(packet) => {
                let h = header_of(&packet);
                // from_tx_virtq_chain checked len <= MAX_PAYLOAD and that the
                // data slice holds len bytes.
                let n = packet
                    .data_slice()
                    .map_or(0, |s| s.copy_to(&mut q.scratch[..]));
                if let Err(e) = backend.on_guest_packet(&h, &q.scratch[..n]) {
                    crate::warn_limited!("virtio-vsock: packet from the guest refused: {e}");
                }
            }
            Err(e) => {
                crate::warn_limited!("virtio-vsock: unreadable TX chain: {e}");
                if let Some(h) = first
                    .filter(|(_, _, write_only)| !write_only)
                    .and_then(|(addr, len, _)| raw_header(mem, addr, len))
                {
                    backend.on_malformed_packet(&h);
                }
            }
        }
        q.tx.add_used(mem, head, 0)?;
        used += 1;
    }
    Ok(used)
}

/// Fills RX buffers with what the backend owes the guest; returns how many
/// chains were used.
pub fn fill_rx(
    q: &mut ActiveQueues,
    mem: &GuestMemoryMmap,
    backend: &mut UnixBackend,
) -> Result<usize, virtio_queue::Error> {
    let mut used = 0;
    while backend.has_packet() {
        let Some(mut chain) = q.rx.pop_descriptor_chain(mem) else {
            break;
        };
        let head = chain.head_index();
        let packet = match VsockPacket::from_rx_virtq_chain(mem, &mut chain, MAX_PAYLOAD) {
            Ok(p) => p,
            Err(e) => {
                crate::warn_limited!("virtio-vsock: unusable RX chain: {e}");
                q.rx.add_used(mem, head, 0)?;
                used += 1;
                continue;
            }
        };
        let room = packet
            .data_slice()
            .map_or(0, |s| s.len())
            .min(MAX_PAYLOAD as usize);
        let Some((h, n)) = backend.next_packet(&mut q.scratch[..room]) else {
            // Nothing after all (a host socket had no bytes): the buffer
            // goes back for the next packet.
            q.rx.go_to_previous_position();
            break;
        };
        let written = (|| {
            packet.header_slice().write_slice(&h.to_bytes(), 0).ok()?;
            if n > 0 {
                packet.data_slice()?.write_slice(&q.scratch[..n], 0).ok()?;
            }
            // HEADER_LEN + n <= 44 + 64 KiB.
            Some((HEADER_LEN + n) as u32)
        })();
        q.rx.add_used(mem, head, written.unwrap_or(0))?;
        used += 1;
    }
    Ok(used)
}

/// Interrupts the guest for `queue` if buffers were used and it asks for it.
pub fn notify(
    queue: &mut Queue,
    index: u16,
    used: usize,
    mem: &GuestMemoryMmap,
    interrupt: &dyn VirtioInterrupt,
) -> std::io::Result<()> {
    if used > 0 && queue.needs_notification(mem).unwrap_or(true) {
        interrupt.trigger(Interrupt::Queue(index))?;
    }
    Ok(())
}
