//! The RX and TX paths between the guest's queues and the host side
//! ([`FrameIo`]), without threads: the worker calls them on events, tests
//! and the fuzz target call them directly.
//!
//! TX writes each chain's frame to the tap with one `writev` over the
//! guest's buffers; only the 12-byte header is copied out first (it is
//! checked, and the copy is what goes to the tap, so the guest cannot
//! change it after the check). RX ([`super::rx`]) reads frames from the
//! tap straight into the guest's buffers. A malformed chain (a descriptor
//! the wrong way, a frame too long or too short, an address outside guest
//! memory or across two of its regions, a header the guest did not
//! negotiate) loses that packet, is used with length 0 and is counted;
//! the device goes on.

use std::io;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestMemory, Permissions};

use super::header::{check_tx_header, HeaderError, VnetHeader, MAX_FRAME_LEN, VNET_HDR_LEN};
pub use super::iov::ChainError;
use super::iov::{GuestBuf, IoVecs, MAX_IOVECS};
use super::tap::FrameIo;

/// Counters the worker keeps and logs from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// RX: frames lost (shorter than the header, or larger than every
    /// buffer the guest could give) and malformed chains, each used with
    /// length 0. TX: chains not sent (malformed, or refused by the tap).
    pub rx_dropped: u64,
    pub tx_dropped: u64,
}

impl NetCounters {
    /// The names `vm.counters` shows: Cloud Hypervisor's four, then the drops.
    pub const NAMES: [&'static str; 6] = [
        "rx_bytes",
        "rx_frames",
        "tx_bytes",
        "tx_frames",
        "rx_dropped",
        "tx_dropped",
    ];

    /// The values in [`Self::NAMES`]'s order.
    pub fn values(&self) -> [u64; 6] {
        [
            self.rx_bytes,
            self.rx_frames,
            self.tx_bytes,
            self.tx_frames,
            self.rx_dropped,
            self.tx_dropped,
        ]
    }
}

/// Why an RX pass ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RxProgress {
    /// The tap has nothing more to read.
    TapDrained,
    /// The guest's buffers ran out: none is left, or a frame waits for
    /// more than those left hold.
    NoBuffers,
}

/// A failure of the queue itself (its rings outside guest memory): the
/// device stops.
pub type QueueError = virtio_queue::Error;

/// What went wrong with the last dropped packet, for the worker's log.
pub type LastDrop = Option<ChainError>;

/// The TX path; it keeps nothing between calls.
#[derive(Default)]
pub struct TxPath;

impl TxPath {
    /// Sends every available chain's frame to `io`; returns how many
    /// chains were used and the last drop's reason.
    pub fn process<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        io: &dyn FrameIo,
        acked: u64,
        counters: &mut NetCounters,
    ) -> Result<(usize, LastDrop), QueueError> {
        let mut used = 0;
        let mut last_drop = None;
        while let Some(chain) = queue.iter(mem)?.next() {
            let head = chain.head_index();
            // A write the tap refuses (its queue full, its link down)
            // loses the frame, as a cable would.
            match send_chain(chain, mem, io, acked) {
                Ok(Ok(len)) => {
                    counters.tx_frames += 1;
                    counters.tx_bytes += len as u64;
                }
                Ok(Err(_)) => counters.tx_dropped += 1,
                Err(e) => {
                    counters.tx_dropped += 1;
                    last_drop = Some(e);
                }
            }
            // The device writes nothing into a TX chain.
            queue.add_used(mem, head, 0)?;
            used += 1;
        }
        Ok((used, last_drop))
    }
}

/// Checks one chain (all device-readable, at most [`MAX_FRAME_LEN`] bytes
/// and [`MAX_IOVECS`] buffers, each in guest memory) and its header, then
/// writes the frame to `io`: the checked copy of the header, then the
/// guest's buffers past it. Returns the frame's length.
fn send_chain<M: GuestMemory>(
    chain: DescriptorChain<&M>,
    mem: &M,
    io: &dyn FrameIo,
    acked: u64,
) -> Result<io::Result<usize>, ChainError> {
    let mut bufs = Vec::new();
    let mut len = 0usize;
    for desc in chain {
        if desc.is_write_only() {
            return Err(ChainError::Direction("device-writable", "TX"));
        }
        let b = GuestBuf {
            addr: desc.addr(),
            len: desc.len(),
        };
        len = len
            .checked_add(b.len())
            .filter(|end| *end <= MAX_FRAME_LEN)
            .ok_or(ChainError::TxTooLong)?;
        if b.is_empty() {
            continue;
        }
        // One vector more for the header's copy.
        if bufs.len() + 1 >= MAX_IOVECS {
            return Err(ChainError::TooManyBuffers);
        }
        bufs.push(b);
    }
    let mut header = [0u8; VNET_HDR_LEN];
    let mut header_len = 0;
    let mut rest = Vec::with_capacity(bufs.len());
    for b in &bufs {
        let s = b.slice(mem, 0, b.len(), Permissions::Read)?;
        let take = (VNET_HDR_LEN - header_len).min(b.len());
        if take > 0 {
            let part = s.subslice(0, take).map_err(|_| b.memory_error())?;
            part.copy_to(&mut header[header_len..header_len + take]);
            header_len += take;
        }
        if take < b.len() {
            rest.push(s.offset(take).map_err(|_| b.memory_error())?);
        }
    }
    if header_len < VNET_HDR_LEN {
        return Err(HeaderError::Short(len).into());
    }
    check_tx_header(VnetHeader::parse(&header)?, len - VNET_HDR_LEN, acked)?;
    let mut iov = IoVecs::new();
    iov.push_bytes(&mut header);
    for s in &rest {
        iov.push_guest(s);
    }
    Ok(io.write_frame(&iov).map(|_| len))
}

#[cfg(test)]
#[path = "queues_tests.rs"]
mod tests;
