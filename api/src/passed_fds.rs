//! File descriptors sent with a request as SCM_RIGHTS ancillary data, the
//! way Kata's Cloud Hypervisor driver hands over tap fds: it writes the
//! whole `PUT /api/v1/vm.add-net` request and the fds in one `sendmsg`.
//!
//! [`FdStream`] reads the API connection with `recvmsg`, keeping the fds
//! that arrive with the bytes; when hyper has parsed a request, the fds
//! received so far (those that came with its bytes, or before them) are
//! taken from the connection and put in the request's extensions as
//! [`PassedFds`]. An endpoint that takes none leaves them there and they
//! are closed with the request.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;

/// Fds one `recvmsg` takes at most; more in one message are closed by the
/// kernel (MSG_CTRUNC) and the request gets none of them.
pub const MAX_FDS_PER_MESSAGE: usize = 16;
/// Fds a connection holds at most before a request takes them; past it
/// the newest are closed (a client sending fds without requests cannot
/// grow the VMM's table).
pub const MAX_HELD_FDS: usize = 64;

/// The fds that came with a request (taken once, by the endpoint that
/// uses them).
#[derive(Clone, Debug, Default)]
pub struct PassedFds(Arc<Mutex<Vec<OwnedFd>>>);

impl PassedFds {
    pub fn new(fds: Vec<OwnedFd>) -> Self {
        PassedFds(Arc::new(Mutex::new(fds)))
    }

    /// Takes the fds (the next call gets none).
    pub fn take(&self) -> Vec<OwnedFd> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Fds received on a connection and not yet given to a request.
#[derive(Clone, Debug, Default)]
pub struct HeldFds(Arc<Mutex<Vec<OwnedFd>>>);

impl HeldFds {
    /// What a request just parsed gets.
    pub fn take(&self) -> Vec<OwnedFd> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn keep(&self, fds: Vec<OwnedFd>) {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let room = MAX_HELD_FDS.saturating_sub(held.len());
        if fds.len() > room {
            tracing::warn!(
                "API connection: {} passed fds beyond the {MAX_HELD_FDS} a connection may hold are closed",
                fds.len() - room
            );
        }
        held.extend(fds.into_iter().take(room));
    }
}

/// A unix stream read with `recvmsg`, keeping passed fds in [`HeldFds`].
pub struct FdStream {
    inner: UnixStream,
    held: HeldFds,
}

impl FdStream {
    pub fn new(inner: UnixStream, held: HeldFds) -> Self {
        FdStream { inner, held }
    }
}

/// One non-blocking `recvmsg` into `buf`; SCM_RIGHTS fds go to `fds`.
fn recv_with_fds(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    // u64 elements: cmsg headers need their alignment.
    let mut control = [0u64; 2 + MAX_FDS_PER_MESSAGE / 2];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: the iovec and control buffer are valid for their lengths for
    // the duration of the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: msg was filled by recvmsg; the CMSG macros walk its control
    // buffer within msg_controllen, and each SCM_RIGHTS payload holds
    // (cmsg_len - CMSG_LEN(0)) / 4 fds the kernel installed for us.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let len = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        tracing::warn!(
            "API connection: more than {MAX_FDS_PER_MESSAGE} fds in one message; the kernel closed the rest"
        );
    }
    Ok(n)
}

impl AsyncRead for FdStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.inner.poll_read_ready(cx))?;
            let raw = this.inner.as_raw_fd();
            let mut fds = Vec::new();
            let unfilled = buf.initialize_unfilled();
            let got = this.inner.try_io(Interest::READABLE, || {
                recv_with_fds(raw, unfilled, &mut fds)
            });
            if !fds.is_empty() {
                this.held.keep(fds);
            }
            match got {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for FdStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSlice;

    use super::*;

    /// Sends `bytes` and `fds` in one sendmsg, as Kata's driver does.
    fn send_with_fds(sock: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[RawFd]) {
        let mut control = [0u64; 8];
        let iov = [IoSlice::new(bytes)];
        // SAFETY: msghdr is plain data; the control buffer is big enough for
        // CMSG_SPACE of the fds (at most 4 here) and outlives the call.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = 1;
            let payload = u32::try_from(std::mem::size_of_val(fds)).expect("a few fds");
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(payload) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
            let sent = libc::sendmsg(sock.as_raw_fd(), &msg, 0);
            assert_eq!(usize::try_from(sent).ok(), Some(bytes.len()));
        }
    }

    /// One read, as hyper makes it.
    async fn read(s: &mut FdStream, buf: &mut [u8]) -> io::Result<usize> {
        let mut rb = ReadBuf::new(buf);
        std::future::poll_fn(|cx| Pin::new(&mut *s).poll_read(cx, &mut rb)).await?;
        Ok(rb.filled().len())
    }

    #[tokio::test(flavor = "current_thread")]
    async fn fds_sent_with_bytes_are_kept_for_the_request() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let held = HeldFds::default();
        let mut s = FdStream::new(UnixStream::from_std(b).unwrap(), held.clone());
        let file = std::fs::File::open("/dev/null").unwrap();
        send_with_fds(
            &a,
            b"PUT /x HTTP/1.1\r\n",
            &[file.as_raw_fd(), file.as_raw_fd()],
        );
        let mut buf = [0u8; 64];
        let n = read(&mut s, &mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"PUT /x HTTP/1.1\r\n");
        let fds = held.take();
        assert_eq!(fds.len(), 2);
        // New descriptors in this process, close-on-exec, the same file.
        for fd in &fds {
            assert_ne!(fd.as_raw_fd(), file.as_raw_fd());
            // SAFETY: F_GETFD on an fd we own.
            let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        }
        assert!(held.take().is_empty(), "taken once");
        // Bytes without fds: nothing held.
        use std::io::Write;
        (&a).write_all(b"more").unwrap();
        let n = read(&mut s, &mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"more");
        assert!(held.take().is_empty());
        let p = PassedFds::new(fds);
        assert_eq!(p.clone().take().len(), 2);
        assert!(p.take().is_empty());
    }
}
