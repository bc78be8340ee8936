use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;

use vmm_sys_util::tempfile::TempFile;

use super::super::scratch::stray_budget;
use super::*;

const PAGE: u64 = 4096;
const WINDOW: u64 = 16 * PAGE;

fn req(shmid: u8, fd_offset: u64, shm_offset: u64, len: u64, flags: u64) -> VhostUserMMap {
    VhostUserMMap {
        shmid,
        fd_offset,
        shm_offset,
        len,
        flags,
        ..Default::default()
    }
}

fn file_with(pages: u64) -> TempFile {
    let f = TempFile::new().unwrap();
    let mut data = Vec::new();
    for p in 0..pages {
        data.extend(std::iter::repeat_n(
            b'a' + u8::try_from(p).unwrap(),
            usize::try_from(PAGE).unwrap(),
        ));
    }
    f.as_file().write_all(&data).unwrap();
    f
}

/// Reads a byte of the window (only where a file is mapped).
fn peek(w: &DaxWindow, offset: u64) -> u8 {
    assert!(offset < w.size());
    // SAFETY: the test maps the page at `offset` before reading it.
    unsafe { std::ptr::read_volatile((w.host_addr() + offset) as *const u8) }
}

/// Whether the window shows its scratch (nothing mapped) at `offset`.
fn shows_scratch(w: &DaxWindow, offset: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let addr = w.host_addr() + offset;
    maps.lines().any(|l| {
        let (range, rest) = l.split_once(' ').unwrap();
        let (s, e) = range.split_once('-').unwrap();
        let (s, e) = (
            u64::from_str_radix(s, 16).unwrap(),
            u64::from_str_radix(e, 16).unwrap(),
        );
        (s..e).contains(&addr) && rest.starts_with("rw-s") && rest.contains("dax-window-scratch")
    })
}

#[test]
fn refuses_bad_requests_without_mapping_anything() {
    let w = DaxWindow::new(WINDOW).unwrap();
    let f = file_with(4);
    let cases = [
        (
            "unknown region",
            req(1, 0, 0, PAGE, 0),
            FailureReason::UnknownRegion,
        ),
        ("zero length", req(0, 0, 0, 0, 0), FailureReason::ZeroLength),
        (
            "past the end",
            req(0, 0, WINDOW - PAGE, 2 * PAGE, 0),
            FailureReason::OutOfBounds,
        ),
        (
            "offset past the end",
            req(0, 0, WINDOW, PAGE, 0),
            FailureReason::OutOfBounds,
        ),
        (
            "shm overflow",
            req(0, 0, u64::MAX - PAGE + 1, PAGE, 0),
            FailureReason::OutOfBounds,
        ),
        (
            "fd overflow",
            req(0, u64::MAX - PAGE + 1, 0, PAGE, 0),
            FailureReason::OutOfBounds,
        ),
        (
            "fd past off_t",
            req(0, 1 << 63, 0, PAGE, 0),
            FailureReason::OutOfBounds,
        ),
        (
            "misaligned shm_offset",
            req(0, 0, 512, PAGE, 0),
            FailureReason::Misaligned,
        ),
        (
            "misaligned fd_offset",
            req(0, 1, 0, PAGE, 0),
            FailureReason::Misaligned,
        ),
        (
            "misaligned len",
            req(0, 0, 0, PAGE + 1, 0),
            FailureReason::Misaligned,
        ),
        (
            "unknown flags",
            req(0, 0, 0, PAGE, 2),
            FailureReason::BadFlags,
        ),
    ];
    for &(what, r, reason) in &cases {
        let e = w.map(&r, f.as_file()).expect_err(what);
        assert_eq!(e.reason, reason, "{what}: {e}");
        assert_eq!(e.errno, libc::EINVAL, "{what}");
        assert_eq!(
            w.unmap(&r).expect_err(what).reason,
            reason,
            "{what}: unmap refused too"
        );
    }
    assert!(shows_scratch(&w, 0), "nothing was mapped");
    let s = w.metrics.snapshot();
    assert_eq!((s.maps, s.bytes_mapped), (0, 0));
    assert_eq!(
        s.failures.iter().map(|f| f.1).sum::<u64>(),
        2 * cases.len() as u64
    );
}

#[test]
fn refuses_fds_that_are_not_files() {
    let w = DaxWindow::new(WINDOW).unwrap();
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let e = w.map(&req(0, 0, 0, PAGE, 0), &a).unwrap_err();
    assert_eq!(e.reason, FailureReason::BadFd, "{e}");
    let closed = TempFile::new().unwrap().into_file().as_raw_fd();
    let e = w.map(&req(0, 0, 0, PAGE, 0), &closed).unwrap_err();
    assert_eq!(e.reason, FailureReason::BadFd, "{e}");
    // A block device was once accepted; the daemon maps only regular
    // files. (An O_PATH descriptor of a device node suffices for fstat.)
    let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
    let node = dir.as_path().join("blk");
    let cpath = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `cpath` is NUL-terminated; the test runs as root (as CI does).
    let r = unsafe { libc::mknod(cpath.as_ptr(), libc::S_IFBLK | 0o600, libc::makedev(7, 0)) };
    assert_eq!(r, 0, "mknod: {}", std::io::Error::last_os_error());
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(&node)
        .unwrap();
    let e = w.map(&req(0, 0, 0, PAGE, 0), &dev).unwrap_err();
    assert_eq!(e.reason, FailureReason::BadFd, "{e}");
    assert!(e.message.contains("not a regular file"), "{e}");
}

#[test]
fn writable_mapping_of_a_read_only_fd_fails_cleanly() {
    let w = DaxWindow::new(WINDOW).unwrap();
    let f = file_with(1);
    let ro = std::fs::File::open(f.as_path()).unwrap();
    let e = w.map(&req(0, 0, 0, PAGE, 1), &ro).unwrap_err();
    assert_eq!(
        (e.reason, e.errno),
        (FailureReason::MapFailed, libc::EACCES),
        "{e}"
    );
    assert!(shows_scratch(&w, 0));
    w.map(&req(0, 0, 0, PAGE, 0), &ro)
        .expect("read-only mapping of a read-only fd");
    assert_eq!(peek(&w, 0), b'a');
}

#[test]
fn maps_file_bytes_and_unmaps_back_to_the_scratch() {
    let w = DaxWindow::new(WINDOW).unwrap();
    let f = file_with(4);
    // File pages 1..3 at window pages 8..10.
    w.map(&req(0, PAGE, 8 * PAGE, 2 * PAGE, 1), f.as_file())
        .unwrap();
    assert_eq!(peek(&w, 8 * PAGE), b'b');
    assert_eq!(peek(&w, 9 * PAGE + 17), b'c');
    assert!(shows_scratch(&w, 7 * PAGE) && shows_scratch(&w, 10 * PAGE));
    // A write through the window lands in the file (MAP_SHARED).
    // SAFETY: window page 8 is mapped read-write above.
    unsafe { std::ptr::write_volatile((w.host_addr() + 8 * PAGE) as *mut u8, b'X') };
    let content = std::fs::read(f.as_path()).unwrap();
    assert_eq!(content[usize::try_from(PAGE).unwrap()], b'X');
    assert_eq!(w.metrics.snapshot().bytes_mapped, 2 * PAGE);

    // Remapping an overlapping range counts only the new bytes.
    w.map(&req(0, 0, 9 * PAGE, 2 * PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(w.metrics.snapshot().bytes_mapped, 3 * PAGE);
    assert_eq!(
        peek(&w, 10 * PAGE),
        b'X',
        "file page 1, written through the window above"
    );

    // Unmapping the middle splits the bookkeeping.
    w.unmap(&req(0, 0, 9 * PAGE, PAGE, 0)).unwrap();
    assert!(shows_scratch(&w, 9 * PAGE));
    assert_eq!(peek(&w, 8 * PAGE), b'X');
    assert_eq!(w.metrics.snapshot().bytes_mapped, 2 * PAGE);
    // Unmapping what is not mapped is harmless.
    w.unmap(&req(0, 0, 0, 4 * PAGE, 0)).unwrap();
    assert_eq!(w.metrics.snapshot().bytes_mapped, 2 * PAGE);

    w.clear();
    let s = w.metrics.snapshot();
    assert_eq!((s.maps, s.unmaps, s.bytes_mapped, s.resets), (2, 2, 0, 1));
    assert!(shows_scratch(&w, 8 * PAGE) && shows_scratch(&w, 10 * PAGE));
}

#[test]
fn window_size_must_be_whole_pages() {
    assert!(DaxWindow::new(0).is_err());
    assert!(DaxWindow::new(PAGE + 1)
        .err()
        .unwrap()
        .to_string()
        .contains("multiple of the host page size"));
}

/// Finding 4: every SHMEM_MAP was its own mapping with no bound, so a
/// daemon (or a guest through it) could pass `vm.max_map_count` and make
/// the VMM's next allocation abort it. Past the cap a map — and an unmap
/// that would split a range — is refused with ENOSPC and counted; what is
/// mapped stays mapped, and requests that do not add mappings still work.
#[test]
fn separate_mappings_are_capped_with_enospc_and_the_window_keeps_serving() {
    let mut w = DaxWindow::new(WINDOW).unwrap();
    w.set_max_mappings(3);
    let f = file_with(16);
    // Every other page: three separate mappings.
    for i in 0..3 {
        w.map(&req(0, 0, 2 * i * PAGE, PAGE, 0), f.as_file())
            .unwrap();
    }
    let e = w
        .map(&req(0, 0, 8 * PAGE, PAGE, 0), f.as_file())
        .unwrap_err();
    assert_eq!(
        (e.errno, e.reason),
        (libc::ENOSPC, FailureReason::TooManyMappings)
    );
    assert!(e.message.contains("over the cap of 3"), "{e}");
    assert!(
        shows_scratch(&w, 8 * PAGE),
        "the refused range stays unmapped"
    );
    assert_eq!(peek(&w, 2 * PAGE), b'a', "earlier mappings stay");
    // Replacing an existing range adds nothing: allowed.
    w.map(&req(0, PAGE, 2 * PAGE, PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(peek(&w, 2 * PAGE), b'b');
    // A map that covers two ranges merges them in the count: allowed, and
    // then there is room again.
    w.map(&req(0, 0, 0, 3 * PAGE, 0), f.as_file()).unwrap();
    w.map(&req(0, 0, 8 * PAGE, PAGE, 0), f.as_file()).unwrap();
    // Splitting a range by unmapping its middle would make a fourth.
    let e = w.unmap(&req(0, 0, PAGE, PAGE, 0)).unwrap_err();
    assert_eq!(e.errno, libc::ENOSPC);
    w.unmap(&req(0, 0, 0, 3 * PAGE, 0)).unwrap();
    assert_eq!(
        w.metrics
            .snapshot()
            .failures
            .iter()
            .find(|(r, _)| *r == "too_many_mappings")
            .map(|f| f.1),
        Some(2)
    );
    assert_eq!(DEFAULT_MAX_MAPPINGS, 16384);
}

#[test]
fn window_size_is_bounded_whoever_declares_it() {
    let e = DaxWindow::new(MAX_WINDOW_SIZE + (2 << 20)).err().unwrap();
    assert!(
        e.to_string()
            .contains("over the limit of 274877906944 bytes (256 GiB)"),
        "{e}"
    );
}

#[test]
fn every_window_the_daemon_may_announce_is_accepted() {
    // The daemon announces its policy's cache_size, which validation keeps
    // to dax_abi::window_size_fits; the VMM must not refuse any of those.
    for size in [
        dax_abi::MIN_WINDOW_SIZE,
        64 * GUEST_RANGE_SIZE,
        MAX_WINDOW_SIZE,
    ] {
        assert!(dax_abi::window_size_fits(size));
        assert!(DaxWindow::check_size(size).is_ok(), "{size}");
    }
    assert!(matches!(
        DaxWindow::check_size(MAX_WINDOW_SIZE + GUEST_RANGE_SIZE),
        Err(WindowError::TooLarge { .. })
    ));
    assert!(matches!(
        DaxWindow::check_size(0),
        Err(WindowError::Size { .. })
    ));
}

#[test]
fn mapped_ranges_split_and_merge() {
    let mut m = MappedRanges::default();
    assert_eq!(m.insert(0, 100), 0);
    assert_eq!(m.insert(50, 150), 50);
    assert_eq!(m.remove(25, 75), 50);
    assert_eq!(
        m.0.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(),
        vec![(0, 25), (75, 150)]
    );
    assert_eq!(m.remove(0, 1000), 100);
    assert!(m.0.is_empty());
}

#[test]
fn guest_ranges_count_each_2m_range_once() {
    let mut m = MappedRanges::default();
    assert_eq!(m.ranges_touched(GUEST_RANGE_SIZE), 0);
    m.insert(0, 4096);
    m.insert(8192, 12288);
    assert_eq!(
        m.ranges_touched(GUEST_RANGE_SIZE),
        1,
        "two mappings in the first range"
    );
    m.insert(GUEST_RANGE_SIZE - 4096, GUEST_RANGE_SIZE + 4096);
    assert_eq!(
        m.ranges_touched(GUEST_RANGE_SIZE),
        2,
        "a mapping straddling into the second"
    );
    m.insert(5 * GUEST_RANGE_SIZE, 7 * GUEST_RANGE_SIZE);
    assert_eq!(m.ranges_touched(GUEST_RANGE_SIZE), 4);
}

#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<WindowEvent>>);

impl WindowObserver for Recorder {
    fn event(&self, event: &WindowEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

#[test]
fn observer_hears_maps_unmaps_refusals_and_resets_and_mincore_sees_touched_pages() {
    let w = DaxWindow::new(16 * PAGE).unwrap();
    let rec = std::sync::Arc::new(Recorder::default());
    w.set_observer(rec.clone());
    let f = file_with(4);
    assert_eq!(w.resident_bytes().unwrap(), 0);
    w.map(&req(0, 0, 0, 2 * PAGE, 1), f.as_file()).unwrap();
    assert_eq!(peek(&w, 0), b'a');
    // The file's pages are in the host page cache (just written).
    assert_eq!(w.resident_bytes().unwrap(), 2 * PAGE);
    assert!(w.map(&req(0, 0, PAGE / 2, PAGE, 0), f.as_file()).is_err());
    w.unmap(&req(0, 0, 0, 2 * PAGE, 0)).unwrap();
    assert_eq!(w.resident_bytes().unwrap(), 0);
    w.clear();
    let events = rec.0.lock().unwrap().clone();
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(
        matches!(events[0], WindowEvent::Map { offset: 0, len, writable: true, .. } if len == 2 * PAGE)
    );
    assert!(matches!(
        events[1],
        WindowEvent::Refused {
            request: "map",
            reason: FailureReason::Misaligned,
            ..
        }
    ));
    assert!(matches!(events[2], WindowEvent::Unmap { offset: 0, .. }));
    assert_eq!(events[3], WindowEvent::Reset);
}

/// Ranges with nothing mapped used to be PROT_NONE, and a guest access
/// there made KVM_RUN fail and ended the VM. They now show the scratch:
/// readable (zeros at first), writable, the writes going nowhere but the
/// scratch, counted. Each window page has its own scratch page,
/// so what is written through one range never shows through another.
#[test]
fn unmapped_ranges_read_zeros_take_writes_into_the_scratch_and_are_counted() {
    let window = 8 * GUEST_RANGE_SIZE;
    let w = DaxWindow::new(window).unwrap();
    assert_eq!(
        w.host_addr() % GUEST_RANGE_SIZE,
        0,
        "2 MiB-aligned on the host"
    );
    assert_eq!(stray_budget(window), GUEST_RANGE_SIZE);
    assert_eq!(stray_budget(256 << 30), 128 << 20);
    assert_eq!(w.stray_bytes().unwrap(), 0);
    let at = |o: u64| (w.host_addr() + o) as *mut u8;
    // SAFETY: every offset is inside the window, which shows the scratch
    // (or a file) everywhere: valid memory for the life of `w`.
    unsafe {
        assert_eq!(std::ptr::read_volatile(at(5 * PAGE)), 0);
        std::ptr::write_volatile(at(3 * GUEST_RANGE_SIZE + 5 * PAGE), 7);
        // Not seen at the same offset of another 2 MiB range.
        assert_eq!(std::ptr::read_volatile(at(5 * PAGE)), 0);
        assert_eq!(
            std::ptr::read_volatile(at(3 * GUEST_RANGE_SIZE + 5 * PAGE)),
            7
        );
    }
    assert_eq!(
        w.stray_bytes().unwrap(),
        2 * PAGE,
        "two scratch pages touched"
    );
    // A file mapped over the range hides the scratch; unmapped, it is back,
    // empty, and the file never saw the stray write.
    let f = file_with(1);
    let stray = 3 * GUEST_RANGE_SIZE + 5 * PAGE;
    w.map(&req(0, 0, stray, PAGE, 1), f.as_file()).unwrap();
    assert_eq!(peek(&w, stray), b'a');
    w.unmap(&req(0, 0, stray, PAGE, 0)).unwrap();
    assert!(shows_scratch(&w, stray));
    assert_eq!(peek(&w, stray), 0);
    assert_eq!(std::fs::read(f.as_path()).unwrap()[0], b'a');
    // Resident bytes count file mappings only, not the scratch.
    assert_eq!(w.resident_bytes().unwrap(), 0);
    // A reset leaves the whole window readable.
    w.clear();
    assert!(shows_scratch(&w, 0) && shows_scratch(&w, window - PAGE));
    assert_eq!(peek(&w, window - PAGE), 0);
}

#[test]
fn windows_of_a_gib_or_more_are_gib_aligned_on_the_host() {
    let w = DaxWindow::new(1 << 30).unwrap();
    assert_eq!(w.host_addr() % (1 << 30), 0);
    assert!(shows_scratch(&w, (1 << 30) - PAGE));
}

/// Resident pages this process has mapped (its page tables) in the VMA that
/// starts at `addr`, from /proc/self/smaps: what a pre-fault fills.
fn rss_of_vma_at(addr: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for l in smaps.lines() {
        if let Some((range, _)) = l.split_once(' ').filter(|(r, _)| r.contains('-')) {
            let start = u64::from_str_radix(range.split_once('-').unwrap().0, 16).unwrap_or(0);
            inside = start == addr;
        } else if inside {
            if let Some(kb) = l.strip_prefix("Rss:") {
                return kb
                    .trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap()
                    * 1024;
            }
        }
    }
    panic!("no VMA at {addr:#x}");
}

/// A new mapping's pages are in the VMM's page tables at once, up to the
/// end of the file (a range past it, as the guest maps 2 MiB ranges of
/// small files, is neither populated nor an error); with `prefault=off`
/// nothing is until touched.
#[test]
fn new_mappings_are_prefaulted_up_to_the_end_of_the_file() {
    let w = DaxWindow::new(WINDOW).unwrap();
    w.set_prefault(true);
    // Three pages and a bit: four pages of file, eight mapped.
    let f = file_with(3);
    f.as_file().write_all(b"tail").unwrap();
    w.map(&req(0, 0, 0, 8 * PAGE, 0), f.as_file()).unwrap();
    assert_eq!(rss_of_vma_at(w.host_addr()), 4 * PAGE);
    let s = w.metrics.snapshot();
    assert_eq!((s.prefaulted_bytes, s.prefault_failures), (4 * PAGE, 0));
    assert_eq!(peek(&w, 3 * PAGE + 2), b'i');

    // A mapping that starts past the end of the file populates nothing.
    // (Not next to the first, which the kernel would merge it into.)
    w.map(&req(0, 8 * PAGE, 12 * PAGE, 4 * PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(rss_of_vma_at(w.host_addr() + 12 * PAGE), 0);
    assert_eq!(w.metrics.snapshot().prefaulted_bytes, 4 * PAGE);

    let cold = DaxWindow::new(WINDOW).unwrap();
    cold.set_prefault(false);
    cold.map(&req(0, 0, 0, 4 * PAGE, 0), f.as_file()).unwrap();
    assert_eq!(rss_of_vma_at(cold.host_addr()), 0);
    assert_eq!(peek(&cold, PAGE), b'b');
    // The touched page, and the neighbours the kernel's fault-around maps
    // from the page cache with it.
    assert!(rss_of_vma_at(cold.host_addr()) >= PAGE);
    assert_eq!(cold.metrics.snapshot().prefaulted_bytes, 0);
}

/// Records what it is asked to map and maps `step` bytes per call, or fails.
struct FakePrefaulter {
    calls: Mutex<Vec<(u64, u64)>>,
    step: u64,
    fail: bool,
}

impl GuestPrefaulter for FakePrefaulter {
    fn prefault(&self, gpa: u64, len: u64) -> std::io::Result<u64> {
        self.calls.lock().unwrap().push((gpa, len));
        if self.fail {
            return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
        }
        Ok(self.step.min(len))
    }
}

/// A window that pre-faults, seen by the guest at 0x40_0000_0000, whose
/// prefaulter maps `step` bytes a call (or fails).
fn prefaulting_window(step: u64, fail: bool) -> (DaxWindow, Arc<FakePrefaulter>) {
    prefaulting_window_sized(WINDOW, step, fail)
}

/// A window of `size` bytes whose guest pre-faults do `step` bytes a call.
fn prefaulting_window_sized(size: u64, step: u64, fail: bool) -> (DaxWindow, Arc<FakePrefaulter>) {
    let w = DaxWindow::new(size).unwrap();
    w.set_prefault(true);
    w.set_guest_base(0x40_0000_0000);
    let p = Arc::new(FakePrefaulter {
        calls: Mutex::new(Vec::new()),
        step,
        fail,
    });
    w.set_guest_prefaulter(p.clone());
    (w, p)
}

/// With a guest prefaulter, a new mapping goes to it at the window's guest
/// address, up to the end of the file, however many calls it takes; its
/// failure is counted and the mapping stays.
#[test]
fn new_mappings_go_to_the_guest_prefaulter_at_the_windows_guest_address() {
    let f = file_with(3);
    let (w, p) = prefaulting_window(PAGE, false);
    w.map(&req(0, 0, 4 * PAGE, 8 * PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(
        *p.calls.lock().unwrap(),
        [
            (0x40_0000_0000 + 4 * PAGE, 3 * PAGE),
            (0x40_0000_0000 + 5 * PAGE, 2 * PAGE),
            (0x40_0000_0000 + 6 * PAGE, PAGE),
        ]
    );
    let s = w.metrics.snapshot();
    assert_eq!(
        (
            s.guest_prefaulted_bytes,
            s.prefaulted_bytes,
            s.prefault_failures
        ),
        (3 * PAGE, 0, 0)
    );
    // Not on until the device says so.
    let off = DaxWindow::new(WINDOW).unwrap();
    off.set_guest_base(0x40_0000_0000);
    off.set_guest_prefaulter(p.clone());
    off.map(&req(0, 0, 0, PAGE, 0), f.as_file()).unwrap();
    assert_eq!(p.calls.lock().unwrap().len(), 3);

    let (failing, _) = prefaulting_window(PAGE, true);
    failing
        .map(&req(0, 0, 0, 2 * PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(peek(&failing, PAGE), b'b', "the mapping stays");
    let s = failing.metrics.snapshot();
    assert_eq!((s.guest_prefaulted_bytes, s.prefault_failures), (0, 1));
}

/// The backend request handler maps and acks first; the
/// pre-fault runs after (the device worker calls it once the ack is sent),
/// so it is off the SETUPMAPPING round trip. Queued pre-faults run newest
/// first, step by step, and give way to a request that is waiting: a
/// SHMEM_MAP no longer waits behind a whole range's pre-fault.
#[test]
fn deferred_prefaults_run_after_the_map_newest_first_and_give_way_to_a_waiting_request() {
    const BASE: u64 = 0x40_0000_0000;
    let f = file_with(96);
    let (w, p) = prefaulting_window_sized(128 * PAGE, 128 * PAGE, false);
    let calls = || p.calls.lock().unwrap().clone();
    w.map_deferring_prefault(&req(0, 0, 0, 2 * PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(peek(&w, PAGE), b'b', "mapped at once");
    assert!(calls().is_empty(), "not pre-faulted yet");
    // 256 KiB: two steps of 128 KiB.
    w.map_deferring_prefault(&req(0, 0, 64 * PAGE, 64 * PAGE, 0), f.as_file())
        .unwrap();
    w.run_deferred_prefault(&|| true);
    assert_eq!(
        calls(),
        [(BASE + 64 * PAGE, 32 * PAGE)],
        "one step, then a request"
    );
    w.run_deferred_prefault(&|| false);
    assert_eq!(
        calls()[1..],
        [(BASE + 96 * PAGE, 32 * PAGE), (BASE, 2 * PAGE)],
        "the rest of the newest, then the older one"
    );
    w.run_deferred_prefault(&|| false);
    assert_eq!(calls().len(), 3, "each runs once");
    // One unmapped (or mapped anew) before it ran is dropped.
    w.map_deferring_prefault(&req(0, 0, 8 * PAGE, PAGE, 0), f.as_file())
        .unwrap();
    w.unmap(&req(0, 0, 8 * PAGE, PAGE, 0)).unwrap();
    w.run_deferred_prefault(&|| false);
    assert_eq!(calls().len(), 3);
    assert_eq!(w.metrics.snapshot().guest_prefaulted_bytes, 66 * PAGE);
    // In a window this small at most 512 wait (the floor; larger windows
    // one per 2 MiB range): a guest mapping faster loses the oldest, and
    // no fewer wait (a queue of eight left most of a random reader's
    // ranges without a pre-fault).
    const QUEUE_MAX: u64 = 512;
    let (w, p) = prefaulting_window_sized((QUEUE_MAX + 2) * PAGE, 128 * PAGE, false);
    for i in 0..QUEUE_MAX + 2 {
        w.map_deferring_prefault(&req(0, 0, i * PAGE, PAGE, 0), f.as_file())
            .unwrap();
    }
    w.run_deferred_prefault(&|| false);
    let done: Vec<u64> = p
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| (c.0 - BASE) / PAGE)
        .collect();
    let newest_first: Vec<u64> = (2..QUEUE_MAX + 2).rev().collect();
    assert_eq!(done, newest_first, "all but the two oldest, newest first");
}

/// While the guest reclaims a range for each new one, only a map that
/// continues the last one (a sequential reader) is pre-faulted; a random one
/// is not. Once the reclaiming stops, every map is pre-faulted again.
#[test]
fn while_the_guest_reclaims_only_sequential_maps_are_prefaulted() {
    let f = file_with(16);
    let (w, p) = prefaulting_window(16 * PAGE, false);
    let calls = || p.calls.lock().unwrap().len();
    w.map(&req(0, 0, 0, PAGE, 0), f.as_file()).unwrap();
    assert_eq!(calls(), 1, "no reclaim yet: pre-faulted");
    // Unmaps of a roomy window (an inode going away) are not pressure.
    for _ in 0..40 {
        w.unmap(&req(0, 0, 0, PAGE, 0)).unwrap();
        w.map(&req(0, 0, 0, PAGE, 0), f.as_file()).unwrap();
    }
    assert_eq!(calls(), 41, "a roomy window: every map pre-faulted");
    // Fill the window to 14 of 16 pages.
    w.map(&req(0, 0, 3 * PAGE, 13 * PAGE, 0), f.as_file())
        .unwrap();
    // Thrash: every map of a random page comes with an unmap.
    let before = calls();
    for i in 0..40u64 {
        w.unmap(&req(0, 0, 0, PAGE, 0)).unwrap();
        w.map(&req(0, (i * 7 % 16) * PAGE, 0, PAGE, 0), f.as_file())
            .unwrap();
    }
    let thrash = calls() - before;
    assert!(
        thrash < 15,
        "{thrash} of 40 random maps pre-faulted while reclaiming"
    );
    // A sequential reader under the same pressure is pre-faulted.
    let before = calls();
    for i in 0..8u64 {
        w.unmap(&req(0, 0, (i % 2) * PAGE, PAGE, 0)).unwrap();
        w.map(
            &req(0, (8 + i) * PAGE, (i % 2) * PAGE, PAGE, 0),
            f.as_file(),
        )
        .unwrap();
    }
    assert!(calls() - before >= 7, "sequential maps are pre-faulted");
    // The reclaiming stops: maps without unmaps bring pre-faulting back.
    for i in 0..120u64 {
        w.map(&req(0, (i * 5 % 16) * PAGE, 4 * PAGE, PAGE, 0), f.as_file())
            .unwrap();
    }
    let before = calls();
    w.map(&req(0, 3 * PAGE, 6 * PAGE, PAGE, 0), f.as_file())
        .unwrap();
    assert_eq!(calls() - before, 1, "no reclaim: pre-faulted again");
}

/// Each map's time is traced stage by stage (a count and a sum each): a
/// refused map counts only the stages it passed, and the worker's turn at
/// the pre-fault after the ack is a stage of its own.
#[test]
fn a_map_is_traced_stage_by_stage() {
    let f = file_with(4);
    let (w, _) = prefaulting_window(PAGE, false);
    w.map_deferring_prefault(&req(0, 0, 0, 2 * PAGE, 0), f.as_file())
        .unwrap();
    w.run_deferred_prefault(&|| false);
    // Refused at the fd's type: past the checks, not past fstat.
    let dir = std::fs::File::open("/").unwrap();
    assert!(w.map(&req(0, 0, 4 * PAGE, PAGE, 0), &dir).is_err());
    let s = w.metrics.snapshot();
    let count = |name: &str| s.map_stages.iter().find(|t| t.stage == name).unwrap().count;
    assert_eq!(count("check"), 2);
    for stage in [
        "fstat",
        "keep_fd",
        "mmap",
        "scratch",
        "record",
        "queue_prefault",
        "notify",
        "prefault_after_ack",
    ] {
        assert_eq!(count(stage), 1, "{stage}");
    }
    // The whole request, and its read, are the device worker's to time.
    assert_eq!((count("request"), count("read")), (0, 0));
    let started = Instant::now();
    w.metrics.request_started(Some(started));
    w.map(&req(0, 0, 8 * PAGE, PAGE, 0), f.as_file()).unwrap();
    w.map(&req(0, 0, 9 * PAGE, PAGE, 0), f.as_file()).unwrap();
    let s = w.metrics.snapshot();
    let read = s.map_stages.iter().find(|t| t.stage == "read").unwrap();
    assert_eq!(read.count, 1, "one read per request started");
    assert_eq!(s.map_stages.len(), MapStage::ALL.len());
}

/// The pre-fault step follows the mapped file's host page size: a 2 MiB
/// range of 2 MiB host pages (a huge-page tmpfs, hugetlbfs) is one KVM
/// call, where 128 KiB steps made sixteen; 4 KiB pages, or an `st_blksize`
/// below 2 MiB (an I/O size), keep 128 KiB steps,
/// between which a waiting SHMEM_MAP is served.
#[test]
fn the_prefault_step_follows_the_files_host_page_size() {
    use super::prefault::{host_page, step_for, Deferred};
    const BASE: u64 = 0x40_0000_0000;
    const MIB: u64 = 1 << 20;
    assert_eq!(host_page(2 * MIB), 2 * MIB, "a huge-page tmpfs");
    assert_eq!(host_page(1 << 30), 1 << 30, "hugetlbfs of 1 GiB pages");
    assert_eq!(host_page(MIB), 0, "a network file system's I/O size");
    assert_eq!(host_page(PAGE), 0);
    assert_eq!(host_page(3 * MIB), 0, "not a power of two");
    assert_eq!(step_for(0), 128 << 10);
    assert_eq!(step_for(2 * MIB), 2 * MIB);
    assert_eq!(
        step_for(1 << 30),
        2 * MIB,
        "a waiting map waits for 2 MiB at most"
    );

    let (w, p) = prefaulting_window_sized(4 * MIB, 2 * MIB, false);
    let job = |host_page| Deferred {
        addr: w.host_addr(),
        shm_offset: 0,
        len: 2 * MIB,
        fd_offset: 0,
        file_size: 4 * MIB,
        step: step_for(host_page),
    };
    // A request waits all the while: the huge page is still one call.
    assert!(w.prefault_steps(job(2 * MIB), &|| true).is_none());
    assert_eq!(*p.calls.lock().unwrap(), [(BASE, 2 * MIB)]);
    p.calls.lock().unwrap().clear();
    // 4 KiB pages: one 128 KiB step, then the waiting request; the rest
    // keeps its step.
    let rest = w.prefault_steps(job(0), &|| true).unwrap();
    assert_eq!(*p.calls.lock().unwrap(), [(BASE, 128 << 10)]);
    assert_eq!(
        (rest.shm_offset, rest.len, rest.step),
        (128 << 10, 2 * MIB - (128 << 10), 128 << 10)
    );
}
