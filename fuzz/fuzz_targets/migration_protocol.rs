//! The migration socket as a hostile peer writes it: any bytes are read as
//! a stream of requests (header, then payload, decoded by command) and as
//! responses. Nothing panics, every decoded header's length is within its
//! command's bound (and so within `MAX_PAYLOAD`), and a decoded header
//! encodes back to the same 16 bytes.
#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use vm_state::protocol::{
    decode_memory_fd_slot, decode_ranges, read_payload, Command, FdLabel, Request, Response,
    HEADER_LEN, MAX_PAYLOAD, MAX_RESPONSE_PAYLOAD,
};
use vm_state::StateDocument;

fuzz_target!(|data: &[u8]| {
    // Each 16-byte window as one header of either kind.
    for window in data.windows(HEADER_LEN) {
        let Ok(bytes) = <[u8; HEADER_LEN]>::try_from(window) else {
            continue;
        };
        if let Ok(request) = Request::decode(&bytes) {
            assert!(request.length() <= MAX_PAYLOAD);
            assert!(request.command().payload_bound().admits(request.length()));
            assert_eq!(request.encode(), bytes);
        }
        if let Ok(response) = Response::decode(&bytes) {
            assert!(response.length() <= MAX_RESPONSE_PAYLOAD);
        }
    }
    // The whole input as the stream a receiver reads.
    let mut stream = Cursor::new(data);
    while let Ok(request) = Request::read_from(&mut stream) {
        let Ok(payload) = read_payload(&mut stream, &request) else {
            break;
        };
        assert_eq!(u64::try_from(payload.len()).ok(), Some(request.length()));
        match request.command() {
            Command::Memory | Command::PageFault => {
                if let Ok(ranges) = decode_ranges(request.command(), &payload) {
                    assert!(ranges.iter().all(|r| r.gpa.checked_add(r.length).is_some()));
                }
            }
            Command::MemoryFd => {
                decode_memory_fd_slot(&payload).expect("a bounded MemoryFd payload is a slot");
            }
            Command::WindowFd | Command::TapFd | Command::DiskFd | Command::VsockFd => {
                if let Ok(label) = FdLabel::decode(request.command(), &payload) {
                    assert!(!label.device.is_empty());
                }
            }
            Command::State => {
                let _ = StateDocument::from_json(&payload);
            }
            _ => {}
        }
    }
});
