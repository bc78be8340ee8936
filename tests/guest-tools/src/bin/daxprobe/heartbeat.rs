//! A guest heartbeat the host reads in the guest's RAM, the same way
//! under any VMM, and the guest's own view of its clocks beside it: the
//! downtime probe of the snapshot and migration benchmark.
//!
//! - `daxprobe ram-counter SECONDS` (guest): locks one page of its own
//!   memory, prints its guest-physical address (`@@GUEST
//!   ram_counter_gpa=N`, from `/proc/self/pagemap`), and for SECONDS keeps
//!   a u64 at its start advancing about every millisecond. The host reads
//!   it in the VMM's RAM memfd at offset N (guest RAM below 3 GiB starts
//!   at offset 0 of it in both VMMs) with `counter-gap` or
//!   `counter-moves`. Each time one step of the loop took more than
//!   `CLOCK_GAP_MS` by `CLOCK_MONOTONIC` or by `CLOCK_REALTIME` it prints
//!   `@@GUEST clockgap mono_ms=M real_ms=R`: what the guest itself saw of
//!   a stop (its clock may be set back to where it paused, so it may see
//!   nothing).
//! - `daxprobe counter-moves PATH OFFSET SECONDS` (host): reads the u64 at
//!   OFFSET of PATH, then every millisecond until it changes (at most
//!   SECONDS) and prints `moved_at_ms=T` (`CLOCK_BOOTTIME`, the clock of
//!   the emulated host's `/proc/uptime`) or `moved_at_ms=none`.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::{fail, num, open};

/// A step of the guest's loop longer than this is reported.
const CLOCK_GAP_MS: u128 = 100;
const PAGE: usize = 4096;

/// Milliseconds of `clock`.
fn clock_ms(clock: libc::clockid_t) -> u128 {
    // SAFETY: all-zero is a valid timespec for the call to overwrite.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a writable timespec.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        fail(format!(
            "clock_gettime: {}",
            std::io::Error::last_os_error()
        ));
    }
    let secs = u128::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u128::try_from(ts.tv_nsec).unwrap_or(0);
    secs * 1000 + nanos / 1_000_000
}

/// The guest-physical address of the page at `addr` of this process.
fn physical_address(addr: usize) -> u64 {
    let pagemap = open("/proc/self/pagemap", false);
    let mut entry = [0u8; 8];
    let index = u64::try_from(addr / PAGE).unwrap_or_else(|_| fail("address too large".into()));
    pagemap
        .read_exact_at(&mut entry, index * 8)
        .unwrap_or_else(|e| fail(format!("/proc/self/pagemap: {e}")));
    let entry = u64::from_le_bytes(entry);
    // Bit 63: present; bits 0-54: the frame number (0 without CAP_SYS_ADMIN).
    let pfn = entry & ((1 << 55) - 1);
    if entry >> 63 == 0 || pfn == 0 {
        fail(format!(
            "no frame number for the page ({entry:#x}): not root?"
        ));
    }
    pfn * u64::try_from(PAGE).unwrap_or(0)
}

pub fn ram_counter(secs: &str) {
    // SAFETY: a fresh private anonymous mapping of one page; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        fail(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: locks the page just mapped, so it stays at one frame.
    if unsafe { libc::mlock(p, PAGE) } != 0 {
        fail(format!("mlock: {}", std::io::Error::last_os_error()));
    }
    let ptr = p.cast::<u64>();
    let mut value = 1u64;
    // SAFETY: the page is mapped, writable, aligned and ours until exit.
    unsafe { ptr.write_volatile(value) };
    println!("@@GUEST ram_counter_gpa={}", physical_address(p as usize));
    let end = Instant::now() + Duration::from_secs(num(secs));
    let (mut mono, mut real) = (
        clock_ms(libc::CLOCK_MONOTONIC),
        clock_ms(libc::CLOCK_REALTIME),
    );
    while Instant::now() < end {
        value = value.wrapping_add(1);
        // SAFETY: as above; volatile so each store reaches RAM.
        unsafe { ptr.write_volatile(value) };
        std::thread::sleep(Duration::from_millis(1));
        let (m, r) = (
            clock_ms(libc::CLOCK_MONOTONIC),
            clock_ms(libc::CLOCK_REALTIME),
        );
        let (dm, dr) = (m.saturating_sub(mono), r.saturating_sub(real));
        if dm > CLOCK_GAP_MS || dr > CLOCK_GAP_MS {
            println!("@@GUEST clockgap mono_ms={dm} real_ms={dr}");
        }
        (mono, real) = (m, r);
    }
}

/// `CLOCK_BOOTTIME` in milliseconds, as `/proc/uptime` counts.
pub fn boottime_ms() -> u128 {
    clock_ms(libc::CLOCK_BOOTTIME)
}

pub fn counter_moves(path: &str, offset: &str, secs: &str) {
    let f = open(path, false);
    let offset: u64 = num(offset);
    let read = || {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, offset)
            .unwrap_or_else(|e| fail(format!("{path}: {e}")));
        u64::from_le_bytes(b)
    };
    let first = read();
    let end = Instant::now() + Duration::from_secs(num(secs));
    while Instant::now() < end {
        if read() != first {
            println!("moved_at_ms={}", boottime_ms());
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("moved_at_ms=none");
}
