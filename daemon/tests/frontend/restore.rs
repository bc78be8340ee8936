//! A snapshot and restore of the fs device with its DAX window alive, with
//! the daemon binary on both sides: the guest maps three ranges of two
//! files and opens both, the device is paused and saved, the daemon is
//! killed, a fresh one starts on the same socket and share, and a new
//! device restored from the saved state finds the same window (the new
//! daemon mapped its record again), the same handles and the same queue.

use std::process::Stdio;

use virtio_devices::device_state::SavedQueue;

use super::window_buffers::{lookup, open};
use super::*;

const WINDOW_GPA: u64 = 0x1_0000_0000;

/// Starts the daemon with its log (stderr) going to `log`.
fn start_daemon_logging(share: &Path, socket: &Path, log: &Path) -> Child {
    let _ = std::fs::remove_file(socket);
    let child = Command::new(env!("CARGO_BIN_EXE_dax-virtiofsd"))
        .args(["--sandbox", "none", "--cache-size", "8M"])
        .args(["--log-level", "warn"])
        .arg("--socket-path")
        .arg(socket)
        .arg("--shared-dir")
        .arg(share)
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()))
        .spawn()
        .expect("spawning dax-virtiofsd");
    test_infra::host::wait_for_path(socket);
    child
}

fn pattern(seed: u64) -> Vec<u8> {
    (0..4 * MIB).map(|i| ((i * seed) % 251) as u8).collect()
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

/// What the first VMM left: the share, the socket, the saved state, the
/// queues' positions, the guest's ring (in `mem`) and its nodes/handles.
struct Saved {
    state: serde_json::Value,
    queues: Vec<SavedQueue>,
    a: (u64, u64),
    b: (u64, u64),
}

/// The first VMM's life: a.bin mapped at window offsets 0 and 2M
/// (read-only, file offsets 0 and 2M), b.bin at 4M (read-write), both
/// open; then pause, save, and the daemon is gone.
fn first_life(share: &Path, socket: &Path, mem: &GuestMemoryMmap) -> (Saved, Guest<'static>) {
    let mut daemon = start_daemon(share, socket);
    let mut fs = VhostUserFs::connect(&fs_config(socket)).expect("negotiation");
    fs.check_movable().expect("our daemon hands over its state");
    fs.set_shm_base(WINDOW_GPA);
    // The guest outlives this device: the test leaks its memory reference.
    let mem: &'static GuestMemoryMmap = Box::leak(Box::new(mem.clone()));
    let mut guest = activate(&mut fs, mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let a = lookup(&mut guest, "a.bin").nodeid;
    let b = lookup(&mut guest, "b.bin").nodeid;
    let fh_a = open(&mut guest, a, libc::O_RDONLY);
    let fh_b = open(&mut guest, b, libc::O_RDWR);
    map(&mut guest, a, 0, 0, false);
    map(&mut guest, a, 2 * MIB, 2 * MIB, false);
    map(&mut guest, b, 0, 4 * MIB, true);
    let queues = fs.pause().expect("pause");
    assert_eq!(queues.len(), 2);
    assert_eq!(queues[1].next_avail, guest.next, "every request was taken");
    let state = fs.save_state().expect("save");
    drop(fs);
    assert!(daemon.wait().unwrap().success(), "the old daemon exits");
    (
        Saved {
            state,
            queues,
            a: (a, fh_a),
            b: (b, fh_b),
        },
        guest,
    )
}

/// Activates `fs` with the saved queues, as the transport does after a
/// restore; the guest's interrupts come on a new channel.
fn activate_saved(fs: &mut VhostUserFs, mem: &GuestMemoryMmap, saved: &Saved, guest: &mut Guest) {
    let (tx, rx) = channel();
    guest.irq = rx;
    let kicks = [
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        guest.kick.try_clone().unwrap(),
    ];
    let queues = saved
        .queues
        .iter()
        .zip(kicks)
        .zip(0u16..)
        .map(|((q, kick), index)| ActivatedQueue {
            index,
            queue: q.to_queue().unwrap(),
            kick,
        })
        .collect();
    let irq = Irq {
        relayed: Mutex::new(tx),
        irqfd: None,
    };
    fs.activate(GuestMemoryAtomic::new(mem.clone()), Arc::new(irq), queues)
        .expect("activate from the saved queues");
}

fn read_fh(guest: &mut Guest, nodeid: u64, fh: u64, offset: u64) -> Vec<u8> {
    let r = abi::ReadIn {
        fh,
        offset,
        size: 64,
        ..Default::default()
    };
    let (e, p) = guest.call(opcode::READ, nodeid, r.as_slice());
    assert_eq!(e, 0, "READ of handle {fh}");
    p
}

fn share_and_socket() -> (TempDir, TempDir, std::path::PathBuf) {
    let share = TempDir::new().unwrap();
    std::fs::write(share.as_path().join("a.bin"), pattern(7)).unwrap();
    std::fs::write(share.as_path().join("b.bin"), pattern(13)).unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    (share, sockdir, socket)
}

#[test]
fn a_restored_device_has_its_window_handles_and_queue_again() {
    let (share, _sockdir, socket) = share_and_socket();
    let mem = guest_memory();
    let (saved, mut guest) = first_life(share.as_path(), &socket, &mem);

    // A request the guest put on the ring while the VM was saved: the
    // restored device serves it without a new kick.
    let r = abi::ReadIn {
        fh: saved.b.1,
        offset: 0,
        size: 64,
        ..Default::default()
    };
    let pending = guest.post(opcode::READ, saved.b.0, r.as_slice());

    let mut daemon = start_daemon(share.as_path(), &socket);
    let mut fs = VhostUserFs::connect_retrying(&fs_config(&socket), Duration::from_secs(60))
        .expect("the new daemon");
    fs.restore_state(&saved.state).expect("restore");
    fs.set_shm_base(WINDOW_GPA);
    let w = fs.window().unwrap();
    assert_eq!(w.guest_base(), WINDOW_GPA);
    let (pa, pb) = (pattern(7), pattern(13));
    for off in [0, 4095, MIB + 3, 2 * MIB - 1] {
        assert_eq!(window_byte(&fs, off), pa[index(off)], "a at {off}");
        assert_eq!(
            window_byte(&fs, 2 * MIB + off),
            pa[index(2 * MIB + off)],
            "a+2M at {off}"
        );
        assert_eq!(
            window_byte(&fs, 4 * MIB + off),
            pb[index(off)],
            "b at {off}"
        );
    }
    let m = &fs.window().unwrap().metrics;
    assert_eq!(
        m.restored_ranges.load(std::sync::atomic::Ordering::Relaxed),
        3,
        "three ranges mapped again from the record"
    );
    let record = fs.window().unwrap().mappings();
    assert_eq!(record.mappings.len(), 3);
    assert!(record.mappings[2].writable && !record.mappings[0].writable);

    activate_saved(&mut fs, &mem, &saved, &mut guest);
    let deadline = Instant::now() + PATIENCE;
    loop {
        let used: u16 = mem.read_obj(guest.used_ring.unchecked_add(2)).unwrap();
        if used == guest.next {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pending request was not served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, e, p) = guest.reply(pending);
    assert_eq!((e, &p[..]), (0, &pb[..64]));
    // Both handles still read, and the next request is answered.
    assert_eq!(
        read_fh(&mut guest, saved.a.0, saved.a.1, 2 * MIB),
        &pa[index(2 * MIB)..index(2 * MIB + 64)]
    );
    assert_eq!(read_fh(&mut guest, saved.b.0, saved.b.1, 64), &pb[64..128]);
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}

#[test]
fn a_share_that_lost_a_mapped_file_fails_the_restore_and_both_sides_name_it() {
    let (share, sockdir, socket) = share_and_socket();
    let mem = guest_memory();
    let (saved, _guest) = first_life(share.as_path(), &socket, &mem);
    std::fs::remove_file(share.as_path().join("b.bin")).unwrap();
    let log = sockdir.as_path().join("daemon.log");
    let mut daemon = start_daemon_logging(share.as_path(), &socket, &log);
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("the new daemon");
    let e = fs.restore_state(&saved.state).unwrap_err().to_string();
    // The daemon's reason comes back to the VMM, naming the file.
    assert!(
        e.contains("fs0") && e.contains("refused the saved state") && e.contains("b.bin"),
        "{e}"
    );
    assert!(
        fs.window().unwrap().mappings().mappings.is_empty(),
        "nothing left mapped"
    );
    drop(fs);
    let _ = daemon.wait();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("b.bin"), "{log}");
}

#[test]
fn a_record_that_differs_from_what_the_daemon_maps_is_refused_naming_the_offset() {
    let (share, _sockdir, socket) = share_and_socket();
    let mem = guest_memory();
    let (mut saved, _guest) = first_life(share.as_path(), &socket, &mem);
    let mapping = &mut saved.state["window"]["record"]["state"]["mappings"][1];
    assert_eq!(mapping["shm_offset"], 2 * MIB);
    mapping["fd_offset"] = serde_json::json!(0);
    let mut daemon = start_daemon(share.as_path(), &socket);
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("the new daemon");
    let e = fs.restore_state(&saved.state).unwrap_err().to_string();
    assert!(
        e.contains("window offset 0x200000") && e.contains("window.record") && e.contains("ino"),
        "{e}"
    );
    assert!(
        fs.window().unwrap().mappings().mappings.is_empty(),
        "nothing left mapped"
    );
    drop(fs);
    let _ = daemon.wait();
}

#[test]
fn a_device_resumed_after_a_snapshot_serves_its_queue_again() {
    let (share, _sockdir, socket) = share_and_socket();
    let mut daemon = start_daemon(share.as_path(), &socket);
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    let mut guest = activate(&mut fs, &mem);
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let a = lookup(&mut guest, "a.bin").nodeid;
    let fh = open(&mut guest, a, libc::O_RDONLY);
    let queues = fs.pause().expect("pause");
    fs.save_state().expect("save");
    // A paused device's daemon serves nothing; resumed, it does again.
    assert_eq!(queues[1].next_avail, guest.next);
    fs.resume().expect("resume");
    assert_eq!(read_fh(&mut guest, a, fh, 0), &pattern(7)[..64]);
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}

/// A daemon (this crate's, in this process) that does not offer
/// DEVICE_STATE, as one of another project may not: the device refuses to
/// be moved, naming itself and the socket, before anything is paused.
#[test]
fn a_daemon_without_device_state_makes_the_device_refuse_to_move_by_name() {
    use daemon::backend::FsBackend;
    use daemon::dax::DaxMapper;
    use daemon::fuse::server::Server;
    use daemon::passthrough::{openat, CachePolicy, PassthroughFs};
    use daemon::policy::DaxPolicy;

    let (share, _sockdir, socket) = share_and_socket();
    let path = std::ffi::CString::new(share.as_path().to_str().unwrap()).unwrap();
    let root = openat(libc::AT_FDCWD, &path, libc::O_PATH, 0).unwrap();
    let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
    let policy = Arc::new(DaxPolicy::new(policies::Policy::default()));
    let fs = PassthroughFs::new(root, proc_fd, CachePolicy::Never, policy.clone()).unwrap();
    let server = Arc::new(Server::new(
        fs,
        DaxMapper::new(WINDOW, policy.clone()),
        policy,
    ));
    let backend = Arc::new(FsBackend::new(server, 1, 1024, true, None));
    let mut vu = vhost_user_backend::VhostUserDaemon::new(
        "no-device-state".into(),
        backend,
        GuestMemoryAtomic::new(daemon::GuestMemoryMmap::new()),
    )
    .unwrap();
    let served = socket.clone();
    let thread = std::thread::spawn(move || {
        let _ = vu.serve(&served);
    });
    let fs = VhostUserFs::connect_retrying(&fs_config(&socket), PATIENCE).expect("negotiation");
    let e = fs.check_movable().unwrap_err().to_string();
    assert!(
        e.contains("fs0")
            && e.contains(&socket.display().to_string())
            && e.contains("DEVICE_STATE not offered"),
        "{e}"
    );
    drop(fs);
    thread.join().unwrap();
}

/// A change to a saved state.
type Edit = fn(&mut serde_json::Value);

/// Saved values the configuration or the new daemon contradict are refused
/// by field before the daemon is asked anything; the same device then
/// restores the untouched state.
#[test]
fn saved_fields_that_do_not_fit_are_refused_by_name_and_nothing_is_applied() {
    let (share, _sockdir, socket) = share_and_socket();
    let mem = guest_memory();
    let (saved, _guest) = first_life(share.as_path(), &socket, &mem);
    let mut daemon = start_daemon(share.as_path(), &socket);
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("the new daemon");
    let edits: [(&str, Edit); 7] = [
        ("acked_features", |s| {
            s["acked_features"] = serde_json::json!(1u64 << 63)
        }),
        ("acked_protocol_features", |s| {
            s["acked_protocol_features"] = serde_json::json!(0)
        }),
        ("num_queues", |s| s["num_queues"] = serde_json::json!(3)),
        ("config", |s| s["config"][0] = serde_json::json!(b'x')),
        ("window.size", |s| {
            s["window"]["size"] = serde_json::json!(16 * MIB)
        }),
        ("window.record", |s| {
            s["window"]["record"]["kind"] = serde_json::json!("vcpu")
        }),
        ("surplus", |s| s["surplus"] = serde_json::json!(1)),
    ];
    for (field, edit) in edits {
        let mut state = saved.state.clone();
        edit(&mut state);
        let e = fs.restore_state(&state).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    fs.restore_state(&saved.state)
        .expect("the untouched state still restores");
    assert_eq!(fs.window().unwrap().mappings().mappings.len(), 3);
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}
