//! Tests of `migration_fds.rs`: guest RAM's memfds over a socketpair, the
//! receiver's mapping showing the sender's bytes, and each fd the receiver
//! must refuse.

use std::os::fd::AsFd;
use std::thread;

use vm_memory::Bytes;

use super::*;
use crate::config::MemoryConfig;
use crate::memory::snapshot::{RamRegionState, RegionOrigin};
use crate::memory::{create_guest_memory, create_hotplug_region, memfd};

const MIB: u64 = 1 << 20;

fn memory(shared: bool) -> (GuestMemoryMmap, MemoryLayoutState) {
    let cfg = MemoryConfig {
        size: 32 * MIB,
        shared,
        ..Default::default()
    };
    let mem = create_guest_memory(&cfg).unwrap();
    let added = create_hotplug_region(&cfg, 1 << 32, 8 * MIB).unwrap();
    let regions = vec![
        RamRegionState::of(mem.iter().next().unwrap(), 0, RegionOrigin::Boot),
        RamRegionState::of(&added, 7, RegionOrigin::Hotplug),
    ];
    let mem = mem.insert_region(added).unwrap();
    (mem, MemoryLayoutState::new(regions).unwrap())
}

/// The receiving side: `count` MemoryFd requests, each answered Ok.
fn receive(socket: UnixStream, count: usize) -> Result<ReceivedMemoryFds, MemoryFdError> {
    let mut fds = ReceivedMemoryFds::default();
    for _ in 0..count {
        let request = Request::read_from(&mut &socket)?;
        fds.receive(&socket, &request)?;
        Response::ok().write_to(&mut &socket)?;
    }
    Ok(fds)
}

#[test]
fn the_receivers_mapping_shows_the_senders_bytes() {
    let (sender_mem, layout) = memory(true);
    sender_mem
        .write_slice(b"boot RAM", GuestAddress(0x2000))
        .unwrap();
    sender_mem
        .write_slice(b"hot-plugged", GuestAddress((1 << 32) + 5 * MIB))
        .unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let receiver = thread::spawn(move || receive(b, 2));
    send_memory_fds(&a, &layout, &sender_mem).unwrap();
    let fds = receiver.join().unwrap().unwrap();
    let mem = fds.into_guest_memory(&layout).unwrap();
    let mut got = [0u8; 8];
    mem.read_slice(&mut got, GuestAddress(0x2000)).unwrap();
    assert_eq!(&got, b"boot RAM");
    let mut got = [0u8; 11];
    mem.read_slice(&mut got, GuestAddress((1 << 32) + 5 * MIB))
        .unwrap();
    assert_eq!(&got, b"hot-plugged");
    // The same pages, not a copy: a write on one side shows on the other.
    mem.write_slice(b"new", GuestAddress(0x3000)).unwrap();
    let mut got = [0u8; 3];
    sender_mem
        .read_slice(&mut got, GuestAddress(0x3000))
        .unwrap();
    assert_eq!(&got, b"new");
}

/// Boot RAM above 3 GiB is one memfd at two offsets: the second region's
/// mapping starts at its offset, not at the file's start.
#[test]
fn each_region_is_mapped_at_its_file_offset() {
    let cfg = MemoryConfig {
        size: 4 << 30,
        shared: true,
        ..Default::default()
    };
    let sender_mem = create_guest_memory(&cfg).unwrap();
    let layout = MemoryLayoutState::of_boot_memory(&sender_mem).unwrap();
    let high = layout.regions[1].gpa;
    sender_mem
        .write_slice(b"above the hole", GuestAddress(high))
        .unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let receiver = thread::spawn(move || receive(b, 2));
    send_memory_fds(&a, &layout, &sender_mem).unwrap();
    let mem = receiver
        .join()
        .unwrap()
        .unwrap()
        .into_guest_memory(&layout)
        .unwrap();
    let mut got = [0u8; 14];
    mem.read_slice(&mut got, GuestAddress(high)).unwrap();
    assert_eq!(&got, b"above the hole");
}

/// Private RAM has no fd: refused, with CH's message, before anything is
/// sent.
#[test]
fn private_memory_is_refused_before_anything_is_sent() {
    let (mem, layout) = memory(false);
    let (a, b) = UnixStream::pair().unwrap();
    let err = send_memory_fds(&a, &layout, &mem).unwrap_err();
    assert!(err.to_string().contains("requires shared memory"), "{err}");
    b.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let read = std::io::Read::read(&mut &b, &mut byte);
    assert_eq!(read.unwrap_err().kind(), io::ErrorKind::WouldBlock);
}

/// Sends `file` as the MemoryFd of `slot` and returns what the receiver
/// made of it.
fn receive_one(
    slot: u32,
    fd: std::os::fd::BorrowedFd<'_>,
) -> (ReceivedMemoryFds, Result<u32, MemoryFdError>) {
    let (a, b) = UnixStream::pair().unwrap();
    protocol::send_request_with_fd(
        &a,
        Command::MemoryFd,
        &protocol::encode_memory_fd_slot(slot),
        fd,
    )
    .unwrap();
    let mut fds = ReceivedMemoryFds::default();
    let request = Request::read_from(&mut &b).unwrap();
    let r = fds.receive(&b, &request);
    (fds, r)
}

#[test]
fn a_file_too_small_for_its_region_is_refused_by_slot() {
    let (_, layout) = memory(true);
    let small = memfd(false).unwrap();
    small.set_len(32 * MIB).unwrap();
    let big = memfd(false).unwrap();
    big.set_len(8 * MIB - 4096).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    for (slot, f) in [(0, &small), (7, &big)] {
        protocol::send_request_with_fd(
            &a,
            Command::MemoryFd,
            &protocol::encode_memory_fd_slot(slot),
            f.as_fd(),
        )
        .unwrap();
    }
    let mut fds = ReceivedMemoryFds::default();
    for _ in 0..2 {
        let request = Request::read_from(&mut &b).unwrap();
        fds.receive(&b, &request).unwrap();
    }
    let err = fds.into_guest_memory(&layout).unwrap_err();
    assert!(
        matches!(err, MemoryFdError::TooSmall { slot: 7, size, needed, .. }
            if size == 8 * MIB - 4096 && needed == 8 * MIB),
        "{err:?}"
    );
}

#[test]
fn a_socket_is_not_guest_memory() {
    let (x, _y) = UnixStream::pair().unwrap();
    let (_, r) = receive_one(0, x.as_fd());
    assert!(
        matches!(r, Err(MemoryFdError::NotRegularFile { slot: 0 })),
        "{r:?}"
    );
}

#[test]
fn missing_duplicate_and_unused_slots_are_refused() {
    let (_, layout) = memory(true);
    let f = memfd(false).unwrap();
    f.set_len(64 * MIB).unwrap();
    // Only slot 0 came: slot 7's region has nothing to map.
    let (fds, r) = receive_one(0, f.as_fd());
    assert_eq!(r.unwrap(), 0);
    let err = fds.into_guest_memory(&layout).unwrap_err();
    assert!(
        matches!(err, MemoryFdError::MissingSlot { slot: 7, gpa } if gpa == 1 << 32),
        "{err:?}"
    );
    // Slot 3 is no region's.
    let (a, b) = UnixStream::pair().unwrap();
    let mut fds = ReceivedMemoryFds::default();
    for slot in [0, 7, 3, 3] {
        protocol::send_request_with_fd(
            &a,
            Command::MemoryFd,
            &protocol::encode_memory_fd_slot(slot),
            f.as_fd(),
        )
        .unwrap();
    }
    for _ in 0..3 {
        let request = Request::read_from(&mut &b).unwrap();
        fds.receive(&b, &request).unwrap();
    }
    let request = Request::read_from(&mut &b).unwrap();
    let dup = fds.receive(&b, &request).unwrap_err();
    assert!(
        matches!(dup, MemoryFdError::DuplicateSlot { slot: 3 }),
        "{dup:?}"
    );
    let err = fds.into_guest_memory(&layout).unwrap_err();
    assert!(
        matches!(err, MemoryFdError::UnusedSlot { slot: 3 }),
        "{err:?}"
    );
}
