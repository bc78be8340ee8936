//! The FUSE wire format (Linux uapi `fuse.h`, protocol 7.38) for the
//! messages this daemon speaks. Every struct is `repr(C)` plain data, read
//! from and written to guest memory as bytes.

use vm_memory::ByteValued;

pub const KERNEL_VERSION: u32 = 7;
/// The minor version we answer with; INIT replies with min(ours, guest's).
pub const KERNEL_MINOR_VERSION: u32 = 38;
/// Oldest minor version served (7.27 is what virtio-fs drivers start at).
pub const MIN_KERNEL_MINOR_VERSION: u32 = 27;
pub const ROOT_ID: u64 = 1;

pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const SETUPMAPPING: u32 = 48;
    pub const REMOVEMAPPING: u32 = 49;
    pub const SYNCFS: u32 = 50;
}

/// INIT flags (`flags` holds bits 0..32, `flags2` bits 32..64).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const EXPORT_SUPPORT: u64 = 1 << 4;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DONT_MASK: u64 = 1 << 6;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const MAP_ALIGNMENT: u64 = 1 << 26;
    pub const SUBMOUNTS: u64 = 1 << 27;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const HAS_INODE_DAX: u64 = 1 << 33;
}

/// `fuse_attr.flags`: the directory is the root of another host mount; the
/// guest mounts it on its own superblock (with `FUSE_SUBMOUNTS`).
pub const ATTR_SUBMOUNT: u32 = 1 << 0;
/// `fuse_attr.flags`: the inode uses DAX (with `dax=inode`).
pub const ATTR_DAX: u32 = 1 << 1;

/// `fuse_open_out.open_flags`.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;

/// SETATTR `valid` bits.
pub mod setattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const CTIME: u32 = 1 << 10;
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

/// `fuse_open_in.open_flags` / `fuse_create_in.open_flags`: an `O_TRUNC`
/// must clear setuid/setgid as for an unprivileged caller.
pub const OPEN_KILL_SUIDGID: u32 = 1 << 0;
/// `fuse_write_in.write_flags`: the write must clear setuid/setgid/caps.
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;

/// SETUPMAPPING flags.
pub const SETUPMAPPING_FLAG_WRITE: u64 = 1 << 0;
pub const SETUPMAPPING_FLAG_READ: u64 = 1 << 1;

macro_rules! wire_structs {
    ($($(#[$m:meta])* pub struct $name:ident { $(pub $f:ident: $t:ty,)* })*) => {$(
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name { $(pub $f: $t,)* }
        // SAFETY: a repr(C) struct of integers (and arrays/structs of them)
        // laid out without padding; every bit pattern is a valid value.
        unsafe impl ByteValued for $name {}
    )*};
}

wire_structs! {
    pub struct InHeader { pub len: u32, pub opcode: u32, pub unique: u64, pub nodeid: u64, pub uid: u32, pub gid: u32, pub pid: u32, pub total_extlen: u16, pub padding: u16, }
    pub struct OutHeader { pub len: u32, pub error: i32, pub unique: u64, }
    pub struct Attr {
        pub ino: u64, pub size: u64, pub blocks: u64, pub atime: u64, pub mtime: u64, pub ctime: u64,
        pub atimensec: u32, pub mtimensec: u32, pub ctimensec: u32, pub mode: u32, pub nlink: u32,
        pub uid: u32, pub gid: u32, pub rdev: u32, pub blksize: u32, pub flags: u32,
    }
    pub struct EntryOut {
        pub nodeid: u64, pub generation: u64, pub entry_valid: u64, pub attr_valid: u64,
        pub entry_valid_nsec: u32, pub attr_valid_nsec: u32, pub attr: Attr,
    }
    pub struct AttrOut { pub attr_valid: u64, pub attr_valid_nsec: u32, pub dummy: u32, pub attr: Attr, }
    pub struct ForgetIn { pub nlookup: u64, }
    pub struct BatchForgetIn { pub count: u32, pub dummy: u32, }
    pub struct ForgetOne { pub nodeid: u64, pub nlookup: u64, }
    pub struct GetattrIn { pub getattr_flags: u32, pub dummy: u32, pub fh: u64, }
    pub struct SetattrIn {
        pub valid: u32, pub padding: u32, pub fh: u64, pub size: u64, pub lock_owner: u64,
        pub atime: u64, pub mtime: u64, pub ctime: u64, pub atimensec: u32, pub mtimensec: u32,
        pub ctimensec: u32, pub mode: u32, pub unused4: u32, pub uid: u32, pub gid: u32, pub unused5: u32,
    }
    pub struct MknodIn { pub mode: u32, pub rdev: u32, pub umask: u32, pub padding: u32, }
    pub struct MkdirIn { pub mode: u32, pub umask: u32, }
    pub struct RenameIn { pub newdir: u64, }
    pub struct Rename2In { pub newdir: u64, pub flags: u32, pub padding: u32, }
    pub struct LinkIn { pub oldnodeid: u64, }
    pub struct OpenIn { pub flags: u32, pub open_flags: u32, }
    pub struct CreateIn { pub flags: u32, pub mode: u32, pub umask: u32, pub open_flags: u32, }
    pub struct OpenOut { pub fh: u64, pub open_flags: u32, pub backing_id: i32, }
    pub struct ReleaseIn { pub fh: u64, pub flags: u32, pub release_flags: u32, pub lock_owner: u64, }
    pub struct FlushIn { pub fh: u64, pub unused: u32, pub padding: u32, pub lock_owner: u64, }
    pub struct ReadIn { pub fh: u64, pub offset: u64, pub size: u32, pub read_flags: u32, pub lock_owner: u64, pub flags: u32, pub padding: u32, }
    pub struct WriteIn { pub fh: u64, pub offset: u64, pub size: u32, pub write_flags: u32, pub lock_owner: u64, pub flags: u32, pub padding: u32, }
    pub struct WriteOut { pub size: u32, pub padding: u32, }
    pub struct Kstatfs {
        pub blocks: u64, pub bfree: u64, pub bavail: u64, pub files: u64, pub ffree: u64,
        pub bsize: u32, pub namelen: u32, pub frsize: u32, pub padding: u32, pub spare: [u32; 6],
    }
    pub struct FsyncIn { pub fh: u64, pub fsync_flags: u32, pub padding: u32, }
    pub struct SetxattrIn { pub size: u32, pub flags: u32, }
    pub struct GetxattrIn { pub size: u32, pub padding: u32, }
    pub struct GetxattrOut { pub size: u32, pub padding: u32, }
    pub struct AccessIn { pub mask: u32, pub padding: u32, }
    /// The pre-7.36 INIT request is the first 16 bytes of this.
    pub struct InitIn { pub major: u32, pub minor: u32, pub max_readahead: u32, pub flags: u32, pub flags2: u32, pub unused: [u32; 11], }
    pub struct InitOut {
        pub major: u32, pub minor: u32, pub max_readahead: u32, pub flags: u32,
        pub max_background: u16, pub congestion_threshold: u16, pub max_write: u32, pub time_gran: u32,
        pub max_pages: u16, pub map_alignment: u16, pub flags2: u32, pub max_stack_depth: u32, pub unused: [u32; 6],
    }
    pub struct InterruptIn { pub unique: u64, }
    pub struct FallocateIn { pub fh: u64, pub offset: u64, pub length: u64, pub mode: u32, pub padding: u32, }
    pub struct LseekIn { pub fh: u64, pub offset: u64, pub whence: u32, pub padding: u32, }
    pub struct LseekOut { pub offset: u64, }
    pub struct Dirent { pub ino: u64, pub off: u64, pub namelen: u32, pub typ: u32, }
    pub struct SetupmappingIn { pub fh: u64, pub foffset: u64, pub len: u64, pub flags: u64, pub moffset: u64, }
    pub struct RemovemappingIn { pub count: u32, }
    pub struct RemovemappingOne { pub moffset: u64, pub len: u64, }
}

/// Size of `fuse_init_in` before 7.36 added `flags2`.
pub const INIT_IN_COMPAT_SIZE: usize = 16;
/// Size of `fuse_init_out` before 7.23.
pub const INIT_OUT_COMPAT_SIZE: usize = 24;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    #[test]
    fn sizes_match_the_kernel_abi() {
        assert_eq!(size_of::<InHeader>(), 40);
        assert_eq!(size_of::<OutHeader>(), 16);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<EntryOut>(), 128);
        assert_eq!(size_of::<AttrOut>(), 104);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<WriteIn>(), 40);
        assert_eq!(size_of::<Kstatfs>(), 80);
        assert_eq!(size_of::<InitIn>(), 64);
        assert_eq!(size_of::<InitOut>(), 64);
        assert_eq!(size_of::<Dirent>(), 24);
        assert_eq!(size_of::<SetupmappingIn>(), 40);
        assert_eq!(size_of::<RemovemappingOne>(), 16);
        assert_eq!(size_of::<FallocateIn>(), 32);
        assert_eq!(size_of::<OpenOut>(), 16);
    }
}
