//! READ and WRITE whose guest buffer lies in the DAX window: a program
//! `read()`s one file into a DAX mapping of another (with `O_DIRECT`, or
//! from a file the daemon opened `direct_io`), so the guest kernel hands the
//! daemon window pages instead of RAM. The daemon cannot see those pages,
//! but it mapped them: each window stretch is served by copying between the
//! request's file and the file mapped there ([`IoTarget::File`]).
//!
//! Only what this daemon mapped and the VMM acknowledged is reachable, only
//! inside that file's current size, and a READ (which writes the buffer)
//! only into a range mapped writable; anything else fails the request with
//! EFAULT, as the guest's own access would.
//!
//! What a request may make the daemon hold is bounded: one descriptor per
//! distinct file behind its buffer (shared by every stretch in that file),
//! each taking a `--max-handles` slot until the request is answered (ENFILE
//! past the cap), and at most [`MAX_WINDOW_PIECES`] stretches (E2BIG past
//! it). Either refusal fails that request only, is counted
//! (`cap_refusals`) and warned about at most every 10 s.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::DaxMapper;
use crate::fuse::chain::Buf;
use crate::limits::Cap;
use crate::passthrough::{errno_error, IoTarget, MappedFd, PassthroughFs};

/// Window stretches (each a piece of one mapped range) one READ or WRITE
/// may name. The daemon offers `max_pages` = 256 (1 MiB requests), so a
/// Linux guest's buffer spans at most 257 pages and so 257 ranges however
/// finely the window is mapped; four times that leaves room and still
/// bounds the copy calls and the memory one request costs.
pub const MAX_WINDOW_PIECES: usize = 1024;

/// The files a request's window stretches are in, each opened once:
/// (node id, host identity) → descriptor.
type OpenedFiles = HashMap<(u64, (u64, u64)), Arc<MappedFd>>;

/// What a request's buffers are on the host, in order: runs of guest RAM
/// as iovecs, window stretches as the mapped files' byte ranges.
/// `into_buffer`: the request fills the buffer (READ).
pub fn targets(
    fs: &PassthroughFs,
    dax: &DaxMapper,
    bufs: Vec<Buf>,
    into_buffer: bool,
) -> io::Result<Vec<IoTarget>> {
    let mut out: Vec<IoTarget> = Vec::new();
    let mut window_bytes = 0u64;
    let mut opened = OpenedFiles::new();
    let mut pieces = 0usize;
    for buf in bufs {
        match buf {
            Buf::Ram(iov) => match out.last_mut() {
                Some(IoTarget::Memory(iovs)) => iovs.push(iov),
                _ => out.push(IoTarget::Memory(vec![iov])),
            },
            Buf::Window { offset, len } => {
                let len = len as u64;
                let r = window_targets(fs, dax, offset, len, into_buffer, &mut opened, &mut pieces);
                match r {
                    Ok(files) => out.extend(files),
                    Err(e) => {
                        dax.stats.window_buffer_refusals.fetch_add(1, Relaxed);
                        tracing::debug!(
                            "a buffer at window offset {offset:#x}+{len:#x} is refused: {e}"
                        );
                        return Err(e);
                    }
                }
                window_bytes += len;
            }
        }
    }
    if window_bytes > 0 {
        dax.stats.window_buffer_ios.fetch_add(1, Relaxed);
        dax.stats
            .window_buffer_bytes
            .fetch_add(window_bytes, Relaxed);
    }
    Ok(out)
}

/// The stretches behind window bytes `[offset, offset + len)`, opening
/// each file not in `opened` yet; `pieces` counts the request's stretches.
fn window_targets(
    fs: &PassthroughFs,
    dax: &DaxMapper,
    offset: u64,
    len: u64,
    into_buffer: bool,
    opened: &mut OpenedFiles,
    pieces: &mut usize,
) -> io::Result<Vec<IoTarget>> {
    let resolved = dax.resolve(offset, len, into_buffer)?;
    // Counted before anything is opened.
    *pieces = pieces.saturating_add(resolved.len());
    if *pieces > MAX_WINDOW_PIECES {
        fs.caps.hit(Cap::WindowPieces, MAX_WINDOW_PIECES as u64);
        return Err(errno_error(libc::E2BIG));
    }
    let mut out = Vec::with_capacity(resolved.len());
    for p in resolved {
        let file = match opened.get(&(p.nodeid, p.key)) {
            Some(file) => file.clone(),
            None => {
                let file = Arc::new(fs.open_mapped(p.nodeid, p.key, into_buffer)?);
                opened.insert((p.nodeid, p.key), file.clone());
                file
            }
        };
        out.push(file.target(p.foffset, p.len)?);
    }
    Ok(out)
}

#[cfg(test)]
#[path = "window_io_tests.rs"]
mod tests;
