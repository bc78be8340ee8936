//! A migration's switch over the network on a running VM (real KVM) with
//! a writable disk, the vsock device and, where taps can be made, a net
//! device on a tap opened by name with a host address: released once the
//! state is saved, each is free for another process (the receiving VMM)
//! to open by its configured name; taken back, each is this VM's again
//! and the VM runs on. The VM's side runs under the main thread's seccomp
//! filter (kill mode), as the control loop runs a migration; the other
//! process's side runs on the test's own thread.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};

use virtio_devices::block::{DiskError, DiskFile};
use virtio_devices::net::Tap;

use super::tests::{boot_program, config, counter, counter_passes, have_kvm, Scratch};
use super::*;
use crate::config::{DiskConfig, NetConfig, VsockConfig};

const TAP_ADDRESS: Ipv4Addr = Ipv4Addr::new(192, 168, 249, 1);

/// The IPv4 address of interface `name` (SIOCGIFADDR), if it has one.
fn interface_address(name: &str) -> Option<Ipv4Addr> {
    // SAFETY: socket() takes no pointers; the fd is checked and owned below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    assert!(sock >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain data; all zeroes is a valid value of it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    // SAFETY: SIOCGIFADDR writes an ifreq, which lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFADDR, &mut req) } < 0 {
        return None;
    }
    // SAFETY: SIOCGIFADDR filled the address member with a sockaddr_in.
    let sin = unsafe {
        std::ptr::addr_of!(req.ifr_ifru.ifru_addr)
            .cast::<libc::sockaddr_in>()
            .read_unaligned()
    };
    Some(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()))
}

/// What the VM's side tells the other process's side.
enum Step {
    /// Released: these devices let go of their host side.
    Released(Vec<String>),
    /// Taken back: Ok, or the error's text.
    Reclaimed(Result<(), String>),
    /// The VM ran on after the last reclaim.
    RanOn(bool),
}

struct Host {
    disk: PathBuf,
    socket: PathBuf,
    tap: Option<String>,
}

impl Host {
    fn disk_locked(&self) -> bool {
        matches!(
            DiskFile::open(&self.disk, true, false),
            Err(DiskError::Locked { .. })
        )
    }

    /// The receiving VMM's turn: every resource opens by its name.
    fn take_all(&self) {
        drop(DiskFile::open(&self.disk, false, false).expect("the image is free"));
        assert!(!self.socket.exists(), "the socket file is removed");
        drop(UnixListener::bind(&self.socket).expect("the socket path binds"));
        std::fs::remove_file(&self.socket).unwrap();
        if let Some(tap) = &self.tap {
            drop(Tap::open_named(tap).expect("the tap opens by name"));
        }
    }

    /// This VM holds every resource.
    fn check_held(&self) {
        assert!(self.disk_locked(), "the image is locked again");
        UnixStream::connect(&self.socket).expect("the socket is served again");
        if let Some(tap) = &self.tap {
            assert!(Tap::open_named(tap).is_err(), "the tap is held again");
            assert_eq!(
                interface_address(tap),
                Some(TAP_ADDRESS),
                "the tap created again has its address again"
            );
        }
    }
}

fn vm_config(dir: &Path, tap: Option<&str>) -> VmConfig {
    let mut c = config();
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 64 << 10]).unwrap();
    c.disks = vec![DiskConfig::parse(&format!("path={},id=disk0", disk.display()), 0).unwrap()];
    c.vsock = Some(
        VsockConfig::parse(&format!(
            "cid=3,socket={},id=vsock0",
            dir.join("v.sock").display()
        ))
        .unwrap(),
    );
    if let Some(tap) = tap {
        c.net = vec![NetConfig::parse(
            &format!("tap={tap},ip={TAP_ADDRESS},mask=255.255.255.0,id=net0"),
            0,
        )
        .unwrap()];
    }
    c
}

/// The VM's side, under the main thread's filter: boots, saves, releases
/// (once refused before the save), waits for the other side; takes back;
/// releases again, and takes back while the other side holds the image.
fn vm_side(config: VmConfig, tell: Sender<Step>, go: Receiver<()>) {
    use crate::seccomp_filters::{all_for, VMM};
    let filter = all_for(std::process::id())
        .into_iter()
        .find(|(k, _)| *k == VMM)
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .expect("the main thread's filter");
    seccomp::apply_filter(&filter).unwrap();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    vm.pause();
    let e = vm.release_for_switch().unwrap_err();
    assert!(matches!(e, SnapshotError::NotSaved), "{e}");
    vm.state_document(&config).expect("saved");
    for _round in 0..2 {
        let released = vm.release_for_switch().expect("released");
        assert_eq!(vm.devices.net_taps().count(), 0);
        assert!(vm.devices.vsock_listener().is_none());
        let mut ids = released.device_ids().to_vec();
        ids.sort();
        tell.send(Step::Released(ids)).unwrap();
        go.recv().unwrap();
        let reclaimed = vm.reclaim_after_switch(released);
        assert_eq!(vm.devices.net_taps().count(), config.net.len());
        assert!(vm.devices.vsock_listener().is_some());
        tell.send(Step::Reclaimed(reclaimed.map_err(|e| e.to_string())))
            .unwrap();
        go.recv().unwrap();
    }
    vm.resume();
    let c = counter(&vm);
    tell.send(Step::RanOn(counter_passes(&vm, c) > c)).unwrap();
}

/// Released, the image locks for another writer, the socket path binds,
/// the tap opens by name; taken back, each is held again (the tap, which
/// this VMM created and which went when released, made again with its
/// address). A second time the other process keeps the image locked: the
/// error names the disk and its path, the rest is taken back, and the VM
/// runs on.
#[test]
fn a_switch_frees_the_disk_socket_and_tap_and_a_failed_migration_takes_them_back() {
    if !have_kvm() {
        return;
    }
    // No other test's forked child may hold a copy of the tap meanwhile.
    let _forks = seccomp::FORK_GUARD
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let dir = Scratch::new("switch");
    let name = format!("daxvs{}", std::process::id() % 100_000);
    let tap = match Tap::open_named(&name) {
        Ok(probe) => {
            drop(probe);
            Some(name)
        }
        Err(e) => {
            eprintln!("no tap here ({e}); the net device is left out");
            None
        }
    };
    let config = vm_config(&dir.0, tap.as_deref());
    let host = Host {
        disk: config.disks[0].path.clone(),
        socket: dir.0.join("v.sock"),
        tap: tap.clone(),
    };
    let (tell, heard) = channel();
    let (go, going) = channel();
    let vm = std::thread::spawn(move || vm_side(config, tell, going));
    let mut expected = vec!["disk0".to_string(), "vsock0".to_string()];
    if tap.is_some() {
        expected.insert(1, "net0".to_string());
    }

    let Step::Released(ids) = heard.recv().unwrap() else {
        panic!("released first")
    };
    assert_eq!(ids, expected);
    host.take_all();
    go.send(()).unwrap();
    let Step::Reclaimed(r) = heard.recv().unwrap() else {
        panic!("taken back next")
    };
    r.expect("everything taken back");
    host.check_held();
    go.send(()).unwrap();

    let Step::Released(_) = heard.recv().unwrap() else {
        panic!("released again")
    };
    let other = DiskFile::open(&host.disk, false, false).expect("the image is free");
    go.send(()).unwrap();
    let Step::Reclaimed(r) = heard.recv().unwrap() else {
        panic!("taken back again")
    };
    let e = r.expect_err("the image is another's");
    assert_eq!(
        e,
        format!(
            "migration failed, taking back: virtio-blk disk0: reclaiming its host side for a \
             migration's switch: disk path={}: locked by another process (a writable disk \
             needs the image to itself; read-only disks share it); the disk serves on without \
             the lock",
            host.disk.display()
        )
    );
    drop(other);
    assert!(!host.disk_locked(), "the VM runs on without the lock");
    UnixStream::connect(&host.socket).expect("the socket is served again");
    go.send(()).unwrap();
    let Step::RanOn(ran) = heard.recv().unwrap() else {
        panic!("ran on last")
    };
    assert!(ran, "the VM runs on");
    vm.join().expect("the VM's side");
}
