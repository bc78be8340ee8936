//! Guest RAM through a socket pair between two memories of this process:
//! what the first pass picks, the dirty ranges clipped to RAM, the bytes
//! arriving where they were, and a range outside RAM refused before
//! anything is written.

use std::os::unix::net::UnixStream;

use vm_memory::{Bytes, GuestAddress};
use vm_state::protocol::{Command, MemoryRange, Request, Response};

use super::*;
use crate::config::MemoryConfig;
use crate::memory::create_guest_memory;
use crate::memory::dirty_log::DirtyPages;

const MIB: u64 = 1 << 20;

fn ram(size: u64, shared: bool) -> GuestMemoryMmap {
    create_guest_memory(&MemoryConfig {
        size,
        shared,
        ..MemoryConfig::default()
    })
    .expect("guest RAM")
}

fn channels() -> (Channel, UnixStream) {
    let (a, b) = UnixStream::pair().expect("socket pair");
    (Channel::Unix(a), b)
}

/// Serves `Memory` requests into `mem` until the sender hangs up;
/// returns every range written, or the first error (answered `Error`).
fn serve(socket: UnixStream, mem: &GuestMemoryMmap) -> Result<Vec<MemoryRange>, MigrationError> {
    serve_within(socket, mem, u64::MAX)
}

/// [`serve`] with a budget of `budget` bytes.
fn serve_within(
    socket: UnixStream,
    mem: &GuestMemoryMmap,
    mut budget: u64,
) -> Result<Vec<MemoryRange>, MigrationError> {
    let channel = Channel::Unix(socket);
    let mut all = Vec::new();
    loop {
        let Ok(request) = Request::read_from(&mut &channel) else {
            return Ok(all);
        };
        assert_eq!(request.command(), Command::Memory);
        match receive_ranges(&mut &channel, &request, mem, &mut budget) {
            Ok(ranges) => {
                all.extend(ranges);
                Response::ok().write_to(&mut &channel).unwrap();
            }
            Err(e) => {
                Response::write_error_with_reason(&mut &channel, &e.to_string()).unwrap();
                return Err(e);
            }
        }
    }
}

/// The first pass over a memfd sends exactly the pages written (its data
/// extents); over private RAM, exactly the pages that are not zeroes.
#[test]
fn the_first_pass_sends_only_pages_that_hold_data() {
    for shared in [true, false] {
        let mem = ram(16 * MIB, shared);
        mem.write_obj(1u8, GuestAddress(0x3000)).unwrap();
        mem.write_obj(1u8, GuestAddress(0x4fff)).unwrap();
        mem.write_obj(7u64, GuestAddress(9 * MIB)).unwrap();
        let ranges = data_ranges(&mem);
        assert_eq!(
            ranges,
            vec![
                MemoryRange {
                    gpa: 0x3000,
                    length: 0x2000
                },
                MemoryRange {
                    gpa: 9 * MIB,
                    length: 0x1000
                },
            ],
            "shared={shared}"
        );
    }
}

/// Dirty pages become ranges joined where they touch; a bit outside RAM
/// (a daemon's log may set any) is dropped.
#[test]
fn dirty_pages_become_ranges_inside_ram() {
    let mem = ram(8 * MIB, false);
    let mut dirty = DirtyPages::new(64 * MIB).unwrap();
    for gpa in [
        0x1000,
        0x2000,
        0x3000,
        0x10_0000,
        8 * MIB - 0x1000,
        8 * MIB,
        40 * MIB,
    ] {
        dirty.mark(gpa);
    }
    assert_eq!(
        dirty_ranges(&dirty, &mem),
        vec![
            MemoryRange {
                gpa: 0x1000,
                length: 0x3000
            },
            MemoryRange {
                gpa: 0x10_0000,
                length: 0x1000
            },
            MemoryRange {
                gpa: 8 * MIB - 0x1000,
                length: 0x1000
            },
        ]
    );
}

/// Ranges of every shape arrive byte for byte where they were, over as
/// many requests as the per-request bounds make (more ranges than one
/// table holds), and nothing else is written.
#[test]
fn ranges_arrive_where_they_were() {
    let source = ram(48 * MIB, true);
    let dest = ram(48 * MIB, true);
    let mut ranges = Vec::new();
    // More single pages than one request's table takes.
    for page in 0..(MAX_RANGES_PER_REQUEST as u64 + 100) {
        let gpa = page * 0x2000;
        source
            .write_obj(page | 0xa5a5_0000_0000, GuestAddress(gpa))
            .unwrap();
        ranges.push(MemoryRange {
            gpa,
            length: 0x1000,
        });
    }
    // And one long range across the chunk size.
    let long = MemoryRange {
        gpa: 40 * MIB,
        length: 3 * MIB + 0x1000,
    };
    let pattern: Vec<u8> = (0..long.length).map(|i| narrow::low_u8(i % 251)).collect();
    source
        .write_slice(&pattern, GuestAddress(long.gpa))
        .unwrap();
    ranges.push(long);
    // A page not sent keeps the destination's zeroes.
    source.write_obj(0xffu8, GuestAddress(0x1000)).unwrap();

    let (sender, receiver) = channels();
    let served = std::thread::scope(|s| {
        let server = s.spawn(|| serve(receiver, &dest));
        let sent = send_ranges(&sender, &source, &ranges).expect("sent");
        assert_eq!(sent, total(&ranges));
        drop(sender);
        server.join().unwrap().expect("received")
    });
    assert_eq!(total(&served), total(&ranges));
    for r in &ranges {
        let mut a = vec![0u8; narrow::usize_of(r.length)];
        let mut b = vec![0u8; narrow::usize_of(r.length)];
        source.read_slice(&mut a, GuestAddress(r.gpa)).unwrap();
        dest.read_slice(&mut b, GuestAddress(r.gpa)).unwrap();
        assert!(a == b, "range {:#x}+{:#x}", r.gpa, r.length);
    }
    assert_eq!(dest.read_obj::<u8>(GuestAddress(0x1000)).unwrap(), 0);
}

/// A range reaching past guest RAM is refused by its number before a
/// byte of the request is written, and the sender hears `Error`.
#[test]
fn a_range_outside_ram_is_refused_before_anything_is_written() {
    let source = ram(16 * MIB, false);
    let dest = ram(8 * MIB, false);
    source.write_obj(0x55u8, GuestAddress(0x1000)).unwrap();
    let ranges = [
        MemoryRange {
            gpa: 0x1000,
            length: 0x1000,
        },
        MemoryRange {
            gpa: 8 * MIB - 0x1000,
            length: 0x2000,
        },
    ];
    let (sender, receiver) = channels();
    let (sent, served) = std::thread::scope(|s| {
        let server = s.spawn(|| serve(receiver, &dest));
        let sent = send_ranges(&sender, &source, &ranges);
        drop(sender);
        (sent, server.join().unwrap())
    });
    let err = served.expect_err("refused").to_string();
    assert!(
        err.contains("range 1") && err.contains("not inside guest RAM"),
        "{err}"
    );
    // The receiver's reason reaches the sender.
    match sent {
        Err(MigrationError::ReceiverRefused {
            command: Command::Memory,
            reason,
        }) => assert!(reason.contains("not inside guest RAM"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(dest.read_obj::<u8>(GuestAddress(0x1000)).unwrap(), 0);
}

/// Two sets of ranges joined: sorted, overlaps and neighbours merged,
/// empty ones dropped.
#[test]
fn a_union_of_ranges_holds_each_byte_once() {
    let r = |gpa, length| MemoryRange { gpa, length };
    assert_eq!(
        union(
            vec![r(0x5000, 0x1000), r(0x1000, 0x2000)],
            vec![r(0x2000, 0x2000), r(0x9000, 0), r(0x8000, 0x1000)]
        ),
        vec![r(0x1000, 0x3000), r(0x5000, 0x1000), r(0x8000, 0x1000)]
    );
}

/// A sender that sends more than the receiver's budget is refused before
/// the request's bytes are taken; up to the budget, everything arrives.
#[test]
fn ram_beyond_the_budget_is_refused() {
    let source = ram(16 * MIB, false);
    let dest = ram(16 * MIB, false);
    source.write_obj(0x77u8, GuestAddress(0x2000)).unwrap();
    let page = |gpa| MemoryRange {
        gpa,
        length: 0x1000,
    };
    let (sender, receiver) = channels();
    let (first, second, served) = std::thread::scope(|s| {
        let server = s.spawn(|| serve_within(receiver, &dest, 0x2000));
        let first = send_ranges(&sender, &source, &[page(0x2000), page(0x3000)]);
        let second = send_ranges(&sender, &source, &[page(0x4000)]);
        drop(sender);
        (first, second, server.join().unwrap())
    });
    assert_eq!(first.expect("within the budget"), 0x2000);
    assert!(second.is_err());
    let err = served.expect_err("over the budget").to_string();
    assert!(
        err.contains("more than") && err.contains("guest RAM's size"),
        "{err}"
    );
    assert_eq!(dest.read_obj::<u8>(GuestAddress(0x2000)).unwrap(), 0x77);
}
