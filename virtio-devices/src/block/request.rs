//! The virtio-blk request a guest hands over in one descriptor chain
//! (virtio 1.2 §5.2.6), checked before anything touches the disk.
//!
//! A chain is device-readable bytes followed by device-writable bytes. The
//! first 16 readable bytes are the header (`type`, `reserved`, `sector`),
//! the last writable byte is the status; what lies between is the data,
//! split across descriptors however the driver likes (any layout). Every
//! length, offset and count below comes from the guest, so all arithmetic
//! is checked, every range is tested against the disk's size, and what is
//! kept per request is bounded by the chain's length, which the queue
//! bounds by its size.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;
/// Bytes of the request header: type, reserved, sector.
pub const HEADER_LEN: u64 = 16;
/// Bytes of one discard / write-zeroes range: sector, num_sectors, flags.
pub const RANGE_LEN: u64 = 16;
/// The serial number GET_ID answers with is at most this long.
pub const ID_BYTES: usize = 20;
/// The only flag a write-zeroes range may carry: the device may unmap.
pub const RANGE_FLAG_UNMAP: u32 = 1;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("chain has a device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    #[error("chain has more than {max} descriptors")]
    TooManySegments { max: usize },
    #[error("chain has {got} readable bytes, fewer than the 16-byte header")]
    ShortHeader { got: u64 },
    #[error("chain has no writable byte for the status")]
    NoStatus,
    #[error("descriptor at {addr:#x} (+{len}) is outside guest memory")]
    BadAddress { addr: u64, len: u64 },
    #[error("data length {len} is not a multiple of 512")]
    UnalignedLength { len: u64 },
    #[error("sectors {sector}+{sectors} reach past the end of the disk ({capacity} sectors)")]
    PastEnd {
        sector: u64,
        sectors: u64,
        capacity: u64,
    },
    #[error("the disk is read-only")]
    ReadOnly,
    #[error("request type {0} is not supported")]
    Unsupported(u32),
    #[error("{what} data of {len} bytes is not a whole number of 16-byte ranges")]
    BadRangeList { what: &'static str, len: u64 },
    #[error("{what} of {got} ranges, more than the {max} advertised")]
    TooManyRanges {
        what: &'static str,
        got: u64,
        max: u32,
    },
    #[error("{what} range of {got} sectors, more than the {max} advertised")]
    RangeTooLong {
        what: &'static str,
        got: u32,
        max: u32,
    },
    #[error("{what} range has flags {flags:#x}")]
    BadRangeFlags { what: &'static str, flags: u32 },
}

impl RequestError {
    /// The status byte the guest gets for this error.
    pub fn status(&self) -> u8 {
        match self {
            RequestError::Unsupported(_) | RequestError::BadRangeFlags { .. } => {
                const { narrow::u8_of(VIRTIO_BLK_S_UNSUPP as u64) }
            }
            _ => const { narrow::u8_of(VIRTIO_BLK_S_IOERR as u64) },
        }
    }
}

/// A stretch of guest memory a descriptor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u64,
}

/// A discard or write-zeroes range, in bytes, already checked against the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub offset: u64,
    pub len: u64,
    pub unmap: bool,
}

/// What the disk must do for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Fill `data` from the disk at `offset`.
    Read {
        offset: u64,
        data: Vec<Segment>,
    },
    /// Write `data` to the disk at `offset`.
    Write {
        offset: u64,
        data: Vec<Segment>,
    },
    Flush,
    /// Write the serial number into `data`.
    GetId {
        data: Vec<Segment>,
    },
    Discard(Vec<ByteRange>),
    WriteZeroes(Vec<ByteRange>),
}

/// What the device knows when it checks a request.
#[derive(Clone, Copy, Debug)]
pub struct DiskLimits {
    /// Size of the disk in 512-byte sectors.
    pub capacity: u64,
    pub readonly: bool,
    /// DISCARD and WRITE_ZEROES are offered (the host file can do them).
    pub discard: bool,
    pub write_zeroes: bool,
    /// Descriptors one chain may have (the queue's size).
    pub max_segments: usize,
    pub max_ranges: u32,
    pub max_range_sectors: u32,
}

/// A parsed chain: where its status byte goes (None: nowhere to answer)
/// and what to do, or why not.
#[derive(Debug)]
pub struct Request {
    pub status: Option<GuestAddress>,
    pub action: Result<Action, RequestError>,
}

/// Copies `buf.len()` bytes from the start of `segs` (which may be split).
fn read_from_segments<M: GuestMemoryBackend>(
    mem: &M,
    segs: &[Segment],
    buf: &mut [u8],
) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == buf.len() {
            break;
        }
        let n = (buf.len() - done).min(usize::try_from(s.len).unwrap_or(usize::MAX));
        mem.read_slice(&mut buf[done..done + n], s.addr)
            .map_err(|_| RequestError::BadAddress {
                addr: s.addr.0,
                len: s.len,
            })?;
        done += n;
    }
    Ok(())
}

/// `segs` without their first `skip` bytes.
fn skip_front(segs: &[Segment], mut skip: u64) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        // `skip < s.len` and the segment was checked not to wrap.
        out.push(Segment {
            addr: s.addr.unchecked_add(skip),
            len: s.len - skip,
        });
        skip = 0;
    }
    out
}

fn total_len(segs: &[Segment]) -> u64 {
    // Each length is a u32 and there are at most `max_segments` (≤ 65536):
    // the sum fits a u64; saturate anyway rather than trust that.
    segs.iter().fold(0u64, |a, s| a.saturating_add(s.len))
}

/// Parses a chain given as `(address, length, device-writable)` descriptors.
pub fn parse<M: GuestMemoryBackend>(
    mem: &M,
    descriptors: impl IntoIterator<Item = (GuestAddress, u32, bool)>,
    limits: &DiskLimits,
) -> Request {
    let mut readable = Vec::new();
    let mut writable: Vec<Segment> = Vec::new();
    let mut order_error = None;
    for (i, (addr, len, write)) in descriptors.into_iter().enumerate() {
        if i >= limits.max_segments {
            order_error.get_or_insert(RequestError::TooManySegments {
                max: limits.max_segments,
            });
            break;
        }
        if len == 0 {
            continue;
        }
        let seg = Segment {
            addr,
            len: u64::from(len),
        };
        // A descriptor that wraps the address space or leaves guest memory
        // is refused here, so later slicing never has to.
        if addr.checked_add(seg.len - 1).is_none() || !mem.check_range(addr, len as usize) {
            order_error.get_or_insert(RequestError::BadAddress {
                addr: addr.0,
                len: seg.len,
            });
            // Still find the status byte, if this one is not it.
            if !write {
                continue;
            }
        }
        if write {
            writable.push(seg);
        } else if writable.is_empty() {
            readable.push(seg);
        } else {
            order_error.get_or_insert(RequestError::ReadableAfterWritable);
        }
    }
    // The status byte: the last byte of the last writable descriptor.
    let status = writable.last_mut().and_then(|last| {
        let at = last.addr.checked_add(last.len - 1)?;
        last.len -= 1;
        mem.check_range(at, 1).then_some(at)
    });
    if writable.last().is_some_and(|s| s.len == 0) {
        writable.pop();
    }
    let action = match (order_error, status) {
        (Some(e), _) => Err(e),
        (None, None) => Err(RequestError::NoStatus),
        (None, Some(_)) => action(mem, &readable, writable, limits),
    };
    Request { status, action }
}

fn action<M: GuestMemoryBackend>(
    mem: &M,
    readable: &[Segment],
    writable: Vec<Segment>,
    limits: &DiskLimits,
) -> Result<Action, RequestError> {
    let got = total_len(readable);
    if got < HEADER_LEN {
        return Err(RequestError::ShortHeader { got });
    }
    let mut header = [0u8; narrow::usize_of(HEADER_LEN)];
    read_from_segments(mem, readable, &mut header)?;
    let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let out_data = skip_front(readable, HEADER_LEN);
    match kind {
        VIRTIO_BLK_T_IN => Ok(Action::Read {
            offset: check_extent(sector, total_len(&writable), limits)?,
            data: writable,
        }),
        VIRTIO_BLK_T_OUT => {
            if limits.readonly {
                return Err(RequestError::ReadOnly);
            }
            Ok(Action::Write {
                offset: check_extent(sector, total_len(&out_data), limits)?,
                data: out_data,
            })
        }
        VIRTIO_BLK_T_FLUSH => Ok(Action::Flush),
        VIRTIO_BLK_T_GET_ID => Ok(Action::GetId { data: writable }),
        VIRTIO_BLK_T_DISCARD if limits.discard => {
            if limits.readonly {
                return Err(RequestError::ReadOnly);
            }
            Ok(Action::Discard(ranges(mem, &out_data, "discard", limits)?))
        }
        VIRTIO_BLK_T_WRITE_ZEROES if limits.write_zeroes => {
            if limits.readonly {
                return Err(RequestError::ReadOnly);
            }
            Ok(Action::WriteZeroes(ranges(
                mem,
                &out_data,
                "write-zeroes",
                limits,
            )?))
        }
        other => Err(RequestError::Unsupported(other)),
    }
}

/// Checks that `len` bytes from `sector` lie on the disk; returns the byte offset.
fn check_extent(sector: u64, len: u64, limits: &DiskLimits) -> Result<u64, RequestError> {
    if !len.is_multiple_of(SECTOR_SIZE) {
        return Err(RequestError::UnalignedLength { len });
    }
    let sectors = len >> SECTOR_SHIFT;
    let past_end = RequestError::PastEnd {
        sector,
        sectors,
        capacity: limits.capacity,
    };
    match sector.checked_add(sectors) {
        Some(end) if end <= limits.capacity => Ok(sector << SECTOR_SHIFT),
        _ => Err(past_end),
    }
}

/// The discard / write-zeroes ranges in `data`, each checked.
fn ranges<M: GuestMemoryBackend>(
    mem: &M,
    data: &[Segment],
    what: &'static str,
    limits: &DiskLimits,
) -> Result<Vec<ByteRange>, RequestError> {
    let len = total_len(data);
    if len == 0 || !len.is_multiple_of(RANGE_LEN) {
        return Err(RequestError::BadRangeList { what, len });
    }
    let count = len / RANGE_LEN;
    if count > u64::from(limits.max_ranges) {
        return Err(RequestError::TooManyRanges {
            what,
            got: count,
            max: limits.max_ranges,
        });
    }
    // `count` ≤ max_ranges, so this buffer is small and bounded.
    let mut raw = vec![0u8; narrow::usize_of(len)];
    read_from_segments(mem, data, &mut raw)?;
    raw.chunks_exact(narrow::usize_of(RANGE_LEN))
        .map(|r| {
            let sector = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
            let num = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default());
            let allowed = if what == "discard" {
                0
            } else {
                RANGE_FLAG_UNMAP
            };
            if flags & !allowed != 0 {
                return Err(RequestError::BadRangeFlags { what, flags });
            }
            if num > limits.max_range_sectors {
                return Err(RequestError::RangeTooLong {
                    what,
                    got: num,
                    max: limits.max_range_sectors,
                });
            }
            let bytes = u64::from(num) << SECTOR_SHIFT;
            Ok(ByteRange {
                offset: check_extent(sector, bytes, limits)?,
                len: bytes,
                unmap: flags & RANGE_FLAG_UNMAP != 0,
            })
        })
        .collect()
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
