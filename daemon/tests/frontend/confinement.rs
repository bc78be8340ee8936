//! The confined daemon seen from outside, through `/proc/<pid>/...` of its
//! two processes (docs/security.md, "The daemon's confinement"). Needs
//! root, as the default sandbox does; CI runs as root.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;

use super::*;

/// A supplementary group the test hands the daemon, which it must drop.
const HANDED_GROUP: libc::gid_t = 4242;
const CAP_SYS_PTRACE: u32 = 19;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: the daemon's sandbox needs root");
    }
    root
}

/// `Seccomp:`, `NoNewPrivs:` and `CapEff:` of every thread of `pid`.
fn thread_status(pid: u32) -> Vec<(String, u32, u32, u64)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let field = |n: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(n))
                .unwrap()
                .trim()
                .to_string()
        };
        let comm = std::fs::read_to_string(dir.join("comm"))
            .unwrap()
            .trim()
            .to_string();
        out.push((
            comm,
            field("Seccomp:").parse().unwrap(),
            field("NoNewPrivs:").parse().unwrap(),
            u64::from_str_radix(&field("CapEff:"), 16).unwrap(),
        ));
    }
    out
}

/// The daemon as it runs by default — its own namespaces with the share as
/// its root, capabilities cut, no_new_privs, the seccomp allowlist on every
/// thread — serves a mapping, and every thread of both its processes is
/// confined; no fd leads through `..` out of the share or its own fd
/// directory; the share is `nodev,nosuid` (a device node in it cannot be
/// opened); no core dumps, no supplementary groups; the waiting parent
/// holds no socket. (Needs root, as the default sandbox does; CI runs as root.)
#[test]
fn the_default_daemon_is_confined_on_every_thread_and_serves_a_dax_mapping() {
    if !is_root() {
        return;
    }
    let share = TempDir::new().unwrap();
    let pattern: Vec<u8> = (0..2 * MIB).map(|i| (i * 13 % 251) as u8).collect();
    std::fs::write(share.as_path().join("data.bin"), &pattern).unwrap();
    // A file system mounted inside the share comes along and is hardened too.
    let _sub = Tmpfs::mount(&share.as_path().join("sub"));
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let mut daemon = spawn_daemon(
        share.as_path(),
        &socket,
        &["--sandbox", "namespace", "--thread-pool-size", "2"],
        &[HANDED_GROUP],
    );
    let mem = guest_memory();
    let mut fs =
        VhostUserFs::connect(&fs_config(&socket)).expect("negotiation with the confined daemon");
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, b"data.bin\0");
    assert_eq!(e, 0);
    let entry: abi::EntryOut = obj(&p);
    let map = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset: 0,
        len: 2 * MIB,
        flags: 2,
        moffset: 0,
    };
    assert_eq!(
        guest
            .call(opcode::SETUPMAPPING, entry.nodeid, map.as_slice())
            .0,
        0
    );
    assert_eq!(window_byte(&fs, MIB + 5), pattern[index(MIB + 5)]);
    // Nothing above the share can be looked up: ".." is refused, and the
    // root is the share itself.
    assert_ne!(guest.call(opcode::LOOKUP, ROOT_ID, b"..\0").0, 0);

    let parent = daemon.id();
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).unwrap();
    let child: u32 = children
        .split_whitespace()
        .next()
        .expect("the serving child")
        .parse()
        .unwrap();
    let parent_threads = thread_status(parent);
    let child_threads = thread_status(child);
    assert!(
        child_threads.len() >= 4,
        "queue threads and workers: {child_threads:?}"
    );
    for (comm, seccomp, nnp, _) in parent_threads.iter().chain(&child_threads) {
        assert_eq!((*seccomp, *nnp), (2, 1), "thread {comm}");
    }
    for (comm, _, _, caps) in &child_threads {
        assert_eq!(
            caps & (1 << daemon::caps::CAP_SYS_ADMIN),
            0,
            "{comm} holds CAP_SYS_ADMIN"
        );
        assert_eq!(
            caps & (1 << daemon::caps::CAP_DAC_READ_SEARCH),
            0,
            "{comm} holds CAP_DAC_READ_SEARCH"
        );
        assert_eq!(
            caps & !0b1000_0000_0000_0000_0000_0001_1011,
            0,
            "{comm}: only CHOWN, DAC_OVERRIDE, FOWNER, FSETID, MKNOD"
        );
    }
    assert!(
        parent_threads.iter().all(|t| t.3 == 0),
        "the waiting parent keeps no capability"
    );
    let ns = |pid: u32, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    for kind in ["mnt", "pid", "net"] {
        assert_ne!(
            ns(child, kind),
            ns(std::process::id(), kind),
            "the serving daemon has a {kind} namespace of its own"
        );
    }
    let root = std::fs::read_link(format!("/proc/{child}/root")).unwrap();
    assert_eq!(
        root,
        std::path::Path::new("/"),
        "its root is the share, seen from inside as /"
    );
    assert_dotdot_leads_nowhere_else(child, share.as_path());
    let mounts = mounts(child);
    assert!(!mounts.is_empty());
    for (point, options, fstype) in &mounts {
        assert_ne!(fstype, "proc", "a procfs is mounted at {point}");
        let options: Vec<&str> = options.split(',').collect();
        assert!(
            options.contains(&"nodev") && options.contains(&"nosuid"),
            "the daemon's {point} is mounted {options:?}"
        );
    }
    // A device node in the share (the guest's MKNOD makes one just so)
    // cannot be opened in the daemon's mount namespace.
    for (name, kind, dev) in [
        ("null", libc::S_IFCHR, libc::makedev(1, 3)),
        ("loop0", libc::S_IFBLK, libc::makedev(7, 0)),
        ("sub/null", libc::S_IFCHR, libc::makedev(1, 3)),
    ] {
        let path = CString::new(share.as_path().join(name).as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated path.
        assert_eq!(unsafe { libc::mknod(path.as_ptr(), kind | 0o666, dev) }, 0);
        let inside = CString::new(format!("/{name}")).unwrap();
        assert_eq!(
            open_in_mount_ns_of(child, &inside),
            libc::EACCES,
            "opening the device node {name} in the daemon's mount namespace"
        );
    }
    for pid in [parent, child] {
        assert_dumps_nothing_and_has_no_groups(pid);
    }
    for fd in std::fs::read_dir(format!("/proc/{parent}/fd")).unwrap() {
        let fd = fd.unwrap();
        let n: u32 = fd.file_name().to_str().unwrap().parse().unwrap();
        let target = std::fs::read_link(fd.path()).unwrap();
        assert!(
            n <= 2 || !target.to_string_lossy().starts_with("socket:"),
            "the waiting parent holds fd {n}: {}",
            target.display()
        );
    }

    drop(guest);
    drop(fs);
    assert!(
        daemon.wait().unwrap().success(),
        "the confined daemon (and its parent) exits cleanly when its VMM goes"
    );
}

/// `--sandbox chroot` (no namespaces): its fd of `/proc/self/fd` leads
/// nowhere through `..` either, and the rest of the process-wide hardening
/// holds.
#[test]
fn the_chroot_daemon_reaches_no_procfs_and_dumps_nothing() {
    if !is_root() {
        return;
    }
    let share = TempDir::new().unwrap();
    std::fs::create_dir(share.as_path().join("sub")).unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let mut daemon = spawn_daemon(
        share.as_path(),
        &socket,
        &["--sandbox", "chroot"],
        &[HANDED_GROUP],
    );
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    let mut guest = activate(&mut fs, &mem);
    // Served, so the sandbox is entered.
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, b"sub\0");
    assert_eq!(e, 0);
    let sub: abi::EntryOut = obj(&p);
    assert_ne!(sub.nodeid, 0);
    let pid = daemon.id();
    assert_dotdot_leads_nowhere_else(pid, share.as_path());
    assert_dumps_nothing_and_has_no_groups(pid);
    drop(guest);
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}

/// A tmpfs mounted (on the host) for the life of the value.
struct Tmpfs(CString);

impl Tmpfs {
    fn mount(at: &Path) -> Tmpfs {
        std::fs::create_dir(at).unwrap();
        let at = CString::new(at.as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated strings, no data argument.
        let r = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                at.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(
            r,
            0,
            "mounting a tmpfs: {}",
            std::io::Error::last_os_error()
        );
        Tmpfs(at)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // SAFETY: NUL-terminated path.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

/// No core dump (it would hold guest memory): the core size limit is 0,
/// soft and hard, and the process is not dumpable, which a reader without
/// CAP_SYS_PTRACE sees as its /proc/<pid>/exe being closed to it. No
/// supplementary group is kept.
fn assert_dumps_nothing_and_has_no_groups(pid: u32) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let core: Vec<&str> = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max core file size"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(core[..2], ["0", "0"], "pid {pid}: core file size {core:?}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let groups = status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .unwrap();
    assert_eq!(groups.trim(), "", "pid {pid} keeps supplementary groups");
    // Capabilities are per thread: only this one gives CAP_SYS_PTRACE up.
    let exe = std::thread::spawn(move || {
        let mut sets = daemon::caps::get().unwrap();
        sets.effective &= !(1 << CAP_SYS_PTRACE);
        daemon::caps::set(sets).unwrap();
        std::fs::read_link(format!("/proc/{pid}/exe")).map(drop)
    })
    .join()
    .unwrap();
    assert_eq!(
        exe.map_err(|e| e.raw_os_error()),
        Err(Some(libc::EACCES)),
        "pid {pid} is dumpable"
    );
}

fn open_path(dirfd: i32, name: &CStr, flags: i32) -> std::io::Result<OwnedFd> {
    daemon::passthrough::openat(dirfd, name, flags | libc::O_PATH | libc::O_CLOEXEC, 0)
}

fn dev_ino(fd: &OwnedFd) -> (u64, u64) {
    let m = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    (m.dev(), m.ino())
}

/// A process's fd directory: every name is a number.
fn is_fd_dir(fd: &OwnedFd) -> bool {
    let names: Vec<String> = std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    !names.is_empty() && names.iter().all(|n| n.parse::<u32>().is_ok())
}

/// Every directory under `dir`, by (device, inode).
fn dirs_under(dir: &Path, out: &mut HashSet<(u64, u64)>) {
    let m = std::fs::symlink_metadata(dir).unwrap();
    out.insert((m.dev(), m.ino()));
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            dirs_under(&e.path(), out);
        }
    }
}

/// From every directory fd `pid` holds, `..` repeated (stopping where the
/// kernel stops the daemon: at its root, or where `..` stays put) reaches
/// only the share's directories and the daemon's own fd directory — never
/// a procfs root with `sys/kernel/core_pattern` or `sysrq-trigger`.
fn assert_dotdot_leads_nowhere_else(pid: u32, share: &Path) {
    let mut inside = HashSet::new();
    dirs_under(share, &mut inside);
    let root = std::fs::metadata(format!("/proc/{pid}/root")).unwrap();
    let root = (root.dev(), root.ino());
    let mut dir_fds = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let entry = entry.unwrap();
        let link = CString::new(entry.path().as_os_str().as_bytes()).unwrap();
        // Sockets, eventfds, memfds and files are not directories.
        let Ok(mut dir) = open_path(libc::AT_FDCWD, &link, libc::O_DIRECTORY) else {
            continue;
        };
        dir_fds += 1;
        let n = entry.file_name().to_string_lossy().into_owned();
        for depth in 0..16 {
            let here = std::fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd())).unwrap();
            for escape in [c"sys/kernel/core_pattern", c"sysrq-trigger", c"kcore"] {
                assert!(
                    open_path(dir.as_raw_fd(), escape, 0).is_err(),
                    "pid {pid} fd {n}: {escape:?} reachable {depth} levels up, at {}",
                    here.display()
                );
            }
            let id = dev_ino(&dir);
            assert!(
                inside.contains(&id) || is_fd_dir(&dir),
                "pid {pid} fd {n}: {depth} levels up is {}, neither the share nor an fd directory",
                here.display()
            );
            if id == root {
                break;
            }
            let up = open_path(dir.as_raw_fd(), c"..", libc::O_DIRECTORY).unwrap();
            if dev_ino(&up) == id {
                break;
            }
            dir = up;
        }
    }
    assert!(
        dir_fds >= 2,
        "pid {pid}: the share's root and /proc/self/fd at least"
    );
}

/// (mount point, per-mount options, file system type) of each mount `pid` sees.
fn mounts(pid: u32) -> Vec<(String, String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let dash = f.iter().position(|&x| x == "-").unwrap();
            (f[4].to_string(), f[5].to_string(), f[dash + 1].to_string())
        })
        .collect()
}

/// Opens `path` from a process that joined `pid`'s mount namespace (so its
/// root is the daemon's); returns 0 if it opened, else the errno. The
/// probe is a forked child that reports through `spawn`'s error and never
/// execs: joining a mount namespace needs a single-threaded process.
fn open_in_mount_ns_of(pid: u32, path: &CStr) -> i32 {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt")).unwrap();
    let ns_fd = ns.as_raw_fd();
    let path = path.to_owned();
    let mut probe = Command::new("/");
    // SAFETY: runs in the forked child before exec: two system calls on
    // memory allocated before the fork; the error carries only an errno.
    unsafe {
        probe.pre_exec(move || {
            if libc::setns(ns_fd, libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Err(std::io::Error::from_raw_os_error(0))
        });
    }
    let err = probe.spawn().expect_err("the probe never execs");
    drop(ns);
    err.raw_os_error().unwrap()
}
