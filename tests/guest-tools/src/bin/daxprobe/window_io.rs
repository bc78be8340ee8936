//! `daxprobe window-io MAP SRC OUT OFFSET LEN direct|buffered`: what a
//! program does when its I/O buffer is a DAX mapping. It maps MAP shared
//! and writable, `read()`s LEN bytes of SRC (from its start) into the
//! mapping at OFFSET, then `write()`s them from the mapping to a new OUT;
//! `direct` opens SRC and OUT with `O_DIRECT`, so the guest kernel hands the
//! daemon window pages as the request's buffers. Prints
//! `dax=D read=N write=M match=1|0` (D: MAP has the DAX attribute; match:
//! the mapping holds what a plain read of SRC gives), or `read_err=E` /
//! `write_err=E` with the errno's name where the call failed.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use super::{fail, file_len, num, open, statx_dax, Mapping};

pub fn window_io(map: &str, src: &str, out: &str, offset: &str, len: &str, mode: &str) {
    let (offset, len): (usize, usize) = (num(offset), num(len));
    let direct = match mode {
        "direct" => libc::O_DIRECT,
        "buffered" => 0,
        m => fail(format!("{m:?}: say direct or buffered")),
    };
    let target = open(map, true);
    let size = file_len(&target);
    if offset.checked_add(len).is_none_or(|end| end > size) {
        fail(format!(
            "{offset}+{len} is past the end of {map} ({size} bytes)"
        ));
    }
    let dax = u8::from(statx_dax(map));
    let m = Mapping::new(&target, size, true);
    let source = OpenOptions::new()
        .read(true)
        .custom_flags(direct)
        .open(src)
        .unwrap_or_else(|e| fail(format!("{src}: {e}")));
    // SAFETY: [offset, offset + len) is inside the writable mapping
    // (checked above); the kernel writes at most `len` bytes there.
    let n = unsafe { libc::read(source.as_raw_fd(), m.ptr.add(offset).cast(), len) };
    // Negative is the error; anything else is at most `len`.
    let Ok(n) = usize::try_from(n) else {
        println!("dax={dax} read_err={}", errno_name());
        return;
    };
    let sink = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(direct)
        .open(out)
        .unwrap_or_else(|e| fail(format!("{out}: {e}")));
    // SAFETY: as above; the kernel only reads the buffer.
    let w = unsafe { libc::write(sink.as_raw_fd(), m.ptr.add(offset).cast(), n) };
    if w < 0 {
        println!("dax={dax} read={n} write_err={}", errno_name());
        return;
    }
    let mut want = vec![0u8; n];
    let plain = open(src, false);
    plain
        .read_exact_at(&mut want, 0)
        .unwrap_or_else(|e| fail(format!("{src}: {e}")));
    let matches = u8::from(m.bytes()[offset..offset + n] == want[..]);
    println!("dax={dax} read={n} write={w} match={matches}");
}

fn errno_name() -> String {
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EFAULT) => "EFAULT".into(),
        Some(libc::EIO) => "EIO".into(),
        Some(libc::EINVAL) => "EINVAL".into(),
        _ => e.to_string().replace(' ', "_"),
    }
}
