//! POSIX behaviour pjdfstest checks inside a guest (tests/guest/tests/pjdfstest.rs),
//! here against the FUSE server on a temporary directory: a too-long name
//! component, and changing the attributes of and linking special files
//! (FIFOs, sockets, device nodes) without opening them, and O_TRUNC left to
//! the guest (ETXTBSY).

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::tests::{cat, cstr, obj, Rig};
use super::*;
use crate::fuse::abi::{init, opcode, setattr, ROOT_ID};

fn mknod(
    rig: &mut Rig,
    parent: u64,
    name: &str,
    mode: u32,
    rdev: u32,
) -> Result<abi::EntryOut, i32> {
    let m = abi::MknodIn {
        mode,
        rdev,
        ..Default::default()
    };
    match rig.call(opcode::MKNOD, parent, &cat(&[m.as_slice(), &cstr(name)])) {
        (0, p) => Ok(obj(&p)),
        (e, _) => Err(e),
    }
}

fn setattr(rig: &mut Rig, nodeid: u64, a: abi::SetattrIn) -> Result<abi::AttrOut, i32> {
    match rig.call(opcode::SETATTR, nodeid, a.as_slice()) {
        (0, p) => Ok(obj(&p)),
        (e, _) => Err(e),
    }
}

fn chmod(rig: &mut Rig, nodeid: u64, mode: u32) -> Result<abi::AttrOut, i32> {
    setattr(
        rig,
        nodeid,
        abi::SetattrIn {
            valid: setattr::MODE,
            mode,
            ..Default::default()
        },
    )
}

fn link(rig: &mut Rig, old: u64, newparent: u64, name: &str) -> Result<abi::EntryOut, i32> {
    let l = abi::LinkIn { oldnodeid: old };
    match rig.call(opcode::LINK, newparent, &cat(&[l.as_slice(), &cstr(name)])) {
        (0, p) => Ok(obj(&p)),
        (e, _) => Err(e),
    }
}

/// Every request that carries a name answers ENAMETOOLONG for a 256-byte
/// component (pjdfstest's `*::enametoolong_component`), and a 255-byte one
/// works.
#[test]
fn a_name_longer_than_name_max_gets_enametoolong() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    let long = "x".repeat(256);
    let longest = "y".repeat(255);
    std::fs::write(rig.dir.as_path().join("f"), b"x").unwrap();
    let f = rig.lookup(ROOT_ID, "f").unwrap().nodeid;

    assert_eq!(rig.lookup(ROOT_ID, &long).unwrap_err(), libc::ENAMETOOLONG);
    let mkdir = abi::MkdirIn {
        mode: 0o755,
        umask: 0,
    };
    let create = abi::CreateIn {
        flags: libc::O_RDWR as u32,
        mode: 0o644,
        ..Default::default()
    };
    let rename = abi::RenameIn { newdir: ROOT_ID };
    let requests: Vec<(&str, u32, Vec<u8>)> = vec![
        (
            "mkdir",
            opcode::MKDIR,
            cat(&[mkdir.as_slice(), &cstr(&long)]),
        ),
        (
            "create",
            opcode::CREATE,
            cat(&[create.as_slice(), &cstr(&long)]),
        ),
        ("symlink", opcode::SYMLINK, cat(&[&cstr(&long), &cstr("f")])),
        ("unlink", opcode::UNLINK, cstr(&long)),
        ("rmdir", opcode::RMDIR, cstr(&long)),
        (
            "link",
            opcode::LINK,
            cat(&[abi::LinkIn { oldnodeid: f }.as_slice(), &cstr(&long)]),
        ),
        (
            "rename from",
            opcode::RENAME,
            cat(&[rename.as_slice(), &cstr(&long), &cstr("g")]),
        ),
        (
            "rename to",
            opcode::RENAME,
            cat(&[rename.as_slice(), &cstr("f"), &cstr(&long)]),
        ),
    ];
    for (what, op, body) in requests {
        assert_eq!(rig.call(op, ROOT_ID, &body).0, libc::ENAMETOOLONG, "{what}");
    }
    assert_eq!(
        mknod(&mut rig, ROOT_ID, &long, libc::S_IFIFO | 0o644, 0).unwrap_err(),
        libc::ENAMETOOLONG
    );
    // Nothing was created or moved by the refused requests.
    let names: Vec<_> = std::fs::read_dir(rig.dir.as_path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["f"]);

    // NAME_MAX itself is fine, and a symlink's target is not a component.
    rig.ok(
        opcode::MKDIR,
        ROOT_ID,
        &cat(&[mkdir.as_slice(), &cstr(&longest)]),
    );
    let target = "t/".repeat(600);
    rig.ok(
        opcode::SYMLINK,
        ROOT_ID,
        &cat(&[&cstr("s"), &cstr(&target)]),
    );
    assert_eq!(
        std::fs::read_link(rig.dir.as_path().join("s")).unwrap(),
        std::path::Path::new(&target)
    );
}

/// The special files a guest can make: a FIFO and a socket always, device
/// nodes where the test may create them (root with CAP_MKNOD).
fn special_files(rig: &mut Rig) -> Vec<(&'static str, abi::EntryOut)> {
    let mut made = Vec::new();
    for (name, mode, rdev) in [
        ("fifo", libc::S_IFIFO, 0),
        ("socket", libc::S_IFSOCK, 0),
        // /dev/null's and /dev/loop0's numbers.
        ("char", libc::S_IFCHR, (1 << 8) | 3),
        ("block", libc::S_IFBLK, 7 << 8),
    ] {
        match mknod(rig, ROOT_ID, name, mode | 0o644, rdev) {
            Ok(e) => made.push((name, e)),
            Err(libc::EPERM) if mode == libc::S_IFCHR || mode == libc::S_IFBLK => {}
            Err(e) => panic!("mknod {name}: errno {e}"),
        }
    }
    made
}

/// chmod of a FIFO, socket or device node works and changes its ctime
/// (pjdfstest's `chmod::change_perm` and `chmod::update_ctime`), without
/// the daemon opening it: a FIFO with no writer would block an open.
#[test]
fn chmod_changes_special_files_without_opening_them() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    for (name, entry) in special_files(&mut rig) {
        let path = rig.dir.as_path().join(name);
        let before = std::fs::symlink_metadata(&path).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let out = chmod(&mut rig, entry.nodeid, 0o4711).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(out.attr.mode & 0o7777, 0o4711, "{name}");
        let after = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(after.permissions().mode() & 0o7777, 0o4711, "{name}");
        assert_eq!(after.file_type(), before.file_type(), "{name}");
        assert!(
            (after.ctime(), after.ctime_nsec()) > (before.ctime(), before.ctime_nsec()),
            "{name}: ctime did not move"
        );
    }
    assert_eq!(rig.server.fs.handle_count(), 0);
    // A symlink has no mode of its own on Linux.
    std::os::unix::fs::symlink("fifo", rig.dir.as_path().join("l")).unwrap();
    let l = rig.lookup(ROOT_ID, "l").unwrap().nodeid;
    assert_eq!(chmod(&mut rig, l, 0o700).unwrap_err(), libc::EOPNOTSUPP);
}

/// A hard link to a special file shares its metadata: a chmod and a chown
/// through one name show through the other (pjdfstest's
/// `link::share_metadata`).
#[test]
fn hard_links_to_special_files_share_their_metadata() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    let sub = rig.ok(
        opcode::MKDIR,
        ROOT_ID,
        &cat(&[
            abi::MkdirIn {
                mode: 0o755,
                umask: 0,
            }
            .as_slice(),
            &cstr("d"),
        ]),
    );
    let sub: abi::EntryOut = obj(&sub);
    for (name, entry) in special_files(&mut rig) {
        let linked = link(&mut rig, entry.nodeid, sub.nodeid, name)
            .unwrap_or_else(|e| panic!("link {name}: errno {e}"));
        assert_eq!(linked.attr.nlink, 2, "{name}");
        assert_eq!(linked.attr.ino, entry.attr.ino, "{name}");
        chmod(&mut rig, linked.nodeid, 0o640).unwrap();
        let chown = setattr(
            &mut rig,
            linked.nodeid,
            abi::SetattrIn {
                valid: setattr::UID | setattr::GID,
                uid: 65534,
                gid: 65534,
                ..Default::default()
            },
        );
        let first = std::fs::symlink_metadata(rig.dir.as_path().join(name)).unwrap();
        assert_eq!(first.permissions().mode() & 0o7777, 0o640, "{name}");
        assert_eq!(first.nlink(), 2, "{name}");
        if chown.is_ok() {
            assert_eq!((first.uid(), first.gid()), (65534, 65534), "{name}");
        }
    }
    assert_eq!(rig.server.fs.handle_count(), 0);
}

/// The guest must be able to refuse `open(O_TRUNC)` of a file it executes
/// (ETXTBSY) before anything is truncated: the daemon does not negotiate
/// ATOMIC_O_TRUNC, so the guest truncates with SETATTR after its check, and
/// an OPEN that carries O_TRUNC anyway truncates nothing. (pjdfstest's
/// `open::etxtbsy` saw the running program killed by SIGSEGV when its file
/// was cut under it.)
#[test]
fn open_leaves_truncation_to_the_guest() {
    let mut rig = Rig::new(policies::Policy::default());
    let out = rig.init_offering(init::ATOMIC_O_TRUNC);
    assert_eq!(out.flags as u64 & init::ATOMIC_O_TRUNC, 0);
    std::fs::write(rig.dir.as_path().join("prog"), b"text of a program").unwrap();
    let prog = rig.lookup(ROOT_ID, "prog").unwrap().nodeid;
    let open = abi::OpenIn {
        flags: (libc::O_RDONLY | libc::O_TRUNC) as u32,
        open_flags: 0,
    };
    rig.ok(opcode::OPEN, prog, open.as_slice());
    assert_eq!(
        std::fs::read(rig.dir.as_path().join("prog")).unwrap(),
        b"text of a program"
    );
    // The truncation the guest sends once its checks pass.
    let out = setattr(
        &mut rig,
        prog,
        abi::SetattrIn {
            valid: setattr::SIZE,
            size: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(out.attr.size, 0);
}
