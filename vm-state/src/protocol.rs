//! The migration wire protocol over the unix socket, byte-compatible with
//! Cloud Hypervisor's (checked against its `vm-migration/src/protocol.rs`
//! at ae44c29, v54 development head; v52.0 has the same bytes for commands
//! 0..=8), plus two commands of our own.
//!
//! Every request and response starts with a 16-byte header, little-endian:
//!
//! ```text
//! Request  { command: u16, command_headers: [u8; 6], length: u64 }
//! Response { status:  u16, padding:         [u8; 6], length: u64 }
//! ```
//!
//! then `length` payload bytes. The sender's protocol version rides in
//! `Start`'s `command_headers[0..2]`; the other header bytes are ignored on
//! receipt, as Cloud Hypervisor ignores them.
//!
//! A peer's header is not trusted: an unknown command or status is refused,
//! and each command's `length` is bounded before a byte of payload is
//! allocated (see [`Command::payload_bound`]); a short read is an error.
//!
//! Our commands (`WindowFd`, `TapFd`, `DiskFd`, `VsockFd`) use numbers from 0x8000 up, which a
//! Cloud Hypervisor receiver refuses ("received request with unknown
//! command"): a mismatched pair fails at once and the sender resumes its VM.

use std::io::{self, Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};

use crate::fd_socket::{self, FdSocketError};

/// Size of a request or response header on the wire.
pub const HEADER_LEN: usize = 16;

/// The protocol version we send in `Start`: Cloud Hypervisor's
/// `CURRENT_PROTOCOL_VERSION` (0), so either side accepts the other.
pub const CURRENT_PROTOCOL_VERSION: u16 = 0;

/// `Config`'s payload: the VM's configuration, CPUID and memory layout as
/// JSON, a few KiB to a few hundred KiB (254 vCPUs, a few hundred CPUID
/// leaves); 16 MiB is far above any real one.
pub const MAX_CONFIG_PAYLOAD: u64 = 16 << 20;
/// `State`'s payload: the state document. Its largest parts are the vCPUs
/// (XSAVE, MSRs and LAPIC as JSON: tens of KiB each, 254 at most) and the
/// daemon's record of its inodes and handles (about 100 bytes each): 256 MiB
/// holds over two million of them.
pub const MAX_STATE_PAYLOAD: u64 = 256 << 20;
/// `Memory`'s payload: a table of 16-byte ranges (the bytes of guest memory
/// follow it, sized by the table). 256 MiB is 16 Mi ranges: every other 4 KiB
/// page of a 128 GiB guest.
pub const MAX_MEMORY_TABLE_PAYLOAD: u64 = 256 << 20;
/// `WindowFd`, `TapFd`, `DiskFd` and `VsockFd`: a short JSON label naming
/// the device and file.
pub const MAX_FD_LABEL_PAYLOAD: u64 = 4096;
/// A response's payload: only an `Ok` to `PageFault` carries one, the page;
/// Cloud Hypervisor's page-fault server refuses pages above 1 GiB
/// (`MAX_PAGE` in its vmm/src/lib.rs), so no valid response exceeds it.
pub const MAX_RESPONSE_PAYLOAD: u64 = 1 << 30;
/// An `Error` response's payload (ours): the receiver's reason, as text.
/// Cloud Hypervisor sends none and its senders read none (they stop at
/// the status), so a reason costs a mixed pair nothing.
pub const MAX_ERROR_REASON: u64 = 1024;
/// The largest `length` any decoded header may carry.
pub const MAX_PAYLOAD: u64 = MAX_RESPONSE_PAYLOAD;

/// Size of a `MemoryRange` on the wire: `{gpa: u64, length: u64}`.
pub const MEMORY_RANGE_LEN: usize = 16;
/// Size of `MemoryFd`'s payload: the slot number, u32 little-endian.
pub const MEMORY_FD_PAYLOAD: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("migration socket: {0}")]
    Io(#[source] io::Error),
    #[error("the peer closed the migration socket in the middle of a {what} ({got} of {expected} bytes)")]
    Truncated {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("received request with unknown command {0:#x}")]
    UnknownCommand(u16),
    #[error("received response with unknown status {0}")]
    UnknownStatus(u16),
    #[error("{command:?}: length {length} is not {bound}")]
    BadLength {
        command: Command,
        length: u64,
        bound: PayloadBound,
    },
    #[error(
        "a {status:?} response with a {length}-byte payload (at most {max}; only Ok and Error carry one)"
    )]
    BadResponseLength {
        status: Status,
        length: u64,
        max: u64,
    },
    #[error("sender protocol version {0} is not one this VMM accepts ({CURRENT_PROTOCOL_VERSION} or the one before it)")]
    UnsupportedVersion(u16),
    #[error("{0:?} carries no protocol version (only Start does)")]
    NotStart(Command),
    #[error("{0:?} passes no fd")]
    NoFdCommand(Command),
    #[error("{0:?}: no fd came with the payload")]
    MissingFd(Command),
    #[error("{command:?}: range {index}: gpa {gpa:#x} + length {length:#x} overflows")]
    RangeOverflow {
        command: Command,
        index: usize,
        gpa: u64,
        length: u64,
    },
    #[error("{command:?}: label: {reason}")]
    BadLabel { command: Command, reason: String },
    #[error(transparent)]
    Fd(#[from] FdSocketError),
}

/// A request's command (Cloud Hypervisor's `Command` numbers 1..=9; its 0,
/// `Invalid`, means nothing and is refused like an unknown one).
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Start = 1,
    Config = 2,
    State = 3,
    Memory = 4,
    /// Finish and resume the VM (the source was running).
    Complete = 5,
    Abandon = 6,
    MemoryFd = 7,
    /// Finish and leave the VM paused (the source was paused).
    CompletePaused = 8,
    PageFault = 9,
    /// Ours: one file mapped in a DAX window, with its label.
    WindowFd = 0x8001,
    /// Ours: a net device's tap, with its label.
    TapFd = 0x8002,
    /// Ours: a blk device's open image (its lock with it), with its label.
    DiskFd = 0x8003,
    /// Ours: the vsock device's listening socket, with its label.
    VsockFd = 0x8004,
}

/// Every command; a number on the wire is looked up here.
pub const ALL_COMMANDS: [Command; 13] = [
    Command::Start,
    Command::Config,
    Command::State,
    Command::Memory,
    Command::Complete,
    Command::Abandon,
    Command::MemoryFd,
    Command::CompletePaused,
    Command::PageFault,
    Command::WindowFd,
    Command::TapFd,
    Command::DiskFd,
    Command::VsockFd,
];

/// The lengths a command may announce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadBound {
    Exactly(u64),
    /// 1 to `max` bytes.
    UpTo(u64),
    /// A multiple of `unit`, 1 to `max` bytes.
    Multiple {
        unit: u64,
        max: u64,
    },
}

impl std::fmt::Display for PayloadBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayloadBound::Exactly(n) => write!(f, "{n}"),
            PayloadBound::UpTo(max) => write!(f, "1 to {max}"),
            PayloadBound::Multiple { unit, max } => write!(f, "a multiple of {unit}, 1 to {max}"),
        }
    }
}

impl PayloadBound {
    pub fn admits(self, length: u64) -> bool {
        match self {
            PayloadBound::Exactly(n) => length == n,
            PayloadBound::UpTo(max) => (1..=max).contains(&length),
            PayloadBound::Multiple { unit, max } => {
                (1..=max).contains(&length) && length.is_multiple_of(unit)
            }
        }
    }
}

impl Command {
    /// The number on the wire.
    pub const fn number(self) -> u16 {
        self as u16
    }

    pub fn from_number(number: u16) -> Result<Command, ProtocolError> {
        ALL_COMMANDS
            .into_iter()
            .find(|c| c.number() == number)
            .ok_or(ProtocolError::UnknownCommand(number))
    }

    /// What `length` may be: what Cloud Hypervisor sends for its commands
    /// (0 where there is no payload, 4 for `MemoryFd`'s slot, one range for
    /// `PageFault`), and a cap where the payload is variable.
    pub const fn payload_bound(self) -> PayloadBound {
        match self {
            Command::Start | Command::Complete | Command::Abandon | Command::CompletePaused => {
                PayloadBound::Exactly(0)
            }
            Command::MemoryFd => PayloadBound::Exactly(MEMORY_FD_PAYLOAD as u64),
            Command::PageFault => PayloadBound::Exactly(MEMORY_RANGE_LEN as u64),
            Command::Config => PayloadBound::UpTo(MAX_CONFIG_PAYLOAD),
            Command::State => PayloadBound::UpTo(MAX_STATE_PAYLOAD),
            Command::Memory => PayloadBound::Multiple {
                unit: MEMORY_RANGE_LEN as u64,
                max: MAX_MEMORY_TABLE_PAYLOAD,
            },
            Command::WindowFd | Command::TapFd | Command::DiskFd | Command::VsockFd => {
                PayloadBound::UpTo(MAX_FD_LABEL_PAYLOAD)
            }
        }
    }

    /// Whether one fd travels with the payload (SCM_RIGHTS).
    pub const fn passes_fd(self) -> bool {
        matches!(
            self,
            Command::MemoryFd
                | Command::WindowFd
                | Command::TapFd
                | Command::DiskFd
                | Command::VsockFd
        )
    }
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    command: Command,
    command_headers: [u8; 6],
    length: u64,
}

impl Request {
    /// A request announcing `length` payload bytes; a length the receiver
    /// would refuse is refused here, before anything is sent.
    pub fn new(command: Command, length: u64) -> Result<Request, ProtocolError> {
        check_length(command, length)?;
        Ok(Request {
            command,
            command_headers: [0; 6],
            length,
        })
    }

    /// `Start` with our protocol version in `command_headers[0..2]`.
    pub fn start() -> Request {
        let mut command_headers = [0; 6];
        let [lo, hi] = CURRENT_PROTOCOL_VERSION.to_le_bytes();
        command_headers[0] = lo;
        command_headers[1] = hi;
        Request {
            command: Command::Start,
            command_headers,
            length: 0,
        }
    }

    pub fn command(&self) -> Command {
        self.command
    }

    pub fn length(&self) -> u64 {
        self.length
    }

    /// The sender's version from a `Start`, if we accept it: ours or the
    /// one before (saturating at 0), as Cloud Hypervisor's receiver does.
    pub fn sender_protocol_version(&self) -> Result<u16, ProtocolError> {
        if self.command != Command::Start {
            return Err(ProtocolError::NotStart(self.command));
        }
        let version = u16::from_le_bytes([self.command_headers[0], self.command_headers[1]]);
        if (CURRENT_PROTOCOL_VERSION.saturating_sub(1)..=CURRENT_PROTOCOL_VERSION)
            .contains(&version)
        {
            Ok(version)
        } else {
            Err(ProtocolError::UnsupportedVersion(version))
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        encode_header(self.command.number(), self.command_headers, self.length)
    }

    /// Decodes a header: the command must be known and the length within
    /// its bound.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Request, ProtocolError> {
        let (number, command_headers, length) = split_header(bytes);
        let command = Command::from_number(number)?;
        check_length(command, length)?;
        Ok(Request {
            command,
            command_headers,
            length,
        })
    }

    pub fn read_from(reader: &mut impl Read) -> Result<Request, ProtocolError> {
        Request::decode(&read_header(reader, "request header")?)
    }

    pub fn write_to(&self, writer: &mut impl Write) -> Result<(), ProtocolError> {
        writer.write_all(&self.encode()).map_err(ProtocolError::Io)
    }
}

/// A response's status (Cloud Hypervisor's `Status`).
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Invalid = 0,
    Ok = 1,
    Error = 2,
}

/// A response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    status: Status,
    length: u64,
}

impl Response {
    pub fn ok() -> Response {
        Response {
            status: Status::Ok,
            length: 0,
        }
    }

    pub fn error() -> Response {
        Response {
            status: Status::Error,
            length: 0,
        }
    }

    /// Writes an `Error` response carrying `reason` (cut at a character
    /// boundary to at most [`MAX_ERROR_REASON`] bytes).
    pub fn write_error_with_reason(
        writer: &mut impl Write,
        reason: &str,
    ) -> Result<(), ProtocolError> {
        let max = usize::try_from(MAX_ERROR_REASON).unwrap_or(usize::MAX);
        let text = cut_at_char_boundary(reason, max).as_bytes();
        let header = Response {
            status: Status::Error,
            length: u64::try_from(text.len()).unwrap_or(MAX_ERROR_REASON),
        };
        let mut message = header.encode().to_vec();
        message.extend_from_slice(text);
        writer.write_all(&message).map_err(ProtocolError::Io)
    }

    /// An `Error` response's reason (read from `reader`, printable
    /// characters only: it goes into logs and API answers); None for any
    /// other response or an empty reason.
    pub fn read_reason(&self, reader: &mut impl Read) -> Result<Option<String>, ProtocolError> {
        if self.status != Status::Error || self.length == 0 {
            return Ok(None);
        }
        // Bounded by MAX_ERROR_REASON when the header was decoded.
        let mut bytes = vec![0; usize::try_from(self.length.min(MAX_ERROR_REASON)).unwrap_or(0)];
        read_exactly(reader, &mut bytes, "error reason")?;
        Ok(printable_reason(&bytes))
    }

    pub fn status(&self) -> Status {
        self.status
    }

    pub fn length(&self) -> u64 {
        self.length
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        encode_header(self.status as u16, [0; 6], self.length)
    }

    /// Decodes a header: a known status; a payload only on `Ok`, at most
    /// [`MAX_RESPONSE_PAYLOAD`], and on `Error`, its reason, at most
    /// [`MAX_ERROR_REASON`].
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Response, ProtocolError> {
        let (number, _padding, length) = split_header(bytes);
        let status = match number {
            0 => Status::Invalid,
            1 => Status::Ok,
            2 => Status::Error,
            n => return Err(ProtocolError::UnknownStatus(n)),
        };
        let max = match status {
            Status::Ok => MAX_RESPONSE_PAYLOAD,
            Status::Error => MAX_ERROR_REASON,
            Status::Invalid => 0,
        };
        if length > max {
            return Err(ProtocolError::BadResponseLength {
                status,
                length,
                max,
            });
        }
        Ok(Response { status, length })
    }

    pub fn read_from(reader: &mut impl Read) -> Result<Response, ProtocolError> {
        Response::decode(&read_header(reader, "response header")?)
    }

    pub fn write_to(&self, writer: &mut impl Write) -> Result<(), ProtocolError> {
        writer.write_all(&self.encode()).map_err(ProtocolError::Io)
    }
}

fn check_length(command: Command, length: u64) -> Result<(), ProtocolError> {
    let bound = command.payload_bound();
    if bound.admits(length) {
        Ok(())
    } else {
        Err(ProtocolError::BadLength {
            command,
            length,
            bound,
        })
    }
}

fn encode_header(kind: u16, headers: [u8; 6], length: u64) -> [u8; HEADER_LEN] {
    let mut bytes = [0; HEADER_LEN];
    let (k, rest) = bytes.split_at_mut(2);
    let (h, l) = rest.split_at_mut(6);
    k.copy_from_slice(&kind.to_le_bytes());
    h.copy_from_slice(&headers);
    l.copy_from_slice(&length.to_le_bytes());
    bytes
}

fn split_header(bytes: &[u8; HEADER_LEN]) -> (u16, [u8; 6], u64) {
    let [k0, k1, h0, h1, h2, h3, h4, h5, l0, l1, l2, l3, l4, l5, l6, l7] = *bytes;
    (
        u16::from_le_bytes([k0, k1]),
        [h0, h1, h2, h3, h4, h5],
        u64::from_le_bytes([l0, l1, l2, l3, l4, l5, l6, l7]),
    )
}

fn read_header(
    reader: &mut impl Read,
    what: &'static str,
) -> Result<[u8; HEADER_LEN], ProtocolError> {
    let mut bytes = [0; HEADER_LEN];
    read_exactly(reader, &mut bytes, what)?;
    Ok(bytes)
}

/// `read_exact` that reports how far it got.
fn read_exactly(
    reader: &mut impl Read,
    buf: &mut [u8],
    what: &'static str,
) -> Result<(), ProtocolError> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(buf.get_mut(got..).unwrap_or_default()) {
            Ok(0) => {
                return Err(ProtocolError::Truncated {
                    what,
                    got,
                    expected: buf.len(),
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProtocolError::Io(e)),
        }
    }
    Ok(())
}

/// Reads a request's payload (its length was bounded when the header was
/// decoded). The buffer grows as bytes arrive, so a peer that announces
/// much and sends little costs little.
pub fn read_payload(reader: &mut impl Read, request: &Request) -> Result<Vec<u8>, ProtocolError> {
    let expected = usize::try_from(request.length).map_err(|_| ProtocolError::BadLength {
        command: request.command,
        length: request.length,
        bound: request.command.payload_bound(),
    })?;
    let mut payload = Vec::with_capacity(expected.min(1 << 20));
    let got = reader
        .take(request.length)
        .read_to_end(&mut payload)
        .map_err(ProtocolError::Io)?;
    if got != expected {
        return Err(ProtocolError::Truncated {
            what: "payload",
            got,
            expected,
        });
    }
    Ok(payload)
}

/// Sends a request whose payload travels with one fd: the header by a
/// plain write, then the payload and the fd in one `sendmsg` (Cloud
/// Hypervisor's `send_memory_fds` does the same for `MemoryFd`).
pub fn send_request_with_fd(
    socket: &UnixStream,
    command: Command,
    payload: &[u8],
    fd: BorrowedFd<'_>,
) -> Result<(), ProtocolError> {
    if !command.passes_fd() {
        return Err(ProtocolError::NoFdCommand(command));
    }
    let length = u64::try_from(payload.len()).unwrap_or(u64::MAX);
    let request = Request::new(command, length)?;
    let mut writer = socket;
    request.write_to(&mut writer)?;
    fd_socket::send_with_fds(socket, payload, &[fd])?;
    Ok(())
}

/// Receives the payload of a request that passes an fd (its header already
/// read): exactly one fd must come with it; a second is closed and refused.
pub fn recv_payload_with_fd(
    socket: &UnixStream,
    request: &Request,
) -> Result<(Vec<u8>, OwnedFd), ProtocolError> {
    if !request.command.passes_fd() {
        return Err(ProtocolError::NoFdCommand(request.command));
    }
    // Bounded by MAX_FD_LABEL_PAYLOAD when the header was decoded.
    let length = usize::try_from(request.length).unwrap_or(usize::MAX);
    let mut payload = vec![0; length];
    let mut fds = fd_socket::recv_with_fds(socket, &mut payload, 1)?;
    let fd = fds.pop().ok_or(ProtocolError::MissingFd(request.command))?;
    Ok((payload, fd))
}

/// A guest-memory range, as `PageFault` and `Memory` carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRange {
    pub gpa: u64,
    pub length: u64,
}

impl MemoryRange {
    pub fn encode(&self) -> [u8; MEMORY_RANGE_LEN] {
        let mut bytes = [0; MEMORY_RANGE_LEN];
        let (g, l) = bytes.split_at_mut(8);
        g.copy_from_slice(&self.gpa.to_le_bytes());
        l.copy_from_slice(&self.length.to_le_bytes());
        bytes
    }
}

/// Decodes `Memory`'s or `PageFault`'s ranges: whole 16-byte ranges, none
/// whose end overflows.
pub fn decode_ranges(command: Command, payload: &[u8]) -> Result<Vec<MemoryRange>, ProtocolError> {
    let length = u64::try_from(payload.len()).unwrap_or(u64::MAX);
    check_length(command, length)?;
    if !matches!(command, Command::Memory | Command::PageFault) {
        return Err(ProtocolError::BadLength {
            command,
            length,
            bound: PayloadBound::Exactly(0),
        });
    }
    let mut ranges = Vec::with_capacity(payload.len() / MEMORY_RANGE_LEN);
    for (index, chunk) in payload.chunks_exact(MEMORY_RANGE_LEN).enumerate() {
        let mut gpa = [0; 8];
        let mut len = [0; 8];
        gpa.copy_from_slice(chunk.get(..8).unwrap_or_default());
        len.copy_from_slice(chunk.get(8..).unwrap_or_default());
        let range = MemoryRange {
            gpa: u64::from_le_bytes(gpa),
            length: u64::from_le_bytes(len),
        };
        if range.gpa.checked_add(range.length).is_none() {
            return Err(ProtocolError::RangeOverflow {
                command,
                index,
                gpa: range.gpa,
                length: range.length,
            });
        }
        ranges.push(range);
    }
    Ok(ranges)
}

/// `MemoryFd`'s payload: the memory slot the fd backs.
pub fn encode_memory_fd_slot(slot: u32) -> [u8; MEMORY_FD_PAYLOAD] {
    slot.to_le_bytes()
}

pub fn decode_memory_fd_slot(payload: &[u8]) -> Result<u32, ProtocolError> {
    let bytes: [u8; MEMORY_FD_PAYLOAD] =
        payload.try_into().map_err(|_| ProtocolError::BadLength {
            command: Command::MemoryFd,
            length: u64::try_from(payload.len()).unwrap_or(u64::MAX),
            bound: Command::MemoryFd.payload_bound(),
        })?;
    Ok(u32::from_le_bytes(bytes))
}

/// What a `WindowFd`, `TapFd`, `DiskFd` or `VsockFd` fd is: the device it
/// belongs to and, for a DAX window's file, its `(dev, ino)` key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdLabel {
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<[u64; 2]>,
}

impl FdLabel {
    pub fn encode(&self) -> Vec<u8> {
        // A struct of a string and integers always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a label: a `WindowFd` names its file's key, a `TapFd`,
    /// `DiskFd` or `VsockFd` none; the device id is not empty.
    pub fn decode(command: Command, payload: &[u8]) -> Result<FdLabel, ProtocolError> {
        let bad = |reason: String| ProtocolError::BadLabel { command, reason };
        let length = u64::try_from(payload.len()).unwrap_or(u64::MAX);
        check_length(command, length)?;
        let label: FdLabel = serde_json::from_slice(payload).map_err(|e| bad(e.to_string()))?;
        if label.device.is_empty() {
            return Err(bad("device is empty".to_string()));
        }
        match (command, label.key.is_some()) {
            (Command::WindowFd, true)
            | (Command::TapFd | Command::DiskFd | Command::VsockFd, false) => Ok(label),
            (Command::WindowFd, false) => Err(bad("key is missing".to_string())),
            (Command::TapFd, true) => Err(bad("a tap has no key".to_string())),
            (Command::DiskFd, true) => Err(bad("a disk has no key".to_string())),
            (Command::VsockFd, true) => Err(bad("a vsock socket has no key".to_string())),
            _ => Err(bad(
                "only WindowFd, TapFd, DiskFd and VsockFd carry a label".to_string(),
            )),
        }
    }
}

/// A peer's reason text as it may go into a log line or an API answer:
/// invalid UTF-8 replaced, control characters (newlines, escapes) turned
/// into spaces, trimmed; None when nothing is left.
pub fn printable_reason(bytes: &[u8]) -> Option<String> {
    let text: String = String::from_utf8_lossy(bytes)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// The longest prefix of `text` of at most `max` bytes that ends on a
/// character boundary.
pub fn cut_at_char_boundary(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

#[cfg(test)]
#[path = "protocol_tests.rs"]
mod tests;
