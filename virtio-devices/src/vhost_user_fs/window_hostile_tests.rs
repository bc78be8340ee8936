//! What a host, a daemon or a guest can do to the window beyond
//! single bad requests — shrink a mapped file, exhaust the VMM's mappings
//! across windows, fill the scratch.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Mutex as StdMutex;

use vmm_sys_util::tempfile::TempFile;

use super::super::map_budget::vmas_for;
use super::*;

const PAGE: u64 = 4096;

fn map_req(fd_offset: u64, shm_offset: u64, len: u64) -> VhostUserMMap {
    VhostUserMMap {
        shmid: 0,
        fd_offset,
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

#[derive(Default)]
struct Events(StdMutex<Vec<WindowEvent>>);

impl WindowObserver for Events {
    fn event(&self, event: &WindowEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// A file shrunk on the host under a mapping: without the repair, the
/// first touch of a vanished page is SIGBUS here (and, from a guest, a vCPU
/// that never returns or a failed KVM_RUN). The watch reports it, the
/// scratch goes over the vanished pages, the rest stays mapped.
#[test]
fn pages_of_a_file_truncated_on_the_host_show_the_scratch() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let events = Arc::new(Events::default());
    w.set_observer(events.clone());
    assert!(w.file_watch_fd().is_some(), "inotify is available here");
    let f = file_of(8, b'x');
    let other = file_of(2, b'y');
    w.map(&map_req(0, 0, 8 * PAGE), f.as_file()).unwrap();
    w.map(&map_req(0, 16 * PAGE, 2 * PAGE), other.as_file())
        .unwrap();
    // A second mapping of the same file keeps no second descriptor.
    w.map(&map_req(0, 24 * PAGE, PAGE), f.as_file()).unwrap();
    assert_eq!(w.mapped_files(), 2);
    w.unmap(&map_req(0, 24 * PAGE, PAGE)).unwrap();
    assert_eq!(peek(&w, 7 * PAGE), b'x');
    // The host cuts the file to 2.5 pages.
    f.as_file().set_len(2 * PAGE + 100).unwrap();
    let repaired = w.on_file_events();
    assert_eq!(repaired, 5 * PAGE, "pages 3..8 are gone");
    assert_eq!(peek(&w, 7 * PAGE), 0, "a vanished page reads zeros");
    assert_eq!(peek(&w, 3 * PAGE), 0);
    assert_eq!(peek(&w, 2 * PAGE), b'x', "the last partial page stays");
    assert_eq!(peek(&w, 2 * PAGE + 200), 0, "zeros past EOF in that page");
    assert_eq!(peek(&w, 16 * PAGE), b'y', "other files are untouched");
    assert_eq!(w.metrics.snapshot().truncated_bytes, 5 * PAGE);
    assert_eq!(w.metrics.snapshot().bytes_mapped, 5 * PAGE);
    assert!(events.0.lock().unwrap().contains(&WindowEvent::Truncated {
        offset: 3 * PAGE,
        len: 5 * PAGE
    }));
    // Nothing more to repair; a file that grows changes nothing.
    f.as_file().set_len(8 * PAGE).unwrap();
    assert_eq!(w.on_file_events(), 0);
    assert_eq!(w.repair_truncated(None), 0);
}

/// Two windows at the per-window cap would together pass
/// `vm.max_map_count` and abort the VMM at its next mmap. They share one
/// budget; a map past it is refused with ENOSPC and changes nothing, and
/// room given back by one window serves the other.
#[test]
fn windows_share_one_mapping_budget() {
    // Room for the two windows and three separate mappings between them.
    let budget = Arc::new(MapBudget::new(2 * vmas_for(0) + 6));
    let a = DaxWindow::with_budget(64 * PAGE, budget.clone()).unwrap();
    let b = DaxWindow::with_budget(64 * PAGE, budget.clone()).unwrap();
    let f = file_of(16, b'z');
    a.map(&map_req(0, 0, PAGE), f.as_file()).unwrap();
    a.map(&map_req(0, 4 * PAGE, PAGE), f.as_file()).unwrap();
    b.map(&map_req(0, 0, PAGE), f.as_file()).unwrap();
    let e = b.map(&map_req(0, 8 * PAGE, PAGE), f.as_file()).unwrap_err();
    assert_eq!(
        (e.errno, e.reason),
        (libc::ENOSPC, FailureReason::TooManyMappings)
    );
    assert!(e.message.contains("vm.max_map_count"), "{e}");
    assert_eq!(peek(&b, 8 * PAGE), 0, "the refused range stays unmapped");
    assert_eq!(budget.used(), budget.limit());
    // Replacing a mapping needs no more.
    b.map(&map_req(PAGE, 0, PAGE), f.as_file()).unwrap();
    a.unmap(&map_req(0, 4 * PAGE, PAGE)).unwrap();
    b.map(&map_req(0, 8 * PAGE, PAGE), f.as_file()).unwrap();
    // A third window cannot even start once the budget is spent.
    assert!(matches!(
        DaxWindow::with_budget(64 * PAGE, budget.clone()),
        Err(WindowError::MapBudget { .. })
    ));
    drop(a);
    drop(b);
    assert_eq!(budget.used(), 0, "dropped windows give everything back");
}

/// A guest that writes outside any mapping keeps at most the budget in the
/// scratch: past it the scratch is emptied on the next tick.
#[test]
fn the_scratch_is_emptied_past_its_budget() {
    let window = 8 * GUEST_RANGE_SIZE;
    let w = DaxWindow::new(window).unwrap();
    let budget = w.stray_budget();
    let at = |o: u64| (w.host_addr() + o) as *mut u8;
    for o in (0..budget).step_by(usize::try_from(PAGE).unwrap()) {
        // SAFETY: inside the window, which shows the scratch everywhere.
        unsafe { std::ptr::write_volatile(at(o), 1) };
    }
    w.tick();
    assert_eq!(w.stray_resets(), 0, "at the budget: kept");
    assert_eq!(peek(&w, 0), 1);
    // SAFETY: as above.
    unsafe { std::ptr::write_volatile(at(budget), 1) };
    w.tick();
    assert_eq!(w.stray_resets(), 1);
    assert_eq!(peek(&w, 0), 0, "emptied: zeros again");
    // The count keeps what was emptied: stray accesses stay visible in
    // the metrics after the scratch is freed (and the read above adds one
    // page again).
    assert_eq!(w.stray_bytes().unwrap(), budget + 2 * PAGE);
}

/// Whether the mapping holding `addr` is left out of core dumps.
fn dont_dump_at(addr: u64) -> bool {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((s, e)) = line.split_once(' ').and_then(|(r, _)| r.split_once('-')) {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                inside = (s..e).contains(&addr);
                continue;
            }
        }
        if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
            return flags.split_whitespace().any(|f| f == "dd");
        }
    }
    panic!("no mapping at {addr:#x}");
}

/// A core dump of the VMM must not hold what the guest sees through the
/// window: its file mappings and its scratch are MADV_DONTDUMP.
#[test]
fn the_window_is_left_out_of_core_dumps() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let f = file_of(4, b'q');
    w.map(&map_req(0, 8 * PAGE, 4 * PAGE), f.as_file()).unwrap();
    assert!(dont_dump_at(w.host_addr()), "scratch");
    assert!(dont_dump_at(w.host_addr() + 8 * PAGE), "file mapping");
    w.unmap(&map_req(0, 8 * PAGE, 4 * PAGE)).unwrap();
    assert!(dont_dump_at(w.host_addr() + 8 * PAGE), "scratch again");
}

/// The permissions and the name of the mapping holding `addr`.
fn mapping_at(addr: u64) -> (String, String) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for l in maps.lines() {
        let mut words = l.split_whitespace();
        let (range, perms) = (words.next().unwrap(), words.next().unwrap());
        let (s, e) = range.split_once('-').unwrap();
        let (s, e) = (
            u64::from_str_radix(s, 16).unwrap(),
            u64::from_str_radix(e, 16).unwrap(),
        );
        if (s..e).contains(&addr) {
            return (perms.into(), words.nth(3).unwrap_or("").into());
        }
    }
    panic!("no mapping at {addr:#x}");
}

/// The guest, not yet aware that the host cut a file short,
/// writes to a page it had read: its fault maps the same vanished range
/// again, writable. Left to KVM, the first touch of such a page hung the
/// vCPU for good (Linux 6.12 retried the fault as an async page fault for
/// ever) and no inotify event came to repair it. The pages past the end are
/// guarded instead; the vCPU's failed access shows the scratch there,
/// writable, once, and a second fault finds nothing left to do.
#[test]
fn a_map_of_pages_past_the_end_is_guarded_and_a_touch_shows_writable_zeros() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let events = Arc::new(Events::default());
    w.set_observer(events.clone());
    let f = file_of(8, b'x');
    w.map(&map_req(0, 0, 8 * PAGE), f.as_file()).unwrap();
    f.as_file().set_len(PAGE).unwrap();
    assert_eq!(w.on_file_events(), 7 * PAGE);
    // The guest's write upgrade: the whole range again, writable.
    w.map(&map_req(0, 0, 8 * PAGE), f.as_file()).unwrap();
    let tail = w.host_addr() + 3 * PAGE;
    assert_eq!(mapping_at(tail).0, "---s", "past the end: guarded");
    assert_eq!(mapping_at(w.host_addr()).0, "rw-s", "the file's page");
    assert_eq!(peek(&w, 0), b'x');
    // What a vCPU's EFAULT runs, KVM not saying where.
    let truncated_before = w.metrics.snapshot().truncated_bytes;
    assert_eq!(w.repair_after_fault(None), 7 * PAGE);
    let (perms, name) = mapping_at(tail);
    assert_eq!(perms, "rw-s");
    assert!(name.contains("dax-window-scratch"), "{name}");
    // SAFETY: inside the window, which shows the scratch there now.
    unsafe { std::ptr::write_volatile(tail as *mut u8, 7) };
    assert_eq!(peek(&w, 3 * PAGE), 7, "the guest's write lands");
    assert_eq!(peek(&w, 7 * PAGE), 0);
    assert_eq!(peek(&w, 0), b'x', "the file's page stays");
    assert_eq!(
        w.metrics.snapshot().truncated_bytes,
        truncated_before + 7 * PAGE
    );
    assert!(events.0.lock().unwrap().contains(&WindowEvent::Truncated {
        offset: PAGE,
        len: 7 * PAGE
    }));
    assert_eq!(w.repair_after_fault(None), 0, "nothing left to repair");
}

/// The last range of a file reaches past its end as the guest maps it, and
/// the guest may extend the file (FUSE WRITE) and then use those pages
/// through the same mapping: a guarded page the file has grown into shows
/// the file when touched, and the file's growth is no truncation.
#[test]
fn a_guarded_page_the_file_grew_into_shows_the_file_when_touched() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let base = 0x10_0000_0000;
    w.set_guest_base(base);
    let events = Arc::new(Events::default());
    w.set_observer(events.clone());
    let f = file_of(1, b'x');
    let mut req = map_req(0, 16 * PAGE, 4 * PAGE);
    req.flags = 0;
    w.map(&req, f.as_file()).unwrap();
    assert_eq!(mapping_at(w.host_addr() + 17 * PAGE).0, "---s");
    f.as_file().write_all_at(&[b'y'; 4096], PAGE).unwrap();
    assert_eq!(w.on_file_events(), 0, "growing is no truncation");
    assert_eq!(w.repair_truncated(None), 0);
    assert!(events
        .0
        .lock()
        .unwrap()
        .iter()
        .all(|e| !matches!(e, WindowEvent::Truncated { .. })));
    // A touch of the grown page, KVM saying where.
    assert_eq!(w.repair_after_fault(Some(base + 17 * PAGE)), PAGE);
    assert_eq!(mapping_at(w.host_addr() + 17 * PAGE).0, "r--s");
    assert_eq!(peek(&w, 17 * PAGE), b'y');
    assert_eq!(
        mapping_at(w.host_addr() + 18 * PAGE).0,
        "---s",
        "still past the end"
    );
    // A touch past the end: zeros.
    assert_eq!(w.repair_after_fault(Some(base + 19 * PAGE)), 2 * PAGE);
    assert_eq!(peek(&w, 19 * PAGE), 0);
    assert_eq!(peek(&w, 16 * PAGE), b'x');
    // A fault elsewhere in the window is none of the guards' doing.
    assert_eq!(w.repair_after_fault(Some(base + 40 * PAGE)), 0);
}

/// A map served for the daemon empties the scratch it hides after the ack
/// (the device worker's turn at what maps leave), not while the guest waits
/// for the map; a range that shows the scratch again before that turn
/// keeps the stray writes made there since. A map not served for the
/// daemon (a restore's) empties it at once.
#[test]
fn the_scratch_a_map_hides_is_emptied_after_the_ack_and_never_after_an_unmap() {
    let w = DaxWindow::new(64 * PAGE).unwrap();
    let f = file_of(4, b'f');
    let poke = |offset: u64, byte: u8| {
        assert!(offset < w.size());
        // SAFETY: the window shows a file or the scratch at every offset.
        unsafe { std::ptr::write_volatile((w.host_addr() + offset) as *mut u8, byte) }
    };
    let resident = || w.scratch.resident_bytes().unwrap();
    poke(0, 9);
    assert_eq!(resident(), PAGE);
    w.map_deferring_prefault(&map_req(0, 0, PAGE), f.as_file())
        .unwrap();
    assert_eq!(peek(&w, 0), b'f');
    assert_eq!(resident(), PAGE, "left for after the ack");
    w.run_deferred_prefault(&|| false);
    assert_eq!(resident(), 0);

    // Unmapped before the worker's turn: a stray write after the unmap stays.
    w.map_deferring_prefault(&map_req(0, 8 * PAGE, PAGE), f.as_file())
        .unwrap();
    w.unmap(&map_req(0, 8 * PAGE, PAGE)).unwrap();
    poke(8 * PAGE, 5);
    w.run_deferred_prefault(&|| false);
    assert_eq!(peek(&w, 8 * PAGE), 5);

    poke(16 * PAGE, 3);
    w.map(&map_req(0, 16 * PAGE, PAGE), f.as_file()).unwrap();
    assert_eq!(resident(), PAGE, "only the stray page at 8 is held");
    assert_eq!(w.stray_bytes().unwrap(), 3 * PAGE, "all three counted");
}
