//! `daxprobe counter-gap PATH SECONDS [OFFSET]`: the host's side of the
//! migration test and benchmark. Reads the u64 at PATH's OFFSET (0 unless
//! given: the guest's `mmap-counter`; the benchmark's `ram-counter` in the
//! VMM's RAM memfd) about every millisecond for SECONDS and prints the
//! longest time it stood still and when that stop ended (`CLOCK_BOOTTIME`,
//! as `/proc/uptime` counts), and every stop of 20 ms or more as
//! `start-end` (the 32 longest), `max_gap_ms=N changes=M ended_at_ms=T
//! stops=S-E,…`:
//! while a VM moves, that is how long its guest was stopped as the host
//! saw it (the guest's own clock is set back to where it paused, so the
//! guest cannot see it).

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::heartbeat::boottime_ms;
use crate::{fail, num, open};

/// Stops this long or longer are listed with when they happened.
const LISTED_STOP: Duration = Duration::from_millis(20);
/// At most this many (the longest) are listed: the line stays bounded.
const MAX_LISTED: usize = 32;

pub fn run(path: &str, secs: &str, offset: &str) {
    let f = open(path, false);
    let offset: u64 = num(offset);
    let read = || {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, offset)
            .unwrap_or_else(|e| fail(format!("{path}: {e}")));
        u64::from_le_bytes(b)
    };
    let end = Instant::now() + Duration::from_secs(num(secs));
    let (mut last, mut since, mut max_gap, mut changes) =
        (read(), Instant::now(), Duration::ZERO, 0u64);
    let mut ended_at = boottime_ms();
    // (length, started at, ended at), boot-time ms.
    let mut stops: Vec<(Duration, u128, u128)> = Vec::new();
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
        let v = read();
        if v != last {
            let stopped = since.elapsed();
            let now = boottime_ms();
            if stopped > max_gap {
                max_gap = stopped;
                ended_at = now;
            }
            if stopped >= LISTED_STOP {
                stops.push((stopped, now.saturating_sub(stopped.as_millis()), now));
                if stops.len() > MAX_LISTED {
                    stops.sort_by_key(|s| std::cmp::Reverse(s.0));
                    stops.truncate(MAX_LISTED);
                }
            }
            last = v;
            since = Instant::now();
            changes += 1;
        }
    }
    stops.sort_by_key(|s| s.1);
    let listed: Vec<String> = stops.iter().map(|(_, s, e)| format!("{s}-{e}")).collect();
    println!(
        "max_gap_ms={} changes={changes} ended_at_ms={ended_at} stops={}",
        max_gap.as_millis(),
        listed.join(",")
    );
}
