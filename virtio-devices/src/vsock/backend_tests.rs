//! The backend against real unix sockets, with the test as the guest:
//! packets in through `on_guest_packet`, out through `next_packet`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use super::*;
use crate::vsock::connection::CONN_BUF;
use crate::vsock::packet::*;

const CID: u64 = 3;

struct Rig {
    dir: std::path::PathBuf,
    b: UnixBackend,
}

impl Rig {
    fn new(name: &str) -> Rig {
        let dir = std::env::temp_dir().join(format!("vsock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = UnixBackend::new(CID, &dir.join("v.sock")).unwrap();
        b.set_active(true);
        Rig { dir, b }
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.join("v.sock")
    }

    /// Serves the host side until `until` holds or a second passed.
    fn poll_until(&mut self, mut until: impl FnMut(&mut UnixBackend) -> bool) {
        let end = Instant::now() + Duration::from_secs(2);
        while !until(&mut self.b) {
            assert!(Instant::now() < end, "timed out");
            self.b.poll_host();
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Everything the guest is owed now (payloads up to `room` bytes).
    fn drain(&mut self, room: usize) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; room];
        while let Some((h, n)) = self.b.next_packet(&mut buf) {
            out.push((h, buf[..n].to_vec()));
        }
        out
    }

    fn send(&mut self, h: Header, data: &[u8]) {
        self.b.on_guest_packet(&h, data).unwrap();
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn guest(op: u16, src_port: u32, dst_port: u32, len: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 64 * 1024,
        fwd_cnt: 0,
    }
}

/// Host connects with CONNECT 1234; returns the stream, the guest's view
/// of the REQUEST, after answering it.
fn host_connect(r: &mut Rig, port: u32) -> (UnixStream, Header) {
    let mut s = UnixStream::connect(r.path()).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!(got.len(), 1);
    let req = got[0].0;
    assert_eq!(
        (req.op, req.src_cid, req.dst_cid, req.dst_port),
        (OP_REQUEST, HOST_CID, CID, port)
    );
    assert!(req.src_port >= 1 << 30, "an ephemeral host port");
    (s, req)
}

#[test]
fn host_to_guest_handshake_then_data_both_ways_and_close() {
    let mut r = Rig::new("h2g");
    let (mut s, req) = host_connect(&mut r, 1234);
    r.send(guest(OP_RESPONSE, 1234, req.src_port, 0), &[]);
    let mut line = String::new();
    let mut reader = BufReader::new(s.try_clone().unwrap());
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, format!("OK {}\n", req.src_port));
    // Host → guest.
    s.write_all(b"ping").unwrap();
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!(got[0].0.op, OP_RW);
    assert_eq!(got[0].1, b"ping");
    assert_eq!(got[0].0.buf_alloc, CONN_BUF);
    // Guest → host.
    r.send(guest(OP_RW, 1234, req.src_port, 4), b"pong");
    let mut buf = [0u8; 4];
    reader.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    // The host closes: the guest hears SHUTDOWN (both, after a hang-up),
    // answers RST, and the connection is gone.
    drop(reader);
    drop(s);
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    let shut = got
        .iter()
        .find(|(h, _)| h.op == OP_SHUTDOWN)
        .unwrap_or_else(|| panic!("{got:?}"));
    assert_eq!(shut.0.flags, SHUTDOWN_SEND | SHUTDOWN_RCV);
    r.send(guest(OP_RST, 1234, req.src_port, 0), &[]);
    assert_eq!(r.b.connection_count(), 0);
}

#[test]
fn data_after_the_connect_line_is_the_streams_first_bytes() {
    let mut r = Rig::new("early");
    let mut s = UnixStream::connect(r.path()).unwrap();
    s.write_all(b"CONNECT 7\nhello").unwrap();
    r.poll_until(|b| b.has_packet());
    let req = r.drain(4096)[0].0;
    r.send(guest(OP_RESPONSE, 7, req.src_port, 0), &[]);
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!((got[0].0.op, got[0].1.as_slice()), (OP_RW, &b"hello"[..]));
}

#[test]
fn bad_connect_lines_and_refused_requests_close_the_host_stream() {
    let mut r = Rig::new("badline");
    for line in [
        &b"CONNECT x\n"[..],
        b"HELLO 5\n",
        b"CONNECT 99999999999\n",
        &[b'9'; 40],
    ] {
        let mut s = UnixStream::connect(r.path()).unwrap();
        s.write_all(line).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        r.poll_until(|b| b.connection_count() == 1 || b.connection_count() == 0);
        let mut rest = Vec::new();
        // Serve until the stream is closed by the backend.
        for _ in 0..50 {
            r.b.poll_host();
            std::thread::sleep(Duration::from_millis(2));
        }
        // Closed: EOF, or a reset where bytes were left unread.
        assert!(
            matches!(s.read_to_end(&mut rest), Ok(0) | Err(_)),
            "{line:?}"
        );
        assert!(!r.b.has_packet());
    }
    // The guest refuses: the host stream ends without OK.
    let (mut s, req) = host_connect(&mut r, 1);
    r.send(guest(OP_RST, 1, req.src_port, 0), &[]);
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0);
    assert_eq!(r.b.connection_count(), 0);
}

#[test]
fn unanswered_requests_and_silent_hosts_time_out() {
    let mut r = Rig::new("timeout");
    let (mut s, _req) = host_connect(&mut r, 1);
    let _silent = UnixStream::connect(r.path()).unwrap();
    r.poll_until(|b| b.connection_count() == 2);
    r.b.expire(Instant::now() + HANDSHAKE_TIMEOUT + Duration::from_millis(1));
    assert_eq!(r.b.connection_count(), 1, "the line-less stream is gone");
    // The request is withdrawn with RST; the stream is closed.
    let got = r.drain(4096);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.op, OP_RST);
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0);
    assert_eq!(r.b.connection_count(), 0);
}

#[test]
fn guest_to_host_reaches_path_underscore_port() {
    let mut r = Rig::new("g2h");
    let listener = UnixListener::bind(format!("{}_5000", r.path().display())).unwrap();
    r.send(guest(OP_REQUEST, 40000, 5000, 0), &[]);
    let got = r.drain(4096);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].0.op, got[0].0.src_port, got[0].0.dst_port),
        (OP_RESPONSE, 5000, 40000)
    );
    let (mut host, _) = listener.accept().unwrap();
    r.send(guest(OP_RW, 40000, 5000, 3), b"abc");
    let mut buf = [0u8; 3];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"abc");
    host.write_all(b"xyz").unwrap();
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!((got[0].0.op, got[0].1.as_slice()), (OP_RW, &b"xyz"[..]));
    // The guest closes both halves: the host reads EOF, the guest hears RST.
    r.send(
        Header {
            flags: SHUTDOWN_RCV | SHUTDOWN_SEND,
            ..guest(OP_SHUTDOWN, 40000, 5000, 0)
        },
        &[],
    );
    let mut rest = Vec::new();
    assert_eq!(host.read_to_end(&mut rest).unwrap(), 0);
    let got = r.drain(4096);
    assert_eq!(got[0].0.op, OP_RST);
    assert_eq!(r.b.connection_count(), 0);
    // No listener on the port: RST.
    r.send(guest(OP_REQUEST, 40001, 5001, 0), &[]);
    let got = r.drain(4096);
    assert_eq!((got[0].0.op, got[0].0.dst_port), (OP_RST, 40001));
}

#[test]
fn unknown_connections_and_bad_packets_get_rst_wrong_cids_nothing() {
    let mut r = Rig::new("unknown");
    r.send(guest(OP_RW, 1, 2, 1), b"x");
    r.send(guest(OP_CREDIT_REQUEST, 1, 2, 0), &[]);
    r.send(guest(OP_RST, 1, 2, 0), &[]);
    let got = r.drain(4096);
    assert_eq!(got.len(), 2, "an RST is never answered");
    assert!(got
        .iter()
        .all(|(h, _)| h.op == OP_RST && h.dst_port == 1 && h.src_port == 2));
    let e = r.b.on_guest_packet(
        &Header {
            op: 42,
            ..guest(OP_RW, 1, 2, 0)
        },
        &[],
    );
    assert_eq!(e, Err(PacketError::Op(42)));
    assert_eq!(r.drain(4096).len(), 1);
    let e = r.b.on_guest_packet(
        &Header {
            src_cid: 9,
            ..guest(OP_RW, 1, 2, 0)
        },
        &[],
    );
    assert!(e.is_err());
    assert_eq!(r.drain(4096).len(), 0);
    // The RST backlog is bounded.
    for port in 0..(u32::try_from(MAX_PENDING_RESETS).unwrap() + 10) {
        r.send(guest(OP_RW, port, 2, 0), &[]);
    }
    assert_eq!(r.drain(4096).len(), MAX_PENDING_RESETS);
}

#[test]
fn a_guest_without_credit_stops_the_host_reads() {
    let mut r = Rig::new("credit");
    let (mut s, req) = host_connect(&mut r, 9);
    // The guest has 1000 bytes of buffer and has read nothing.
    r.send(
        Header {
            buf_alloc: 1000,
            ..guest(OP_RESPONSE, 9, req.src_port, 0)
        },
        &[],
    );
    s.set_nonblocking(true).unwrap();
    let chunk = vec![7u8; 64 * 1024];
    let mut written = 0;
    while let Ok(n) = s.write(&chunk) {
        written += n;
    }
    assert!(written > 100_000, "the host socket filled: {written}");
    let mut seen = 0;
    for _ in 0..20 {
        r.b.poll_host();
        seen += r.drain(4096).iter().map(|(_, d)| d.len()).sum::<usize>();
    }
    assert_eq!(seen, 1000, "no more than the guest's credit");
    // The guest read 600 bytes: 600 more may come.
    r.send(
        Header {
            buf_alloc: 1000,
            fwd_cnt: 600,
            ..guest(OP_CREDIT_UPDATE, 9, req.src_port, 0)
        },
        &[],
    );
    for _ in 0..20 {
        r.b.poll_host();
        seen += r.drain(4096).iter().map(|(_, d)| d.len()).sum::<usize>();
    }
    assert_eq!(seen, 1600);
}

#[test]
fn a_host_that_never_reads_holds_the_guest_to_its_credit() {
    let mut r = Rig::new("slowhost");
    let listener = UnixListener::bind(format!("{}_6000", r.path().display())).unwrap();
    r.send(guest(OP_REQUEST, 50, 6000, 0), &[]);
    r.drain(4096);
    let (_host, _) = listener.accept().unwrap();
    let data = vec![1u8; MAX_PAYLOAD as usize];
    // The host's socket takes some; the backend holds up to CONN_BUF more;
    // a guest that sends past that is reset, and nothing more is kept.
    let mut sent = 0u64;
    let mut reset = false;
    for _ in 0..200 {
        r.send(guest(OP_RW, 50, 6000, MAX_PAYLOAD), &data);
        sent += u64::from(MAX_PAYLOAD);
        let got = r.drain(4096);
        if got.iter().any(|(h, _)| h.op == OP_RST) {
            reset = true;
            break;
        }
        if let Some((_, (_, c))) = r.b.conns.iter().next() {
            assert!(c.buffered() <= CONN_BUF as usize);
        }
    }
    assert!(reset, "sent {sent} bytes without an RST");
    assert_eq!(r.b.connection_count(), 0);
}

#[test]
fn credit_updates_follow_the_host_reading() {
    let mut r = Rig::new("update");
    let listener = UnixListener::bind(format!("{}_6001", r.path().display())).unwrap();
    r.send(guest(OP_REQUEST, 51, 6001, 0), &[]);
    r.drain(4096);
    let (mut host, _) = listener.accept().unwrap();
    let data = vec![1u8; MAX_PAYLOAD as usize];
    for _ in 0..3 {
        r.send(guest(OP_RW, 51, 6001, MAX_PAYLOAD), &data);
    }
    let mut sink = vec![0u8; 3 * MAX_PAYLOAD as usize];
    host.read_exact(&mut sink).unwrap();
    r.b.poll_host();
    let got = r.drain(4096);
    let update = got
        .iter()
        .find(|(h, _)| h.op == OP_CREDIT_UPDATE)
        .expect("credit update");
    assert_eq!(update.0.fwd_cnt, 3 * MAX_PAYLOAD);
    // A credit request is answered.
    r.send(guest(OP_CREDIT_REQUEST, 51, 6001, 0), &[]);
    assert_eq!(r.drain(4096)[0].0.op, OP_CREDIT_UPDATE);
}

#[test]
fn connections_are_bounded_and_many_run_at_once() {
    let mut r = Rig::new("many");
    let listener = UnixListener::bind(format!("{}_7000", r.path().display())).unwrap();
    for port in 0..u32::try_from(MAX_CONNECTIONS).unwrap() {
        r.send(guest(OP_REQUEST, port, 7000, 0), &[]);
    }
    let got = r.drain(4096);
    assert!(got.iter().all(|(h, _)| h.op == OP_RESPONSE));
    assert_eq!(got.len(), MAX_CONNECTIONS);
    r.send(guest(OP_REQUEST, 99_999, 7000, 0), &[]);
    assert_eq!(r.drain(4096)[0].0.op, OP_RST, "one too many");
    // Each connection carries its own bytes.
    let mut hosts: Vec<UnixStream> = (0..MAX_CONNECTIONS)
        .map(|_| listener.accept().unwrap().0)
        .collect();
    for port in 0..u32::try_from(MAX_CONNECTIONS).unwrap() {
        r.send(guest(OP_RW, port, 7000, 4), &port.to_le_bytes());
    }
    let mut seen: Vec<u32> = hosts
        .iter_mut()
        .map(|h| {
            let mut b = [0u8; 4];
            h.read_exact(&mut b).unwrap();
            u32::from_le_bytes(b)
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..u32::try_from(MAX_CONNECTIONS).unwrap()).collect::<Vec<_>>()
    );
    // An inactive device (driver reset) ends them all.
    r.b.set_active(false);
    assert_eq!(r.b.connection_count(), 0);
    let mut rest = Vec::new();
    assert_eq!(hosts[0].read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn a_stale_socket_file_is_replaced_a_live_one_refused() {
    let dir = std::env::temp_dir().join(format!("vsock-stale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s");
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let b = UnixBackend::new(CID, &path).unwrap();
    let e = UnixBackend::new(CID, &path).err().unwrap().to_string();
    assert!(
        e.contains("listens on it already") && e.contains("socket="),
        "{e}"
    );
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn connect_lines() {
    assert_eq!(parse_connect_line(b"CONNECT 1024"), Some(1024));
    assert_eq!(parse_connect_line(b"CONNECT 4294967295"), Some(u32::MAX));
    for bad in [
        &b"CONNECT"[..],
        b"CONNECT ",
        b"CONNECT -1",
        b"CONNECT 4294967296",
        b"CONNECT 1 ",
        b"CONNECT +1",
        b"CONNECT\t1",
        b"CONNECTX1",
        b"CONNEC 1",
        b"connect",
        b"connect ",
        b" connect 1",
        b"\xc3\xa9onnect 1",
    ] {
        assert_eq!(parse_connect_line(bad), None, "{bad:?}");
    }
}

/// Kata's Rust runtime dials its agent with `connect 1024`
/// (runtime-rs `hybrid_vsock.rs`); Cloud Hypervisor's muxer matches the
/// word without regard to case, so any mix of cases is a CONNECT.
#[test]
fn connect_lines_in_any_case() {
    assert_eq!(parse_connect_line(b"connect 1024"), Some(1024));
    assert_eq!(parse_connect_line(b"Connect 1024"), Some(1024));
    assert_eq!(parse_connect_line(b"cOnNeCt 7"), Some(7));
    assert_eq!(parse_connect_line(b"connect 4294967295"), Some(u32::MAX));
    assert_eq!(parse_connect_line(b"connect 4294967296"), None);
    assert_eq!(parse_connect_line(b"connect -1"), None);
}

/// The whole dial as runtime-rs makes it: `connect 1024\n` on the socket
/// reaches the guest as a REQUEST for port 1024 and, answered, gives the
/// dialler its `OK` line.
#[test]
fn a_lower_case_connect_reaches_the_guest() {
    let mut r = Rig::new("lowercase");
    let mut s = UnixStream::connect(r.path()).unwrap();
    s.write_all(b"connect 1024\n").unwrap();
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!(got.len(), 1);
    let req = got[0].0;
    assert_eq!((req.op, req.dst_port), (OP_REQUEST, 1024));
    r.send(guest(OP_RESPONSE, 1024, req.src_port, 0), &[]);
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    assert_eq!(line, format!("OK {}\n", req.src_port));
}

/// A guest RX buffer with no room for data must not make the backend spin
/// on a connection that has only data to send (a fuzzer-found hang).
#[test]
fn a_buffer_without_data_room_gets_control_packets_only() {
    let mut r = Rig::new("noroom");
    let (mut s, req) = host_connect(&mut r, 3);
    r.send(guest(OP_RESPONSE, 3, req.src_port, 0), &[]);
    s.write_all(b"data").unwrap();
    r.poll_until(|b| b.has_packet());
    assert!(r.b.next_packet(&mut []).is_none());
    assert!(r.b.has_packet(), "the data waits for a real buffer");
    let got = r.drain(4096);
    assert_eq!((got[0].0.op, got[0].1.as_slice()), (OP_RW, &b"data"[..]));
    // Control packets fit a header-only buffer.
    r.send(guest(OP_CREDIT_REQUEST, 3, req.src_port, 0), &[]);
    assert_eq!(r.b.next_packet(&mut []).unwrap().0.op, OP_CREDIT_UPDATE);
}

/// The host hung up and the guest never answers the SHUTDOWN with its
/// RST: past the close timeout the guest hears RST and the entry goes.
/// A host that aborts (closes with our bytes unread) is an RST at once.
#[test]
fn a_close_the_guest_never_finishes_times_out() {
    let mut r = Rig::new("closing");
    let (s, req) = host_connect(&mut r, 4);
    r.send(guest(OP_RESPONSE, 4, req.src_port, 0), &[]);
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    drop(s);
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert!(got.iter().any(|(h, _)| h.op == OP_SHUTDOWN), "{got:?}");
    assert_eq!(r.b.connection_count(), 1, "waiting for the guest's RST");
    r.b.expire(Instant::now() + CLOSE_TIMEOUT + Duration::from_millis(1));
    let got = r.drain(4096);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0.op, got[0].0.dst_port), (OP_RST, 4));
    assert_eq!(r.b.connection_count(), 0);
}

#[test]
fn a_host_that_aborts_is_an_rst_at_once() {
    let mut r = Rig::new("abort");
    let (s, req) = host_connect(&mut r, 5);
    r.send(guest(OP_RESPONSE, 5, req.src_port, 0), &[]);
    // The OK line is never read: the close is a reset for the backend.
    drop(s);
    r.poll_until(|b| b.has_packet());
    let got = r.drain(4096);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0.op, OP_RST);
    assert_eq!(r.b.connection_count(), 0);
}
