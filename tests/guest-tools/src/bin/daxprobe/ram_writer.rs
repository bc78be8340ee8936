//! `daxprobe ram-writer MIB PERIOD_MS STATUS SECONDS` (guest): a writer to
//! the guest's RAM whose every page a migration must carry. It maps MIB
//! MiB of anonymous memory and, every PERIOD_MS for SECONDS, first checks
//! that every page still holds what the previous pass wrote, then writes
//! the next pass's pattern over all of it (each 8-byte word a function of
//! the pass, the page and the word, so a page left at an older pass, or
//! one copied while half written and not sent again, shows). A page that
//! does not hold the previous pass's pattern is counted and the first few
//! are printed (`@@GUEST ram_bad pass=P page=I word=W found=X`). After each
//! pass it replaces STATUS with `passes=N bad_pages=M`, which the guest's
//! script reads after a move; the loop keeps the pages dirty while the VMM
//! pre-copies them.

use std::time::{Duration, Instant};

use crate::{fail, num};

const PAGE_WORDS: usize = 4096 / 8;
/// Bad pages printed one by one; the rest are only counted.
const PRINTED: u64 = 5;

/// The word `w` of page `page` after pass `pass`.
fn pattern(pass: u64, page: usize, w: usize) -> u64 {
    let at = u64::try_from(page * PAGE_WORDS + w).unwrap_or(u64::MAX);
    pass.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ at
}

pub fn run(mib: &str, period_ms: &str, status: &str, secs: &str) {
    let mib: usize = num(mib);
    if mib == 0 || mib > 1024 {
        fail(format!("ram-writer: MIB {mib} outside 1..=1024"));
    }
    let period = Duration::from_millis(num(period_ms));
    let until = Instant::now() + Duration::from_secs(num(secs));
    let len = mib << 20;
    // SAFETY: a fresh private anonymous mapping, checked below; nothing
    // else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        fail(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let words = p.cast::<u64>();
    let pages = len / 4096;
    let tmp = format!("{status}.tmp");
    let (mut pass, mut bad) = (0u64, 0u64);
    while Instant::now() < until {
        if pass > 0 {
            for page in 0..pages {
                for w in 0..PAGE_WORDS {
                    // SAFETY: page * PAGE_WORDS + w < len / 8, inside the
                    // mapping; volatile, so every pass really reads RAM.
                    let found = unsafe { words.add(page * PAGE_WORDS + w).read_volatile() };
                    if found != pattern(pass, page, w) {
                        bad += 1;
                        if bad <= PRINTED {
                            println!(
                                "@@GUEST ram_bad pass={pass} page={page} word={w} found={found:#x}"
                            );
                        }
                        break;
                    }
                }
            }
        }
        pass += 1;
        for page in 0..pages {
            for w in 0..PAGE_WORDS {
                // SAFETY: as above, inside the mapping.
                unsafe {
                    words
                        .add(page * PAGE_WORDS + w)
                        .write_volatile(pattern(pass, page, w))
                };
            }
        }
        let line = format!("passes={pass} bad_pages={bad}\n");
        if std::fs::write(&tmp, line)
            .and_then(|()| std::fs::rename(&tmp, status))
            .is_err()
        {
            fail(format!("ram-writer: writing {status}"));
        }
        std::thread::sleep(period);
    }
}
