//! The host side of a virtio-blk device: a raw image (a file or a block
//! device), what it can do, and the I/O each checked request turns into.
//!
//! Reads and writes go straight between the file and guest memory with
//! `preadv`/`pwritev` (no bounce buffer); DISCARD punches a hole and
//! WRITE_ZEROES zeroes a range with `fallocate`, offered only when a probe
//! at open time shows the file system can.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use vm_memory::{Bytes, GuestMemoryBackend};

use super::request::{Action, ByteRange, Segment, ID_BYTES, SECTOR_SIZE};

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk path={path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("disk path={path}: {size} bytes, smaller than one 512-byte sector")]
    Empty { path: PathBuf, size: u64 },
    #[error("disk path={path}: {what}, not a regular file or block device")]
    Kind { path: PathBuf, what: &'static str },
    #[error("disk path={path}: the file was replaced while it was being opened")]
    Replaced { path: PathBuf },
    #[error("disk path={path}: locked by another process (a writable disk needs the image to itself; read-only disks share it)")]
    Locked { path: PathBuf },
    #[error("disk path={path}: the passed file {what}")]
    Passed { path: PathBuf, what: String },
}

/// An open raw image.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    /// Whole 512-byte sectors in the image.
    sectors: u64,
    readonly: bool,
    /// `FALLOC_FL_PUNCH_HOLE` works here (DISCARD, and zeroing with unmap).
    punch_hole: bool,
    /// `FALLOC_FL_ZERO_RANGE` works here (WRITE_ZEROES without unmap).
    zero_range: bool,
}

/// Whether `fallocate(mode)` is supported, tried past the end of the file
/// with KEEP_SIZE so nothing changes.
fn fallocate_works(file: &File, end: u64, mode: libc::c_int) -> bool {
    let Ok(offset) = libc::off_t::try_from(end) else {
        return false;
    };
    // SAFETY: fallocate on an fd we own, with integer arguments only.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            4096,
        ) == 0
    }
}

/// Clears `O_NONBLOCK` on `file`.
fn set_blocking(file: &File) -> std::io::Result<()> {
    // SAFETY: fcntl on an fd `file` owns; F_GETFL takes no argument.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; F_SETFL takes the flags as an int.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Takes an open-file-description lock on the whole image, as Cloud
/// Hypervisor does: shared for a read-only disk (many VMs may boot from one
/// image), exclusive for a writable one. It goes when the file is closed.
/// Returns false when another process holds a conflicting lock; a file
/// system without such locks is not an error.
fn lock(file: &File, readonly: bool, path: &Path) -> bool {
    // SAFETY: an all-zero flock is valid; the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = narrow::c_short_of(if readonly {
        libc::F_RDLCK
    } else {
        libc::F_WRLCK
    });
    fl.l_whence = const { narrow::c_short_of(libc::SEEK_SET) };
    // l_start = l_len = 0: the whole file, however it grows.
    // SAFETY: fcntl on our fd with a pointer to a live flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } == 0 {
        return true;
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => false,
        _ => {
            tracing::warn!("disk {}: not locked ({e})", path.display());
            true
        }
    }
}

/// Lets go of the open-file-description lock [`lock`] took; the file
/// stays open. Unlocking what holds no lock is no error (nor is a file
/// system without such locks).
fn unlock(file: &File) -> std::io::Result<()> {
    // SAFETY: an all-zero flock is valid; the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = const { narrow::c_short_of(libc::F_UNLCK) };
    fl.l_whence = const { narrow::c_short_of(libc::SEEK_SET) };
    // SAFETY: fcntl on our fd with a pointer to a live flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::ENOLCK | libc::EOPNOTSUPP) => Ok(()),
        _ => Err(e),
    }
}

impl DiskFile {
    /// Opens `path` read-only or read-write, with `O_DIRECT` when `direct`.
    ///
    /// Its type is checked before it is opened: opening a FIFO blocks until
    /// a writer comes (the VMM's control loop with it), and opening a
    /// character device can act on it. The open itself is non-blocking,
    /// and must find the file that was checked.
    pub fn open(path: &Path, readonly: bool, direct: bool) -> Result<Self, DiskError> {
        let named = std::fs::metadata(path).map_err(|source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Self::open_checked(path, &named, readonly, direct)
    }

    /// [`Self::open`] once `path` was found to be `named`.
    fn open_checked(
        path: &Path,
        named: &std::fs::Metadata,
        readonly: bool,
        direct: bool,
    ) -> Result<Self, DiskError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let err = |source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        };
        let kind_of = |m: &std::fs::Metadata| {
            let kind = m.file_type();
            if kind.is_file() || kind.is_block_device() {
                Ok(kind.is_file())
            } else {
                Err(DiskError::Kind {
                    path: path.to_path_buf(),
                    what: crate::file_type::describe(kind),
                })
            }
        };
        kind_of(named)?;
        let direct = if direct { libc::O_DIRECT } else { 0 };
        let file = OpenOptions::new()
            .read(true)
            .write(!readonly)
            // A FIFO put in its place since: the open returns, not waits.
            .custom_flags(libc::O_NONBLOCK | direct)
            .open(path)
            .map_err(err)?;
        let opened = file.metadata().map_err(err)?;
        if (opened.dev(), opened.ino()) != (named.dev(), named.ino()) {
            return Err(DiskError::Replaced {
                path: path.to_path_buf(),
            });
        }
        let regular = kind_of(&opened)?;
        Self::locked(file, path, regular, readonly)
    }

    /// The image another process opened and passed (a local migration's
    /// sender: its lock comes with the open file description), once it is
    /// checked to be what this disk would have opened: the file `path`
    /// names now (same device and inode), a regular file or block device,
    /// opened read-write exactly when the disk is writable and with
    /// `O_DIRECT` exactly when `direct`. The lock is taken again on it
    /// (a no-op on the description that holds it already).
    pub fn from_passed(
        path: &Path,
        file: File,
        readonly: bool,
        direct: bool,
    ) -> Result<Self, DiskError> {
        let regular = Self::check_passed(path, &file, readonly, direct)?;
        Self::locked(file, path, regular, readonly)
    }

    /// The checks of [`Self::from_passed`] alone; Ok(whether it is a
    /// regular file).
    pub fn check_passed(
        path: &Path,
        file: &File,
        readonly: bool,
        direct: bool,
    ) -> Result<bool, DiskError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let err = |source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        };
        let passed = |what: String| DiskError::Passed {
            path: path.to_path_buf(),
            what,
        };
        let named = std::fs::metadata(path).map_err(err)?;
        let held = file.metadata().map_err(err)?;
        let kind = held.file_type();
        if !kind.is_file() && !kind.is_block_device() {
            return Err(passed(format!(
                "is {}, not a regular file or block device",
                crate::file_type::describe(kind)
            )));
        }
        if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
            return Err(passed(format!(
                "is another file (device {}, inode {}) than the path names (device {}, inode {})",
                held.dev(),
                held.ino(),
                named.dev(),
                named.ino()
            )));
        }
        // SAFETY: fcntl on an fd `file` owns; F_GETFL takes no argument.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        let want = if readonly {
            libc::O_RDONLY
        } else {
            libc::O_RDWR
        };
        let access = flags & libc::O_ACCMODE;
        if access != want {
            let mode = |m| match m {
                libc::O_RDONLY => "read-only",
                libc::O_RDWR => "read-write",
                _ => "write-only",
            };
            return Err(passed(format!(
                "is open {}, the disk is configured {}",
                mode(access),
                if readonly { "read-only" } else { "writable" }
            )));
        }
        if (flags & libc::O_DIRECT != 0) != direct {
            return Err(passed(format!(
                "is open {} O_DIRECT, the disk is configured direct={}",
                if direct { "without" } else { "with" },
                if direct { "on" } else { "off" }
            )));
        }
        Ok(kind.is_file())
    }

    /// The checked open file, made blocking, locked and probed.
    fn locked(file: File, path: &Path, regular: bool, readonly: bool) -> Result<Self, DiskError> {
        let err = |source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        };
        let mut file = file;
        // I/O then blocks as it should (io_uring, for one, answers EAGAIN
        // on a non-blocking file instead of waiting).
        set_blocking(&file).map_err(err)?;
        if !lock(&file, readonly, path) {
            return Err(DiskError::Locked {
                path: path.to_path_buf(),
            });
        }
        // A block device's metadata says 0 bytes; seeking to its end does not.
        let size = file.seek(SeekFrom::End(0)).map_err(err)?;
        let sectors = size / SECTOR_SIZE;
        if sectors == 0 {
            return Err(DiskError::Empty {
                path: path.to_path_buf(),
                size,
            });
        }
        if size % SECTOR_SIZE != 0 {
            tracing::warn!(
                "disk {}: {size} bytes is not a multiple of 512; the last {} bytes are not used",
                path.display(),
                size % SECTOR_SIZE
            );
        }
        // Probing writes nothing, but needs a writable fd and a regular file
        // (past the end of a block device, fallocate fails anyway).
        let probe = |mode| !readonly && regular && fallocate_works(&file, size, mode);
        Ok(DiskFile {
            punch_hole: probe(libc::FALLOC_FL_PUNCH_HOLE),
            zero_range: probe(libc::FALLOC_FL_ZERO_RANGE),
            file,
            sectors,
            readonly,
        })
    }

    /// A migration's switch over the network: the receiving VMM opens and
    /// locks the image `path` names itself (shared storage), so this one
    /// lets go of its lock. The image stays open; its user must not do I/O
    /// until [`Self::relock`] (the VM is paused). The error names `path`.
    pub fn unlock(&self, path: &Path) -> Result<(), DiskError> {
        unlock(&self.file).map_err(|source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Takes the lock [`Self::unlock`] let go of again, as the open took
    /// it (shared when read-only, exclusive when writable);
    /// [`DiskError::Locked`] when another process holds a conflicting one
    /// meanwhile.
    pub fn relock(&self, path: &Path) -> Result<(), DiskError> {
        if lock(&self.file, self.readonly, path) {
            Ok(())
        } else {
            Err(DiskError::Locked {
                path: path.to_path_buf(),
            })
        }
    }

    /// The open image.
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    pub fn readonly(&self) -> bool {
        self.readonly
    }

    /// DISCARD can be offered.
    pub fn can_discard(&self) -> bool {
        !self.readonly && self.punch_hole
    }

    /// WRITE_ZEROES can be offered (by zeroing or by punching a hole, which
    /// reads back as zeroes too).
    pub fn can_write_zeroes(&self) -> bool {
        !self.readonly && (self.zero_range || self.punch_hole)
    }

    /// Performs `action`; returns the status byte and how many bytes were
    /// written into guest memory (for the used ring).
    pub fn execute<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        action: &Action,
        serial: &[u8; ID_BYTES],
    ) -> (u8, u32) {
        let result = match action {
            Action::Read { offset, data } => self
                .transfer(mem, data, *offset, false)
                .map(narrow::sat_u32),
            Action::Write { offset, data } => self.transfer(mem, data, *offset, true).map(|_| 0),
            Action::Flush => self.file.sync_data().map(|()| 0),
            Action::GetId { data } => write_id(mem, data, serial),
            Action::Discard(ranges) => self.fallocate_each(ranges, |_| libc::FALLOC_FL_PUNCH_HOLE),
            Action::WriteZeroes(ranges) => self.fallocate_each(ranges, |r| {
                if self.zero_range && !(r.unmap && self.punch_hole) {
                    libc::FALLOC_FL_ZERO_RANGE
                } else {
                    libc::FALLOC_FL_PUNCH_HOLE
                }
            }),
        };
        match result {
            Ok(n) => (const { narrow::u8_of(VIRTIO_BLK_S_OK as u64) }, n),
            Err(e) => {
                crate::warn_limited!("virtio-blk: I/O error: {e}");
                (const { narrow::u8_of(VIRTIO_BLK_S_IOERR as u64) }, 0)
            }
        }
    }

    fn fallocate_each(
        &self,
        ranges: &[ByteRange],
        mode: impl Fn(&ByteRange) -> libc::c_int,
    ) -> std::io::Result<u32> {
        for r in ranges.iter().filter(|r| r.len > 0) {
            let (Ok(offset), Ok(len)) = (
                libc::off_t::try_from(r.offset),
                libc::off_t::try_from(r.len),
            ) else {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            };
            // SAFETY: fallocate on our fd with integer arguments; the range
            // was checked to lie inside the disk.
            let rc = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    mode(r) | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(0)
    }

    /// Moves the bytes of `data` from (or, `write`, to) the disk at
    /// `offset`, all of them: a short transfer continues where it stopped.
    fn transfer<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        data: &[Segment],
        offset: u64,
        write: bool,
    ) -> std::io::Result<usize> {
        // Host addresses of every piece of the data; a segment that crosses
        // from one guest memory region into another comes as two pieces.
        let mut slices = Vec::with_capacity(data.len());
        for s in data {
            for slice in mem.get_slices(s.addr, narrow::usize_of(s.len)) {
                slices
                    .push(slice.map_err(|e| std::io::Error::other(format!("guest memory: {e}")))?);
            }
        }
        let guards: Vec<_> = slices
            .iter()
            .map(|s| (s.ptr_guard_mut(), s.len()))
            .collect();
        let mut iovecs: Vec<libc::iovec> = guards
            .iter()
            .map(|(g, len)| libc::iovec {
                iov_base: g.as_ptr().cast(),
                iov_len: *len,
            })
            .collect();
        let total: usize = iovecs.iter().map(|v| v.iov_len).sum();
        let (mut done, mut first) = (0usize, 0usize);
        while first < iovecs.len() {
            let pos = offset
                .checked_add(done as u64)
                .and_then(|p| libc::off_t::try_from(p).ok())
                .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
            // The kernel takes at most IOV_MAX (1024) vectors per call.
            let count = libc::c_int::try_from((iovecs.len() - first).min(1024)).unwrap_or(1024);
            let fd = self.file.as_raw_fd();
            let iov = iovecs[first..].as_ptr();
            // SAFETY: each iovec points into guest memory that `mem` keeps
            // mapped while the guards live, with the length get_slices
            // checked; the kernel reads or writes only within them.
            let n = unsafe {
                if write {
                    libc::pwritev(fd, iov, count, pos)
                } else {
                    libc::preadv(fd, iov, count, pos)
                }
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                // The file shrank under us (a read past its new end).
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            let mut n = n.unsigned_abs();
            done += n;
            while n > 0 && first < iovecs.len() {
                let v = &mut iovecs[first];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    first += 1;
                } else {
                    // SAFETY: advancing within the same iovec's buffer.
                    v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                    v.iov_len -= n;
                    n = 0;
                }
            }
        }
        debug_assert_eq!(done, total);
        Ok(done)
    }
}

/// GET_ID: the serial number, zero-padded to 20 bytes, into as much of
/// `data` as there is.
fn write_id<M: GuestMemoryBackend>(
    mem: &M,
    data: &[Segment],
    serial: &[u8; ID_BYTES],
) -> std::io::Result<u32> {
    let mut written = 0usize;
    for s in data {
        if written == ID_BYTES {
            break;
        }
        let n = (ID_BYTES - written).min(narrow::usize_of(s.len));
        mem.write_slice(&serial[written..written + n], s.addr)
            .map_err(|e| std::io::Error::other(format!("guest memory: {e}")))?;
        written += n;
    }
    Ok(narrow::sat_u32(written))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn image(bytes: usize) -> (vmm_sys_util::tempfile::TempFile, PathBuf) {
        let t = vmm_sys_util::tempfile::TempFile::new().unwrap();
        let data: Vec<u8> = (0..bytes).map(|i| (i / 512).to_le_bytes()[0]).collect();
        std::fs::write(t.as_path(), data).unwrap();
        let p = t.as_path().to_path_buf();
        (t, p)
    }

    #[test]
    fn reads_writes_zeroes_and_refuses_what_is_not_a_disk() {
        let (_t, path) = image(64 << 10);
        let disk = DiskFile::open(&path, false, false).unwrap();
        assert_eq!(disk.sectors(), 128);
        let mem: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let serial = [b's'; ID_BYTES];
        // Read sectors 2..4 into two pieces of guest memory.
        let read = Action::Read {
            offset: 2 * 512,
            data: vec![
                Segment {
                    addr: GuestAddress(0x1000),
                    len: 512,
                },
                Segment {
                    addr: GuestAddress(0x3000),
                    len: 512,
                },
            ],
        };
        assert_eq!(disk.execute(&mem, &read, &serial), (0, 1024));
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x1000)).unwrap(), 2);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x3000)).unwrap(), 3);
        // Write them back one sector further on.
        mem.write_slice(&[0xab; 512], GuestAddress(0x1000)).unwrap();
        let write = Action::Write {
            offset: 10 * 512,
            data: vec![Segment {
                addr: GuestAddress(0x1000),
                len: 512,
            }],
        };
        assert_eq!(disk.execute(&mem, &write, &serial), (0, 0));
        assert_eq!(disk.execute(&mem, &Action::Flush, &serial), (0, 0));
        let on_disk = std::fs::read(&path).unwrap();
        assert!(on_disk[10 * 512..11 * 512].iter().all(|&b| b == 0xab));
        // GET_ID into a short buffer: what fits.
        let id = Action::GetId {
            data: vec![Segment {
                addr: GuestAddress(0x5000),
                len: 8,
            }],
        };
        assert_eq!(disk.execute(&mem, &id, &serial), (0, 8));
        // Zeroing (or punching) sector 3 leaves zeroes, the size unchanged.
        if disk.can_write_zeroes() {
            let wz = Action::WriteZeroes(vec![ByteRange {
                offset: 3 * 512,
                len: 512,
                unmap: false,
            }]);
            assert_eq!(disk.execute(&mem, &wz, &serial), (0, 0));
            let on_disk = std::fs::read(&path).unwrap();
            assert_eq!(on_disk.len(), 64 << 10);
            assert!(on_disk[3 * 512..4 * 512].iter().all(|&b| b == 0));
            assert!(on_disk[4 * 512..5 * 512].iter().all(|&b| b == 4));
        }
        // Guest memory that is not there: IOERR, nothing written.
        let bad = Action::Read {
            offset: 0,
            data: vec![Segment {
                addr: GuestAddress(0xff00),
                len: 512,
            }],
        };
        assert_eq!(
            disk.execute(&mem, &bad, &serial).0,
            const { narrow::u8_of(VIRTIO_BLK_S_IOERR as u64) }
        );

        // The writable disk holds the image: no second user, not even a reader.
        let e = DiskFile::open(&path, true, false).unwrap_err().to_string();
        assert!(e.contains("locked by another process"), "{e}");
        assert!(matches!(
            DiskFile::open(&path, false, false),
            Err(DiskError::Locked { .. })
        ));
        drop(disk);
        // Read-only: nothing is offered that writes; readers share the image.
        let ro = DiskFile::open(&path, true, false).unwrap();
        let ro2 = DiskFile::open(&path, true, false).unwrap();
        assert!(ro2.readonly());
        let e = DiskFile::open(&path, false, false).unwrap_err().to_string();
        assert!(e.contains("needs the image to itself"), "{e}");
        drop((ro2, e));
        assert!(ro.readonly() && !ro.can_discard() && !ro.can_write_zeroes());
        // Not a disk.
        assert!(matches!(
            DiskFile::open(Path::new("/"), true, false),
            Err(DiskError::Kind { .. })
        ));
        let (_e, empty) = image(100);
        let e = DiskFile::open(&empty, true, false).unwrap_err().to_string();
        assert!(e.contains("smaller than one 512-byte sector"), "{e}");
        let e = DiskFile::open(Path::new("/nonexistent/disk"), true, false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("disk path=/nonexistent/disk:"), "{e}");
    }

    /// Opens `path` on a thread of its own; an open that blocks (a FIFO
    /// opened for reading waits for a writer) fails the test instead of
    /// hanging it.
    fn open_or_block(path: &Path, readonly: bool) -> Result<DiskFile, DiskError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = path.to_path_buf();
        std::thread::spawn(move || tx.send(DiskFile::open(&path, readonly, false)));
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("DiskFile::open blocked")
    }

    #[test]
    fn a_fifo_or_a_character_device_is_refused_by_type_without_blocking() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let fifo = dir.as_path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path for the call's duration.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for readonly in [true, false] {
            let e = open_or_block(&fifo, readonly).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "disk path={}: a FIFO, not a regular file or block device",
                    fifo.display()
                )
            );
        }
        let e = open_or_block(Path::new("/dev/null"), false)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "disk path=/dev/null: a character device, not a regular file or block device"
        );
    }

    #[test]
    fn a_file_replaced_between_the_check_and_the_open_is_refused() {
        let (_a, checked) = image(4096);
        let (_b, swapped) = image(4096);
        let named = std::fs::metadata(&checked).unwrap();
        let e = DiskFile::open_checked(&swapped, &named, true, false).unwrap_err();
        assert!(matches!(e, DiskError::Replaced { .. }), "{e}");
        assert!(DiskFile::open_checked(&checked, &named, true, false).is_ok());
    }

    /// The open image another process passed is taken, its lock with it
    /// (the image is never unlocked on the way; a third open is refused
    /// throughout), once checked to be the file the path names, opened as
    /// configured; anything else is refused saying what differs.
    #[test]
    fn a_passed_image_is_taken_with_its_lock_when_it_is_the_configured_one() {
        let (_t, path) = image(4096);
        let (_o, other) = image(4096);
        let sender = DiskFile::open(&path, false, false).unwrap();
        let passed = sender.file().try_clone().unwrap();
        let receiver = DiskFile::from_passed(&path, passed, false, false).expect("taken");
        assert_eq!(receiver.sectors(), 8);
        drop(sender);
        assert!(matches!(
            DiskFile::open(&path, true, false),
            Err(DiskError::Locked { .. })
        ));
        drop(receiver);
        DiskFile::open(&path, false, false).expect("free once both are gone");

        let refused = |file: File, readonly, direct| {
            DiskFile::from_passed(&path, file, readonly, direct)
                .unwrap_err()
                .to_string()
        };
        let rw = |p: &Path| OpenOptions::new().read(true).write(true).open(p).unwrap();
        let e = refused(rw(&other), false, false);
        assert!(e.contains("the passed file is another file"), "{e}");
        let e = refused(File::open(&path).unwrap(), false, false);
        assert!(
            e.ends_with("the passed file is open read-only, the disk is configured writable"),
            "{e}"
        );
        let e = refused(rw(&path), true, false);
        assert!(
            e.ends_with("is open read-write, the disk is configured read-only"),
            "{e}"
        );
        let e = refused(rw(&path), false, true);
        assert!(
            e.ends_with("is open without O_DIRECT, the disk is configured direct=on"),
            "{e}"
        );
        let e = refused(File::open("/").unwrap(), true, false);
        assert!(e.contains("is a directory, not a regular file"), "{e}");
    }
}
