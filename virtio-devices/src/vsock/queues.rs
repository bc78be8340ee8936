//! The virtqueue side of the device: TX chains from the guest read as
//! header and payload and handed to the backend; RX chains (laid out as
//! rust-vmm's `virtio-vsock` crate checks them: a writable header of 44
//! bytes, then a writable data buffer, in one descriptor or two) filled
//! with what the backend owes the guest.

use std::sync::Arc;

use std::io::Read;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader};
use virtio_vsock::packet::VsockPacket;
use vm_memory::Bytes;

use super::backend::UnixBackend;
use super::packet::{Header, HEADER_LEN, MAX_PAYLOAD};
use crate::device::{Interrupt, VirtioInterrupt};
use crate::GuestMemoryMmap;

pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const EVENT_QUEUE: u16 = 2;
/// `struct virtio_vsock_event { le32 id; }` with the only id virtio
/// defines (1.2 §5.10.6.6.1): the device's transport was reset, so the
/// guest's connections are gone.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;
const EVENT_LEN: u32 = 4;

/// The device's queues once the driver started it.
pub struct ActiveQueues {
    pub rx: Queue,
    pub tx: Queue,
    /// The event queue: the driver fills it; the device posts a transport
    /// reset there once after a restore ([`post_transport_reset`]).
    pub event: Queue,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// A transport reset waits for a buffer in the event queue.
    pub transport_reset: bool,
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
            transport_reset: false,
            scratch: vec![0; MAX_PAYLOAD as usize],
        }
    }
}

/// Hands every TX packet to the backend; returns how many chains were used.
///
/// A packet is read as the bytes of the chain's readable descriptors, in
/// order: 44 header bytes, then `len` payload bytes, however the driver
/// split them (Linux 6.12 puts a large send's payload in several page
/// descriptors). A chain shorter than a header names no one and is
/// dropped; one shorter than its `len` is refused by [`UnixBackend`],
/// which resets the connection it names.
pub fn process_tx(
    q: &mut ActiveQueues,
    mem: &GuestMemoryMmap,
    backend: &mut UnixBackend,
) -> Result<usize, virtio_queue::Error> {
    let mut used = 0;
    // `iter` refuses an available index more than the queue's size ahead:
    // an error, the queues stop (`pop_descriptor_chain` would only log,
    // once per kick).
    while let Some(chain) = q.tx.iter(mem)?.next() {
        let head = chain.head_index();
        match read_tx_packet(mem, chain, &mut q.scratch) {
            Ok((h, n)) => {
                if let Err(e) = backend.on_guest_packet(&h, &q.scratch[..n]) {
                    crate::warn_limited!("virtio-vsock: packet from the guest refused: {e}");
                }
            }
            Err(e) => crate::warn_limited!("virtio-vsock: unreadable TX chain: {e}"),
        }
        q.tx.add_used(mem, head, 0)?;
        used += 1;
    }
    Ok(used)
}

/// The header and payload of a TX chain; the payload (at most `len` and
/// at most `scratch`'s length, [`MAX_PAYLOAD`]) goes to `scratch`.
fn read_tx_packet(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    scratch: &mut [u8],
) -> Result<(Header, usize), String> {
    let mut reader = Reader::new(mem, chain).map_err(|e| format!("{e:?}"))?;
    let mut raw = [0u8; HEADER_LEN];
    reader
        .read_exact(&mut raw)
        .map_err(|_| format!("shorter than a {HEADER_LEN}-byte header"))?;
    let h = Header::from_bytes(&raw);
    // len <= u32::MAX fits a usize; the copy is bounded by the scratch.
    let want = (h.len as usize)
        .min(scratch.len())
        .min(reader.available_bytes());
    reader
        .read_exact(&mut scratch[..want])
        .map_err(|e| format!("reading the payload: {e}"))?;
    Ok((h, want))
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
        let Some(mut chain) = q.rx.iter(mem)?.next() else {
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
            Some(narrow::sat_u32(HEADER_LEN + n))
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

/// Posts the pending transport reset in the event queue's next buffer
/// able to hold it and interrupts the guest; the reset stays pending
/// while the driver has no buffer there (its next kick of any queue tries
/// again). A buffer too small is used with length 0; at most the queue's
/// size of buffers are looked at per call.
pub fn post_transport_reset(q: &mut ActiveQueues, mem: &GuestMemoryMmap) -> Result<(), String> {
    if !q.transport_reset {
        return Ok(());
    }
    let mut used = 0;
    for _ in 0..q.event.size() {
        let Some(chain) = q
            .event
            .iter(mem)
            .map_err(|e| format!("event queue: {e:?}"))?
            .next()
        else {
            break;
        };
        let head = chain.head_index();
        let written = chain
            .writable()
            .find(|d| d.len() >= EVENT_LEN)
            .is_some_and(|d| {
                mem.write_obj(VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le(), d.addr())
                    .is_ok()
            });
        let len = if written { EVENT_LEN } else { 0 };
        q.event
            .add_used(mem, head, len)
            .map_err(|e| format!("event queue: {e:?}"))?;
        used += 1;
        if written {
            q.transport_reset = false;
            break;
        }
    }
    notify(&mut q.event, EVENT_QUEUE, used, mem, &*q.interrupt).map_err(|e| e.to_string())
}
