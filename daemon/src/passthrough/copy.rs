//! Copying a byte range between two host files, for READ and WRITE whose
//! guest buffer lies in the DAX window (see [`super::IoTarget::File`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use super::{cvt_count, errno_error};

/// The bounce buffer of the fallback copy: a READ or WRITE moves at most
/// `MAX_WRITE` (1 MiB) in all, so a request costs a few rounds of this.
const BOUNCE: usize = 64 * 1024;

/// Copies up to `len` bytes from `from` at `from_off` to `to` at `to_off`;
/// stops early only at the end of `from`. Returns the bytes copied.
///
/// `copy_file_range` keeps the data in the kernel (and shares extents
/// where the file system can); where it cannot copy between these two
/// files (another file system, overlapping ranges of one file, a kernel
/// without it) the copy goes through a bounded buffer instead.
pub fn copy_range(
    from: &File,
    from_off: u64,
    to: &File,
    to_off: u64,
    len: usize,
) -> io::Result<usize> {
    match copy_in_kernel(from, from_off, to, to_off, len) {
        Ok(n) => Ok(n),
        Err((done, e)) if done == 0 && falls_back(&e) => {
            copy_through_buffer(from, from_off, to, to_off, len)
        }
        Err((done, _)) if done > 0 => Ok(done),
        Err((_, e)) => Err(e),
    }
}

fn falls_back(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

fn offset_of(v: u64) -> io::Result<i64> {
    i64::try_from(v).map_err(|_| errno_error(libc::EINVAL))
}

/// `copy_file_range` until done or the source ends; on an error, the bytes
/// already copied with it.
fn copy_in_kernel(
    from: &File,
    from_off: u64,
    to: &File,
    to_off: u64,
    len: usize,
) -> Result<usize, (usize, io::Error)> {
    let (mut off_in, mut off_out) = match (offset_of(from_off), offset_of(to_off)) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) | (_, Err(e)) => return Err((0, e)),
    };
    let mut done = 0;
    while done < len {
        // SAFETY: both fds are open files owned by the caller; the kernel
        // reads and advances only the two offsets, which live on this stack.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                len - done,
                0,
            )
        };
        match cvt_count::<_, usize>(n) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((done, e)),
        }
    }
    Ok(done)
}

fn copy_through_buffer(
    from: &File,
    from_off: u64,
    to: &File,
    to_off: u64,
    len: usize,
) -> io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; BOUNCE.min(len)];
    let mut done = 0;
    while done < len {
        let want = buf.len().min(len - done);
        let at = from_off
            .checked_add(done as u64)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        let n = match from.read_at(&mut buf[..want], at) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if done > 0 => {
                return Ok(done).inspect(|_| tracing::debug!("copy cut short: {e}"))
            }
            Err(e) => return Err(e),
        };
        let out = to_off
            .checked_add(done as u64)
            .ok_or_else(|| errno_error(libc::EINVAL))?;
        to.write_all_at(&buf[..n], out)?;
        done += n;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn file_with(bytes: &[u8]) -> File {
        let f = tempfile_in_tmp();
        f.write_all_at(bytes, 0).unwrap();
        f
    }

    fn tempfile_in_tmp() -> File {
        let dir = std::env::temp_dir();
        let path = dir.join(format!(
            "dax-copy-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    #[test]
    fn copies_between_files_and_stops_at_the_end_of_the_source() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let from = file_with(&data);
        let to = file_with(&[0u8; 8192]);
        assert_eq!(copy_range(&from, 100, &to, 4096, 150_000).unwrap(), 150_000);
        let mut back = vec![0u8; 150_000];
        to.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(back, data[100..150_100]);
        // 1000 bytes are left in the source past 199_000.
        assert_eq!(copy_range(&from, 199_000, &to, 0, 4096).unwrap(), 1000);
    }

    #[test]
    fn the_buffered_copy_handles_what_copy_file_range_refuses() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 13) as u8).collect();
        let f = file_with(&data);
        // Overlapping ranges of one file: copy_file_range says EINVAL.
        assert_eq!(copy_range(&f, 0, &f, 10, 20).unwrap(), 20);
        let mut back = [0u8; 30];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(&back[10..30], &data[0..20]);
        let to = file_with(&[]);
        assert_eq!(
            copy_through_buffer(&f, 0, &to, 0, 100_000).unwrap(),
            100_000
        );
        assert_eq!(to.metadata().unwrap().len(), 100_000);
    }
}
