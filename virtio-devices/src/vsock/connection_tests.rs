//! The connection state machine alone, over a socket pair.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::*;

fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    (a, b)
}

fn from_guest(op: u16, len: u32) -> Header {
    Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 10,
        dst_port: 20,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 4096,
        fwd_cnt: 0,
    }
}

const T: Duration = Duration::from_secs(5);

#[test]
fn credit_is_what_the_guest_has_room_for() {
    assert_eq!(credit(4096, 0, 0), 4096);
    assert_eq!(credit(4096, 100, 4000), 196);
    assert_eq!(credit(4096, 0, 4096), 0);
    // Counters wrap.
    assert_eq!(credit(4096, u32::MAX - 9, 10), 4076);
    // A fwd_cnt ahead of what was sent: no credit rather than a huge one.
    assert_eq!(credit(4096, 50, 10), 0);
}

#[test]
fn packets_out_of_place_reset_the_connection() {
    let now = Instant::now();
    // RW before the guest answered a host-initiated request.
    let (a, _b) = pair();
    let mut c = Connection::host_initiated(a, 1 << 30, 20, 3, now + T);
    let mut buf = [0u8; 64];
    assert_eq!(c.next_packet(&mut buf).unwrap().0.op, OP_REQUEST);
    c.on_guest_packet(&from_guest(OP_RW, 1), b"x", now, T);
    assert_eq!(c.state, State::Dead);
    assert_eq!(c.next_packet(&mut buf).unwrap().0.op, OP_RST);
    assert!(c.finished());
    // A second REQUEST on an established connection.
    let (a, _b) = pair();
    let mut c = Connection::guest_initiated(a, &from_guest(OP_REQUEST, 0));
    c.on_guest_packet(&from_guest(OP_REQUEST, 0), &[], now, T);
    assert_eq!(c.state, State::Dead);
    // RW after the guest's SHUTDOWN SEND.
    let (a, _b) = pair();
    let mut c = Connection::guest_initiated(a, &from_guest(OP_REQUEST, 0));
    let shut = Header {
        flags: SHUTDOWN_SEND,
        ..from_guest(OP_SHUTDOWN, 0)
    };
    c.on_guest_packet(&shut, &[], now, T);
    assert_eq!(c.state, State::Established);
    c.on_guest_packet(&from_guest(OP_RW, 1), b"x", now, T);
    assert_eq!(c.state, State::Dead);
}

#[test]
fn a_guest_half_close_reaches_the_host_after_the_buffered_bytes() {
    let now = Instant::now();
    let (a, mut host) = pair();
    let mut c = Connection::guest_initiated(a, &from_guest(OP_REQUEST, 0));
    let mut buf = [0u8; 64];
    assert_eq!(c.next_packet(&mut buf).unwrap().0.op, OP_RESPONSE);
    c.on_guest_packet(&from_guest(OP_RW, 5), b"hello", now, T);
    let shut = Header {
        flags: SHUTDOWN_SEND,
        ..from_guest(OP_SHUTDOWN, 0)
    };
    c.on_guest_packet(&shut, &[], now, T);
    let mut got = Vec::new();
    host.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"hello");
    // The guest still receives: the connection stays.
    assert_eq!(c.state, State::Established);
    assert!(c.deadline.is_none());
}

#[test]
fn the_guests_full_close_waits_for_the_host_then_resets() {
    let now = Instant::now();
    let (a, mut host) = pair();
    let mut c = Connection::guest_initiated(a, &from_guest(OP_REQUEST, 0));
    c.next_packet(&mut [0u8; 64]);
    // Fill the host socket so bytes stay buffered.
    let big = vec![0u8; 60_000];
    let mut sent = 0;
    while c.buffered() == 0 {
        c.on_guest_packet(
            &from_guest(OP_RW, u32::try_from(big.len()).unwrap()),
            &big,
            now,
            T,
        );
        sent += big.len();
        assert!(sent < 10 << 20);
    }
    let shut = Header {
        flags: SHUTDOWN_SEND | SHUTDOWN_RCV,
        ..from_guest(OP_SHUTDOWN, 0)
    };
    c.on_guest_packet(&shut, &[], now, T);
    assert_eq!(c.state, State::Established, "bytes still wait");
    assert_eq!(c.deadline, Some(now + T));
    // The host reads everything: the flush finishes the close.
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        host.read_to_end(&mut all).unwrap();
        all.len()
    });
    while c.state != State::Dead {
        c.flush_to_host();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(c.next_packet(&mut [0u8; 64]).unwrap().0.op, OP_RST);
    assert_eq!(reader.join().unwrap(), sent);
}

#[test]
fn expiry_resets() {
    let (a, _b) = pair();
    let now = Instant::now();
    let mut c = Connection::host_initiated(a, 1 << 30, 20, 3, now + T);
    c.expire();
    assert_eq!(c.state, State::Dead);
    let (h, _) = c.next_packet(&mut [0u8; 8]).unwrap();
    assert_eq!(
        (h.op, h.src_cid, h.dst_cid, h.src_port, h.dst_port),
        (OP_RST, HOST_CID, 3, 1 << 30, 20)
    );
    assert!(c.finished());
    assert!(c.next_packet(&mut [0u8; 8]).is_none());
}
