//! The daemon's migratable state as a VMM hands it to a new daemon
//! (SET_DEVICE_STATE_FD, LOAD): any bytes, loaded into a fresh daemon on a
//! small tmpfs share (a directory, two files, a symlink out of the share).
//! An error naming a field or a path, never a panic; a blob that loads
//! leaves inodes inside the share only.
#![no_main]

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use daemon::dax::DaxMapper;
use daemon::migration;
use daemon::passthrough::{openat, CachePolicy, PassthroughFs};
use daemon::policy::DaxPolicy;
use libfuzzer_sys::fuzz_target;

fn share() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm".into()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("dax-fuzz-state-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("d")).unwrap();
        std::fs::write(dir.join("d/f"), b"contents").unwrap();
        std::fs::write(dir.join("g"), b"g").unwrap();
        let _ = std::os::unix::fs::symlink("/etc", dir.join("link"));
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = share();
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
    fs.limits.max_inodes = 64;
    fs.limits.max_handles = 16;
    let dax = DaxMapper::new(8 << 20, policy.clone());
    if migration::load(data, &fs, &dax, &policy).is_ok() {
        // Whatever loaded is inside the share: no path climbs out of it.
        for nodeid in 2..64 {
            if fs.inode(nodeid).is_ok() {
                let path = fs.path_of(nodeid);
                assert!(
                    !path.split('/').any(|c| c == ".." || c.is_empty()),
                    "{path}"
                );
            }
        }
    }
});
