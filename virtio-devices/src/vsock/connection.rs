//! One stream connection between a guest port and a host unix socket: its
//! state, both directions' byte counts for credit-based flow control
//! (virtio 1.2 §5.10.6.3), and the packets it owes the guest.
//!
//! Neither direction buffers without bound:
//! - guest → host: bytes the host socket does not take at once wait in
//!   `to_host`, at most [`CONN_BUF`] — the buffer space this side
//!   advertises (`buf_alloc`). A guest that sends past its credit is reset.
//! - host → guest: the host socket is read only when the guest has credit
//!   and an RX buffer, straight into that buffer; a guest that never reads
//!   leaves the bytes in the host's socket, whose writer then blocks.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::packet::{
    Header, HOST_CID, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW,
    OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};

/// Bytes from the guest this side holds for one connection at most (what
/// it advertises as `buf_alloc`; the models use the same 256 KiB).
pub const CONN_BUF: u32 = 256 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: REQUEST sent (or owed), RESPONSE awaited.
    LocalInit,
    Established,
    /// This side sent SHUTDOWN with both flags; the guest's RST is awaited.
    Closing,
    /// Gone: removed from the table once its last packet (RST) is out.
    Dead,
}

/// Control packets owed to the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Owed {
    request: bool,
    response: bool,
    rst: bool,
    credit_update: bool,
    /// SHUTDOWN flags still to send (0: none).
    shutdown: u32,
}

pub struct Connection {
    pub(super) stream: UnixStream,
    /// Host-side port (the guest's destination for guest-initiated ones).
    pub local_port: u32,
    /// Guest-side port.
    pub peer_port: u32,
    guest_cid: u64,
    pub state: State,
    owed: Owed,
    /// Guest → host bytes the host socket has not taken yet.
    to_host: VecDeque<u8>,
    /// Leading bytes of `to_host` that are this side's `OK <port>` reply,
    /// not the guest's: they count neither against its credit nor in fwd_cnt.
    reply_left: usize,
    /// Guest → host bytes handed to the host socket (advertised as fwd_cnt).
    fwd_cnt: u32,
    /// fwd_cnt as the guest last heard it.
    fwd_cnt_told: u32,
    /// Guest → host bytes received.
    rx_cnt: u32,
    /// Host → guest bytes sent.
    tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The guest said it will receive / send no more (SHUTDOWN flags).
    peer_shutdown: u32,
    /// The host socket has bytes (or EOF) to read; cleared on WouldBlock.
    pub(super) host_readable: bool,
    /// The host closed its sending half (read gave EOF).
    host_eof: bool,
    /// The host closed both halves (EPOLLHUP): nothing more can be written.
    pub(super) host_hup: bool,
    /// When the state must have moved on (request answered, close done).
    pub deadline: Option<Instant>,
}

/// Whether the guest still has credit for `tx_cnt` bytes sent.
fn credit(buf_alloc: u32, fwd_cnt: u32, tx_cnt: u32) -> u32 {
    let in_flight = tx_cnt.wrapping_sub(fwd_cnt);
    // A guest whose counters make no sense (fwd_cnt ahead of what it
    // received) gets no credit: it stalls only itself.
    buf_alloc.saturating_sub(in_flight)
}

impl Connection {
    fn new(
        stream: UnixStream,
        local_port: u32,
        peer_port: u32,
        guest_cid: u64,
        state: State,
    ) -> Self {
        Connection {
            stream,
            local_port,
            peer_port,
            guest_cid,
            state,
            owed: Owed::default(),
            to_host: VecDeque::new(),
            reply_left: 0,
            fwd_cnt: 0,
            fwd_cnt_told: 0,
            rx_cnt: 0,
            tx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            peer_shutdown: 0,
            host_readable: false,
            host_eof: false,
            host_hup: false,
            deadline: None,
        }
    }

    /// A host process asked (`CONNECT <peer_port>`) for the guest's port:
    /// a REQUEST is owed; `OK <local_port>` goes to the host on RESPONSE.
    pub fn host_initiated(
        stream: UnixStream,
        local_port: u32,
        peer_port: u32,
        guest_cid: u64,
        deadline: Instant,
    ) -> Self {
        let mut c = Connection::new(stream, local_port, peer_port, guest_cid, State::LocalInit);
        c.owed.request = true;
        c.deadline = Some(deadline);
        c
    }

    /// The guest asked for host port `local_port` and its listener took
    /// the connection: a RESPONSE is owed.
    pub fn guest_initiated(stream: UnixStream, request: &Header) -> Self {
        let mut c = Connection::new(
            stream,
            request.dst_port,
            request.src_port,
            request.src_cid,
            State::Established,
        );
        c.owed.response = true;
        c.peer_buf_alloc = request.buf_alloc;
        c.peer_fwd_cnt = request.fwd_cnt;
        c
    }

    /// A connection that only owes the guest an RST (and then goes).
    pub fn reset(&mut self) {
        self.owed = Owed {
            rst: true,
            ..Owed::default()
        };
        self.state = State::Dead;
        self.to_host.clear();
        self.reply_left = 0;
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    pub fn peer_credit(&self) -> u32 {
        credit(self.peer_buf_alloc, self.peer_fwd_cnt, self.tx_cnt)
    }

    /// Bytes from the guest not yet taken by the host.
    pub fn buffered(&self) -> usize {
        self.to_host.len() - self.reply_left
    }

    /// Whether this side should read the host socket now (if it is readable).
    fn may_read_host(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && self.peer_shutdown & SHUTDOWN_RCV == 0
            && self.peer_credit() > 0
    }

    /// Whether the host socket should be watched for input (a readable
    /// socket already noted is not watched: it would fire again and again
    /// until the guest has room).
    pub fn wants_host_input(&self) -> bool {
        !self.host_readable && !self.host_hup && self.may_read_host()
    }

    pub fn wants_host_output(&self) -> bool {
        !self.to_host.is_empty() && !self.host_hup
    }

    /// Whether [`Self::next_packet`] has something for the guest.
    pub fn has_packet(&self) -> bool {
        self.owed != Owed::default() || (self.host_readable && self.may_read_host())
    }

    /// True once the last packet is out and the connection can go.
    pub fn finished(&self) -> bool {
        self.state == State::Dead && !self.owed.rst
    }

    fn header(&self, op: u16, len: u32, flags: u32) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF,
            fwd_cnt: self.fwd_cnt,
        }
    }

    /// The next packet for the guest, its payload (if any) read from the
    /// host socket into `data`, at most the guest's credit.
    pub fn next_packet(&mut self, data: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(op) = self.owed_before_data() {
            return Some(self.control(op, 0));
        }
        if let Some(h) = self.read_host(data) {
            return Some(h);
        }
        // The read may have ended the connection (a host error: RST) or
        // the host's half (EOF: SHUTDOWN); either goes out now.
        if let Some(op) = self.owed_before_data() {
            return Some(self.control(op, 0));
        }
        if self.owed.shutdown != 0 {
            let flags = std::mem::take(&mut self.owed.shutdown);
            return Some(self.control(OP_SHUTDOWN, flags));
        }
        if std::mem::take(&mut self.owed.credit_update) {
            return Some(self.control(OP_CREDIT_UPDATE, 0));
        }
        None
    }

    /// RST, REQUEST or RESPONSE if owed: they go before any data.
    fn owed_before_data(&mut self) -> Option<u16> {
        if self.owed.rst {
            self.owed = Owed::default();
            Some(OP_RST)
        } else if std::mem::take(&mut self.owed.request) {
            Some(OP_REQUEST)
        } else if std::mem::take(&mut self.owed.response) {
            Some(OP_RESPONSE)
        } else {
            None
        }
    }

    fn control(&mut self, op: u16, flags: u32) -> (Header, usize) {
        self.fwd_cnt_told = self.fwd_cnt;
        (self.header(op, 0, flags), 0)
    }

    /// Reads host bytes for an RW packet; notes EOF and errors.
    fn read_host(&mut self, data: &mut [u8]) -> Option<(Header, usize)> {
        if !self.host_readable || !self.may_read_host() || data.is_empty() {
            return None;
        }
        // The credit bounds the read: u32 to usize never truncates on 64-bit.
        let room = data.len().min(self.peer_credit() as usize);
        match self.stream.read(&mut data[..room]) {
            Ok(0) => {
                self.host_readable = false;
                self.host_eof = true;
                // The host sends no more; after a full hang-up it takes no
                // more either, and the guest's RST is awaited.
                self.owed.shutdown |= SHUTDOWN_SEND;
                if self.host_hup {
                    self.owed.shutdown |= SHUTDOWN_RCV;
                    self.state = State::Closing;
                }
                None
            }
            Ok(n) => {
                // n <= room <= credit <= u32::MAX.
                let len = narrow::sat_u32(n);
                self.tx_cnt = self.tx_cnt.wrapping_add(len);
                let h = self.header(OP_RW, len, 0);
                self.fwd_cnt_told = self.fwd_cnt;
                Some((h, n))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                self.host_readable = false;
                None
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => None,
            Err(_) => {
                self.reset();
                None
            }
        }
    }

    /// A packet from the guest for this connection (already validated).
    /// A guest that sends past its credit, or a packet out of place in the
    /// state, resets the connection.
    pub fn on_guest_packet(
        &mut self,
        h: &Header,
        data: &[u8],
        now: Instant,
        close_timeout: std::time::Duration,
    ) {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd_cnt = h.fwd_cnt;
        match (h.op, self.state) {
            (OP_RST, _) => {
                self.state = State::Dead;
                self.owed = Owed::default();
                let _ = self.stream.shutdown(Shutdown::Both);
            }
            (OP_RESPONSE, State::LocalInit) => {
                self.state = State::Established;
                self.deadline = None;
                let ok = format!("OK {}\n", self.local_port);
                self.to_host.extend(ok.as_bytes());
                self.reply_left = ok.len();
                self.flush_to_host();
            }
            (OP_RW, State::Established) if self.peer_shutdown & SHUTDOWN_SEND == 0 => {
                // The guest may have at most CONN_BUF bytes unforwarded.
                if self.buffered().saturating_add(data.len()) > CONN_BUF as usize {
                    return self.reset();
                }
                self.rx_cnt = self.rx_cnt.wrapping_add(h.len);
                self.to_host.extend(data);
                self.flush_to_host();
            }
            (OP_SHUTDOWN, State::Established | State::Closing) => {
                self.peer_shutdown |= h.flags & (SHUTDOWN_RCV | SHUTDOWN_SEND);
                if self.peer_shutdown & SHUTDOWN_RCV != 0 {
                    let _ = self.stream.shutdown(Shutdown::Read);
                    self.host_readable = false;
                }
                if self.peer_shutdown == SHUTDOWN_RCV | SHUTDOWN_SEND {
                    // The guest closed: what it sent reaches the host
                    // within the timeout, then the RST it waits for.
                    self.deadline = Some(now + close_timeout);
                }
                self.after_flush();
            }
            (OP_CREDIT_UPDATE, _) => {}
            (OP_CREDIT_REQUEST, _) => self.owed.credit_update = true,
            // Anything else is out of place in this state (RW before the
            // RESPONSE or after the guest's SHUTDOWN SEND, a second REQUEST…).
            _ => self.reset(),
        }
    }

    /// The host socket can take bytes: writes what waits.
    pub fn flush_to_host(&mut self) {
        while !self.to_host.is_empty() && !self.host_hup {
            let (front, _) = self.to_host.as_slices();
            match self.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    self.to_host.drain(..n);
                    let reply = n.min(self.reply_left);
                    self.reply_left -= reply;
                    // n - reply <= CONN_BUF.
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(narrow::sat_u32(n - reply));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // The host's reader is gone (EPIPE): the guest hears RST.
                Err(_) => return self.reset(),
            }
        }
        self.after_flush();
    }

    /// Credit news for the guest, and the close steps that wait for the
    /// buffer to drain.
    fn after_flush(&mut self) {
        if self.state == State::Dead {
            return;
        }
        // The guest thinks this much of CONN_BUF is taken; once that is
        // over half and the host took some of it, tell the guest.
        let believed_used = self.rx_cnt.wrapping_sub(self.fwd_cnt_told);
        if believed_used > CONN_BUF / 2 && self.fwd_cnt != self.fwd_cnt_told {
            self.owed.credit_update = true;
        }
        if self.to_host.is_empty() && self.peer_shutdown & SHUTDOWN_SEND != 0 {
            let _ = self.stream.shutdown(Shutdown::Write);
            if self.peer_shutdown & SHUTDOWN_RCV != 0 {
                self.reset();
            }
        }
    }

    /// The host hung up both halves: bytes for it are dropped; what it
    /// wrote before is still read and sent to the guest, then SHUTDOWN.
    pub fn on_host_hangup(&mut self) {
        self.host_hup = true;
        self.host_readable = true;
        self.to_host.clear();
        self.reply_left = 0;
    }

    /// The deadline passed: a request the guest never answered, or a close
    /// it never finished. The guest hears RST; the host socket closes.
    pub fn expire(&mut self) {
        self.deadline = None;
        self.reset();
    }
}

#[cfg(test)]
#[path = "connection_tests.rs"]
mod tests;
