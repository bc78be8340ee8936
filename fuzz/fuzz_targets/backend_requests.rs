//! The daemon's backend request stream (SHMEM_MAP/UNMAP or anything else, cut anywhere, with any fds) read by the device worker's own code (`worker::serve_one`) and answered by a real DAX window.
//!
//! The bytes go into the channel's daemon end, which is then shut for
//! writing, so the worker sees them and then end of file; it serves until
//! it gives the channel up. Each served request must consume bytes (or the
//! worker, woken level-triggered, would spin), and the window's
//! bookkeeping must match the maps and unmaps it reported, all inside it.
#![no_main]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dax_vmm_fuzz::stream;
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::FrontendReqHandler;
use virtio_devices::vhost_user_fs::backend_req::DaxRequestHandler;
use virtio_devices::vhost_user_fs::window::{DaxWindow, WindowEvent, WindowObserver};
use virtio_devices::vhost_user_fs::worker;
use vmm_sys_util::epoll::EventSet;

const PAGE: u64 = 4096;
const WINDOW_PAGES: u64 = WINDOW_PAGES_USIZE as u64;
const WINDOW_PAGES_USIZE: usize = 64;

/// Pages of the window mapped, as the window's events tell it.
struct Shadow(Mutex<Vec<bool>>);

impl WindowObserver for Shadow {
    fn event(&self, event: &WindowEvent) {
        let mut pages = self.0.lock().unwrap();
        let (offset, len, mapped) = match *event {
            WindowEvent::Map { offset, len, .. } => (offset, len, true),
            WindowEvent::Unmap { offset, len } => (offset, len, false),
            WindowEvent::Reset => {
                pages.fill(false);
                return;
            }
            _ => return,
        };
        let end = offset.checked_add(len).expect("event range overflows");
        assert!(
            end <= WINDOW_PAGES * PAGE && offset % PAGE == 0 && len % PAGE == 0,
            "{event:?} reported outside the window or unaligned"
        );
        for p in offset / PAGE..end / PAGE {
            pages[usize::try_from(p).expect("a page of the window")] = mapped;
        }
    }
}

fn queued(fd: std::os::fd::RawFd) -> libc::c_int {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int into `n`.
    unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    n
}

fuzz_target!(|data: &[u8]| {
    let (options, bytes) = data.split_first().unwrap_or((&0, &[]));
    let mut window = DaxWindow::new(WINDOW_PAGES * PAGE).unwrap();
    window.set_max_mappings(if options & 2 != 0 { 4 } else { 64 });
    let window = Arc::new(window);
    let shadow = Arc::new(Shadow(Mutex::new(vec![false; WINDOW_PAGES_USIZE])));
    window.set_observer(shadow.clone());
    let handler = DaxRequestHandler::new("fuzz".into(), window.clone());
    let mut requests = FrontendReqHandler::new(Arc::new(handler)).unwrap();
    requests.set_reply_ack_flag(options & 1 != 0);
    stream::send_all_and_close(requests.get_tx_raw_fd(), bytes);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&requests);
    // Every request takes at least its 12-byte header: this many serves
    // empty any input.
    for _ in 0..=data.len() / 12 + 1 {
        let before = queued(fd);
        // No patience: everything the daemon will send is queued already.
        if !worker::serve_one("fuzz", &mut requests, EventSet::IN, Duration::ZERO) {
            break;
        }
        assert!(
            queued(fd) < before,
            "a request was served without consuming a byte ({before} queued)"
        );
        let mapped = shadow.0.lock().unwrap().iter().filter(|&&m| m).count() as u64;
        assert_eq!(
            window.metrics.snapshot().bytes_mapped,
            mapped * PAGE,
            "the window's count disagrees with its maps and unmaps"
        );
    }
    window.clear();
    assert_eq!(window.metrics.snapshot().bytes_mapped, 0);
});
