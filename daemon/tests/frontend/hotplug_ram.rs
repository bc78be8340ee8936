//! Guest RAM added while the device runs (ACPI memory hot-plug): the
//! daemon must be able to serve a FUSE request whose buffer lies in it.

use std::sync::Arc;

use super::window_buffers::{lookup, open, read_into};
use super::*;

/// Where the added RAM sits: above the 16 MiB of boot RAM, as hot-plugged
/// RAM sits above 4 GiB.
const ADDED_GPA: u64 = 0x1_0000_0000;
const ADDED_SIZE: u64 = 2 * MIB;
const CHUNK: usize = 64 * 1024;

fn ram_region(gpa: u64, size: u64) -> Arc<virtio_devices::GuestRegionMmap> {
    let file = TempFile::new().unwrap().into_file();
    file.set_len(size).unwrap();
    Arc::new(
        vm_memory::GuestRegionMmap::from_range(
            GuestAddress(gpa),
            usize::try_from(size).unwrap(),
            Some(FileOffset::new(file, 0)),
        )
        .unwrap(),
    )
}

fn share_with_data() -> (TempDir, Vec<u8>) {
    let share = TempDir::new().unwrap();
    let data: Vec<u8> = (0..CHUNK)
        .map(|i| u8::try_from(i * 31 % 251).unwrap())
        .collect();
    std::fs::write(share.as_path().join("data.bin"), &data).unwrap();
    (share, data)
}

#[test]
fn a_read_into_ram_added_after_activation_is_served_once_the_daemon_has_it() {
    let (share, data) = share_with_data();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let mut daemon = start_daemon(share.as_path(), &socket);
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let node = lookup(&mut guest, "data.bin").nodeid;
    let fh = open(&mut guest, node, libc::O_RDONLY);

    // Before the daemon is told, the new RAM is no memory of the guest's.
    let (errno, _) = read_into(&mut guest, node, fh, 0, ADDED_GPA);
    assert_eq!(errno, libc::EFAULT, "a buffer outside the memory table");

    let region = ram_region(ADDED_GPA, ADDED_SIZE);
    let after = mem.insert_region(region.clone()).unwrap();
    fs.daemon_memory()
        .add_region(&after, &region)
        .expect("ADD_MEM_REG");
    assert_eq!(
        read_into(&mut guest, node, fh, 0, ADDED_GPA),
        (0, u32::try_from(CHUNK).unwrap())
    );
    let mut got = vec![0u8; CHUNK];
    after.read_slice(&mut got, GuestAddress(ADDED_GPA)).unwrap();
    assert!(got == data, "the file's bytes landed in the added RAM");

    // Taken back (a resize that failed later on): refused again.
    fs.daemon_memory()
        .remove_region(&mem, &region)
        .expect("REM_MEM_REG");
    assert_eq!(
        read_into(&mut guest, node, fh, 0, ADDED_GPA).0,
        libc::EFAULT
    );
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}

#[test]
fn a_memory_table_of_more_regions_than_one_message_carries_reaches_the_daemon_whole() {
    let (share, data) = share_with_data();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let mut daemon = start_daemon(share.as_path(), &socket);
    // Boot RAM plus 39 added regions: more than one SET_MEM_TABLE can carry
    // (32 fds in one message), as boot RAM split around the 32-bit hole
    // plus every hot-plug slot would be.
    let mut mem = guest_memory();
    for i in 0..39 {
        mem = mem
            .insert_region(ram_region(ADDED_GPA + i * ADDED_SIZE, ADDED_SIZE))
            .unwrap();
    }
    assert_eq!(vm_memory::GuestMemoryBackend::num_regions(&mem), 40);
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let node = lookup(&mut guest, "data.bin").nodeid;
    let fh = open(&mut guest, node, libc::O_RDONLY);
    let last = ADDED_GPA + 38 * ADDED_SIZE;
    assert_eq!(
        read_into(&mut guest, node, fh, 0, last),
        (0, u32::try_from(CHUNK).unwrap())
    );
    let mut got = vec![0u8; CHUNK];
    mem.read_slice(&mut got, GuestAddress(last)).unwrap();
    assert!(got == data, "the file's bytes landed in the last region");
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}
