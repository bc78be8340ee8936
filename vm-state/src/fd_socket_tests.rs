//! Tests of `fd_socket.rs`: fds over a socketpair, and each way a peer can
//! send too many, too few or too short.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;

use super::*;

/// A file holding `content`, read from its start.
fn file_with(content: &[u8]) -> File {
    let mut f = tempfile();
    f.write_all(content).unwrap();
    f
}

fn tempfile() -> File {
    // A memfd: a file with no name, nothing left behind.
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vm-state-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: fd was just created and is owned by nobody else.
    File::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn content_of(fd: OwnedFd) -> Vec<u8> {
    let mut f = File::from(fd);
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    out
}

fn is_cloexec(fd: &OwnedFd) -> bool {
    // SAFETY: F_GETFD on an fd we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    flags & libc::FD_CLOEXEC != 0
}

#[test]
fn fds_travel_with_their_bytes_and_read_the_same_files() {
    let (a, b) = UnixStream::pair().unwrap();
    let one = file_with(b"first file");
    let two = file_with(b"second file");
    send_with_fds(&a, b"label", &[one.as_fd(), two.as_fd()]).unwrap();
    let mut buf = [0u8; 5];
    let fds = recv_with_fds(&b, &mut buf, 2).unwrap();
    assert_eq!(&buf, b"label");
    assert_eq!(fds.len(), 2);
    assert!(fds.iter().all(is_cloexec), "received fds are close-on-exec");
    let mut fds = fds.into_iter();
    assert_eq!(content_of(fds.next().unwrap()), b"first file");
    assert_eq!(content_of(fds.next().unwrap()), b"second file");
}

#[test]
fn bytes_without_fds_are_received_as_such() {
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(b"abc").unwrap();
    a.write_all(b"def").unwrap();
    let mut buf = [0u8; 6];
    assert!(recv_with_fds(&b, &mut buf, 1).unwrap().is_empty());
    assert_eq!(&buf, b"abcdef");
}

#[test]
fn more_fds_than_the_payload_carries_are_refused() {
    let (a, b) = UnixStream::pair().unwrap();
    let f = file_with(b"x");
    send_with_fds(&a, b"12345678", &[f.as_fd(), f.as_fd()]).unwrap();
    let mut buf = [0u8; 8];
    let err = recv_with_fds(&b, &mut buf, 1).unwrap_err();
    assert!(
        matches!(err, FdSocketError::TooManyFds { got: 2, max: 1 }),
        "{err:?}"
    );
}

#[test]
fn more_fds_than_a_receive_has_room_for_are_refused() {
    let (a, b) = UnixStream::pair().unwrap();
    let f = file_with(b"x");
    // Past our own sender's cap: a peer that does not keep it.
    let raw = vec![f.as_raw_fd(); 16];
    a.send_with_fds(&[&b"x"[..]], &raw).unwrap();
    let mut buf = [0u8; 1];
    let err = recv_with_fds(&b, &mut buf, MAX_FDS_PER_MESSAGE).unwrap_err();
    assert!(matches!(err, FdSocketError::ControlTruncated), "{err:?}");
}

#[test]
fn an_end_of_stream_before_the_payload_is_whole_is_an_error() {
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(b"abc").unwrap();
    drop(a);
    let mut buf = [0u8; 8];
    let err = recv_with_fds(&b, &mut buf, 1).unwrap_err();
    assert!(
        matches!(
            err,
            FdSocketError::Truncated {
                got: 3,
                expected: 8
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_send_the_receiver_would_refuse_is_refused() {
    let (a, _b) = UnixStream::pair().unwrap();
    let f = file_with(b"x");
    let err = send_with_fds(&a, b"", &[f.as_fd()]).unwrap_err();
    assert!(matches!(err, FdSocketError::EmptyPayload), "{err:?}");
    let five = [f.as_fd(), f.as_fd(), f.as_fd(), f.as_fd(), f.as_fd()];
    let err = send_with_fds(&a, b"x", &five).unwrap_err();
    assert!(
        matches!(err, FdSocketError::TooManyToSend { count: 5 }),
        "{err:?}"
    );
}
