//! What the DAX window shows where no file is mapped.
//!
//! One memfd as large as the window, mapped at the same offset it shows
//! (window offset `o` is scratch offset `o`), shared, read-write, never
//! `PROT_NONE`: KVM cannot serve a `PROT_NONE` page (KVM_RUN fails; only
//! the window's guards, see `window/guard.rs`, rely on that on purpose),
//! so a guest that touches a range with no mapping (a
//! hostile or buggy guest, any guest after its daemon died and the device
//! reset, or a range whose file was truncated on the host) reads zeros and
//! its writes land in the scratch.
//!
//! Each window page has a scratch page of its own: data written through one
//! window range never shows through another. (An earlier scratch repeated
//! one small memfd along the window, so what a guest wrote through one
//! file's range after its daemon died showed up in every other range.)
//!
//! The memfd is sparse: only pages the guest touched cost memory
//! ([`Scratch::resident_bytes`]); [`Scratch::stray_bytes`] counts every
//! page touched since the window was made, emptied or not, so the evidence
//! of stray accesses is not lost when the scratch is. What a guest may keep there is capped
//! ([`stray_budget`]): past it [`Scratch::enforce_budget`] frees every page
//! (the guest then reads zeros where it had written). A range that gets a
//! file mapped, or is unmapped again, starts from zeros too
//! ([`Scratch::forget`]).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The smallest budget: one guest DAX range (`FUSE_DAX_SZ`, 2 MiB).
const MIN_STRAY_BUDGET: u64 = dax_abi::GUEST_RANGE_SIZE;

/// What the guest may keep in a `window_size` window's scratch: 2 MiB, or
/// 1/2048 of the window when that is more (128 MiB for the largest window).
pub fn stray_budget(window_size: u64) -> u64 {
    (window_size / 2048)
        .next_power_of_two()
        .max(MIN_STRAY_BUDGET)
}

pub struct Scratch {
    file: File,
    budget: u64,
    /// Times the budget was exceeded and the scratch emptied.
    resets: AtomicU64,
    /// Bytes the guest had touched that emptying freed since.
    forgotten: AtomicU64,
}

impl Scratch {
    /// A sparse scratch for a `window_size` window (nothing allocated yet).
    pub fn new(window_size: u64) -> std::io::Result<Self> {
        // SAFETY: the name is a NUL-terminated literal; the returned fd is
        // checked and then owned by the File.
        let fd = unsafe { libc::memfd_create(c"dax-window-scratch".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor no one else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(window_size)?;
        Ok(Scratch {
            file,
            budget: stray_budget(window_size),
            resets: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
        })
    }

    /// Maps the scratch over `[start, end)` of the window at `host_addr`.
    /// The caller checks that the range lies inside the window.
    pub fn show(&self, host_addr: u64, start: u64, end: u64) -> std::io::Result<()> {
        let len = usize::try_from(end - start)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let offset = libc::off_t::try_from(start)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: [host_addr + start, + len) lies inside the window the
        // caller reserved and owns (it checks bounds); MAP_FIXED replaces
        // what was there. No Rust reference points into it. The memfd is as
        // large as the window, so every offset shown exists.
        let p = unsafe {
            libc::mmap(
                (host_addr + start) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
                self.file.as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        dont_dump(host_addr + start, end - start);
        Ok(())
    }

    /// Bytes of scratch the guest has touched and that are held now.
    pub fn resident_bytes(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.blocks() * 512)
    }

    /// Bytes of scratch the guest has touched since the window was made
    /// (held now or emptied since).
    pub fn stray_bytes(&self) -> std::io::Result<u64> {
        Ok(self.resident_bytes()? + self.forgotten.load(Relaxed))
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Times the budget was exceeded and the scratch emptied.
    pub fn resets(&self) -> u64 {
        self.resets.load(Relaxed)
    }

    /// Empties `[start, end)` of the scratch (its pages read zeros again).
    pub fn forget(&self, start: u64, end: u64) -> std::io::Result<()> {
        let before = self.resident_bytes()?;
        if before == 0 {
            return Ok(());
        }
        let (Ok(off), Ok(len)) = (
            libc::off_t::try_from(start),
            libc::off_t::try_from(end - start),
        ) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        // SAFETY: fallocate on our own memfd; punching a hole frees pages
        // and unmaps them from every mapping, which then read zeros.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let after = self.resident_bytes()?;
        self.forgotten
            .fetch_add(before.saturating_sub(after), Relaxed);
        Ok(())
    }

    /// Frees the whole scratch when the guest keeps more than the budget
    /// there; whether it did.
    pub fn enforce_budget(&self) -> std::io::Result<bool> {
        if self.resident_bytes()? <= self.budget {
            return Ok(false);
        }
        let size = self.file.metadata()?.len();
        self.forget(0, size)?;
        self.resets.fetch_add(1, Relaxed);
        Ok(true)
    }
}

/// Keeps `[addr, addr + len)` out of core dumps: what the window shows is
/// the guest's data (as guest RAM is, see the VMM's memory setup).
pub fn dont_dump(addr: u64, len: u64) {
    let Ok(len) = usize::try_from(len) else {
        return;
    };
    // SAFETY: madvise changes only whether the range is dumped; the range
    // is a mapping of this process the caller just made.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTDUMP) };
    if r != 0 {
        tracing::debug!(
            "MADV_DONTDUMP on the DAX window: {}",
            std::io::Error::last_os_error()
        );
    }
}
