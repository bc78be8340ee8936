//! The hybrid vsock backend (Firecracker's and Cloud Hypervisor's): the
//! guest's stream connections mapped onto unix sockets on the host.
//!
//! - Host → guest: a process connects to the unix socket `PATH` and writes
//!   `CONNECT <port>\n`; the guest gets a REQUEST for `<port>`; on its
//!   RESPONSE the process reads `OK <host port>\n`, and the stream is then
//!   the connection. A refused or unanswered request closes the stream.
//! - Guest → host: a REQUEST for host port P connects to the unix listener
//!   `PATH_P`; none there, the guest hears RST.
//!
//! The backend knows nothing of virtqueues: [`UnixBackend::on_guest_packet`]
//! takes what the guest sent, [`UnixBackend::next_packet`] gives what it is
//! owed, so both are tested (and fuzzed) without a guest. Its host sockets
//! and its timer sit in an epoll set of its own, whose fd the device's
//! worker watches ([`UnixBackend::poll_host`] then serves it).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{Connection, State};
use super::packet::{validate, Header, PacketError, HOST_CID, OP_REQUEST, OP_RST, TYPE_STREAM};
use super::socket_path::{self, connect_nonblocking, SocketId, SocketPathError};

/// Connections (and host streams still owing their CONNECT line) at most:
/// each holds at most [`super::connection::CONN_BUF`] bytes.
pub const MAX_CONNECTIONS: usize = 256;
/// RSTs for unknown connections waiting for RX buffers, at most; past it
/// they are dropped (the guest's request times out instead).
pub const MAX_PENDING_RESETS: usize = 256;
/// Longest `CONNECT <port>\n` line.
pub const MAX_CONNECT_LINE: usize = 32;
/// How long a host stream may take to send its CONNECT line, a REQUEST
/// to be answered, and a closing connection to finish.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often deadlines are checked.
const TICK: Duration = Duration::from_millis(500);
/// Host ports of host-initiated connections count up from here (as the
/// models do), clear of the ports host listeners use.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

const LISTENER: u64 = 0;
const TIMER: u64 = 1;
const FIRST_STREAM_TOKEN: u64 = 16;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Socket(#[from] SocketPathError),
    #[error("vsock: host socket set: {0}")]
    Epoll(std::io::Error),
}

/// The listener a switch took from the backend ([`UnixBackend::take_listener`]).
pub struct TakenListener {
    pub listener: UnixListener,
    /// The socket file it is bound to, when known.
    pub socket_id: Option<SocketId>,
    /// Whether the name was the backend's: the caller removes the socket
    /// file then (if it still is `socket_id`).
    pub ours: bool,
}

/// A host stream that has not finished its `CONNECT <port>\n` line.
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
    deadline: Instant,
}

/// (host port, guest port)
type Key = (u32, u32);

enum Slot {
    Pending,
    Conn(Key),
}

pub struct UnixBackend {
    guest_cid: u64,
    path: PathBuf,
    /// The socket file bound at `path`: the one removed at the end.
    socket_id: Option<SocketId>,
    /// None while a migration's switch has taken it ([`Self::take_listener`]).
    listener: Option<UnixListener>,
    epoll: Epoll,
    timer: TimerFd,
    conns: HashMap<Key, (u64, Connection)>,
    pending: HashMap<u64, PendingHost>,
    tokens: HashMap<u64, Slot>,
    /// Connections that have something for the guest, in turn.
    ready: VecDeque<Key>,
    /// RSTs for packets that name no connection.
    resets: VecDeque<Header>,
    next_token: u64,
    next_local_port: u32,
    /// While the guest's driver is not running, host connections are
    /// closed as they arrive.
    active: bool,
    /// A local migration took the socket: not accepted on.
    released: bool,
    /// Whether the socket's name goes with this backend.
    name: SocketName,
}

/// Whether a backend removes its socket's name when it goes: a backend
/// that bound the socket does, until a local migration hands it over; one
/// on a listener another VMM passed does not until its VMM has taken the
/// whole VM (a failed migration leaves the name to the sender, whose
/// listener it still is). Shared with whoever decides that.
#[derive(Clone, Debug)]
pub struct SocketName(Arc<AtomicBool>);

impl SocketName {
    fn new(owned: bool) -> Self {
        SocketName(Arc::new(AtomicBool::new(owned)))
    }

    /// The name is this backend's: removed when it goes.
    pub fn claim(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn disown(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    pub fn is_owned(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// `CONNECT <port>` (without its newline) → the port. The word is matched
/// without regard to case, as Cloud Hypervisor's muxer matches it: Kata's
/// Rust runtime dials with `connect 1024`, its Go runtime and Firecracker's
/// tools with `CONNECT 1024`.
pub fn parse_connect_line(line: &[u8]) -> Option<u32> {
    const WORD: &[u8] = b"CONNECT ";
    let (word, port) = line.split_at_checked(WORD.len())?;
    if !word.eq_ignore_ascii_case(WORD) {
        return None;
    }
    let port = std::str::from_utf8(port).ok()?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

impl UnixBackend {
    /// Binds `path` (see [`socket_path::bind`]).
    pub fn new(guest_cid: u64, path: &Path) -> Result<Self, BackendError> {
        let (listener, socket_id) = socket_path::bind(path)?;
        Self::on_listener(guest_cid, path, listener, socket_id, SocketName::new(true))
    }

    /// Serves on a listener bound at `path` by another process and passed
    /// (see [`socket_path::adopt`], which checks it); the name is not this
    /// backend's until [`SocketName::claim`].
    pub fn adopt(
        guest_cid: u64,
        path: &Path,
        listener: UnixListener,
    ) -> Result<Self, BackendError> {
        let (listener, socket_id) = socket_path::adopt(path, listener)?;
        Self::on_listener(guest_cid, path, listener, socket_id, SocketName::new(false))
    }

    fn on_listener(
        guest_cid: u64,
        path: &Path,
        listener: UnixListener,
        socket_id: Option<SocketId>,
        name: SocketName,
    ) -> Result<Self, BackendError> {
        let setup = |r: std::io::Result<()>| r.map_err(BackendError::Epoll);
        setup(listener.set_nonblocking(true))?;
        let epoll = Epoll::new().map_err(BackendError::Epoll)?;
        let errno = |e: vmm_sys_util::errno::Error| BackendError::Epoll(e.into());
        let mut timer = TimerFd::new().map_err(errno)?;
        timer.reset(TICK, Some(TICK)).map_err(errno)?;
        let b = UnixBackend {
            guest_cid,
            path: path.to_path_buf(),
            socket_id,
            listener: Some(listener),
            epoll,
            timer,
            conns: HashMap::new(),
            pending: HashMap::new(),
            tokens: HashMap::new(),
            ready: VecDeque::new(),
            resets: VecDeque::new(),
            next_token: FIRST_STREAM_TOKEN,
            next_local_port: FIRST_LOCAL_PORT,
            active: false,
            released: false,
            name,
        };
        if let Some(l) = &b.listener {
            setup(b.watch(ControlOperation::Add, l.as_raw_fd(), EventSet::IN, LISTENER))?;
        }
        setup(b.watch(
            ControlOperation::Add,
            b.timer.as_raw_fd(),
            EventSet::IN,
            TIMER,
        ))?;
        Ok(b)
    }

    /// The listening socket (a local migration passes it on); None while
    /// a migration's switch has taken it.
    pub fn listener(&self) -> Option<&UnixListener> {
        self.listener.as_ref()
    }

    /// Whether the socket's name goes with this backend.
    pub fn name(&self) -> &SocketName {
        &self.name
    }

    /// A local migration's source once the VM's state is saved: the
    /// receiving VMM serves the socket from now on, on the same listener
    /// (passed to it). This backend stops accepting (a host client that
    /// connects meanwhile waits in the listener's queue for the receiver)
    /// and leaves the socket's name in place when it goes (the receiver's
    /// now). Open connections stay until the backend goes: they cannot
    /// move (the receiver's guest is told they are gone).
    pub fn release(&mut self) {
        if !self.released {
            if let Some(l) = &self.listener {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    l.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
            self.released = true;
            self.name.disown();
        }
    }

    /// Undoes [`Self::release`]: the migration failed and this VMM's guest
    /// runs on, its socket served here again. A listener a switch took
    /// comes back with [`Self::put_listener`] only.
    pub fn reclaim(&mut self) {
        if self.released {
            self.released = false;
            let Some(l) = &self.listener else { return };
            if let Err(e) = self.watch(ControlOperation::Add, l.as_raw_fd(), EventSet::IN, LISTENER)
            {
                crate::error_limited!(
                    "vsock {}: host connections not served again: {e}",
                    self.path.display()
                );
            }
            self.name.claim();
        }
    }

    /// A migration's switch over the network: the receiving VMM binds the
    /// socket's path itself, so this backend stops accepting and gives the
    /// listener up (the caller closes it, and removes the socket file if
    /// [`TakenListener::ours`]). Its name is no longer this backend's. Open
    /// connections stay: they cannot move over the network; they end with
    /// this VMM (the receiving guest is told they are gone), or go on if
    /// the migration fails. None: taken already.
    pub fn take_listener(&mut self) -> Option<TakenListener> {
        let listener = self.listener.take()?;
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            listener.as_raw_fd(),
            EpollEvent::default(),
        );
        // A local release gave the name up for a receiver on this very
        // listener; a switch has passed it to none, so the name is still
        // this VMM's to remove.
        let ours = self.name.is_owned() || self.released;
        self.name.disown();
        self.released = false;
        Some(TakenListener {
            listener,
            socket_id: self.socket_id.take(),
            ours,
        })
    }

    /// The migration failed: serves `listener`, bound again at the path
    /// (see [`socket_path::bind`]; `socket_id` from there), and the name is
    /// this backend's again.
    pub fn put_listener(
        &mut self,
        listener: UnixListener,
        socket_id: Option<SocketId>,
    ) -> Result<(), BackendError> {
        listener
            .set_nonblocking(true)
            .map_err(BackendError::Epoll)?;
        self.watch(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EventSet::IN,
            LISTENER,
        )
        .map_err(BackendError::Epoll)?;
        self.listener = Some(listener);
        self.socket_id = socket_id;
        self.released = false;
        self.name.claim();
        Ok(())
    }

    /// The epoll fd to watch: readable when a host socket or the timer is.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len() + self.pending.len()
    }

    fn watch(
        &self,
        op: ControlOperation,
        fd: RawFd,
        events: EventSet,
        token: u64,
    ) -> std::io::Result<()> {
        self.epoll.ctl(op, fd, EpollEvent::new(events, token))
    }

    /// The guest's driver started (true) or was reset (false): either way
    /// every connection ends; host streams see EOF.
    pub fn set_active(&mut self, active: bool) {
        self.active = active;
        for (_, (token, c)) in self.conns.drain() {
            self.tokens.remove(&token);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                c.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        for (token, p) in self.pending.drain() {
            self.tokens.remove(&token);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                p.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        self.ready.clear();
        self.resets.clear();
    }

    /// Whether [`Self::next_packet`] may have something.
    pub fn has_packet(&self) -> bool {
        !self.resets.is_empty() || !self.ready.is_empty()
    }

    fn reset_for(&mut self, h: &Header) {
        if h.op == OP_RST || self.resets.len() >= MAX_PENDING_RESETS {
            return;
        }
        self.resets.push_back(Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: h.dst_port,
            dst_port: h.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op: OP_RST,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        });
    }

    /// A packet from the guest that failed its checks but names a
    /// connection (right cids): that connection is reset, or the guest
    /// hears RST for the one it meant.
    fn on_malformed_packet(&mut self, h: &Header) {
        if h.src_cid != self.guest_cid || h.dst_cid != HOST_CID {
            return;
        }
        let key = (h.dst_port, h.src_port);
        match self.conns.get_mut(&key) {
            Some((_, c)) => {
                c.reset();
                self.refresh(key);
            }
            None => self.reset_for(h),
        }
    }

    /// A packet from the guest, its payload in `data`.
    pub fn on_guest_packet(&mut self, h: &Header, data: &[u8]) -> Result<(), PacketError> {
        if let Err(e) = validate(h, data.len(), self.guest_cid) {
            if e.deserves_reset() {
                self.on_malformed_packet(h);
            }
            return Err(e);
        }
        let key = (h.dst_port, h.src_port);
        let now = Instant::now();
        match self.conns.get_mut(&key) {
            Some((_, c)) => c.on_guest_packet(h, data, now, CLOSE_TIMEOUT),
            None if h.op == OP_REQUEST && self.active => self.connect_to_host(h),
            None => self.reset_for(h),
        }
        if self.conns.contains_key(&key) {
            self.refresh(key);
        }
        Ok(())
    }

    /// The guest asks for host port `dst_port`: connects to `PATH_<port>`.
    fn connect_to_host(&mut self, h: &Header) {
        if self.connection_count() >= MAX_CONNECTIONS {
            crate::warn_limited!("vsock: {MAX_CONNECTIONS} connections open; the guest's request for host port {} is refused", h.dst_port);
            return self.reset_for(h);
        }
        let mut target = self.path.clone().into_os_string();
        target.push(format!("_{}", h.dst_port));
        match connect_nonblocking(Path::new(&target)) {
            Ok(stream) => {
                let key = (h.dst_port, h.src_port);
                self.insert(key, Connection::guest_initiated(stream, h));
            }
            Err(_) => self.reset_for(h),
        }
    }

    fn insert(&mut self, key: Key, c: Connection) {
        let token = self.next_token;
        self.next_token += 1;
        // Registered with no events; refresh() sets what it waits for.
        if self
            .watch(
                ControlOperation::Add,
                c.stream.as_raw_fd(),
                EventSet::empty(),
                token,
            )
            .is_err()
        {
            return;
        }
        self.tokens.insert(token, Slot::Conn(key));
        self.conns.insert(key, (token, c));
        self.refresh(key);
    }

    /// After a connection changed: what its host socket is watched for,
    /// whether it waits its turn for RX, whether it is gone.
    fn refresh(&mut self, key: Key) {
        let Some((token, c)) = self.conns.get_mut(&key) else {
            return;
        };
        if c.state == State::Closing && c.deadline.is_none() {
            c.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
        }
        if c.finished() {
            let token = *token;
            let fd = c.stream.as_raw_fd();
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            self.tokens.remove(&token);
            self.conns.remove(&key);
            return;
        }
        let mut events = EventSet::empty();
        if c.wants_host_input() {
            events |= EventSet::IN;
        }
        if c.wants_host_output() {
            events |= EventSet::OUT;
        }
        let (token, fd, has_packet) = (*token, c.stream.as_raw_fd(), c.has_packet());
        if c.host_hup {
            // A hung-up socket reports HUP whatever it is watched for.
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        } else {
            let _ = self.watch(ControlOperation::Modify, fd, events, token);
        }
        if has_packet && !self.ready.contains(&key) {
            self.ready.push_back(key);
        }
    }

    /// The next packet for the guest, payload into `data` (the guest's RX
    /// buffer, at most [`super::packet::MAX_PAYLOAD`]).
    pub fn next_packet(&mut self, data: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(h) = self.resets.pop_front() {
            return Some((h, 0));
        }
        // One pass over the connections waiting their turn: one that has
        // nothing for a buffer of this size (a payload for a guest buffer
        // with no data room) goes back in line, and the next buffer may
        // take it. Looping until one answers would spin for ever on such
        // a buffer (found by the fuzzer).
        for _ in 0..self.ready.len() {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            let Some((_, c)) = self.conns.get_mut(&key) else {
                continue;
            };
            let packet = c.next_packet(data);
            self.refresh(key);
            if packet.is_some() {
                return packet;
            }
        }
        None
    }

    /// Serves the host side: new connections, CONNECT lines, readable and
    /// writable streams, hang-ups, deadlines. Never blocks.
    pub fn poll_host(&mut self) {
        let mut events = [EpollEvent::default(); 32];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(_) => return,
        };
        for ev in &events[..n] {
            match ev.data() {
                LISTENER => self.accept(),
                TIMER => {
                    let _ = self.timer.wait();
                    self.expire(Instant::now());
                }
                token => self.on_stream_event(token, ev.event_set()),
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            if !self.active
                || self.connection_count() >= MAX_CONNECTIONS
                || stream.set_nonblocking(true).is_err()
            {
                if self.active {
                    crate::warn_limited!(
                        "vsock: {MAX_CONNECTIONS} connections open; a host connection is closed"
                    );
                }
                continue;
            }
            let token = self.next_token;
            self.next_token += 1;
            if self
                .watch(
                    ControlOperation::Add,
                    stream.as_raw_fd(),
                    EventSet::IN,
                    token,
                )
                .is_err()
            {
                continue;
            }
            self.tokens.insert(token, Slot::Pending);
            self.pending.insert(
                token,
                PendingHost {
                    stream,
                    line: Vec::new(),
                    deadline: Instant::now() + HANDSHAKE_TIMEOUT,
                },
            );
        }
    }

    fn on_stream_event(&mut self, token: u64, events: EventSet) {
        match self.tokens.get(&token) {
            Some(Slot::Pending) => self.read_connect_line(token),
            Some(Slot::Conn(key)) => {
                let key = *key;
                let Some((_, c)) = self.conns.get_mut(&key) else {
                    return;
                };
                if events.contains(EventSet::HANG_UP) {
                    c.on_host_hangup();
                } else {
                    if events.intersects(EventSet::IN | EventSet::READ_HANG_UP | EventSet::ERROR) {
                        c.host_readable = true;
                    }
                    if events.contains(EventSet::OUT) {
                        c.flush_to_host();
                    }
                }
                self.refresh(key);
            }
            None => {}
        }
    }

    /// Reads the CONNECT line a byte at a time: what follows the newline
    /// is the stream's data for the guest and stays in the socket.
    fn read_connect_line(&mut self, token: u64) {
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        let outcome = loop {
            match p.stream.read(&mut byte) {
                Ok(1) if byte[0] == b'\n' => break Some(parse_connect_line(&p.line)),
                Ok(1) if p.line.len() < MAX_CONNECT_LINE => p.line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break None,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // EOF, an overlong line, an error.
                _ => break Some(None),
            }
        };
        let Some(port) = outcome else {
            return;
        };
        let p = self.pending.remove(&token).expect("present");
        self.tokens.remove(&token);
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            p.stream.as_raw_fd(),
            EpollEvent::default(),
        );
        let Some(port) = port else {
            return; // closed: the host sees EOF instead of OK
        };
        let local_port = self.allocate_local_port(port);
        let c = Connection::host_initiated(
            p.stream,
            local_port,
            port,
            self.guest_cid,
            Instant::now() + HANDSHAKE_TIMEOUT,
        );
        self.insert((local_port, port), c);
    }

    fn allocate_local_port(&mut self, peer_port: u32) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self
                .next_local_port
                .checked_add(1)
                .unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.contains_key(&(port, peer_port)) {
                return port;
            }
        }
    }

    /// Ends what outlived its deadline.
    pub fn expire(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(t, _)| *t)
            .collect();
        for token in late {
            if let Some(p) = self.pending.remove(&token) {
                self.tokens.remove(&token);
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    p.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
        }
        let late: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, (_, c))| c.deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            if let Some((_, c)) = self.conns.get_mut(&key) {
                c.expire();
            }
            self.refresh(key);
        }
    }
}

/// The socket's name goes with the backend (a later VMM may bind it), if
/// it still is the socket bound and the name is the backend's. The
/// backend is dropped on the device's own thread when it stops, whichever
/// thread drops the device.
impl Drop for UnixBackend {
    fn drop(&mut self) {
        if self.name.is_owned() {
            socket_path::remove_if_bound(&self.path, self.socket_id);
        }
    }
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod tests;
