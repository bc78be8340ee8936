//! The shared log's file and its atomic take, and what the VMM says to a
//! daemon to turn its log on and off, checked against a scripted peer on
//! a socket pair (the real daemon's side is in the daemon's frontend
//! tests).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;

use super::super::memory_table::DaemonMemory;
use super::*;

/// A second shared mapping of the log's file, as the daemon maps it.
fn daemon_view(log: &SharedDirtyLog) -> &'static mut [u8] {
    let len = narrow::usize_of(log.size());
    // SAFETY: a fresh shared mapping of the whole file; leaked for the
    // test's life.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            log.file().as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: `len` bytes mapped just now, never unmapped.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) }
}

#[test]
fn the_file_holds_the_whole_span_and_bits_come_back_once() {
    // 4 GiB + one page: 2^20 + 1 pages, rounded up to whole words.
    let log = SharedDirtyLog::new((4 << 30) + 4096).unwrap();
    assert_eq!(log.words(), (1 << 14) + 1);
    assert_eq!(log.file().metadata().unwrap().len(), log.size());
    let view = daemon_view(&log);
    // Page 0, page 9 and page 2^20 (the last), set as the daemon does.
    view[0] |= 1;
    view[1] |= 1 << 1;
    view[(1 << 20) / 8] |= 1;
    assert_eq!(log.take_word(0), Some(1 | 1 << 9));
    assert_eq!(log.take_word(1 << 14), Some(1));
    assert_eq!(log.take_word(0), Some(0), "taken: cleared");
    assert!(view.iter().all(|b| *b == 0), "the daemon sees it cleared");
    assert_eq!(log.take_word(log.words()), None);
    let e = SharedDirtyLog::new(MAX_LOG_SPAN + 1).err().unwrap();
    assert!(e.to_string().contains("above the limit"), "{e}");
}

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_LOG_BASE: u32 = 6;
const SET_PROTOCOL_FEATURES: u32 = 16;
/// Header flags: version 1, a reply.
const REPLY: u32 = 0x1 | 0x4;

/// The device's features in use before the log (VERSION_1 and
/// PROTOCOL_FEATURES).
const IN_USE: u64 = 1 << 32 | 1 << 30;

/// One message from the VMM: its request code and body (any fd it carried
/// is dropped).
fn recv(peer: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut hdr = [0u8; 12];
    peer.read_exact(&mut hdr).unwrap();
    let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
    let mut body = vec![0u8; narrow::usize_of(u64::from(word(8)))];
    peer.read_exact(&mut body).unwrap();
    (word(0), body)
}

fn reply(peer: &mut UnixStream, code: u32, body: &[u8]) {
    let mut msg = Vec::new();
    for w in [code, REPLY, u32::try_from(body.len()).unwrap()] {
        msg.extend_from_slice(&w.to_le_bytes());
    }
    msg.extend_from_slice(body);
    peer.write_all(&msg).unwrap();
}

fn u64_body(body: &[u8]) -> u64 {
    u64::from_le_bytes(body[..8].try_into().unwrap())
}

/// A device's handle on a connection whose other end is `peer`, after a
/// handshake that acked LOG_SHMFD when `log_capable`.
fn daemon_memory(log_capable: bool) -> (DaemonMemory, UnixStream) {
    let (ours, mut peer) = UnixStream::pair().unwrap();
    let mut frontend = Frontend::from_stream(ours, 2);
    let offered = IN_USE | VhostUserVirtioFeatures::LOG_ALL.bits();
    let handshake = std::thread::spawn(move || {
        assert_eq!(recv(&mut peer).0, GET_FEATURES);
        reply(&mut peer, GET_FEATURES, &offered.to_le_bytes());
        assert_eq!(recv(&mut peer).0, SET_PROTOCOL_FEATURES);
        peer
    });
    frontend.get_features().unwrap();
    let acked = if log_capable {
        VhostUserProtocolFeatures::LOG_SHMFD
    } else {
        VhostUserProtocolFeatures::empty()
    };
    frontend.set_protocol_features(acked).unwrap();
    let peer = handshake.join().unwrap();
    let memory = DaemonMemory::new(
        "fs0",
        frontend,
        false,
        false,
        Arc::new(AtomicBool::new(false)),
        log_capable,
        Arc::new(AtomicU64::new(IN_USE)),
        Arc::new(Mutex::new(None)),
    );
    (memory, peer)
}

/// Start: SET_FEATURES with LOG_ALL added to the features in use, then
/// SET_LOG_BASE with a log as long as its file; stop: SET_FEATURES with
/// the features in use again. Each waits for the daemon (GET_FEATURES).
#[test]
fn start_adds_log_all_and_sends_the_whole_log_and_stop_takes_log_all_off() {
    let (memory, mut peer) = daemon_memory(true);
    let log = Arc::new(SharedDirtyLog::new(1 << 30).unwrap());
    let size = log.size();
    let daemon = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for _ in 0..2 {
            let (code, body) = recv(&mut peer);
            assert_eq!(code, SET_FEATURES);
            seen.push(u64_body(&body));
            let (code, body) = recv(&mut peer);
            if code == SET_LOG_BASE {
                // mmap_size, mmap_offset.
                assert_eq!(u64_body(&body), size, "the whole log");
                assert_eq!(u64_body(&body[8..]), 0);
                reply(&mut peer, SET_LOG_BASE, &body);
                assert_eq!(recv(&mut peer).0, GET_FEATURES);
            } else {
                assert_eq!(code, GET_FEATURES, "stop sends no log base");
            }
            reply(&mut peer, GET_FEATURES, &IN_USE.to_le_bytes());
        }
        seen
    });
    memory.start_dirty_log(&log).expect("start");
    assert!(memory.log.lock().unwrap().is_some());
    memory.stop_dirty_log().expect("stop");
    assert!(memory.log.lock().unwrap().is_none());
    let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
    assert_eq!(daemon.join().unwrap(), [IN_USE | log_all, IN_USE]);
}

/// Without LOG_SHMFD (or LOG_ALL) a start is refused naming the device,
/// and the daemon hears nothing.
#[test]
fn a_daemon_that_cannot_log_is_refused_by_name_and_told_nothing() {
    let (memory, peer) = daemon_memory(false);
    let log = Arc::new(SharedDirtyLog::new(1 << 20).unwrap());
    let e = memory.start_dirty_log(&log).unwrap_err().to_string();
    assert!(e.contains("fs fs0") && e.contains("LOG_ALL"), "{e}");
    assert!(memory.log.lock().unwrap().is_none());
    memory.stop_dirty_log().expect("nothing to stop");
    peer.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let heard = (&peer).read(&mut byte);
    assert_eq!(
        heard.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "the daemon got a message"
    );
}
