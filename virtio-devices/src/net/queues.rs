//! The RX and TX paths between the guest's queues and the host side
//! ([`FrameIo`]), without threads: the worker calls them on events, tests
//! and the fuzz target call them directly.
//!
//! RX holds at most one frame read from the tap and not yet placed: when
//! the guest has no receive buffer left, the path says so
//! ([`RxProgress::NoBuffers`]) and the worker stops watching the tap until
//! the guest kicks the RX queue; the tap's own queue (bounded by the
//! kernel) holds the rest. TX gathers a chain into one bounded buffer and
//! writes it to the tap. A malformed chain (a descriptor the wrong way, a
//! frame too long or too short, an address outside guest memory, a header
//! the guest did not negotiate) loses that packet, is used with length 0
//! and is counted; the device goes on.

use std::io;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestMemory};

use super::header::{check_tx, set_num_buffers, HeaderError, MAX_FRAME_LEN, VNET_HDR_LEN};
use super::tap::FrameIo;

#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("{0} descriptor in a {1} chain")]
    Direction(&'static str, &'static str),
    #[error("TX frame longer than {MAX_FRAME_LEN} bytes")]
    TxTooLong,
    #[error("RX frame of {frame} bytes does not fit the chain's {room} bytes")]
    RxNoRoom { frame: usize, room: usize },
    #[error("descriptor at {addr:#x}+{len} is outside guest memory")]
    Memory { addr: u64, len: u32 },
    #[error(transparent)]
    Header(#[from] HeaderError),
}

/// Counters the worker keeps and logs from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Chains used with length 0: malformed, or a frame that did not fit.
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
    /// A frame is waiting and the guest has no buffer for it.
    NoBuffers,
}

/// A failure of the queue itself (its rings outside guest memory): the
/// device stops.
pub type QueueError = virtio_queue::Error;

/// What went wrong with the last dropped packet, for the worker's log.
pub type LastDrop = Option<ChainError>;

pub struct RxPath {
    frame: Vec<u8>,
    /// Bytes of `frame` read from the tap and not yet given to the guest.
    pending: Option<usize>,
}

impl Default for RxPath {
    fn default() -> Self {
        RxPath {
            frame: vec![0; MAX_FRAME_LEN],
            pending: None,
        }
    }
}

impl RxPath {
    /// Moves frames from `io` into the queue's buffers until the tap is
    /// drained or the buffers run out. Returns why it stopped, how many
    /// chains were used, and the last drop's reason.
    pub fn process<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        io: &dyn FrameIo,
        counters: &mut NetCounters,
    ) -> Result<(RxProgress, usize, LastDrop), QueueError> {
        let mut used = 0;
        let mut last_drop = None;
        loop {
            let len = match self.pending {
                Some(len) => len,
                None => match io.recv_frame(&mut self.frame) {
                    // A frame without a header cannot be given to the guest.
                    Ok(n) if n < VNET_HDR_LEN => {
                        counters.rx_dropped += 1;
                        last_drop = Some(HeaderError::Short(n).into());
                        continue;
                    }
                    Ok(n) => {
                        self.pending = Some(n);
                        n
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    // WouldBlock, or the tap failing (e.g. its link went
                    // down): either way there is nothing to read now.
                    Err(_) => return Ok((RxProgress::TapDrained, used, last_drop)),
                },
            };
            let Some(chain) = queue.iter(mem)?.next() else {
                return Ok((RxProgress::NoBuffers, used, last_drop));
            };
            let head = chain.head_index();
            self.pending = None;
            let frame = &mut self.frame[..len];
            let written = match set_num_buffers(frame, 1)
                .map_err(ChainError::from)
                .and_then(|()| write_frame(chain, mem, frame))
            {
                Ok(()) => {
                    counters.rx_frames += 1;
                    counters.rx_bytes += len as u64;
                    narrow::sat_u32(len)
                }
                Err(e) => {
                    counters.rx_dropped += 1;
                    last_drop = Some(e);
                    0
                }
            };
            queue.add_used(mem, head, written)?;
            used += 1;
        }
    }

    /// True while a frame waits for a guest buffer.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }
}

/// Copies `frame` into the chain's buffers, all device-writable.
fn write_frame<M: GuestMemory>(
    chain: DescriptorChain<&M>,
    mem: &M,
    frame: &[u8],
) -> Result<(), ChainError> {
    let mut done = 0usize;
    let mut room = 0usize;
    for desc in chain {
        if !desc.is_write_only() {
            return Err(ChainError::Direction("device-readable", "RX"));
        }
        room = room.saturating_add(desc.len() as usize);
        if done == frame.len() {
            continue;
        }
        let n = (desc.len() as usize).min(frame.len() - done);
        mem.write_slice(&frame[done..done + n], desc.addr())
            .map_err(|_| ChainError::Memory {
                addr: desc.addr().raw_value(),
                len: desc.len(),
            })?;
        done += n;
    }
    if done < frame.len() {
        return Err(ChainError::RxNoRoom {
            frame: frame.len(),
            room,
        });
    }
    Ok(())
}

pub struct TxPath {
    frame: Vec<u8>,
}

impl Default for TxPath {
    fn default() -> Self {
        TxPath {
            frame: vec![0; MAX_FRAME_LEN],
        }
    }
}

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
            let sent = gather(chain, mem, &mut self.frame)
                .and_then(|len| Ok((len, check_tx(&self.frame[..len], acked)?)))
                .map(|(len, _)| {
                    // The tap takes the header with the frame. A write the
                    // tap refuses (its queue full, its link down) loses the
                    // frame, as a cable would.
                    io.send_frame(&self.frame[..len]).map(|_| len)
                });
            match sent {
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

/// Copies the chain's buffers, all device-readable, into `buf`; returns
/// the frame's length.
fn gather<M: GuestMemory>(
    chain: DescriptorChain<&M>,
    mem: &M,
    buf: &mut [u8],
) -> Result<usize, ChainError> {
    let mut len = 0usize;
    for desc in chain {
        if desc.is_write_only() {
            return Err(ChainError::Direction("device-writable", "TX"));
        }
        let end = len
            .checked_add(desc.len() as usize)
            .filter(|end| *end <= buf.len())
            .ok_or(ChainError::TxTooLong)?;
        mem.read_slice(&mut buf[len..end], desc.addr())
            .map_err(|_| ChainError::Memory {
                addr: desc.addr().raw_value(),
                len: desc.len(),
            })?;
        len = end;
    }
    Ok(len)
}

#[cfg(test)]
#[path = "queues_tests.rs"]
mod tests;
