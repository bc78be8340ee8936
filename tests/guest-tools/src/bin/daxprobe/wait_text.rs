//! `daxprobe wait-text FILE TEXT SECONDS` (run in the VMM's host): when
//! TEXT first appears in FILE (a guest's serial output the VMM appends
//! to), looked for every 5 ms without starting a process per look, so
//! the watch takes little from a guest booting on the same CPU. Prints
//! `at_ms=N`, N on the clock of /proc/uptime (CLOCK_BOOTTIME) in
//! milliseconds, or `at_ms=timeout` after SECONDS (exit 1).

use std::io::{Read, Seek, SeekFrom};
use std::time::{Duration, Instant};

use super::heartbeat::boottime_ms;
use super::{fail, num};

/// Whether `text` is in `seen` once `new` is appended; keeps only the
/// tail that a later match could start in.
fn found_in(seen: &mut Vec<u8>, new: &[u8], text: &[u8]) -> bool {
    seen.extend_from_slice(new);
    if seen.windows(text.len().max(1)).any(|w| w == text) {
        return true;
    }
    let keep = text.len().saturating_sub(1).min(seen.len());
    seen.drain(..seen.len() - keep);
    false
}

pub fn run(path: &str, text: &str, secs: &str) {
    let deadline = Instant::now() + Duration::from_secs(num(secs));
    let mut file = std::fs::File::open(path).unwrap_or_else(|e| fail(format!("{path}: {e}")));
    let (mut seen, mut at) = (Vec::new(), 0u64);
    let mut buf = vec![0u8; 64 * 1024];
    while Instant::now() < deadline {
        // The VMM may have truncated and rewritten the file: start over.
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < at {
            at = 0;
            seen.clear();
        }
        file.seek(SeekFrom::Start(at))
            .unwrap_or_else(|e| fail(format!("{path}: {e}")));
        loop {
            let n = file
                .read(&mut buf)
                .unwrap_or_else(|e| fail(format!("{path}: {e}")));
            if n == 0 {
                break;
            }
            at += n as u64;
            if found_in(&mut seen, &buf[..n], text.as_bytes()) {
                println!("at_ms={}", boottime_ms());
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("at_ms=timeout");
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::found_in;

    #[test]
    fn text_split_across_reads_is_found() {
        let mut seen = Vec::new();
        assert!(!found_in(&mut seen, b"noise @@GU", b"@@GUEST init"));
        assert!(found_in(&mut seen, b"EST init uptime=1.2", b"@@GUEST init"));
        let mut seen = Vec::new();
        assert!(!found_in(&mut seen, b"@@GUEST ini", b"@@GUEST init"));
        assert_eq!(
            seen.len(),
            11,
            "only what a later match could start in is kept"
        );
        assert!(!found_in(&mut seen, b"x", b"@@GUEST init"));
    }
}
