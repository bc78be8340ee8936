//! Regression tests for what a hostile guest tried (docs/security.md): each
//! fails on the code before its fix. Hand-built requests, temporary directory.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;

use super::tests::{cat, cstr, obj, Rig};
use super::*;
use crate::fuse::abi::{init, opcode, ROOT_ID};
use crate::limits::Cap;
use crate::passthrough::XattrMode;

fn host_getxattr(path: &std::path::Path, name: &str) -> Result<Vec<u8>, i32> {
    let p = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: NUL-terminated strings, `buf` writable for its length.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    buf.truncate(usize::try_from(r).unwrap());
    Ok(buf)
}

fn create(rig: &mut Rig, name: &str, flags: i32) -> (i32, Vec<u8>) {
    let c = abi::CreateIn {
        flags: flags.cast_unsigned(),
        mode: 0o644,
        ..Default::default()
    };
    rig.call(opcode::CREATE, ROOT_ID, &cat(&[c.as_slice(), &cstr(name)]))
}

fn mknod(rig: &mut Rig, name: &str, mode: u32, rdev: u32) -> i32 {
    let m = abi::MknodIn {
        mode,
        rdev,
        ..Default::default()
    };
    rig.call(opcode::MKNOD, ROOT_ID, &cat(&[m.as_slice(), &cstr(name)]))
        .0
}

/// Finding 1 (CVE-2020-35517 class): MKNOD then CREATE of the same name
/// must not open the device or FIFO. A FIFO opened O_RDWR does not block,
/// so the old code's open is seen as a handle, not as a hang.
#[test]
fn create_never_opens_an_existing_device_node_fifo_or_socket() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    assert_eq!(mknod(&mut rig, "fifo", libc::S_IFIFO | 0o666, 0), 0);
    let mut specials = vec!["fifo"];
    // /dev/null's numbers: a device every host has (needs CAP_MKNOD).
    if mknod(&mut rig, "null", libc::S_IFCHR | 0o666, (1 << 8) | 3) == 0 {
        specials.push("null");
    }
    for name in specials {
        for flags in [
            libc::O_RDWR,
            libc::O_RDONLY | libc::O_NONBLOCK,
            libc::O_WRONLY | libc::O_TRUNC,
        ] {
            let (e, _) = create(&mut rig, name, flags);
            assert_ne!(e, 0, "CREATE {name} flags {flags:#o} opened a special file");
        }
        assert_eq!(
            create(&mut rig, name, libc::O_RDWR | libc::O_EXCL).0,
            libc::EEXIST
        );
    }
    assert_eq!(
        rig.server.fs.handle_count(),
        0,
        "no handle to a special file exists"
    );
    // A regular file: O_EXCL refuses it, without O_EXCL it is opened (and
    // O_TRUNC truncates), as open(2) with O_CREAT does.
    std::fs::write(rig.dir.as_path().join("plain"), b"old contents").unwrap();
    assert_eq!(
        create(&mut rig, "plain", libc::O_RDWR | libc::O_EXCL).0,
        libc::EEXIST
    );
    let (e, reply) = create(&mut rig, "plain", libc::O_RDWR | libc::O_TRUNC);
    assert_eq!(e, 0);
    let entry: abi::EntryOut = obj(&reply);
    assert_eq!(entry.attr.mode & libc::S_IFMT, libc::S_IFREG);
    assert_eq!(std::fs::read(rig.dir.as_path().join("plain")).unwrap(), b"");
    assert_eq!(rig.server.fs.handle_count(), 1);
}

fn setxattr(rig: &mut Rig, nodeid: u64, name: &str, value: &[u8]) -> i32 {
    let a = abi::SetxattrIn {
        size: u32::try_from(value.len()).unwrap(),
        flags: 0,
    };
    rig.call(
        opcode::SETXATTR,
        nodeid,
        &cat(&[a.as_slice(), &cstr(name), value]),
    )
    .0
}

fn getxattr(rig: &mut Rig, nodeid: u64, name: &str, size: u32) -> (i32, Vec<u8>) {
    let a = abi::GetxattrIn { size, padding: 0 };
    rig.call(opcode::GETXATTR, nodeid, &cat(&[a.as_slice(), &cstr(name)]))
}

/// Finding 3: xattrs are off by default; when on, no guest name reaches a
/// host namespace that grants privilege (`security.capability`, `trusted.*`).
/// Also finding 7's root cause: the calls resolve no path, so they work
/// whatever the working directory is (the old code needed it to be
/// `/proc/self/fd` and named the inode by a number another thread could reuse).
#[test]
fn xattrs_are_off_by_default_and_mapped_away_from_privileged_namespaces() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    std::fs::write(rig.dir.as_path().join("f"), b"x").unwrap();
    let f = rig.lookup(ROOT_ID, "f").unwrap().nodeid;
    assert_eq!(
        setxattr(&mut rig, f, "user.a", b"1"),
        libc::ENOSYS,
        "off unless --xattr"
    );
    assert_eq!(getxattr(&mut rig, f, "user.a", 0).0, libc::ENOSYS);

    rig.server.fs.xattr = XattrMode::Mapped;
    let cap = [
        1u8, 0, 0, 2, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(setxattr(&mut rig, f, "security.capability", &cap), 0);
    assert_eq!(setxattr(&mut rig, f, "trusted.overlay.opaque", b"y"), 0);
    assert_eq!(setxattr(&mut rig, f, "user.plain", b"p"), 0);
    assert_eq!(setxattr(&mut rig, f, "user.virtiofs.spoof", b"s"), 0);
    let host = rig.dir.as_path().join("f");
    assert_eq!(
        host_getxattr(&host, "security.capability"),
        Err(libc::ENODATA),
        "no host file capability"
    );
    assert_eq!(
        host_getxattr(&host, "trusted.overlay.opaque"),
        Err(libc::ENODATA)
    );
    assert_eq!(
        host_getxattr(&host, "user.virtiofs.security.capability").unwrap(),
        cap
    );
    assert_eq!(host_getxattr(&host, "user.plain").unwrap(), b"p");
    assert_eq!(
        host_getxattr(&host, "user.virtiofs.spoof"),
        Err(libc::ENODATA),
        "the guest cannot forge a mapped name"
    );
    // The guest sees its own names back.
    assert_eq!(getxattr(&mut rig, f, "security.capability", 64).1, cap);
    let (e, list) = rig.call(
        opcode::LISTXATTR,
        f,
        abi::GetxattrIn {
            size: 4096,
            padding: 0,
        }
        .as_slice(),
    );
    assert_eq!(e, 0);
    let mut names: Vec<&[u8]> = list.split(|&b| b == 0).filter(|n| !n.is_empty()).collect();
    names.sort();
    let want: Vec<&[u8]> = vec![
        b"security.capability",
        b"trusted.overlay.opaque",
        b"user.plain",
        b"user.virtiofs.spoof",
    ];
    assert_eq!(names, want);
    // A host trusted.* attribute the guest did not set stays hidden.
    let p = CString::new(host.as_os_str().as_bytes()).unwrap();
    // SAFETY: NUL-terminated strings and a 1-byte value.
    if unsafe {
        libc::setxattr(
            p.as_ptr(),
            c"trusted.host".as_ptr(),
            b"h".as_ptr().cast(),
            1,
            0,
        )
    } == 0
    {
        let (_, list) = rig.call(
            opcode::LISTXATTR,
            f,
            abi::GetxattrIn {
                size: 4096,
                padding: 0,
            }
            .as_slice(),
        );
        assert!(
            !list.windows(12).any(|w| w == b"trusted.host"),
            "host's own trusted.* listed"
        );
    }
    assert_eq!(
        rig.call(opcode::REMOVEXATTR, f, &cstr("security.capability"))
            .0,
        0
    );
    assert_eq!(
        host_getxattr(&host, "user.virtiofs.security.capability"),
        Err(libc::ENODATA)
    );
}

/// Finding 6: the guest's GETXATTR/LISTXATTR size is not an allocation
/// size; and the xattr size cap is enforced with a counted refusal.
#[test]
fn xattr_sizes_from_the_guest_are_capped_before_anything_is_allocated() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    rig.server.fs.xattr = XattrMode::Mapped;
    std::fs::write(rig.dir.as_path().join("f"), b"x").unwrap();
    let f = rig.lookup(ROOT_ID, "f").unwrap().nodeid;
    assert_eq!(setxattr(&mut rig, f, "user.v", b"value"), 0);
    crate::alloc_probe::reset();
    let (e, value) = getxattr(&mut rig, f, "user.v", u32::MAX);
    assert_eq!((e, value.as_slice()), (0, &b"value"[..]));
    let (e, _) = rig.call(
        opcode::LISTXATTR,
        f,
        abi::GetxattrIn {
            size: u32::MAX,
            padding: 0,
        }
        .as_slice(),
    );
    assert_eq!(e, 0);
    let largest = crate::alloc_probe::largest();
    assert!(
        largest <= 1 << 20,
        "a {largest}-byte allocation for a guest-given size"
    );
    rig.server.fs.limits.max_xattr_size = 4;
    assert_eq!(setxattr(&mut rig, f, "user.w", b"too long"), libc::E2BIG);
    assert_eq!(rig.server.fs.caps.get(Cap::XattrSize), 1);
    assert_eq!(
        setxattr(&mut rig, f, "user.w", b"ok"),
        0,
        "the daemon keeps serving"
    );
}

/// Finding 6 (CVE-2020-10717 class): inodes and handles are capped; past a
/// cap the guest gets ENFILE, the refusal is counted, and everything else
/// (existing inodes, FORGET making room) keeps working.
#[test]
fn inodes_and_handles_are_capped_with_enfile_and_counted() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    for n in ["a", "b", "c", "d"] {
        std::fs::write(rig.dir.as_path().join(n), n).unwrap();
    }
    rig.server.fs.limits.max_inodes = 3; // the root and two more
    rig.server.fs.limits.max_handles = 1;
    let a = rig.lookup(ROOT_ID, "a").unwrap().nodeid;
    rig.lookup(ROOT_ID, "b").unwrap();
    assert_eq!(
        rig.lookup(ROOT_ID, "c").map(|e| e.nodeid),
        Err(libc::ENFILE)
    );
    assert_eq!(rig.server.fs.caps.get(Cap::Inodes), 1);
    assert_eq!(
        rig.lookup(ROOT_ID, "a").unwrap().nodeid,
        a,
        "known inodes are still served"
    );
    rig.call(opcode::FORGET, a, abi::ForgetIn { nlookup: 2 }.as_slice());
    assert!(rig.lookup(ROOT_ID, "c").is_ok(), "a FORGET makes room");

    let c = rig.lookup(ROOT_ID, "c").unwrap().nodeid;
    let open = abi::OpenIn {
        flags: libc::O_RDONLY as u32,
        open_flags: 0,
    };
    assert_eq!(rig.call(opcode::OPEN, c, open.as_slice()).0, 0);
    assert_eq!(rig.call(opcode::OPEN, c, open.as_slice()).0, libc::ENFILE);
    assert_eq!(
        rig.call(opcode::OPENDIR, ROOT_ID, open.as_slice()).0,
        libc::ENFILE
    );
    assert_eq!(rig.server.fs.caps.get(Cap::Handles), 2);
}

/// FUSE_HANDLE_KILLPRIV_V2: negotiated; a write the guest marks
/// KILL_SUIDGID clears the setuid bit as a local unprivileged write would,
/// though the daemon runs with CAP_FSETID; an unmarked write keeps it.
#[test]
fn killpriv_v2_writes_clear_setuid_like_a_local_write() {
    use std::os::unix::fs::PermissionsExt;
    let mut rig = Rig::new(policies::Policy::default());
    let out = rig.init_offering(init::HANDLE_KILLPRIV_V2);
    assert_ne!(out.flags as u64 & init::HANDLE_KILLPRIV_V2, 0);
    let path = rig.dir.as_path().join("suid");
    std::fs::write(&path, b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let f = rig.lookup(ROOT_ID, "suid").unwrap().nodeid;
    let open: abi::OpenOut = obj(&rig.ok(
        opcode::OPEN,
        f,
        abi::OpenIn {
            flags: libc::O_RDWR as u32,
            open_flags: 0,
        }
        .as_slice(),
    ));
    let write = |flags: u32| abi::WriteIn {
        fh: open.fh,
        offset: 0,
        size: 1,
        write_flags: flags,
        ..Default::default()
    };
    rig.ok(opcode::WRITE, f, &cat(&[write(0).as_slice(), b"#"]));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(
        mode(&path),
        0o4755,
        "an unmarked write by a privileged caller keeps setuid"
    );
    rig.ok(
        opcode::WRITE,
        f,
        &cat(&[write(abi::WRITE_KILL_SUIDGID).as_slice(), b"#"]),
    );
    assert_eq!(mode(&path), 0o755, "a KILL_SUIDGID write clears setuid");
}

/// The owner of `path` (not following a symlink).
fn owner(path: &std::path::Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.uid(), m.gid())
}

/// CREATE and OPEN take only the open flags a create or an open may carry.
/// With `O_PATH` the kernel ignores `O_CREAT|O_EXCL`, so CREATE of an
/// existing FIFO, device node, directory or symlink "succeeded" and gave it
/// to the guest's caller; `O_DIRECTORY` and `O_TMPFILE` change what is
/// opened. Each is refused with EINVAL, and nothing is chowned or opened.
#[test]
fn create_and_open_refuse_o_path_o_directory_and_o_tmpfile() {
    use std::os::unix::fs::lchown;
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    assert_eq!(mknod(&mut rig, "fifo", libc::S_IFIFO | 0o666, 0), 0);
    let mut names = vec!["fifo", "dir", "link"];
    if mknod(&mut rig, "null", libc::S_IFCHR | 0o666, (1 << 8) | 3) == 0 {
        names.push("null");
    }
    let root = rig.dir.as_path().to_path_buf();
    std::fs::create_dir(root.join("dir")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("link")).unwrap();
    // Owned by someone else than the caller (uid 0), so a chown shows.
    for name in &names {
        lchown(root.join(name), Some(1234), Some(1234)).unwrap();
    }
    for name in &names {
        for flags in [
            libc::O_PATH,
            libc::O_PATH | libc::O_RDWR,
            libc::O_RDWR | libc::O_DIRECTORY,
            libc::O_RDWR | libc::O_TMPFILE,
        ] {
            assert_eq!(
                create(&mut rig, name, flags).0,
                libc::EINVAL,
                "CREATE {name} flags {flags:#o}"
            );
            assert_eq!(owner(&root.join(name)), (1234, 1234), "{name} chowned");
        }
    }
    assert_eq!(
        create(&mut rig, "new", libc::O_PATH).0,
        libc::EINVAL,
        "nothing is created with O_PATH either"
    );
    assert!(!root.join("new").exists());
    assert_eq!(rig.server.fs.handle_count(), 0, "no handle was made");

    // OPEN of a regular file: the same flags are refused; the others (and
    // the bits Linux adds, like O_LARGEFILE and __FMODE_EXEC) are not.
    std::fs::write(root.join("plain"), b"x").unwrap();
    let plain = rig.lookup(ROOT_ID, "plain").unwrap().nodeid;
    let open = |flags: i32| abi::OpenIn {
        flags: flags.cast_unsigned(),
        open_flags: 0,
    };
    for flags in [libc::O_PATH, libc::O_RDONLY | libc::O_DIRECTORY] {
        assert_eq!(
            rig.call(opcode::OPEN, plain, open(flags).as_slice()).0,
            libc::EINVAL,
            "OPEN flags {flags:#o}"
        );
    }
    assert_eq!(rig.server.fs.handle_count(), 0);
    let linux = libc::O_RDWR | libc::O_APPEND | 0o100_000 | 0o40;
    assert_eq!(rig.call(opcode::OPEN, plain, open(linux).as_slice()).0, 0);
    let (e, _) = create(&mut rig, "made", libc::O_RDWR | 0o100_000 | libc::O_CLOEXEC);
    assert_eq!(e, 0);
    assert_eq!(rig.server.fs.handle_count(), 2);
}
