//! The host directory as a FUSE filesystem.
//!
//! Every inode the guest knows is an `O_PATH` fd opened relative to its
//! parent's fd with `O_NOFOLLOW`, one path component at a time; names with
//! `/`, `.` and `..` are refused. So no request can name anything outside
//! the shared directory, whatever symlinks (absolute or relative) it holds
//! and however the guest races renames: nothing is ever resolved by path
//! from the root. Files are re-opened for I/O through `/proc/self/fd/<n>`
//! (the process's working directory, see [`crate::sandbox`]), and only
//! regular files and directories are re-opened that way, so a symlink is
//! never followed.

mod attr;
mod copy;
mod dir;
mod file;
mod state;
mod xattr;

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::fuse::abi::ROOT_ID;
use crate::limits::{Cap, CapCounters, Limits};

pub use attr::SetattrRequest;
pub use dir::{DirEntry, DirEntryPlus};
pub use file::{IoTarget, MappedFd};
pub use state::{HandleState, InodeState, PassthroughState, StateError};
pub use xattr::XattrMode;

/// `--cache`: how long the guest may trust what it was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// No caching: attributes and entries expire at once, file I/O is direct.
    Never,
    /// Attributes and entries cached as long as `Always`; file I/O is direct
    /// (no page cache), as virtiofsd's `metadata`.
    Metadata,
    /// Short timeouts; the page cache is dropped on open if the file changed.
    Auto,
    /// Long timeouts; the page cache is kept across opens.
    Always,
}

impl CachePolicy {
    pub fn timeout(self) -> Duration {
        match self {
            CachePolicy::Never => Duration::ZERO,
            CachePolicy::Auto => Duration::from_secs(1),
            CachePolicy::Metadata | CachePolicy::Always => Duration::from_secs(86_400),
        }
    }
}

pub fn last_error() -> io::Error {
    io::Error::last_os_error()
}

pub fn errno_error(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

/// Turns a libc return value into a Result.
pub fn cvt<T: Default + PartialOrd>(ret: T) -> io::Result<T> {
    if ret < T::default() {
        Err(last_error())
    } else {
        Ok(ret)
    }
}

/// A libc call's byte count or offset: the error when it failed (it is
/// negative then), else the value, which is never negative.
pub fn cvt_count<T, U: TryFrom<T>>(ret: T) -> io::Result<U> {
    U::try_from(ret).map_err(|_| last_error())
}

/// The longest name component Linux file systems take (`NAME_MAX`).
pub const NAME_MAX: usize = 255;

/// A name from the guest: one path component, not `.` or `..`. A longer
/// one than [`NAME_MAX`] gets ENAMETOOLONG, as every Linux file system
/// answers (the guest's VFS leaves that check to the file system).
pub fn component(name: &[u8]) -> io::Result<CString> {
    let name = name.strip_suffix(b"\0").unwrap_or(name);
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(errno_error(libc::EINVAL));
    }
    if name.len() > NAME_MAX {
        return Err(errno_error(libc::ENAMETOOLONG));
    }
    CString::new(name).map_err(|_| errno_error(libc::EINVAL))
}

pub fn stat_fd(fd: RawFd) -> io::Result<libc::stat64> {
    // SAFETY: an all-zero stat64 is valid for fstatat64 to overwrite.
    let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
    // SAFETY: the path is an empty C string and `st` is writable; with
    // AT_EMPTY_PATH the call inspects `fd` itself.
    cvt(unsafe {
        libc::fstatat64(
            fd,
            c"".as_ptr(),
            &mut st,
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

pub fn openat(dirfd: RawFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; the result is checked before use.
    let fd = cvt(unsafe { libc::openat(dirfd, name.as_ptr(), flags | libc::O_CLOEXEC, mode) })?;
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub struct Inode {
    pub fd: OwnedFd,
    /// (st_dev, st_ino): two lookups of one file share one inode.
    key: (u64, u64),
    pub mode: u32,
    /// Lookups the guest holds (FORGET gives them back).
    refs: AtomicU64,
    /// Where the guest last saw it: (parent nodeid, name). Used for policy
    /// paths and for operations that need the name (symlink times).
    pub link: Mutex<Option<(u64, CString)>>,
}

impl Inode {
    /// (st_dev, st_ino) of the host file.
    pub fn key(&self) -> (u64, u64) {
        self.key
    }

    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    pub fn is_reg(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }

    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }
}

#[derive(Default)]
struct InodeMap {
    by_id: HashMap<u64, Arc<Inode>>,
    by_key: HashMap<(u64, u64), u64>,
    next_id: u64,
}

/// An open file or directory the guest holds a handle to.
pub struct Handle {
    pub file: std::fs::File,
    pub nodeid: u64,
    /// The open(2) flags it was opened with (without `O_CREAT`, `O_EXCL`
    /// and `O_TRUNC`, which applied once): what a restored daemon opens it
    /// with again ([`crate::migration`]).
    pub flags: i32,
    /// Serializes seek + getdents on a directory handle.
    pub dir_lock: Mutex<()>,
}

pub struct PassthroughFs {
    proc_self_fd: OwnedFd,
    inodes: RwLock<InodeMap>,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    next_handle: AtomicU64,
    pub cache: CachePolicy,
    /// Who decides which regular files the guest gets with DAX.
    pub dax: Arc<dyn DaxDecision>,
    /// Running as root: new files are given the caller's uid/gid.
    chown_new: bool,
    /// Regular-file attributes answered with and without `FUSE_ATTR_DAX`.
    pub attrs_dax: AtomicU64,
    pub attrs_nodax: AtomicU64,
    /// `--announce-submounts`: offer FUSE_SUBMOUNTS at INIT.
    pub announce_submounts: bool,
    /// Offer READDIRPLUS at INIT (not with `--no-readdirplus`).
    pub readdirplus: bool,
    /// Offer FUSE_HANDLE_KILLPRIV_V2 at INIT (not with `--no-killpriv-v2`).
    pub offer_killpriv_v2: bool,
    /// The guest accepted FUSE_SUBMOUNTS at its last INIT.
    submounts_on: AtomicBool,
    /// `--xattr`: whether extended attributes are served at all.
    pub xattr: XattrMode,
    /// Caps on what the guest can make the daemon hold.
    pub limits: Limits,
    /// Requests refused by each cap.
    pub caps: CapCounters,
    /// The guest accepted FUSE_HANDLE_KILLPRIV_V2 at its last INIT.
    killpriv_v2: AtomicBool,
    /// Descriptors open now for window-buffer I/O ([`MappedFd`]): counted
    /// with the handles against `--max-handles`.
    window_fds: Arc<AtomicU64>,
}

/// One of `--max-handles`' slots, taken by a window-buffer descriptor
/// ([`PassthroughFs::charge_window_fd`]) and given back when dropped.
pub struct WindowFdSlot(Arc<AtomicU64>);

impl Drop for WindowFdSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The identity of the guest process making a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// Decides, per regular file, whether the guest gets it with DAX
/// (`FUSE_ATTR_DAX`). The passthrough layer only asks (the daemon's DAX
/// policy answers); it knows nothing of rules, sizes or paths.
pub trait DaxDecision: Send + Sync {
    /// `path` gives the file's path in the share, computed only if the
    /// decision needs it; `size` is its size in bytes.
    fn dax(&self, nodeid: u64, path: &dyn Fn() -> String, size: u64) -> bool;
    /// The inode is gone (FORGET): whatever was kept for it can go.
    fn forget(&self, _nodeid: u64) {}
    /// A new session (INIT): every inode is gone.
    fn reset(&self) {}
}

impl PassthroughFs {
    /// `root` is the shared directory (an `O_PATH` fd), `proc_self_fd` an fd
    /// of `/proc/self/fd`.
    pub fn new(
        root: OwnedFd,
        proc_self_fd: OwnedFd,
        cache: CachePolicy,
        dax: Arc<dyn DaxDecision>,
    ) -> io::Result<Self> {
        let st = stat_fd(root.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(errno_error(libc::ENOTDIR));
        }
        let mut map = InodeMap {
            next_id: ROOT_ID + 1,
            ..Default::default()
        };
        let key = (st.st_dev, st.st_ino);
        let root = Inode {
            fd: root,
            key,
            mode: st.st_mode,
            refs: AtomicU64::new(2),
            link: Mutex::new(None),
        };
        map.by_id.insert(ROOT_ID, Arc::new(root));
        map.by_key.insert(key, ROOT_ID);
        // SAFETY: geteuid has no preconditions.
        let chown_new = unsafe { libc::geteuid() } == 0;
        Ok(PassthroughFs {
            proc_self_fd,
            inodes: RwLock::new(map),
            handles: RwLock::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            cache,
            dax,
            chown_new,
            attrs_dax: AtomicU64::new(0),
            attrs_nodax: AtomicU64::new(0),
            announce_submounts: false,
            readdirplus: true,
            offer_killpriv_v2: true,
            submounts_on: AtomicBool::new(false),
            xattr: XattrMode::Off,
            window_fds: Arc::default(),
            limits: Limits::default(),
            caps: CapCounters::default(),
            killpriv_v2: AtomicBool::new(false),
        })
    }

    pub fn inode(&self, nodeid: u64) -> io::Result<Arc<Inode>> {
        self.inodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .get(&nodeid)
            .cloned()
            .ok_or_else(|| errno_error(libc::EBADF))
    }

    pub fn handle(&self, fh: u64, nodeid: u64) -> io::Result<Arc<Handle>> {
        let h = self
            .handles
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&fh)
            .cloned()
            .ok_or_else(|| errno_error(libc::EBADF))?;
        // A handle is only good for the inode it was opened on.
        if h.nodeid != nodeid {
            return Err(errno_error(libc::EBADF));
        }
        Ok(h)
    }

    /// Registers an open file; past `--max-handles` (handles and
    /// window-buffer descriptors together) the file is closed and the
    /// guest gets ENFILE.
    fn add_handle(&self, file: std::fs::File, nodeid: u64, flags: i32) -> io::Result<u64> {
        let mut handles = self.handles.write().unwrap_or_else(|p| p.into_inner());
        let in_use = (handles.len() as u64).saturating_add(self.window_fds.load(Ordering::SeqCst));
        if in_use >= self.limits.max_handles {
            drop(handles);
            self.caps.hit(Cap::Handles, self.limits.max_handles);
            return Err(errno_error(libc::ENFILE));
        }
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        handles.insert(
            fh,
            Arc::new(Handle {
                file,
                nodeid,
                flags: flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC),
                dir_lock: Mutex::new(()),
            }),
        );
        Ok(fh)
    }

    /// Takes a `--max-handles` slot for a descriptor that window-buffer
    /// I/O opens; ENFILE (counted, warned at most every 10 s) when handles
    /// and such descriptors already fill the cap. Under the handles' lock,
    /// so the two kinds never pass the cap together.
    pub fn charge_window_fd(&self) -> io::Result<WindowFdSlot> {
        let handles = self.handles.write().unwrap_or_else(|p| p.into_inner());
        let in_use = (handles.len() as u64).saturating_add(self.window_fds.load(Ordering::SeqCst));
        if in_use >= self.limits.max_handles {
            drop(handles);
            self.caps.hit(Cap::Handles, self.limits.max_handles);
            return Err(errno_error(libc::ENFILE));
        }
        self.window_fds.fetch_add(1, Ordering::SeqCst);
        Ok(WindowFdSlot(self.window_fds.clone()))
    }

    /// Window-buffer descriptors open now.
    pub fn window_fd_count(&self) -> u64 {
        self.window_fds.load(Ordering::SeqCst)
    }

    /// Open handles now.
    pub fn handle_count(&self) -> usize {
        self.handles.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn release(&self, fh: u64, nodeid: u64) -> io::Result<()> {
        let mut handles = self.handles.write().unwrap_or_else(|p| p.into_inner());
        match handles.get(&fh) {
            Some(h) if h.nodeid == nodeid => {
                handles.remove(&fh);
                Ok(())
            }
            _ => Err(errno_error(libc::EBADF)),
        }
    }

    /// Re-opens an inode for I/O through `/proc/self/fd`; only regular files
    /// and directories, so a symlink is never followed.
    pub fn reopen(&self, inode: &Inode, flags: i32) -> io::Result<std::fs::File> {
        if !inode.is_reg() && !inode.is_dir() {
            return Err(errno_error(libc::ELOOP));
        }
        let name = CString::new(inode.fd.as_raw_fd().to_string()).expect("digits");
        let flags = flags
            & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY | libc::O_NOFOLLOW | libc::O_DIRECT);
        Ok(openat(self.proc_self_fd.as_raw_fd(), &name, flags, 0)?.into())
    }

    /// The proc name of an inode's fd, for calls that take a path relative
    /// to the working directory (`/proc/self/fd`).
    pub fn proc_name(inode: &Inode) -> CString {
        CString::new(inode.fd.as_raw_fd().to_string()).expect("digits")
    }

    pub fn proc_self_fd(&self) -> RawFd {
        self.proc_self_fd.as_raw_fd()
    }

    /// LOOKUP: finds `name` in `parent`, counting one more reference.
    pub fn lookup(&self, parent: u64, name: &CStr) -> io::Result<(u64, libc::stat64)> {
        let dir = self.inode(parent)?;
        let fd = openat(dir.fd.as_raw_fd(), name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let st = stat_fd(fd.as_raw_fd())?;
        let key = (st.st_dev, st.st_ino);
        let mut map = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&id) = map.by_key.get(&key) {
            if let Some(inode) = map.by_id.get(&id) {
                inode.refs.fetch_add(1, Ordering::SeqCst);
                *inode.link.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((parent, name.to_owned()));
                return Ok((id, st));
            }
        }
        if map.by_id.len() as u64 >= self.limits.max_inodes {
            drop(map);
            self.caps.hit(Cap::Inodes, self.limits.max_inodes);
            return Err(errno_error(libc::ENFILE));
        }
        let id = map.next_id;
        map.next_id += 1;
        let inode = Inode {
            fd,
            key,
            mode: st.st_mode,
            refs: AtomicU64::new(1),
            link: Mutex::new(Some((parent, name.to_owned()))),
        };
        map.by_id.insert(id, Arc::new(inode));
        map.by_key.insert(key, id);
        Ok((id, st))
    }

    /// FORGET: gives back `n` references; the inode goes at zero.
    pub fn forget(&self, nodeid: u64, n: u64) {
        if nodeid == ROOT_ID {
            return;
        }
        let mut map = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        let Some(inode) = map.by_id.get(&nodeid) else {
            return;
        };
        let left = inode.refs.load(Ordering::SeqCst).saturating_sub(n);
        inode.refs.store(left, Ordering::SeqCst);
        if left == 0 {
            let key = inode.key;
            map.by_id.remove(&nodeid);
            if map.by_key.get(&key) == Some(&nodeid) {
                map.by_key.remove(&key);
            }
            drop(map);
            self.dax.forget(nodeid);
        }
    }

    /// DESTROY, or a new INIT: the guest forgets everything but the root.
    pub fn reset(&self) {
        let mut map = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        map.by_id.retain(|&id, _| id == ROOT_ID);
        let root_key = map.by_id[&ROOT_ID].key;
        map.by_key.retain(|k, _| *k == root_key);
        self.handles
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        drop(map);
        self.dax.reset();
    }

    /// The inode's path relative to the share, as far as the guest has
    /// looked it up ("" for the root).
    pub fn path_of(&self, nodeid: u64) -> String {
        let map = self.inodes.read().unwrap_or_else(|p| p.into_inner());
        let mut parts = Vec::new();
        let mut id = nodeid;
        // Bounded: a rename cycle in stale links cannot loop forever.
        for _ in 0..4096 {
            if id == ROOT_ID {
                break;
            }
            let Some(inode) = map.by_id.get(&id) else {
                break;
            };
            let Some((parent, name)) = inode.link.lock().unwrap_or_else(|p| p.into_inner()).clone()
            else {
                break;
            };
            parts.push(String::from_utf8_lossy(name.as_bytes()).into_owned());
            id = parent;
        }
        parts.reverse();
        parts.join("/")
    }

    /// Records whether the guest's INIT took FUSE_HANDLE_KILLPRIV_V2.
    pub fn set_killpriv_v2(&self, on: bool) {
        self.killpriv_v2.store(on, Ordering::SeqCst);
    }

    /// Whether the guest's INIT took FUSE_HANDLE_KILLPRIV_V2.
    pub fn killpriv_v2(&self) -> bool {
        self.killpriv_v2.load(Ordering::SeqCst)
    }

    /// Records whether the guest's INIT took FUSE_SUBMOUNTS.
    pub fn set_submounts(&self, on: bool) {
        self.submounts_on.store(on, Ordering::SeqCst);
    }

    /// Whether a lookup of `nodeid` (with stat `st`) should tell the guest
    /// it is a submount: a directory on another host filesystem than the
    /// directory it was found in. The guest then gives it its own
    /// superblock, so inode numbers of the two filesystems cannot collide.
    pub fn is_submount(&self, nodeid: u64, st: &libc::stat64) -> bool {
        if !self.submounts_on.load(Ordering::SeqCst)
            || st.st_mode & libc::S_IFMT != libc::S_IFDIR
            || nodeid == ROOT_ID
        {
            return false;
        }
        let map = self.inodes.read().unwrap_or_else(|p| p.into_inner());
        let parent = map.by_id.get(&nodeid).and_then(|i| {
            i.link
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|l| l.0)
        });
        match parent.and_then(|p| map.by_id.get(&p)) {
            Some(parent) => parent.key.0 != st.st_dev,
            None => false,
        }
    }

    /// Number of inodes the guest holds (root included).
    pub fn inode_count(&self) -> usize {
        self.inodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .len()
    }

    /// Gives a newly created entry to the caller, as the guest's kernel
    /// would have if it had created it itself.
    fn chown_new_entry(&self, dirfd: RawFd, name: &CStr, caller: Caller) -> io::Result<()> {
        if !self.chown_new {
            return Ok(());
        }
        // SAFETY: `name` is NUL-terminated; AT_SYMLINK_NOFOLLOW changes the
        // entry itself, never a symlink's target.
        cvt(unsafe {
            libc::fchownat(
                dirfd,
                name.as_ptr(),
                caller.uid,
                caller.gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
#[path = "passthrough_tests.rs"]
mod tests;
