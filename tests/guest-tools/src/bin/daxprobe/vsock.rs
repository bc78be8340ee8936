//! Both ends of the vsock guest test:
//!
//! ```text
//! daxprobe vsock-serve PORT REPLY_BYTES COUNT  guest: accepts COUNT AF_VSOCK connections on PORT,
//!                                            serving them at once (one thread each)
//! daxprobe unix-serve PATH REPLY_BYTES       host: accepts one connection on the unix listener PATH
//! daxprobe vsock-connect CID PORT BYTES      guest: connects to CID:PORT over AF_VSOCK
//! daxprobe hybrid-connect SOCKET PORT BYTES  host: connects to the VMM's hybrid socket and asks
//!                                            for the guest's PORT (`CONNECT PORT` / `OK <port>`)
//! ```
//!
//! A client writes BYTES of its pattern, shuts down its sending half and
//! reads the reply to EOF; a server reads to EOF, then writes REPLY_BYTES
//! of its own pattern and closes. Each side checks what it read against
//! the other's pattern and prints one line:
//! `sent=N received=M match=1|0` (plus `ok_port=P` for hybrid-connect; a
//! server prints one line per connection).
//! A hybrid-connect whose request the VMM or the guest refused (EOF
//! before `OK`) exits 2, so a script can retry until the guest listens.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};

use super::{fail, num};

/// Byte `i` of what a client sends.
fn client_byte(i: u64) -> u8 {
    ((i * 7 + 3) % 251) as u8
}

/// Byte `i` of what a server sends.
fn server_byte(i: u64) -> u8 {
    ((i * 13 + 5) % 251) as u8
}

/// Writes `len` bytes of `pattern` in 64 KiB pieces.
fn send_pattern(s: &mut impl Write, len: u64, pattern: fn(u64) -> u8) -> u64 {
    let mut sent = 0;
    let mut buf = vec![0u8; 64 * 1024];
    while sent < len {
        let n = buf
            .len()
            .min(usize::try_from(len - sent).unwrap_or(usize::MAX));
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(sent + i as u64);
        }
        s.write_all(&buf[..n])
            .unwrap_or_else(|e| fail(format!("write after {sent} bytes: {e}")));
        sent += n as u64;
    }
    sent
}

/// Reads to EOF; returns the count and whether every byte was `pattern`'s.
fn receive_pattern(s: &mut impl Read, pattern: fn(u64) -> u8) -> (u64, bool) {
    let mut got = 0u64;
    let mut matches = true;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => return (got, matches),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => fail(format!("read after {got} bytes: {e}")),
        };
        matches &= buf[..n]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern(got + i as u64));
        got += n as u64;
    }
}

fn shutdown_write(fd: &impl AsRawFd) {
    // SAFETY: shutdown on an fd this process owns; no memory involved.
    if unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_WR) } != 0 {
        fail(format!("shutdown: {}", std::io::Error::last_os_error()));
    }
}

pub(super) fn client(s: &mut (impl Read + Write + AsRawFd), bytes: u64) -> String {
    let sent = send_pattern(s, bytes, client_byte);
    shutdown_write(s);
    let (received, ok) = receive_pattern(s, server_byte);
    format!("sent={sent} received={received} match={}", u8::from(ok))
}

fn server(s: &mut (impl Read + Write), reply: u64) -> String {
    let (received, ok) = receive_pattern(s, client_byte);
    let sent = send_pattern(s, reply, server_byte);
    format!("sent={sent} received={received} match={}", u8::from(ok))
}

fn vsock_socket() -> File {
    // SAFETY: integer arguments; the fd is owned right below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        fail(format!(
            "socket(AF_VSOCK): {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh fd nothing else owns.
    File::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn vsock_addr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain data; zeroed is valid.
    let mut a: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    a.svm_family = libc::sa_family_t::try_from(libc::AF_VSOCK).expect("AF_VSOCK fits sa_family_t");
    a.svm_cid = cid;
    a.svm_port = port;
    a
}

#[expect(clippy::cast_possible_truncation, reason = "a sockaddr_vm is 16 bytes")]
const VM_ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

pub fn vsock_serve(port: &str, reply: &str, count: &str) {
    let s = vsock_socket();
    let addr = vsock_addr(libc::VMADDR_CID_ANY, num(port));
    // SAFETY: `addr` is a valid sockaddr_vm of the length given.
    let bound = unsafe { libc::bind(s.as_raw_fd(), std::ptr::addr_of!(addr).cast(), VM_ADDR_LEN) };
    // SAFETY: listen on an fd this process owns.
    if bound != 0 || unsafe { libc::listen(s.as_raw_fd(), 4) } != 0 {
        fail(format!(
            "bind/listen vsock port {port}: {}",
            std::io::Error::last_os_error()
        ));
    }
    eprintln!("daxprobe: listening on vsock port {port}");
    let reply = num(reply);
    let servers: Vec<_> = (0..num(count))
        .map(|_| {
            // SAFETY: accept without a peer address; the fd is owned right below.
            let fd = unsafe {
                libc::accept4(
                    s.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                fail(format!("accept: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: a fresh fd nothing else owns.
            let mut conn = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            std::thread::spawn(move || println!("{}", server(&mut conn, reply)))
        })
        .collect();
    for t in servers {
        let _ = t.join();
    }
}

pub fn vsock_connect(cid: &str, port: &str, bytes: &str) {
    let mut s = vsock_socket();
    let addr = vsock_addr(num(cid), num(port));
    // SAFETY: `addr` is a valid sockaddr_vm of the length given.
    if unsafe { libc::connect(s.as_raw_fd(), std::ptr::addr_of!(addr).cast(), VM_ADDR_LEN) } != 0 {
        fail(format!(
            "connect vsock {cid}:{port}: {}",
            std::io::Error::last_os_error()
        ));
    }
    println!("{}", client(&mut s, num(bytes)));
}

pub fn unix_serve(path: &str, reply: &str) {
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path).unwrap_or_else(|e| fail(format!("bind {path}: {e}")));
    let (mut conn, _) = l.accept().unwrap_or_else(|e| fail(format!("accept: {e}")));
    println!("{}", server(&mut conn, num(reply)));
}

pub fn hybrid_connect(socket: &str, port: &str, bytes: &str) {
    let mut s = UnixStream::connect(socket).unwrap_or_else(|e| {
        eprintln!("daxprobe: connect {socket}: {e}");
        std::process::exit(2)
    });
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .unwrap_or_else(|e| fail(format!("write: {e}")));
    // The reply line, a byte at a time: what follows it is the stream.
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        match s.read(&mut byte) {
            Ok(1) if line.len() < 64 => line.push(byte[0]),
            _ => {
                eprintln!(
                    "daxprobe: no OK line (got {:?})",
                    String::from_utf8_lossy(&line)
                );
                std::process::exit(2)
            }
        }
    }
    let text = String::from_utf8_lossy(&line);
    let Some(ok_port) = text.trim_end().strip_prefix("OK ") else {
        fail(format!("expected OK <port>, got {text:?}"))
    };
    let ok_port = ok_port.to_string();
    println!("ok_port={ok_port} {}", client(&mut s, num(bytes)));
}
