//! Tests of `protocol.rs`: the header bytes against Cloud Hypervisor's
//! layout, round trips, the bounds on what a peer sends, and a whole
//! fd-passing exchange over a socketpair.

use std::fs::File;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::os::fd::{AsFd, FromRawFd};

use super::*;

/// A valid length for each command.
fn valid_length(command: Command) -> u64 {
    match command.payload_bound() {
        PayloadBound::Exactly(n) => n,
        PayloadBound::UpTo(_) => 100,
        PayloadBound::Multiple { unit, .. } => 3 * unit,
    }
}

#[test]
fn command_numbers_are_cloud_hypervisors_and_ours() {
    let numbers: Vec<u16> = ALL_COMMANDS.iter().map(|c| c.number()).collect();
    // Cloud Hypervisor's protocol.rs: Start = 1 ... PageFault = 9.
    assert_eq!(
        numbers,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 0x8001, 0x8002, 0x8003, 0x8004]
    );
    for command in ALL_COMMANDS {
        assert_eq!(Command::from_number(command.number()).unwrap(), command);
    }
}

#[test]
fn each_request_header_is_u16_command_6_bytes_u64_length() {
    for command in ALL_COMMANDS {
        let length = valid_length(command);
        let bytes = Request::new(command, length).unwrap().encode();
        let mut expected = Vec::new();
        expected.extend_from_slice(&command.number().to_le_bytes());
        expected.extend_from_slice(&[0; 6]);
        expected.extend_from_slice(&length.to_le_bytes());
        assert_eq!(bytes.as_slice(), expected.as_slice(), "{command:?}");
    }
    // Two spelled out.
    assert_eq!(
        Request::new(Command::MemoryFd, 4).unwrap().encode(),
        [7, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        Request::new(Command::WindowFd, 0x102).unwrap().encode(),
        [0x01, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x01, 0, 0, 0, 0, 0, 0]
    );
    // Start: the version (0) in the first two header bytes.
    assert_eq!(
        Request::start().encode(),
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn each_response_header_is_u16_status_6_bytes_u64_length() {
    assert_eq!(
        Response::ok().encode(),
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        Response::error().encode(),
        [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    for response in [Response::ok(), Response::error()] {
        assert_eq!(Response::decode(&response.encode()).unwrap(), response);
    }
    // An Ok that carries a page (PageFault's answer).
    let page = [
        1, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0x10, 0, 0, 0, 0, 0, 0,
    ];
    let r = Response::decode(&page).unwrap();
    assert_eq!((r.status(), r.length()), (Status::Ok, 0x1000));
}

#[test]
fn requests_round_trip_through_a_stream() {
    let mut wire = Vec::new();
    for command in ALL_COMMANDS {
        Request::new(command, valid_length(command))
            .unwrap()
            .write_to(&mut wire)
            .unwrap();
    }
    let mut reader = Cursor::new(wire);
    for command in ALL_COMMANDS {
        let r = Request::read_from(&mut reader).unwrap();
        assert_eq!((r.command(), r.length()), (command, valid_length(command)));
    }
    let err = Request::read_from(&mut reader).unwrap_err();
    assert!(
        matches!(
            err,
            ProtocolError::Truncated {
                got: 0,
                expected: 16,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn start_carries_the_version_and_residual_header_bytes_are_ignored() {
    assert_eq!(Request::start().sender_protocol_version().unwrap(), 0);
    let residual = [1, 0, 0, 0, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 0, 0, 0, 0, 0];
    assert_eq!(
        Request::decode(&residual)
            .unwrap()
            .sender_protocol_version()
            .unwrap(),
        0
    );
    let newer = [1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let err = Request::decode(&newer)
        .unwrap()
        .sender_protocol_version()
        .unwrap_err();
    assert!(
        matches!(err, ProtocolError::UnsupportedVersion(1)),
        "{err:?}"
    );
    let err = Request::new(Command::Config, 1)
        .unwrap()
        .sender_protocol_version()
        .unwrap_err();
    assert!(
        matches!(err, ProtocolError::NotStart(Command::Config)),
        "{err:?}"
    );
}

#[test]
fn an_unknown_command_or_status_is_refused() {
    for number in [0u16, 10, 0x7fff, 0x8000, 0x8005, 0xffff] {
        let mut bytes = [0; HEADER_LEN];
        bytes[..2].copy_from_slice(&number.to_le_bytes());
        let err = Request::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtocolError::UnknownCommand(n) if n == number),
            "{err:?}"
        );
    }
    let err = Response::decode(&[3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap_err();
    assert!(matches!(err, ProtocolError::UnknownStatus(3)), "{err:?}");
}

#[test]
fn a_length_outside_the_commands_bound_is_refused() {
    let cases = [
        (Command::Start, 1),
        (Command::Complete, 8),
        (Command::MemoryFd, 5),
        (Command::PageFault, 32),
        (Command::Config, 0),
        (Command::Config, MAX_CONFIG_PAYLOAD + 1),
        (Command::State, MAX_STATE_PAYLOAD + 1),
        (Command::State, u64::MAX),
        (Command::Memory, 17),
        (Command::Memory, MAX_MEMORY_TABLE_PAYLOAD + 16),
        (Command::WindowFd, MAX_FD_LABEL_PAYLOAD + 1),
        (Command::TapFd, 0),
        (Command::DiskFd, 0),
        (Command::VsockFd, MAX_FD_LABEL_PAYLOAD + 1),
    ];
    for (command, length) in cases {
        let mut bytes = [0; HEADER_LEN];
        bytes[..2].copy_from_slice(&command.number().to_le_bytes());
        bytes[8..].copy_from_slice(&length.to_le_bytes());
        let err = Request::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtocolError::BadLength { command: c, length: l, .. } if c == command && l == length),
            "{command:?} {length}: {err:?}"
        );
        assert!(Request::new(command, length).is_err(), "not sent either");
    }
    // Responses: a payload on Ok, at most the largest page, and a reason
    // on Error, at most MAX_ERROR_REASON; none on Invalid.
    let mut error_with_payload = Response::error().encode();
    error_with_payload[8..].copy_from_slice(&(MAX_ERROR_REASON + 1).to_le_bytes());
    assert!(matches!(
        Response::decode(&error_with_payload).unwrap_err(),
        ProtocolError::BadResponseLength {
            status: Status::Error,
            max: MAX_ERROR_REASON,
            ..
        }
    ));
    let mut invalid_with_payload = [0u8; HEADER_LEN];
    invalid_with_payload[8] = 1;
    assert!(matches!(
        Response::decode(&invalid_with_payload).unwrap_err(),
        ProtocolError::BadResponseLength {
            status: Status::Invalid,
            max: 0,
            ..
        }
    ));
    let mut huge = Response::ok().encode();
    huge[8..].copy_from_slice(&(MAX_RESPONSE_PAYLOAD + 1).to_le_bytes());
    assert!(matches!(
        Response::decode(&huge).unwrap_err(),
        ProtocolError::BadResponseLength {
            status: Status::Ok,
            ..
        }
    ));
}

#[test]
fn a_short_payload_is_an_error() {
    let request = Request::new(Command::State, 10).unwrap();
    let err = read_payload(&mut Cursor::new(b"0123".to_vec()), &request).unwrap_err();
    assert!(
        matches!(
            err,
            ProtocolError::Truncated {
                what: "payload",
                got: 4,
                expected: 10
            }
        ),
        "{err:?}"
    );
    // Exactly the announced bytes are taken; what follows is the next header.
    let mut reader = Cursor::new(b"0123456789rest".to_vec());
    assert_eq!(read_payload(&mut reader, &request).unwrap(), b"0123456789");
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"rest");
    let err = Request::read_from(&mut Cursor::new(vec![1u8; 15])).unwrap_err();
    assert!(
        matches!(
            err,
            ProtocolError::Truncated {
                got: 15,
                expected: 16,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn ranges_and_slots_round_trip_and_overflow_is_refused() {
    let ranges = [
        MemoryRange {
            gpa: 0x1000,
            length: 0x2000,
        },
        MemoryRange {
            gpa: 1 << 32,
            length: 1 << 30,
        },
    ];
    let payload: Vec<u8> = ranges.iter().flat_map(|r| r.encode()).collect();
    assert_eq!(
        payload[..16],
        [0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(decode_ranges(Command::Memory, &payload).unwrap(), ranges);
    assert_eq!(
        decode_ranges(Command::PageFault, &payload[..16]).unwrap(),
        ranges[..1]
    );
    let bad = MemoryRange {
        gpa: u64::MAX - 1,
        length: 2,
    };
    let payload: Vec<u8> = [ranges[0], bad].iter().flat_map(|r| r.encode()).collect();
    assert!(matches!(
        decode_ranges(Command::Memory, &payload).unwrap_err(),
        ProtocolError::RangeOverflow { index: 1, .. }
    ));
    assert!(decode_ranges(Command::Memory, &payload[..20]).is_err());
    assert!(decode_ranges(Command::State, &payload).is_err());

    assert_eq!(encode_memory_fd_slot(0x0102_0304), [4, 3, 2, 1]);
    assert_eq!(decode_memory_fd_slot(&[4, 3, 2, 1]).unwrap(), 0x0102_0304);
    assert!(decode_memory_fd_slot(&[4, 3, 2]).is_err());
}

#[test]
fn labels_round_trip_and_a_wrong_one_is_refused() {
    let window = FdLabel {
        device: "fs0".to_string(),
        key: Some([0x803, 1234]),
    };
    assert_eq!(window.encode(), br#"{"device":"fs0","key":[2051,1234]}"#);
    assert_eq!(
        FdLabel::decode(Command::WindowFd, &window.encode()).unwrap(),
        window
    );
    let tap = FdLabel {
        device: "net0".to_string(),
        key: None,
    };
    assert_eq!(tap.encode(), br#"{"device":"net0"}"#);
    assert_eq!(FdLabel::decode(Command::TapFd, &tap.encode()).unwrap(), tap);
    let disk = FdLabel {
        device: "disk0".to_string(),
        key: None,
    };
    assert_eq!(
        FdLabel::decode(Command::DiskFd, &disk.encode()).unwrap(),
        disk
    );
    let vsock = FdLabel {
        device: "vsock0".to_string(),
        key: None,
    };
    assert_eq!(
        FdLabel::decode(Command::VsockFd, &vsock.encode()).unwrap(),
        vsock
    );

    let refused = [
        (Command::WindowFd, tap.encode()),
        (Command::TapFd, window.encode()),
        (Command::TapFd, br#"{"device":""}"#.to_vec()),
        (Command::WindowFd, br#"{"device":"fs0","key":[1]}"#.to_vec()),
        (Command::WindowFd, b"\xff\x00garbage".to_vec()),
        (Command::TapFd, vec![b' '; 5000]),
        (Command::MemoryFd, tap.encode()),
        (Command::DiskFd, window.encode()),
        (Command::DiskFd, br#"{"device":""}"#.to_vec()),
        (Command::VsockFd, window.encode()),
        (Command::VsockFd, vec![b' '; 5000]),
    ];
    for (command, payload) in refused {
        assert!(
            FdLabel::decode(command, &payload).is_err(),
            "{command:?} {:?}",
            String::from_utf8_lossy(&payload)
        );
    }
}

fn memfd_with(content: &[u8]) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vm-state-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd was just created and is owned by nobody else.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    std::io::Write::write_all(&mut f, content).unwrap();
    f
}

fn content_of(fd: OwnedFd) -> Vec<u8> {
    let mut f = File::from(fd);
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    out
}

#[test]
fn a_local_migrations_fd_exchange_over_a_socketpair() {
    let (source, destination) = UnixStream::pair().unwrap();
    let ram = memfd_with(b"guest memory");
    let mapped = memfd_with(b"a file in the window");
    let label = FdLabel {
        device: "fs0".to_string(),
        key: Some([1, 2]),
    };

    let mut s = &source;
    Request::start().write_to(&mut s).unwrap();
    send_request_with_fd(
        &source,
        Command::MemoryFd,
        &encode_memory_fd_slot(3),
        ram.as_fd(),
    )
    .unwrap();
    send_request_with_fd(&source, Command::WindowFd, &label.encode(), mapped.as_fd()).unwrap();
    Request::new(Command::Abandon, 0)
        .unwrap()
        .write_to(&mut s)
        .unwrap();

    let mut d = &destination;
    let start = Request::read_from(&mut d).unwrap();
    assert_eq!(start.sender_protocol_version().unwrap(), 0);
    Response::ok().write_to(&mut d).unwrap();

    let request = Request::read_from(&mut d).unwrap();
    assert_eq!(request.command(), Command::MemoryFd);
    let (payload, fd) = recv_payload_with_fd(&destination, &request).unwrap();
    assert_eq!(decode_memory_fd_slot(&payload).unwrap(), 3);
    assert_eq!(content_of(fd), b"guest memory");

    let request = Request::read_from(&mut d).unwrap();
    assert_eq!(request.command(), Command::WindowFd);
    let (payload, fd) = recv_payload_with_fd(&destination, &request).unwrap();
    assert_eq!(FdLabel::decode(Command::WindowFd, &payload).unwrap(), label);
    assert_eq!(content_of(fd), b"a file in the window");

    assert_eq!(
        Request::read_from(&mut d).unwrap().command(),
        Command::Abandon
    );
    let response = Response::read_from(&mut s).unwrap();
    assert_eq!(response.status(), Status::Ok);
}

#[test]
fn a_payload_that_should_pass_an_fd_and_does_not_is_refused() {
    let (source, destination) = UnixStream::pair().unwrap();
    let mut s = &source;
    // A peer that announces MemoryFd and writes the slot without its fd.
    Request::new(Command::MemoryFd, 4)
        .unwrap()
        .write_to(&mut s)
        .unwrap();
    std::io::Write::write_all(&mut s, &[1, 0, 0, 0]).unwrap();
    let mut d = &destination;
    let request = Request::read_from(&mut d).unwrap();
    let err = recv_payload_with_fd(&destination, &request).unwrap_err();
    assert!(
        matches!(err, ProtocolError::MissingFd(Command::MemoryFd)),
        "{err:?}"
    );
    // Commands that pass no fd are refused on both ends.
    let f = memfd_with(b"x");
    assert!(matches!(
        send_request_with_fd(&source, Command::State, b"{}", f.as_fd()).unwrap_err(),
        ProtocolError::NoFdCommand(Command::State)
    ));
    let state = Request::new(Command::State, 2).unwrap();
    assert!(matches!(
        recv_payload_with_fd(&destination, &state).unwrap_err(),
        ProtocolError::NoFdCommand(Command::State)
    ));
}

/// An Error response carries the receiver's reason, cut to the bound at a
/// character boundary, control characters blanked on reading; a plain
/// Error (Cloud Hypervisor's) has none.
#[test]
fn an_error_carries_its_reason() {
    let mut wire = Vec::new();
    Response::write_error_with_reason(
        &mut wire,
        "State: restore: data.bin:\nis not the saved file",
    )
    .unwrap();
    let mut reader = &wire[..];
    let response = Response::read_from(&mut reader).unwrap();
    assert_eq!(response.status(), Status::Error);
    assert_eq!(
        response.read_reason(&mut reader).unwrap().as_deref(),
        Some("State: restore: data.bin: is not the saved file")
    );
    assert!(reader.is_empty());

    let long = "é".repeat(1000);
    let mut wire = Vec::new();
    Response::write_error_with_reason(&mut wire, &long).unwrap();
    let mut reader = &wire[..];
    let response = Response::read_from(&mut reader).unwrap();
    assert!(response.length() <= MAX_ERROR_REASON);
    let reason = response.read_reason(&mut reader).unwrap().unwrap();
    assert!(long.starts_with(&reason) && !reason.is_empty());

    let mut reader = &Response::error().encode()[..];
    let response = Response::read_from(&mut reader).unwrap();
    assert_eq!(response.read_reason(&mut reader).unwrap(), None);
}

#[test]
fn a_reason_is_cut_on_a_character_boundary_and_made_printable() {
    // "é" is two bytes: a cut inside it steps back before it.
    assert_eq!(cut_at_char_boundary("aé", 2), "a");
    assert_eq!(cut_at_char_boundary("aé", 3), "aé");
    assert_eq!(cut_at_char_boundary("abc", 0), "");
    assert_eq!(cut_at_char_boundary("abc", 99), "abc");
    assert_eq!(
        printable_reason(b" no such\nfile\x1b[0m \xff ").as_deref(),
        Some("no such file [0m \u{fffd}")
    );
    assert_eq!(printable_reason(b" \n\t "), None);
    assert_eq!(printable_reason(b""), None);
}
