//! One handler per FUSE opcode: each takes the parsed request (node,
//! caller, body, the guest's reply buffers) and answers it through the
//! passthrough filesystem or the DAX mapper. [`handler`] is the table;
//! an opcode it does not list gets ENOSYS. WRITE, whose data is read
//! straight from the guest's buffers, is handled by the server itself.

use std::ffi::CString;
use std::io;

use vm_memory::ByteValued;

use super::abi::{self, opcode};
use super::chain::Writer;
use super::server::{data, Body, Reply, Server};
use crate::passthrough::{errno_error, Caller, SetattrRequest};

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

/// The handler of `op`. Not listed: ACCESS (the guest checks permissions
/// itself: virtio-fs mounts with default_permissions), locks (they stay
/// local to the guest), and whatever this server does not implement.
pub(super) fn handler(op: u32) -> Option<Handler> {
    Some(match op {
        opcode::INIT => |s, q| s.init(&mut q.body),
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
        opcode::READ => |s, q| s.read(q.nodeid, &mut q.body, q.out),
        opcode::STATFS => statfs,
        opcode::RELEASE | opcode::RELEASEDIR => release,
        opcode::FLUSH => flush,
        opcode::FSYNC | opcode::FSYNCDIR => fsync,
        opcode::SETXATTR => setxattr,
        opcode::GETXATTR | opcode::LISTXATTR => getxattr,
        opcode::REMOVEXATTR => removexattr,
        opcode::OPENDIR => opendir,
        opcode::READDIR | opcode::READDIRPLUS => |s, q| {
            s.readdir(
                q.opcode == opcode::READDIRPLUS,
                q.nodeid,
                &mut q.body,
                q.out,
            )
        },
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
    Ok(Reply::None)
}

fn batch_forget(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let count = q.body.obj::<abi::BatchForgetIn>()?.count;
    for _ in 0..count {
        let one = q.body.obj::<abi::ForgetOne>()?;
        s.fs.forget(one.nodeid, one.nlookup);
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

fn statfs(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let st = s.fs.statfs(q.nodeid)?;
    Ok(data(abi::Kstatfs {
        blocks: st.f_blocks,
        bfree: st.f_bfree,
        bavail: st.f_bavail,
        files: st.f_files,
        ffree: st.f_ffree,
        bsize: st.f_bsize as u32,
        namelen: st.f_namemax as u32,
        frsize: st.f_frsize as u32,
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
    let align = s.policy.current().map_alignment_log2();
    s.dax.setup_mapping(&s.fs, q.nodeid, &a, align)?;
    s.policy.adaptive.mapped(q.nodeid, a.moffset, a.len);
    done(Ok(()))
}

fn removemapping(s: &Server, q: &mut Request) -> io::Result<Reply> {
    let count = q.body.obj::<abi::RemovemappingIn>()?.count;
    let mut ranges = Vec::new();
    // One past the cap, so the mapper sees the request was too long.
    for _ in 0..count.min(crate::dax::MAX_REMOVEMAPPING_ENTRIES + 1) {
        ranges.push(q.body.obj::<abi::RemovemappingOne>()?);
    }
    let result = s.dax.remove_mappings(count, &ranges);
    if ranges.len() == count as usize {
        for r in &ranges {
            s.policy.adaptive.unmapped(r.moffset, r.len);
        }
    }
    done(result)
}
