//! The vhost-user dirty log over a real socket, as a migrating VMM drives
//! it: LOG_ALL and LOG_SHMFD negotiated, SET_LOG_BASE with a shared log
//! (one bit per 4 KiB guest page), then a FUSE READ whose data the daemon
//! `preadv`s straight into guest RAM. The log must then name exactly the
//! pages the daemon wrote: the data's, the reply header's and the used
//! ring's, and no other. Then the same through the VMM's own frontend
//! (`DaemonMemory::start_dirty_log` and its shared log).

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_devices::vhost_user_fs::dirty_log::SharedDirtyLog;
use vm_memory::GuestMemoryBackend;

use super::window_buffers::{lookup, open, read_into};
use super::*;

const PAGE: u64 = 4096;
/// The log of 16 MiB of guest RAM: one bit per page.
const LOG_BYTES: u64 = 16 * MIB / PAGE / 8;
/// The READ's first buffer straddles two pages; its second is never
/// reached (the file ends first).
const DATA: u64 = 0x40_0800;
const UNREACHED: u64 = 0x50_0000;
const REQUEST_RING: u64 = 0x8000;
const USED_RING: u64 = 0xc000;
const FILE_LEN: usize = 4096;
/// Queue 1, the request queue (0 is hiprio, left unset).
const QUEUE: usize = 1;

/// The pages whose bit is set in `log`.
fn dirty_pages(log: &std::fs::File) -> BTreeSet<u64> {
    let mut bytes = vec![0u8; index(LOG_BYTES)];
    log.read_exact_at(&mut bytes, 0).unwrap();
    let mut pages = BTreeSet::new();
    for (i, byte) in (0u64..).zip(&bytes) {
        for bit in 0..8 {
            if byte & (1 << bit) != 0 {
                pages.insert(i * 8 + bit);
            }
        }
    }
    pages
}

/// A log file of `len` bytes, all clean.
fn log_file(len: u64) -> std::fs::File {
    let log = TempFile::new().unwrap().into_file();
    log.set_len(len).unwrap();
    log
}

/// Puts `f` in `share`: [`FILE_LEN`] bytes, none zero; returns them.
fn share_with_file(share: &TempDir) -> Vec<u8> {
    let content: Vec<u8> = (0..FILE_LEN)
        .map(|i| u8::try_from(i % 251).unwrap() + 1)
        .collect();
    std::fs::write(share.as_path().join("f"), &content).unwrap();
    content
}

/// What the VMM's handshake does, plus the two migration features, then
/// queue 1 on `ring`'s descriptor and available rings with its used ring
/// at [`USED_RING`].
fn connect_logging(
    socket: &Path,
    mem: &GuestMemoryMmap,
    ring: &MockSplitQueue<GuestMemoryMmap>,
    kick: &EventFd,
    call: &EventFd,
) -> Frontend {
    let mut f = Frontend::connect(socket, 2).unwrap();
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
    assert_ne!(features & log_all, 0, "LOG_ALL offered");
    let ring_features = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
    f.set_features(ring_features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() | log_all)
        .unwrap();
    let offered = f.get_protocol_features().unwrap();
    assert!(offered.contains(VhostUserProtocolFeatures::LOG_SHMFD));
    f.set_protocol_features(
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::LOG_SHMFD,
    )
    .unwrap();
    let region = mem.iter().next().unwrap();
    f.set_mem_table(&[VhostUserMemoryRegionInfo::from_guest_region(region).unwrap()])
        .unwrap();
    let hva = |gpa: GuestAddress| mem.get_host_address(gpa).unwrap() as u64;
    f.set_vring_num(QUEUE, QUEUE_SIZE).unwrap();
    f.set_vring_addr(
        QUEUE,
        &VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            // VHOST_VRING_F_LOG: "log the used ring", at this guest address.
            flags: 1,
            desc_table_addr: hva(ring.desc_table_addr()),
            used_ring_addr: hva(GuestAddress(USED_RING)),
            avail_ring_addr: hva(ring.avail_addr()),
            log_addr: Some(USED_RING),
        },
    )
    .unwrap();
    f.set_vring_base(QUEUE, 0).unwrap();
    f.set_vring_call(QUEUE, call).unwrap();
    f.set_vring_kick(QUEUE, kick).unwrap();
    f.set_vring_enable(QUEUE, true).unwrap();
    f
}

/// READs the whole file (asking for twice its length) into [`DATA`] and
/// [`UNREACHED`]; returns the reply's slot.
fn read_file(guest: &mut Guest, nodeid: u64, fh: u64) -> u64 {
    let len = u32::try_from(FILE_LEN).unwrap();
    let r = abi::ReadIn {
        fh,
        offset: 0,
        size: 2 * len,
        ..Default::default()
    };
    let slot = guest.post_with(
        opcode::READ,
        nodeid,
        r.as_slice(),
        &[],
        16,
        &[(DATA, len), (UNREACHED, len)],
    );
    guest.kick_and_wait();
    let out: OutHeader = guest
        .mem
        .read_obj(GuestAddress(REPLY_BASE + slot * 0x1000))
        .unwrap();
    assert_eq!((out.error, out.len), (0, 16 + len), "READ answered in full");
    slot
}

#[test]
fn a_read_into_guest_ram_logs_exactly_the_pages_written_once_a_log_is_set() {
    let share = TempDir::new().unwrap();
    let content = share_with_file(&share);
    let sockets = TempDir::new().unwrap();
    let socket = sockets.as_path().join("fs.sock");
    let mut child = start_daemon(share.as_path(), &socket);

    let mem = guest_memory();
    let ring = MockSplitQueue::create(&mem, GuestAddress(REQUEST_RING), QUEUE_SIZE);
    let (kick, call) = (
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    let f = connect_logging(&socket, &mem, &ring, &kick, &call);
    // Interrupts go to `call`; the guest polls the used index instead.
    let (_interrupts, irq) = channel();
    let mut guest = Guest {
        mem: &mem,
        ring,
        kick,
        irq,
        used_ring: GuestAddress(USED_RING),
        next: 0,
        unique: 0,
    };
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let nodeid = lookup(&mut guest, "f").nodeid;
    let fh = open(&mut guest, nodeid, libc::O_RDONLY);

    // No log yet: the READ is served as always.
    read_file(&mut guest, nodeid, fh);
    let mut got = vec![0u8; FILE_LEN];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, content);
    mem.write_slice(&vec![0u8; FILE_LEN], GuestAddress(DATA))
        .unwrap();

    let log = log_file(LOG_BYTES);
    f.set_log_base(
        0,
        Some(VhostUserDirtyLogRegion {
            mmap_size: LOG_BYTES,
            mmap_offset: 0,
            mmap_handle: log.as_raw_fd(),
        }),
    )
    .unwrap();
    assert!(dirty_pages(&log).is_empty(), "nothing written yet");

    let slot = read_file(&mut guest, nodeid, fh);
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, content);
    let expected: BTreeSet<u64> = [
        DATA / PAGE,
        (DATA + PAGE) / PAGE,
        (REPLY_BASE + slot * 0x1000) / PAGE,
        USED_RING / PAGE,
    ]
    .into();
    assert_eq!(
        dirty_pages(&log),
        expected,
        "the data's two pages, the reply header's and the used ring's (not {:#x})",
        UNREACHED / PAGE
    );

    drop(f);
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "the daemon exits when its VMM goes: {status}"
    );
}

/// The log comes from the VMM: one too short for guest RAM (8 pages of
/// 4096) is refused with an error (the connection ends, as for any failed
/// vhost-user request) and never written, rather than written past its end.
#[test]
fn a_log_shorter_than_guest_ram_is_refused_and_never_written() {
    let share = TempDir::new().unwrap();
    share_with_file(&share);
    let sockets = TempDir::new().unwrap();
    let socket = sockets.as_path().join("fs.sock");
    let mut child = start_daemon(share.as_path(), &socket);
    let mem = guest_memory();
    let ring = MockSplitQueue::create(&mem, GuestAddress(REQUEST_RING), QUEUE_SIZE);
    let (kick, call) = (
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    let f = connect_logging(&socket, &mem, &ring, &kick, &call);
    let short = log_file(LOG_BYTES);
    let refused = f.set_log_base(
        0,
        Some(VhostUserDirtyLogRegion {
            mmap_size: 1,
            mmap_offset: 0,
            mmap_handle: short.as_raw_fd(),
        }),
    );
    assert!(refused.is_err(), "a log shorter than guest RAM");
    assert!(dirty_pages(&short).is_empty());
    drop(f);
    let status = child.wait().unwrap();
    assert!(status.code().is_some(), "ended, not killed: {status}");
}

/// Where RAM added while logging sits (as hot-plugged RAM sits above 4 GiB).
const ADDED_GPA: u64 = 0x1_0000_0000;
const ADDED_SIZE: u64 = 2 * MIB;

/// The pages set in the VMM's shared log, taken (cleared) as they are read.
fn take_pages(log: &SharedDirtyLog) -> BTreeSet<u64> {
    let mut pages = BTreeSet::new();
    for i in 0..log.words() {
        let word = log.take_word(i).unwrap();
        let first = u64::try_from(i).unwrap() * 64;
        pages.extend((0..64).filter(|b| word & (1 << b) != 0).map(|b| first + b));
    }
    pages
}

/// The VMM's own dirty log over the real daemon: after
/// `DaemonMemory::start_dirty_log` (LOG_ALL, SET_LOG_BASE with the VMM's
/// shared log), a READ the daemon answers marks its buffer's page, in
/// boot RAM and in RAM added while logging (the VMM sends the log base
/// again with the new region, which the daemon would not log otherwise),
/// and after the guest reset and activated the device again.
#[test]
fn the_vmm_log_names_a_reads_buffer_also_in_ram_added_while_logging() {
    let share = TempDir::new().unwrap();
    share_with_file(&share);
    let sockets = TempDir::new().unwrap();
    let socket = sockets.as_path().join("fs.sock");
    let mut child = start_daemon(share.as_path(), &socket);
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let nodeid = lookup(&mut guest, "f").nodeid;
    let fh = open(&mut guest, nodeid, libc::O_RDONLY);

    let memory = fs.daemon_memory();
    let log = Arc::new(SharedDirtyLog::new(ADDED_GPA + ADDED_SIZE).unwrap());
    memory.start_dirty_log(&log).expect("the daemon logs");
    assert_eq!(read_into(&mut guest, nodeid, fh, 0, DATA).0, 0);
    let pages = take_pages(&log);
    assert!(
        pages.contains(&(DATA / PAGE)),
        "the buffer's page: {pages:?}"
    );
    assert!(!pages.contains(&(UNREACHED / PAGE)));
    assert!(take_pages(&log).is_empty(), "taken: cleared");

    let file = TempFile::new().unwrap().into_file();
    file.set_len(ADDED_SIZE).unwrap();
    let region = Arc::new(
        vm_memory::GuestRegionMmap::from_range(
            GuestAddress(ADDED_GPA),
            index(ADDED_SIZE),
            Some(FileOffset::new(file, 0)),
        )
        .unwrap(),
    );
    let after = mem.insert_region(region.clone()).unwrap();
    memory.add_region(&after, &region).expect("added RAM");
    assert_eq!(read_into(&mut guest, nodeid, fh, 0, ADDED_GPA).0, 0);
    let pages = take_pages(&log);
    assert!(
        pages.contains(&(ADDED_GPA / PAGE)),
        "the buffer's page in the added RAM: {pages:?}"
    );

    // The guest resets the device and activates it again (a driver
    // reload, a reboot) while the migration logs: a fresh memory table
    // would have the daemon write unlogged, unless the log goes with it.
    drop(guest);
    assert!(fs.reset());
    // A driver starts its rings afresh.
    vm_memory::Bytes::write_slice(&mem, &[0u8; 0xf000], GuestAddress(0x1000)).unwrap();
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let nodeid = lookup(&mut guest, "f").nodeid;
    let fh = open(&mut guest, nodeid, libc::O_RDONLY);
    take_pages(&log);
    assert_eq!(read_into(&mut guest, nodeid, fh, 0, DATA).0, 0);
    let pages = take_pages(&log);
    assert!(
        pages.contains(&(DATA / PAGE)),
        "the buffer's page after the device was activated again: {pages:?}"
    );

    memory.stop_dirty_log().expect("stop");
    // The handle holds the connection too.
    drop(memory);
    drop(guest);
    drop(fs);
    assert!(child.wait().unwrap().success());
}
