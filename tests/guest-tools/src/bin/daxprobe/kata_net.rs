//! `daxprobe kata-add-net SOCKET TAP BODY`: what Kata's Cloud Hypervisor
//! driver does to add a network device (clh.go, vmAddNetPutRequest): it
//! opens a tap (multiqueue, with the virtio-net header, as Kata's
//! netlink-made taps are), then writes the `PUT /api/v1/vm.add-net`
//! request as Go's `httputil.DumpRequest` prints it and the tap fd as
//! SCM_RIGHTS data in one `sendmsg`, and reads the answer on the same
//! connection. Prints `status=<code> body=<body>`.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::fail;

/// Opens (creating) the tap `name` as Kata's endpoints have it.
pub(super) fn open_tap(name: &str) -> OwnedFd {
    // SAFETY: a NUL-terminated path; the fd is checked and owned below.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        fail(format!("/dev/net/tun: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just opened and nothing else owns it.
    let tun = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all zeroes is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *d = s.cast_signed();
    }
    req.ifr_ifru.ifru_flags =
        i16::try_from(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_MULTI_QUEUE)
            .expect("the tap flags fit ifr_flags");
    // SAFETY: TUNSETIFF reads and writes an ifreq.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        fail(format!(
            "TUNSETIFF {name}: {}",
            std::io::Error::last_os_error()
        ));
    }
    tun
}

pub fn add_net(socket: &str, tap: &str, body: &str) {
    let (status, body) = add_net_exchange(socket, tap, body);
    println!("status={status} body={body}");
}

/// Sends vm.add-net with the tap's fd on a fresh connection; returns the
/// answer's status and body.
pub fn add_net_exchange(socket: &str, tap: &str, body: &str) -> (String, String) {
    let tap = open_tap(tap);
    let s = UnixStream::connect(socket).unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    let request = test_infra::kata::add_net_request(body);
    let mut control = [0u64; 4];
    let iov = [std::io::IoSlice::new(request.as_bytes())];
    // SAFETY: msghdr is plain data; the control buffer holds CMSG_SPACE of
    // one fd and outlives the call; the iovec points at `request`.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(4) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), tap.as_raw_fd());
        libc::sendmsg(s.as_raw_fd(), &msg, 0)
    };
    if usize::try_from(sent).ok() != Some(request.len()) {
        fail(format!(
            "sendmsg: {sent}: {}",
            std::io::Error::last_os_error()
        ));
    }
    // The answer on the same (kept-alive) connection: head, then
    // Content-Length bytes.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let mut s = s;
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, rest)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if rest.len() >= len {
                let status = head.split(' ').nth(1).unwrap_or("0");
                return (status.to_string(), rest[..len].to_string());
            }
        }
        let n = s
            .read(&mut buf)
            .unwrap_or_else(|e| fail(format!("{socket}: {e}")));
        if n == 0 {
            fail(format!("{socket}: closed after {:?}", text));
        }
        got.extend_from_slice(&buf[..n]);
    }
}
