//! A peer's bytes on a unix stream socket, as a less-trusted process could
//! send them: cut into pieces where the input says, each piece with the
//! file descriptors (SCM_RIGHTS) the input chooses, so message headers,
//! attached fds and message boundaries disagree in every way.
//!
//! Input layout: byte 0 = `n | first_fds << 3` (n: extra cuts, 0..=7;
//! `first_fds`: the fds of the first piece, see [`Fds`]), then n cuts of
//! 3 bytes (piece start as u16 LE, its fds), then the payload. A seed is
//! thus `[0x00, payload…]` (one piece, no fd) or `[0x08, payload…]` (one
//! piece with one mappable fd).

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::OnceLock;

/// A piece of the payload and the fds sent with it.
pub struct Piece<'a> {
    pub bytes: &'a [u8],
    pub fds: Vec<RawFd>,
}

/// Which fds a piece carries, from a 5-bit field: bits 0-1 how many
/// (0..=3), bits 2-3 what kind (a mappable memfd, a read-only file, an
/// eventfd, or a directory); bit 4 turns the count into 40, more than
/// vhost-user's 32 so the receiver's control buffer overflows.
pub struct Fds;

impl Fds {
    fn of(field: u8) -> Vec<RawFd> {
        let count = if field & 0x10 != 0 {
            40
        } else {
            usize::from(field & 3)
        };
        let fd = match field >> 2 & 3 {
            0 => files().memfd.as_raw_fd(),
            1 => files().read_only.as_raw_fd(),
            2 => files().eventfd.as_raw_fd(),
            _ => files().dir.as_raw_fd(),
        };
        vec![fd; count]
    }
}

struct Files {
    memfd: std::fs::File,
    read_only: std::fs::File,
    eventfd: vmm_sys_util::eventfd::EventFd,
    dir: std::fs::File,
}

/// Size of the mappable file: 16 pages.
pub const FILE_SIZE: u64 = FILE_BYTES as u64;
const FILE_BYTES: usize = 16 * 4096;

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let memfd = vmm_sys_util::tempfile::TempFile::new()
            .expect("a temporary file")
            .into_file();
        (&memfd)
            .write_all(&[0xab; FILE_BYTES])
            .expect("its contents");
        let tmp = vmm_sys_util::tempfile::TempFile::new().expect("a temporary file");
        let mut writer = tmp.as_file();
        writer.write_all(&[0xcd; 4096]).expect("its contents");
        let read_only = std::fs::File::open(tmp.as_path()).expect("reopened read-only");
        Files {
            memfd,
            read_only,
            eventfd: vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).expect("an eventfd"),
            dir: std::fs::File::open("/").expect("a directory"),
        }
    })
}

/// Cuts `data` into pieces as its first bytes say (see the module docs).
pub fn pieces(data: &[u8]) -> Vec<Piece<'_>> {
    let Some((&head, rest)) = data.split_first() else {
        return Vec::new();
    };
    let n = usize::from(head & 7);
    let (cuts, payload) = rest.split_at(rest.len().min(3 * n));
    let mut starts = vec![(0usize, head >> 3)];
    for c in cuts.chunks_exact(3) {
        let at = usize::from(u16::from_le_bytes([c[0], c[1]])) % (payload.len() + 1);
        starts.push((at, c[2]));
    }
    starts.sort_by_key(|s| s.0);
    starts.dedup_by_key(|s| s.0);
    let mut out = Vec::new();
    for (i, &(at, fds)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(payload.len(), |s| s.0);
        out.push(Piece {
            bytes: &payload[at..end],
            fds: Fds::of(fds),
        });
    }
    out
}

/// Sends `piece` on `fd` without blocking; false if the socket would
/// block or failed (the rest is then not sent: the peer sees what came).
pub fn send(fd: RawFd, piece: &Piece<'_>) -> bool {
    if piece.bytes.is_empty() {
        // A stream socket does not send an empty piece, fds or not.
        return true;
    }
    let fd_bytes = std::mem::size_of_val(piece.fds.as_slice());
    let fd_bytes_u32 = u32::try_from(fd_bytes).expect("a few fds");
    let space = if piece.fds.is_empty() {
        0
    } else {
        // SAFETY: CMSG_SPACE only computes a size.
        unsafe { libc::CMSG_SPACE(fd_bytes_u32) as usize }
    };
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: piece.bytes.as_ptr() as *mut libc::c_void,
        iov_len: piece.bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no buffers).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if space > 0 {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: `control` holds CMSG_SPACE(fd_bytes) bytes, so the first
        // header and its data (fd_bytes) fit; the fds are copied in.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes_u32) as usize;
            std::ptr::copy_nonoverlapping(
                piece.fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes,
            );
        }
    }
    // SAFETY: `msg` points at `iov` and `control`, both alive for the call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    usize::try_from(n).is_ok_and(|n| n == piece.bytes.len())
}

/// Sends every piece of `data` on `fd` (stopping at the first that does
/// not go whole), then shuts `fd`'s writing side: the reader sees end of
/// file after the bytes, as when the peer exits.
pub fn send_all_and_close(fd: RawFd, data: &[u8]) {
    for p in pieces(data) {
        if !send(fd, &p) {
            break;
        }
    }
    // SAFETY: shutdown changes the socket's state only; `fd` is open.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
}
