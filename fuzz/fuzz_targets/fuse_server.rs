//! The FUSE server on arbitrary requests spread over descriptor chains of
//! any shape (the first bytes choose how the request is cut into readable
//! buffers and how large the reply buffers are), against a temporary
//! directory on tmpfs, with extended attributes on and small caps so they
//! are hit. (descriptor_chain fuzzes the chains themselves.)
#![no_main]

use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use daemon::dax::DaxMapper;
use daemon::fuse::chain::split;
use daemon::fuse::server::Server;
use daemon::passthrough::{openat, CachePolicy, PassthroughFs, XattrMode};
use daemon::policy::DaxPolicy;
use dax_vmm_fuzz::{daemon_memory, queue_of, DaemonMemory, DATA};
use libfuzzer_sys::fuzz_target;
use virtio_queue::QueueOwnedT;
use vm_memory::{Bytes, GuestAddress};

struct Rig {
    mem: DaemonMemory,
    server: Server,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        dax_vmm_fuzz::limit_file_size(1 << 20);
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm".into()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("dax-fuzz-fuse-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("file"), b"contents").unwrap();
        std::fs::write(dir.join("sub/nested"), b"nested").unwrap();
        let _ = std::os::unix::fs::symlink("/etc/passwd", dir.join("link"));
        let root = openat(
            libc::AT_FDCWD,
            &CString::new(dir.to_str().unwrap()).unwrap(),
            libc::O_PATH,
            0,
        )
        .unwrap();
        let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
        let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
        let mut fs = PassthroughFs::new(root, proc_fd, CachePolicy::Auto, policy.clone()).unwrap();
        fs.xattr = XattrMode::Mapped;
        fs.limits.max_inodes = 256;
        fs.limits.max_handles = 64;
        Rig {
            mem: daemon_memory(),
            server: Server::new(fs, DaxMapper::new(2 << 20, policy.clone()), policy),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let rig = rig();
    let (shape, request) = data.split_at(data.len().min(4));
    let shape = [0, 1, 2, 3].map(|i| shape.get(i).copied().unwrap_or(0));
    // Up to four readable pieces at cut points the input picks.
    let mut bufs = Vec::new();
    let mut at = 0usize;
    let mut addr = DATA;
    for &cut in &shape[..usize::from(shape[0] % 4)] {
        let len = usize::from(cut).min(request.len() - at);
        bufs.push((addr, piece_len(len), false));
        at += len;
        addr += (len as u64 + 64).next_multiple_of(8);
    }
    bufs.push((addr, piece_len(request.len() - at), false));
    rig.mem.write_slice(request, GuestAddress(DATA)).unwrap();
    // Re-lay the pieces where the descriptors point.
    let mut off = 0;
    for &(a, l, _) in &bufs {
        rig.mem
            .write_slice(&request[off..off + l as usize], GuestAddress(a))
            .unwrap();
        off += l as usize;
    }
    let reply_len = [16u32, 100, 4096, 0x20000][usize::from(shape[3] % 4)];
    bufs.push((0x80000, reply_len, true));
    if shape[3] & 4 != 0 {
        bufs.push((0xc0000, 4096, true));
    }
    let mut q = queue_of(&rig.mem, &bufs);
    let Ok(iter) = q.iter(&rig.mem) else { return };
    for chain in iter {
        if let Ok((r, w)) = split(&rig.mem, chain) {
            rig.server.handle(r, w);
        }
    }
});

/// A descriptor's length for `n` bytes of the request (which libFuzzer
/// keeps far below 4 GiB).
fn piece_len(n: usize) -> u32 {
    u32::try_from(n).expect("a fuzz input under 4 GiB")
}
