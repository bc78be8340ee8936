//! The vsock backend's packet checks and connection state machine on
//! whatever a hostile guest sends, interleaved with host processes that
//! connect and write arbitrary CONNECT lines, the guest draining its RX
//! buffers of any size, and deadlines passing. Every packet the backend
//! emits is addressed host → guest, fits the buffer it was given and is
//! a stream packet; connections stay within their bound; nothing panics.
#![no_main]

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use virtio_devices::vsock::backend::{UnixBackend, MAX_CONNECTIONS};
use virtio_devices::vsock::packet::{Header, HEADER_LEN, HOST_CID, TYPE_STREAM};

const GUEST_CID: u64 = 3;
/// The host port with a listener (`<socket>_5000`).
const LISTENING_PORT: u32 = 5000;

/// A socket directory and the listener on port 5000, once per process.
fn host() -> &'static (PathBuf, UnixListener) {
    static HOST: OnceLock<(PathBuf, UnixListener)> = OnceLock::new();
    HOST.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vsock-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let listener =
            UnixListener::bind(dir.join(format!("v.sock_{LISTENING_PORT}"))).expect("listener");
        listener.set_nonblocking(true).expect("non-blocking");
        (dir.join("v.sock"), listener)
    })
}

/// Input bytes, read front to back; zeros past the end.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    fn byte(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }
}

fuzz_target!(|data: &[u8]| {
    let (path, listener) = host();
    let Ok(mut backend) = UnixBackend::new(GUEST_CID, path) else {
        return;
    };
    backend.set_active(true);
    let mut input = Input(data);
    let mut clients: Vec<UnixStream> = Vec::new();
    let mut accepted: Vec<UnixStream> = Vec::new();
    let mut rx = vec![0u8; 64 * 1024];
    while !input.0.is_empty() {
        match input.byte() % 6 {
            0 => {
                let mut raw = [0u8; HEADER_LEN];
                let got = input.bytes(HEADER_LEN);
                raw[..got.len()].copy_from_slice(got);
                let mut h = Header::from_bytes(&raw);
                // Mostly well addressed, on few ports, so packets meet
                // connections; the rest as the fuzzer wrote them.
                let steer = raw[0];
                if steer & 1 == 0 {
                    h.src_cid = GUEST_CID;
                    h.dst_cid = HOST_CID;
                    h.type_ = TYPE_STREAM;
                }
                if steer & 2 == 0 {
                    h.dst_port = if steer & 4 == 0 {
                        LISTENING_PORT
                    } else {
                        h.dst_port % 4 + (1 << 30)
                    };
                    h.src_port %= 8;
                }
                if steer & 8 == 0 {
                    h.op %= 8;
                }
                let len = usize::from(input.byte()) * 16;
                let payload = input.bytes(len).to_vec();
                let _ = backend.on_guest_packet(&h, &payload);
            }
            1 => {
                let room = (usize::from(input.byte()) * 257).min(rx.len());
                while let Some((h, n)) = backend.next_packet(&mut rx[..room]) {
                    assert_eq!(
                        (h.src_cid, h.dst_cid, h.type_),
                        (HOST_CID, GUEST_CID, TYPE_STREAM)
                    );
                    assert!(n <= room && h.len as usize == n, "{h:?} {n} {room}");
                }
            }
            2 => {
                let line_len = usize::from(input.byte() % 48);
                let line = input.bytes(line_len).to_vec();
                if let Ok(mut s) = UnixStream::connect(path) {
                    let _ = s.set_nonblocking(true);
                    let _ = s.write(&line);
                    clients.push(s);
                }
            }
            3 => backend.poll_host(),
            4 => backend.expire(Instant::now() + Duration::from_secs(u64::from(input.byte()))),
            _ => {
                while let Ok((s, _)) = listener.accept() {
                    let _ = s.set_nonblocking(true);
                    accepted.push(s);
                }
                if input.byte() & 1 == 1 {
                    accepted.clear();
                    clients.clear();
                }
            }
        }
        assert!(backend.connection_count() <= MAX_CONNECTIONS);
    }
    // What the host listener holds goes with this run.
    while listener.accept().is_ok() {}
});
