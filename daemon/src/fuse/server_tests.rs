//! The server against hand-built requests in guest memory, on a temporary
//! directory.

use std::os::unix::fs::symlink;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::tempdir::TempDir;

use super::*;
use crate::fuse::abi::{init, opcode, InHeader, OutHeader, ROOT_ID};
use crate::fuse::chain::split;
use crate::fuse::chain::tests::{chain_of, memory};
use crate::fuse::handlers::MAX_WRITE;
use crate::passthrough::openat;
use crate::policy::DaxPolicy;
use crate::GuestMemoryMmap;

const REQ: u64 = 0x1000;
const REPLY: u64 = 0x40000;
const REPLY_LEN: u32 = 0x20000;

pub(super) struct Rig {
    pub mem: GuestMemoryMmap,
    pub server: Server,
    pub dir: TempDir,
    unique: u64,
}

pub(super) fn policy(json: &str) -> policies::Policy {
    policies::Policy::parse_json(json).unwrap()
}

impl Rig {
    pub fn new(policy: policies::Policy) -> Rig {
        let dir = TempDir::new().unwrap();
        let share = dir.as_path().to_path_buf();
        Rig::sharing(&share, dir, policy, false, 32 << 20)
    }

    /// Serves `share` (`dir` is only kept alive) with a `window`-byte DAX
    /// window (0: none, `--dax off`).
    fn sharing(
        share: &std::path::Path,
        dir: TempDir,
        policy: policies::Policy,
        announce_submounts: bool,
        window: u64,
    ) -> Rig {
        let root = openat(
            libc::AT_FDCWD,
            &CString::new(share.to_str().unwrap()).unwrap(),
            libc::O_PATH,
            0,
        )
        .unwrap();
        let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
        let policy = Arc::new(DaxPolicy::new(policy));
        let mut fs = PassthroughFs::new(root, proc_fd, CachePolicy::Auto, policy.clone()).unwrap();
        fs.announce_submounts = announce_submounts;
        Rig {
            mem: memory(),
            server: Server::new(fs, DaxMapper::new(window, policy.clone()), policy),
            dir,
            unique: 0,
        }
    }

    /// Sends `opcode` on `nodeid` with `body`; returns (errno, reply payload).
    pub fn call(&mut self, opcode: u32, nodeid: u64, body: &[u8]) -> (i32, Vec<u8>) {
        self.unique += 1;
        let hdr = InHeader {
            len: u32::try_from(40 + body.len()).unwrap(),
            opcode,
            unique: self.unique,
            nodeid,
            uid: 0,
            gid: 0,
            ..Default::default()
        };
        let mut req = hdr.as_slice().to_vec();
        req.extend_from_slice(body);
        self.mem.write_slice(&req, GuestAddress(REQ)).unwrap();
        self.mem
            .write_slice(&vec![0xee; REPLY_LEN as usize], GuestAddress(REPLY))
            .unwrap();
        let chain = chain_of(
            &self.mem,
            &[
                (REQ, u32::try_from(req.len()).unwrap(), false),
                (REPLY, REPLY_LEN, true),
            ],
        );
        let (r, w) = split(&self.mem, chain).unwrap();
        let n = self.server.handle(r, w);
        if n == 0 {
            return (-1, Vec::new()); // no reply (FORGET)
        }
        let out: OutHeader = self.mem.read_obj(GuestAddress(REPLY)).unwrap();
        assert_eq!(out.unique, self.unique);
        assert_eq!(out.len as usize, n, "header length = bytes used");
        let mut payload = vec![0u8; n - 16];
        self.mem
            .read_slice(&mut payload, GuestAddress(REPLY + 16))
            .unwrap();
        (-out.error, payload)
    }

    pub fn ok(&mut self, opcode: u32, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let (e, p) = self.call(opcode, nodeid, body);
        assert_eq!(e, 0, "opcode {opcode} failed with errno {e}");
        p
    }

    pub fn init(&mut self) -> abi::InitOut {
        self.init_offering(0)
    }

    /// INIT as Linux sends it, offering `extra` flags (bits 0..32) too.
    pub fn init_offering(&mut self, extra: u64) -> abi::InitOut {
        let i = abi::InitIn {
            major: 7,
            minor: 38,
            max_readahead: 1 << 17,
            flags: u32::try_from(
                init::INIT_EXT
                    | init::MAP_ALIGNMENT
                    | init::DO_READDIRPLUS
                    | init::ASYNC_READ
                    | extra,
            )
            .unwrap(),
            flags2: (init::HAS_INODE_DAX >> 32) as u32,
            ..Default::default()
        };
        obj(&self.ok(opcode::INIT, 0, i.as_slice()))
    }

    /// LOOKUP; a negative entry (nodeid 0) reads as ENOENT.
    pub fn lookup(&mut self, parent: u64, name: &str) -> Result<abi::EntryOut, i32> {
        let (e, p) = self.call(opcode::LOOKUP, parent, &cstr(name));
        match e {
            0 if obj::<abi::EntryOut>(&p).nodeid == 0 => Err(libc::ENOENT),
            0 => Ok(obj(&p)),
            e => Err(e),
        }
    }
}

pub(super) fn obj<T: ByteValued + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    v.as_mut_slice().copy_from_slice(&b[..size_of::<T>()]);
    v
}

pub(super) fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

pub(super) fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn init_negotiates_versions_and_dax_flags() {
    let mut rig = Rig::new(policy(r#"{"window_granularity": "64K"}"#));
    let out = rig.init();
    assert_eq!((out.major, out.minor), (7, 38));
    assert_eq!(out.max_write, MAX_WRITE);
    assert_ne!(out.flags as u64 & init::DO_READDIRPLUS, 0);
    // No backend channel yet: no DAX flags offered.
    assert_eq!(out.flags as u64 & init::MAP_ALIGNMENT, 0);
    assert_eq!(out.flags2, 0);
    // Too old a guest is refused; a newer major gets ours back.
    let old = abi::InitIn {
        major: 7,
        minor: 20,
        ..Default::default()
    };
    assert_eq!(
        rig.call(opcode::INIT, 0, &old.as_slice()[..16]).0,
        libc::EPROTO
    );
    let newer = abi::InitIn {
        major: 8,
        minor: 0,
        ..Default::default()
    };
    let out: abi::InitOut = obj(&rig.ok(opcode::INIT, 0, newer.as_slice()));
    assert_eq!(out.major, 7);
    // A truncated INIT is EINVAL, not a crash.
    assert_eq!(rig.call(opcode::INIT, 0, &[7, 0, 0]).0, libc::EINVAL);
}

#[test]
fn submounts_are_announced_on_directories_of_other_host_filesystems_when_asked_and_accepted() {
    use std::os::unix::fs::MetadataExt;
    // "/" holds other filesystems (procfs at least); which of these names
    // are mount points is read from the host, not assumed.
    let root_dev = std::fs::metadata("/").unwrap().dev();
    let names: Vec<(&str, bool)> = ["proc", "sys", "dev", "etc", "usr", "tmp", "run", "var"]
        .into_iter()
        .filter_map(|n| {
            std::fs::symlink_metadata(format!("/{n}"))
                .ok()
                .filter(|m| m.is_dir())
                .map(|m| (n, m.dev() != root_dev))
        })
        .collect();
    assert!(
        names.iter().any(|&(_, other)| other),
        "no mount point under / among {names:?}"
    );
    assert!(
        names.iter().any(|&(_, other)| !other),
        "every directory under / is a mount point: {names:?}"
    );
    for (announce, guest_offers) in [(false, true), (true, false), (true, true)] {
        let mut rig = Rig::sharing(
            std::path::Path::new("/"),
            TempDir::new().unwrap(),
            policies::Policy::default(),
            announce,
            32 << 20,
        );
        let out = rig.init_offering(init::SUBMOUNTS);
        let out = if guest_offers { out } else { rig.init() };
        let negotiated = announce && guest_offers;
        assert_eq!(
            out.flags as u64 & init::SUBMOUNTS != 0,
            negotiated,
            "announce {announce}, guest offers {guest_offers}"
        );
        for &(name, other_fs) in &names {
            let entry = rig.lookup(ROOT_ID, name).unwrap();
            let flagged = entry.attr.flags & abi::ATTR_SUBMOUNT != 0;
            assert_eq!(
                flagged,
                negotiated && other_fs,
                "/{name} (announce {announce}, guest offers {guest_offers})"
            );
        }
    }
    // Files are never submounts; the share's own root is not one either.
    let mut rig = Rig::sharing(
        std::path::Path::new("/proc"),
        TempDir::new().unwrap(),
        policies::Policy::default(),
        true,
        32 << 20,
    );
    rig.init_offering(init::SUBMOUNTS);
    assert_eq!(
        rig.lookup(ROOT_ID, "self")
            .map(|e| e.attr.flags & abi::ATTR_SUBMOUNT),
        Ok(0),
        "/proc/self is a symlink"
    );
    assert_eq!(
        rig.lookup(ROOT_ID, "uptime")
            .map(|e| e.attr.flags & abi::ATTR_SUBMOUNT),
        Ok(0)
    );
}

#[test]
fn files_round_trip_through_create_write_read_readdir() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    let create = abi::CreateIn {
        flags: libc::O_RDWR as u32,
        mode: 0o644,
        ..Default::default()
    };
    let reply = rig.ok(
        opcode::CREATE,
        ROOT_ID,
        &cat(&[create.as_slice(), &cstr("hello.txt")]),
    );
    let entry: abi::EntryOut = obj(&reply);
    let open: abi::OpenOut = obj(&reply[size_of::<abi::EntryOut>()..]);
    assert_eq!(entry.attr.mode & libc::S_IFMT, libc::S_IFREG);

    let data = b"through guest memory, no bounce buffer";
    let write = abi::WriteIn {
        fh: open.fh,
        offset: 3,
        size: u32::try_from(data.len()).unwrap(),
        ..Default::default()
    };
    let out: abi::WriteOut =
        obj(&rig.ok(opcode::WRITE, entry.nodeid, &cat(&[write.as_slice(), data])));
    assert_eq!(out.size as usize, data.len());
    let on_host = std::fs::read(rig.dir.as_path().join("hello.txt")).unwrap();
    assert_eq!(&on_host[3..], data);

    let read = abi::ReadIn {
        fh: open.fh,
        offset: 3,
        size: 4096,
        ..Default::default()
    };
    assert_eq!(rig.ok(opcode::READ, entry.nodeid, read.as_slice()), data);
    // A handle is only good for its own inode.
    let (e, _) = rig.call(opcode::READ, ROOT_ID, read.as_slice());
    assert_eq!(e, libc::EBADF);

    std::fs::create_dir(rig.dir.as_path().join("sub")).unwrap();
    let open: abi::OpenOut =
        obj(&rig.ok(opcode::OPENDIR, ROOT_ID, abi::OpenIn::default().as_slice()));
    let read = abi::ReadIn {
        fh: open.fh,
        size: 4096,
        ..Default::default()
    };
    let listing = rig.ok(opcode::READDIRPLUS, ROOT_ID, read.as_slice());
    let mut names = Vec::new();
    let mut pos = 0;
    while pos < listing.len() {
        let e: abi::EntryOut = obj(&listing[pos..]);
        let d: abi::Dirent = obj(&listing[pos + 128..]);
        let name =
            String::from_utf8(listing[pos + 152..pos + 152 + d.namelen as usize].to_vec()).unwrap();
        assert_eq!(
            e.nodeid == 0,
            name == "." || name == "..",
            "{name}: only . and .. come without a lookup"
        );
        names.push(name);
        pos += (152 + d.namelen as usize).next_multiple_of(8);
    }
    names.sort();
    assert_eq!(names, [".", "..", "hello.txt", "sub"]);

    // Rename, then unlink; the file is gone on the host.
    let rename = abi::RenameIn { newdir: ROOT_ID };
    rig.ok(
        opcode::RENAME,
        ROOT_ID,
        &cat(&[rename.as_slice(), &cstr("hello.txt"), &cstr("moved.txt")]),
    );
    assert!(rig.dir.as_path().join("moved.txt").exists());
    rig.ok(opcode::UNLINK, ROOT_ID, &cstr("moved.txt"));
    assert_eq!(rig.lookup(ROOT_ID, "moved.txt").unwrap_err(), libc::ENOENT);
}

#[test]
fn nothing_outside_the_share_can_be_reached() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    let outside = TempDir::new().unwrap();
    std::fs::write(outside.as_path().join("secret"), b"host data").unwrap();
    symlink("/", rig.dir.as_path().join("abs")).unwrap();
    symlink(
        outside.as_path().join("secret"),
        rig.dir.as_path().join("to-secret"),
    )
    .unwrap();
    symlink("../../..", rig.dir.as_path().join("up")).unwrap();

    for bad in ["..", ".", "a/b", "/etc", ""] {
        assert_eq!(
            rig.lookup(ROOT_ID, bad).unwrap_err(),
            libc::EINVAL,
            "{bad:?}"
        );
    }
    // A symlink is an inode of its own; it is never followed.
    let abs = rig.lookup(ROOT_ID, "abs").unwrap();
    assert_eq!(abs.attr.mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(rig.lookup(abs.nodeid, "etc").unwrap_err(), libc::ENOTDIR);
    let up = rig.lookup(ROOT_ID, "up").unwrap();
    assert_eq!(rig.lookup(up.nodeid, "secret").unwrap_err(), libc::ENOTDIR);
    let secret = rig.lookup(ROOT_ID, "to-secret").unwrap();
    let open = abi::OpenIn {
        flags: libc::O_RDONLY as u32,
        ..Default::default()
    };
    assert_eq!(
        rig.call(opcode::OPEN, secret.nodeid, open.as_slice()).0,
        libc::ELOOP
    );
    assert_eq!(
        rig.call(opcode::OPENDIR, up.nodeid, open.as_slice()).0,
        libc::ENOTDIR
    );
    assert_eq!(
        rig.ok(opcode::READLINK, secret.nodeid, &[]),
        outside
            .as_path()
            .join("secret")
            .to_str()
            .unwrap()
            .as_bytes()
    );
    // Creating through a symlink does not create outside either.
    let create = abi::CreateIn {
        flags: libc::O_RDWR as u32,
        mode: 0o644,
        ..Default::default()
    };
    assert_ne!(
        rig.call(
            opcode::CREATE,
            abs.nodeid,
            &cat(&[create.as_slice(), &cstr("pwned")])
        )
        .0,
        0
    );
    let mkdir = abi::MkdirIn {
        mode: 0o755,
        umask: 0,
    };
    assert_ne!(
        rig.call(
            opcode::MKDIR,
            up.nodeid,
            &cat(&[mkdir.as_slice(), &cstr("pwned")])
        )
        .0,
        0
    );
    assert!(!std::path::Path::new("/pwned").exists());
    // An unknown nodeid or handle is EBADF.
    assert_eq!(
        rig.call(
            opcode::GETATTR,
            999_999,
            abi::GetattrIn::default().as_slice()
        )
        .0,
        libc::EBADF
    );
}

#[test]
fn attr_dax_follows_the_policy_by_size_and_path() {
    let mut rig = Rig::new(policy(
        r#"{"mode": "inode", "rules": [{"path": "logs/**", "dax": false}, {"min_size": "64K", "dax": true}], "default": false}"#,
    ));
    rig.init();
    std::fs::write(rig.dir.as_path().join("big"), vec![1u8; 128 << 10]).unwrap();
    std::fs::write(rig.dir.as_path().join("small"), vec![1u8; 100]).unwrap();
    std::fs::create_dir(rig.dir.as_path().join("logs")).unwrap();
    std::fs::write(rig.dir.as_path().join("logs/big.log"), vec![1u8; 128 << 10]).unwrap();
    assert_eq!(
        rig.lookup(ROOT_ID, "big").unwrap().attr.flags,
        abi::ATTR_DAX
    );
    assert_eq!(rig.lookup(ROOT_ID, "small").unwrap().attr.flags, 0);
    let logs = rig.lookup(ROOT_ID, "logs").unwrap();
    assert_eq!(logs.attr.flags, 0, "directories never get DAX");
    let log = rig.lookup(logs.nodeid, "big.log").unwrap();
    assert_eq!(log.attr.flags, 0, "path rule wins over size rule");
    // GETATTR answers the same, and follows a change of size.
    let small = rig.lookup(ROOT_ID, "small").unwrap();
    std::fs::write(rig.dir.as_path().join("small"), vec![1u8; 100 << 10]).unwrap();
    let attr: abi::AttrOut = obj(&rig.ok(
        opcode::GETATTR,
        small.nodeid,
        abi::GetattrIn::default().as_slice(),
    ));
    assert_eq!(attr.attr.flags, abi::ATTR_DAX);
    // A new policy reaches inodes already looked up.
    rig.server.policy.replace(policy(r#"{"mode": "never"}"#));
    let attr: abi::AttrOut = obj(&rig.ok(
        opcode::GETATTR,
        small.nodeid,
        abi::GetattrIn::default().as_slice(),
    ));
    assert_eq!(attr.attr.flags, 0);
}

#[test]
fn the_adaptive_part_refines_only_the_default_and_sees_the_window() {
    // A 32 MiB window: a file over 16 MiB starts without DAX, unless a
    // rule names it; mappings and unmaps are counted by 2 MiB range.
    let mut rig = Rig::new(policy(
        r#"{"cache_size": "32M", "rules": [{"path": "pinned/**", "dax": true}, {"max_size": "32K", "dax": false}]}"#,
    ));
    rig.init();
    let d = rig.dir.as_path();
    std::fs::create_dir(d.join("pinned")).unwrap();
    for name in ["big.bin", "pinned/big.bin"] {
        let f = std::fs::File::create(d.join(name)).unwrap();
        f.set_len(20 << 20).unwrap();
    }
    std::fs::write(d.join("mid.bin"), vec![7u8; 64 << 10]).unwrap();
    assert_eq!(rig.lookup(ROOT_ID, "big.bin").unwrap().attr.flags, 0);
    let pinned = rig.lookup(ROOT_ID, "pinned").unwrap();
    assert_eq!(
        rig.lookup(pinned.nodeid, "big.bin").unwrap().attr.flags,
        abi::ATTR_DAX,
        "an explicit rule wins"
    );
    let mid = rig.lookup(ROOT_ID, "mid.bin").unwrap();
    assert_eq!(mid.attr.flags, abi::ATTR_DAX);
    let events = rig.server.policy.adaptive.events_after(0).events;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].kind.as_str(), events[0].path.as_deref()),
        ("withdraw", Some("big.bin"))
    );
    assert_eq!(events[0].reason, "larger_than_window_share");
    // Without the VMM's channel the SETUPMAPPING fails: nothing is counted.
    let map = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset: 0,
        len: 2 << 20,
        flags: 1,
        moffset: 0,
    };
    assert_ne!(
        rig.call(opcode::SETUPMAPPING, mid.nodeid, map.as_slice()).0,
        0
    );
    assert_eq!(rig.server.policy.adaptive.stats().mapped_ranges, 0);
    // Switched off, the policy's own answer stands.
    rig.server.policy.replace(policy(
        r#"{"cache_size": "32M", "adaptive": {"enabled": false}}"#,
    ));
    let big = rig.lookup(ROOT_ID, "big.bin").unwrap();
    assert_eq!(big.attr.flags, abi::ATTR_DAX);
}
#[test]
fn malformed_requests_get_errors_not_crashes() {
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    // Header claims more than the buffers hold.
    rig.mem
        .write_obj(
            InHeader {
                len: 4096,
                opcode: opcode::LOOKUP,
                unique: 9,
                ..Default::default()
            },
            GuestAddress(REQ),
        )
        .unwrap();
    let chain = chain_of(&rig.mem, &[(REQ, 40, false), (REPLY, 64, true)]);
    let (r, w) = split(&rig.mem, chain).unwrap();
    assert_eq!(rig.server.handle(r, w), 16);
    let out: OutHeader = rig.mem.read_obj(GuestAddress(REPLY)).unwrap();
    assert_eq!((out.error, out.unique), (-libc::EINVAL, 9));
    // No writable buffer at all: nothing is written.
    let chain = chain_of(&rig.mem, &[(REQ, 40, false)]);
    let (r, w) = split(&rig.mem, chain).unwrap();
    assert_eq!(rig.server.handle(r, w), 0);
    // Unknown opcode, name without NUL, short struct, WRITE larger than its data.
    assert_eq!(rig.call(9999, ROOT_ID, &[]).0, libc::ENOSYS);
    assert_eq!(rig.call(opcode::LOOKUP, ROOT_ID, b"noterm").0, libc::EINVAL);
    assert_eq!(rig.call(opcode::SETATTR, ROOT_ID, &[0; 8]).0, libc::EINVAL);
    let write = abi::WriteIn {
        fh: 1,
        size: 1 << 20,
        ..Default::default()
    };
    assert_eq!(
        rig.call(opcode::WRITE, ROOT_ID, write.as_slice()).0,
        libc::EINVAL
    );
    // DAX requests without a backend channel, and bad ranges.
    let map = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset: 0,
        len: 2 << 20,
        flags: 2,
        moffset: 0,
    };
    assert_eq!(
        rig.call(opcode::SETUPMAPPING, ROOT_ID, map.as_slice()).0,
        libc::EINVAL,
        "root is not a file"
    );
    let past = abi::SetupmappingIn {
        moffset: 32 << 20,
        ..map
    };
    assert_eq!(
        rig.call(opcode::SETUPMAPPING, ROOT_ID, past.as_slice()).0,
        libc::EINVAL
    );
    let flags = abi::SetupmappingIn { flags: 4, ..map };
    assert_eq!(
        rig.call(opcode::SETUPMAPPING, ROOT_ID, flags.as_slice()).0,
        libc::EINVAL
    );
    let rm = abi::RemovemappingIn { count: 1000 };
    assert_eq!(
        rig.call(opcode::REMOVEMAPPING, ROOT_ID, rm.as_slice()).0,
        libc::EINVAL
    );
    // FORGET gets no reply.
    assert_eq!(
        rig.call(
            opcode::FORGET,
            ROOT_ID,
            abi::ForgetIn { nlookup: 1 }.as_slice()
        )
        .0,
        -1
    );
}

/// virtiofsd's `--no-readdirplus`, `--no-killpriv-v2` and
/// `--cache=metadata` (Kata's configuration accepts `metadata`).
#[test]
fn readdirplus_killpriv_v2_and_cache_metadata_change_what_is_offered() {
    let mut rig = Rig::new(policy("{}"));
    std::fs::write(rig.dir.as_path().join("f"), b"x").unwrap();
    let asked = init::DO_READDIRPLUS | init::HANDLE_KILLPRIV_V2;
    assert_eq!(rig.init_offering(asked).flags as u64 & asked, asked);
    let open = abi::OpenIn {
        flags: libc::O_RDONLY as u32,
        ..Default::default()
    };
    let f = rig.lookup(ROOT_ID, "f").unwrap();
    assert_eq!(f.entry_valid, 1, "auto: one second");
    let out: abi::OpenOut = obj(&rig.ok(opcode::OPEN, f.nodeid, open.as_slice()));
    assert_eq!(out.open_flags & abi::FOPEN_DIRECT_IO, 0);

    rig.server.fs.readdirplus = false;
    rig.server.fs.offer_killpriv_v2 = false;
    rig.server.fs.cache = CachePolicy::Metadata;
    assert_eq!(rig.init_offering(asked).flags as u64 & asked, 0);
    let f = rig.lookup(ROOT_ID, "f").unwrap();
    assert_eq!((f.entry_valid, f.attr_valid), (86_400, 86_400));
    let out: abi::OpenOut = obj(&rig.ok(opcode::OPEN, f.nodeid, open.as_slice()));
    assert_eq!(out.open_flags & abi::FOPEN_DIRECT_IO, abi::FOPEN_DIRECT_IO);
}

/// FUSE makes `blksize` the guest inode's block size, and the guest's DAX
/// writeback refuses (EIO, a kernel warning) an inode whose block size is
/// not its page size: where a window is offered a regular file is given
/// the page size whatever its host file system says (2 MiB on a huge-page
/// tmpfs); other files, and every file without a window, keep the host's.
#[test]
fn a_regular_files_block_size_is_the_guest_page_size_where_a_window_is_offered() {
    let huge = |mode| abi::Attr {
        mode,
        blksize: 2 << 20,
        ..Default::default()
    };
    let file = libc::S_IFREG | 0o644;
    let dir = libc::S_IFDIR | 0o755;
    let rig = Rig::new(policies::Policy::default());
    assert_eq!(rig.server.for_guest(huge(file)).blksize, 4096);
    assert_eq!(rig.server.for_guest(huge(dir)).blksize, 2 << 20);
    let d = TempDir::new().unwrap();
    let share = d.as_path().to_path_buf();
    let mut no_window = Rig::sharing(&share, d, policies::Policy::default(), false, 0);
    assert_eq!(no_window.server.for_guest(huge(file)).blksize, 2 << 20);
    // Both replies that carry attributes go through it.
    no_window.init();
    std::fs::write(share.join("f"), b"x").unwrap();
    let host = std::fs::metadata(share.join("f")).unwrap();
    let entry = no_window.lookup(ROOT_ID, "f").unwrap();
    assert_eq!(
        u64::from(entry.attr.blksize),
        std::os::unix::fs::MetadataExt::blksize(&host)
    );
    let mut rig = Rig::new(policies::Policy::default());
    rig.init();
    std::fs::write(rig.dir.as_path().join("f"), b"x").unwrap();
    let entry = rig.lookup(ROOT_ID, "f").unwrap();
    assert_eq!(entry.attr.blksize, 4096);
    let attr: abi::AttrOut = obj(&rig.ok(
        opcode::GETATTR,
        entry.nodeid,
        abi::GetattrIn::default().as_slice(),
    ));
    assert_eq!(attr.attr.blksize, 4096);
}
