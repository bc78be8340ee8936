//! `daxprobe counter-handover SRC_PID DST_PID BYTES OFFSET SECONDS` (host):
//! the downtime of a migration between two VMM processes that do not share
//! the guest's RAM (over TCP), read from the guest's `ram-counter`
//! heartbeat in each VMM's RAM memfd (the one of BYTES bytes; the counter
//! at OFFSET, as `counter-gap` reads it).
//!
//! About every millisecond for SECONDS it reads the source's counter and,
//! once the destination's RAM memfd exists (it appears when the VMM
//! receives the configuration), the destination's. The source's counter
//! stops when the guest is paused for the last time; the destination's
//! copy of it only ever holds values the source had until the guest runs
//! there, when it passes the source's last value. The downtime is from
//! the source's last change to the first reading of the destination past
//! the source's highest value (a sample of a copy racing the source's
//! reading is taken back if the source later reaches that value). Prints
//! `src_last_ms=T src_max=V dst_past_ms=T2 downtime_ms=D` (`CLOCK_BOOTTIME`
//! ms, as `/proc/uptime` counts), with `dst_past_ms=none downtime_ms=none`
//! when the guest never ran on the destination (a failed migration).
//! File descriptors are kept open, so a source that exits is still read.
//! It ends early once the destination has stayed past the source for
//! [`SETTLED`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::heartbeat::boottime_ms;
use crate::{fail, num};

/// The memfd of `bytes` bytes among `pid`'s open files, opened for reading.
fn ram_memfd(pid: &str, bytes: u64) -> Option<File> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    for entry in dir.flatten() {
        // An fd closed meanwhile is skipped.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().contains("memfd:") {
            continue;
        }
        if let Ok(f) = File::open(entry.path()) {
            if f.metadata().is_ok_and(|m| m.len() == bytes) {
                return Some(f);
            }
        }
    }
    None
}

/// How long the destination's reading must stay past the source's highest
/// before the probe ends early.
const SETTLED: Duration = Duration::from_secs(1);

fn value(f: &File, offset: u64) -> u64 {
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, offset)
        .unwrap_or_else(|e| fail(format!("reading the counter: {e}")));
    u64::from_le_bytes(b)
}

pub fn run(src_pid: &str, dst_pid: &str, bytes: &str, offset: &str, secs: &str) {
    let (bytes, offset): (u64, u64) = (num(bytes), num(offset));
    let end = Instant::now() + Duration::from_secs(num(secs));
    let src = ram_memfd(src_pid, bytes)
        .unwrap_or_else(|| fail(format!("no {bytes}-byte memfd open in process {src_pid}")));
    let mut dst: Option<File> = None;
    let (mut src_max, mut src_last) = (value(&src, offset), boottime_ms());
    // (the destination's value, when it was read) at the first reading past
    // the source's highest.
    let mut past: Option<(u64, u128)> = None;
    let mut past_since = Instant::now();
    while Instant::now() < end && !(past.is_some() && past_since.elapsed() >= SETTLED) {
        std::thread::sleep(Duration::from_millis(1));
        let v = value(&src, offset);
        if v != src_max {
            src_max = src_max.max(v);
            src_last = boottime_ms();
            if past.is_some_and(|(d, _)| d <= src_max) {
                past = None;
            }
        }
        if dst.is_none() {
            dst = ram_memfd(dst_pid, bytes);
        }
        if let (Some(f), None) = (&dst, past) {
            let d = value(f, offset);
            if d > src_max {
                past = Some((d, boottime_ms()));
                past_since = Instant::now();
            }
        }
    }
    match past {
        Some((_, at)) => println!(
            "src_last_ms={src_last} src_max={src_max} dst_past_ms={at} downtime_ms={}",
            at.saturating_sub(src_last)
        ),
        None => {
            println!("src_last_ms={src_last} src_max={src_max} dst_past_ms=none downtime_ms=none")
        }
    }
}
