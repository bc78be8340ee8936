//! The request parser on chains a guest could build.

use super::*;
use vm_memory::GuestMemoryMmap;

const HDR: u64 = 0x1000;
const DATA: u64 = 0x2000;
const STATUS: u64 = 0x8000;
const MEM_END: u64 = 0x10000;

fn limits() -> DiskLimits {
    DiskLimits {
        capacity: 64,
        readonly: false,
        discard: true,
        write_zeroes: true,
        max_segments: 16,
        max_ranges: 2,
        max_range_sectors: 32,
    }
}

fn mem_with_header(kind: u32, sector: u64) -> GuestMemoryMmap<()> {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), usize::try_from(MEM_END).unwrap())])
        .unwrap();
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HDR)).unwrap();
    mem
}

fn d(addr: u64, len: u32, write: bool) -> (GuestAddress, u32, bool) {
    (GuestAddress(addr), len, write)
}

fn parse_with(
    mem: &GuestMemoryMmap<()>,
    descs: &[(GuestAddress, u32, bool)],
    l: &DiskLimits,
) -> Request {
    parse(mem, descs.iter().copied(), l)
}

#[test]
fn read_write_flush_and_get_id_in_the_usual_layout() {
    let mem = mem_with_header(VIRTIO_BLK_T_IN, 4);
    let r = parse_with(
        &mem,
        &[d(HDR, 16, false), d(DATA, 1024, true), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(r.status, Some(GuestAddress(STATUS)));
    assert_eq!(
        r.action,
        Ok(Action::Read {
            offset: 4 * 512,
            data: vec![Segment {
                addr: GuestAddress(DATA),
                len: 1024
            }]
        })
    );
    let mem = mem_with_header(VIRTIO_BLK_T_OUT, 63);
    let r = parse_with(
        &mem,
        &[d(HDR, 16, false), d(DATA, 512, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(
        r.action,
        Ok(Action::Write {
            offset: 63 * 512,
            data: vec![Segment {
                addr: GuestAddress(DATA),
                len: 512
            }]
        })
    );
    let mem = mem_with_header(VIRTIO_BLK_T_FLUSH, 0);
    let r = parse_with(&mem, &[d(HDR, 16, false), d(STATUS, 1, true)], &limits());
    assert_eq!(r.action, Ok(Action::Flush));
    let mem = mem_with_header(VIRTIO_BLK_T_GET_ID, 0);
    let r = parse_with(
        &mem,
        &[d(HDR, 16, false), d(DATA, 20, true), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(
        r.action,
        Ok(Action::GetId {
            data: vec![Segment {
                addr: GuestAddress(DATA),
                len: 20
            }]
        })
    );
}

#[test]
fn any_layout_header_with_data_and_status_inside_the_last_buffer() {
    // Header and 512 bytes of data in one readable descriptor; data and the
    // status byte in one writable one.
    let mem = mem_with_header(VIRTIO_BLK_T_OUT, 1);
    let r = parse_with(
        &mem,
        &[d(HDR, 16 + 512, false), d(STATUS, 1, true)],
        &limits(),
    );
    assert_eq!(
        r.action,
        Ok(Action::Write {
            offset: 512,
            data: vec![Segment {
                addr: GuestAddress(HDR + 16),
                len: 512
            }]
        })
    );
    let mem = mem_with_header(VIRTIO_BLK_T_IN, 1);
    // The header split 10 + 6 across two descriptors, status at the end of the data buffer.
    let mut h = [0u8; 16];
    mem.read_slice(&mut h, GuestAddress(HDR)).unwrap();
    mem.write_slice(&h[10..], GuestAddress(0x3000)).unwrap();
    let r = parse_with(
        &mem,
        &[d(HDR, 10, false), d(0x3000, 6, false), d(DATA, 513, true)],
        &limits(),
    );
    assert_eq!(r.status, Some(GuestAddress(DATA + 512)));
    assert_eq!(
        r.action,
        Ok(Action::Read {
            offset: 512,
            data: vec![Segment {
                addr: GuestAddress(DATA),
                len: 512
            }]
        })
    );
}

#[test]
fn lengths_and_sectors_are_checked_against_the_disk() {
    let l = limits();
    let io = |kind, sector, len| {
        let mem = mem_with_header(kind, sector);
        let write = kind == VIRTIO_BLK_T_IN;
        parse_with(
            &mem,
            &[d(HDR, 16, false), d(DATA, len, write), d(STATUS, 1, true)],
            &l,
        )
        .action
    };
    assert_eq!(
        io(VIRTIO_BLK_T_IN, 0, 100),
        Err(RequestError::UnalignedLength { len: 100 })
    );
    // The last sector is fine, one more is past the end.
    assert!(io(VIRTIO_BLK_T_IN, 63, 512).is_ok());
    let past = io(VIRTIO_BLK_T_IN, 63, 1024).unwrap_err();
    assert_eq!(
        past,
        RequestError::PastEnd {
            sector: 63,
            sectors: 2,
            capacity: 64
        }
    );
    assert_eq!(
        past.status(),
        const { narrow::u8_of(VIRTIO_BLK_S_IOERR as u64) }
    );
    // Sector numbers that overflow when added to or shifted.
    assert!(matches!(
        io(VIRTIO_BLK_T_OUT, u64::MAX, 512),
        Err(RequestError::PastEnd { .. })
    ));
    assert!(matches!(
        io(VIRTIO_BLK_T_OUT, u64::MAX >> 9, 512),
        Err(RequestError::PastEnd { .. })
    ));
    assert!(matches!(
        io(VIRTIO_BLK_T_IN, 1 << 55, 0),
        Err(RequestError::PastEnd { .. })
    ));
}

#[test]
fn malformed_chains_are_refused_and_answered_where_possible() {
    let l = limits();
    let mem = mem_with_header(VIRTIO_BLK_T_IN, 0);
    // No status byte: nothing to answer with.
    let r = parse_with(&mem, &[d(HDR, 16, false), d(DATA, 512, false)], &l);
    assert_eq!((r.status, r.action), (None, Err(RequestError::NoStatus)));
    // Short header.
    let r = parse_with(&mem, &[d(HDR, 8, false), d(STATUS, 1, true)], &l);
    assert_eq!(r.action, Err(RequestError::ShortHeader { got: 8 }));
    assert_eq!(r.status, Some(GuestAddress(STATUS)));
    // Readable after writable.
    let r = parse_with(
        &mem,
        &[
            d(HDR, 16, false),
            d(DATA, 512, true),
            d(0x3000, 16, false),
            d(STATUS, 1, true),
        ],
        &l,
    );
    assert_eq!(r.action, Err(RequestError::ReadableAfterWritable));
    // Data outside guest memory, or wrapping the address space.
    let r = parse_with(
        &mem,
        &[
            d(HDR, 16, false),
            d(MEM_END - 256, 512, true),
            d(STATUS, 1, true),
        ],
        &l,
    );
    assert!(matches!(r.action, Err(RequestError::BadAddress { .. })));
    assert_eq!(r.status, Some(GuestAddress(STATUS)));
    let r = parse_with(
        &mem,
        &[
            d(HDR, 16, false),
            d(u64::MAX - 10, 512, false),
            d(STATUS, 1, true),
        ],
        &l,
    );
    assert!(matches!(r.action, Err(RequestError::BadAddress { .. })));
    // A status byte outside guest memory: no answer.
    let r = parse_with(&mem, &[d(HDR, 16, false), d(MEM_END, 1, true)], &l);
    assert_eq!(r.status, None);
    // More descriptors than the queue allows.
    let many: Vec<_> = (0..17).map(|i| d(DATA + i * 512, 512, true)).collect();
    let r = parse_with(&mem, &many, &l);
    assert_eq!(r.action, Err(RequestError::TooManySegments { max: 16 }));
    // Unknown type: UNSUPP.
    let mem = mem_with_header(99, 0);
    let r = parse_with(&mem, &[d(HDR, 16, false), d(STATUS, 1, true)], &l);
    assert_eq!(r.action, Err(RequestError::Unsupported(99)));
    assert_eq!(
        r.action.unwrap_err().status(),
        const { narrow::u8_of(VIRTIO_BLK_S_UNSUPP as u64) }
    );
}

fn range(sector: u64, num: u32, flags: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[0..8].copy_from_slice(&sector.to_le_bytes());
    r[8..12].copy_from_slice(&num.to_le_bytes());
    r[12..16].copy_from_slice(&flags.to_le_bytes());
    r
}

#[test]
fn discard_and_write_zeroes_ranges() {
    let l = limits();
    let run = |kind, ranges: &[[u8; 16]], l: &DiskLimits| {
        let mem = mem_with_header(kind, 0);
        let bytes: Vec<u8> = ranges.concat();
        mem.write_slice(&bytes, GuestAddress(DATA)).unwrap();
        parse_with(
            &mem,
            &[
                d(HDR, 16, false),
                d(DATA, u32::try_from(bytes.len()).unwrap(), false),
                d(STATUS, 1, true),
            ],
            l,
        )
        .action
    };
    assert_eq!(
        run(
            VIRTIO_BLK_T_DISCARD,
            &[range(8, 8, 0), range(32, 32, 0)],
            &l
        ),
        Ok(Action::Discard(vec![
            ByteRange {
                offset: 8 * 512,
                len: 8 * 512,
                unmap: false
            },
            ByteRange {
                offset: 32 * 512,
                len: 32 * 512,
                unmap: false
            },
        ]))
    );
    assert_eq!(
        run(
            VIRTIO_BLK_T_WRITE_ZEROES,
            &[range(0, 1, RANGE_FLAG_UNMAP)],
            &l
        ),
        Ok(Action::WriteZeroes(vec![ByteRange {
            offset: 0,
            len: 512,
            unmap: true
        }]))
    );
    // Unmap is not a discard flag; unknown flags are UNSUPP.
    let e = run(VIRTIO_BLK_T_DISCARD, &[range(0, 1, RANGE_FLAG_UNMAP)], &l).unwrap_err();
    assert_eq!(
        e.status(),
        const { narrow::u8_of(VIRTIO_BLK_S_UNSUPP as u64) }
    );
    assert!(run(VIRTIO_BLK_T_WRITE_ZEROES, &[range(0, 1, 4)], &l).is_err());
    // Past the end, too long, too many.
    assert!(matches!(
        run(VIRTIO_BLK_T_DISCARD, &[range(60, 8, 0)], &l),
        Err(RequestError::PastEnd { .. })
    ));
    assert!(matches!(
        run(VIRTIO_BLK_T_DISCARD, &[range(u64::MAX, 8, 0)], &l),
        Err(RequestError::PastEnd { .. })
    ));
    assert_eq!(
        run(VIRTIO_BLK_T_DISCARD, &[range(0, 33, 0)], &l),
        Err(RequestError::RangeTooLong {
            what: "discard",
            got: 33,
            max: 32
        })
    );
    assert_eq!(
        run(VIRTIO_BLK_T_DISCARD, &[range(0, 1, 0); 3], &l),
        Err(RequestError::TooManyRanges {
            what: "discard",
            got: 3,
            max: 2
        })
    );
    // Not a whole number of ranges.
    let mem = mem_with_header(VIRTIO_BLK_T_DISCARD, 0);
    let r = parse_with(
        &mem,
        &[d(HDR, 16, false), d(DATA, 10, false), d(STATUS, 1, true)],
        &l,
    );
    assert!(matches!(
        r.action,
        Err(RequestError::BadRangeList { len: 10, .. })
    ));
    // Not offered: UNSUPP.
    let off = DiskLimits {
        discard: false,
        write_zeroes: false,
        ..l
    };
    assert_eq!(
        run(VIRTIO_BLK_T_DISCARD, &[range(0, 1, 0)], &off),
        Err(RequestError::Unsupported(VIRTIO_BLK_T_DISCARD))
    );
}

#[test]
fn a_readonly_disk_refuses_every_write_with_ioerr() {
    let ro = DiskLimits {
        readonly: true,
        ..limits()
    };
    for kind in [
        VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_WRITE_ZEROES,
    ] {
        let mem = mem_with_header(kind, 0);
        mem.write_slice(&range(0, 1, 0), GuestAddress(DATA))
            .unwrap();
        let r = parse_with(
            &mem,
            &[d(HDR, 16, false), d(DATA, 512, false), d(STATUS, 1, true)],
            &ro,
        );
        assert_eq!(r.action, Err(RequestError::ReadOnly), "type {kind}");
        assert_eq!(
            RequestError::ReadOnly.status(),
            const { narrow::u8_of(VIRTIO_BLK_S_IOERR as u64) }
        );
    }
    let mem = mem_with_header(VIRTIO_BLK_T_IN, 0);
    let r = parse_with(
        &mem,
        &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, true)],
        &ro,
    );
    assert!(r.action.is_ok());
}
