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

use std::io;
use std::sync::atomic::Ordering::Relaxed;

use super::DaxMapper;
use crate::fuse::chain::Buf;
use crate::passthrough::{IoTarget, PassthroughFs};

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
    for buf in bufs {
        match buf {
            Buf::Ram(iov) => match out.last_mut() {
                Some(IoTarget::Memory(iovs)) => iovs.push(iov),
                _ => out.push(IoTarget::Memory(vec![iov])),
            },
            Buf::Window { offset, len } => {
                let len = len as u64;
                let r = window_targets(fs, dax, offset, len, into_buffer);
                match r {
                    Ok(files) => out.extend(files),
                    Err(e) => {
                        dax.stats.window_buffer_refusals.fetch_add(1, Relaxed);
                        log::debug!(
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

fn window_targets(
    fs: &PassthroughFs,
    dax: &DaxMapper,
    offset: u64,
    len: u64,
    into_buffer: bool,
) -> io::Result<Vec<IoTarget>> {
    dax.resolve(offset, len, into_buffer)?
        .into_iter()
        .map(|p| fs.open_mapped(p.nodeid, p.key, p.foffset, p.len, into_buffer))
        .collect()
}
