//! Host buffers for one `readv`/`writev` between the tap and guest memory,
//! built only from ranges vm-memory checked, and the guest-side pieces of
//! a descriptor chain they come from.
//!
//! [`IoVecs`] borrows what its entries point into (guest memory through a
//! [`VolatileSlice`], or a byte buffer of ours) for its lifetime, so the
//! kernel can read or write only memory that stays mapped for the call.

use std::marker::PhantomData;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::volatile_memory::PtrGuardMut;
use vm_memory::{Address, GuestAddress, GuestMemory, Permissions, VolatileSlice};

use super::header::{HeaderError, MAX_FRAME_LEN, VNET_HDR_LEN};

/// Why a chain was dropped: its shape, its buffers or its header.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("{0} descriptor in a {1} chain")]
    Direction(&'static str, &'static str),
    #[error("TX frame longer than {MAX_FRAME_LEN} bytes")]
    TxTooLong,
    #[error("RX frame of {frame} bytes does not fit the chain's {room} bytes")]
    RxNoRoom { frame: usize, room: usize },
    #[error("descriptor at {addr:#x}+{len} is outside guest memory or spans two of its regions")]
    Memory { addr: u64, len: u32 },
    #[error("chain of more than {MAX_IOVECS} buffers")]
    TooManyBuffers,
    #[error("RX chain of {0} bytes cannot hold the {VNET_HDR_LEN}-byte header")]
    RxChainShort(usize),
    #[error(transparent)]
    Header(#[from] HeaderError),
}

/// The kernel's limit on vectors in one `readv`/`writev` (`IOV_MAX`).
pub const MAX_IOVECS: usize = 1024;

/// One guest buffer of a chain, as the descriptor gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestBuf {
    pub addr: GuestAddress,
    pub len: u32,
}

impl GuestBuf {
    pub fn len(&self) -> usize {
        narrow::usize_of(u64::from(self.len))
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn memory_error(&self) -> ChainError {
        ChainError::Memory {
            addr: self.addr.raw_value(),
            len: self.len,
        }
    }

    /// The bytes `offset..offset + count` of this buffer as one host
    /// slice: inside guest memory and inside one of its regions (a buffer
    /// across two regions is refused: no guest driver builds one from
    /// pages, and one slice is one vector). `count` is not 0.
    pub fn slice<'m, M: GuestMemory + ?Sized>(
        &self,
        mem: &'m M,
        offset: usize,
        count: usize,
        access: Permissions,
    ) -> Result<VolatileSlice<'m, vm_memory::bitmap::BS<'m, M::Bitmap>>, ChainError> {
        let in_buf = offset
            .checked_add(count)
            .is_some_and(|end| end <= self.len());
        let addr = u64::try_from(offset)
            .ok()
            .and_then(|o| self.addr.checked_add(o));
        let (true, Some(addr)) = (in_buf, addr) else {
            return Err(self.memory_error());
        };
        let mut slices = mem
            .get_slices(addr, count, access)
            .map_err(|_| self.memory_error())?;
        match (slices.next(), slices.next()) {
            (Some(Ok(s)), None) if s.len() == count => Ok(s),
            _ => Err(self.memory_error()),
        }
    }
}

/// Copies `data` into the buffers at byte `offset` of the frame they hold
/// (the header's `num_buffers`, which may straddle two descriptors).
pub fn write_at<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &[GuestBuf],
    offset: usize,
    data: &[u8],
) -> Result<(), ChainError> {
    let mut skip = offset;
    let mut done = 0;
    for b in bufs {
        if done == data.len() {
            break;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let n = (b.len() - skip).min(data.len() - done);
        let s = b.slice(mem, skip, n, Permissions::Write)?;
        s.copy_from(&data[done..done + n]);
        done += n;
        skip = 0;
    }
    if done < data.len() {
        return Err(ChainError::RxNoRoom {
            frame: offset.saturating_add(data.len()),
            room: offset.saturating_add(done),
        });
    }
    Ok(())
}

/// Copies `frame` into the buffers from their start; the buffers hold at
/// least `frame.len()` bytes (the caller counted).
pub fn copy_into<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &[GuestBuf],
    frame: &[u8],
) -> Result<(), ChainError> {
    write_at(mem, bufs, 0, frame)
}

/// The vectors of one system call and the guards that keep what they
/// point at mapped.
pub struct IoVecs<'a> {
    iov: Vec<libc::iovec>,
    guards: Vec<PtrGuardMut>,
    len: usize,
    _borrows: PhantomData<&'a mut [u8]>,
}

impl<'a> IoVecs<'a> {
    pub fn new() -> Self {
        IoVecs {
            iov: Vec::new(),
            guards: Vec::new(),
            len: 0,
            _borrows: PhantomData,
        }
    }

    /// Adds a checked guest range, borrowed for `'a`.
    pub fn push_guest<B: BitmapSlice>(&mut self, s: &VolatileSlice<'a, B>) {
        if s.is_empty() {
            return;
        }
        let guard = s.ptr_guard_mut();
        self.iov.push(libc::iovec {
            iov_base: guard.as_ptr().cast(),
            iov_len: s.len(),
        });
        self.guards.push(guard);
        self.len += s.len();
    }

    /// Adds a buffer of ours, borrowed for `'a`.
    pub fn push_bytes(&mut self, b: &'a mut [u8]) {
        let s = VolatileSlice::from(b);
        self.push_guest(&s);
    }

    /// Total bytes the vectors cover.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many vectors.
    pub fn count(&self) -> usize {
        self.iov.len()
    }

    /// The vectors, for `readv`/`writev` on `fd`: every entry points at
    /// memory borrowed for `'a` (so mapped now), with its length.
    pub fn as_iovecs(&self) -> &[libc::iovec] {
        &self.iov
    }
}

impl Default for IoVecs<'_> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GuestMemoryMmap;
    use vm_memory::Bytes;

    #[test]
    fn a_buffer_is_one_checked_slice_of_one_region() {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
        ])
        .unwrap();
        let b = GuestBuf {
            addr: GuestAddress(0xf00),
            len: 0x100,
        };
        assert_eq!(
            b.slice(&mem, 0, 0x100, Permissions::Read).unwrap().len(),
            0x100
        );
        // Past the buffer's own length, across two regions, outside memory.
        assert!(b.slice(&mem, 0xf0, 0x20, Permissions::Read).is_err());
        let across = GuestBuf {
            addr: GuestAddress(0xf00),
            len: 0x200,
        };
        assert!(across.slice(&mem, 0, 0x200, Permissions::Read).is_err());
        let outside = GuestBuf {
            addr: GuestAddress(0x1f80),
            len: 0x100,
        };
        assert!(outside.slice(&mem, 0, 0x100, Permissions::Read).is_err());
        let wraps = GuestBuf {
            addr: GuestAddress(u64::MAX - 4),
            len: 0x100,
        };
        assert!(wraps.slice(&mem, 8, 4, Permissions::Read).is_err());
    }

    #[test]
    fn bytes_land_at_a_frame_offset_across_buffers() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let bufs = [
            GuestBuf {
                addr: GuestAddress(0x100),
                len: 11,
            },
            GuestBuf {
                addr: GuestAddress(0x200),
                len: 0,
            },
            GuestBuf {
                addr: GuestAddress(0x300),
                len: 5,
            },
        ];
        // Offset 10..12 straddles the first and third buffers.
        write_at(&mem, &bufs, 10, &[0xaa, 0xbb]).unwrap();
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x100 + 10)).unwrap(), 0xaa);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x300)).unwrap(), 0xbb);
        assert!(matches!(
            write_at(&mem, &bufs, 15, &[1, 2]),
            Err(ChainError::RxNoRoom {
                frame: 17,
                room: 16
            })
        ));
    }

    #[test]
    fn vectors_cover_what_was_pushed() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut ours = [7u8; 12];
        let g = GuestBuf {
            addr: GuestAddress(0x100),
            len: 100,
        };
        let s = g.slice(&mem, 0, 100, Permissions::Read).unwrap();
        let mut v = IoVecs::new();
        v.push_bytes(&mut ours);
        v.push_guest(&s);
        assert_eq!((v.len(), v.count()), (112, 2));
        assert_eq!(v.as_iovecs()[1].iov_len, 100);
    }
}
