//! Local migration between two endpoints in this process over a socket
//! pair, with real VMs on /dev/kvm running the snapshot tests' counting
//! program (skipped without /dev/kvm); and the two API bodies.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

use serde_json::json;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vm_state::protocol::{self, Command, Request, Response, Status};

use super::channel::Channel;
use super::receive::receive_over;
use super::send::{check_local, send_over};
use super::*;
use crate::config::json::vm_config_to_json;
use crate::config::VmConfig;
use crate::snapshot::tests::{boot_program, config, counter, counter_passes, have_kvm};
use crate::vm::Vm;

/// The snapshot tests' VM, with guest RAM in a memfd (`shared=on`).
pub(super) fn shared_config() -> VmConfig {
    let mut c = config();
    c.memory.shared = true;
    c
}

pub(super) fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().expect("socket pair");
    for s in [&a, &b] {
        s.set_read_timeout(Some(SOCKET_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(SOCKET_TIMEOUT)).unwrap();
    }
    (a, b)
}

/// A whole local migration of `source` (configured as `config`) over a
/// socket pair: the receiver runs on a thread of its own and gives what it
/// received to `inspect` there (its VM is dropped after, unless `inspect`
/// keeps it); the sender's side must succeed. Returns what `inspect` did.
pub(super) fn migrate<T: Send + 'static>(
    source: &mut Vm,
    config: &VmConfig,
    inspect: impl FnOnce(Received) -> T + Send + 'static,
) -> T {
    let (a, b) = pair();
    let receiver = std::thread::spawn(move || {
        inspect(receive_over(&Channel::Unix(b), None).expect("received"))
    });
    let layout = check_local(source).expect("movable");
    send_over(source, config, &layout, &Channel::Unix(a)).expect("sent");
    receiver.join().expect("the receiving thread")
}

/// (st_dev, st_ino) of the file behind guest RAM at 0.
fn ram_file(vm: &Vm) -> (u64, u64) {
    let region = vm.mem.find_region(GuestAddress(0)).expect("RAM at 0");
    let meta = region
        .file_offset()
        .expect("shared RAM")
        .file()
        .metadata()
        .unwrap();
    (meta.dev(), meta.ino())
}

/// Whether the VM's counter still advances (it would stay put paused).
pub(super) fn still_counting(vm: &Vm) -> bool {
    let now = counter(vm);
    counter_passes(vm, now) > now
}

/// The whole sequence: the receiver's VM runs on from the counter the
/// sender's VM had when it paused, over the same memfd (the sender's own
/// mapping sees the receiver's increments: nothing was copied), and the
/// sender's VM stays paused.
#[test]
fn a_local_migration_moves_the_running_vm_over_the_same_memory() {
    if !have_kvm() {
        return;
    }
    let config = shared_config();
    let mut source = boot_program(&config);
    counter_passes(&source, 1000);
    let source_ram = ram_file(&source);
    let (at_receipt, later, dest_ram, dest_paused) = migrate(&mut source, &config, |received| {
        assert!(!received.paused);
        let at_receipt = counter(&received.vm);
        let later = counter_passes(&received.vm, at_receipt);
        (
            at_receipt,
            later,
            ram_file(&received.vm),
            received.vm.vcpus.paused(),
        )
    });
    assert!(source.vcpus.paused(), "the sender's VM stays paused");
    assert!(later > at_receipt, "the receiver's VM counts on");
    assert!(!dest_paused);
    assert_eq!(dest_ram, source_ram, "the same memfd, not a copy");
    // The receiver's VM is gone with its thread; the count it reached is
    // in the memory both mapped.
    assert!(counter(&source) >= later);
}

/// A sender paused before the migration sends CompletePaused: the
/// receiver's VM stays paused.
#[test]
fn a_paused_vm_arrives_paused() {
    if !have_kvm() {
        return;
    }
    let config = shared_config();
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    source.pause();
    let paused = migrate(&mut source, &config, |r| (r.paused, r.vm.vcpus.paused()));
    assert_eq!(paused, (true, true));
}

/// Start and the memory fds, as a sender sends them.
fn start_and_memory(source: &Vm, socket: &UnixStream) {
    Request::start().write_to(&mut &*socket).unwrap();
    assert_eq!(
        Response::read_from(&mut &*socket).unwrap().status(),
        Status::Ok
    );
    let layout = check_local(source).expect("movable");
    crate::memory::migration_fds::send_memory_fds(socket, &layout, &source.mem).unwrap();
}

/// Abandon after the memory fds: the receiver answers Ok and ends with
/// nothing kept; the sender's VM was never stopped.
#[test]
fn abandon_mid_way_is_answered_and_the_senders_vm_keeps_running() {
    if !have_kvm() {
        return;
    }
    let config = shared_config();
    let source = boot_program(&config);
    counter_passes(&source, 10);
    let (a, b) = pair();
    let receiver = std::thread::spawn(move || receive_over(&Channel::Unix(b), None).map(|_| ()));
    start_and_memory(&source, &a);
    Request::new(Command::Abandon, 0)
        .unwrap()
        .write_to(&mut &a)
        .unwrap();
    assert_eq!(Response::read_from(&mut &a).unwrap().status(), Status::Ok);
    let e = receiver.join().unwrap().expect_err("abandoned");
    assert!(matches!(e, MigrationError::Abandoned), "{e}");
    assert!(still_counting(&source));
}

/// A receiver that answers Ok to everything but `fail_at`, which it
/// answers Error; it reads every payload and fd as a real one does.
pub(super) fn failing_receiver(
    socket: UnixStream,
    fail_at: Command,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || loop {
        let Ok(request) = Request::read_from(&mut &socket) else {
            return;
        };
        if request.command().passes_fd() {
            protocol::recv_payload_with_fd(&socket, &request).unwrap();
        } else {
            protocol::read_payload(&mut &socket, &request).unwrap();
        }
        if request.command() == fail_at {
            Response::error().write_to(&mut &socket).unwrap();
            return;
        }
        Response::ok().write_to(&mut &socket).unwrap();
    })
}

/// The receiver fails `Config` (before the sender pauses) or `State`
/// (after): the sender reports it and its VM runs (again).
#[test]
fn a_receiver_error_is_reported_and_the_senders_vm_runs_again() {
    if !have_kvm() {
        return;
    }
    for fail_at in [Command::Config, Command::State] {
        let config = shared_config();
        let mut source = boot_program(&config);
        counter_passes(&source, 10);
        let (a, b) = pair();
        let receiver = failing_receiver(b, fail_at);
        let layout = check_local(&source).expect("movable");
        let e = send_over(&mut source, &config, &layout, &Channel::Unix(a)).expect_err("refused");
        receiver.join().unwrap();
        assert!(
            e.to_string().contains("the receiver reported an error")
                && e.to_string().contains(&format!("{fail_at:?}")),
            "{e}"
        );
        assert!(!source.vcpus.paused(), "{fail_at:?}: resumed");
        assert!(still_counting(&source), "{fail_at:?}");
    }
}

/// A header as Cloud Hypervisor's `Request::write_to` lays it out.
fn ch_header(command: u16, length: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..2].copy_from_slice(&command.to_le_bytes());
    h[8..].copy_from_slice(&length.to_le_bytes());
    h
}

fn ch_answer(socket: &UnixStream) -> [u8; 16] {
    let mut r = [0u8; 16];
    std::io::Read::read_exact(&mut &*socket, &mut r).unwrap();
    r
}

/// The sequence as a Cloud Hypervisor sender writes it, byte by byte (no
/// WindowFd or TapFd; payloads ours): every step answered with CH's Ok
/// bytes, the VM received and running.
#[test]
fn a_cloud_hypervisor_senders_bytes_are_received() {
    if !have_kvm() {
        return;
    }
    let config = shared_config();
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let layout = check_local(&source).expect("movable");
    let (a, b) = pair();
    let receiver = std::thread::spawn(move || {
        let r = receive_over(&Channel::Unix(b), None).expect("received");
        let c = counter(&r.vm);
        counter_passes(&r.vm, c) > c
    });
    let ok = ch_header(1, 0);
    (&a).write_all(&ch_header(1, 0)).unwrap();
    assert_eq!(ch_answer(&a), ok);
    for region in &layout.regions {
        let file = source
            .mem
            .find_region(GuestAddress(region.gpa))
            .unwrap()
            .file_offset()
            .unwrap()
            .file()
            .try_clone()
            .unwrap();
        (&a).write_all(&ch_header(7, 4)).unwrap();
        vm_state::fd_socket::send_with_fds(&a, &region.slot.to_le_bytes(), &[file.as_fd()])
            .unwrap();
        assert_eq!(ch_answer(&a), ok);
    }
    let cfg = serde_json::to_vec(&MigrationConfig {
        format: CONFIG_FORMAT.to_string(),
        version: CONFIG_VERSION,
        vm_config: vm_config_to_json(&config),
        memory: layout.clone(),
    })
    .unwrap();
    (&a).write_all(&ch_header(2, cfg.len() as u64)).unwrap();
    (&a).write_all(&cfg).unwrap();
    assert_eq!(ch_answer(&a), ok);
    source.pause();
    let mut doc = source.state_document(&config).unwrap();
    doc.put(crate::snapshot::MEMORY_SECTION, &layout).unwrap();
    let state = doc.to_json().unwrap();
    (&a).write_all(&ch_header(3, state.len() as u64)).unwrap();
    (&a).write_all(&state).unwrap();
    assert_eq!(ch_answer(&a), ok);
    (&a).write_all(&ch_header(5, 0)).unwrap();
    assert_eq!(ch_answer(&a), ok);
    assert!(receiver.join().unwrap(), "the received VM counts");
}

/// A command number neither Cloud Hypervisor nor we define is answered
/// Error and ends the receive; so is a Cloud Hypervisor sender's Config
/// (no format: its state could not be restored here).
#[test]
fn an_unknown_command_or_a_foreign_config_is_refused() {
    let (a, b) = pair();
    let receiver = std::thread::spawn(move || receive_over(&Channel::Unix(b), None).map(|_| ()));
    (&a).write_all(&ch_header(1, 0)).unwrap();
    assert_eq!(ch_answer(&a), ch_header(1, 0));
    (&a).write_all(&ch_header(0x8005, 0)).unwrap();
    assert_eq!(ch_answer(&a), ch_header(2, 0), "Error");
    let e = receiver.join().unwrap().expect_err("refused");
    assert!(e.to_string().contains("unknown command 0x8005"), "{e}");

    let (a, b) = pair();
    let receiver = std::thread::spawn(move || receive_over(&Channel::Unix(b), None).map(|_| ()));
    (&a).write_all(&ch_header(1, 0)).unwrap();
    assert_eq!(ch_answer(&a), ch_header(1, 0));
    let ch_config = br#"{"vm_config":{},"common_cpuid":[],"memory_manager_data":{}}"#;
    (&a).write_all(&ch_header(2, ch_config.len() as u64))
        .unwrap();
    (&a).write_all(ch_config).unwrap();
    // Error, with our receiver's reason after the header (a Cloud
    // Hypervisor sender stops at the status).
    let answer = ch_answer(&a);
    assert_eq!(answer[..8], ch_header(2, 0)[..8], "Error");
    let length = u64::from_le_bytes(answer[8..].try_into().unwrap());
    let mut reason = vec![0u8; usize::try_from(length).unwrap()];
    std::io::Read::read_exact(&mut &a, &mut reason).unwrap();
    let reason = String::from_utf8(reason).unwrap();
    assert!(reason.contains("not \"dax-vmm\""), "{reason}");
    let e = receiver.join().unwrap().expect_err("refused");
    assert!(e.to_string().contains("not \"dax-vmm\""), "{e}");
}

/// Private guest RAM cannot be passed as fds: refused with Cloud
/// Hypervisor's message before anything is sent or paused.
#[test]
fn local_migration_of_private_memory_is_refused_by_chs_message() {
    if !have_kvm() {
        return;
    }
    let source = boot_program(&config());
    let e = check_local(&source).expect_err("private RAM");
    assert!(
        e.to_string()
            .contains("Local migration requires shared memory or hugepages enabled"),
        "{e}"
    );
    assert!(still_counting(&source));
}

/// What ch-remote v53 puts on the wire for `send-migration
/// destination_url=unix:/tmp/mig.sock,local=on` and `receive-migration
/// receiver_url=unix:/tmp/mig.sock` (captured from the binary; v53 refuses
/// a bare `receive-migration unix:/PATH` itself: "unknown option").
const CH_REMOTE_53_SEND: &str = r#"{"destination_url":"unix:/tmp/mig.sock","local":true,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Cancel","connections":1,"tls_dir":null,"memory_mode":"Precopy"}"#;
const CH_REMOTE_53_RECEIVE: &str =
    r#"{"receiver_url":"unix:/tmp/mig.sock","tls_dir":null,"memory_mode":"Precopy"}"#;

#[test]
fn ch_remote_53s_migration_bodies_are_taken() {
    let send = send_migration_from_json(&serde_json::from_str(CH_REMOTE_53_SEND).unwrap()).unwrap();
    assert_eq!(send.url, unix("/tmp/mig.sock"));
    assert!(send.local);
    assert_eq!(
        send.limits,
        PrecopyLimits {
            downtime: std::time::Duration::from_millis(300),
            timeout: std::time::Duration::from_secs(3600),
            strategy: TimeoutStrategy::Cancel
        }
    );
    let receive = receive_migration_from_json(&serde_json::from_str(CH_REMOTE_53_RECEIVE).unwrap());
    assert_eq!(receive.unwrap().url, unix("/tmp/mig.sock"));
}

fn unix(path: &str) -> MigrationUrl {
    MigrationUrl::Unix(std::path::PathBuf::from(path))
}

/// ch-remote v53's `send-migration destination_url=tcp:127.0.0.1:6000`
/// (local off) and `receive-migration receiver_url=tcp:0.0.0.0:6000`, and
/// the other ways to spell the URLs and bounds.
#[test]
fn tcp_urls_and_precopy_bounds_are_taken() {
    let send = send_migration_from_json(&json!({"destination_url": "tcp:127.0.0.1:6000",
        "local": false, "downtime_ms": 50, "timeout_s": 10, "timeout_strategy": "Ignore",
        "connections": 1, "tls_dir": null, "memory_mode": "Precopy"}))
    .unwrap();
    assert_eq!(
        send.url,
        MigrationUrl::Tcp("127.0.0.1:6000".parse().unwrap())
    );
    assert!(!send.local);
    assert_eq!(send.limits.downtime, std::time::Duration::from_millis(50));
    assert_eq!(send.limits.timeout, std::time::Duration::from_secs(10));
    assert_eq!(send.limits.strategy, TimeoutStrategy::Ignore);
    let receive = receive_migration_from_json(&json!({"receiver_url": "tcp:[::]:6000"})).unwrap();
    assert_eq!(receive.url, MigrationUrl::Tcp("[::]:6000".parse().unwrap()));
    assert_eq!(receive.url.to_string(), "tcp:[::]:6000");
    // A pre-copy over a unix socket (another VMM of the same host without
    // shared RAM) is taken too.
    let send = send_migration_from_json(&json!({"destination_url": "unix:/x"})).unwrap();
    assert!(!send.local);
    assert_eq!(send.limits.downtime, std::time::Duration::from_millis(300));
}

/// The bodies as ch-remote sends them are taken (unknown fields ignored);
/// what is not supported yet is refused by name.
#[test]
fn the_bodies_are_chs_and_refuse_by_name() {
    let send = json!({"destination_url": "unix:/run/m.sock", "local": true,
        "preserve_source": false, "downtime_ms": 300, "timeout_s": 3600,
        "timeout_strategy": "Cancel", "connections": 1, "tls_dir": null,
        "memory_mode": "Precopy", "from_the_future": 1});
    assert_eq!(
        send_migration_from_json(&send).unwrap().url,
        unix("/run/m.sock")
    );
    let refused = |body: serde_json::Value, what: &str| {
        let e = send_migration_from_json(&body).expect_err(what).to_string();
        assert!(e.contains(what) && e.contains("vm.send-migration"), "{e}");
    };
    refused(
        json!({"destination_url": "tcp:1.2.3.4:6000", "local": true}),
        "local=on passes guest RAM as fds",
    );
    refused(
        json!({"destination_url": "tcp:host.example:6000"}),
        "names are not resolved",
    );
    refused(
        json!({"destination_url": "http://x"}),
        "the scheme must be unix: or tcp:",
    );
    refused(
        json!({"destination_url": "tcp:1.2.3.4:6000", "downtime_ms": 0}),
        "downtime_ms: must be at least 1",
    );
    refused(
        json!({"destination_url": "tcp:1.2.3.4:6000", "timeout_s": 0}),
        "timeout_s: must be at least 1",
    );
    refused(
        json!({"destination_url": "tcp:1.2.3.4:6000", "timeout_strategy": "Retry"}),
        "timeout_strategy: \"Retry\" is neither Cancel nor Ignore",
    );
    refused(
        json!({"destination_url": "unix:/x", "local": true, "memory_mode": "Postcopy"}),
        "memory_mode=Postcopy is not supported yet",
    );
    refused(
        json!({"destination_url": "unix:/x", "local": true, "connections": 4}),
        "connections=4 is not supported yet",
    );
    refused(
        json!({"destination_url": "unix:/x", "local": true, "tls_dir": "/t"}),
        "tls_dir is not supported yet",
    );
    refused(
        json!({"destination_url": "unix:/x", "local": true, "preserve_source": true}),
        "preserve_source is not supported yet",
    );
    refused(json!({"local": true}), "destination_url");

    let receive = json!({"receiver_url": "unix:/run/m.sock", "tls_dir": null,
        "memory_mode": "Precopy", "vfio_fds": null, "iommufd_fd": null,
        "zone_updates": [], "extra": true});
    assert_eq!(
        receive_migration_from_json(&receive).unwrap().url,
        unix("/run/m.sock")
    );
    // An empty fd list means none (the schema allows it).
    let empty = json!({"receiver_url": "unix:/x", "vfio_fds": [], "zone_updates": null});
    receive_migration_from_json(&empty).expect("an empty vfio_fds list");
    let e = receive_migration_from_json(&json!({"receiver_url": "unix:/x", "vfio_fds": [{}]}))
        .expect_err("vfio fds")
        .to_string();
    assert!(e.contains("vfio_fds is not supported yet"), "{e}");
    let e = receive_migration_from_json(&json!({"receiver_url": "tcp:0.0.0.0"}))
        .expect_err("no port")
        .to_string();
    assert!(
        e.contains("receiver_url") && e.contains("ADDRESS:PORT"),
        "{e}"
    );
    let e =
        receive_migration_from_json(&json!({"receiver_url": "unix:/x", "memory_mode": "Postcopy"}))
            .expect_err("postcopy")
            .to_string();
    assert!(
        e.contains("memory_mode=Postcopy is not supported yet"),
        "{e}"
    );
}

/// The receive over a socket path: it listens, takes the sender, removes
/// the socket file; the send connects to it.
#[test]
fn the_endpoints_meet_on_a_socket_path() {
    if !have_kvm() {
        return;
    }
    let dir = crate::snapshot::tests::Scratch::new("migration-path");
    let path = dir.0.join("m.sock");
    let config = shared_config();
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let listen_at = path.clone();
    let receiver = std::thread::spawn(move || {
        let r = receive_migration(&MigrationUrl::Unix(listen_at), None).expect("received");
        let c = counter(&r.vm);
        counter_passes(&r.vm, c) > c
    });
    test_infra::host::wait_for_path(&path);
    let target = SendMigration {
        url: MigrationUrl::Unix(path.clone()),
        local: true,
        limits: send_migration_from_json(&json!({"destination_url": "unix:/x"}))
            .unwrap()
            .limits,
    };
    send_migration(&mut source, &config, &target).expect("sent");
    assert!(receiver.join().unwrap());
    assert!(!path.exists(), "the socket file is removed once taken");
}

/// Both sides on threads under the main thread's seccomp filter (kill
/// mode), as the control loop runs them: socket path, listen, accept,
/// connect, memfds passed by SCM_RIGHTS, the VM built and resumed there;
/// and the same over TCP, with RAM copied while the guest runs.
#[test]
fn both_sides_pass_the_main_threads_seccomp_filter() {
    use crate::seccomp_filters::{all_for, VMM};
    if !have_kvm() {
        return;
    }
    let filter = || {
        all_for(std::process::id())
            .into_iter()
            .find(|(k, _)| *k == VMM)
            .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
            .expect("the main thread's filter")
    };
    let dir = crate::snapshot::tests::Scratch::new("migration-seccomp");
    let free_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let limits = send_migration_from_json(&json!({"destination_url": "unix:/x"}))
        .unwrap()
        .limits;
    let local = SendMigration {
        url: MigrationUrl::Unix(dir.0.join("m.sock")),
        local: true,
        limits,
    };
    let tcp = SendMigration {
        url: MigrationUrl::Tcp(free_port),
        local: false,
        limits,
    };
    for target in [local, tcp] {
        let (receiver_filter, sender_filter) = (filter(), filter());
        let listen_at = target.url.clone();
        let receiver = std::thread::spawn(move || {
            seccomp::apply_filter(&receiver_filter).unwrap();
            let r = receive_migration(&listen_at, None).expect("received");
            let c = counter(&r.vm);
            let counts = counter_passes(&r.vm, c) > c;
            r.vm.stop();
            counts
        });
        let sender = std::thread::spawn(move || {
            seccomp::apply_filter(&sender_filter).unwrap();
            let config = shared_config();
            let mut source = boot_program(&config);
            counter_passes(&source, 10);
            // Until the receiver listens, the connect fails and nothing
            // else has happened.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                match send_migration(&mut source, &config, &target) {
                    Ok(()) => break,
                    Err(MigrationError::Socket {
                        what: "connecting", ..
                    }) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    Err(e) => panic!("{}: {e}", target.url),
                }
            }
            source.vcpus.paused()
        });
        assert!(sender.join().expect("the filtered sender"), "left paused");
        assert!(receiver.join().expect("the filtered receiver"));
    }
}

/// A VM with a net device: its tap travels as a `TapFd` (our tap is
/// single-queue, so the receiver could not open it by name while the
/// sender holds it: EBUSY), and the receiver's device is built on it.
/// Needs CAP_NET_ADMIN (skipped without).
#[test]
fn a_net_devices_tap_is_passed_to_the_receiver() {
    if !have_kvm() {
        return;
    }
    // No other test's forked child may hold a copy of the tap meanwhile.
    let _forks = seccomp::FORK_GUARD
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let name = format!("daxlm{}", std::process::id() % 100000);
    match virtio_devices::net::Tap::open_named(&name) {
        Ok(probe) => drop(probe),
        Err(e) => return eprintln!("no tap here ({e}); skipped"),
    }
    let mut config = shared_config();
    config.net = vec![crate::config::NetConfig::parse(
        &format!("tap={name},mac=52:54:00:12:34:56,id=net0"),
        0,
    )
    .expect("net config")];
    let mut source = boot_program(&config);
    counter_passes(&source, 10);
    let mut r = migrate(&mut source, &config, |r| r);
    // The old VMM exits: its copy of the tap goes.
    drop(source);
    let taps: Vec<String> =
        r.vm.devices
            .net_taps()
            .map(|(id, _)| id.to_string())
            .collect();
    assert!(still_counting(&r.vm));
    assert_eq!(taps, ["net0"]);
    // The tap came as an fd but is still the VM's by name: a later
    // migration's switch lets go of it, so that another VMM can open it
    // by name, and takes it back.
    r.vm.pause();
    let _doc = r.vm.state_document(&r.config).expect("saved");
    let released = r.vm.release_for_switch().expect("released");
    let free = virtio_devices::net::Tap::open_named(&name).is_ok();
    r.vm.reclaim_after_switch(released).expect("taken back");
    assert!(free, "the passed tap is let go of at a later switch");
}
