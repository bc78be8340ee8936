//! `vm.restore`'s `net_fds`: the fds passed with the request dealt to the
//! devices it names and checked (count, tap, device, queue pairs), and a
//! VM restored on the tap it was given (KVM and CAP_NET_ADMIN, skipped
//! without).

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use super::*;
use crate::config::NetConfig;
use crate::snapshot::tests::{boot_program, config, counter_passes, have_kvm, Scratch};
use crate::vm::Vm;

fn named(entries: &[(&str, usize)]) -> Vec<RestoredNet> {
    entries
        .iter()
        .map(|(id, num_fds)| RestoredNet {
            id: id.to_string(),
            num_fds: *num_fds,
        })
        .collect()
}

fn not_a_tap() -> OwnedFd {
    OwnedFd::from(std::fs::File::open("/dev/null").unwrap())
}

/// A tap of this test's own (None where taps cannot be made: no
/// CAP_NET_ADMIN or no /dev/net/tun) and a second fd of it, what a
/// client passes.
fn tap(suffix: &str) -> Option<(Tap, OwnedFd)> {
    let name = format!("daxrt{}{suffix}", std::process::id() % 100_000);
    match Tap::open_named(&name) {
        Ok(tap) => {
            // SAFETY: the tap owns the fd and outlives this borrow.
            let fd = unsafe { BorrowedFd::borrow_raw(tap.as_raw_fd()) }
                .try_clone_to_owned()
                .unwrap();
            Some((tap, fd))
        }
        Err(e) => {
            eprintln!("no tap here ({e}); skipped");
            None
        }
    }
}

/// The interface a tap fd is attached to.
fn interface(fd: BorrowedFd<'_>) -> String {
    Tap::from_fd(fd.try_clone_to_owned().unwrap())
        .unwrap()
        .name()
        .to_string()
}

fn net_config(net: &[&str]) -> VmConfig {
    let mut c = config();
    c.net = net
        .iter()
        .enumerate()
        .map(|(i, n)| NetConfig::parse(n, i).unwrap())
        .collect();
    c
}

#[test]
fn the_fd_count_must_be_what_net_fds_names() {
    let e = RestoreTaps::take(&[], vec![not_a_tap()]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "1 file descriptor(s) came with the request, but net_fds names 0 (its num_fds summed)"
    );
    let e = RestoreTaps::take(&named(&[("net0", 1), ("net1", 1)]), vec![not_a_tap()])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("1 file descriptor(s) came"), "{e}");
    assert!(e.contains("net_fds names 2"), "{e}");
    let e = RestoreTaps::take(&named(&[("net0", usize::MAX), ("net1", 2)]), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("names more than this VMM counts"), "{e}");
    assert!(RestoreTaps::take(&[], Vec::new()).unwrap().is_empty());
}

#[test]
fn an_fd_that_is_no_tap_is_refused_naming_the_device() {
    let e = RestoreTaps::take(&named(&[("net0", 1)]), vec![not_a_tap()])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("net_fds: fd 0 of net0 is not a tap: fd ")
            && e.contains("not a tap with IFF_VNET_HDR (TUNGETIFF: "),
        "{e}"
    );
    // The second device's fd is checked as well, after the first's.
    if let Some((_keep, fd)) = tap("c") {
        let e = RestoreTaps::take(&named(&[("net0", 1), ("net1", 1)]), vec![fd, not_a_tap()])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("net_fds: fd 0 of net1 is not a tap"), "{e}");
    }
}

#[test]
fn the_taps_go_to_the_named_devices_of_the_snapshot_or_to_none() {
    let mut c = net_config(&["tap=a0,id=net0", "tap=b0,id=net1"]);
    let taps = |entries: &[(&str, usize)]| {
        RestoreTaps(
            entries
                .iter()
                .map(|(id, n)| (id.to_string(), (0..*n).map(|_| not_a_tap()).collect()))
                .collect(),
        )
    };
    // An id the snapshot has no net device of, after one it has: nothing
    // is given.
    let e = taps(&[("net1", 1), ("net9", 1)])
        .hand_to(&mut c)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "net_fds names net9, which is not a net device of the snapshot (its net devices: net0, net1)"
    );
    assert!(c.net.iter().all(|n| n.fds.is_empty()), "nothing half-given");
    let e = taps(&[("net0", 2)]).hand_to(&mut c).unwrap_err();
    assert_eq!(
        e.to_string(),
        "net_fds gives net0 2 fd(s), but the device has 1 queue pair(s): one tap fd each"
    );
    assert!(c.net.iter().all(|n| n.fds.is_empty()));
    let e = taps(&[("net0", 1)])
        .hand_to(&mut config())
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("(its net devices: none)"), "{e}");

    taps(&[("net1", 1)]).hand_to(&mut c).unwrap();
    assert!(c.net[0].fds.is_empty(), "net0 opens its tap by name");
    assert_eq!(c.net[1].fds.0.len(), 1, "net1 is built on the passed fd");
}

/// A VM with a net device on one tap is snapshotted and dropped; restored
/// with another tap passed for net0, its device is built on that one, and
/// the VM runs on. Without the tap passed, the restore opens the saved
/// name; with a tap for a device it does not have, it is refused by name
/// and no VM is made.
#[test]
fn a_restored_net_device_is_built_on_the_tap_passed_for_it() {
    if !have_kvm() {
        return;
    }
    let Some((first, _)) = tap("a") else {
        return;
    };
    let first_name = first.name().to_string();
    drop(first);
    let dir = Scratch::new("restore-taps");
    let config = net_config(&[&format!("tap={first_name},mac=52:54:00:12:34:56,id=net0")]);
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    vm.check_snapshottable().expect("movable devices");
    vm.pause();
    vm.snapshot(&config, &dir.0).expect("snapshot");
    drop(vm);

    let Some((second, fd)) = tap("b") else {
        return;
    };
    let wrong = RestoreTaps::take(&named(&[("net7", 1)]), vec![fd]).unwrap();
    let e = Vm::restore(&dir.0, false, wrong, None)
        .err()
        .expect("refused");
    assert!(
        e.to_string().contains(
            "net_fds names net7, which is not a net device of the snapshot (its net devices: net0)"
        ),
        "{e}"
    );
    // SAFETY: the tap owns the fd and outlives this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(second.as_raw_fd()) }
        .try_clone_to_owned()
        .unwrap();
    let taps = RestoreTaps::take(&named(&[("net0", 1)]), vec![fd]).unwrap();
    let (restored, mut vm) = Vm::restore(&dir.0, false, taps, None).expect("restore");
    let on: Vec<(String, String)> = vm
        .devices
        .net_taps()
        .map(|(id, fd)| (id.to_string(), interface(fd)))
        .collect();
    assert_eq!(on, [("net0".to_string(), second.name().to_string())]);
    assert_eq!(restored.net[0].tap.as_deref(), Some(first_name.as_str()));
    let saved = crate::snapshot::tests::counter(&vm);
    vm.resume();
    counter_passes(&vm, saved);
    vm.stop();
}
