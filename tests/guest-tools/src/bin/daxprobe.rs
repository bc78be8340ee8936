//! `daxprobe`: the guest-side tool of the rig, built static and put in the
//! guest's initramfs: what busybox cannot do on a DAX share.
//!
//! ```text
//! daxprobe statx PATH...                 one line: PATH:1 (STATX_ATTR_DAX set) or PATH:0 each
//! daxprobe mmap-copy SRC DST             copies SRC to DST reading SRC through a shared mmap
//! daxprobe mmap-fill PATH OFFSET LEN BYTE  fills a range through a shared writable mmap, msyncs
//! daxprobe mmap-scan PATH SECONDS          maps PATH once and reads all of it again and again;
//!                                        prints "passes=N changed=M" (M: passes whose
//!                                        checksum differed from the first); says
//!                                        "first pass done" on stderr once all is mapped
//! daxprobe mmap-counter COUNTER CHECK SECONDS  advances a u64 in COUNTER through a shared
//!                                        writable mapping every ~10 ms and checksums CHECK's
//!                                        mapping once a second (daxprobe/mmap_counter.rs)
//! daxprobe counter-gap PATH SECONDS [OFFSET]  (host) the longest time mmap-counter's value in
//!                                        PATH (or ram-counter's at OFFSET) stood still
//!                                        (daxprobe/counter_gap.rs)
//! daxprobe counter-handover SRC_PID DST_PID BYTES OFFSET SECONDS  (host) a migration's downtime
//!                                        from ram-counter's value in the source's and then the
//!                                        destination's RAM memfd (daxprobe/counter_handover.rs)
//! daxprobe proc-cost SHARE_DIR PID...  (host) memory (own, guest RAM, share file pages) and
//!                                        threads of the PIDs and their descendants, summed, one
//!                                        line (daxprobe/proc_cost.rs, test_infra::proc_cost)
//! daxprobe wait-text FILE TEXT SECONDS  (host) when TEXT first appears in FILE, polled every
//!                                        5 ms: "at_ms=N" on /proc/uptime's clock (daxprobe/wait_text.rs)
//! daxprobe ram-counter SECONDS           a heartbeat in the guest's RAM the host reads, and the
//!                                        guest clocks' gaps (daxprobe/heartbeat.rs)
//! daxprobe ram-writer MIB PERIOD_MS STATUS SECONDS  rewrites MIB MiB of RAM every PERIOD_MS,
//!                                        checking first that the last pass is still there; writes
//!                                        "passes=N bad_pages=M" to STATUS (daxprobe/ram_writer.rs)
//! daxprobe counter-moves PATH OFFSET SECONDS  (host) when ram-counter's value at OFFSET of PATH
//!                                        moves again (daxprobe/heartbeat.rs)
//! daxprobe mmap-busy PATH SECONDS        keeps every 2 MiB range of PATH mapped and written
//!                                        (daxprobe/mmap_busy.rs)
//! daxprobe mmap-truncated PATH READY GO   maps PATH, reads it all, creates READY, waits
//!                                        (60 s at most) for GO to exist (the host has cut the
//!                                        file meanwhile), then a child reads every page again
//!                                        through the same mapping; prints "zeros=N data=M" or
//!                                        "sigbus" (the child was killed by SIGBUS)
//! daxprobe mmap-truncated-rw PATH OFFSET READY GO  the same for the page at OFFSET of a writable
//!                                        mapping, then read and written by a forked child and by
//!                                        a new mapping; a line per step (daxprobe/truncated_rw.rs)
//! daxprobe window-io MAP SRC OUT OFFSET LEN direct|buffered
//!                                        read() SRC into a shared mapping of MAP, write() it
//!                                        from there to OUT (see daxprobe/window_io.rs)
//! daxprobe bench PATH seq|rand|mmap BLOCK_KIB TOTAL_MIB   reads, prints MiB/s
//! daxprobe mktree DIR DIRS FILES         writes a source-tree-like share: DIRS directories of
//!                                        FILES files, 97 % of 1-12 KiB and 3 % of 64-320 KiB
//!                                        (fixed seed); prints "files=N bytes=M over_32k=K"
//! daxprobe readtree DIR                  reads every file under DIR (open, read all, close);
//!                                        prints "files=N bytes=M secs=S mib_per_s=R"
//! daxprobe http SOCKET METHOD PATH [BODY]  one HTTP/1.1 request on a unix socket; prints
//!                                        "status=N body=..." on one line (exit 1 unless 2xx)
//! daxprobe sse SOCKET PATH                 subscribes to server-sent events; when the stream
//!                                        ends prints the count of each kind ("map=N unmap=M")
//! daxprobe roundtrip DAX_FILE FUSE_FILE PASSES  cold first touch per 2 MiB range (one
//!                                        SETUPMAPPING) against 4 KiB O_DIRECT preads (one
//!                                        FUSE READ); prints median/p90 µs (daxprobe/roundtrip.rs)
//! daxprobe kata-replay SOCKET SCRIPT   Kata's sandbox start, as its Go runtime sends it, on one
//!                                        kept-alive connection; prints "@@HOST kata_<step>=..."
//!                                        per request (see daxprobe/kata_replay.rs)
//! daxprobe kata-rs-replay SOCKET SCRIPT  the same as Kata's Rust runtime sends it (one connection
//!                                        for the sandbox's life; daxprobe/kata_rs_replay.rs)
//! daxprobe listen-exec SOCKET PROG ARGS...  binds and listens on SOCKET, then execs PROG with it
//!                                        as fd 3, as Kata starts its virtio-fs daemon
//!                                        (daxprobe/listen_exec.rs)
//! daxprobe tap-exec TAP PROG ARGS...     opens (creating) the multiqueue tap TAP, then execs
//!                                        PROG with it as fd 3 (daxprobe/listen_exec.rs)
//! daxprobe power-button                  waits for the ACPI power button's KEY_POWER (evdev);
//!                                        prints "pressed" (exit 0)
//! daxprobe vsock-serve|vsock-connect|unix-serve|hybrid-connect ...
//!                                        both ends of a vsock connection, guest (AF_VSOCK) and
//!                                        host (the VMM's hybrid unix socket); see daxprobe/vsock.rs
//! daxprobe virtio-hostile pci|mmio SERIAL MARKER
//!                                        unbinds the kernel's driver from the virtio-blk disk SERIAL
//!                                        and drives it through its registers as a hostile driver:
//!                                        an impossible available index, resets (daxprobe/hostile.rs)
//! ```
//!
//! `statx` forces a GETATTR (`AT_STATX_FORCE_SYNC`), so it sees what the
//! server says now rather than what the guest cached.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::time::Instant;

#[path = "daxprobe/counter_gap.rs"]
mod counter_gap;
#[path = "daxprobe/counter_handover.rs"]
mod counter_handover;
#[path = "daxprobe/cpu_time.rs"]
mod cpu_time;
#[path = "daxprobe/heartbeat.rs"]
mod heartbeat;
#[path = "daxprobe/hostile.rs"]
mod hostile;
#[path = "daxprobe/kata_net.rs"]
mod kata_net;
#[path = "daxprobe/kata_replay.rs"]
mod kata_replay;
#[path = "daxprobe/kata_rs_replay.rs"]
mod kata_rs_replay;
#[path = "daxprobe/listen_exec.rs"]
mod listen_exec;
#[path = "daxprobe/mmap_busy.rs"]
mod mmap_busy;
#[path = "daxprobe/mmap_counter.rs"]
mod mmap_counter;
#[path = "daxprobe/proc_cost.rs"]
mod proc_cost;
#[path = "daxprobe/ram_writer.rs"]
mod ram_writer;
#[path = "daxprobe/truncated_rw.rs"]
mod truncated_rw;
#[path = "daxprobe/vsock.rs"]
mod vsock;
#[path = "daxprobe/wait_text.rs"]
mod wait_text;
#[path = "daxprobe/window_io.rs"]
mod window_io;

/// `STATX_ATTR_DAX` from linux/stat.h.
const STATX_ATTR_DAX: u64 = 0x0020_0000;

fn fail(msg: String) -> ! {
    eprintln!("daxprobe: {msg}");
    std::process::exit(1)
}

/// An argument as a number of the type it is used as (a length is a
/// `usize`, a port a `u32`), so an out-of-range one fails here by name.
fn num<T: std::str::FromStr>(s: &str) -> T {
    s.parse()
        .unwrap_or_else(|_| fail(format!("{s:?} is not a number in range")))
}

/// A file's length as the `usize` a mapping of it needs (0 if unknown).
fn file_len(f: &std::fs::File) -> usize {
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    usize::try_from(len).unwrap_or_else(|_| fail(format!("a file of {len} bytes cannot be mapped")))
}

fn statx_dax(path: &str) -> bool {
    let c = CString::new(std::path::Path::new(path).as_os_str().as_bytes())
        .unwrap_or_else(|_| fail("bad path".into()));
    // SAFETY: all-zero is a valid statx for the call to overwrite.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a writable statx.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut st,
        )
    };
    if r != 0 {
        fail(format!("statx {path}: {}", std::io::Error::last_os_error()));
    }
    st.stx_attributes & STATX_ATTR_DAX != 0
}

/// A shared mapping of a whole file, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(file: &File, len: usize, writable: bool) -> Mapping {
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping of an open file; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            fail(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Mapping { ptr: p.cast(), len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Waits until `path` exists, looking every `look`, at most `within`;
/// false if it never came.
fn wait_for_file(
    path: &std::path::Path,
    within: std::time::Duration,
    look: std::time::Duration,
) -> bool {
    let deadline = Instant::now() + within;
    while !path.exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(look);
    }
    true
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Touches every page of a DAX mapping whose file the host cuts short
/// meanwhile: the guest's page tables still point into the window, so the
/// touch reaches the VMM's mapping of pages that no longer exist.
fn mmap_truncated(path: &str, ready: &str, go: &str) {
    let f = open(path, false);
    let len = file_len(&f);
    if len == 0 {
        fail(format!("{path} is empty"));
    }
    let m = Mapping::new(&f, len, false);
    let first: u64 = m.bytes().iter().step_by(4096).map(|&b| u64::from(b)).sum();
    File::create(ready).unwrap_or_else(|e| fail(format!("{ready}: {e}")));
    // Goes on after a minute either way.
    let _ = wait_for_file(
        std::path::Path::new(go),
        std::time::Duration::from_secs(60),
        std::time::Duration::from_millis(50),
    );
    // SAFETY: fork in a single-threaded program; the child only reads the
    // mapping it inherited and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let (mut zeros, mut data) = (0u64, 0u64);
        for page in m.bytes().chunks(4096) {
            if page.iter().all(|&b| b == 0) {
                zeros += 1;
            } else {
                data += 1;
            }
        }
        println!("zeros={zeros} data={data} first_sum={first}");
        let _ = std::io::stdout().flush();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFSIGNALED(status) {
        println!("sigbus={}", libc::WTERMSIG(status) == libc::SIGBUS);
    }
}

fn open(path: &str, write: bool) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .unwrap_or_else(|e| fail(format!("{path}: {e}")))
}

fn bench(path: &str, mode: &str, block_kib: usize, total_mib: u64) {
    let file = open(path, false);
    let size = file_len(&file);
    let block = block_kib
        .checked_mul(1024)
        .unwrap_or_else(|| fail(format!("{block_kib} KiB blocks are too large")));
    let total = total_mib << 20;
    if block == 0 || size < block {
        fail(format!("{path} is smaller than one block"));
    }
    let blocks = size / block;
    let mut buf = vec![0u8; block];
    let mut sum = 0u64;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let start = Instant::now();
    let mut done = 0u64;
    let map = (mode == "mmap").then(|| Mapping::new(&file, size, false));
    let mut i = 0usize;
    while done < total {
        let idx = match mode {
            "rand" | "mmap" => {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                usize::try_from(seed % blocks as u64).expect("an index below the block count")
            }
            _ => i % blocks,
        };
        let off = idx * block;
        match &map {
            Some(m) => {
                // Touch every 4 KiB page of the block.
                let b = &m.bytes()[off..off + block];
                sum = b
                    .iter()
                    .step_by(4096)
                    .fold(sum, |a, &x| a.wrapping_add(u64::from(x)));
            }
            None => {
                file.read_exact_at(&mut buf, off as u64)
                    .unwrap_or_else(|e| fail(format!("pread: {e}")));
                sum = sum.wrapping_add(u64::from(buf[0]));
            }
        }
        done += block as u64;
        i += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "mib_per_s={:.1} bytes={done} secs={secs:.3} sum={sum}",
        done as f64 / (1 << 20) as f64 / secs
    );
}

/// xorshift64: the same sequence on every run.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn mktree(dir: &str, dirs: u64, files: u64) {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let (mut count, mut bytes, mut over) = (0u64, 0u64, 0u64);
    for d in 0..dirs {
        let sub = format!("{dir}/d{d}");
        std::fs::create_dir_all(&sub).unwrap_or_else(|e| fail(format!("{sub}: {e}")));
        for f in 0..files {
            let size = if next(&mut seed) % 100 < 3 {
                (64 + next(&mut seed) % 257) << 10
            } else {
                (1 + next(&mut seed) % 12) << 10
            };
            let fill = next(&mut seed).to_le_bytes()[0];
            let path = format!("{sub}/f{f}.c");
            std::fs::write(
                &path,
                vec![fill; usize::try_from(size).expect("a file under 321 KiB")],
            )
            .unwrap_or_else(|e| fail(format!("{path}: {e}")));
            count += 1;
            bytes += size;
            over += u64::from(size > 32 << 10);
        }
    }
    println!("files={count} bytes={bytes} over_32k={over}");
}

fn readtree(dir: &str) {
    fn walk(dir: &std::path::Path, files: &mut u64, bytes: &mut u64) {
        let entries =
            std::fs::read_dir(dir).unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        for e in entries.flatten() {
            let path = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&path, files, bytes),
                Ok(t) if t.is_file() => {
                    let data = std::fs::read(&path)
                        .unwrap_or_else(|e| fail(format!("{}: {e}", path.display())));
                    *files += 1;
                    *bytes += data.len() as u64;
                }
                _ => {}
            }
        }
    }
    let (mut files, mut bytes) = (0, 0);
    let start = Instant::now();
    walk(std::path::Path::new(dir), &mut files, &mut bytes);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "files={files} bytes={bytes} secs={secs:.3} mib_per_s={:.1}",
        bytes as f64 / (1 << 20) as f64 / secs
    );
}

fn http(socket: &str, method: &str, path: &str, body: &str) {
    use std::io::Read;
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    // Up to the end of the body its Content-Length gives (Cloud
    // Hypervisor keeps the connection open despite `Connection: close`),
    // or to the end of the stream without one.
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s
            .read(&mut buf)
            .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
        raw.extend_from_slice(&buf[..n]);
        if n == 0 || http_complete(&raw) {
            break;
        }
    }
    let out = String::from_utf8_lossy(&raw).into_owned();
    let status: u16 = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let reply = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .replace('\n', " ");
    println!("status={status} body={}", reply.trim());
    if !(200..300).contains(&status) {
        std::process::exit(1);
    }
}

/// Subscribes to a server-sent event stream and, when it ends, prints how
/// many events of each kind arrived (`map=12 unmap=3 …`).
/// A response whose headers and Content-Length bytes of body are all in.
fn http_complete(raw: &[u8]) -> bool {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    // 204 and 304 carry no body, and Cloud Hypervisor sends them no length.
    if head.starts_with("http/1.1 204") || head.starts_with("http/1.1 304") {
        return true;
    }
    head.lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|len| raw.len() >= end + 4 + len)
}

fn sse_counts(socket: &str, path: &str) {
    use std::io::BufRead;
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    let mut counts: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for line in std::io::BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        if let Some(kind) = line.strip_prefix("event: ") {
            *counts.entry(kind.trim().to_string()).or_default() += 1;
        }
    }
    let out: Vec<String> = counts.iter().map(|(k, n)| format!("{k}={n}")).collect();
    println!("{}", out.join(" "));
}

/// Waits for KEY_POWER from the input device named "Power Button" (the
/// ACPI button driver's), as systemd-logind or acpid would.
fn power_button() {
    const EV_KEY: u16 = 1;
    const KEY_POWER: u16 = 116;
    let device = (0..32)
        .find(|i| {
            std::fs::read_to_string(format!("/sys/class/input/event{i}/device/name"))
                .is_ok_and(|n| n.contains("Power Button"))
        })
        .unwrap_or_else(|| {
            fail(
                "no input device named \"Power Button\" (are the button and evdev modules loaded?)"
                    .into(),
            )
        });
    let mut f = File::open(format!("/dev/input/event{device}"))
        .unwrap_or_else(|e| fail(format!("/dev/input/event{device}: {e}")));
    println!("armed event{device}");
    // struct input_event on x86-64: a 16-byte timeval, type, code, value.
    let mut ev = [0u8; 24];
    loop {
        use std::io::Read;
        f.read_exact(&mut ev)
            .unwrap_or_else(|e| fail(format!("reading event{device}: {e}")));
        let kind = u16::from_ne_bytes([ev[16], ev[17]]);
        let code = u16::from_ne_bytes([ev[18], ev[19]]);
        let value = i32::from_ne_bytes([ev[20], ev[21], ev[22], ev[23]]);
        if kind == EV_KEY && code == KEY_POWER && value == 1 {
            println!("pressed");
            return;
        }
    }
}

#[path = "daxprobe/roundtrip.rs"]
mod roundtrip;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["statx", paths @ ..] => {
            let out: Vec<String> = paths.iter().map(|p| format!("{p}:{}", u8::from(statx_dax(p)))).collect();
            println!("{}", out.join(" "));
        }
        ["mmap-copy", src, dst] => {
            let f = open(src, false);
            let len = file_len(&f);
            let mut out = File::create(dst).unwrap_or_else(|e| fail(format!("{dst}: {e}")));
            if len > 0 {
                let m = Mapping::new(&f, len, false);
                out.write_all(m.bytes()).unwrap_or_else(|e| fail(format!("{dst}: {e}")));
            }
        }
        ["mmap-fill", path, off, len, byte] => {
            let f = open(path, true);
            let size = file_len(&f);
            let (off, len, byte): (usize, usize, u8) = (num(off), num(len), num(byte));
            if off + len > size {
                fail(format!("{off}+{len} is past the end of {path} ({size} bytes)"));
            }
            let m = Mapping::new(&f, size, true);
            // SAFETY: the range is inside the writable mapping (checked above).
            unsafe { std::ptr::write_bytes(m.ptr.add(off), byte, len) };
            // SAFETY: msync of our own mapping.
            if unsafe { libc::msync(m.ptr.cast(), size, libc::MS_SYNC) } != 0 {
                fail(format!("msync: {}", std::io::Error::last_os_error()));
            }
        }
        ["mmap-scan", path, secs] => {
            let f = open(path, false);
            let len = file_len(&f);
            if len == 0 {
                fail(format!("{path} is empty"));
            }
            let m = Mapping::new(&f, len, false);
            let sum = |b: &[u8]| {
                b.chunks(8)
                    .fold(0u64, |a, c| a.rotate_left(5) ^ c.iter().fold(0, |x, &y| x << 8 | u64::from(y)))
            };
            let first = sum(m.bytes());
            // Whoever waits for the scan to be under way (all pages faulted in).
            eprintln!("first pass done");
            let end = std::time::Instant::now() + std::time::Duration::from_secs(num(secs));
            let (mut passes, mut changed) = (1u64, 0u64);
            while std::time::Instant::now() < end {
                passes += 1;
                changed += u64::from(sum(m.bytes()) != first);
            }
            println!("passes={passes} changed={changed}");
        }
        ["counter-gap", path, secs] => counter_gap::run(path, secs, "0"),
        ["counter-gap", path, secs, offset] => counter_gap::run(path, secs, offset),
        ["counter-handover", src, dst, bytes, offset, secs] => counter_handover::run(src, dst, bytes, offset, secs),
        ["proc-cost", share_dir, pids @ ..] if !pids.is_empty() => proc_cost::run(share_dir, pids),
        ["wait-text", path, text, secs] => wait_text::run(path, text, secs),
        ["ram-counter", secs] => heartbeat::ram_counter(secs),
        ["ram-writer", mib, period_ms, status, secs] => ram_writer::run(mib, period_ms, status, secs),
        ["counter-moves", path, offset, secs] => heartbeat::counter_moves(path, offset, secs),
        ["mmap-busy", path, secs] => mmap_busy::run(path, secs),
        ["mmap-counter", counter, check, secs] => mmap_counter::run(counter, check, secs),
        ["mmap-truncated", path, ready, go] => mmap_truncated(path, ready, go),
        ["mmap-truncated-rw", path, offset, ready, go] => truncated_rw::run(path, offset, ready, go),
        ["window-io", map, src, out, off, len, mode] => window_io::window_io(map, src, out, off, len, mode),
        ["bench", path, mode @ ("seq" | "rand" | "mmap"), block_kib, total_mib] => bench(path, mode, num(block_kib), num(total_mib)),
        ["mktree", dir, dirs, files] => mktree(dir, num(dirs), num(files)),
        ["readtree", dir] => readtree(dir),
        ["roundtrip", dax_file, fuse_file, passes] => roundtrip::run(dax_file, fuse_file, num(passes)),
        ["roundtrip-maps", dax_file] => roundtrip::maps_once(dax_file),
        ["roundtrip-reads", fuse_file, count] => roundtrip::reads_once(fuse_file, num(count)),
        ["cpu-marks", dir, marks @ ..] if !marks.is_empty() => cpu_time::marks(dir, marks),
        ["mark", dir, mark] => cpu_time::mark(dir, mark),
        ["http", socket, method, path] => http(socket, method, path, ""),
        ["http", socket, method, path, body] => http(socket, method, path, body),
        ["sse", socket, path] => sse_counts(socket, path),
        ["kata-add-net", socket, tap, body] => kata_net::add_net(socket, tap, body),
        ["kata-replay", socket, script] => kata_replay::replay(socket, script),
        ["kata-rs-replay", socket, script] => kata_rs_replay::replay(socket, script),
        ["listen-exec", socket, prog, args @ ..] => listen_exec::listen_exec(socket, prog, args),
        ["tap-exec", tap, prog, args @ ..] => listen_exec::tap_exec(tap, prog, args),
        ["power-button"] => power_button(),
        ["vsock-serve", port, reply, count] => vsock::vsock_serve(port, reply, count),
        ["vsock-connect", cid, port, bytes] => vsock::vsock_connect(cid, port, bytes),
        ["unix-serve", path, reply] => vsock::unix_serve(path, reply),
        ["hybrid-connect", socket, port, bytes] => vsock::hybrid_connect(socket, port, bytes),
        ["virtio-hostile", transport, serial, marker] => hostile::run(transport, serial, marker),
        _ => fail("usage: see the source header (statx | mmap-copy | mmap-fill | mmap-scan | mmap-counter | counter-gap | counter-handover | proc-cost | wait-text | ram-counter | ram-writer | counter-moves | mmap-busy | mmap-truncated | mmap-truncated-rw | window-io | bench | mktree | readtree | http | sse | kata-add-net | kata-replay | kata-rs-replay | listen-exec | power-button | vsock-serve | vsock-connect | unix-serve | hybrid-connect | virtio-hostile)".into()),
    }
}
