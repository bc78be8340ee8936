//! What one READ or WRITE with its buffer in the window makes the daemon
//! hold: one descriptor per distinct file, each a `--max-handles` slot,
//! and a bounded number of stretches; past either cap that request fails
//! and the next is served.

use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::AsRawFd;

use vmm_sys_util::tempdir::TempDir;

use super::*;
use crate::dax::window_map::MappedFile;
use crate::fuse::abi::ROOT_ID;
use crate::passthrough::{openat, CachePolicy};
use crate::policy::DaxPolicy;

const PAGE: u64 = 4096;

struct Share {
    fs: PassthroughFs,
    dax: DaxMapper,
    _dir: TempDir,
}

/// A share holding `files` files of `pages` pages each, and a mapper.
fn share(files: usize, pages: u64) -> (Share, Vec<MappedFile>) {
    let dir = TempDir::new().unwrap();
    let path = CString::new(dir.as_path().to_str().unwrap()).unwrap();
    let root = openat(libc::AT_FDCWD, &path, libc::O_PATH, 0).unwrap();
    let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
    let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
    let fs = PassthroughFs::new(root, proc_fd, CachePolicy::Auto, policy.clone()).unwrap();
    let mut mapped = Vec::new();
    for i in 0..files {
        let name = format!("f{i}");
        let f = std::fs::File::create(dir.as_path().join(&name)).unwrap();
        f.set_len(pages * PAGE).unwrap();
        let (nodeid, st) = fs.lookup(ROOT_ID, &CString::new(name).unwrap()).unwrap();
        mapped.push(MappedFile {
            nodeid,
            key: (st.st_dev, st.st_ino),
            foffset: 0,
            writable: true,
        });
    }
    let dax = DaxMapper::new(64 << 20, policy);
    (Share { fs, dax, _dir: dir }, mapped)
}

/// Records window pages `pages` as `file` from its start, each page its
/// own range.
fn map_pages(s: &Share, file: MappedFile, pages: std::ops::Range<u64>) {
    let first = pages.start;
    for i in pages {
        let f = MappedFile {
            foffset: (i - first) * PAGE,
            ..file
        };
        s.dax.record_mapping(i * PAGE, PAGE, f);
    }
}

fn window_buf(offset: u64, pages: u64) -> Vec<Buf> {
    vec![Buf::Window {
        offset,
        len: usize::try_from(pages * PAGE).unwrap(),
    }]
}

/// The errno a refused request fails with.
fn errno(r: io::Result<Vec<IoTarget>>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

/// The distinct descriptors behind `targets`.
fn fds(targets: &[IoTarget]) -> HashSet<i32> {
    targets
        .iter()
        .filter_map(|t| match t {
            IoTarget::File { file, .. } => Some(file.as_raw_fd()),
            IoTarget::Memory(_) => None,
        })
        .collect()
}

/// A buffer across 512 separately mapped pages of one file: 512 stretches,
/// one descriptor (it was one reopen per stretch, all held at once).
#[test]
fn a_buffer_across_many_ranges_of_one_file_holds_one_descriptor() {
    let (s, files) = share(1, 512);
    map_pages(&s, files[0], 0..512);
    let targets = targets(&s.fs, &s.dax, window_buf(0, 512), true).unwrap();
    assert_eq!(targets.len(), 512);
    assert_eq!(fds(&targets).len(), 1);
    assert_eq!(s.fs.window_fd_count(), 1, "one --max-handles slot taken");
    drop(targets);
    assert_eq!(s.fs.window_fd_count(), 0, "given back with the request");
}

/// With `--max-handles 2`, a request over three files fails with ENFILE
/// (counted as the handles cap) and holds nothing after; two files are
/// served, and while they are held neither another request's file nor an
/// OPEN gets a slot.
#[test]
fn window_buffer_descriptors_count_against_max_handles() {
    let (mut s, files) = share(3, 1);
    s.fs.limits.max_handles = 2;
    for (i, f) in files.iter().enumerate() {
        map_pages(&s, *f, i as u64..i as u64 + 1);
    }
    assert_eq!(
        errno(targets(&s.fs, &s.dax, window_buf(0, 3), false)),
        Some(libc::ENFILE)
    );
    assert_eq!(s.fs.caps.get(Cap::Handles), 1);
    assert_eq!(s.dax.stats.window_buffer_refusals.load(Relaxed), 1);
    assert_eq!(s.fs.window_fd_count(), 0, "a refused request holds nothing");

    let held = targets(&s.fs, &s.dax, window_buf(0, 2), false).unwrap();
    assert_eq!(fds(&held).len(), 2);
    assert_eq!(
        errno(targets(&s.fs, &s.dax, window_buf(2 * PAGE, 1), false)),
        Some(libc::ENFILE)
    );
    let e =
        s.fs.open(files[2].nodeid, libc::O_RDONLY.cast_unsigned(), false);
    assert_eq!(
        e.map(|_| ()).unwrap_err().raw_os_error(),
        Some(libc::ENFILE)
    );
    drop(held);
    // The daemon keeps serving: the slots are back.
    let t = targets(&s.fs, &s.dax, window_buf(2 * PAGE, 1), false).unwrap();
    assert_eq!(fds(&t).len(), 1);
}

/// More stretches than [`MAX_WINDOW_PIECES`] in one request: E2BIG before
/// anything is opened, counted; a request at the cap is served.
#[test]
fn a_request_over_the_stretch_cap_is_refused_before_opening_anything() {
    let pages = MAX_WINDOW_PIECES as u64 + 1;
    let (s, files) = share(1, pages);
    map_pages(&s, files[0], 0..pages);
    assert_eq!(
        errno(targets(&s.fs, &s.dax, window_buf(0, pages), true)),
        Some(libc::E2BIG)
    );
    assert_eq!(s.fs.caps.get(Cap::WindowPieces), 1);
    assert_eq!(s.fs.window_fd_count(), 0);
    // Split over two buffers of one request, the stretches add up.
    let mut bufs = window_buf(0, 1);
    bufs.extend(window_buf(PAGE, pages - 1));
    assert_eq!(errno(targets(&s.fs, &s.dax, bufs, true)), Some(libc::E2BIG));
    let t = targets(&s.fs, &s.dax, window_buf(0, pages - 1), true).unwrap();
    assert_eq!((t.len(), fds(&t).len()), (MAX_WINDOW_PIECES, 1));
}
