//! The window's record: taken from real mappings, mapped again into a new
//! window through the SHMEM_MAP path, replays that are no-ops or refused,
//! and the check of a window against a record.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::Ordering;

use vm_state::Persist;
use vmm_sys_util::tempfile::TempFile;

use super::super::map_budget::MapBudget;
use super::super::watch_budget::WatchBudget;
use super::record::{RecordError, WindowMapping, WindowRecord, WindowRestoreArgs};
use super::*;

const PAGE: u64 = 4096;
const WINDOW: u64 = 16 * PAGE;

/// A file whose page `p` holds the byte `first + p`.
fn file_of(pages: u64, first: u8) -> TempFile {
    let f = TempFile::new().unwrap();
    let mut data = Vec::new();
    for p in 0..pages {
        data.extend(std::iter::repeat_n(
            first + u8::try_from(p).unwrap(),
            usize::try_from(PAGE).unwrap(),
        ));
    }
    f.as_file().write_all(&data).unwrap();
    f
}

fn key(f: &File) -> FileKey {
    let m = f.metadata().unwrap();
    (m.dev(), m.ino())
}

fn req(fd_offset: u64, shm_offset: u64, len: u64, writable: bool) -> VhostUserMMap {
    VhostUserMMap {
        shmid: 0,
        fd_offset,
        shm_offset,
        len,
        flags: u64::from(writable),
        ..Default::default()
    }
}

/// Maps refused as a replay that differs.
fn mismatches(w: &DaxWindow) -> u64 {
    let failures = w.metrics.snapshot().failures;
    failures
        .iter()
        .find(|(r, _)| *r == "replay_mismatch")
        .unwrap()
        .1
}

fn peek(w: &DaxWindow, offset: u64) -> u8 {
    assert!(offset < w.size());
    // SAFETY: the tests read only pages they mapped from a file.
    unsafe { std::ptr::read_volatile((w.host_addr() + offset) as *const u8) }
}

/// The two files and the three ranges every test starts from: file A's
/// pages 0..2 at window page 0 and its pages 4..7 at window page 4, both
/// read-only; file B's pages 1..3 at window page 10, writable.
struct Saved {
    a: TempFile,
    b: TempFile,
    window: DaxWindow,
}

impl Saved {
    fn new() -> Self {
        let (a, b) = (file_of(8, b'a'), file_of(4, b'A'));
        let window = DaxWindow::new(WINDOW).unwrap();
        window
            .map(&req(0, 0, 2 * PAGE, false), a.as_file())
            .unwrap();
        window
            .map(&req(4 * PAGE, 4 * PAGE, 3 * PAGE, false), a.as_file())
            .unwrap();
        window
            .map(&req(PAGE, 10 * PAGE, 2 * PAGE, true), b.as_file())
            .unwrap();
        Saved { a, b, window }
    }

    /// A descriptor of each file of its own, as a migration passes them.
    fn files(&self) -> HashMap<FileKey, File> {
        [&self.a, &self.b]
            .into_iter()
            .map(|f| (key(f.as_file()), f.as_file().try_clone().unwrap()))
            .collect()
    }

    fn restored(&self, record: &WindowRecord) -> DaxWindow {
        let args = WindowRestoreArgs {
            budget: MapBudget::process(),
            watches: WatchBudget::process(),
            files: &self.files(),
        };
        DaxWindow::restore(args, record).unwrap()
    }
}

#[test]
fn a_saved_window_is_mapped_again_equal_and_shows_the_same_bytes() {
    let mut saved = Saved::new();
    let (a, b) = (key(saved.a.as_file()), key(saved.b.as_file()));
    let record = saved.window.save().unwrap();
    let m = |shm_offset, len, fd_offset, writable, (dev, ino): FileKey| WindowMapping {
        shm_offset,
        len,
        fd_offset,
        writable,
        dev,
        ino,
    };
    assert_eq!(
        record,
        WindowRecord {
            size: WINDOW,
            mappings: vec![
                m(0, 2 * PAGE, 0, false, a),
                m(4 * PAGE, 3 * PAGE, 4 * PAGE, false, a),
                m(10 * PAGE, 2 * PAGE, PAGE, true, b),
            ],
        }
    );
    // What a snapshot writes and a restore reads.
    let json = serde_json::to_string(&record).unwrap();
    let record: WindowRecord = serde_json::from_str(&json).unwrap();

    let restored = saved.restored(&record);
    restored.verify(&record).unwrap();
    assert_eq!(restored.metrics.maps.load(Ordering::Relaxed), 3);
    for page in [0, 1, 4, 5, 6, 10, 11] {
        let at = page * PAGE + 7;
        assert_eq!(peek(&restored, at), peek(&saved.window, at), "page {page}");
    }
    assert_eq!(peek(&restored, 5 * PAGE), b'a' + 5);
    assert_eq!(peek(&restored, 11 * PAGE), b'A' + 2);
    // The writable range writes through to the host file.
    // SAFETY: window page 10 is file B's page 1, mapped writable.
    unsafe { std::ptr::write_volatile((restored.host_addr() + 10 * PAGE) as *mut u8, b'!') };
    let mut byte = [0u8];
    saved.b.as_file().read_exact_at(&mut byte, PAGE).unwrap();
    assert_eq!(byte, *b"!");
}

/// A local migration maps the ranges from passed descriptors, then the new
/// daemon replays its own record: each of its maps finds its range in
/// place and changes nothing.
#[test]
fn replaying_a_map_already_in_place_is_a_no_op() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let restored = saved.restored(&record);
    let maps = || restored.metrics.maps.load(Ordering::Relaxed);
    assert_eq!(maps(), 3);
    restored.set_replaying(true);
    restored
        .map(&req(PAGE, 10 * PAGE, 2 * PAGE, true), saved.b.as_file())
        .unwrap();
    restored
        .map(&req(0, 0, 2 * PAGE, false), saved.a.as_file())
        .unwrap();
    restored.replay(&record, &saved.files()).unwrap();
    assert_eq!(maps(), 3, "nothing was mapped again");
    assert_eq!(
        restored.metrics.restored_ranges.load(Ordering::Relaxed),
        3,
        "each range counted once as mapped again, not again at each replay"
    );
    assert_eq!(mismatches(&restored), 0);
    restored.verify(&record).unwrap();
}

/// A replay over a range holding something else (another file, offset or
/// access) is refused naming the window offset and the files, and leaves
/// the window as it was; outside a replay the same map simply replaces.
#[test]
fn a_replay_that_differs_is_refused_by_name() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let restored = saved.restored(&record);
    let (a, b) = (key(saved.a.as_file()), key(saved.b.as_file()));
    restored.set_replaying(true);
    let cases = [
        ("another file", req(0, 0, 2 * PAGE, false), &saved.b, 0),
        ("another offset", req(PAGE, 0, 2 * PAGE, false), &saved.a, 0),
        ("another access", req(0, 0, 2 * PAGE, true), &saved.a, 0),
        (
            "part of a range",
            req(4 * PAGE, 4 * PAGE, PAGE, false),
            &saved.a,
            4 * PAGE,
        ),
        ("over two ranges", req(0, 0, 8 * PAGE, false), &saved.a, 0),
    ];
    for (n, (what, r, file, held_at)) in cases.into_iter().enumerate() {
        let e = restored.map(&r, file.as_file()).unwrap_err();
        assert_eq!(e.reason, FailureReason::ReplayMismatch, "{what}");
        assert!(
            e.message
                .contains(&format!("window offset {held_at:#x} holds"))
                && e.message.contains(&format!("ino {}", a.1)),
            "{what}: {}",
            e.message
        );
        if what == "another file" {
            assert!(e.message.contains(&format!("ino {}", b.1)), "{}", e.message);
        }
        assert_eq!(mismatches(&restored), n as u64 + 1);
        restored.verify(&record).unwrap();
    }
    // A whole record replayed over a window holding another file.
    let mut other = record.clone();
    other.mappings[2].fd_offset = 0;
    let e = restored.replay(&other, &saved.files()).unwrap_err();
    assert!(
        matches!(e, RecordError::Replay { shm_offset, .. } if shm_offset == 10 * PAGE),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("ino {}", b.1)), "{e}");
    restored.verify(&record).unwrap();
    // Not replaying: a daemon may map another file over a range.
    restored.set_replaying(false);
    restored
        .map(&req(0, 0, 2 * PAGE, false), saved.b.as_file())
        .unwrap();
    assert_eq!(peek(&restored, 0), b'A');
}

#[test]
fn verify_names_the_first_difference() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let differs_at = |r: &WindowRecord| match saved.window.verify(r) {
        Err(RecordError::Differs {
            shm_offset,
            expected,
            found,
        }) => (shm_offset, expected, found),
        other => panic!("{other:?}"),
    };
    let mut access = record.clone();
    access.mappings[1].writable = true;
    let (at, expected, found) = differs_at(&access);
    assert_eq!(at, 4 * PAGE);
    assert!(expected.ends_with("writable") && found.ends_with("read-only"));

    let mut missing = record.clone();
    missing.mappings.remove(1);
    let (at, expected, _) = differs_at(&missing);
    assert_eq!((at, expected.as_str()), (4 * PAGE, "nothing mapped"));

    let mut extra = record.clone();
    extra.mappings.insert(
        1,
        WindowMapping {
            shm_offset: 2 * PAGE,
            ..record.mappings[0]
        },
    );
    let (at, _, found) = differs_at(&extra);
    assert_eq!((at, found.as_str()), (2 * PAGE, "nothing mapped"));

    let mut size = record.clone();
    size.size = 2 * WINDOW;
    assert!(matches!(
        saved.window.verify(&size),
        Err(RecordError::Size { .. })
    ));
    saved
        .window
        .unmap(&req(0, 10 * PAGE, 2 * PAGE, false))
        .unwrap();
    let (at, _, found) = differs_at(&record);
    assert_eq!((at, found.as_str()), (10 * PAGE, "nothing mapped"));
}

/// A record's file must come with a descriptor of that very file.
#[test]
fn a_replay_without_the_right_file_is_refused_by_name() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let (a, b) = (key(saved.a.as_file()), key(saved.b.as_file()));
    let fresh = DaxWindow::new(WINDOW).unwrap();
    let mut files = saved.files();
    files.remove(&b);
    match fresh.replay(&record, &files) {
        Err(RecordError::NoFile {
            shm_offset, ino, ..
        }) => {
            assert_eq!((shm_offset, ino), (10 * PAGE, b.1))
        }
        other => panic!("{other:?}"),
    }
    let swapped = saved.a.as_file().try_clone().unwrap();
    files.insert(b, swapped);
    match fresh.replay(&record, &files) {
        Err(RecordError::WrongFile { found, .. }) => assert_eq!(found, a),
        other => panic!("{other:?}"),
    }
    assert!(
        !fresh.replaying.load(Ordering::SeqCst),
        "the flag is put back"
    );
}

/// A record is data read back from disk or a stream: each of its maps
/// meets the checks a daemon's SHMEM_MAP does, and a bad one is refused
/// naming its window offset before anything is mapped.
#[test]
fn a_replayed_map_meets_the_shmem_map_checks() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let cases = [
        (
            "past the window",
            WINDOW - PAGE,
            2 * PAGE,
            FailureReason::OutOfBounds,
        ),
        ("misaligned", 12 * PAGE + 1, PAGE, FailureReason::Misaligned),
        ("empty", 12 * PAGE, 0, FailureReason::ZeroLength),
    ];
    for (what, shm_offset, len, reason) in cases {
        let mut bad = record.clone();
        bad.mappings.push(WindowMapping {
            shm_offset,
            len,
            ..record.mappings[0]
        });
        let fresh = DaxWindow::new(WINDOW).unwrap();
        match fresh.replay(&bad, &saved.files()) {
            Err(RecordError::Replay {
                shm_offset: at,
                source,
                ..
            }) => assert_eq!((at, source.reason), (shm_offset, reason), "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert!(fresh.mappings().mappings.is_empty(), "{what}");
        assert_eq!(fresh.metrics.maps.load(Ordering::Relaxed), 0, "{what}");
    }
}

/// The local migration path: the new window is mapped from the
/// descriptors the old one keeps, with no other copy of the files.
#[test]
fn a_window_is_mapped_again_from_the_descriptors_the_old_one_keeps() {
    let mut saved = Saved::new();
    let record = saved.window.save().unwrap();
    let files = saved.window.mapped_files_by_key().unwrap();
    let keys: std::collections::BTreeSet<FileKey> = files.keys().copied().collect();
    let expected = [key(saved.a.as_file()), key(saved.b.as_file())];
    assert_eq!(keys, expected.into_iter().collect());
    let fresh = DaxWindow::new(WINDOW).unwrap();
    fresh.replay(&record, &files).unwrap();
    drop(files);
    for page in [0, 1, 4, 5, 6, 10, 11] {
        let at = page * PAGE;
        assert_eq!(peek(&fresh, at), peek(&saved.window, at), "page {page}");
    }
    fresh.verify(&record).unwrap();
}

/// The guest maps a range read-only first and upgrades it on its first
/// write, each time with a descriptor the daemon opened for that access:
/// the window keeps the one open for writing, so a local migration can
/// map the writable range again from what it passes.
#[test]
fn a_range_upgraded_to_writable_passes_on_a_descriptor_open_for_writing() {
    let f = file_of(4, b'x');
    let path = f.as_path().to_path_buf();
    let read_only = File::open(&path).unwrap();
    let read_write = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut window = DaxWindow::new(WINDOW).unwrap();
    window.map(&req(0, 0, 2 * PAGE, false), &read_only).unwrap();
    window.map(&req(0, 0, 2 * PAGE, true), &read_write).unwrap();
    let record = window.save().unwrap();
    let files = window.mapped_files_by_key().unwrap();
    let passed = &files[&key(&read_only)];
    // SAFETY: F_GETFL on a descriptor this test owns.
    let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(passed), libc::F_GETFL) };
    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDWR);
    let fresh = DaxWindow::new(WINDOW).unwrap();
    fresh.replay(&record, &files).unwrap();
    fresh.verify(&record).unwrap();
}
