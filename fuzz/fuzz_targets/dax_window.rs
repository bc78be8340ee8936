//! SHMEM_MAP/SHMEM_UNMAP sequences against a real DAX window: requests as a
//! daemon could send them (any region, offset, length, flags), checked by
//! the window; the bookkeeping must stay within the window and the cap.
#![no_main]

use std::io::Write;
use std::sync::OnceLock;

use dax_vmm_fuzz::take;
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::message::VhostUserMMap;
use virtio_devices::vhost_user_fs::window::DaxWindow;

const PAGE: u64 = 4096;
const WINDOW_PAGES: u64 = 64;

fn file() -> &'static std::fs::File {
    static FILE: OnceLock<std::fs::File> = OnceLock::new();
    FILE.get_or_init(|| {
        let f = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        (&f).write_all(&[0xab; 16 * 4096]).unwrap();
        f
    })
}

/// One window for the whole run, cleared before each input: making and
/// dropping a window per input would spend most of the run in closing its
/// inotify instance (the kernel waits for an SRCU grace period there).
fn window() -> &'static DaxWindow {
    static WINDOW: OnceLock<DaxWindow> = OnceLock::new();
    WINDOW.get_or_init(|| {
        let mut w = DaxWindow::new(WINDOW_PAGES * PAGE).unwrap();
        w.set_max_mappings(8);
        w
    })
}

fuzz_target!(|data: &[u8]| {
    let w = window();
    w.clear();
    assert_eq!(w.metrics.snapshot().bytes_mapped, 0);
    let mut pos = 0;
    while pos < data.len() {
        let op = take::<1>(data, &mut pos);
        // Mostly page-aligned values inside the window, sometimes raw ones.
        let raw = op & 0x80 != 0;
        let mut val = |n: u64| {
            let v = take::<2>(data, &mut pos);
            if raw {
                v.wrapping_mul(0x1_0001_0001)
            } else {
                (v % n) * PAGE
            }
        };
        let (shm_offset, len, fd_offset) = (val(WINDOW_PAGES), val(WINDOW_PAGES / 4 + 1), val(24));
        let req = VhostUserMMap {
            shmid: u8::from(op >> 4 & 1 == 1),
            shm_offset,
            len,
            fd_offset,
            flags: op >> 5 & 3,
            ..Default::default()
        };
        let _ = if op & 1 == 0 {
            w.map(&req, file())
        } else {
            w.unmap(&req)
        };
        let snap = w.metrics.snapshot();
        assert!(snap.bytes_mapped <= WINDOW_PAGES * PAGE);
    }
    if data.first().is_some_and(|b| b & 2 != 0) {
        w.clear();
        assert_eq!(w.metrics.snapshot().bytes_mapped, 0);
    }
});
