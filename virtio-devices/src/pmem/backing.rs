//! The file behind a virtio-pmem device and its mapping in the VMM.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The guest maps pmem with 2 MiB pages; the range must be a whole number of them.
pub const PMEM_ALIGNMENT: u64 = 2 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PmemError {
    #[error("--pmem file={0}: {1}")]
    Open(PathBuf, std::io::Error),
    #[error("--pmem file={0}: size is required when file= is a directory")]
    DirectoryWithoutSize(PathBuf),
    #[error("--pmem size={0}: must be a non-zero multiple of 2 MiB")]
    Size(u64),
    #[error("--pmem file={path}: file size {len} is not a non-zero multiple of 2 MiB; give size=")]
    FileSize { path: PathBuf, len: u64 },
    #[error("--pmem file={path}: the file is {len} bytes, shorter than size={size}, and discard_writes=on opens it read-only")]
    ShortReadOnly { path: PathBuf, len: u64, size: u64 },
    #[error("--pmem file={0}: extending to size={1}: {2}")]
    Extend(PathBuf, u64, std::io::Error),
    #[error("--pmem file={0}: mapping {1} bytes: {2}")]
    Map(PathBuf, u64, std::io::Error),
}

/// An open backing file mapped into the VMM's address space, unmapped on drop.
#[derive(Debug)]
pub struct PmemBacking {
    file: File,
    size: u64,
    host_addr: u64,
    /// `file=` as given (a directory when the file is an unnamed temporary one).
    path: PathBuf,
    discard_writes: bool,
    /// The file is an unnamed temporary file in the directory `path`.
    unnamed: bool,
}

impl PmemBacking {
    /// Opens (or, for a directory, creates an unnamed temporary file in) `path`,
    /// extends it to `size` if shorter, and maps it: shared, or private when
    /// `discard_writes` so guest writes never reach the file.
    pub fn open(path: &Path, size: Option<u64>, discard_writes: bool) -> Result<Self, PmemError> {
        if let Some(size) = size {
            if size == 0 || size % PMEM_ALIGNMENT != 0 {
                return Err(PmemError::Size(size));
            }
        }
        let is_dir = path.is_dir();
        let file = if is_dir {
            if size.is_none() {
                return Err(PmemError::DirectoryWithoutSize(path.into()));
            }
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_TMPFILE)
                .open(path)
        } else {
            OpenOptions::new()
                .read(true)
                .write(!discard_writes)
                .open(path)
        }
        .map_err(|e| PmemError::Open(path.into(), e))?;
        let len = file
            .metadata()
            .map_err(|e| PmemError::Open(path.into(), e))?
            .len();
        let size = match size {
            Some(size) => size,
            None if len != 0 && len % PMEM_ALIGNMENT == 0 => len,
            None => {
                return Err(PmemError::FileSize {
                    path: path.into(),
                    len,
                })
            }
        };
        if len < size {
            if discard_writes && !is_dir {
                return Err(PmemError::ShortReadOnly {
                    path: path.into(),
                    len,
                    size,
                });
            }
            file.set_len(size)
                .map_err(|e| PmemError::Extend(path.into(), size, e))?;
        }
        let (prot, flags) = if discard_writes {
            (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
            )
        } else {
            (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
            )
        };
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED) of an fd we
        // own; it aliases no Rust object. The result is checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                narrow::usize_of(size),
                prot,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(PmemError::Map(
                path.into(),
                size,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(PmemBacking {
            file,
            size,
            host_addr: addr as u64,
            path: path.into(),
            discard_writes,
            unnamed: is_dir,
        })
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// `file=` as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Guest writes stay in the VMM's private copy (`discard_writes=on`).
    pub fn discard_writes(&self) -> bool {
        self.discard_writes
    }

    /// The file is an unnamed temporary file (`file=` named a directory):
    /// nothing can open it again.
    pub fn unnamed(&self) -> bool {
        self.unnamed
    }

    /// Start of the mapping in the VMM, to register with KVM.
    pub fn host_addr(&self) -> u64 {
        self.host_addr
    }
}

impl Drop for PmemBacking {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `open` created, once.
        unsafe {
            libc::munmap(
                self.host_addr as *mut libc::c_void,
                narrow::usize_of(self.size),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pmem-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn sizes_are_checked_and_named() {
        let dir = scratch("sizes");
        let f = dir.join("f");
        std::fs::write(&f, vec![0u8; 3 * usize::try_from(MIB).unwrap()]).unwrap();
        let e = PmemBacking::open(&f, Some(3 * MIB), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("size=3145728") && e.contains("2 MiB"), "{e}");
        let e = PmemBacking::open(&f, None, false).unwrap_err().to_string();
        assert!(e.contains("file size 3145728"), "{e}");
        let e = PmemBacking::open(&dir, None, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("size is required"), "{e}");
        let e = PmemBacking::open(&dir.join("missing"), Some(2 * MIB), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn short_file_is_extended_and_writes_reach_it() {
        let dir = scratch("extend");
        let f = dir.join("f");
        std::fs::write(&f, b"x").unwrap();
        let b = PmemBacking::open(&f, Some(2 * MIB), false).unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 2 * MIB);
        // SAFETY: the mapping is 2 MiB long and writable.
        unsafe { *(b.host_addr() as *mut u8).add(4096) = 0x5a };
        b.file().sync_all().unwrap();
        drop(b);
        assert_eq!(std::fs::read(&f).unwrap()[4096], 0x5a);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn discard_writes_leaves_the_file_alone() {
        let dir = scratch("discard");
        let f = dir.join("f");
        std::fs::write(&f, vec![7u8; 2 * usize::try_from(MIB).unwrap()]).unwrap();
        let b = PmemBacking::open(&f, None, true).unwrap();
        assert_eq!(b.size(), 2 * MIB);
        // SAFETY: the private mapping is 2 MiB long and writable.
        unsafe { *(b.host_addr() as *mut u8) = 1 };
        drop(b);
        assert_eq!(std::fs::read(&f).unwrap()[0], 7);
        let e = PmemBacking::open(&f, Some(4 * MIB), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("read-only"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn directory_gets_an_unnamed_temporary_file() {
        let dir = scratch("tmpfile");
        let b = PmemBacking::open(&dir, Some(2 * MIB), false).unwrap();
        assert_eq!(b.size(), 2 * MIB);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "O_TMPFILE leaves no name behind"
        );
        drop(b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
