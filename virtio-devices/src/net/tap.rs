//! A tap interface as the device's host side: opened (or created) by name
//! through `/dev/net/tun`, or taken as an fd another process opened (Kata
//! passes them over the API socket), with the virtio-net header on every
//! frame. [`FrameIo`] is what the queues need of it, so tests can stand a
//! socket pair in for the tap.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use super::header::VNET_HDR_LEN;
use super::iov::IoVecs;

/// The kernel's limit on an interface name (IFNAMSIZ less the NUL).
pub const MAX_TAP_NAME_LEN: usize = libc::IFNAMSIZ - 1;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap={name}: the name must be 1 to {MAX_TAP_NAME_LEN} bytes without '/', ' ' or NUL")]
    Name { name: String },
    #[error("tap={name}: opening /dev/net/tun: {source} (is the tun module loaded?)")]
    OpenTun { name: String, source: io::Error },
    #[error("tap={name}: {what}: {source}")]
    Ioctl {
        name: String,
        what: &'static str,
        source: io::Error,
    },
    #[error("fd {fd}: not a tap with IFF_VNET_HDR ({why})")]
    NotATap { fd: RawFd, why: String },
}

/// What the RX and TX paths need of the host side: whole frames (header
/// included) in and out, non-blocking, and an fd to wait on. A frame moves
/// with one `readv`/`writev` on that fd, straight between the tap and the
/// guest's buffers.
pub trait FrameIo: AsRawFd + Send + Sync {
    /// Reads one frame into the vectors; `WouldBlock` when none is waiting.
    fn read_frame(&self, iov: &mut IoVecs<'_>) -> io::Result<usize> {
        let count = libc::c_int::try_from(iov.count())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: every vector points at memory `iov` borrows mutably (a
        // checked guest range or a buffer of ours), mapped for the call;
        // the kernel writes only within the vectors' lengths.
        let n = unsafe { libc::readv(self.as_raw_fd(), iov.as_iovecs().as_ptr(), count) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// Writes one frame from the vectors.
    fn write_frame(&self, iov: &IoVecs<'_>) -> io::Result<usize> {
        let count = libc::c_int::try_from(iov.count())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: as in read_frame; the kernel only reads the vectors.
        let n = unsafe { libc::writev(self.as_raw_fd(), iov.as_iovecs().as_ptr(), count) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// Reads one frame into `buf`.
    fn recv_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut iov = IoVecs::new();
        iov.push_bytes(buf);
        self.read_frame(&mut iov)
    }
}

/// An open tap queue.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

/// An `ifreq` for `name` (already checked to fit).
fn ifreq_named(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain data (a name and a union of integers and
    // addresses); all zeroes is a valid value of it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    req
}

fn ifreq_name(req: &libc::ifreq) -> String {
    let bytes: Vec<u8> = req
        .ifr_name
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| u8::from_ne_bytes(c.to_ne_bytes()))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `ioctl(fd, request, arg)` with a pointer argument, as an io::Result.
///
/// # Safety
/// `arg` must be the type the kernel reads or writes for `request`.
unsafe fn ioctl_ptr<T>(fd: RawFd, request: libc::Ioctl, arg: *mut T) -> io::Result<()> {
    // SAFETY: the caller vouches that `arg` fits `request`; the kernel
    // touches no other memory.
    if unsafe { libc::ioctl(fd, request, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `ioctl(fd, request, value)` with an integer argument.
fn ioctl_val(fd: RawFd, request: libc::Ioctl, value: libc::c_ulong) -> io::Result<()> {
    // SAFETY: these requests (TUNSETOFFLOAD) take their argument by value
    // and touch no memory of ours.
    if unsafe { libc::ioctl(fd, request, value) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Checks a tap name as the kernel would take it.
pub fn check_tap_name(name: &str) -> Result<(), TapError> {
    if name.is_empty()
        || name.len() > MAX_TAP_NAME_LEN
        || name
            .bytes()
            .any(|b| b == b'/' || b == 0 || b.is_ascii_whitespace())
    {
        return Err(TapError::Name { name: name.into() });
    }
    Ok(())
}

impl Tap {
    /// Opens the tap `name`, creating it if it does not exist (it then
    /// lasts as long as this fd), with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`
    /// and a 12-byte header, non-blocking.
    pub fn open_named(name: &str) -> Result<Self, TapError> {
        check_tap_name(name)?;
        let fail = |what, source| TapError::Ioctl {
            name: name.into(),
            what,
            source,
        };
        // SAFETY: a NUL-terminated path; the fd returned is checked and owned below.
        let fd = unsafe {
            libc::open(
                c"/dev/net/tun".as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(TapError::OpenTun {
                name: name.into(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: fd was just opened and is owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut req = ifreq_named(name);
        req.ifr_ifru.ifru_flags =
            const { narrow::c_short_of(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) };
        // SAFETY: TUNSETIFF reads and writes an ifreq.
        unsafe { ioctl_ptr(file.as_raw_fd(), libc::TUNSETIFF, &mut req) }
            .map_err(|e| fail("TUNSETIFF", e))?;
        let tap = Tap {
            file,
            name: ifreq_name(&req),
        };
        tap.set_vnet_hdr_len()
            .map_err(|e| fail("TUNSETVNETHDRSZ", e))?;
        Ok(tap)
    }

    /// Takes a tap fd opened by someone else (Kata's `fds`): it must be a
    /// tap with `IFF_VNET_HDR`; it is made non-blocking and given the
    /// 12-byte header.
    pub fn from_fd(fd: OwnedFd) -> Result<Self, TapError> {
        let raw = fd.as_raw_fd();
        let not = |why: String| TapError::NotATap { fd: raw, why };
        let req = Self::interface_of(fd.as_fd())?;
        // SAFETY: F_GETFL/F_SETFL on an fd we own.
        let ok = unsafe {
            let fl = libc::fcntl(raw, libc::F_GETFL);
            fl >= 0 && libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK) >= 0
        };
        if !ok {
            return Err(not(format!("O_NONBLOCK: {}", io::Error::last_os_error())));
        }
        let tap = Tap {
            file: File::from(fd),
            name: ifreq_name(&req),
        };
        tap.set_vnet_hdr_len()
            .map_err(|e| not(format!("TUNSETVNETHDRSZ: {e}")))?;
        Ok(tap)
    }

    /// Whether `fd` is a tap with `IFF_VNET_HDR` (what [`Self::from_fd`]
    /// takes), asked with TUNGETIFF only: nothing about the fd changes, so
    /// a caller can check every fd it was passed before taking any.
    pub fn check_fd(fd: BorrowedFd<'_>) -> Result<(), TapError> {
        Self::interface_of(fd).map(drop)
    }

    /// TUNGETIFF's answer for a tap with `IFF_VNET_HDR`.
    fn interface_of(fd: BorrowedFd<'_>) -> Result<libc::ifreq, TapError> {
        let raw = fd.as_raw_fd();
        let not = |why: String| TapError::NotATap { fd: raw, why };
        let mut req = ifreq_named("");
        // SAFETY: TUNGETIFF writes an ifreq.
        unsafe { ioctl_ptr(raw, libc::TUNGETIFF, &mut req) }
            .map_err(|e| not(format!("TUNGETIFF: {e}")))?;
        // SAFETY: TUNGETIFF filled the flags member of the union.
        let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags });
        if flags & libc::IFF_TAP == 0 || flags & libc::IFF_VNET_HDR == 0 {
            return Err(not(format!("interface flags {flags:#x}")));
        }
        Ok(req)
    }

    fn set_vnet_hdr_len(&self) -> io::Result<()> {
        let mut len = libc::c_int::try_from(VNET_HDR_LEN).unwrap_or(libc::c_int::MAX);
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        unsafe { ioctl_ptr(self.file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &mut len) }
    }

    /// The interface's name (the kernel's, e.g. for `tap%d`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Which checksum/TSO frames the tap may hand us (`TUN_F_*`).
    pub fn set_offload(&self, flags: u32) -> io::Result<()> {
        ioctl_val(
            self.file.as_raw_fd(),
            libc::TUNSETOFFLOAD,
            libc::c_ulong::from(flags),
        )
    }

    fn fail(&self, what: &'static str) -> impl Fn(io::Error) -> TapError + '_ {
        move |source| TapError::Ioctl {
            name: self.name.clone(),
            what,
            source,
        }
    }

    /// Gives the host side `ip`/`mask`, sets its MTU if given, and brings
    /// it up (through an AF_INET socket, as `ip` does).
    pub fn configure_host_side(
        &self,
        ip: Option<Ipv4Addr>,
        mask: Option<Ipv4Addr>,
        mtu: Option<u16>,
    ) -> Result<(), TapError> {
        // SAFETY: socket() takes no pointers; the fd is checked and owned below.
        let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if sock < 0 {
            return Err(self.fail("socket(AF_INET)")(io::Error::last_os_error()));
        }
        // SAFETY: sock was just opened and is owned by nothing else.
        let sock = unsafe { OwnedFd::from_raw_fd(sock) };
        let set_addr = |request, what, addr: Ipv4Addr| {
            let mut req = ifreq_named(&self.name);
            // SAFETY: a sockaddr_in fits the union's sockaddr member (both 16 bytes).
            unsafe {
                let sin =
                    &mut req.ifr_ifru.ifru_addr as *mut libc::sockaddr as *mut libc::sockaddr_in;
                (*sin).sin_family = const { narrow::sa_family_of(libc::AF_INET) };
                (*sin).sin_addr.s_addr = u32::from_ne_bytes(addr.octets());
            }
            // SAFETY: SIOCSIFADDR/SIOCSIFNETMASK read an ifreq.
            unsafe { ioctl_ptr(sock.as_raw_fd(), request, &mut req) }.map_err(self.fail(what))
        };
        if let Some(ip) = ip {
            set_addr(libc::SIOCSIFADDR, "SIOCSIFADDR", ip)?;
        }
        // A netmask belongs to an address: without one there is none to set.
        if let (Some(_), Some(mask)) = (ip, mask) {
            set_addr(libc::SIOCSIFNETMASK, "SIOCSIFNETMASK", mask)?;
        }
        if let Some(mtu) = mtu {
            let mut req = ifreq_named(&self.name);
            req.ifr_ifru.ifru_mtu = i32::from(mtu);
            // SAFETY: SIOCSIFMTU reads an ifreq.
            unsafe { ioctl_ptr(sock.as_raw_fd(), libc::SIOCSIFMTU, &mut req) }
                .map_err(self.fail("SIOCSIFMTU"))?;
        }
        let mut req = ifreq_named(&self.name);
        // SAFETY: SIOCGIFFLAGS writes an ifreq.
        unsafe { ioctl_ptr(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) }
            .map_err(self.fail("SIOCGIFFLAGS"))?;
        // SAFETY: SIOCGIFFLAGS filled the flags member; then SIOCSIFFLAGS reads it.
        unsafe {
            req.ifr_ifru.ifru_flags |=
                const { narrow::c_short_of(libc::IFF_UP | libc::IFF_RUNNING) };
            ioctl_ptr(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &mut req)
        }
        .map_err(self.fail("SIOCSIFFLAGS"))
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl FrameIo for Tap {}

/// A datagram socket keeps frame boundaries as a tap does: tests and the
/// fuzz target use a non-blocking pair in its place.
impl FrameIo for std::os::unix::net::UnixDatagram {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_before_the_kernel_sees_them() {
        for bad in ["", "a/b", "with space", "0123456789abcdef"] {
            assert!(
                check_tap_name(bad)
                    .unwrap_err()
                    .to_string()
                    .contains("1 to 15 bytes"),
                "{bad:?}"
            );
        }
        assert!(check_tap_name("tap0").is_ok());
        assert!(check_tap_name("0123456789abcde").is_ok());
    }

    #[test]
    fn a_file_that_is_no_tap_is_refused() {
        let f = File::open("/dev/null").unwrap();
        let e = Tap::from_fd(f.into()).unwrap_err().to_string();
        assert!(e.contains("not a tap"), "{e}");
    }

    /// Needs CAP_NET_ADMIN and /dev/net/tun; skipped without them.
    #[test]
    fn a_named_tap_is_created_configured_and_passes_frames() {
        let name = format!("daxt{}", std::process::id() % 100000);
        let tap = match Tap::open_named(&name) {
            Ok(t) => t,
            Err(e) => return eprintln!("skipped: {e}"),
        };
        assert_eq!(tap.name(), name);
        tap.configure_host_side(
            Some(Ipv4Addr::new(192, 168, 251, 1)),
            Some(Ipv4Addr::new(255, 255, 255, 0)),
            Some(1400),
        )
        .unwrap();
        let mtu: u32 = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(mtu, 1400);
        tap.set_offload(libc::TUN_F_CSUM | libc::TUN_F_TSO4)
            .unwrap();
        // Nothing has been sent to the guest side yet.
        let mut buf = [0u8; 2048];
        assert_eq!(
            tap.recv_frame(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        // The same fd again, as Kata would pass it.
        let dup = tap.file.try_clone().unwrap();
        let again = Tap::from_fd(dup.into()).unwrap();
        assert_eq!(again.name(), name);
    }
}
