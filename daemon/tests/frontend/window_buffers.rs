//! READ and WRITE whose buffers lie in the DAX window, as a guest program
//! makes them when it `read()`s a file with `O_DIRECT` into a DAX mapping
//! of another file, then `write()`s from that mapping to a third: the real
//! daemon serves them by copying between the files behind the window, and
//! refuses (EFAULT) every buffer it cannot place, while it keeps serving.

use super::http::http;
use super::*;

/// Where the test puts the window in guest-physical memory: above the
/// 16 MiB of guest RAM, as a PCI BAR would be.
const WINDOW_GPA: u64 = 0x1_0000_0000;
const CHUNK: u32 = 64 * 1024;

pub(super) fn lookup(guest: &mut Guest, name: &str) -> abi::EntryOut {
    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, format!("{name}\0").as_bytes());
    assert_eq!(e, 0, "LOOKUP {name}");
    obj(&p)
}

pub(super) fn open(guest: &mut Guest, nodeid: u64, flags: i32) -> u64 {
    let o = abi::OpenIn {
        flags: flags.cast_unsigned(),
        open_flags: 0,
    };
    let (e, p) = guest.call(opcode::OPEN, nodeid, o.as_slice());
    assert_eq!(e, 0, "OPEN");
    obj::<abi::OpenOut>(&p).fh
}

fn map(guest: &mut Guest, nodeid: u64, foffset: u64, moffset: u64, writable: bool) {
    let m = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset,
        len: 2 * MIB,
        flags: if writable { 3 } else { 2 },
        moffset,
    };
    assert_eq!(guest.call(opcode::SETUPMAPPING, nodeid, m.as_slice()).0, 0);
}

/// READ of `len` bytes at `offset` into guest-physical `dest`: (errno,
/// bytes the reply says were read).
pub(super) fn read_into(
    guest: &mut Guest,
    nodeid: u64,
    fh: u64,
    offset: u64,
    dest: u64,
) -> (i32, u32) {
    let r = abi::ReadIn {
        fh,
        offset,
        size: CHUNK,
        ..Default::default()
    };
    let slot = guest.post_with(
        opcode::READ,
        nodeid,
        r.as_slice(),
        &[],
        16,
        &[(dest, CHUNK)],
    );
    guest.kick_and_wait();
    reply_len(guest, slot)
}

/// WRITE of `CHUNK` bytes from guest-physical `src` at `offset`.
fn write_from(guest: &mut Guest, nodeid: u64, fh: u64, offset: u64, src: u64) -> (i32, u32) {
    let w = abi::WriteIn {
        fh,
        offset,
        size: CHUNK,
        ..Default::default()
    };
    let slot = guest.post_with(
        opcode::WRITE,
        nodeid,
        w.as_slice(),
        &[(src, CHUNK)],
        0x1000,
        &[],
    );
    guest.kick_and_wait();
    let (errno, _) = reply_len(guest, slot);
    if errno != 0 {
        return (errno, 0);
    }
    let out: abi::WriteOut = guest
        .mem
        .read_obj(GuestAddress(REPLY_BASE + slot * 0x1000 + 16))
        .unwrap();
    (0, out.size)
}

fn reply_len(guest: &Guest, slot: u64) -> (i32, u32) {
    let out: OutHeader = guest
        .mem
        .read_obj(GuestAddress(REPLY_BASE + slot * 0x1000))
        .unwrap();
    (-out.error, out.len.saturating_sub(16))
}

fn stats(control: &Path) -> serde_json::Value {
    let (status, body) = http(control, "GET", "/api/v1/stats", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn reads_and_writes_with_buffers_in_the_window_go_through_the_files_mapped_there() {
    let share = TempDir::new().unwrap();
    let src: Vec<u8> = (0..MIB).map(|i| (i * 13 % 251) as u8).collect();
    std::fs::write(share.as_path().join("src.bin"), &src).unwrap();
    std::fs::write(share.as_path().join("map.bin"), vec![0u8; index(4 * MIB)]).unwrap();
    std::fs::write(share.as_path().join("out.bin"), b"").unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let control = sockdir.as_path().join("control.sock");
    let control_arg = control.to_str().unwrap();
    let mut daemon =
        start_daemon_with(share.as_path(), &socket, &["--control-socket", control_arg]);
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    fs.set_shm_base(WINDOW_GPA);
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);

    let mapped = lookup(&mut guest, "map.bin");
    let source = lookup(&mut guest, "src.bin");
    let out = lookup(&mut guest, "out.bin");
    // map.bin [0, 2M) writable at window offset 0; src.bin [0, 2M) read-only at 2M.
    map(&mut guest, mapped.nodeid, 0, 0, true);
    map(&mut guest, source.nodeid, 0, 2 * MIB, false);
    let src_fh = open(&mut guest, source.nodeid, libc::O_RDONLY);
    let out_fh = open(&mut guest, out.nodeid, libc::O_RDWR);
    let buffer = WINDOW_GPA + 0x3000;

    // Before the VMM says where the window is, the buffer is nowhere.
    assert_eq!(
        read_into(&mut guest, source.nodeid, src_fh, 0, buffer).0,
        libc::EFAULT
    );

    let location = format!(r#"{{"gpa": {WINDOW_GPA}, "size": {WINDOW}}}"#);
    let (status, body) = http(&control, "PUT", "/api/v1/window/location", &location);
    assert_eq!(status, 204, "{body}");
    let (status, body) = http(
        &control,
        "PUT",
        "/api/v1/window/location",
        r#"{"gpa": 4097, "size": 4096}"#,
    );
    assert_eq!(status, 400, "an unaligned location is refused");
    assert!(body.contains("window/location"), "{body}");

    // read(src, mapping of map.bin + 0x3000): the bytes land in map.bin,
    // which is what the guest's mapping shows (the VMM's window too).
    let at = 4096 * 5;
    assert_eq!(
        read_into(&mut guest, source.nodeid, src_fh, at, buffer),
        (0, CHUNK)
    );
    let host_map = std::fs::read(share.as_path().join("map.bin")).unwrap();
    let want = &src[index(at)..index(at + u64::from(CHUNK))];
    assert_eq!(&host_map[0x3000..0x3000 + CHUNK as usize], want);
    assert_eq!(window_byte(&fs, 0x3000 + 77), want[77]);

    // write(out, mapping + 0x3000): out.bin gets what the mapping holds.
    assert_eq!(
        write_from(&mut guest, out.nodeid, out_fh, 0, buffer),
        (0, CHUNK)
    );
    assert_eq!(
        std::fs::read(share.as_path().join("out.bin")).unwrap(),
        want
    );
    // Writing from a read-only mapping is reading it: allowed.
    assert_eq!(
        write_from(
            &mut guest,
            out.nodeid,
            out_fh,
            u64::from(CHUNK),
            WINDOW_GPA + 2 * MIB
        ),
        (0, CHUNK)
    );
    let out_bytes = std::fs::read(share.as_path().join("out.bin")).unwrap();
    assert_eq!(&out_bytes[CHUNK as usize..], &src[..CHUNK as usize]);

    // Refused, each alone, while the daemon goes on serving:
    // a read into the read-only mapping (it would write src.bin),
    assert_eq!(
        read_into(&mut guest, source.nodeid, src_fh, 0, WINDOW_GPA + 2 * MIB).0,
        libc::EFAULT
    );
    // a buffer over the unmapped part of the window, or across the end of
    // what is mapped,
    assert_eq!(
        read_into(&mut guest, source.nodeid, src_fh, 0, WINDOW_GPA + 6 * MIB).0,
        libc::EFAULT
    );
    assert_eq!(
        write_from(
            &mut guest,
            out.nodeid,
            out_fh,
            0,
            WINDOW_GPA + 4 * MIB - 4096
        )
        .0,
        libc::EFAULT
    );
    // a buffer across the window's own end (not the window's to place),
    assert_eq!(
        read_into(
            &mut guest,
            source.nodeid,
            src_fh,
            0,
            WINDOW_GPA + WINDOW - 4096
        )
        .0,
        libc::EFAULT
    );
    // a buffer past a mapped file's end (src.bin is 1 MiB, mapped 2 MiB),
    assert_eq!(
        write_from(&mut guest, out.nodeid, out_fh, 0, WINDOW_GPA + 3 * MIB).0,
        libc::EFAULT
    );
    // and a buffer in a range the guest has unmapped again.
    let unmap = [
        abi::RemovemappingIn { count: 1 }.as_slice(),
        abi::RemovemappingOne {
            moffset: 0,
            len: 2 * MIB,
        }
        .as_slice(),
    ]
    .concat();
    assert_eq!(
        guest.call(opcode::REMOVEMAPPING, mapped.nodeid, &unmap).0,
        0
    );
    assert_eq!(
        read_into(&mut guest, source.nodeid, src_fh, 0, buffer).0,
        libc::EFAULT
    );
    // map.bin kept only what the one good read put there.
    let host_map = std::fs::read(share.as_path().join("map.bin")).unwrap();
    assert_eq!(&host_map[0x3000..0x3000 + CHUNK as usize], want);
    assert!(host_map[..0x3000].iter().all(|&b| b == 0));

    let s = stats(&control);
    assert_eq!(s["window_buffer_ios"], 3, "{s}");
    assert_eq!(s["window_buffer_bytes"], 3 * u64::from(CHUNK), "{s}");
    assert_eq!(s["window_buffer_refusals"], 5, "{s}");
    assert_eq!(s["window_location"]["gpa"], WINDOW_GPA, "{s}");
    // Ordinary requests still work.
    assert_eq!(lookup(&mut guest, "src.bin").nodeid, source.nodeid);
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}
