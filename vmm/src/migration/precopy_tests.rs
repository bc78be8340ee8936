//! Pre-copy migrations over TCP on 127.0.0.1 between two endpoints in
//! this process, with real VMs on /dev/kvm running the snapshot tests'
//! counting program (skipped without /dev/kvm): guest RAM arrives by
//! copy, private or shared, and a receiver lost mid-way leaves the
//! sender's VM running.

use std::net::TcpListener;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::channel::Channel;
use super::receive::receive_over;
use super::*;
use crate::snapshot::tests::{boot_program, config, counter, counter_passes, have_kvm};
use crate::vm::Vm;

/// Where the test writes its pattern: above the program and its counter.
const PATTERN_AT: u64 = 0x40_0000;
const PATTERN_LEN: usize = 3 << 20;

fn pattern() -> Vec<u8> {
    (0..PATTERN_LEN as u64)
        .map(|i| narrow::low_u8(i * 7 % 253))
        .collect()
}

fn limits() -> PrecopyLimits {
    PrecopyLimits {
        downtime: Duration::from_millis(300),
        timeout: Duration::from_secs(60),
        strategy: TimeoutStrategy::Cancel,
    }
}

/// A listener on a free port of 127.0.0.1 and the target naming it.
fn tcp_target() -> (TcpListener, SendMigration) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let url = MigrationUrl::Tcp(listener.local_addr().unwrap());
    (
        listener,
        SendMigration {
            url,
            local: false,
            limits: limits(),
        },
    )
}

fn accept(listener: &TcpListener) -> Channel {
    let (stream, _) = listener.accept().expect("the sender");
    stream.set_read_timeout(Some(SOCKET_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(SOCKET_TIMEOUT)).unwrap();
    Channel::Tcp(stream)
}

fn still_counting(vm: &Vm) -> bool {
    let now = counter(vm);
    counter_passes(vm, now) > now
}

/// Private and shared RAM alike: the receiver's VM counts on from at
/// least where the sender's stopped, over its own copy of RAM that holds
/// the pattern written before; the sender's VM stays paused.
#[test]
fn a_precopy_over_tcp_moves_the_running_vm_by_copy() {
    if !have_kvm() {
        return;
    }
    for shared in [true, false] {
        let mut config = config();
        config.memory.shared = shared;
        let mut source = boot_program(&config);
        source
            .mem
            .write_slice(&pattern(), GuestAddress(PATTERN_AT))
            .unwrap();
        counter_passes(&source, 1000);
        let (listener, target) = tcp_target();
        let receiver = std::thread::spawn(move || {
            let received = receive_over(&accept(&listener), None).expect("received");
            let at_receipt = counter(&received.vm);
            let later = counter_passes(&received.vm, at_receipt);
            let mut copy = vec![0u8; PATTERN_LEN];
            received
                .vm
                .mem
                .read_slice(&mut copy, GuestAddress(PATTERN_AT))
                .unwrap();
            (at_receipt, later, copy == pattern(), received.paused)
        });
        if let Err(e) = send_migration(&mut source, &config, &target) {
            panic!("shared={shared}: {e:?}");
        }
        let stopped_at = counter(&source);
        let (at_receipt, later, same, paused) = receiver.join().unwrap();
        assert!(
            source.vcpus.paused(),
            "shared={shared}: the sender's VM stays paused"
        );
        assert!(!paused);
        assert!(
            at_receipt >= stopped_at,
            "shared={shared}: the receiver starts from the sender's last count ({at_receipt} < {stopped_at})"
        );
        assert!(later > at_receipt, "shared={shared}: it counts on");
        assert!(same, "shared={shared}: the pattern arrived");
        assert_eq!(
            counter(&source),
            stopped_at,
            "shared={shared}: a copy, not the same memory"
        );
    }
}

/// The receiver goes away after taking `Config` and some RAM: the sender
/// fails, says so, and its VM runs on.
#[test]
fn a_receiver_lost_mid_stream_leaves_the_vm_running() {
    if !have_kvm() {
        return;
    }
    let config = config();
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let (listener, target) = tcp_target();
    let receiver = std::thread::spawn(move || {
        let channel = accept(&listener);
        let mut taken = 0;
        // Start, Config and the first Memory request, then gone.
        while taken < 3 {
            let request = vm_state::protocol::Request::read_from(&mut &channel).unwrap();
            let payload = vm_state::protocol::read_payload(&mut &channel, &request).unwrap();
            if request.command() == vm_state::protocol::Command::Memory {
                let ranges = vm_state::protocol::decode_ranges(
                    vm_state::protocol::Command::Memory,
                    &payload,
                )
                .unwrap();
                let bytes: u64 = ranges.iter().map(|r| r.length).sum();
                let mut sink = vec![0u8; usize::try_from(bytes).unwrap()];
                std::io::Read::read_exact(&mut &channel, &mut sink).unwrap();
            }
            vm_state::protocol::Response::ok()
                .write_to(&mut &channel)
                .unwrap();
            taken += 1;
        }
        drop(channel);
    });
    // Enough pages that the first pass takes more than one request.
    let big = vec![1u8; 80 << 20];
    let mut config = config;
    config.memory.size = 128 << 20;
    drop(source);
    source = boot_program(&config);
    source
        .mem
        .write_slice(&big, GuestAddress(16 << 20))
        .unwrap();
    counter_passes(&source, 10);
    let e = send_migration(&mut source, &config, &target).expect_err("the receiver is gone");
    receiver.join().unwrap();
    assert!(
        e.to_string().contains("migration socket") || e.to_string().contains("closed"),
        "{e}"
    );
    assert!(!source.vcpus.paused(), "the VM runs again");
    assert!(still_counting(&source));
    // And it can be migrated afterwards.
    let (listener, target) = tcp_target();
    let receiver = std::thread::spawn(move || {
        let r = receive_over(&accept(&listener), None).expect("received");
        let c = counter(&r.vm);
        counter_passes(&r.vm, c) > c
    });
    send_migration(&mut source, &config, &target).expect("sent the second time");
    assert!(receiver.join().unwrap());
}

/// A VM with a writable disk and the vsock device, over TCP in one host
/// (as on shared storage): the receiver opens the image (its lock) and
/// binds the socket path itself, which it can because the sender let go
/// of them at the switch. Then a receiver that refuses `State`: the
/// sender takes the lock and the socket back and its VM runs on.
#[test]
fn the_disk_lock_and_the_vsock_socket_change_hands_at_the_switch() {
    use crate::config::{DiskConfig, VsockConfig};
    use virtio_devices::block::{DiskError, DiskFile};
    if !have_kvm() {
        return;
    }
    let dir = crate::snapshot::tests::Scratch::new("precopy-switch");
    let image = dir.0.join("disk.img");
    std::fs::write(&image, vec![0u8; 64 << 10]).unwrap();
    let socket = dir.0.join("v.sock");
    let mut config = config();
    config.disks =
        vec![DiskConfig::parse(&format!("path={},id=disk0", image.display()), 0).unwrap()];
    config.vsock =
        Some(VsockConfig::parse(&format!("cid=3,socket={},id=vsock0", socket.display())).unwrap());
    let locked = |path: &std::path::Path| {
        matches!(
            DiskFile::open(path, true, false),
            Err(DiskError::Locked { .. })
        )
    };

    // A receiver that fails State: everything comes back to the sender.
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    assert!(locked(&image), "the sender holds the image");
    let (listener, target) = tcp_target();
    let refusing = std::thread::spawn(move || {
        let channel = accept(&listener);
        loop {
            let request = vm_state::protocol::Request::read_from(&mut &channel).unwrap();
            if request.command() == vm_state::protocol::Command::Memory {
                let table = vm_state::protocol::read_payload(&mut &channel, &request).unwrap();
                let ranges =
                    vm_state::protocol::decode_ranges(vm_state::protocol::Command::Memory, &table)
                        .unwrap();
                let bytes: u64 = ranges.iter().map(|r| r.length).sum();
                let mut sink = vec![0u8; usize::try_from(bytes).unwrap()];
                std::io::Read::read_exact(&mut &channel, &mut sink).unwrap();
            } else {
                vm_state::protocol::read_payload(&mut &channel, &request).unwrap();
            }
            if request.command() == vm_state::protocol::Command::State {
                vm_state::protocol::Response::error()
                    .write_to(&mut &channel)
                    .unwrap();
                return;
            }
            vm_state::protocol::Response::ok()
                .write_to(&mut &channel)
                .unwrap();
        }
    });
    let e = send_migration(&mut source, &config, &target).expect_err("State refused");
    refusing.join().unwrap();
    assert!(e.to_string().contains("State"), "{e}");
    assert!(!source.vcpus.paused(), "the VM runs again");
    assert!(still_counting(&source));
    assert!(locked(&image), "the lock was taken back");
    assert!(socket.exists(), "the vsock socket is bound again");

    // A real receiver: it opens the image and binds the socket itself.
    let (listener, target) = tcp_target();
    let receiver = std::thread::spawn(move || {
        let r = receive_over(&accept(&listener), None).expect("received");
        let c = counter(&r.vm);
        let counts = counter_passes(&r.vm, c) > c;
        (counts, r)
    });
    send_migration(&mut source, &config, &target).expect("sent");
    let (counts, received) = receiver.join().unwrap();
    assert!(counts);
    assert!(locked(&image), "the receiver holds the image now");
    assert!(socket.exists(), "and the vsock socket");
    drop(source);
    assert!(locked(&image), "still, with the sender gone");
    drop(received);
}

/// A tap the operator passed as fds cannot move over the stream (refused
/// by the device's name); one a local migration passed for `tap=NAME`
/// can, since the receiver opens it by name.
#[test]
fn a_tap_passed_as_fds_is_refused_by_name() {
    let mut config = config();
    let mut net =
        crate::config::NetConfig::parse("tap=daxtap9,mac=52:54:00:12:34:56,id=net7", 0).unwrap();
    net.fds = crate::config::TapFds(std::sync::Arc::new(vec![std::fs::File::open("/dev/null")
        .unwrap()
        .into()]));
    config.net = vec![net];
    let e = super::precopy::check_taps(&config)
        .expect_err("passed fds")
        .to_string();
    assert!(e.contains("net net7") && e.contains("fds="), "{e}");
    config.net[0].fds_from_migration = true;
    super::precopy::check_taps(&config).expect("a tap by name after a local migration");
}

/// A receiver that takes every request and answers Ok, each `Memory`
/// request only after `delay` (a slow link); it ends when the sender
/// hangs up.
fn slow_receiver(listener: TcpListener, delay: Duration) -> std::thread::JoinHandle<Vec<Command>> {
    use vm_state::protocol::{decode_ranges, read_payload, Request, Response};
    std::thread::spawn(move || {
        let channel = accept(&listener);
        let mut seen = Vec::new();
        while let Ok(request) = Request::read_from(&mut &channel) {
            let payload = read_payload(&mut &channel, &request).unwrap();
            if request.command() == Command::Memory {
                let ranges = decode_ranges(Command::Memory, &payload).unwrap();
                let bytes: u64 = ranges.iter().map(|r| r.length).sum();
                let mut sink = vec![0u8; usize::try_from(bytes).unwrap()];
                std::io::Read::read_exact(&mut &channel, &mut sink).unwrap();
                std::thread::sleep(delay);
            }
            seen.push(request.command());
            Response::ok().write_to(&mut &channel).unwrap();
        }
        seen
    })
}

/// A guest that writes faster than the link carries never fits a 1 ms
/// downtime: after the bounded rounds the migration fails naming the
/// bound and the target, the receiver is told, and the VM runs on; with
/// `timeout_strategy=ignore` it is paused anyway and moves.
#[test]
fn a_precopy_that_cannot_meet_its_downtime_fails_or_pauses_anyway() {
    if !have_kvm() {
        return;
    }
    let config = config();
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let (listener, mut target) = tcp_target();
    target.limits.downtime = Duration::from_millis(1);
    let receiver = slow_receiver(listener, Duration::from_millis(20));
    let e = send_migration(&mut source, &config, &target).expect_err("cannot converge");
    let seen = receiver.join().unwrap();
    let text = e.to_string();
    assert!(
        text.contains(&format!("after {MAX_ROUNDS} rounds")) && text.contains("downtime_ms=1"),
        "{text}"
    );
    assert_eq!(
        seen.iter().filter(|c| **c == Command::Memory).count(),
        usize::try_from(MAX_ROUNDS).unwrap(),
        "the first pass and the rounds after it, each one request"
    );
    assert_eq!(seen.last(), Some(&Command::Abandon), "the receiver is told");
    assert!(!source.vcpus.paused());
    assert!(still_counting(&source));

    let (listener, mut target) = tcp_target();
    target.limits.downtime = Duration::from_millis(1);
    target.limits.strategy = TimeoutStrategy::Ignore;
    let receiver = slow_receiver(listener, Duration::from_millis(20));
    send_migration(&mut source, &config, &target).expect("paused anyway and sent");
    let seen = receiver.join().unwrap();
    assert!(source.vcpus.paused());
    assert_eq!(
        seen.iter().rev().take(2).collect::<Vec<_>>(),
        [&Command::Complete, &Command::State]
    );
}

/// The round's rate and the estimate for what is left: bytes per second
/// from the copy, at least 1, and a round too short to measure taken as
/// one millisecond rather than dividing by zero.
#[test]
fn rate_and_estimate_follow_the_round_and_never_divide_by_zero() {
    use super::precopy::rate_and_estimate;
    // 100 MiB in 2 s: 50 MiB/s; 10 MiB left takes 200 ms.
    let (rate, est) = rate_and_estimate(100 << 20, Duration::from_secs(2), 10 << 20);
    assert_eq!(rate, 50 << 20);
    assert_eq!(est, Duration::from_millis(200));
    // Nothing sent: the rate is 1 B/s, so what is left estimates huge.
    let (rate, est) = rate_and_estimate(0, Duration::from_secs(1), 4096);
    assert_eq!(rate, 1);
    assert_eq!(est, Duration::from_secs(4096));
    // A round under 1 ms counts as 1 ms.
    let (rate, _) = rate_and_estimate(4096, Duration::from_micros(10), 0);
    assert_eq!(rate, 4096 * 1000);
    // Nothing left: no downtime, whatever the rate.
    assert_eq!(rate_and_estimate(1, Duration::ZERO, 0).1, Duration::ZERO);
    // Saturating, not overflowing.
    let (rate, est) = rate_and_estimate(u64::MAX, Duration::from_millis(1), u64::MAX);
    assert_eq!(rate, u64::MAX);
    assert_eq!(est, Duration::from_millis(1));
}
