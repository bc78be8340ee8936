//! The virtio-vsock packet header (virtio 1.2 §5.10.6) as plain values, and
//! the checks every header from the guest passes before the connection
//! table sees it. Descriptor layout (header and data lengths against the
//! descriptors) is checked by rust-vmm's `virtio-vsock` crate in
//! [`super::queues`]; what is checked here is what the header says.

/// The host's context id: every guest-to-host packet goes to it.
pub const HOST_CID: u64 = 2;
/// Header bytes on the wire.
pub const HEADER_LEN: usize = 44;
/// The largest payload one packet may carry (Linux's
/// VIRTIO_VSOCK_MAX_PKT_BUF_SIZE); a longer `len` is refused.
pub const MAX_PAYLOAD: u32 = 64 * 1024;

pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// A packet header, host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    /// Reads a header from its 44 little-endian bytes.
    pub fn from_bytes(b: &[u8; HEADER_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"));
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// Why a packet from the guest was not taken.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("src_cid {got} is not the guest's cid {guest_cid}")]
    SourceCid { got: u64, guest_cid: u64 },
    #[error("dst_cid {0} is not the host (2)")]
    DestinationCid(u64),
    #[error("type {0} is not a stream (1); only stream sockets exist")]
    Type(u16),
    #[error("unknown op {0}")]
    Op(u16),
    #[error("len {len} exceeds the payload limit {MAX_PAYLOAD}")]
    Length { len: u32 },
    #[error("len {len} on op {op}, which carries no payload")]
    PayloadOnControl { len: u32, op: u16 },
    #[error("the descriptors hold {got} payload bytes, the header says {len}")]
    Truncated { len: u32, got: usize },
}

impl PacketError {
    /// Whether the guest should hear an RST for the packet: it names a
    /// connection (right cids), only its contents are wrong. A packet with
    /// the wrong cids is dropped: answering it would talk to no one.
    pub fn deserves_reset(&self) -> bool {
        !matches!(
            self,
            PacketError::SourceCid { .. } | PacketError::DestinationCid(_)
        )
    }
}

/// Checks a header from the guest and the payload that came with it.
pub fn validate(h: &Header, payload_len: usize, guest_cid: u64) -> Result<(), PacketError> {
    if h.src_cid != guest_cid {
        return Err(PacketError::SourceCid {
            got: h.src_cid,
            guest_cid,
        });
    }
    if h.dst_cid != HOST_CID {
        return Err(PacketError::DestinationCid(h.dst_cid));
    }
    if h.type_ != TYPE_STREAM {
        return Err(PacketError::Type(h.type_));
    }
    if !(OP_REQUEST..=OP_CREDIT_REQUEST).contains(&h.op) {
        return Err(PacketError::Op(h.op));
    }
    if h.len > MAX_PAYLOAD {
        return Err(PacketError::Length { len: h.len });
    }
    if h.op != OP_RW && h.len != 0 {
        return Err(PacketError::PayloadOnControl {
            len: h.len,
            op: h.op,
        });
    }
    // `len` fits a usize: it is at most MAX_PAYLOAD.
    if payload_len != h.len as usize {
        return Err(PacketError::Truncated {
            len: h.len,
            got: payload_len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1000,
            dst_port: 5000,
            len,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 7,
        }
    }

    #[test]
    fn header_round_trips_through_its_wire_bytes() {
        let h = rw(12);
        let b = h.to_bytes();
        assert_eq!(Header::from_bytes(&b), h);
        // Little-endian at the spec's offsets.
        assert_eq!(&b[24..28], &12u32.to_le_bytes());
        assert_eq!(&b[30..32], &OP_RW.to_le_bytes());
    }

    #[test]
    fn every_field_is_checked() {
        assert_eq!(validate(&rw(12), 12, 3), Ok(()));
        let e = |h: Header, n: usize| validate(&h, n, 3).unwrap_err();
        assert_eq!(
            e(
                Header {
                    src_cid: 4,
                    ..rw(0)
                },
                0
            ),
            PacketError::SourceCid {
                got: 4,
                guest_cid: 3
            }
        );
        assert_eq!(
            e(
                Header {
                    dst_cid: 1,
                    ..rw(0)
                },
                0
            ),
            PacketError::DestinationCid(1)
        );
        assert_eq!(e(Header { type_: 2, ..rw(0) }, 0), PacketError::Type(2));
        assert_eq!(e(Header { op: 0, ..rw(0) }, 0), PacketError::Op(0));
        assert_eq!(e(Header { op: 8, ..rw(0) }, 0), PacketError::Op(8));
        assert_eq!(
            e(rw(MAX_PAYLOAD + 1), 0),
            PacketError::Length {
                len: MAX_PAYLOAD + 1
            }
        );
        assert_eq!(
            e(
                Header {
                    op: OP_REQUEST,
                    ..rw(4)
                },
                4
            ),
            PacketError::PayloadOnControl {
                len: 4,
                op: OP_REQUEST
            }
        );
        assert_eq!(e(rw(10), 9), PacketError::Truncated { len: 10, got: 9 });
        assert!(!e(
            Header {
                src_cid: 4,
                ..rw(0)
            },
            0
        )
        .deserves_reset());
        assert!(e(Header { op: 9, ..rw(0) }, 0).deserves_reset());
    }
}
