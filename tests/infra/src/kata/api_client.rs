//! Cloud Hypervisor's `api_client` crate as Kata's Rust runtime uses it
//! (runtime-rs `ch-config/src/ch_api.rs` pins it at tag v51.0): how a
//! request goes out and how an answer is read, so a test sends exactly its
//! bytes in its writes and fails where it would fail. Written from reading
//! `api_client/src/lib.rs` at v51.0, not copied.
//!
//! A request is two to four writes on the one kept connection:
//!
//! ```text
//! 1. "<METHOD> /api/v1/<command> HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n"
//!    (sendmsg, with the request's fds as SCM_RIGHTS: vm.add-net's taps)
//! 2. "Content-Length: <n>\r\n"            only with a body
//! 3. "\r\n"
//! 4. <body>                               only with a body
//! ```
//!
//! No Content-Type, and a bodiless PUT (vm.boot, vmm.shutdown) has no
//! Content-Length at all.
//!
//! The answer is read 256 bytes at a time until the head ends; the body's
//! length is found only by the literal text `Content-Length: ` anywhere in
//! what was read (without it the body is ignored and reading stops at the
//! head); the status is what lies between `HTTP/1.1 ` and the next `\r`,
//! trimmed, parsed as an integer (so `200 OK` is an error); anything but
//! 100, 200 and 204 is an error carrying the body. Each chunk read must be
//! whole UTF-8 (the crate unwraps it: a panic there is an error here).
//! The answer is read by [`ch_client::parse_reply`], which follows those
//! rules for ch-remote (the same crate); what this module adds is the kept
//! connection and the fds.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::ch_client::{self, ChError};

/// The writes of one request, in order (see the module note).
pub fn request_writes(method: &str, command: &str, body: Option<&str>) -> Vec<Vec<u8>> {
    let mut writes =
        vec![
            format!("{method} /api/v1/{command} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n")
                .into_bytes(),
        ];
    if let Some(body) = body {
        writes.push(format!("Content-Length: {}\r\n", body.len()).into_bytes());
    }
    writes.push(b"\r\n".to_vec());
    if let Some(body) = body {
        writes.push(body.as_bytes().to_vec());
    }
    writes
}

/// `simple_api_full_command_with_fds_and_response`: writes the request on
/// `socket` (the first write with `fds`), then reads the answer. Returns
/// the body (None when the answer had no `Content-Length: `).
pub fn call(
    socket: &mut UnixStream,
    method: &str,
    command: &str,
    body: Option<&str>,
    fds: &[RawFd],
) -> Result<Option<String>, ChError> {
    let writes = request_writes(method, command, body);
    let socket_error = |e: io::Error| ChError::Socket(e.to_string());
    send_with_fds(socket, &writes[0], fds).map_err(socket_error)?;
    for w in &writes[1..] {
        socket.write_all(w).map_err(socket_error)?;
    }
    socket.flush().map_err(socket_error)?;
    ch_client::parse_reply(socket).map(|(_, body)| body)
}

/// One `sendmsg` of `bytes` with `fds` as SCM_RIGHTS (vmm-sys-util's
/// `send_with_fds`; no control message when there are no fds).
fn send_with_fds(socket: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    const MAX_FDS: usize = 16;
    if fds.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} fds, at most {MAX_FDS}",
            fds.len()
        )));
    }
    let fd_bytes = std::mem::size_of_val(fds);
    let fd_bytes_u32 = u32::try_from(fd_bytes).map_err(io::Error::other)?;
    // Room for CMSG_SPACE of MAX_FDS fds, u64-aligned.
    let mut control = [0u64; 2 + MAX_FDS / 2];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(fd_bytes_u32) } as usize;
        // SAFETY: msg_control points at `control`, large enough for
        // CMSG_SPACE(fd_bytes) (checked against MAX_FDS above); the header
        // and the fd array are written inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes_u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes,
            );
        }
    }
    // SAFETY: msg points at the iovec and control buffer above, both alive
    // for the call.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
    match usize::try_from(sent) {
        Ok(n) if n == bytes.len() => Ok(()),
        Ok(n) => Err(io::Error::other(format!(
            "sendmsg sent {n} of {} bytes",
            bytes.len()
        ))),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_go_out_in_api_clients_writes() {
        let w = request_writes("PUT", "vm.boot", None);
        assert_eq!(
            w,
            vec![
                b"PUT /api/v1/vm.boot HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n".to_vec(),
                b"\r\n".to_vec()
            ]
        );
        let w = request_writes("PUT", "vm.resize", Some("{}"));
        let text: Vec<&str> = w.iter().map(|b| std::str::from_utf8(b).unwrap()).collect();
        assert_eq!(
            text,
            [
                "PUT /api/v1/vm.resize HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n",
                "Content-Length: 2\r\n",
                "\r\n",
                "{}"
            ]
        );
    }

    #[test]
    fn fds_ride_on_the_first_write() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut fds_seen = 0;
            let mut buf = [0u8; 4096];
            let mut control = [0u64; 8];
            while !got.ends_with(b"{}") {
                let mut iov = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: buf.len(),
                };
                // SAFETY: msghdr is plain data.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = &raw mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = std::mem::size_of_val(&control);
                // SAFETY: the buffers outlive the call.
                let n = unsafe { libc::recvmsg(b.as_raw_fd(), &raw mut msg, 0) };
                let n = usize::try_from(n).unwrap();
                if msg.msg_controllen > 0 {
                    assert!(got.is_empty(), "fds after the first bytes");
                    fds_seen += 1;
                }
                got.extend_from_slice(&buf[..n]);
            }
            (&b).write_all(b"HTTP/1.1 204 \r\n\r\n").unwrap();
            (String::from_utf8(got).unwrap(), fds_seen)
        });
        let r = call(&mut a, "PUT", "vm.add-net", Some("{}"), &[c.as_raw_fd()]);
        assert_eq!(r, Ok(None));
        let (text, fds) = server.join().unwrap();
        assert_eq!(fds, 1);
        assert_eq!(
            text,
            "PUT /api/v1/vm.add-net HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
             Content-Length: 2\r\n\r\n{}"
        );
    }
}
