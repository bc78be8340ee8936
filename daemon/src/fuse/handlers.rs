//! The request layer: one FUSE request in, one reply out.
//! [`Server::handle`] parses the request from its descriptor chain, finds
//! its handler in [`handler`]'s table (an opcode it does not list gets
//! ENOSYS) and writes the reply. Each handler takes the parsed request
//! (node, caller, body, the guest's reply buffers) and answers it through
//! the passthrough filesystem or the DAX mapper; WRITE, whose data is read
//! straight from the guest's buffers, is parsed before the table. A request
//! that cannot be parsed or served gets an errno; nothing here panics on
//! guest input.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::sync::atomic::Ordering::Relaxed;

use vm_memory::ByteValued;

use super::abi::{self, init, opcode, InHeader, OutHeader};
use super::chain::{Reader, Writer};
use super::server::{data, Body, Reply, Server};
use crate::dax::window_io;
use crate::passthrough::{errno_error, CachePolicy, Caller, DirEntry, SetattrRequest};

/// Largest request body other than WRITE data (names, xattr values).
const MAX_BODY: usize = 128 * 1024;
/// Largest WRITE the guest is told it may send.
pub(super) const MAX_WRITE: u32 = 1 << 20;
/// MAX_WRITE in 4 KiB pages, as INIT's `max_pages`.
#[expect(clippy::cast_possible_truncation, reason = "MAX_WRITE / 4096 is 256")]
const MAX_PAGES: u16 = (MAX_WRITE / 4096) as u16;

/// A request after its header: what every handler gets.
pub(super) struct Request<'r, 'm> {
    pub opcode: u32,
    pub nodeid: u64,
    pub caller: Caller,
    pub body: Body,
    /// The guest's reply buffers, for handlers that write there directly.
    pub out: &'r mut Writer<'m>,
}

pub(super) type Handler = fn(&Server, &mut Request<'_, '_>) -> io::Result<Reply>;

impl Server {
    /// Serves one request; returns the bytes written to the guest's buffers.
    pub fn handle(&self, r: Reader, w: Writer) -> usize {
        self.handle_with_opcode(r, w).0
    }

    /// [`Self::handle`], and the request's opcode (None without a header),
    /// for [`Self::served`].
    pub fn handle_with_opcode(&self, mut r: Reader, w: Writer) -> (usize, Option<u32>) {
        self.stats.requests.fetch_add(1, Relaxed);
        let Ok(hdr) = r.read_obj::<InHeader>() else {
            crate::warn_limited!("request too short for a FUSE header; dropped");
            return (0, None);
        };
        (self.handle_parsed(&hdr, r, w), Some(hdr.opcode))
    }

    /// A request with opcode `opcode`, popped at `popped`, is on the used
    /// ring and the guest signalled: a SETUPMAPPING's whole time in the
    /// daemon is counted ([`crate::dax::MapStage::Served`]).
    pub fn served(&self, opcode: Option<u32>, popped: std::time::Instant) {
        if opcode == Some(opcode::SETUPMAPPING) {
            self.dax
                .stats
                .record_stage(crate::dax::MapStage::Served, popped.elapsed());
        }
    }

    fn handle_parsed(&self, hdr: &InHeader, mut r: Reader, mut w: Writer) -> usize {
        let hdr = *hdr;
        let result = dispatch(self, &hdr, &mut r, &mut w);
        let (error, payload) = match result {
            Ok(Reply::None) => return 0,
            Ok(Reply::Data(d)) => (0, Some(d)),
            Ok(Reply::Direct(n)) => {
                return match write_header(&mut w, hdr.unique, 0, n) {
                    Ok(()) => size_of::<OutHeader>() + n,
                    Err(_) => 0,
                };
            }
            Err(e) => {
                self.stats.errors.fetch_add(1, Relaxed);
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                tracing::debug!(
                    request = hdr.unique,
                    "opcode {} nodeid {}: errno {errno}",
                    hdr.opcode,
                    hdr.nodeid
                );
                (errno, None)
            }
        };
        let len = payload.as_ref().map_or(0, Vec::len);
        if len + size_of::<OutHeader>() > w.available() {
            crate::warn_limited!(
                "opcode {}: reply buffer too small ({} bytes)",
                hdr.opcode,
                w.available()
            );
            let _ = write_header(&mut w, hdr.unique, libc::ERANGE, 0);
            return if w.available() >= size_of::<OutHeader>() {
                size_of::<OutHeader>()
            } else {
                0
            };
        }
        if write_header(&mut w, hdr.unique, error, len).is_err() {
            return 0;
        }
        if let Some(d) = payload {
            if w.write_at(size_of::<OutHeader>(), &d).is_err() {
                return 0;
            }
        }
        size_of::<OutHeader>() + len
    }
}

fn write_header(w: &mut Writer, unique: u64, errno: i32, payload: usize) -> io::Result<()> {
    let len =
        u32::try_from(size_of::<OutHeader>() + payload).map_err(|_| errno_error(libc::EINVAL))?;
    w.write_at(
        0,
        OutHeader {
            len,
            error: -errno,
            unique,
        }
        .as_slice(),
    )
}

fn dispatch(s: &Server, h: &InHeader, r: &mut Reader, w: &mut Writer) -> io::Result<Reply> {
    let body_len = (h.len as usize)
        .checked_sub(size_of::<InHeader>())
        .ok_or_else(|| errno_error(libc::EINVAL))?;
    if body_len > r.available() {
        return Err(errno_error(libc::EINVAL));
    }
    if h.opcode == opcode::WRITE {
        return write(s, h, r, body_len);
    }
    if body_len > MAX_BODY {
        return Err(errno_error(libc::E2BIG));
    }
    let b = Body::new(r.read_bytes(body_len)?);
    let Some(handler) = handler(h.opcode) else {
        return Err(errno_error(libc::ENOSYS));
    };
    handler(
        s,
        &mut Request {
            opcode: h.opcode,
            nodeid: h.nodeid,
            caller: Caller {
                uid: h.uid,
                gid: h.gid,
            },
            body: b,
            out: w,
        },
    )
}

/// WRITE: its data is taken from the guest's buffers where they are.
fn write(s: &Server, h: &InHeader, r: &mut Reader, body_len: usize) -> io::Result<Reply> {
    let a = r.read_obj::<abi::WriteIn>()?;
    let size = a.size as usize;
    if size > body_len.saturating_sub(size_of::<abi::WriteIn>()) || a.size > MAX_WRITE {
        return Err(errno_error(libc::EINVAL));
    }
    let bufs = r.bufs(size, s.dax.location())?;
    let targets = window_io::targets(&s.fs, &s.dax, bufs, false)?;
    let kill = a.write_flags & abi::WRITE_KILL_SUIDGID != 0;
    let n = s.fs.write_from(h.nodeid, a.fh, a.offset, &targets, kill)?;
    s.stats.fuse_writes.fetch_add(1, Relaxed);
    s.stats.fuse_write_bytes.fetch_add(n as u64, Relaxed);
    Ok(data(abi::WriteOut {
        // At most the u32 size the guest asked for.
        size: u32::try_from(n).map_err(|_| errno_error(libc::EIO))?,
        padding: 0,
    }))
}

/// The handler of `op`. Not listed: ACCESS (the guest checks permissions
/// itself: virtio-fs mounts with default_permissions), locks (they stay
/// local to the guest), and whatever this server does not implement.
pub(super) fn handler(op: u32) -> Option<Handler> {
    Some(match op {
        opcode::INIT => init,
        opcode::DESTROY => destroy,
        opcode::LOOKUP => lookup,
        opcode::FORGET => forget,
        opcode::BATCH_FORGET => batch_forget,
        opcode::INTERRUPT => |_, _| Ok(Reply::None),
        opcode::GETATTR => |s, q| Ok(data(s.attr_out(s.fs.getattr(q.nodeid)?))),
        opcode::SETATTR => setattr,
        opcode::READLINK => |s, q| Ok(Reply::Data(s.fs.readlink(q.nodeid)?)),
        opcode::SYMLINK => symlink,
        opcode::MKNOD => mknod,
        opcode::MKDIR => mkdir,
        opcode::UNLINK => |s, q| unlink(s, q, 0),
        opcode::RMDIR => |s, q| unlink(s, q, libc::AT_REMOVEDIR),
        opcode::RENAME | opcode::RENAME2 => rename,
        opcode::LINK => link,
        opcode::OPEN => open,
        opcode::CREATE => create,
        opcode::READ => read,
        opcode::STATFS => statfs,
        opcode::RELEASE | opcode::RELEASEDIR => release,
        opcode::FLUSH => flush,
        opcode::FSYNC | opcode::FSYNCDIR => fsync,
        opcode::SETXATTR => setxattr,
        opcode::GETXATTR | opcode::LISTXATTR => getxattr,
        opcode::REMOVEXATTR => removexattr,
        opcode::OPENDIR => opendir,
        opcode::READDIR | opcode::READDIRPLUS => readdir,
        opcode::FALLOCATE => fallocate,
        opcode::LSEEK => lseek,
        opcode::SYNCFS => |s, _| done(s.fs.syncfs()),
        opcode::SETUPMAPPING => setupmapping,
        opcode::REMOVEMAPPING => removemapping,
        _ => return None,
    })
}

/// An empty success reply once `r` succeeded.
fn done(r: io::Result<()>) -> io::Result<Reply> {
    r.map(|()| Reply::Data(Vec::new()))
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| errno_error(libc::EINVAL))
}

fn destroy(s: &Server, _q: &mut Request) -> io::Result<Reply> {
    s.fs.reset();
    s.dax.forget_mappings();
    Ok(Reply::Data(Vec::new()))
}

fn lookup(s: &Server, q: &mut Request) -> io::Result<Reply> {
    match s.fs.lookup(q.nodeid, &q.body.name()?) {
        Ok(found) => Ok(data(s.entry(found))),
        // A negative entry (nodeid 0) lets the guest cache "not there" for
        // the entry timeout instead of asking again.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !s.fs.cache.timeout().is_zero() => {
            let t = s.fs.cache.timeout();
            Ok(data(abi::EntryOut {
                entry_valid: t.as_secs(),
                entry_valid_nsec: t.subsec_nanos(),
                ..Default::default()
            }))
        }
        Err(e) => Err(e),
    }
}

fn forget(s: &Server, q: &mut Request) -> io::Result<Reply> {
    s.fs.forget(q.nodeid, q.body.obj::<abi::ForgetIn>()?.nlookup);
    s.dax.node_forgotten(q.nodeid);
    Ok(Reply::None)
}

fn batch_forget(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let count = q.body.obj::<abi::BatchForgetIn>()?.count;
    for _ in 0..count {
        let one = q.body.obj::<abi::ForgetOne>()?;
        s.fs.forget(one.nodeid, one.nlookup);
        s.dax.node_forgotten(one.nodeid);
    }
    Ok(Reply::None)
}

fn setattr(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::SetattrIn>()?;
    let req = SetattrRequest {
        valid: a.valid,
        fh: a.fh,
        size: a.size,
        atime: (a.atime, a.atimensec),
        mtime: (a.mtime, a.mtimensec),
        mode: a.mode,
        uid: a.uid,
        gid: a.gid,
    };
    Ok(data(s.attr_out(s.fs.setattr(q.nodeid, &req)?)))
}

fn symlink(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let name = q.body.name()?;
    let target = c_string(q.body.cstr()?)?;
    Ok(data(
        s.entry(s.fs.symlink(q.nodeid, &name, &target, q.caller)?),
    ))
}

fn mknod(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::MknodIn>()?;
    let name = q.body.name()?;
    Ok(data(s.entry(
        s.fs.mknod(q.nodeid, &name, a.mode, a.rdev, q.caller)?,
    )))
}

fn mkdir(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::MkdirIn>()?;
    let name = q.body.name()?;
    Ok(data(s.entry(s.fs.mkdir(
        q.nodeid,
        &name,
        a.mode | libc::S_IFDIR,
        q.caller,
    )?)))
}

fn unlink(s: &Server, q: &mut Request, flags: i32) -> io::Result<Reply> {
    done(s.fs.unlink(q.nodeid, &q.body.name()?, flags))
}

fn rename(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let (newdir, flags) = if q.opcode == opcode::RENAME {
        (q.body.obj::<abi::RenameIn>()?.newdir, 0)
    } else {
        let a = q.body.obj::<abi::Rename2In>()?;
        (a.newdir, a.flags)
    };
    let old = q.body.name()?;
    let new = q.body.name()?;
    done(s.fs.rename(q.nodeid, &old, newdir, &new, flags))
}

fn link(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let old = q.body.obj::<abi::LinkIn>()?.oldnodeid;
    Ok(data(s.entry(s.fs.link(old, q.nodeid, &q.body.name()?)?)))
}

fn open(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::OpenIn>()?;
    let kill = a.open_flags & abi::OPEN_KILL_SUIDGID != 0;
    // ATOMIC_O_TRUNC is not negotiated, so the guest truncates with SETATTR
    // after its own checks; an O_TRUNC here anyway is not acted on.
    let flags = a.flags & !(libc::O_TRUNC as u32);
    Ok(data(abi::OpenOut {
        fh: s.fs.open(q.nodeid, flags, kill)?,
        open_flags: s.open_flags(),
        backing_id: 0,
    }))
}

fn create(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::CreateIn>()?;
    let kill = a.open_flags & abi::OPEN_KILL_SUIDGID != 0;
    let name = q.body.name()?;
    let (entry, fh) =
        s.fs.create(q.nodeid, &name, a.mode, a.flags, kill, q.caller)?;
    let mut out = s.entry(entry).as_slice().to_vec();
    let open = abi::OpenOut {
        fh,
        open_flags: s.open_flags(),
        backing_id: 0,
    };
    out.extend_from_slice(open.as_slice());
    Ok(Reply::Data(out))
}

/// INIT: agrees on the protocol version and flags, and starts a session:
/// what the last guest left (inodes, handles, mappings) is dropped, and the
/// DAX window's alignment is fixed for the session at what is announced.
fn init(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q
        .body
        .obj_at_least::<abi::InitIn>(abi::INIT_IN_COMPAT_SIZE)?;
    if a.major < abi::KERNEL_VERSION
        || (a.major == abi::KERNEL_VERSION && a.minor < abi::MIN_KERNEL_MINOR_VERSION)
    {
        crate::error_limited!(
            "guest FUSE {}.{} is too old (need 7.{})",
            a.major,
            a.minor,
            abi::MIN_KERNEL_MINOR_VERSION
        );
        return Err(errno_error(libc::EPROTO));
    }
    if a.major > abi::KERNEL_VERSION {
        // The guest retries with our major version.
        return Ok(data(abi::InitOut {
            major: abi::KERNEL_VERSION,
            ..Default::default()
        }));
    }
    let enabled = offered_flags(&a) & wanted_flags(s);
    let map_alignment_log2 = s.policy.current().map_alignment_log2();
    s.fs.reset();
    s.dax.begin_session(map_alignment_log2);
    s.fs.set_submounts(enabled & init::SUBMOUNTS != 0);
    s.fs.set_killpriv_v2(enabled & init::HANDLE_KILLPRIV_V2 != 0);
    let minor = a.minor.min(abi::KERNEL_MINOR_VERSION);
    crate::info_limited!(
        "FUSE INIT: guest 7.{}, serving 7.{minor}, flags {enabled:#x}",
        a.minor
    );
    let (flags, flags2) = split_flags(enabled);
    let out = abi::InitOut {
        major: abi::KERNEL_VERSION,
        minor,
        max_readahead: a.max_readahead,
        flags,
        max_background: 64,
        congestion_threshold: 48,
        max_write: MAX_WRITE,
        time_gran: 1,
        max_pages: MAX_PAGES,
        map_alignment: if enabled & init::MAP_ALIGNMENT != 0 {
            map_alignment_log2
        } else {
            0
        },
        flags2,
        ..Default::default()
    };
    let mut bytes = out.as_slice().to_vec();
    if a.minor < 23 {
        bytes.truncate(abi::INIT_OUT_COMPAT_SIZE);
    }
    Ok(Reply::Data(bytes))
}

/// The INIT flags the guest offers: `flags2` counts only with INIT_EXT.
fn offered_flags(a: &abi::InitIn) -> u64 {
    u64::from(a.flags)
        | if u64::from(a.flags) & init::INIT_EXT != 0 {
            u64::from(a.flags2) << 32
        } else {
            0
        }
}

/// INIT's 64 flag bits as the wire's `flags` (low half) and `flags2`.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the low half on purpose; the high half is `flags2`"
)]
fn split_flags(enabled: u64) -> (u32, u32) {
    (enabled as u32, (enabled >> 32) as u32)
}

/// The INIT flags this server would enable, by its options.
fn wanted_flags(s: &Server) -> u64 {
    // Not ATOMIC_O_TRUNC: with it the guest sends O_TRUNC inside OPEN,
    // and the host file is truncated before the guest's VFS checks that
    // nobody executes it (ETXTBSY) — a running program's text was cut
    // under it. Without it the guest checks first and truncates by SETATTR.
    let mut wanted = init::ASYNC_READ
        | init::BIG_WRITES
        | init::PARALLEL_DIROPS
        | init::MAX_PAGES
        | init::INIT_EXT;
    if s.fs.readdirplus {
        wanted |= init::DO_READDIRPLUS | init::READDIRPLUS_AUTO;
    }
    if s.fs.offer_killpriv_v2 {
        wanted |= init::HANDLE_KILLPRIV_V2;
    }
    match s.fs.cache {
        CachePolicy::Auto => wanted |= init::AUTO_INVAL_DATA,
        CachePolicy::Always => wanted |= init::CACHE_SYMLINKS,
        CachePolicy::Never | CachePolicy::Metadata => {}
    }
    if s.dax.available() {
        wanted |= init::MAP_ALIGNMENT | init::HAS_INODE_DAX;
    }
    if s.fs.announce_submounts {
        wanted |= init::SUBMOUNTS;
    }
    wanted
}

/// READ through the queue: straight into the guest's reply buffers (or,
/// for buffers in the DAX window, into the files mapped there).
fn read(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::ReadIn>()?;
    let room = q
        .out
        .available()
        .checked_sub(size_of::<OutHeader>())
        .ok_or_else(|| errno_error(libc::EINVAL))?;
    let size = (a.size as usize).min(room);
    let bufs = q.out.bufs(size_of::<OutHeader>(), size, s.dax.location())?;
    let targets = window_io::targets(&s.fs, &s.dax, bufs, true)?;
    let n = s.fs.read_into(q.nodeid, a.fh, a.offset, &targets)?;
    // `preadv` wrote the first `n` bytes behind vm-memory's back.
    q.out.mark_written(size_of::<OutHeader>(), n)?;
    s.stats.fuse_reads.fetch_add(1, Relaxed);
    s.stats.fuse_read_bytes.fetch_add(n as u64, Relaxed);
    s.policy.adaptive.fuse_read(q.nodeid, a.offset, n as u64);
    Ok(Reply::Direct(n))
}

fn pad8(n: usize) -> usize {
    n.next_multiple_of(8)
}

/// READDIR and READDIRPLUS: as many entries as fit the guest's buffer.
fn readdir(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let plus = q.opcode == opcode::READDIRPLUS;
    let a = q.body.obj::<abi::ReadIn>()?;
    let room = q
        .out
        .available()
        .saturating_sub(size_of::<OutHeader>())
        .min(a.size as usize);
    let fixed = size_of::<abi::Dirent>() + if plus { size_of::<abi::EntryOut>() } else { 0 };
    let mut used = 0usize;
    let mut fits = |e: &DirEntry| {
        let need = pad8(fixed + e.name.len());
        if used + need > room {
            return false;
        }
        used += need;
        true
    };
    let mut out = Vec::new();
    let push = |out: &mut Vec<u8>, e: &DirEntry| {
        out.extend_from_slice(dirent(e).as_slice());
        out.extend_from_slice(&e.name);
        out.resize(pad8(out.len()), 0);
    };
    if plus {
        for p in s.fs.readdirplus(q.nodeid, a.fh, a.offset, &mut fits)? {
            let entry = p.lookup.map(|l| s.entry(l)).unwrap_or_default();
            out.extend_from_slice(entry.as_slice());
            push(&mut out, &p.entry);
        }
    } else {
        for e in s.fs.readdir(q.nodeid, a.fh, a.offset, &mut fits)? {
            push(&mut out, &e);
        }
    }
    Ok(Reply::Data(out))
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "a name from getdents64 is at most NAME_MAX (255) bytes"
)]
fn dirent(e: &DirEntry) -> abi::Dirent {
    abi::Dirent {
        ino: e.ino,
        off: e.next_offset,
        namelen: e.name.len() as u32,
        typ: u32::from(e.kind),
    }
}

fn statfs(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let st = s.fs.statfs(q.nodeid)?;
    // EOVERFLOW, as statfs(2) answers for a value its struct cannot hold.
    let u32_of = |v: u64| u32::try_from(v).map_err(|_| errno_error(libc::EOVERFLOW));
    Ok(data(abi::Kstatfs {
        blocks: st.f_blocks,
        bfree: st.f_bfree,
        bavail: st.f_bavail,
        files: st.f_files,
        ffree: st.f_ffree,
        bsize: u32_of(st.f_bsize)?,
        namelen: u32_of(st.f_namemax)?,
        frsize: u32_of(st.f_frsize)?,
        ..Default::default()
    }))
}

fn release(s: &Server, q: &mut Request) -> io::Result<Reply> {
    done(s.fs.release(q.body.obj::<abi::ReleaseIn>()?.fh, q.nodeid))
}

fn flush(s: &Server, q: &mut Request) -> io::Result<Reply> {
    done(s.fs.flush(q.nodeid, q.body.obj::<abi::FlushIn>()?.fh))
}

fn fsync(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::FsyncIn>()?;
    done(s.fs.fsync(q.nodeid, a.fh, a.fsync_flags & 1 != 0))
}

fn setxattr(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::SetxattrIn>()?;
    let name = c_string(q.body.cstr()?)?;
    let value = q.body.bytes(a.size as usize)?;
    done(s.fs.setxattr(q.nodeid, &name, value, a.flags))
}

/// GETXATTR and LISTXATTR: with size 0 the guest asks only how big.
fn getxattr(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let size = q.body.obj::<abi::GetxattrIn>()?.size;
    let (len, value) = if q.opcode == opcode::GETXATTR {
        let name = c_string(q.body.cstr()?)?;
        s.fs.getxattr(q.nodeid, &name, size)?
    } else {
        s.fs.listxattr(q.nodeid, size)?
    };
    Ok(if size == 0 {
        data(abi::GetxattrOut {
            size: len,
            padding: 0,
        })
    } else {
        Reply::Data(value)
    })
}

fn removexattr(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let name = c_string(q.body.cstr()?)?;
    done(s.fs.removexattr(q.nodeid, &name))
}

fn opendir(s: &Server, q: &mut Request) -> io::Result<Reply> {
    Ok(data(abi::OpenOut {
        fh: s.fs.opendir(q.nodeid)?,
        open_flags: 0,
        backing_id: 0,
    }))
}

fn fallocate(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::FallocateIn>()?;
    done(s.fs.fallocate(q.nodeid, a.fh, a.mode, a.offset, a.length))
}

fn lseek(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::LseekIn>()?;
    Ok(data(abi::LseekOut {
        offset: s.fs.lseek(q.nodeid, a.fh, a.offset, a.whence)?,
    }))
}

fn setupmapping(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let a = q.body.obj::<abi::SetupmappingIn>()?;
    done(s.dax.setup_mapping(&s.fs, q.nodeid, &a))
}

fn removemapping(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let count = q.body.obj::<abi::RemovemappingIn>()?.count;
    let mut ranges = Vec::new();
    // One past the cap, so the mapper sees the request was too long.
    for _ in 0..count.min(crate::dax::MAX_REMOVEMAPPING_ENTRIES + 1) {
        ranges.push(q.body.obj::<abi::RemovemappingOne>()?);
    }
    done(s.dax.remove_mappings(count, &ranges))
}
