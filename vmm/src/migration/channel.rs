//! What a migration runs over: a unix socket (`unix:PATH`, the same host:
//! a local migration passes fds over it, any other sends RAM through it)
//! or a TCP connection (`tcp:ADDRESS:PORT`, another host). Both sides
//! speak the same protocol over either; the stream carries guest RAM and
//! the VM's state in the clear, so a TCP one must run on a trusted
//! network, as Cloud Hypervisor's must.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use super::{MigrationError, ACCEPT_TIMEOUT, SOCKET_TIMEOUT};

/// Where a migration goes to (`destination_url`) or comes from
/// (`receiver_url`), in Cloud Hypervisor's notation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigrationUrl {
    /// `unix:PATH`: Cloud Hypervisor strips the scheme and takes the rest
    /// as the socket's path.
    Unix(PathBuf),
    /// `tcp:ADDRESS:PORT`, the address a literal IPv4 one or an IPv6 one in
    /// brackets. Names are not resolved: the VMM's seccomp filter keeps it
    /// off the network but for this one connection, and a resolver would
    /// need more (operators pass the address their orchestrator resolved).
    Tcp(SocketAddr),
}

impl MigrationUrl {
    /// Parses `url`, the body's `field`; the error names both.
    pub fn parse(field: &'static str, url: &str) -> Result<MigrationUrl, MigrationError> {
        let bad = |reason: &str| MigrationError::BadUrl {
            field,
            url: url.to_string(),
            reason: reason.to_string(),
        };
        if let Some(path) = url.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("unix: names no socket path"));
            }
            return Ok(MigrationUrl::Unix(PathBuf::from(path)));
        }
        if let Some(address) = url.strip_prefix("tcp:") {
            return address.parse::<SocketAddr>().map(MigrationUrl::Tcp).map_err(|_| {
                bad("tcp: must be followed by ADDRESS:PORT with a literal IPv4 address or a bracketed IPv6 one (names are not resolved)")
            });
        }
        Err(bad("the scheme must be unix: or tcp:"))
    }
}

impl fmt::Display for MigrationUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigrationUrl::Unix(path) => write!(f, "unix:{}", path.display()),
            MigrationUrl::Tcp(address) => write!(f, "tcp:{address}"),
        }
    }
}

/// One connected migration stream.
pub enum Channel {
    Unix(UnixStream),
    Tcp(TcpStream),
}

fn socket_error(
    url: &MigrationUrl,
    what: &'static str,
) -> impl FnOnce(io::Error) -> MigrationError {
    let url = url.to_string();
    move |source| MigrationError::Socket { url, what, source }
}

impl Channel {
    /// Connects to a receiver (at most [`SOCKET_TIMEOUT`] for a TCP
    /// handshake), with both directions' timeouts set.
    pub fn connect(url: &MigrationUrl) -> Result<Channel, MigrationError> {
        let channel = match url {
            MigrationUrl::Unix(path) => {
                Channel::Unix(UnixStream::connect(path).map_err(socket_error(url, "connecting"))?)
            }
            MigrationUrl::Tcp(address) => {
                let stream = TcpStream::connect_timeout(address, SOCKET_TIMEOUT)
                    .map_err(socket_error(url, "connecting"))?;
                // Requests are small and each waits for its answer.
                stream
                    .set_nodelay(true)
                    .map_err(socket_error(url, "setting TCP_NODELAY"))?;
                Channel::Tcp(stream)
            }
        };
        channel.set_timeouts(url)?;
        Ok(channel)
    }

    /// Listens at `url`, takes one sender (waiting at most
    /// [`ACCEPT_TIMEOUT`]) and stops listening: nobody else may connect.
    /// A unix socket's path must not exist; it is removed once the sender
    /// is taken (or none came).
    pub fn accept(url: &MigrationUrl) -> Result<Channel, MigrationError> {
        let channel = match url {
            MigrationUrl::Unix(path) => {
                let listener = UnixListener::bind(path).map_err(socket_error(url, "listening"))?;
                let accepted = wait_readable(listener.as_fd())
                    .and_then(|ready| ready.then(|| listener.accept().map(|(s, _)| s)).transpose());
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::warn!("{}: removing the socket file: {e}", path.display());
                }
                Channel::Unix(
                    accepted
                        .map_err(socket_error(url, "accepting the sender"))?
                        .ok_or_else(|| MigrationError::AcceptTimeout {
                            url: url.to_string(),
                        })?,
                )
            }
            MigrationUrl::Tcp(address) => {
                let listener =
                    TcpListener::bind(address).map_err(socket_error(url, "listening"))?;
                let stream = wait_readable(listener.as_fd())
                    .and_then(|ready| ready.then(|| listener.accept()).transpose())
                    .map_err(socket_error(url, "accepting the sender"))?
                    .ok_or_else(|| MigrationError::AcceptTimeout {
                        url: url.to_string(),
                    })?;
                tracing::info!("migration receive: sender {} connected", stream.1);
                stream
                    .0
                    .set_nodelay(true)
                    .map_err(socket_error(url, "setting TCP_NODELAY"))?;
                Channel::Tcp(stream.0)
            }
        };
        channel.set_timeouts(url)?;
        Ok(channel)
    }

    fn set_timeouts(&self, url: &MigrationUrl) -> Result<(), MigrationError> {
        let timeout = Some(SOCKET_TIMEOUT);
        match self {
            Channel::Unix(s) => s
                .set_read_timeout(timeout)
                .and_then(|()| s.set_write_timeout(timeout)),
            Channel::Tcp(s) => s
                .set_read_timeout(timeout)
                .and_then(|()| s.set_write_timeout(timeout)),
        }
        .map_err(socket_error(url, "setting its timeouts"))
    }

    /// The unix socket, which alone can pass fds.
    pub fn unix(&self) -> Option<&UnixStream> {
        match self {
            Channel::Unix(s) => Some(s),
            Channel::Tcp(_) => None,
        }
    }
}

impl AsFd for Channel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Channel::Unix(s) => s.as_fd(),
            Channel::Tcp(s) => s.as_fd(),
        }
    }
}

impl Read for &Channel {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Channel::Unix(s) => (&*s).read(buf),
            Channel::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Channel {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Channel::Unix(s) => (&*s).write(buf),
            Channel::Tcp(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Waits up to [`ACCEPT_TIMEOUT`] for a listener to have a sender.
fn wait_readable(listener: BorrowedFd<'_>) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout_ms = i32::try_from(ACCEPT_TIMEOUT.as_millis()).unwrap_or(i32::MAX);
    loop {
        // SAFETY: one valid pollfd, for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        match r {
            0 => return Ok(false),
            n if n > 0 => return Ok(true),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}
