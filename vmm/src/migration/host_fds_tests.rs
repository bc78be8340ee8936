//! A local migration hands the disks' open images (their locks with them)
//! and the vsock's listening socket to the receiver: real VMs on /dev/kvm
//! (skipped without) over a socket pair; and the receiver's checks of what
//! a sender passes, which need no VM.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use virtio_devices::block::{DiskError, DiskFile};
use vm_state::protocol::{self, Command, FdLabel, Request, Response, Status};

use super::receive::{receive_over, take_host_fds};
use super::send::{check_local, send_over};
use super::tests::{failing_receiver, migrate, pair, shared_config, still_counting};
use super::*;
use crate::config::{DiskConfig, VmConfig, VsockConfig};
use crate::snapshot::tests::{boot_program, counter_passes, have_kvm, Scratch};

/// A 64 KiB raw image in `dir`.
fn image(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
    path
}

/// The shared-memory test VM with the writable disk `disk0` on `image`
/// and the vsock `vsock0` listening on `socket`.
fn with_disk_and_vsock(image: &Path, socket: &Path) -> VmConfig {
    let mut c = shared_config();
    c.disks = vec![DiskConfig::parse(&format!("path={},id=disk0", image.display()), 0).unwrap()];
    c.vsock =
        Some(VsockConfig::parse(&format!("cid=3,socket={},id=vsock0", socket.display())).unwrap());
    c
}

/// Whether a process serves the vsock socket at `path`: a device whose
/// guest driver never started (the test program has none) takes a host
/// connection and closes it at once, so the read sees EOF; nobody
/// accepting would leave it waiting.
fn served(path: &Path) -> bool {
    let Ok(stream) = UnixStream::connect(path) else {
        return false;
    };
    stream.set_read_timeout(Some(SOCKET_TIMEOUT)).unwrap();
    matches!((&stream).read(&mut [0u8; 1]), Ok(0))
}

/// The whole migration with a writable disk and a vsock: the receiver
/// builds both on the sender's fds (it could neither lock the image nor
/// bind the path while the sender holds them), the image stays locked,
/// new host connections on the same socket path are served, and the
/// socket's name is the receiver's to remove at the end, no longer the
/// sender's. (That a device stops accepting when released, and which one
/// removes the name when it goes, is the vsock device's own test.)
#[test]
fn a_writable_disk_and_a_vsock_move_with_their_image_and_listener() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("migration-host-fds");
    let (disk, socket) = (image(&dir.0, "disk.img"), dir.0.join("v.sock"));
    let config = with_disk_and_vsock(&disk, &socket);
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    // The received VM comes back: it lives until the test is done with it.
    let received = migrate(&mut source, &config, |r| r);
    let r = &received;
    let counts = still_counting(&r.vm);
    let disks: Vec<String> =
        r.vm.devices
            .disk_images()
            .map(|(id, _)| id.into())
            .collect();
    let vsock = r.vm.devices.vsock_listener().map(|(id, _)| id.to_string());
    let name = r.vm.devices.vsock_socket_name().map(|n| n.is_owned());
    assert!(counts, "the receiver's VM counts on");
    assert_eq!(disks, ["disk0"]);
    assert_eq!(vsock.as_deref(), Some("vsock0"));
    assert_eq!(name, Some(true), "the receiver owns the socket's name");
    assert_eq!(
        source.devices.vsock_socket_name().map(|n| n.is_owned()),
        Some(false),
        "the sender leaves the socket's name"
    );
    assert!(
        matches!(
            DiskFile::open(&disk, false, false),
            Err(DiskError::Locked { .. })
        ),
        "the image stays locked"
    );
    assert!(served(&socket), "the socket path is served");
    drop(received);
}

/// The receiver refuses the disk's image or the vsock's listener (here:
/// the sender's config names another image, another socket path than
/// the files it passes): the migration fails naming the device and what
/// differs, and the sender's VM runs on with both.
#[test]
fn a_passed_fd_that_is_not_the_configured_file_fails_the_migration_by_name() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("migration-host-fds-refused");
    let (disk, socket) = (image(&dir.0, "disk.img"), dir.0.join("v.sock"));
    let config = with_disk_and_vsock(&disk, &socket);
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let other = image(&dir.0, "other.img");
    let cases = [
        (
            with_disk_and_vsock(&other, &socket),
            "DiskFd for disk0: disk path=",
            "the passed file is another file",
        ),
        (
            with_disk_and_vsock(&disk, &dir.0.join("w.sock")),
            "VsockFd for vsock0: vsock socket=",
            "the passed socket is bound at",
        ),
    ];
    for (claimed, device, what) in cases {
        let (a, b) = pair();
        let receiver = std::thread::spawn(move || {
            receive_over(&super::channel::Channel::Unix(b), None).map(|_| ())
        });
        let layout = check_local(&source).expect("movable");
        let e = send_over(
            &mut source,
            &claimed,
            &layout,
            &super::channel::Channel::Unix(a),
        )
        .expect_err("refused");
        assert!(e.to_string().contains("State"), "{e}");
        let e = receiver.join().unwrap().expect_err("refused").to_string();
        assert!(e.contains(device) && e.contains(what), "{e}");
        assert!(still_counting(&source));
    }
    assert!(served(&socket), "the sender still serves its socket");
}

/// A migration that fails after the image and the listener were sent
/// (even after the sender let go of its socket, at State) leaves the
/// sender holding both (they were copies): its VM runs on, the image
/// locked, the socket served again (it is the only listener).
#[test]
fn a_failed_migration_leaves_the_sender_its_image_and_listener() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("migration-host-fds-failed");
    for fail_at in [Command::DiskFd, Command::VsockFd, Command::State] {
        let name = format!("{fail_at:?}");
        let disk = image(&dir.0, &format!("{name}.img"));
        let socket = dir.0.join(format!("{name}.sock"));
        let config = with_disk_and_vsock(&disk, &socket);
        let mut source = boot_program(&config);
        counter_passes(&source, 10);
        let (a, b) = pair();
        let receiver = failing_receiver(b, fail_at);
        let layout = check_local(&source).expect("movable");
        let e = send_over(
            &mut source,
            &config,
            &layout,
            &super::channel::Channel::Unix(a),
        )
        .expect_err("refused");
        receiver.join().unwrap();
        assert!(e.to_string().contains(&format!("{fail_at:?}")), "{e}");
        assert!(still_counting(&source), "{fail_at:?}");
        assert!(
            matches!(
                DiskFile::open(&disk, false, false),
                Err(DiskError::Locked { .. })
            ),
            "{fail_at:?}: the sender keeps the image locked"
        );
        assert!(served(&socket), "{fail_at:?}: the sender serves its socket");
        assert_eq!(
            source.devices.vsock_socket_name().map(|n| n.is_owned()),
            Some(true),
            "{fail_at:?}: the sender owns the socket's name again"
        );
        // The VM's devices outlive it in this process (the old VMM exits
        // instead): the next round takes a fresh image and socket path.
        drop(source);
    }
}

/// The receiver's checks, each refusal naming the device and what
/// differs: the image must be the file the disk's path names, opened as
/// the disk is configured; the listener a listening unix stream socket
/// bound at the configured path; and each for a device the configuration
/// has.
#[test]
fn a_wrong_image_or_listener_is_refused_by_device() {
    let dir = Scratch::new("migration-host-fds-checks");
    let (disk, socket) = (image(&dir.0, "disk.img"), dir.0.join("v.sock"));
    let other = image(&dir.0, "other.img");
    let config = with_disk_and_vsock(&disk, &socket);
    let open = |path: &Path, write: bool, flags: i32| -> OwnedFd {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(flags)
            .open(path)
            .unwrap()
            .into()
    };
    let refused = |config: &VmConfig, disk: Option<(&str, OwnedFd)>, vsock: Option<OwnedFd>| {
        let disks: BTreeMap<_, _> = disk.into_iter().map(|(d, f)| (d.to_string(), f)).collect();
        let vsock = vsock.map(|fd| ("vsock0".to_string(), fd));
        take_host_fds(&mut config.clone(), disks, vsock)
            .expect_err("refused")
            .to_string()
    };
    let disk_refused = |config: &VmConfig, id: &str, fd: OwnedFd, what: &str| {
        let e = refused(config, Some((id, fd)), None);
        assert!(e.starts_with(&format!("DiskFd for {id}: ")), "{e}");
        assert!(e.contains(what), "{what}: {e}");
    };
    disk_refused(
        &config,
        "disk0",
        open(&other, true, 0),
        "the passed file is another file",
    );
    disk_refused(
        &config,
        "disk0",
        open(&disk, false, 0),
        "the passed file is open read-only, the disk is configured writable",
    );
    disk_refused(
        &config,
        "disk0",
        open(&dir.0, false, 0),
        "the passed file is a directory, not a regular file or block device",
    );
    disk_refused(
        &config,
        "disk9",
        open(&disk, true, 0),
        "the configuration has no disk of that id",
    );
    let mut read_only = config.clone();
    read_only.disks[0].readonly = true;
    disk_refused(
        &read_only,
        "disk0",
        open(&disk, true, 0),
        "the passed file is open read-write, the disk is configured read-only",
    );
    let mut direct = config.clone();
    direct.disks[0].direct = true;
    disk_refused(
        &direct,
        "disk0",
        open(&disk, true, 0),
        "the passed file is open without O_DIRECT, the disk is configured direct=on",
    );

    let vsock_refused = |fd: OwnedFd, what: &str| {
        let e = refused(&config, None, Some(fd));
        assert!(e.starts_with("VsockFd for vsock0: "), "{e}");
        assert!(e.contains(what), "{what}: {e}");
    };
    let elsewhere = UnixListener::bind(dir.0.join("w.sock")).unwrap();
    vsock_refused(
        elsewhere.into(),
        &format!(
            "the passed socket is bound at {}, not at the configured path",
            dir.0.join("w.sock").display()
        ),
    );
    let (stream, _peer) = UnixStream::pair().unwrap();
    vsock_refused(stream.into(), "the passed socket does not listen");
    let datagram = UnixDatagram::bind(&socket).unwrap();
    vsock_refused(datagram.into(), "not a stream socket");
    std::fs::remove_file(&socket).unwrap();
    vsock_refused(open(&disk, false, 0), "cannot be probed");
    let mut no_vsock = config.clone();
    no_vsock.vsock = None;
    let e = refused(
        &no_vsock,
        None,
        Some(UnixListener::bind(&socket).unwrap().into()),
    );
    assert!(
        e.contains("VsockFd for vsock0: the configuration has no vsock device of that id"),
        "{e}"
    );
    std::fs::remove_file(&socket).unwrap();

    // The right ones are taken into the configuration.
    let mut taken = config.clone();
    let listener = UnixListener::bind(&socket).unwrap();
    let disks = BTreeMap::from([("disk0".to_string(), open(&disk, true, 0))]);
    take_host_fds(
        &mut taken,
        disks,
        Some(("vsock0".to_string(), listener.into())),
    )
    .expect("taken");
    assert!(taken.disks[0].passed_file.0.is_some());
    assert!(taken
        .vsock
        .as_ref()
        .is_some_and(|v| v.passed_listener.0.is_some()));
}

/// Sends `command` with `label` and `fd` as a sender does; the answer.
fn pass(socket: &UnixStream, command: Command, device: &str, fd: &OwnedFd) -> Status {
    let label = FdLabel {
        device: device.to_string(),
        key: None,
    };
    protocol::send_request_with_fd(socket, command, &label.encode(), fd.as_fd()).unwrap();
    Response::read_from(&mut &*socket).unwrap().status()
}

/// A second image for one disk, or a second vsock listener, is answered
/// Error and ends the receive, naming the device.
#[test]
fn a_second_image_or_listener_is_refused_by_name() {
    let dir = Scratch::new("migration-host-fds-twice");
    let disk: OwnedFd = std::fs::File::open(image(&dir.0, "disk.img"))
        .unwrap()
        .into();
    for (command, device, reason) in [
        (Command::DiskFd, "disk0", "DiskFd for disk0: a second image"),
        (
            Command::VsockFd,
            "vsock0",
            "VsockFd for vsock1: a second vsock listener (the first was for vsock0)",
        ),
    ] {
        let (a, b) = pair();
        let receiver = std::thread::spawn(move || {
            receive_over(&super::channel::Channel::Unix(b), None).map(|_| ())
        });
        Request::start().write_to(&mut &a).unwrap();
        assert_eq!(Response::read_from(&mut &a).unwrap().status(), Status::Ok);
        assert_eq!(pass(&a, command, device, &disk), Status::Ok);
        let second = if command == Command::VsockFd {
            "vsock1"
        } else {
            device
        };
        assert_eq!(pass(&a, command, second, &disk), Status::Error);
        let e = receiver.join().unwrap().expect_err("refused").to_string();
        assert!(e.contains(reason), "{e}");
    }
}
