//! The share's part of the daemon's migratable state: the inodes the guest
//! holds and its open handles, saved from one [`PassthroughFs`] and loaded
//! into a fresh one serving the same share ([`crate::migration`] frames it).
//!
//! Inodes travel by path relative to the share — `(parent nodeid, name)`,
//! parents first — and are verified on the way back in by `(st_dev, st_ino)`
//! and file type: the sandbox drops `CAP_DAC_READ_SEARCH`, so file handles
//! (`open_by_handle_at`) are not available. The load treats the state as
//! hostile: each name passes LOOKUP's [`component`] check, each inode is
//! opened one component at a time with `O_NOFOLLOW` from its parent's fd,
//! counts are capped by `--max-inodes` / `--max-handles`, and nothing is
//! applied unless everything loaded.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::file::GUEST_OPEN_FLAGS;
use super::{component, openat, stat_fd, Handle, Inode, PassthroughFs};
use crate::fuse::abi::ROOT_ID;

/// How deep a saved inode's chain of parents may be (as `path_of` bounds it).
const MAX_DEPTH: usize = 4096;

/// Flags a saved handle may carry: the guest's open flags that last beyond
/// the open, and `O_DIRECTORY` for a directory handle.
const HANDLE_FLAGS: i32 =
    (GUEST_OPEN_FLAGS & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC)) | libc::O_DIRECTORY;

/// One inode the guest holds, by where it was last seen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InodeState {
    pub nodeid: u64,
    pub parent: u64,
    /// One path component (bytes: host names need not be UTF-8).
    pub name: Vec<u8>,
    /// `st_dev`, or `None` for the share root's device: a share remounted
    /// with a new device number (tmpfs, overlay) still matches by inode.
    pub dev: Option<u64>,
    pub ino: u64,
    /// The file type (`st_mode & S_IFMT`).
    pub kind: u32,
    /// Lookups the guest holds.
    pub refs: u64,
}

/// One open handle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandleState {
    pub fh: u64,
    pub nodeid: u64,
    pub flags: i32,
}

/// The inodes and handles of a share, parents before children.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassthroughState {
    /// The share root's inode number: a different directory is refused.
    pub root_ino: u64,
    pub next_id: u64,
    pub next_handle: u64,
    /// The guest's INIT took FUSE_HANDLE_KILLPRIV_V2 / FUSE_SUBMOUNTS (it
    /// does not send INIT again after a move).
    pub killpriv_v2: bool,
    pub submounts: bool,
    pub inodes: Vec<InodeState>,
    pub handles: Vec<HandleState>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {why}")]
    Path { path: String, why: String },
    #[error("{field}: {count} entries, the limit is {limit}")]
    TooMany {
        field: &'static str,
        count: usize,
        limit: u64,
    },
    #[error("{field}: {why}")]
    Invalid { field: &'static str, why: String },
    #[error("the daemon already serves a session ({0}); state loads only into a fresh one")]
    NotFresh(&'static str),
}

fn path_err(path: &str, why: impl ToString) -> StateError {
    StateError::Path {
        path: if path.is_empty() {
            ".".into()
        } else {
            path.into()
        },
        why: why.to_string(),
    }
}

fn invalid(field: &'static str, why: impl ToString) -> StateError {
    StateError::Invalid {
        field,
        why: why.to_string(),
    }
}

fn join(parent: &str, name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    if parent.is_empty() {
        name.into_owned()
    } else {
        format!("{parent}/{name}")
    }
}

impl PassthroughFs {
    /// The inodes and handles the guest holds. Each inode is checked to be
    /// still where the guest last saw it: a file unlinked or renamed behind
    /// the guest's back cannot be found again by path, so the save is
    /// refused naming its last known path.
    pub fn save_state(&self) -> Result<PassthroughState, StateError> {
        let map = self.inodes.read().unwrap_or_else(|p| p.into_inner());
        let handles = self.handles.read().unwrap_or_else(|p| p.into_inner());
        let root = &map.by_id[&ROOT_ID];
        let root_dev = root.key.0;
        let mut inodes = Vec::with_capacity(map.by_id.len());
        for (&nodeid, inode) in &map.by_id {
            if nodeid == ROOT_ID {
                continue;
            }
            let path = self.path_of_locked(&map, nodeid);
            let link = inode.link.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some((parent, name)) = link else {
                return Err(path_err(&path, "no known name"));
            };
            let depth = self
                .depth_locked(&map, nodeid)
                .ok_or_else(|| path_err(&path, "its parents are not all known"))?;
            let dir = map
                .by_id
                .get(&parent)
                .ok_or_else(|| path_err(&path, "its directory is forgotten"))?;
            let found = openat(
                dir.fd.as_raw_fd(),
                &name,
                libc::O_PATH | libc::O_NOFOLLOW,
                0,
            )
            .and_then(|fd| stat_fd(fd.as_raw_fd()))
            .map_err(|e| path_err(&path, format!("cannot be found again: {e}")))?;
            if (found.st_dev, found.st_ino) != inode.key {
                return Err(path_err(
                    &path,
                    "now names another file (renamed or unlinked while open)",
                ));
            }
            inodes.push((
                depth,
                InodeState {
                    nodeid,
                    parent,
                    name: name.into_bytes(),
                    dev: (inode.key.0 != root_dev).then_some(inode.key.0),
                    ino: inode.key.1,
                    kind: inode.mode & libc::S_IFMT,
                    refs: inode.refs.load(Ordering::SeqCst),
                },
            ));
        }
        inodes.sort_by_key(|(depth, i)| (*depth, i.nodeid));
        let mut saved: Vec<HandleState> = handles
            .iter()
            .map(|(&fh, h)| HandleState {
                fh,
                nodeid: h.nodeid,
                flags: h.flags,
            })
            .collect();
        saved.sort_by_key(|h| h.fh);
        // A handle outlives its inode only if the guest forgot the inode
        // while the file was open: there is no path to find it by.
        if let Some(h) = saved.iter().find(|h| !map.by_id.contains_key(&h.nodeid)) {
            return Err(invalid(
                "handles",
                format!(
                    "handle {} is open on node {}, which the guest forgot",
                    h.fh, h.nodeid
                ),
            ));
        }
        Ok(PassthroughState {
            root_ino: root.key.1,
            next_id: map.next_id,
            next_handle: self.next_handle.load(Ordering::SeqCst),
            killpriv_v2: self.killpriv_v2(),
            submounts: self.submounts_on.load(Ordering::SeqCst),
            inodes: inodes.into_iter().map(|(_, i)| i).collect(),
            handles: saved,
        })
    }

    fn path_of_locked(&self, map: &super::InodeMap, nodeid: u64) -> String {
        let mut parts = Vec::new();
        let mut id = nodeid;
        for _ in 0..MAX_DEPTH {
            let Some(inode) = map.by_id.get(&id).filter(|_| id != ROOT_ID) else {
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

    /// How many links lead from `nodeid` to the root; `None` when a parent
    /// is missing or the chain does not end (a stale rename cycle).
    fn depth_locked(&self, map: &super::InodeMap, nodeid: u64) -> Option<usize> {
        let mut id = nodeid;
        for depth in 0..MAX_DEPTH {
            if id == ROOT_ID {
                return Some(depth);
            }
            let link = map
                .by_id
                .get(&id)?
                .link
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            id = link?.0;
        }
        None
    }

    /// Loads `state` into this daemon, which must serve no session yet
    /// (only the root known, no handle). Every inode is found again by its
    /// path and must be the same file (device, inode number, type); every
    /// handle is opened again with its flags. Nothing is applied unless all
    /// of it loads; the error names the first path or field that failed.
    pub fn load_state(&self, state: &PassthroughState) -> Result<(), StateError> {
        let (root, root_dev) = {
            let map = self.inodes.read().unwrap_or_else(|p| p.into_inner());
            if map.by_id.len() != 1 {
                return Err(StateError::NotFresh("inodes are known"));
            }
            let root = map.by_id[&ROOT_ID].clone();
            let dev = root.key.0;
            (root, dev)
        };
        if state.root_ino != root.key.1 {
            return Err(path_err(
                "",
                format!(
                    "the share's root is inode {}, the state's was {}",
                    root.key.1, state.root_ino
                ),
            ));
        }
        if state.next_id <= ROOT_ID || state.next_handle == 0 {
            return Err(invalid(
                "next_id",
                format!(
                    "next_id {} and next_handle {} must be past the root and 0",
                    state.next_id, state.next_handle
                ),
            ));
        }
        let inode_cap = self.limits.max_inodes.saturating_sub(1);
        if state.inodes.len() as u64 > inode_cap {
            return Err(StateError::TooMany {
                field: "inodes",
                count: state.inodes.len(),
                limit: inode_cap,
            });
        }
        if state.handles.len() as u64 > self.limits.max_handles {
            return Err(StateError::TooMany {
                field: "handles",
                count: state.handles.len(),
                limit: self.limits.max_handles,
            });
        }
        let mut loaded: HashMap<u64, (Arc<Inode>, String)> = HashMap::new();
        loaded.insert(ROOT_ID, (root, String::new()));
        let mut keys = HashSet::new();
        for saved in &state.inodes {
            let inode = self.load_inode(saved, state.next_id, root_dev, &loaded, &mut keys)?;
            let path = join(&loaded[&saved.parent].1, &saved.name);
            loaded.insert(saved.nodeid, (Arc::new(inode), path));
        }
        let mut handles = HashMap::new();
        for saved in &state.handles {
            if saved.fh == 0 || saved.fh >= state.next_handle {
                return Err(invalid(
                    "handles.fh",
                    format!("{} outside 1..next_handle", saved.fh),
                ));
            }
            let Some((inode, path)) = loaded.get(&saved.nodeid) else {
                return Err(invalid(
                    "handles.nodeid",
                    format!("{} is not a saved inode", saved.nodeid),
                ));
            };
            let handle = self.load_handle(saved, inode, path)?;
            if handles.insert(saved.fh, Arc::new(handle)).is_some() {
                return Err(invalid("handles.fh", format!("{} twice", saved.fh)));
            }
        }
        let mut map = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        let mut open = self.handles.write().unwrap_or_else(|p| p.into_inner());
        if map.by_id.len() != 1 || !open.is_empty() {
            return Err(StateError::NotFresh("a request came in during the load"));
        }
        for (nodeid, (inode, _)) in loaded {
            map.by_key.insert(inode.key, nodeid);
            map.by_id.insert(nodeid, inode);
        }
        map.next_id = state.next_id;
        *open = handles;
        self.next_handle.store(state.next_handle, Ordering::SeqCst);
        self.set_killpriv_v2(state.killpriv_v2);
        self.set_submounts(state.submounts);
        Ok(())
    }

    fn load_inode(
        &self,
        saved: &InodeState,
        next_id: u64,
        root_dev: u64,
        loaded: &HashMap<u64, (Arc<Inode>, String)>,
        keys: &mut HashSet<(u64, u64)>,
    ) -> Result<Inode, StateError> {
        if saved.nodeid <= ROOT_ID || saved.nodeid >= next_id {
            return Err(invalid(
                "inodes.nodeid",
                format!("{} outside 2..next_id", saved.nodeid),
            ));
        }
        if loaded.contains_key(&saved.nodeid) {
            return Err(invalid("inodes.nodeid", format!("{} twice", saved.nodeid)));
        }
        if saved.refs == 0 {
            return Err(invalid(
                "inodes.refs",
                format!("0 for node {}", saved.nodeid),
            ));
        }
        let Some((dir, dir_path)) = loaded.get(&saved.parent) else {
            return Err(invalid(
                "inodes.parent",
                format!(
                    "{} of node {} is not loaded before it",
                    saved.parent, saved.nodeid
                ),
            ));
        };
        let name = component(&saved.name).map_err(|e| {
            invalid(
                "inodes.name",
                format!("{:?}: {e}", String::from_utf8_lossy(&saved.name)),
            )
        })?;
        let path = join(dir_path, name.as_bytes());
        let fd = openat(
            dir.fd.as_raw_fd(),
            &name,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        )
        .map_err(|e| path_err(&path, e))?;
        let st = stat_fd(fd.as_raw_fd()).map_err(|e| path_err(&path, e))?;
        let key = (saved.dev.unwrap_or(root_dev), saved.ino);
        if (st.st_dev, st.st_ino) != key || st.st_mode & libc::S_IFMT != saved.kind {
            return Err(path_err(
                &path,
                format!(
                    "is not the saved file (device {} inode {} type {:o}; saved {} {} {:o}): \
                     renamed or replaced meanwhile",
                    st.st_dev,
                    st.st_ino,
                    st.st_mode & libc::S_IFMT,
                    key.0,
                    key.1,
                    saved.kind
                ),
            ));
        }
        if !keys.insert(key) {
            return Err(path_err(&path, "saved twice under two node ids"));
        }
        Ok(Inode {
            fd,
            key,
            mode: st.st_mode,
            refs: AtomicU64::new(saved.refs),
            link: Mutex::new(Some((saved.parent, name))),
        })
    }

    fn load_handle(
        &self,
        saved: &HandleState,
        inode: &Inode,
        path: &str,
    ) -> Result<Handle, StateError> {
        if saved.flags & !HANDLE_FLAGS != 0 {
            return Err(invalid(
                "handles.flags",
                format!("{:#o} has flags outside {HANDLE_FLAGS:#o}", saved.flags),
            ));
        }
        let dir_handle = saved.flags & libc::O_DIRECTORY != 0;
        if dir_handle != inode.is_dir() || !(inode.is_dir() || inode.is_reg()) {
            return Err(path_err(
                path,
                "a handle's kind does not match the file's type",
            ));
        }
        let file = self
            .reopen(inode, saved.flags)
            .map_err(|e| path_err(path, format!("cannot be opened again: {e}")))?;
        Ok(Handle {
            file,
            nodeid: saved.nodeid,
            flags: saved.flags,
            dir_lock: Mutex::new(()),
        })
    }
}
