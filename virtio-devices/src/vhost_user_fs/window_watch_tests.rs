//! A window's watch of its mapped files under load: a guest writing a
//! mapped file a byte at a time, and more files than the VMM's watch
//! budget.

use std::io::Write;
use std::os::unix::fs::FileExt;

use vmm_sys_util::tempfile::TempFile;

use super::*;

const PAGE: u64 = 4096;

fn map_req(shm_offset: u64, len: u64) -> VhostUserMMap {
    VhostUserMMap {
        shmid: 0,
        fd_offset: 0,
        shm_offset,
        len,
        flags: 1,
        ..Default::default()
    }
}

fn file_of(pages: u64, byte: u8) -> TempFile {
    let f = TempFile::new().unwrap();
    f.as_file()
        .write_all(&vec![byte; usize::try_from(pages * PAGE).unwrap()])
        .unwrap();
    f
}

fn peek(w: &DaxWindow, offset: u64) -> u8 {
    assert!(offset < w.size());
    // SAFETY: the window shows a file or the scratch at every offset.
    unsafe { std::ptr::read_volatile((w.host_addr() + offset) as *const u8) }
}

/// Walks of every mapping made under the window's lock so far.
fn walks(w: &DaxWindow) -> u64 {
    w.mapped.lock().unwrap().files.walks()
}

/// 10,000 one-byte writes to a mapped file, the device worker woken after
/// each: one size read per wake-up, outside the lock, and no walk of the
/// mappings under the lock SHMEM_MAP and the vCPU repair take (it was an
/// fstat and a walk under that lock per write). A truncation still takes
/// it, once.
#[test]
fn one_byte_writes_to_a_mapped_file_never_take_the_window_lock() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let f = file_of(8, b'x');
    let other = file_of(2, b'y');
    w.map(&map_req(0, 8 * PAGE), f.as_file()).unwrap();
    w.map(&map_req(16 * PAGE, 2 * PAGE), other.as_file())
        .unwrap();
    for i in 0..10_000u64 {
        f.as_file().write_at(b"z", i % (8 * PAGE)).unwrap();
        assert_eq!(w.on_file_events(), 0);
    }
    assert_eq!(walks(&w), 0, "no walk under the window's lock");
    assert!(
        w.file_watch.size_checks() <= 10_000,
        "one size read per wake-up at most"
    );
    assert_eq!(peek(&w, 7 * PAGE), b'x');
    // Appends grow the file: still nothing to do under the lock.
    f.as_file().write_at(b"tail", 8 * PAGE).unwrap();
    assert_eq!(w.on_file_events(), 0);
    assert_eq!(walks(&w), 0);
    // The host cuts it to 2 pages: found, and repaired under the lock.
    f.as_file().set_len(2 * PAGE).unwrap();
    assert_eq!(w.on_file_events(), 6 * PAGE);
    assert_eq!(walks(&w), 1);
    assert_eq!(peek(&w, 7 * PAGE), 0);
    assert_eq!(peek(&w, 16 * PAGE), b'y', "the other file is untouched");
}

/// With a budget of 2 watches, a third mapped file gets none (counted) and
/// is read every tick: its truncation is repaired there. An unmapped file
/// gives its watch back, and a dropped window all of them.
#[test]
fn files_past_the_watch_budget_are_checked_every_tick() {
    let watches = Arc::new(WatchBudget::new(2));
    let w = DaxWindow::with_budgets(64 * PAGE, MapBudget::process(), watches.clone()).unwrap();
    let files: Vec<TempFile> = (0..3).map(|i| file_of(4, b'a' + i)).collect();
    for (i, f) in (0u64..).zip(&files) {
        w.map(&map_req(i * 8 * PAGE, 4 * PAGE), f.as_file())
            .unwrap();
    }
    assert_eq!(w.watched_files(), (3, 2));
    assert_eq!((w.watch_refusals(), watches.used()), (1, 2));
    // The unwatched file (the third) is cut to one page.
    files[2].as_file().set_len(PAGE).unwrap();
    assert_eq!(w.on_file_events(), 0, "no watch tells of it");
    w.tick();
    assert_eq!(w.metrics.snapshot().truncated_bytes, 3 * PAGE);
    assert_eq!(peek(&w, 16 * PAGE), b'c');
    assert_eq!(peek(&w, 17 * PAGE), 0, "repaired: zeros");
    // A watched file unmapped gives its watch back; the next file takes it.
    w.unmap(&map_req(0, 4 * PAGE)).unwrap();
    assert_eq!(watches.used(), 1);
    let d = file_of(1, b'd');
    w.map(&map_req(32 * PAGE, PAGE), d.as_file()).unwrap();
    assert_eq!((w.watched_files(), watches.used()), ((3, 2), 2));
    drop(w);
    assert_eq!(watches.used(), 0);
}

/// A file mapped past its end (a small file in a whole range) and then
/// appended to, a write at a time, as a guest's file-extending writes go
/// through the daemon: each appended page shows through the mapping. (Any
/// modification used to replace the pages past the file's end with the
/// scratch, so the next append's bytes read as zeros in the window.)
#[test]
fn appends_to_a_file_mapped_past_its_end_show_through_the_window() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let f = file_of(1, b'a');
    w.map(&map_req(0, 4 * PAGE), f.as_file()).unwrap();
    for (page, byte) in (1u64..4).zip(b'b'..) {
        f.as_file()
            .write_at(&vec![byte; usize::try_from(PAGE).unwrap()], page * PAGE)
            .unwrap();
        assert_eq!(w.on_file_events(), 0);
    }
    // The pages past the end at map time are guarded until the guest
    // touches them; its fault (KVM gives no address on Linux 6.12) gives
    // the file back where it grew.
    assert_eq!(w.repair_after_fault(None), 3 * PAGE);
    assert_eq!(
        (0..4).map(|p| peek(&w, p * PAGE)).collect::<Vec<u8>>(),
        b"abcd"
    );
    assert_eq!(w.metrics.snapshot().truncated_bytes, 0);
}
