//! The virtio-net header (`virtio_net_hdr_v1`, virtio 1.2 §5.1.6, 12 bytes)
//! that precedes every frame on both queues, and what it allows.
//!
//! The tap is opened with `IFF_VNET_HDR` and a header size of 12
//! (`TUNSETVNETHDRSZ`), so the kernel reads and writes the same layout: a
//! TX frame goes to the tap as the guest wrote it, header included, and an
//! RX frame comes from the tap with its header. This module checks a TX
//! header against what the guest negotiated (a GSO type the tap was not
//! told to accept would be refused by the kernel anyway; here it is refused
//! first with a reason), fills `num_buffers` on RX, and maps the acked
//! guest offloads to the tap's `TUNSETOFFLOAD` flags.

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_HDR_F_DATA_VALID, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_ECN,
    VIRTIO_NET_HDR_GSO_NONE, VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_HDR_GSO_TCPV6,
};

/// Size of `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size,
/// csum_start, csum_offset, num_buffers.
pub const VNET_HDR_LEN: usize = 12;

/// The largest frame either queue moves, header included: a 64 KiB TSO
/// frame with its Ethernet and VLAN headers (as Firecracker bounds it).
pub const MAX_FRAME_LEN: usize = 65562;

/// The checksum offloads (`offload_csum`).
pub const CSUM_FEATURES: u64 = (1 << VIRTIO_NET_F_CSUM) | (1 << VIRTIO_NET_F_GUEST_CSUM);

/// Offloads this device offers where the tap accepts them: checksums and
/// TCP segmentation both ways. UFO is left out (the kernel segments UDP).
pub const OFFLOAD_FEATURES: u64 = (1 << VIRTIO_NET_F_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_TSO4)
    | (1 << VIRTIO_NET_F_GUEST_TSO6)
    | (1 << VIRTIO_NET_F_GUEST_ECN)
    | (1 << VIRTIO_NET_F_HOST_TSO4)
    | (1 << VIRTIO_NET_F_HOST_TSO6)
    | (1 << VIRTIO_NET_F_HOST_ECN);

/// The offloads a config allows (`offload_csum`, `offload_tso`): TSO
/// needs checksum offload, so without it there is none.
pub fn allowed_offloads(csum: bool, tso: bool) -> u64 {
    match (csum, tso) {
        (false, _) => 0,
        (true, false) => CSUM_FEATURES,
        (true, true) => OFFLOAD_FEATURES,
    }
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("frame of {0} bytes is shorter than the {VNET_HDR_LEN}-byte virtio-net header")]
    Short(usize),
    #[error("header flags {0:#x}: only NEEDS_CSUM (1) and DATA_VALID (2) exist")]
    Flags(u8),
    #[error("NEEDS_CSUM without VIRTIO_NET_F_CSUM negotiated")]
    ChecksumNotNegotiated,
    #[error("checksum at {start}+{offset} lies past the {len}-byte frame")]
    ChecksumOutside { start: u16, offset: u16, len: usize },
    #[error(
        "gso_type {0:#x} is not one this device accepts (none, TCPv4, TCPv6, with or without ECN)"
    )]
    GsoType(u8),
    #[error("gso_type {0:#x} without the matching HOST_TSO/HOST_ECN feature negotiated")]
    GsoNotNegotiated(u8),
    #[error("GSO frame without NEEDS_CSUM or with gso_size 0")]
    GsoIncomplete,
    #[error("gso_size {0:#x} is GSO_BY_FRAGS, not a segment size")]
    GsoByFrags(u16),
    #[error("csum_start {start} lies inside the minimal {min}-byte network header")]
    ChecksumStart { start: u16, min: u16 },
    #[error("TCP GSO with csum_offset {0}: the TCP checksum is at offset {TCP_CSUM_OFFSET}")]
    TcpChecksumOffset(u16),
    #[error(
        "TCP header at csum_start {start} ({TCP_HDR_LEN} bytes) lies past the {len}-byte frame"
    )]
    TransportOutside { start: u16, len: usize },
    #[error("hdr_len {hdr_len} lies past the {len}-byte frame")]
    HdrLen { hdr_len: u16, len: usize },
}

/// Where a TCP header's checksum lies (`offsetof(struct tcphdr, check)`).
pub const TCP_CSUM_OFFSET: u16 = 16;
/// A TCP header without options (`sizeof(struct tcphdr)`).
pub const TCP_HDR_LEN: u16 = 20;
/// The smallest network headers: IPv4 without options, IPv6.
const IPV4_HDR_LEN: u16 = 20;
const IPV6_HDR_LEN: u16 = 40;
/// `GSO_BY_FRAGS`: a kernel-internal gso_size no guest may give.
const GSO_BY_FRAGS: u16 = 0xffff;

/// The fields of a `virtio_net_hdr_v1` (little-endian on the wire).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHeader {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
    pub num_buffers: u16,
}

impl VnetHeader {
    /// Reads the header at the start of `frame`.
    pub fn parse(frame: &[u8]) -> Result<Self, HeaderError> {
        let h = frame
            .get(..VNET_HDR_LEN)
            .ok_or(HeaderError::Short(frame.len()))?;
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        Ok(VnetHeader {
            flags: h[0],
            gso_type: h[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
            num_buffers: u16_at(10),
        })
    }

    pub fn to_bytes(self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        for (at, v) in [
            (2, self.hdr_len),
            (4, self.gso_size),
            (6, self.csum_start),
            (8, self.csum_offset),
            (10, self.num_buffers),
        ] {
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// Checks a guest's TX frame (header and packet) against the features it
/// acked; the frame then goes to the tap unchanged.
pub fn check_tx(frame: &[u8], acked: u64) -> Result<VnetHeader, HeaderError> {
    let h = VnetHeader::parse(frame)?;
    check_tx_header(h, frame.len() - VNET_HDR_LEN, acked)
}

/// [`check_tx`] on a header already read, before a packet of
/// `packet_len` bytes.
///
/// What Linux's `virtio_net_hdr_to_skb` (and tun's `hdr_len` check)
/// refuses is refused here first, so a frame the tap would reject, or one
/// whose offsets point outside it, never reaches it: the checksum field
/// and (for TCP GSO) a whole TCP header inside the frame, `csum_start`
/// past the smallest network header, a TCP GSO checksum at the TCP
/// header's checksum field, a real segment size, `hdr_len` inside the frame.
pub fn check_tx_header(
    h: VnetHeader,
    packet_len: usize,
    acked: u64,
) -> Result<VnetHeader, HeaderError> {
    let has = |bit: u32| acked & (1 << bit) != 0;
    let known =
        const { narrow::u8_of((VIRTIO_NET_HDR_F_NEEDS_CSUM | VIRTIO_NET_HDR_F_DATA_VALID) as u64) };
    if h.flags & !known != 0 {
        return Err(HeaderError::Flags(h.flags));
    }
    let needs_csum = h.flags & const { narrow::u8_of(VIRTIO_NET_HDR_F_NEEDS_CSUM as u64) } != 0;
    if needs_csum && !has(VIRTIO_NET_F_CSUM) {
        return Err(HeaderError::ChecksumNotNegotiated);
    }
    let ecn = h.gso_type & const { narrow::u8_of(VIRTIO_NET_HDR_GSO_ECN as u64) } != 0;
    let gso = h.gso_type & !(const { narrow::u8_of(VIRTIO_NET_HDR_GSO_ECN as u64) });
    // (feature needed, smallest network header) for a TCP GSO frame.
    let tcp_gso = match u32::from(gso) {
        VIRTIO_NET_HDR_GSO_NONE if !ecn => None,
        VIRTIO_NET_HDR_GSO_TCPV4 => Some((VIRTIO_NET_F_HOST_TSO4, IPV4_HDR_LEN)),
        VIRTIO_NET_HDR_GSO_TCPV6 => Some((VIRTIO_NET_F_HOST_TSO6, IPV6_HDR_LEN)),
        _ => return Err(HeaderError::GsoType(h.gso_type)),
    };
    if let Some((needed, _)) = tcp_gso {
        if !has(needed) || (ecn && !has(VIRTIO_NET_F_HOST_ECN)) {
            return Err(HeaderError::GsoNotNegotiated(h.gso_type));
        }
        if !needs_csum || h.gso_size == 0 {
            return Err(HeaderError::GsoIncomplete);
        }
        if h.gso_size == GSO_BY_FRAGS {
            return Err(HeaderError::GsoByFrags(h.gso_size));
        }
        if h.csum_offset != TCP_CSUM_OFFSET {
            return Err(HeaderError::TcpChecksumOffset(h.csum_offset));
        }
    }
    if needs_csum {
        // The kernel writes the 16-bit checksum at csum_start + csum_offset
        // within the packet; it must lie inside it.
        let start = usize::from(h.csum_start);
        if start + usize::from(h.csum_offset) + 2 > packet_len {
            return Err(HeaderError::ChecksumOutside {
                start: h.csum_start,
                offset: h.csum_offset,
                len: packet_len,
            });
        }
        let min = tcp_gso.map_or(IPV4_HDR_LEN, |(_, min)| min);
        if h.csum_start < min {
            return Err(HeaderError::ChecksumStart {
                start: h.csum_start,
                min,
            });
        }
        if tcp_gso.is_some() && start + usize::from(TCP_HDR_LEN) > packet_len {
            return Err(HeaderError::TransportOutside {
                start: h.csum_start,
                len: packet_len,
            });
        }
    }
    if usize::from(h.hdr_len) > packet_len {
        return Err(HeaderError::HdrLen {
            hdr_len: h.hdr_len,
            len: packet_len,
        });
    }
    Ok(h)
}

/// The byte offset of `num_buffers` in the header.
pub const NUM_BUFFERS_OFFSET: usize = 10;

/// Sets `num_buffers` in an RX frame's header: how many chains the frame
/// spans (always 1 without `VIRTIO_NET_F_MRG_RXBUF`). The tap does not
/// write the field: it skips the last 2 bytes of the 12-byte header.
pub fn set_num_buffers(frame: &mut [u8], n: u16) -> Result<(), HeaderError> {
    let len = frame.len();
    let field = frame
        .get_mut(NUM_BUFFERS_OFFSET..VNET_HDR_LEN)
        .ok_or(HeaderError::Short(len))?;
    field.copy_from_slice(&n.to_le_bytes());
    Ok(())
}

/// The `TUNSETOFFLOAD` flags for what the guest acked: what the tap may
/// hand the guest (partial checksums, TSO frames) is what the guest said
/// it takes. Without them the kernel finishes checksums and segments
/// before the frame reaches the tap's reader.
pub fn tap_offload_flags(acked: u64) -> u32 {
    let has = |bit: u32| acked & (1 << bit) != 0;
    let mut flags = 0;
    if has(VIRTIO_NET_F_GUEST_CSUM) {
        flags |= libc::TUN_F_CSUM;
        if has(VIRTIO_NET_F_GUEST_TSO4) {
            flags |= libc::TUN_F_TSO4;
        }
        if has(VIRTIO_NET_F_GUEST_TSO6) {
            flags |= libc::TUN_F_TSO6;
        }
        if has(VIRTIO_NET_F_GUEST_ECN) && flags & (libc::TUN_F_TSO4 | libc::TUN_F_TSO6) != 0 {
            flags |= libc::TUN_F_TSO_ECN;
        }
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 = OFFLOAD_FEATURES;

    fn frame(h: VnetHeader, packet_len: usize) -> Vec<u8> {
        let mut f = h.to_bytes().to_vec();
        f.resize(VNET_HDR_LEN + packet_len, 0xab);
        f
    }

    #[test]
    fn header_bytes_round_trip_little_endian() {
        let h = VnetHeader {
            flags: 1,
            gso_type: 4,
            hdr_len: 0x1234,
            gso_size: 1448,
            csum_start: 54,
            csum_offset: 16,
            num_buffers: 1,
        };
        let b = h.to_bytes();
        assert_eq!(&b[2..4], &[0x34, 0x12]);
        assert_eq!(VnetHeader::parse(&b).unwrap(), h);
        assert_eq!(VnetHeader::parse(&b[..11]), Err(HeaderError::Short(11)));
    }

    #[test]
    fn tx_headers_are_checked_against_the_acked_features() {
        let plain = VnetHeader::default();
        assert!(check_tx(&frame(plain, 60), 0).is_ok());
        assert_eq!(check_tx(&[0; 5], ALL), Err(HeaderError::Short(5)));
        let csum = VnetHeader {
            flags: 1,
            csum_start: 34,
            csum_offset: 16,
            ..plain
        };
        assert!(check_tx(&frame(csum, 60), ALL).is_ok());
        assert_eq!(
            check_tx(&frame(csum, 60), 0),
            Err(HeaderError::ChecksumNotNegotiated)
        );
        // The checksum field must lie inside the packet.
        assert_eq!(
            check_tx(&frame(csum, 51), ALL),
            Err(HeaderError::ChecksumOutside {
                start: 34,
                offset: 16,
                len: 51
            })
        );
        assert!(check_tx(&frame(csum, 52), ALL).is_ok());
        let max = VnetHeader {
            csum_start: u16::MAX,
            csum_offset: u16::MAX,
            ..csum
        };
        assert!(check_tx(&frame(max, 100), ALL).is_err());
        assert_eq!(
            check_tx(&frame(VnetHeader { flags: 4, ..plain }, 60), ALL),
            Err(HeaderError::Flags(4))
        );
        let tso4 = VnetHeader {
            gso_type: const { narrow::u8_of(VIRTIO_NET_HDR_GSO_TCPV4 as u64) },
            gso_size: 1448,
            hdr_len: 66,
            ..csum
        };
        assert!(check_tx(&frame(tso4, 9000), ALL).is_ok());
        let no_tso = ALL & !(1 << VIRTIO_NET_F_HOST_TSO4);
        assert_eq!(
            check_tx(&frame(tso4, 9000), no_tso),
            Err(HeaderError::GsoNotNegotiated(1))
        );
        let ecn = VnetHeader {
            gso_type: tso4.gso_type | const { narrow::u8_of(VIRTIO_NET_HDR_GSO_ECN as u64) },
            ..tso4
        };
        assert!(check_tx(&frame(ecn, 9000), ALL).is_ok());
        assert!(check_tx(&frame(ecn, 9000), ALL & !(1 << VIRTIO_NET_F_HOST_ECN)).is_err());
        // ECN alone, UDP (UFO is not offered), unknown types.
        for t in [0x80u8, 3, 5, 2, 0x7f] {
            let h = VnetHeader {
                gso_type: t,
                ..tso4
            };
            assert_eq!(check_tx(&frame(h, 9000), ALL), Err(HeaderError::GsoType(t)));
        }
        // GSO needs a partial checksum and a segment size.
        for h in [
            VnetHeader {
                gso_size: 0,
                ..tso4
            },
            VnetHeader { flags: 0, ..tso4 },
        ] {
            assert_eq!(
                check_tx(&frame(h, 9000), ALL),
                Err(HeaderError::GsoIncomplete)
            );
        }
    }

    /// The rules Linux's `virtio_net_hdr_to_skb` and tun apply, one by one,
    /// each on a TSO frame that passes but for the one field.
    #[test]
    fn tx_offsets_are_checked_as_linux_checks_them() {
        let tso4 = VnetHeader {
            flags: 1,
            gso_type: const { narrow::u8_of(VIRTIO_NET_HDR_GSO_TCPV4 as u64) },
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 0,
        };
        let tso6 = VnetHeader {
            gso_type: const { narrow::u8_of(VIRTIO_NET_HDR_GSO_TCPV6 as u64) },
            csum_start: 54,
            hdr_len: 86,
            ..tso4
        };
        assert!(check_tx(&frame(tso4, 9000), ALL).is_ok());
        assert!(check_tx(&frame(tso6, 9000), ALL).is_ok());
        // TCP GSO: the checksum is the TCP header's (UDP's 6, or any other
        // offset inside the frame, is refused).
        for offset in [0, 6, 10, 17, 100] {
            let h = VnetHeader {
                csum_offset: offset,
                ..tso4
            };
            assert_eq!(
                check_tx(&frame(h, 9000), ALL),
                Err(HeaderError::TcpChecksumOffset(offset))
            );
        }
        // csum_start past the smallest network header: 20 bytes (IPv4,
        // and any partial checksum), 40 for TCPv6.
        let h = VnetHeader {
            csum_start: 19,
            ..tso4
        };
        assert_eq!(
            check_tx(&frame(h, 9000), ALL),
            Err(HeaderError::ChecksumStart { start: 19, min: 20 })
        );
        let h = VnetHeader {
            csum_start: 39,
            ..tso6
        };
        assert_eq!(
            check_tx(&frame(h, 9000), ALL),
            Err(HeaderError::ChecksumStart { start: 39, min: 40 })
        );
        let plain_csum = VnetHeader {
            flags: 1,
            csum_start: 10,
            csum_offset: 6,
            ..VnetHeader::default()
        };
        assert_eq!(
            check_tx(&frame(plain_csum, 100), ALL),
            Err(HeaderError::ChecksumStart { start: 10, min: 20 })
        );
        // A whole TCP header at csum_start: the checksum field alone
        // inside the frame is not enough.
        assert_eq!(
            check_tx(&frame(tso4, 34 + 19), ALL),
            Err(HeaderError::TransportOutside { start: 34, len: 53 })
        );
        assert!(check_tx(
            &frame(
                VnetHeader {
                    hdr_len: 54,
                    ..tso4
                },
                54
            ),
            ALL
        )
        .is_ok());
        // The checksum field inside the frame, whatever csum_start says.
        let h = VnetHeader {
            csum_start: 8990,
            ..tso4
        };
        assert!(matches!(
            check_tx(&frame(h, 9000), ALL),
            Err(HeaderError::ChecksumOutside { .. })
        ));
        // A real segment size.
        let h = VnetHeader {
            gso_size: 0xffff,
            ..tso4
        };
        assert_eq!(
            check_tx(&frame(h, 9000), ALL),
            Err(HeaderError::GsoByFrags(0xffff))
        );
        // hdr_len inside the frame (tun refuses it past), GSO or not.
        let h = VnetHeader {
            hdr_len: 9001,
            ..tso4
        };
        assert_eq!(
            check_tx(&frame(h, 9000), ALL),
            Err(HeaderError::HdrLen {
                hdr_len: 9001,
                len: 9000
            })
        );
        let h = VnetHeader {
            hdr_len: 61,
            ..VnetHeader::default()
        };
        assert!(matches!(
            check_tx(&frame(h, 60), ALL),
            Err(HeaderError::HdrLen { .. })
        ));
    }

    #[test]
    fn rx_num_buffers_and_tap_offloads_follow_the_guest() {
        let mut f = frame(VnetHeader::default(), 10);
        set_num_buffers(&mut f, 1).unwrap();
        assert_eq!(VnetHeader::parse(&f).unwrap().num_buffers, 1);
        assert!(set_num_buffers(&mut [0; 4], 1).is_err());

        assert_eq!(tap_offload_flags(0), 0);
        assert_eq!(
            tap_offload_flags(ALL),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN
        );
        // TSO is nothing without checksum offload.
        assert_eq!(tap_offload_flags(ALL & !(1 << VIRTIO_NET_F_GUEST_CSUM)), 0);
        assert_eq!(
            tap_offload_flags((1 << VIRTIO_NET_F_GUEST_CSUM) | (1 << VIRTIO_NET_F_GUEST_ECN)),
            libc::TUN_F_CSUM
        );
    }
}
