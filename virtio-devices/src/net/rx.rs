//! The RX path: frames from the tap into the guest's receive chains.
//!
//! The path takes chains from the available ring and holds them (checked:
//! all device-writable, in guest memory, room for the header) until a
//! frame fills them; the device may keep buffers as long as it likes, so
//! nothing is ever given back unused. Once the held chains hold
//! [`MAX_FRAME_LEN`] bytes, the next frame is read with one `readv`
//! straight into them: with `VIRTIO_NET_F_MRG_RXBUF` over as many chains
//! as it needs (`num_buffers` in its header says how many), without it
//! into one chain large enough for any frame.
//!
//! When the guest gave less room than that, the tap cannot be read into
//! the guest (a frame larger than the room would be cut, and the tap gives
//! a frame once), so the frame is read into a buffer of
//! [`MAX_FRAME_LEN`] bytes and copied once it fits. At most one frame
//! waits there; while it waits the worker leaves the tap alone until the
//! guest adds buffers (the tap's own queue, bounded by the kernel, holds
//! the rest). A frame that can never fit (no chain is big enough without
//! MRG_RXBUF, or the chains held reached [`MAX_IOVECS`] buffers or the
//! queue's size) is dropped and counted, and the chains held for it go
//! back with length 0, so a guest that gives tiny buffers loses its
//! frames, not the device its progress.

use std::collections::VecDeque;
use std::io;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestMemory, Permissions};

use super::header::{
    set_num_buffers, HeaderError, MAX_FRAME_LEN, NUM_BUFFERS_OFFSET, VNET_HDR_LEN,
};
use super::iov::{copy_into, write_at, GuestBuf, IoVecs, MAX_IOVECS};
use super::queues::{ChainError, LastDrop, NetCounters, QueueError, RxProgress};
use super::tap::FrameIo;

/// A receive chain taken from the available ring and not used yet.
struct HeldChain {
    head: u16,
    bufs: Vec<GuestBuf>,
    /// The bytes `bufs` hold.
    room: usize,
}

pub struct RxPath {
    /// `VIRTIO_NET_F_MRG_RXBUF` negotiated: a frame may span chains.
    mergeable: bool,
    held: VecDeque<HeldChain>,
    held_room: usize,
    held_bufs: usize,
    bounce: Vec<u8>,
    /// Bytes of `bounce` read from the tap and not yet given to the guest.
    pending: Option<usize>,
    /// Frames that went through `bounce` (not straight into the guest).
    bounced: u64,
}

impl Default for RxPath {
    fn default() -> Self {
        RxPath::new(false)
    }
}

/// What one pass did to the used ring.
#[derive(Default)]
struct Pass {
    used: usize,
    last_drop: LastDrop,
}

/// What a read from the tap came to.
enum Read {
    /// A frame was delivered, dropped or put aside: go on.
    Again,
    /// Nothing to read now.
    Drained,
}

impl RxPath {
    pub fn new(mergeable: bool) -> Self {
        RxPath {
            mergeable,
            held: VecDeque::new(),
            held_room: 0,
            held_bufs: 0,
            bounce: vec![0; MAX_FRAME_LEN],
            pending: None,
            bounced: 0,
        }
    }

    /// True while a frame waits for guest buffers (the tests' view).
    #[cfg(test)]
    fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// How many frames were read into the path's own buffer and copied,
    /// rather than read straight into the guest's buffers (the tests' view).
    #[cfg(test)]
    fn bounced(&self) -> u64 {
        self.bounced
    }

    /// Chains taken from the ring and not used yet.
    pub(super) fn held_chains(&self) -> usize {
        self.held.len()
    }

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
        let mut pass = Pass::default();
        loop {
            let want = self.pending.unwrap_or(MAX_FRAME_LEN);
            let full = self.take_chains(queue, mem, want, counters, &mut pass)?;
            if let Some(len) = self.pending {
                if self.held_room >= len {
                    self.pending = None;
                    self.place_bounced(queue, mem, len, counters, &mut pass)?;
                } else if full {
                    self.pending = None;
                    counters.rx_dropped += 1;
                    pass.last_drop = Some(ChainError::RxNoRoom {
                        frame: len,
                        room: self.held_room,
                    });
                    let all = self.held.len();
                    self.release(queue, mem, all, &mut pass)?;
                } else {
                    return Ok((RxProgress::NoBuffers, pass.used, pass.last_drop));
                }
                continue;
            }
            if self.held.is_empty() {
                return Ok((RxProgress::NoBuffers, pass.used, pass.last_drop));
            }
            let read = if self.held_room >= MAX_FRAME_LEN {
                self.read_direct(queue, mem, io, counters, &mut pass)?
            } else {
                self.read_bounced(io, counters, &mut pass)
            };
            if let Read::Drained = read {
                return Ok((RxProgress::TapDrained, pass.used, pass.last_drop));
            }
        }
    }

    /// True when no further chain may be held: one without MRG_RXBUF
    /// (a frame goes into one chain), else a queue's worth or
    /// [`MAX_IOVECS`] buffers.
    fn at_limit(&self, queue: &Queue) -> bool {
        if self.mergeable {
            self.held.len() >= usize::from(queue.size()) || self.held_bufs >= MAX_IOVECS
        } else {
            !self.held.is_empty()
        }
    }

    /// Takes chains from the ring until they hold `want` bytes, the ring
    /// is empty, or the limit is reached; a malformed chain is used with
    /// length 0 at once. Returns whether the limit was reached.
    fn take_chains<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        want: usize,
        counters: &mut NetCounters,
        pass: &mut Pass,
    ) -> Result<bool, QueueError> {
        loop {
            if self.at_limit(queue) {
                return Ok(true);
            }
            if self.held_room >= want {
                return Ok(false);
            }
            let Some(chain) = queue.iter(mem)?.next() else {
                return Ok(false);
            };
            let head = chain.head_index();
            match check_chain(chain, mem) {
                Ok((bufs, room)) => {
                    self.held_room = self.held_room.saturating_add(room);
                    self.held_bufs += bufs.len();
                    self.held.push_back(HeldChain { head, bufs, room });
                }
                Err(e) => {
                    counters.rx_dropped += 1;
                    pass.last_drop = Some(e);
                    queue.add_used(mem, head, 0)?;
                    pass.used += 1;
                }
            }
        }
    }

    fn pop_held(&mut self) -> Option<HeldChain> {
        let c = self.held.pop_front()?;
        self.held_room -= c.room;
        self.held_bufs -= c.bufs.len();
        Some(c)
    }

    /// Gives the first `count` held chains back with length 0.
    fn release<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        count: usize,
        pass: &mut Pass,
    ) -> Result<(), QueueError> {
        for _ in 0..count {
            let Some(c) = self.pop_held() else { break };
            queue.add_used(mem, c.head, 0)?;
            pass.used += 1;
        }
        Ok(())
    }

    /// How many of the held chains, from the first, a frame of `len`
    /// bytes fills.
    fn chains_for(&self, len: usize) -> usize {
        let mut room = 0usize;
        for (i, c) in self.held.iter().enumerate() {
            room = room.saturating_add(c.room);
            if room >= len {
                return i + 1;
            }
        }
        self.held.len()
    }

    /// Uses the chains a frame of `len` bytes (already in them) filled,
    /// each with the bytes it got. `num_buffers` must be written first.
    fn complete<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        len: usize,
        count: usize,
        pass: &mut Pass,
    ) -> Result<(), QueueError> {
        let mut left = len;
        for _ in 0..count {
            let Some(c) = self.pop_held() else { break };
            let n = c.room.min(left);
            left -= n;
            queue.add_used(mem, c.head, narrow::sat_u32(n))?;
            pass.used += 1;
        }
        Ok(())
    }

    /// Reads one frame with `readv` straight into the held chains (they
    /// hold [`MAX_FRAME_LEN`] bytes: any frame fits).
    fn read_direct<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        io: &dyn FrameIo,
        counters: &mut NetCounters,
        pass: &mut Pass,
    ) -> Result<Read, QueueError> {
        let read = {
            let mut iov = IoVecs::new();
            if let Err((index, e)) = self.vectors(mem, &mut iov) {
                // Guest memory changed under a held chain (unplugged):
                // that chain goes back empty; the others stay.
                drop(iov);
                if let Some(c) = self.held.remove(index) {
                    self.held_room -= c.room;
                    self.held_bufs -= c.bufs.len();
                    counters.rx_dropped += 1;
                    pass.last_drop = Some(e);
                    queue.add_used(mem, c.head, 0)?;
                    pass.used += 1;
                }
                return Ok(Read::Again);
            }
            if iov.len() < MAX_FRAME_LEN {
                // More buffers than one readv takes: copy instead.
                drop(iov);
                return Ok(self.read_bounced(io, counters, pass));
            }
            io.read_frame(&mut iov)
        };
        let len = match read {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(Read::Again),
            // WouldBlock, or the tap failing (e.g. its link went down):
            // either way there is nothing to read now.
            Err(_) => return Ok(Read::Drained),
        };
        if len < VNET_HDR_LEN {
            // A frame without a header cannot be given to the guest; what
            // it wrote into the held chains is overwritten by the next.
            counters.rx_dropped += 1;
            pass.last_drop = Some(HeaderError::Short(len).into());
            return Ok(Read::Again);
        }
        let count = self.chains_for(len);
        let num_buffers = narrow::sat_u16(count).to_le_bytes();
        let first = self.held.front().map(|c| c.bufs.as_slice()).unwrap_or(&[]);
        if let Err(e) = write_at(mem, first, NUM_BUFFERS_OFFSET, &num_buffers) {
            counters.rx_dropped += 1;
            pass.last_drop = Some(e);
            self.release(queue, mem, count, pass)?;
            return Ok(Read::Again);
        }
        counters.rx_frames += 1;
        counters.rx_bytes += len as u64;
        self.complete(queue, mem, len, count, pass)?;
        Ok(Read::Again)
    }

    /// The held chains' buffers as vectors, [`MAX_FRAME_LEN`] bytes at
    /// most; on a buffer no longer in guest memory, its chain's index.
    fn vectors<'m, M: GuestMemory>(
        &self,
        mem: &'m M,
        iov: &mut IoVecs<'m>,
    ) -> Result<(), (usize, ChainError)> {
        for (i, c) in self.held.iter().enumerate() {
            for b in &c.bufs {
                let take = b.len().min(MAX_FRAME_LEN - iov.len());
                if take == 0 || iov.count() == MAX_IOVECS {
                    return Ok(());
                }
                let s = b
                    .slice(mem, 0, take, Permissions::Write)
                    .map_err(|e| (i, e))?;
                iov.push_guest(&s);
            }
        }
        Ok(())
    }

    /// Reads one frame into the path's own buffer, to be placed once the
    /// guest's buffers hold it.
    fn read_bounced(
        &mut self,
        io: &dyn FrameIo,
        counters: &mut NetCounters,
        pass: &mut Pass,
    ) -> Read {
        match io.recv_frame(&mut self.bounce) {
            Ok(n) if n < VNET_HDR_LEN => {
                counters.rx_dropped += 1;
                pass.last_drop = Some(HeaderError::Short(n).into());
                Read::Again
            }
            Ok(n) => {
                self.pending = Some(n);
                self.bounced += 1;
                Read::Again
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Read::Again,
            Err(_) => Read::Drained,
        }
    }

    /// Copies the waiting frame of `len` bytes into the held chains (they
    /// hold it) and uses them.
    fn place_bounced<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        len: usize,
        counters: &mut NetCounters,
        pass: &mut Pass,
    ) -> Result<(), QueueError> {
        let count = self.chains_for(len);
        let frame = &mut self.bounce[..len];
        let copied = set_num_buffers(frame, narrow::sat_u16(count))
            .map_err(ChainError::from)
            .and_then(|()| {
                let mut at = 0;
                for c in self.held.iter().take(count) {
                    let n = c.room.min(len - at);
                    copy_into(mem, &c.bufs, &frame[at..at + n])?;
                    at += n;
                }
                Ok(())
            });
        match copied {
            Ok(()) => {
                counters.rx_frames += 1;
                counters.rx_bytes += len as u64;
                self.complete(queue, mem, len, count, pass)
            }
            Err(e) => {
                counters.rx_dropped += 1;
                pass.last_drop = Some(e);
                self.release(queue, mem, count, pass)
            }
        }
    }
}

/// Checks a receive chain: every descriptor device-writable and in one
/// region of guest memory, at most [`MAX_IOVECS`] of them, room for the
/// header. Returns its buffers (empty ones left out) and their room.
fn check_chain<M: GuestMemory>(
    chain: DescriptorChain<&M>,
    mem: &M,
) -> Result<(Vec<GuestBuf>, usize), ChainError> {
    let mut bufs = Vec::new();
    let mut room = 0usize;
    for desc in chain {
        if !desc.is_write_only() {
            return Err(ChainError::Direction("device-readable", "RX"));
        }
        let b = GuestBuf {
            addr: desc.addr(),
            len: desc.len(),
        };
        if b.is_empty() {
            continue;
        }
        if bufs.len() == MAX_IOVECS {
            return Err(ChainError::TooManyBuffers);
        }
        b.slice(mem, 0, b.len(), Permissions::Write)?;
        room = room.saturating_add(b.len());
        bufs.push(b);
    }
    // virtio 1.2 §5.1.6.3.1: each buffer holds at least the header.
    if room < VNET_HDR_LEN {
        return Err(ChainError::RxChainShort(room));
    }
    Ok((bufs, room))
}

#[cfg(test)]
#[path = "rx_tests.rs"]
mod tests;
