//! What the daemon does to itself before it serves a guest (virtiofsd's
//! `--sandbox`), in this order, before any thread exists:
//!
//! - `namespace` (default): new mount, pid and network namespaces
//!   (`unshare`, then a fork: the child is pid 1 of the new pid namespace and
//!   serves; the parent closes every fd but stdio and only waits for it);
//!   mounts stop propagating to the host; a fresh `/proc` for the new pid
//!   namespace, only long enough to open its `self/fd` (below); the shared
//!   directory bind-mounted onto itself, made `nodev,nosuid`, and made the
//!   root with `pivot_root`, the old root detached. Where the host's root is the initial ramfs, which
//!   `pivot_root` refuses, the share's mount is moved over `/` and
//!   `chroot`ed into instead (as `switch_root` does) — safe because
//!   `CAP_SYS_CHROOT` is dropped next, so the chroot cannot be left.
//! - `chroot`: only the chroot, into the share, for hosts without
//!   namespaces; the working directory is the new root.
//! - `none`: no confinement of the file system view.
//!
//! Then, for `namespace` and `chroot`: the capability bounding set, the
//! ambient set and the permitted/effective sets cut to [`caps::KEPT`]. In
//! every mode: `no_new_privs`, and the seccomp filter (installed by `main`
//! once the sandbox is entered, before the first thread).
//!
//! `/proc/self/fd` is opened before the root changes and kept as an fd; the
//! daemon only ever opens single-number names relative to it (an inode's own
//! fd), never `..`, and no process directory is ever made the working one.
//! It is never an fd into a whole procfs, whose `..` would lead to
//! `sys/kernel/core_pattern` (writable by uid 0, no capability needed):
//! `namespace` bind-mounts `/proc/self/fd` over `/proc`, opens that, and
//! detaches both mounts, so `..` from the fd stays where it is; `chroot`
//! opens a detached clone of `/proc/self/fd` (`open_tree`, Linux 5.2), to
//! the same end without touching the host's mounts. `none` opens the
//! host's `/proc/self/fd` as it is.
//!
//! In the `namespace` sandbox the share and every mount under it are made
//! `nodev,nosuid` (keeping each mount's other flags), so a device node in
//! the share — a guest's MKNOD creates one — cannot be opened.
//!
//! In every mode, before the fork: no core dumps (core size limit 0, soft
//! and hard, and not dumpable: a dump would hold guest memory). In
//! `namespace` and `chroot`, also before the fork: no supplementary groups.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::caps;
use crate::passthrough::{cvt, openat};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sandbox {
    Namespace,
    Chroot,
    None,
}

pub struct Opened {
    pub root: OwnedFd,
    pub proc_self_fd: OwnedFd,
    /// How the root was changed, for the log.
    pub how: &'static str,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("--shared-dir {path}: {source}")]
    SharedDir { path: String, source: io::Error },
    #[error("opening /proc/self/fd: {0} (is /proc mounted?)")]
    Proc(io::Error),
    #[error("--sandbox {mode}: {step}: {source} (run as root, or use --sandbox none)")]
    Step {
        mode: &'static str,
        step: &'static str,
        source: io::Error,
    },
}

fn step(mode: &'static str, step: &'static str) -> impl Fn(io::Error) -> SandboxError {
    move |source| SandboxError::Step { mode, step, source }
}

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn mount(
    src: &std::ffi::CStr,
    target: &std::ffi::CStr,
    fstype: Option<&std::ffi::CStr>,
    flags: libc::c_ulong,
) -> io::Result<()> {
    let fstype = fstype.map_or(std::ptr::null(), |f| f.as_ptr());
    // SAFETY: NUL-terminated strings (or null for the type), no data argument.
    cvt(unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype,
            flags,
            std::ptr::null(),
        )
    })?;
    Ok(())
}

/// Enters the sandbox; returns the share's root fd and `/proc/self/fd`. With
/// `Namespace` this returns in the forked child only: the parent waits and
/// exits with the child's status.
pub fn enter(shared_dir: &Path, mode: Sandbox) -> Result<Opened, SandboxError> {
    let shown = shared_dir.display().to_string();
    let shared_err = |source| SandboxError::SharedDir {
        path: shown.clone(),
        source,
    };
    let c_shared = c_path(shared_dir).map_err(shared_err)?;
    // Checked first, so a typo is reported as such and not as a mount error.
    drop(
        openat(
            libc::AT_FDCWD,
            &c_shared,
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )
        .map_err(shared_err)?,
    );
    let name = match mode {
        Sandbox::Namespace => "namespace",
        Sandbox::Chroot => "chroot",
        Sandbox::None => "none",
    };
    // Before the fork, so the waiting parent has it too.
    no_core_dumps().map_err(step(name, "disabling core dumps"))?;
    if mode != Sandbox::None {
        // While CAP_SETGID is held (it is not kept).
        // SAFETY: an empty list; no pointer is read.
        cvt(unsafe { libc::setgroups(0, std::ptr::null()) })
            .map_err(step(name, "dropping supplementary groups"))?;
    }
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(40);
    let opened = match mode {
        Sandbox::None => {
            let root = openat(
                libc::AT_FDCWD,
                &c_shared,
                libc::O_PATH | libc::O_DIRECTORY,
                0,
            )
            .map_err(shared_err)?;
            let proc_self_fd = open_proc_self_fd()?;
            Opened {
                root,
                proc_self_fd,
                how: "none",
            }
        }
        Sandbox::Chroot => {
            let proc_self_fd = clone_proc_self_fd()?;
            let e = |s| step("chroot", s);
            // SAFETY: NUL-terminated path.
            cvt(unsafe { libc::chdir(c_shared.as_ptr()) }).map_err(e("chdir"))?;
            // SAFETY: as above.
            cvt(unsafe { libc::chroot(c".".as_ptr()) }).map_err(e("chroot"))?;
            // SAFETY: as above.
            cvt(unsafe { libc::chdir(c"/".as_ptr()) }).map_err(e("chdir /"))?;
            let root = openat(libc::AT_FDCWD, c"/", libc::O_PATH | libc::O_DIRECTORY, 0)
                .map_err(e("opening /"))?;
            Opened {
                root,
                proc_self_fd,
                how: "chroot",
            }
        }
        Sandbox::Namespace => enter_namespaces(&c_shared)?,
    };
    if mode != Sandbox::None {
        drop_capabilities(last_cap).map_err(step(name, "dropping capabilities"))?;
    }
    seccomp::set_no_new_privs().map_err(step("any", "no_new_privs"))?;
    // New files get exactly the mode the guest asked for (it applied its umask).
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0) };
    Ok(opened)
}

fn open_proc_self_fd() -> Result<OwnedFd, SandboxError> {
    openat(
        libc::AT_FDCWD,
        c"/proc/self/fd",
        libc::O_PATH | libc::O_DIRECTORY,
        0,
    )
    .map_err(SandboxError::Proc)
}

/// No core dump of the daemon: it maps guest RAM. The hard limit cannot be
/// raised again without CAP_SYS_RESOURCE; not being dumpable also stops a
/// pipe `core_pattern`, which ignores the limit.
fn no_core_dumps() -> io::Result<()> {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `zero` is a valid rlimit.
    cvt(unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) })?;
    // SAFETY: prctl with integer arguments.
    cvt(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })?;
    Ok(())
}

/// open_tree(2)'s flag for a detached copy of the mount (uapi/linux/mount.h).
const OPEN_TREE_CLONE: libc::c_uint = 1;

/// `/proc/self/fd` as the root of a detached mount of its own (a clone
/// made by `open_tree`), so `..` from it goes nowhere; the host's mount
/// table is not touched, so it works without a mount namespace.
fn clone_proc_self_fd() -> Result<OwnedFd, SandboxError> {
    // SAFETY: NUL-terminated path; integer flags; the result is a new fd.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c"/proc/self/fd".as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(step(
            "chroot",
            "cloning /proc/self/fd (open_tree, Linux 5.2)",
        )(io::Error::last_os_error()));
    }
    let fd = i32::try_from(fd)
        .map_err(|_| SandboxError::Proc(io::Error::from_raw_os_error(libc::EBADF)))?;
    // SAFETY: open_tree returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The kernel's `statvfs` flags that a bind remount must pass again (it
/// sets all of a mount's flags at once) and the mount flags they stand for.
const KEPT_MOUNT_FLAGS: [(libc::c_ulong, libc::c_ulong); 6] = [
    (libc::ST_RDONLY, libc::MS_RDONLY),
    (libc::ST_NOEXEC, libc::MS_NOEXEC),
    (libc::ST_NOATIME, libc::MS_NOATIME),
    (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
    (libc::ST_RELATIME, libc::MS_RELATIME),
    // ST_NOSYMFOLLOW (Linux 5.10), not in the libc crate.
    (0x2000, libc::MS_NOSYMFOLLOW),
];

/// Remounts the mount at `path` `nodev,nosuid`, keeping its other flags.
fn remount_nodev_nosuid(path: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: all-zero is a valid statvfs for the call to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: NUL-terminated path; `st` is writable.
    cvt(unsafe { libc::statvfs(path.as_ptr(), &mut st) })?;
    let mut flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NODEV | libc::MS_NOSUID;
    for (st_flag, ms_flag) in KEPT_MOUNT_FLAGS {
        if st.f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    if st.f_flag & (libc::ST_NOATIME | libc::ST_RELATIME) == 0 {
        flags |= libc::MS_STRICTATIME;
    }
    mount(c"none", path, None, flags)
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push(
                    d.iter()
                        .fold(0u8, |v, c| v.wrapping_mul(8).wrapping_add(c - b'0')),
                );
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Makes the share's bind mount (the working directory) and every mount
/// under it `nodev,nosuid`: a device node in the share cannot be opened,
/// a setuid file grants nothing to what runs it from the daemon's view.
fn harden_share_mounts() -> io::Result<()> {
    remount_nodev_nosuid(c".")?;
    let here = std::env::current_dir()?;
    let here = here.as_os_str().as_bytes();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    for line in mountinfo.lines() {
        let Some(point) = line.split(' ').nth(4) else {
            continue;
        };
        let point = unescape_mountinfo(point);
        let under = point
            .strip_prefix(here)
            .is_some_and(|rest| rest.first() == Some(&b'/'));
        if under {
            let point =
                CString::new(point).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            remount_nodev_nosuid(&point)?;
        }
    }
    Ok(())
}

fn enter_namespaces(shared: &std::ffi::CStr) -> Result<Opened, SandboxError> {
    let e = |s| step("namespace", s);
    // SAFETY: unshare with flags only; no thread has been started yet, as
    // a new pid namespace requires for the children that follow.
    cvt(unsafe { libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS | libc::CLONE_NEWNET) })
        .map_err(e("unshare"))?;
    // SAFETY: the process is single-threaded here, so the child is a
    // complete copy; it returns to serve, the parent never returns.
    let child = cvt(unsafe { libc::fork() }).map_err(e("fork"))?;
    if child > 0 {
        wait_for_child(child);
    }
    // The child dies with its parent, so killing the daemon's pid (what an
    // orchestrator knows) ends the whole daemon.
    // SAFETY: prctl with integer arguments.
    cvt(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
        .map_err(e("PR_SET_PDEATHSIG"))?;
    mount(c"none", c"/", None, libc::MS_REC | libc::MS_SLAVE)
        .map_err(e("making / a slave mount"))?;
    mount(
        c"proc",
        c"/proc",
        Some(c"proc"),
        libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_NOSUID | libc::MS_RELATIME,
    )
    .map_err(e("mounting /proc for the new pid namespace"))?;
    // As virtiofsd: the fd directory alone, over /proc, is what is opened;
    // then both mounts are detached, so `..` from it has nowhere to go.
    mount(c"/proc/self/fd", c"/proc", None, libc::MS_BIND)
        .map_err(e("bind-mounting /proc/self/fd over /proc"))?;
    let proc_self_fd = openat(
        libc::AT_FDCWD,
        c"/proc",
        libc::O_PATH | libc::O_DIRECTORY,
        0,
    )
    .map_err(SandboxError::Proc)?;
    for what in [
        "detaching /proc/self/fd from /proc",
        "detaching the new /proc",
    ] {
        // SAFETY: NUL-terminated path.
        cvt(unsafe { libc::umount2(c"/proc".as_ptr(), libc::MNT_DETACH) }).map_err(e(what))?;
    }
    mount(shared, shared, None, libc::MS_BIND | libc::MS_REC)
        .map_err(e("bind-mounting the share"))?;
    // SAFETY: NUL-terminated path.
    cvt(unsafe { libc::chdir(shared.as_ptr()) }).map_err(e("chdir into the share"))?;
    harden_share_mounts().map_err(e("remounting the share nodev,nosuid"))?;
    // SAFETY: pivot_root(".", ".") stacks the old root on the new one; both
    // paths are NUL-terminated.
    let how = if unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) } == 0 {
        // SAFETY: detaches the old root stacked on "."; NUL-terminated path.
        cvt(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) })
            .map_err(e("detaching the old root"))?;
        "namespace (pivot_root)"
    } else {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(e("pivot_root")(err));
        }
        // The root is the initial ramfs: move the share over it instead.
        mount(c".", c"/", None, libc::MS_MOVE)
            .map_err(e("moving the share over / (initramfs root)"))?;
        // SAFETY: NUL-terminated path.
        cvt(unsafe { libc::chroot(c".".as_ptr()) }).map_err(e("chroot (initramfs root)"))?;
        "namespace (initramfs root: move + chroot)"
    };
    // SAFETY: NUL-terminated path.
    cvt(unsafe { libc::chdir(c"/".as_ptr()) }).map_err(e("chdir /"))?;
    let root = openat(libc::AT_FDCWD, c"/", libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(e("opening the new root"))?;
    Ok(Opened {
        root,
        proc_self_fd,
        how,
    })
}

/// The parent's whole life after the fork: wait, then exit as the child did.
fn wait_for_child(child: libc::pid_t) -> ! {
    // The parent keeps nothing the guest can reach, but it is confined all
    // the same: it may only wait and exit.
    let _ = seccomp::set_no_new_privs();
    close_inherited_fds();
    if let Err(e) = caps::set(caps::CapSets::default()) {
        eprintln!("dax-virtiofsd: dropping the waiting parent's capabilities: {e}");
    }
    let waiting = [
        libc::SYS_wait4,
        libc::SYS_exit_group,
        libc::SYS_exit,
        libc::SYS_rt_sigreturn,
        libc::SYS_write,
    ];
    if let Err(e) = seccomp::apply(
        "daemon parent",
        &seccomp::calls(&waiting),
        seccomp::Mode::Kill,
    ) {
        eprintln!("dax-virtiofsd: {e}");
    }
    let mut status = 0;
    loop {
        // SAFETY: `status` is writable; waits for our own child.
        let r = unsafe { libc::waitpid(child, &mut status, 0) };
        if r == child {
            break;
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            std::process::exit(1);
        }
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    // SAFETY: _exit ends the process without running the child's share of
    // atexit work (there is none to run in the parent).
    unsafe { libc::_exit(code) }
}

/// Closes every fd but stdin, stdout and stderr: the waiting parent needs
/// none of the sockets or files the child serves with.
fn close_inherited_fds() {
    // SAFETY: closes fds 3 and up, none of which this process uses again.
    if unsafe { libc::syscall(libc::SYS_close_range, 3, libc::c_uint::MAX, 0) } == 0 {
        return;
    }
    // Before Linux 5.9: one by one, up to the open-file limit. (/proc
    // cannot be listed: the child is changing this mount namespace's root.)
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let top = i32::try_from(lim.rlim_cur).unwrap_or(i32::MAX);
    for fd in 3..top {
        // SAFETY: as above.
        unsafe { libc::close(fd) };
    }
}

/// Cuts the bounding, ambient, permitted and effective sets to `caps::KEPT`.
fn drop_capabilities(last_cap: u32) -> io::Result<()> {
    let kept = caps::mask(&caps::KEPT);
    for cap in 0..=last_cap {
        if kept & (1 << cap) == 0 {
            // SAFETY: prctl with integer arguments; needs CAP_SETPCAP, which
            // is dropped last (it is not in KEPT).
            let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            if r != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                return Err(io::Error::last_os_error());
            }
        }
    }
    // SAFETY: as above.
    cvt(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    })?;
    let now = caps::get()?;
    caps::set(caps::CapSets {
        effective: now.permitted & kept,
        permitted: now.permitted & kept,
        inheritable: 0,
    })
}

/// Raises the open-file limit: every inode the guest holds is an open fd.
/// `wanted` None means as high as the system allows (`fs.nr_open`); 0
/// leaves the limit as it is (virtiofsd's `--rlimit-nofile 0`).
/// Returns the soft limit now in force.
pub fn raise_nofile_limit(wanted: Option<u64>) -> io::Result<u64> {
    if wanted == Some(0) {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid, writable rlimit.
        cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
        return Ok(lim.rlim_cur);
    }
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(1 << 20);
    let target = wanted.unwrap_or(nr_open).min(nr_open);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    let raised = libc::rlimit {
        rlim_cur: target,
        rlim_max: lim.rlim_max.max(target),
    };
    // SAFETY: as above; raising the hard limit needs CAP_SYS_RESOURCE, so
    // fall back to the current hard limit without it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let capped = libc::rlimit {
            rlim_cur: target.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &capped) })?;
        return Ok(capped.rlim_cur);
    }
    Ok(raised.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// virtiofsd's `--rlimit-nofile 0` leaves the limit unchanged; taken
    /// as a limit it would leave the daemon no fd at all.
    #[test]
    fn an_open_file_limit_of_zero_leaves_the_limit_as_it_is() {
        let read = || {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: `lim` is a valid, writable rlimit.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
            (lim.rlim_cur, lim.rlim_max)
        };
        let before = read();
        assert_eq!(raise_nofile_limit(Some(0)).unwrap(), before.0);
        assert_eq!(read(), before);
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/srv/my\040share"), b"/srv/my share");
        assert_eq!(unescape_mountinfo(r"/a\011b\012c\134d"), b"/a\tb\nc\\d");
        assert_eq!(unescape_mountinfo(r"/plain\x"), b"/plain\\x");
        assert_eq!(unescape_mountinfo(r"/end\04"), b"/end\\04");
    }
}
