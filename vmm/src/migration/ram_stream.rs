//! Guest RAM through the migration stream, as Cloud Hypervisor sends it:
//! a `Memory` request whose payload is a table of `{gpa, length}` ranges,
//! then the bytes of each range in table order, then one answer. Used
//! when RAM cannot be passed as fds (another host, or private RAM).
//!
//! The receiver checks every range against its own RAM before a byte is
//! written and reads through a fixed buffer: a sender can make it write
//! only inside guest RAM, and never makes it allocate per range.

use std::io::Read;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vm_state::protocol::{self, Command, MemoryRange, Request, MEMORY_RANGE_LEN};

use super::channel::Channel;
use super::exchange::expect_ok;
use super::MigrationError;
use crate::memory::dirty_log::{DirtyPages, PAGE_SIZE};
use crate::memory::snapshot::next_data_extent;
use crate::memory::GuestMemoryMmap;

/// Ranges one `Memory` request carries at most (64 KiB of table).
pub const MAX_RANGES_PER_REQUEST: usize = 4096;
/// Bytes of RAM one `Memory` request carries at most: each request is
/// answered, so a receiver that fails is heard of this soon.
pub const MAX_BYTES_PER_REQUEST: u64 = 64 << 20;
/// The copy buffer on either side.
const CHUNK: usize = 1 << 20;

/// What the first pass sends: the ranges of `mem` that may hold anything
/// but zeroes (the receiver's fresh RAM is zeroes). A memfd's data
/// extents (`SEEK_DATA`: pages never written are holes); elsewhere
/// (private RAM, hugetlbfs) every 4 KiB page that is not all zeroes.
pub fn data_ranges(mem: &GuestMemoryMmap) -> Vec<MemoryRange> {
    let mut ranges = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    for region in mem.iter() {
        let gpa = region.start_addr().0;
        let len = region.len();
        let sparse = region
            .file_offset()
            .and_then(|f| file_extents(f.file(), f.start(), len, gpa));
        match sparse {
            Some(extents) => extents.into_iter().for_each(|r| push(&mut ranges, r)),
            None => nonzero_pages(mem, gpa, len, &mut buf, &mut ranges),
        }
    }
    ranges
}

/// The data extents of `[start, start + len)` of `file`, as guest ranges
/// from `gpa`; None when the file cannot seek holes.
fn file_extents(file: &std::fs::File, start: u64, len: u64, gpa: u64) -> Option<Vec<MemoryRange>> {
    let end = start.checked_add(len)?;
    let mut extents = Vec::new();
    let mut at = start;
    while let Some((data, length)) = next_data_extent(file, at, end).ok()? {
        extents.push(MemoryRange {
            gpa: gpa + (data - start),
            length,
        });
        at = data + length;
    }
    Some(extents)
}

fn nonzero_pages(
    mem: &GuestMemoryMmap,
    gpa: u64,
    len: u64,
    buf: &mut [u8],
    ranges: &mut Vec<MemoryRange>,
) {
    let mut done = 0u64;
    while done < len {
        let n = narrow::usize_of((len - done).min(buf.len() as u64));
        let chunk = buf.get_mut(..n).unwrap_or_default();
        let at = gpa + done;
        if mem.read_slice(chunk, GuestAddress(at)).is_err() {
            // Inside a region of `mem` by construction; send it whole
            // rather than guess.
            push(
                ranges,
                MemoryRange {
                    gpa: at,
                    length: n as u64,
                },
            );
        } else {
            for (i, page) in (0u64..).zip(chunk.chunks(narrow::usize_of(PAGE_SIZE))) {
                if page.iter().any(|&b| b != 0) {
                    push(
                        ranges,
                        MemoryRange {
                            gpa: at + i * PAGE_SIZE,
                            length: page.len() as u64,
                        },
                    );
                }
            }
        }
        done += n as u64;
    }
}

/// Appends `r`, joined to the last range when they touch.
fn push(ranges: &mut Vec<MemoryRange>, r: MemoryRange) {
    if r.length == 0 {
        return;
    }
    if let Some(last) = ranges.last_mut() {
        if last.gpa + last.length == r.gpa {
            last.length += r.length;
            return;
        }
    }
    ranges.push(r);
}

/// The dirty pages that lie in guest RAM, as ranges. A daemon's log is
/// not trusted to mark only RAM: bits outside it are dropped here.
pub fn dirty_ranges(dirty: &DirtyPages, mem: &GuestMemoryMmap) -> Vec<MemoryRange> {
    let mut ranges = Vec::new();
    for (gpa, length) in dirty.runs() {
        let end = gpa.saturating_add(length);
        for region in mem.iter() {
            let start = region.start_addr().0;
            let stop = start.saturating_add(region.len());
            let (from, to) = (gpa.max(start), end.min(stop));
            if from < to {
                push(
                    &mut ranges,
                    MemoryRange {
                        gpa: from,
                        length: to - from,
                    },
                );
            }
        }
    }
    ranges
}

/// The ranges of `a` and `b` together, in address order, each byte once.
pub fn union(mut a: Vec<MemoryRange>, b: Vec<MemoryRange>) -> Vec<MemoryRange> {
    a.extend(b);
    a.sort_by_key(|r| r.gpa);
    let mut out: Vec<MemoryRange> = Vec::with_capacity(a.len());
    for r in a {
        match out.last_mut() {
            Some(last) if r.gpa <= last.gpa + last.length => {
                let end = (r.gpa + r.length).max(last.gpa + last.length);
                last.length = end - last.gpa;
            }
            _ if r.length > 0 => out.push(r),
            _ => {}
        }
    }
    out
}

/// Bytes `ranges` hold.
pub fn total(ranges: &[MemoryRange]) -> u64 {
    ranges.iter().map(|r| r.length).sum()
}

/// Sends `ranges` of `mem` in `Memory` requests, each answered; returns
/// the bytes sent.
pub fn send_ranges(
    channel: &Channel,
    mem: &GuestMemoryMmap,
    ranges: &[MemoryRange],
) -> Result<u64, MigrationError> {
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    let mut batch: Vec<MemoryRange> = Vec::new();
    let mut batch_bytes = 0u64;
    for r in ranges {
        // Large ranges are split so no request exceeds its byte budget.
        let mut at = r.gpa;
        let end = r.gpa + r.length;
        while at < end {
            let room = MAX_BYTES_PER_REQUEST - batch_bytes;
            let length = (end - at).min(room);
            batch.push(MemoryRange { gpa: at, length });
            batch_bytes += length;
            at += length;
            if batch.len() == MAX_RANGES_PER_REQUEST || batch_bytes == MAX_BYTES_PER_REQUEST {
                sent += send_request(channel, mem, &batch, &mut buf)?;
                batch.clear();
                batch_bytes = 0;
            }
        }
    }
    if !batch.is_empty() {
        sent += send_request(channel, mem, &batch, &mut buf)?;
    }
    Ok(sent)
}

fn send_request(
    channel: &Channel,
    mem: &GuestMemoryMmap,
    ranges: &[MemoryRange],
    buf: &mut [u8],
) -> Result<u64, MigrationError> {
    let table: Vec<u8> = ranges.iter().flat_map(MemoryRange::encode).collect();
    let length = u64::try_from(table.len()).unwrap_or(u64::MAX);
    Request::new(Command::Memory, length)?.write_to(&mut &*channel)?;
    write_all(channel, &table)?;
    let mut sent = 0u64;
    for r in ranges {
        let mut done = 0u64;
        while done < r.length {
            let n = narrow::usize_of((r.length - done).min(buf.len() as u64));
            let chunk = buf.get_mut(..n).unwrap_or_default();
            // Read while the guest may write it: the dirty log has the
            // page again if it changed meanwhile.
            mem.read_slice(chunk, GuestAddress(r.gpa + done))
                .map_err(|e| MigrationError::Ram(format!("reading {:#x}: {e}", r.gpa + done)))?;
            write_all(channel, chunk)?;
            done += n as u64;
        }
        sent += r.length;
    }
    expect_ok(channel, Command::Memory)?;
    Ok(sent)
}

fn write_all(channel: &Channel, bytes: &[u8]) -> Result<(), MigrationError> {
    std::io::Write::write_all(&mut &*channel, bytes)
        .map_err(|e| MigrationError::Protocol(protocol::ProtocolError::Io(e)))
}

/// How many times over a sender may send all of guest RAM: a pre-copy
/// sends it once, then at most [`super::MAX_ROUNDS`] rounds of dirty pages
/// and the last ones, each at most all of RAM.
pub const RAM_RESENDS: u64 = super::MAX_ROUNDS as u64 + 2;

/// Takes one `Memory` request's table and bytes into `mem`; every range
/// must lie in guest RAM and their bytes fit in what is left of `budget`
/// (both checked before a byte is read; the budget is then charged).
/// Returns the ranges written.
pub fn receive_ranges(
    stream: &mut impl Read,
    request: &Request,
    mem: &GuestMemoryMmap,
    budget: &mut u64,
) -> Result<Vec<MemoryRange>, MigrationError> {
    let table = protocol::read_payload(stream, request)?;
    let ranges = protocol::decode_ranges(Command::Memory, &table)?;
    debug_assert_eq!(ranges.len() * MEMORY_RANGE_LEN, table.len());
    let bytes = ranges
        .iter()
        .try_fold(0u64, |sum, r| sum.checked_add(r.length))
        .filter(|bytes| *bytes <= *budget)
        .ok_or_else(|| {
            MigrationError::Ram(format!(
                "Memory: the sender sent more than {RAM_RESENDS} times guest RAM's size"
            ))
        })?;
    for (index, r) in ranges.iter().enumerate() {
        let inside = usize::try_from(r.length)
            .is_ok_and(|len| GuestMemoryBackend::check_range(mem, GuestAddress(r.gpa), len));
        if !inside {
            return Err(MigrationError::Ram(format!(
                "Memory range {index}: {:#x}+{:#x} is not inside guest RAM",
                r.gpa, r.length
            )));
        }
    }
    let mut buf = vec![0u8; CHUNK];
    for r in &ranges {
        let mut done = 0u64;
        while done < r.length {
            let n = narrow::usize_of((r.length - done).min(buf.len() as u64));
            let chunk = buf.get_mut(..n).unwrap_or_default();
            read_exact(stream, chunk, r, done)?;
            mem.write_slice(chunk, GuestAddress(r.gpa + done))
                .map_err(|e| MigrationError::Ram(format!("writing {:#x}: {e}", r.gpa + done)))?;
            done += n as u64;
        }
    }
    *budget -= bytes;
    Ok(ranges)
}

fn read_exact(
    stream: &mut impl Read,
    chunk: &mut [u8],
    r: &MemoryRange,
    done: u64,
) -> Result<(), MigrationError> {
    stream.read_exact(chunk).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            MigrationError::Ram(format!(
                "the sender closed the stream inside range {:#x}+{:#x}, {done} bytes in",
                r.gpa, r.length
            ))
        } else {
            MigrationError::Protocol(protocol::ProtocolError::Io(e))
        }
    })
}

#[cfg(test)]
#[path = "ram_stream_tests.rs"]
mod tests;
