//! File descriptors passed over the migration's unix socket (SCM_RIGHTS):
//! guest memory's (`MemoryFd`), the DAX window's files (`WindowFd`), a
//! tap (`TapFd`), a disk's open image (`DiskFd`) and the vsock listener
//! (`VsockFd`), each sent with the payload bytes of its request in one
//! `sendmsg`, as Cloud Hypervisor's `Vm::send_memory_fds` does.
//!
//! Sending uses vmm-sys-util's `ScmSocket`. Receiving does not: its
//! `recvmsg` passes no flags, so a received fd would lack close-on-exec
//! until someone set it, and leak into any program this process starts in
//! between. Ours asks the kernel for `MSG_CMSG_CLOEXEC` (as the API's
//! `passed_fds` does), wraps every fd in an `OwnedFd` at once, and caps how
//! many one receive takes: past the cap all of them are closed and the
//! receive fails.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Fds one message may carry. Every command of the protocol passes one;
/// the room for a few more lets a receive see (and refuse) a peer that
/// sends more, instead of the kernel dropping them silently.
pub const MAX_FDS_PER_MESSAGE: usize = 4;

/// The control buffer of one receive: room for the cmsghdr and 12 fds (u64
/// elements for the header's alignment). The kernel installs at most that
/// many; a receive then keeps at most its caller's cap.
const CONTROL_WORDS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum FdSocketError {
    #[error("sending on the migration socket failed: {0}")]
    Send(#[source] io::Error),
    #[error("receiving on the migration socket failed: {0}")]
    Receive(#[source] io::Error),
    #[error("the peer closed the migration socket after {got} of {expected} payload bytes")]
    Truncated { got: usize, expected: usize },
    #[error("{got} fds came with one payload, more than the {max} it carries (all were closed)")]
    TooManyFds { got: usize, max: usize },
    #[error("more fds came with one message than a receive has room for (all were closed)")]
    ControlTruncated,
    #[error("{count} fds cannot be sent in one message (at most {MAX_FDS_PER_MESSAGE})")]
    TooManyToSend { count: usize },
    #[error("fds must travel with at least one payload byte")]
    EmptyPayload,
}

/// Sends `bytes` with `fds` attached to their first byte, then the rest of
/// `bytes` if the kernel took only part of them.
pub fn send_with_fds(
    socket: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), FdSocketError> {
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(FdSocketError::TooManyToSend { count: fds.len() });
    }
    if bytes.is_empty() {
        // A stream socket carries ancillary data only with data.
        return Err(FdSocketError::EmptyPayload);
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let sent = loop {
        match socket.send_with_fds(&[bytes], &raw) {
            Ok(n) => break n,
            Err(e) if e.errno() == libc::EINTR => continue,
            Err(e) => return Err(FdSocketError::Send(io::Error::from_raw_os_error(e.errno()))),
        }
    };
    let rest = bytes.get(sent..).unwrap_or_default();
    let mut writer = socket;
    writer.write_all(rest).map_err(FdSocketError::Send)
}

/// Fills `buf` from the socket and returns the fds that came with its bytes
/// (close-on-exec, owned). More than `max_fds` in all, or more than one
/// message's control buffer holds, is an error and every fd received is
/// closed; so is an end of stream before `buf` is full. A read timeout set
/// on the socket ends the wait with `Receive` (WouldBlock).
pub fn recv_with_fds(
    socket: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> Result<Vec<OwnedFd>, FdSocketError> {
    let mut fds = Vec::new();
    let mut got = 0;
    while got < buf.len() {
        let unfilled = buf.get_mut(got..).unwrap_or_default();
        let (n, truncated) = match recv_once(socket.as_raw_fd(), unfilled, &mut fds) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(FdSocketError::Receive(e)),
        };
        if truncated {
            return Err(FdSocketError::ControlTruncated);
        }
        if fds.len() > max_fds {
            return Err(FdSocketError::TooManyFds {
                got: fds.len(),
                max: max_fds,
            });
        }
        if n == 0 {
            return Err(FdSocketError::Truncated {
                got,
                expected: buf.len(),
            });
        }
        got += n;
    }
    Ok(fds)
}

/// One `recvmsg` into `buf`; the SCM_RIGHTS fds it brings are pushed to
/// `fds` as owned fds. Returns the bytes read and whether the kernel
/// truncated the control data (MSG_CTRUNC: it closed the fds that did not
/// fit).
fn recv_once(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<(usize, bool)> {
    let mut control = [0u64; CONTROL_WORDS];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is valid (no name, no
    // iovec, no control buffer until set below).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: the iovec points at `buf` and the control pointer at
    // `control`, both valid for their lengths for the whole call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR/CMSG_NXTHDR walk
    // its control buffer within msg_controllen, and an SCM_RIGHTS payload
    // holds (cmsg_len - CMSG_LEN(0)) / 4 fds the kernel installed in this
    // process for us, each taken exactly once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let header = usize::try_from(libc::CMSG_LEN(0)).unwrap_or(usize::MAX);
                let count = (*cmsg).cmsg_len.saturating_sub(header) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

#[cfg(test)]
#[path = "fd_socket_tests.rs"]
mod tests;
