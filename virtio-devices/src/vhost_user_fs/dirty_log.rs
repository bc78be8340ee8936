//! The vhost-user dirty log: what the fs daemons write into guest RAM
//! while a live migration copies it (FUSE replies, used rings).
//!
//! [`SharedDirtyLog`] is one memfd the VMM sizes and maps itself — one bit
//! per 4 KiB page of guest-physical space from address 0, bit N of the
//! log (byte N/8, bit N%8) = page N — and hands to every daemon with
//! `SET_LOG_BASE`; the daemon sets the bit of each page it writes. The
//! file is sized once for the whole span the guest's RAM may take and
//! never shrunk: a daemon that maps more than the file holds dies of
//! SIGBUS. The VMM takes the bits back word by word with an atomic swap,
//! so a bit the daemon sets between the read and the clear is never lost.
//!
//! [`DaemonMemory::start_dirty_log`](super::memory_table::DaemonMemory::start_dirty_log)
//! (in the daemon's memory table handle) turns the log on for one daemon
//! (`SET_FEATURES` with `LOG_ALL`, then `SET_LOG_BASE`); a daemon that
//! does not offer `LOG_ALL` and `LOG_SHMFD` is refused by name, since a
//! pre-copy without its writes would copy stale pages. The log base is
//! sent again after every memory table change while logging (the daemon
//! logs only the regions it had when it got the log).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use vhost::VhostUserDirtyLogRegion;

/// Bytes of guest memory one bit of the log stands for.
pub const LOG_PAGE_SIZE: u64 = 4096;

/// Pages one word of the log covers.
const PAGES_PER_WORD: u64 = 64;

/// The largest guest-physical span a log covers: 16 TiB, 512 MiB of log.
pub const MAX_LOG_SPAN: u64 = 1 << 44;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error(
        "a dirty log of a {span:#x}-byte guest-physical span is above the limit of {MAX_LOG_SPAN:#x} bytes"
    )]
    TooLarge { span: u64 },
    #[error("creating the dirty log's memfd: {0}")]
    Memfd(std::io::Error),
    #[error("sizing the dirty log's memfd to {size} bytes: {source}")]
    Truncate { size: u64, source: std::io::Error },
    #[error("mapping the {size}-byte dirty log: {source}")]
    Map { size: usize, source: std::io::Error },
}

/// The log the daemons write and the VMM reads; see the module note.
pub struct SharedDirtyLog {
    file: File,
    /// `words` u64s mapped shared from `file`.
    map: NonNull<AtomicU64>,
    words: usize,
}

// SAFETY: the mapping is only reached through atomics (`take_word`) and is
// owned by this value until it is dropped.
unsafe impl Send for SharedDirtyLog {}
// SAFETY: as for Send: every access is an atomic operation.
unsafe impl Sync for SharedDirtyLog {}

impl SharedDirtyLog {
    /// A zeroed log for guest-physical addresses `[0, span)`, rounded up
    /// to whole words.
    pub fn new(span: u64) -> Result<Self, DirtyLogError> {
        let too_large = DirtyLogError::TooLarge { span };
        if span > MAX_LOG_SPAN {
            return Err(too_large);
        }
        let words = span.div_ceil(LOG_PAGE_SIZE).div_ceil(PAGES_PER_WORD).max(1);
        let size = words.checked_mul(8).ok_or(too_large)?;
        let len = usize::try_from(size).map_err(|_| DirtyLogError::TooLarge { span })?;
        let words = usize::try_from(words).map_err(|_| DirtyLogError::TooLarge { span })?;
        // SAFETY: the name is a NUL-terminated literal, the flags valid; the
        // result is checked before use.
        let fd = unsafe { libc::memfd_create(c"dirty-log".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(DirtyLogError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and nobody else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)
            .map_err(|source| DirtyLogError::Truncate { size, source })?;
        // SAFETY: a fresh shared mapping of `len` bytes of a file that holds
        // `len` bytes; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(DirtyLogError::Map {
                size: len,
                source: std::io::Error::last_os_error(),
            });
        }
        let map = NonNull::new(ptr.cast::<AtomicU64>()).ok_or(DirtyLogError::Map {
            size: len,
            source: std::io::Error::from(std::io::ErrorKind::InvalidData),
        })?;
        Ok(SharedDirtyLog { file, map, words })
    }

    /// Words of the log (64 pages each).
    pub fn words(&self) -> usize {
        self.words
    }

    /// Bytes of the log (its file's length and its mapping's).
    pub fn size(&self) -> u64 {
        // usize is at most 64 bits wide on every supported host.
        self.words as u64 * 8
    }

    /// Word `i` (pages `64 i .. 64 i + 63`, page `64 i + b` as bit `b`),
    /// set to zero in the same atomic step. None past the end.
    pub fn take_word(&self, i: usize) -> Option<u64> {
        if i >= self.words {
            return None;
        }
        // SAFETY: `i` is below `words`, so the pointer is inside the
        // mapping, which lives as long as `self`; u64s of a page-aligned
        // mapping are aligned.
        let word = unsafe { &*self.map.as_ptr().add(i) };
        // The daemon sets bits byte by byte (bit N of the log = byte N/8,
        // bit N%8): read little-endian, that is bit N%64 of word N/64.
        Some(u64::from_le(word.swap(0, Ordering::AcqRel)))
    }

    /// What `SET_LOG_BASE` carries: the whole file from offset 0.
    pub(super) fn region(&self) -> VhostUserDirtyLogRegion {
        VhostUserDirtyLogRegion {
            mmap_size: self.size(),
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }

    /// The log's file, for a second mapping (as a daemon's) in tests.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for SharedDirtyLog {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` with this length and is
        // not reached after this.
        unsafe {
            libc::munmap(self.map.as_ptr().cast(), self.words * 8);
        }
    }
}

#[cfg(test)]
#[path = "dirty_log_tests.rs"]
mod tests;
