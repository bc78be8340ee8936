//! `daxprobe mmap-counter COUNTER CHECK SECONDS`: the guest's side of the
//! snapshot and migration tests. It maps COUNTER shared and writable and
//! CHECK shared and read-only, both once, and for SECONDS (of guest time)
//! keeps the u64 at COUNTER's offset 0 advancing about every 10 ms, so the
//! host sees the guest's writes land in the file (through the DAX window,
//! with no FUSE request on the way) before and after the VM moves. Once a
//! second it checksums all of CHECK through its mapping and prints
//! `@@GUEST counter n=N check=ok|bad`: a window mapped again at another file
//! offset, or not at all, shows as `bad` or as a SIGBUS. At the end:
//! `@@GUEST counter_done n=N bad=B`.

use std::time::{Duration, Instant};

use crate::{fail, file_len, num, open, Mapping};

fn checksum(b: &[u8]) -> u64 {
    b.chunks(8).fold(0u64, |a, c| {
        a.rotate_left(5) ^ c.iter().fold(0, |x, &y| x << 8 | u64::from(y))
    })
}

pub fn run(counter: &str, check: &str, secs: &str) {
    let c = open(counter, true);
    if file_len(&c) < 8 {
        fail(format!(
            "{counter}: shorter than the 8 bytes of the counter"
        ));
    }
    let counter_map = Mapping::new(&c, 8, true);
    let k = open(check, false);
    let len = file_len(&k);
    if len == 0 {
        fail(format!("{check} is empty"));
    }
    let check_map = Mapping::new(&k, len, false);
    let first = checksum(check_map.bytes());
    let ptr = counter_map.ptr.cast::<u64>();
    let end = Instant::now() + Duration::from_secs(num(secs));
    let (mut n, mut bad, mut last_report) = (0u64, 0u64, Instant::now());
    // SAFETY: the mapping is at least 8 bytes, page-aligned, writable and
    // lives until the end of this function; volatile so every increment
    // is a store the host can see.
    let mut value = unsafe { ptr.read_volatile() };
    while Instant::now() < end {
        value = value.wrapping_add(1);
        // SAFETY: as above.
        unsafe { ptr.write_volatile(value) };
        n += 1;
        if last_report.elapsed() >= Duration::from_secs(1) {
            let ok = checksum(check_map.bytes()) == first;
            bad += u64::from(!ok);
            println!(
                "@@GUEST counter n={value} check={}",
                if ok { "ok" } else { "bad" }
            );
            last_report = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("@@GUEST counter_done n={n} bad={bad}");
}
