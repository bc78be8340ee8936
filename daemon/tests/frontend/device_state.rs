//! The device-state transfer over a real socket, as a VMM drives it
//! (vhost's frontend): SET_DEVICE_STATE_FD with one end of a socket pair,
//! the blob read to EOF (SAVE) or written and closed (LOAD), then
//! CHECK_DEVICE_STATE. The state is made in this process by a daemon
//! library instance on the same share, as the old daemon would have.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use daemon::dax::DaxMapper;
use daemon::passthrough::{openat, CachePolicy, PassthroughFs};
use daemon::policy::DaxPolicy;
use vhost::vhost_user::message::{
    VhostTransferStateDirection as Direction, VhostTransferStatePhase as Phase,
    VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;

use super::*;

fn connect(socket: &Path) -> Frontend {
    let mut f = Frontend::connect(socket, 2).unwrap();
    f.set_owner().unwrap();
    f.set_features(f.get_features().unwrap()).unwrap();
    let offered = f.get_protocol_features().unwrap();
    assert!(offered.contains(VhostUserProtocolFeatures::DEVICE_STATE));
    f.set_protocol_features(
        offered & (VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::DEVICE_STATE),
    )
    .unwrap();
    f
}

fn save(f: &Frontend) -> Vec<u8> {
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let own = f
        .set_device_state_fd(Direction::SAVE, Phase::STOPPED, OwnedFd::from(theirs))
        .unwrap();
    assert!(own.is_none(), "the daemon writes into our pair");
    let mut blob = Vec::new();
    ours.read_to_end(&mut blob).unwrap();
    f.check_device_state().unwrap();
    blob
}

fn load(f: &Frontend, blob: &[u8]) -> vhost::Result<()> {
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    f.set_device_state_fd(Direction::LOAD, Phase::STOPPED, OwnedFd::from(theirs))?;
    ours.write_all(blob).unwrap();
    drop(ours);
    f.check_device_state()
}

/// The state of a session on `share`: d/f and g looked up, f open.
fn state_of(share: &Path) -> Vec<u8> {
    let path = CString::new(share.to_str().unwrap()).unwrap();
    let root = openat(libc::AT_FDCWD, &path, libc::O_PATH, 0).unwrap();
    let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
    let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
    let fs = PassthroughFs::new(root, proc_fd, CachePolicy::Never, policy.clone()).unwrap();
    let dax = DaxMapper::new(WINDOW, policy.clone());
    let (d, _) = fs.lookup(ROOT_ID, c"d").unwrap();
    let (f, _) = fs.lookup(d, c"f").unwrap();
    fs.lookup(ROOT_ID, c"g").unwrap();
    fs.open(f, libc::O_RDWR.cast_unsigned(), false).unwrap();
    daemon::migration::save(&fs, &dax, &policy).unwrap()
}

#[test]
fn a_new_daemon_loads_the_state_and_saves_it_back_the_same_and_refuses_a_replaced_file() {
    let share = TempDir::new().unwrap();
    std::fs::create_dir(share.as_path().join("d")).unwrap();
    std::fs::write(share.as_path().join("d/f"), b"f").unwrap();
    std::fs::write(share.as_path().join("g"), b"g").unwrap();
    let sockets = TempDir::new().unwrap();
    let socket = sockets.as_path().join("fs.sock");
    let blob = state_of(share.as_path());

    let mut child = start_daemon(share.as_path(), &socket);
    let f = connect(&socket);
    load(&f, &blob).unwrap();
    // What it holds now is what it was given (saved again, it is equal).
    let again = daemon::migration::decode(&save(&f)).unwrap();
    assert_eq!(again, daemon::migration::decode(&blob).unwrap());
    // A second LOAD into a daemon that holds a session fails at CHECK.
    assert!(load(&f, &blob).is_err());
    drop(f);
    let _ = child.kill();
    let _ = child.wait();

    // Garbage, and a file replaced at its path: CHECK fails.
    // (The old file is kept under another name, so its inode number is not
    // free for the new one to take.)
    std::fs::rename(share.as_path().join("d/f"), share.as_path().join("old")).unwrap();
    std::fs::write(share.as_path().join("d/f"), b"new").unwrap();
    for bad in [&b"{not json"[..], &blob] {
        let mut child = start_daemon(share.as_path(), &socket);
        let f = connect(&socket);
        assert!(load(&f, bad).is_err());
        drop(f);
        let _ = child.kill();
        let _ = child.wait();
    }
}
