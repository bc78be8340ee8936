//! `daxprobe mmap-busy PATH SECONDS`: a guest process that keeps a busy
//! DAX window, for the snapshot and migration benchmark. It maps all of
//! PATH shared and writable, writes every page once (so each 2 MiB range
//! of the file is mapped in the window) and prints `@@GUEST busy_ready
//! ranges=N`; then for SECONDS it writes a u64 into a different page of
//! every 2 MiB range per pass, with a 2 ms pause between passes, and at
//! the end prints `@@GUEST busy_done passes=P`.

use std::time::{Duration, Instant};

use crate::{fail, file_len, num, open, Mapping};

const RANGE: usize = 2 << 20;
const PAGE: usize = 4096;

pub fn run(path: &str, secs: &str) {
    let f = open(path, true);
    let len = file_len(&f);
    if len < RANGE {
        fail(format!("{path}: shorter than one 2 MiB range"));
    }
    let map = Mapping::new(&f, len, true);
    for page in (0..len).step_by(PAGE) {
        // SAFETY: `page` is inside the writable mapping of `len` bytes.
        unsafe { map.ptr.add(page).write_volatile(1) };
    }
    let ranges = len / RANGE;
    println!("@@GUEST busy_ready ranges={ranges}");
    let end = Instant::now() + Duration::from_secs(num(secs));
    let mut passes = 0u64;
    while Instant::now() < end {
        passes += 1;
        let page = usize::try_from(passes).unwrap_or(0) % (RANGE / PAGE) * PAGE;
        for range in 0..ranges {
            // SAFETY: range * RANGE + page + 8 <= ranges * RANGE <= len, and
            // every page start is 8-byte aligned.
            unsafe {
                map.ptr
                    .add(range * RANGE + page)
                    .cast::<u64>()
                    .write_volatile(passes);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    println!("@@GUEST busy_done passes={passes}");
}
