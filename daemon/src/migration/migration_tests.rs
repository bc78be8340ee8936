use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::VhostUserMMap;
use vhost::vhost_user::{
    Backend, Error as VhostError, FrontendReqHandler, HandlerResult, VhostUserFrontendReqHandler,
};

use vmm_sys_util::tempdir::TempDir;

use super::*;
use crate::fuse::abi::ROOT_ID;
use crate::passthrough::{openat, CachePolicy};
use crate::policy::DaxPolicy;

const MIB: u64 = 1 << 20;

struct Daemon {
    fs: PassthroughFs,
    dax: DaxMapper,
    policy: Arc<DaxPolicy>,
    vmm: Arc<Vmm>,
}

/// The VMM's end of the backend request channel: records every SHMEM_MAP
/// (window offset, length, file offset, flags, the file's (dev, ino)) and
/// acknowledges it, or refuses them while told to.
/// One SHMEM_MAP as the VMM saw it: window offset, length, file offset,
/// flags, the file's (dev, ino).
type SeenMap = (u64, u64, u64, u64, (u64, u64));

#[derive(Default)]
struct Vmm {
    maps: Mutex<Vec<SeenMap>>,
    refuse: AtomicBool,
}

impl VhostUserFrontendReqHandler for Vmm {
    fn shmem_map(&self, req: &VhostUserMMap, fd: &dyn AsRawFd) -> HandlerResult<u64> {
        if self.refuse.load(SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: fstat into a zeroed stat of the fd the channel passed.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the fd is open for the call.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        let (off, len, foff, flags) = (req.shm_offset, req.len, req.fd_offset, req.flags);
        self.maps
            .lock()
            .unwrap()
            .push((off, len, foff, flags, (st.st_dev, st.st_ino)));
        Ok(0)
    }
}

/// Gives `dax` a channel to a new [`Vmm`] served on a thread of its own.
fn connect_vmm(dax: &DaxMapper) -> Arc<Vmm> {
    let vmm = Arc::new(Vmm::default());
    let mut requests = FrontendReqHandler::new(vmm.clone()).unwrap();
    requests.set_reply_ack_flag(true);
    // SAFETY: `dup` of an fd the handler keeps open; the result is checked.
    let daemon_end = unsafe { libc::dup(requests.get_tx_raw_fd()) };
    assert!(daemon_end >= 0);
    // SAFETY: `daemon_end` is a fresh fd nothing else owns.
    let backend = Backend::from_stream(unsafe { UnixStream::from_raw_fd(daemon_end) });
    backend.set_reply_ack_flag(true);
    backend.set_shmem_flag(true);
    dax.set_backend(backend);
    std::thread::spawn(move || {
        while let Ok(_) | Err(VhostError::ReqHandlerError(_)) = requests.handle_request() {}
    });
    vmm
}

fn daemon_on(dir: &TempDir) -> Daemon {
    let path = CString::new(dir.as_path().to_str().unwrap()).unwrap();
    let root = openat(libc::AT_FDCWD, &path, libc::O_PATH, 0).unwrap();
    let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
    let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
    let dax = DaxMapper::new(64 * MIB, policy.clone());
    Daemon {
        fs: PassthroughFs::new(root, proc_fd, CachePolicy::Never, policy.clone()).unwrap(),
        vmm: connect_vmm(&dax),
        dax,
        policy,
    }
}

fn share() -> TempDir {
    let dir = TempDir::new().unwrap();
    std::fs::create_dir(dir.as_path().join("d")).unwrap();
    std::fs::write(dir.as_path().join("d/f"), b"file f's bytes").unwrap();
    std::fs::write(dir.as_path().join("g"), b"and g's").unwrap();
    dir
}

/// On A: d, d/f (open read-write, mapped), g (open read-only), d opened.
struct Session {
    d: u64,
    f: u64,
    g: u64,
    fh_f: u64,
    fh_g: u64,
    fh_d: u64,
}

fn session(a: &Daemon) -> Session {
    let (d, _) = a.fs.lookup(ROOT_ID, c"d").unwrap();
    let (f, _) = a.fs.lookup(d, c"f").unwrap();
    let (g, _) = a.fs.lookup(ROOT_ID, c"g").unwrap();
    a.fs.lookup(ROOT_ID, c"g").unwrap();
    let fh_f = a.fs.open(f, libc::O_RDWR.cast_unsigned(), false).unwrap();
    let fh_g = a.fs.open(g, libc::O_RDONLY.cast_unsigned(), false).unwrap();
    let fh_d = a.fs.opendir(d).unwrap();
    let key = a.fs.inode(f).unwrap().key();
    let file = MappedFile {
        nodeid: f,
        key,
        foffset: 2 * MIB,
        writable: true,
    };
    a.dax.load_window_record(21, &[(4 * MIB, 2 * MIB, file)]);
    Session {
        d,
        f,
        g,
        fh_f,
        fh_g,
        fh_d,
    }
}

fn read_all(d: &Daemon, nodeid: u64, fh: u64) -> Vec<u8> {
    let h = d.fs.handle(fh, nodeid).unwrap();
    let mut buf = vec![0; 64];
    let n = h.file.read_at(&mut buf, 0).unwrap();
    buf.truncate(n);
    buf
}

#[test]
fn a_second_daemon_on_the_share_resolves_the_same_files_and_handles() {
    let dir = share();
    let a = daemon_on(&dir);
    let s = session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let b = daemon_on(&dir);
    load(&blob, &b.fs, &b.dax, &b.policy).unwrap();
    for n in [s.d, s.f, s.g] {
        assert_eq!(
            b.fs.inode(n).unwrap().key(),
            a.fs.inode(n).unwrap().key(),
            "node {n}"
        );
    }
    let meta = std::fs::metadata(dir.as_path().join("d/f")).unwrap();
    assert_eq!(b.fs.inode(s.f).unwrap().key(), (meta.dev(), meta.ino()));
    assert_eq!(b.fs.path_of(s.f), "d/f");
    assert_eq!(read_all(&b, s.f, s.fh_f), b"file f's bytes");
    assert_eq!(read_all(&b, s.g, s.fh_g), b"and g's");
    assert_eq!(
        b.fs.handle(s.fh_d, s.d).unwrap().flags & libc::O_DIRECTORY,
        libc::O_DIRECTORY
    );
    // The handles keep their access: f writes, g does not.
    let hf = b.fs.handle(s.fh_f, s.f).unwrap();
    hf.file.write_at(b"F", 0).unwrap();
    assert!(b
        .fs
        .handle(s.fh_g, s.g)
        .unwrap()
        .file
        .write_at(b"G", 0)
        .is_err());
    assert_eq!(
        std::fs::read(dir.as_path().join("d/f")).unwrap(),
        b"File f's bytes"
    );
    // g was looked up twice: two FORGETs drop it, not one.
    b.fs.forget(s.g, 1);
    assert!(b.fs.inode(s.g).is_ok());
    b.fs.forget(s.g, 1);
    assert!(b.fs.inode(s.g).is_err());
    // New node ids and handles continue after the saved ones.
    let fh =
        b.fs.open(s.f, libc::O_RDONLY.cast_unsigned(), false)
            .unwrap();
    assert!(fh > s.fh_d.max(s.fh_f).max(s.fh_g));
    // The window's record: the mapped range resolves to f at its offset.
    assert_eq!(a.dax.window_record(), b.dax.window_record());
    let pieces = b.dax.resolve(4 * MIB + 4096, 4096, true).unwrap();
    assert_eq!((pieces[0].nodeid, pieces[0].foffset), (s.f, 2 * MIB + 4096));
}

#[test]
fn a_file_replaced_at_its_path_is_refused_by_name() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    // Same path, a new inode (the old one stays alive through A's fds).
    std::fs::remove_file(dir.as_path().join("d/f")).unwrap();
    std::fs::write(dir.as_path().join("d/f"), b"other").unwrap();
    let b = daemon_on(&dir);
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("d/f") && err.contains("replaced"), "{err}");
    assert_eq!(b.fs.inode_count(), 1, "nothing applied");
    assert_eq!(b.fs.handle_count(), 0);
    assert_eq!(b.dax.window_record().1, vec![]);
}

#[test]
fn a_file_gone_at_save_is_refused_by_its_last_name() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    std::fs::rename(dir.as_path().join("g"), dir.as_path().join("h")).unwrap();
    let err = save(&a.fs, &a.dax, &a.policy).unwrap_err().to_string();
    assert!(
        err.contains("g:") && err.contains("cannot be found"),
        "{err}"
    );
}

#[test]
fn truncated_oversized_or_garbage_blobs_are_errors() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let b = daemon_on(&dir);
    for cut in [0, 1, blob.len() / 2, blob.len() - 1] {
        assert!(
            load(&blob[..cut], &b.fs, &b.dax, &b.policy).is_err(),
            "cut at {cut}"
        );
    }
    let big = vec![b' '; MAX_STATE_BYTES + 1];
    assert!(matches!(decode(&big), Err(MigrationError::TooLarge { .. })));
    assert!(load(b"\xff\x00garbage", &b.fs, &b.dax, &b.policy).is_err());
    let newer =
        String::from_utf8(blob.clone())
            .unwrap()
            .replacen("\"version\":1", "\"version\":2", 1);
    assert!(matches!(
        decode(newer.as_bytes()),
        Err(MigrationError::Version(2))
    ));
    assert_eq!(b.fs.inode_count(), 1);
    load(&blob, &b.fs, &b.dax, &b.policy).unwrap();
    assert!(
        matches!(
            load(&blob, &b.fs, &b.dax, &b.policy),
            Err(MigrationError::Share(StateError::NotFresh(_)))
        ),
        "a second load into a daemon with a session"
    );
}

/// Edits the saved state as a hostile VMM could, and loads it into a fresh
/// daemon: the error names the field.
fn load_edited(dir: &TempDir, edit: impl FnOnce(&mut DaemonState)) -> String {
    let a = daemon_on(dir);
    session(&a);
    let mut state = decode(&save(&a.fs, &a.dax, &a.policy).unwrap()).unwrap();
    edit(&mut state);
    let b = daemon_on(dir);
    let err = load(
        &serde_json::to_vec(&state).unwrap(),
        &b.fs,
        &b.dax,
        &b.policy,
    )
    .unwrap_err();
    assert_eq!(b.fs.inode_count(), 1, "nothing applied: {err}");
    err.to_string()
}

#[test]
fn hostile_states_are_refused_naming_the_field() {
    let dir = share();
    let err = load_edited(&dir, |s| s.share.inodes[0].name = b"..".to_vec());
    assert!(err.contains("inodes.name"), "{err}");
    let err = load_edited(&dir, |s| s.share.inodes[1].name = b"d/f".to_vec());
    assert!(err.contains("inodes.name"), "{err}");
    let err = load_edited(&dir, |s| s.share.inodes.reverse());
    assert!(err.contains("inodes.parent"), "{err}");
    let err = load_edited(&dir, |s| s.share.handles[0].flags |= libc::O_TRUNC);
    assert!(err.contains("handles.flags"), "{err}");
    let err = load_edited(&dir, |s| s.share.handles[0].nodeid = 999);
    assert!(err.contains("handles.nodeid"), "{err}");
    let err = load_edited(&dir, |s| s.window.ranges[0].start = 63 * MIB);
    assert!(err.contains("window.ranges"), "{err}");
    let err = load_edited(&dir, |s| {
        s.window.ranges[0].nodeid = s.share.inodes[0].nodeid
    });
    assert!(err.contains("not a regular file"), "{err}");
    // A symlink put where a saved directory was is not followed.
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    std::fs::rename(dir.as_path().join("d"), dir.as_path().join("e")).unwrap();
    std::os::unix::fs::symlink("e", dir.as_path().join("d")).unwrap();
    let b = daemon_on(&dir);
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("restore: d:"), "{err}");
}

#[test]
fn counts_past_the_daemons_caps_are_refused() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let mut b = daemon_on(&dir);
    b.fs.limits.max_handles = 2;
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("handles: 3 entries, the limit is 2"), "{err}");
    let mut b = daemon_on(&dir);
    b.fs.limits.max_inodes = 3;
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("inodes: 3 entries, the limit is 2"), "{err}");
}

#[test]
fn the_policy_in_force_moves_and_the_adaptive_part_sees_the_mapped_ranges() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let swapped = policies::Policy {
        mode: policies::Mode::Never,
        ..policies::Policy::default()
    };
    a.policy.replace(swapped.clone());
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let b = daemon_on(&dir);
    assert_ne!(b.policy.current().policy, swapped);
    load(&blob, &b.fs, &b.dax, &b.policy).unwrap();
    assert_eq!(b.policy.current().policy, swapped);
    // The one 2 MiB range mapped on A counts as mapped on B.
    assert_eq!(b.policy.adaptive.stats().mapped_ranges, 1);
    // A policy document that does not parse: refused, nothing applied.
    let mut state = decode(&blob).unwrap();
    state.policy = serde_json::json!({"mode": "sometimes"});
    let c = daemon_on(&dir);
    let err = load(
        &serde_json::to_vec(&state).unwrap(),
        &c.fs,
        &c.dax,
        &c.policy,
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("policy:"), "{err}");
    assert_eq!(c.fs.inode_count(), 1);
}

#[test]
fn a_handle_whose_inode_the_guest_forgot_refuses_the_save_naming_it() {
    let dir = share();
    let a = daemon_on(&dir);
    let s = session(&a);
    a.fs.forget(s.g, 2);
    let err = save(&a.fs, &a.dax, &a.policy).unwrap_err().to_string();
    assert!(
        err.contains(&format!("handle {} is open on node {}", s.fh_g, s.g)),
        "{err}"
    );
}

#[test]
fn the_load_has_the_vmm_map_every_range_again_as_it_was() {
    let dir = share();
    let a = daemon_on(&dir);
    let s = session(&a);
    let g = a.fs.inode(s.g).unwrap().key();
    let mut ranges = a.dax.window_record().1;
    ranges.push((
        8 * MIB,
        2 * MIB,
        MappedFile {
            nodeid: s.g,
            key: g,
            foffset: 0,
            writable: false,
        },
    ));
    a.dax.load_window_record(21, &ranges);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let b = daemon_on(&dir);
    load(&blob, &b.fs, &b.dax, &b.policy).unwrap();
    let f = a.fs.inode(s.f).unwrap().key();
    let writable = vhost::vhost_user::message::VhostUserMMapFlags::WRITABLE.bits();
    assert_eq!(
        *b.vmm.maps.lock().unwrap(),
        [
            (4 * MIB, 2 * MIB, 2 * MIB, writable, f),
            (8 * MIB, 2 * MIB, 0, 0, g)
        ]
    );
    assert_eq!(a.dax.window_record(), b.dax.window_record());
}

#[test]
fn a_range_the_vmm_refuses_to_map_again_fails_the_load_naming_the_file() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    let b = daemon_on(&dir);
    b.vmm.refuse.store(true, SeqCst);
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("d/f") && err.contains("0x400000"), "{err}");
    // Nothing of the state stays applied.
    assert_eq!(b.fs.inode_count(), 1);
    assert!(b.dax.window_record().1.is_empty());
}

#[test]
fn a_mapped_file_missing_on_the_destination_share_fails_the_load_naming_it() {
    let dir = share();
    let a = daemon_on(&dir);
    session(&a);
    let blob = save(&a.fs, &a.dax, &a.policy).unwrap();
    // The destination's view of the share lacks d/f, which the window maps
    // (A still holds it open).
    std::fs::remove_file(dir.as_path().join("d/f")).unwrap();
    let b = daemon_on(&dir);
    let err = load(&blob, &b.fs, &b.dax, &b.policy)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("restore: d/f: ") && err.contains("No such file"),
        "{err}"
    );
    // Refused before anything was mapped or applied.
    assert!(b.vmm.maps.lock().unwrap().is_empty());
    assert_eq!(b.fs.inode_count(), 1);
    assert_eq!(b.fs.handle_count(), 0);
    assert!(b.dax.window_record().1.is_empty());
}
