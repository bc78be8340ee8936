//! FUSE SETUPMAPPING/REMOVEMAPPING through the daemon's FUSE server and DAX mapper, whose SHMEM_MAP/UNMAP go over a real backend channel to the VMM's worker code and a real DAX window.
//!
//! The daemon waits for each request's ack (REPLY_ACK, as negotiated in
//! use), so the two sides must agree: a SETUPMAPPING the guest sees succeed
//! is one map in the window, a range removed is one unmap, and the window's
//! count of mapped bytes stays within it.
#![no_main]

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use daemon::dax::DaxMapper;
use daemon::fuse::abi::opcode;
use daemon::fuse::chain::split;
use daemon::fuse::server::Server;
use daemon::passthrough::{openat, CachePolicy, PassthroughFs};
use daemon::policy::DaxPolicy;
use dax_vmm_fuzz::{daemon_memory, queue_of, take, take_u8, DaemonMemory, DATA};
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::{Backend, FrontendReqHandler};
use virtio_devices::vhost_user_fs::backend_req::DaxRequestHandler;
use virtio_devices::vhost_user_fs::window::DaxWindow;
use virtio_devices::vhost_user_fs::{worker, VHOST_USER_TIMEOUT};
use virtio_queue::QueueOwnedT;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::EventSet;

const PAGE: u64 = 4096;
const WINDOW: u64 = 2 << 20;
const ROOT_ID: u64 = 1;
const REPLY: u64 = 0x80000;

struct Rig {
    mem: DaemonMemory,
    server: Server,
    window: Arc<DaxWindow>,
    /// The nodeids of a regular file and of a directory under the share.
    file: u64,
    dir: u64,
}

/// The VMM's side: its worker code serving the channel, on its own thread
/// as in the VMM (the daemon blocks on each ack).
fn serve_vmm_side(mut requests: FrontendReqHandler<DaxRequestHandler>) {
    std::thread::spawn(move || loop {
        let fd = requests.as_raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        unsafe { libc::poll(&mut p, 1, -1) };
        if !worker::serve_one("fuzz", &mut requests, EventSet::IN, VHOST_USER_TIMEOUT) {
            panic!("the VMM gave up the backend channel of a well-behaved daemon");
        }
    });
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        // The window's scratch (2 MiB) is a file too: made before the cap.
        let window = Arc::new(DaxWindow::new(WINDOW).unwrap());
        dax_vmm_fuzz::limit_file_size(1 << 20);
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm".into()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("dax-fuzz-fuse-dax-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("file"), vec![0x5a; 64 << 10]).unwrap();
        let root = openat(
            libc::AT_FDCWD,
            &CString::new(dir.to_str().unwrap()).unwrap(),
            libc::O_PATH,
            0,
        )
        .unwrap();
        let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
        let policy = policies::Policy::parse_json(
            r#"{"cache_size": "2M", "window_granularity": "4K", "mode": "always"}"#,
        )
        .unwrap();
        let policy = Arc::new(DaxPolicy::new(policy));
        let fs = PassthroughFs::new(root, proc_fd, CachePolicy::Auto, policy.clone()).unwrap();
        let handler = DaxRequestHandler::new("fuzz".into(), window.clone());
        let mut requests = FrontendReqHandler::new(Arc::new(handler)).unwrap();
        requests.set_reply_ack_flag(true);
        // What SET_BACKEND_REQ_FD hands the daemon: the channel's other end.
        // SAFETY: the handler keeps its end open; dup makes the daemon's own.
        let daemon_end = unsafe { libc::dup(requests.get_tx_raw_fd()) };
        assert!(daemon_end >= 0);
        // SAFETY: `daemon_end` is a fresh fd nothing else owns.
        let stream = unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(daemon_end) };
        let backend = Backend::from_stream(stream);
        backend.set_reply_ack_flag(true);
        backend.set_shmem_flag(true);
        serve_vmm_side(requests);
        let mapper = DaxMapper::new(WINDOW, policy.clone());
        mapper.set_backend(backend);
        let mut rig = Rig {
            mem: daemon_memory(),
            server: Server::new(fs, mapper, policy),
            window,
            file: 0,
            dir: 0,
        };
        rig.file = rig.lookup("file");
        rig.dir = rig.lookup("sub");
        rig
    })
}

impl Rig {
    /// Sends one request; returns the reply's error (0 on success).
    fn call(&self, opcode: u32, nodeid: u64, body: &[u8]) -> i32 {
        let mut req = Vec::with_capacity(40 + body.len());
        let len = u32::try_from(40 + body.len()).expect("a request under 4 GiB");
        req.extend_from_slice(&len.to_le_bytes());
        req.extend_from_slice(&opcode.to_le_bytes());
        req.extend_from_slice(&7u64.to_le_bytes()); // unique
        req.extend_from_slice(&nodeid.to_le_bytes());
        req.extend_from_slice(&[0; 16]); // uid, gid, pid, total_extlen, padding
        req.extend_from_slice(body);
        self.mem.write_slice(&req, GuestAddress(DATA)).unwrap();
        let mut q = queue_of(&self.mem, &[(DATA, len, false), (REPLY, 4096, true)]);
        let chain = q.iter(&self.mem).unwrap().next().unwrap();
        let (r, w) = split(&self.mem, chain).unwrap();
        assert!(self.server.handle(r, w) >= 16, "opcode {opcode}: no reply");
        self.mem.read_obj::<i32>(GuestAddress(REPLY + 4)).unwrap()
    }

    fn lookup(&self, name: &str) -> u64 {
        let mut body = name.as_bytes().to_vec();
        body.push(0);
        assert_eq!(self.call(opcode::LOOKUP, ROOT_ID, &body), 0);
        self.mem.read_obj::<u64>(GuestAddress(REPLY + 16)).unwrap()
    }

    /// (successful maps, successful unmaps) on the daemon's and the VMM's side.
    fn counts(&self) -> [(u64, u64); 2] {
        let d = self.server.report();
        let w = self.window.metrics.snapshot();
        [(d.setupmappings, d.removemappings), (w.maps, w.unmaps)]
    }
}

/// A value from the input: mostly page-aligned inside `pages` pages,
/// sometimes (`raw`) anything.
fn value(data: &[u8], pos: &mut usize, raw: bool, pages: u64) -> u64 {
    let v = take::<2>(data, pos);
    if raw {
        v.wrapping_mul(0x1_0001_0001)
    } else {
        (v % pages) * PAGE
    }
}

fuzz_target!(|data: &[u8]| {
    let rig = rig();
    let mut pos = 0;
    while pos < data.len() {
        let op = take_u8(data, &mut pos);
        let raw = op & 0x80 != 0;
        let val = |pos: &mut usize, pages| value(data, pos, raw, pages);
        let nodeid = match op >> 1 & 3 {
            0 | 1 => rig.file,
            2 => rig.dir,
            _ => ROOT_ID + u64::from(op >> 3 & 7) * 1000,
        };
        let pages = WINDOW / PAGE;
        let mut body = Vec::new();
        let opcode = if op & 1 == 0 {
            let foffset = val(&mut pos, 24);
            let len = val(&mut pos, pages / 4 + 1);
            let moffset = val(&mut pos, pages);
            let flags = u64::from(op >> 5 & 3);
            for v in [u64::MAX, foffset, len, flags, moffset] {
                body.extend_from_slice(&v.to_le_bytes());
            }
            opcode::SETUPMAPPING
        } else {
            let n = take_u8(data, &mut pos);
            let entries = if raw { n % 8 } else { n % 4 + 1 };
            let count = u32::from(if op & 0x40 != 0 { n } else { entries });
            body.extend_from_slice(&count.to_le_bytes());
            for _ in 0..entries {
                body.extend_from_slice(&val(&mut pos, pages).to_le_bytes());
                body.extend_from_slice(&val(&mut pos, pages / 4 + 1).to_le_bytes());
            }
            opcode::REMOVEMAPPING
        };
        // Sometimes a body cut short, as a hostile driver could send.
        if op & 0x18 == 0x18 && !body.is_empty() {
            body.truncate(usize::from(op) % body.len());
        }
        let before = rig.counts();
        let error = rig.call(opcode, nodeid, &body);
        let after = rig.counts();
        let [(dm, du), (wm, wu)] = [
            (after[0].0 - before[0].0, after[0].1 - before[0].1),
            (after[1].0 - before[1].0, after[1].1 - before[1].1),
        ];
        assert_eq!(
            (dm, du),
            (wm, wu),
            "daemon and window disagree on what succeeded"
        );
        if opcode == opcode::SETUPMAPPING {
            assert_eq!(
                error == 0,
                wm == 1,
                "SETUPMAPPING answered {error}, window maps +{wm}"
            );
        }
        assert!(rig.window.metrics.snapshot().bytes_mapped <= WINDOW);
    }
    // Both sides back to an empty window, as the guest's unmount leaves it.
    let mut all = 1u32.to_le_bytes().to_vec();
    all.extend_from_slice(&0u64.to_le_bytes());
    all.extend_from_slice(&WINDOW.to_le_bytes());
    assert_eq!(rig.call(opcode::REMOVEMAPPING, ROOT_ID, &all), 0);
    assert_eq!(rig.window.metrics.snapshot().bytes_mapped, 0);
});
