//! `daxprobe counter-gap PATH SECONDS`: the host's side of the migration
//! test. Reads the u64 at PATH's offset 0 (the guest's `mmap-counter`)
//! about every millisecond for SECONDS and prints the longest time it
//! stood still, `max_gap_ms=N changes=M`: while a VM moves, that is how
//! long its guest was stopped as the host saw it (the guest's own clock is
//! set back to where it paused, so the guest cannot see it).

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::{fail, num, open};

pub fn run(path: &str, secs: &str) {
    let f = open(path, false);
    let read = || {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, 0)
            .unwrap_or_else(|e| fail(format!("{path}: {e}")));
        u64::from_le_bytes(b)
    };
    let end = Instant::now() + Duration::from_secs(num(secs));
    let (mut last, mut since, mut max_gap, mut changes) =
        (read(), Instant::now(), Duration::ZERO, 0u64);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
        let v = read();
        if v != last {
            max_gap = max_gap.max(since.elapsed());
            last = v;
            since = Instant::now();
            changes += 1;
        }
    }
    println!("max_gap_ms={} changes={changes}", max_gap.as_millis());
}
