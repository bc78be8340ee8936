//! `daxprobe roundtrip DAX_FILE FUSE_FILE PASSES`: what one FUSE_SETUPMAPPING
//! costs the guest, beside what one 4 KiB FUSE_READ costs, in one boot.
//!
//! Each pass, alternating so both see the same emulator state:
//!
//! - **cold touch**: guest caches dropped (which evicts the DAX file's inode
//!   and with it every range it had mapped), the DAX file mapped whole and
//!   one byte read from each 2 MiB range, each read timed: a fault that
//!   sends one SETUPMAPPING and waits for it;
//! - **other page**: in the same mapping, right after, one byte 1 MiB into
//!   each range: a page of a range already mapped that this process has not
//!   touched (a guest page fault where the guest maps 4 KiB at a time, and a
//!   nested page fault where the VMM has not pre-faulted the page yet), no
//!   round trip: what a cold touch costs beside its SETUPMAPPING;
//! - **warm touch**: the file mapped again and the same bytes read: the
//!   ranges are still in the inode's tree and their pages in KVM's, so each
//!   is a guest page fault alone;
//! - **FUSE read**: as many 4 KiB `O_DIRECT` preads of FUSE_FILE (on a mount
//!   without DAX) at random 4 KiB-aligned offsets, each one FUSE_READ.
//!
//! `roundtrip-maps` and `roundtrip-reads` make one pass of either kind
//! alone, for the host to read each thread's CPU time around it.
//!
//! Prints one line of `name_n=… name_median_us=… name_p90_us=…` for
//! `setupmapping`, `other_page`, `warm_touch` and `fuse_read`.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::Mapping;

/// Linux maps DAX files in 2 MiB ranges of the window.
const RANGE: usize = 2 << 20;
const READ_BLOCK: usize = 4096;

fn fail(msg: String) -> ! {
    eprintln!("daxprobe roundtrip: {msg}");
    std::process::exit(1)
}

fn open(path: &str, flags: libc::c_int) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .unwrap_or_else(|e| fail(format!("{path}: {e}")))
}

/// `off` as pread takes it; a file offset past `i64::MAX` cannot exist.
fn offset(off: u64) -> libc::off_t {
    libc::off_t::try_from(off).unwrap_or_else(|_| fail(format!("offset {off} is past i64::MAX")))
}

fn size_of(file: &std::fs::File, path: &str) -> usize {
    file.metadata()
        .map_err(|e| e.to_string())
        .and_then(|m| usize::try_from(m.len()).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| fail(format!("{path}: {e}")))
}

/// Drops the guest's page cache, dentries and inodes: a closed DAX file's
/// inode goes, and its ranges with it (REMOVEMAPPING, not timed here).
fn drop_caches() {
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .unwrap_or_else(|e| fail(format!("/proc/sys/vm/drop_caches: {e}")));
}

/// Reads one byte `at` bytes into each 2 MiB range of `m`, timing each read.
fn touch_ranges(m: &Mapping, at: usize) -> Vec<Duration> {
    let bytes = m.bytes();
    let mut times = Vec::with_capacity(bytes.len() / RANGE);
    for off in (at..bytes.len()).step_by(RANGE) {
        let start = Instant::now();
        // A volatile read so the touch is not optimised away.
        // SAFETY: `off` is inside `bytes` (the loop's bound), a valid u8.
        let byte = unsafe { std::ptr::read_volatile(bytes.as_ptr().add(off)) };
        times.push(start.elapsed());
        std::hint::black_box(byte);
    }
    times
}

/// `file`'s whole 2 MiB ranges, mapped read-only (a partial last one
/// would map less).
fn map_whole_ranges(file: &std::fs::File, path: &str) -> Mapping {
    let len = size_of(file, path) / RANGE * RANGE;
    if len == 0 {
        fail(format!("{path} is smaller than one 2 MiB range"));
    }
    Mapping::new(file, len, false)
}

/// `count` 4 KiB `O_DIRECT` preads at random aligned offsets of `path`,
/// each timed.
fn direct_reads(path: &str, count: usize, seed: &mut u64) -> Vec<Duration> {
    let file = open(path, libc::O_DIRECT);
    let blocks = (size_of(&file, path) / READ_BLOCK) as u64;
    if blocks == 0 {
        fail(format!("{path} is smaller than {READ_BLOCK} bytes"));
    }
    // O_DIRECT wants an aligned buffer.
    let layout = std::alloc::Layout::from_size_align(READ_BLOCK, READ_BLOCK)
        .unwrap_or_else(|e| fail(e.to_string()));
    // SAFETY: a non-zero-sized layout; freed below.
    let buf = unsafe { std::alloc::alloc(layout) };
    if buf.is_null() {
        fail("out of memory".into());
    }
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let off = (*seed % blocks) * READ_BLOCK as u64;
        let start = Instant::now();
        // SAFETY: `buf` holds READ_BLOCK writable bytes.
        let n = unsafe { libc::pread(file.as_raw_fd(), buf.cast(), READ_BLOCK, offset(off)) };
        times.push(start.elapsed());
        if usize::try_from(n).ok() != Some(READ_BLOCK) {
            fail(format!(
                "pread {path} at {off}: {}",
                if n < 0 {
                    std::io::Error::last_os_error().to_string()
                } else {
                    format!("{n} bytes")
                }
            ));
        }
    }
    // SAFETY: allocated above with the same layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    times
}

/// `name_n=… name_median_us=… name_p90_us=… name_mean_us=…`, nearest rank.
fn summary(name: &str, times: &mut [Duration]) -> String {
    if times.is_empty() {
        return format!("{name}_n=0");
    }
    times.sort_unstable();
    let rank = |q: f64| times[test_infra::results::nearest_rank(times.len(), q) - 1];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = times.iter().map(|&d| us(d)).sum::<f64>() / times.len() as f64;
    format!(
        "{name}_n={} {name}_median_us={:.1} {name}_p90_us={:.1} {name}_mean_us={:.1}",
        times.len(),
        us(rank(0.5)),
        us(rank(0.9)),
        mean
    )
}

pub fn run(dax_path: &str, fuse_path: &str, passes: u64) {
    let (mut cold, mut other_page, mut warm, mut reads) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..passes {
        drop_caches();
        let file = open(dax_path, 0);
        let mapping = map_whole_ranges(&file, dax_path);
        let ranges = mapping.bytes().len() / RANGE;
        cold.extend(touch_ranges(&mapping, 0));
        other_page.extend(touch_ranges(&mapping, RANGE / 2));
        drop(mapping);
        warm.extend(touch_ranges(&map_whole_ranges(&file, dax_path), 0));
        drop(file);
        reads.extend(direct_reads(fuse_path, ranges, &mut seed));
    }
    println!(
        "{} {} {} {}",
        summary("setupmapping", &mut cold),
        summary("other_page", &mut other_page),
        summary("warm_touch", &mut warm),
        summary("fuse_read", &mut reads)
    );
}

/// `daxprobe roundtrip-maps DAX_FILE`: one cold touch of each 2 MiB range
/// of DAX_FILE, caches dropped by the caller beforehand (so that the
/// REMOVEMAPPINGs of the drop fall outside whatever the host measures
/// around this), timed as in [`run`].
pub fn maps_once(dax_path: &str) {
    let file = open(dax_path, 0);
    let mut cold = touch_ranges(&map_whole_ranges(&file, dax_path), 0);
    println!("{}", summary("setupmapping", &mut cold));
}

/// `daxprobe roundtrip-reads FUSE_FILE COUNT`: COUNT 4 KiB `O_DIRECT`
/// preads, timed as in [`run`].
pub fn reads_once(fuse_path: &str, count: usize) {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    println!(
        "{}",
        summary("fuse_read", &mut direct_reads(fuse_path, count, &mut seed))
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_gives_nearest_rank_median_and_p90() {
        let mut t: Vec<Duration> = (1..=10).rev().map(Duration::from_micros).collect();
        assert_eq!(
            summary("x", &mut t),
            "x_n=10 x_median_us=5.0 x_p90_us=9.0 x_mean_us=5.5"
        );
        assert_eq!(summary("y", &mut []), "y_n=0");
    }
}
