//! The control loop's answers without a booted VM: the states and the
//! refusals Cloud Hypervisor's API gives, and what a device added before
//! boot does to the configuration. Booted paths are the guest tests'.

use super::*;
use crate::device_manager::virtio_pci::PciAddress;

/// A configuration `vm.create` accepts (nothing is opened before boot).
fn create_body() -> Value {
    json!({
        "payload": {"kernel": "/nonexistent/bzImage", "cmdline": "console=ttyS0"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 268_435_456u64},
        "serial": {"mode": "Null"},
    })
}

fn control() -> ControlLoop {
    ControlLoop::new(None, EventBus::with_capacity(4), DaemonNotices::default())
}

fn created() -> ControlLoop {
    let mut c = control();
    assert!(matches!(
        c.handle(VmmAction::Create(create_body())),
        Ok(VmmReply::NoContent)
    ));
    c
}

/// The status and message of a refused action.
fn refused(c: &mut ControlLoop, action: VmmAction) -> (u16, String) {
    match c.handle(action) {
        Err(e) => (e.status, e.message),
        Ok(_) => panic!("the action was not refused"),
    }
}

fn info(c: &mut ControlLoop) -> Value {
    match c.handle(VmmAction::Info) {
        Ok(VmmReply::Json(v)) => v,
        Ok(_) => panic!("vm.info answered without JSON"),
        Err(e) => panic!("vm.info: {}", e.message),
    }
}

fn disk_ids(c: &mut ControlLoop) -> Vec<String> {
    info(c)["config"]["disks"]
        .as_array()
        .map(|d| {
            d.iter()
                .map(|d| d["id"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn without_a_configuration_every_vm_action_is_refused_with_409() {
    let mut c = control();
    for (action, text) in [
        (
            VmmAction::Boot,
            "vm.boot: no VM is created (vm.create first)",
        ),
        (VmmAction::Info, "vm.info: no VM is created"),
        (
            VmmAction::Resize(json!({"desired_vcpus": 2})),
            "vm.resize: no VM is created (vm.create first)",
        ),
        (
            VmmAction::RemoveDevice("disk0".into()),
            "vm.remove-device: no VM is created (vm.create first)",
        ),
        (
            VmmAction::AddDisk(json!({"path": "/d", "id": "disk0"})),
            "vm.add-disk: no VM is created (vm.create first)",
        ),
    ] {
        assert_eq!(refused(&mut c, action), (409, text.to_string()));
    }
    assert!(c.config.is_none());
}

#[test]
fn create_makes_a_created_vm_and_a_second_create_is_refused() {
    let mut c = created();
    let v = info(&mut c);
    assert_eq!(v["state"], "Created");
    assert_eq!(v["memory_actual_size"], 268_435_456u64);
    assert!(v.get("device_tree").is_none(), "no device tree before boot");
    assert_eq!(
        refused(&mut c, VmmAction::Create(create_body())),
        (
            409,
            "vm.create: a VM is already created (vm.delete it first)".into()
        )
    );
}

#[test]
fn a_bad_configuration_is_refused_with_400_and_nothing_is_created() {
    let mut c = control();
    let (status, message) = refused(
        &mut c,
        VmmAction::Create(json!({"payload": {"kernel": "/k"}, "memory": {"size": 4096}})),
    );
    assert_eq!(status, 400);
    assert!(message.starts_with("vm.create: "), "{message}");
    assert!(c.config.is_none());
}

#[test]
fn a_created_vm_refuses_what_needs_it_running() {
    let mut c = created();
    for (action, endpoint) in [
        (VmmAction::ShutdownVm, "vm.shutdown"),
        (VmmAction::Reboot, "vm.reboot"),
        (VmmAction::PowerButton, "vm.power-button"),
        (VmmAction::Pause, "vm.pause"),
    ] {
        assert_eq!(
            refused(&mut c, action),
            (
                409,
                format!("{endpoint}: the VM is not running (it is Created)")
            )
        );
    }
    assert_eq!(
        refused(&mut c, VmmAction::Resume),
        (
            409,
            "vm.resume: the VM is not paused (it is Created)".into()
        )
    );
    assert_eq!(c.state, State::Created);
}

/// Without /dev/kvm the boot fails at once; with it, at the missing
/// kernel: either way 500, and the VM stays created, not booted.
#[test]
fn a_boot_that_fails_answers_500_and_leaves_the_vm_created() {
    let mut c = created();
    let (status, message) = refused(&mut c, VmmAction::Boot);
    assert_eq!(status, 500);
    assert!(message.starts_with("vm.boot: "), "{message}");
    assert!(c.vm.is_none());
    assert_eq!(info(&mut c)["state"], "Created");
}

#[test]
fn a_device_added_before_boot_joins_the_configuration_only_if_it_checks_out() {
    let mut c = created();
    let disk = json!({"path": "/nonexistent/disk.img", "id": "disk0"});
    assert!(matches!(
        c.handle(VmmAction::AddDisk(disk.clone())),
        Ok(VmmReply::NoContent)
    ));
    assert_eq!(disk_ids(&mut c), ["disk0"]);
    // The same id again: 409, as Cloud Hypervisor answers.
    let (status, message) = refused(&mut c, VmmAction::AddDisk(disk));
    assert_eq!(status, 409);
    assert!(message.starts_with("vm.add-disk: "), "{message}");
    // A body the parser refuses: 400.
    let (status, message) = refused(
        &mut c,
        VmmAction::AddDisk(json!({"path": "/d", "rate_limiter_config": {}})),
    );
    assert_eq!(status, 400);
    assert!(message.starts_with("vm.add-disk: "), "{message}");
    // Neither refusal changed the configuration.
    assert_eq!(disk_ids(&mut c), ["disk0"]);
}

#[test]
fn a_second_vsock_device_is_refused_and_the_first_stays() {
    let mut c = created();
    let vsock = |id: &str| json!({"cid": 3, "socket": "/nonexistent/v.sock", "id": id});
    assert!(c.handle(VmmAction::AddVsock(vsock("vsock0"))).is_ok());
    assert_eq!(
        refused(&mut c, VmmAction::AddVsock(vsock("vsock1"))),
        (
            409,
            "vm.add-vsock: the VM has a vsock device already (\"vsock0\"); remove it first".into()
        )
    );
    assert_eq!(info(&mut c)["config"]["vsock"]["id"], "vsock0");
}

#[test]
fn remove_device_before_boot_takes_it_out_of_the_configuration() {
    let mut c = created();
    let disk = json!({"path": "/nonexistent/disk.img", "id": "disk0"});
    assert!(c.handle(VmmAction::AddDisk(disk)).is_ok());
    assert!(matches!(
        c.handle(VmmAction::RemoveDevice("disk0".into())),
        Ok(VmmReply::NoContent)
    ));
    assert!(disk_ids(&mut c).is_empty());
    assert_eq!(
        refused(&mut c, VmmAction::RemoveDevice("disk0".into())),
        (404, "vm.remove-device: no device with id \"disk0\"".into())
    );
}

#[test]
fn delete_forgets_the_configuration_and_create_works_again() {
    let mut c = created();
    assert!(matches!(
        c.handle(VmmAction::Delete),
        Ok(VmmReply::NoContent)
    ));
    assert!(c.config.is_none());
    assert_eq!(refused(&mut c, VmmAction::Info).0, 409);
    assert!(c.handle(VmmAction::Create(create_body())).is_ok());
    assert_eq!(info(&mut c)["state"], "Created");
}

#[test]
fn without_a_vm_there_are_no_counters() {
    let mut c = created();
    assert!(matches!(
        c.handle(VmmAction::Counters),
        Ok(VmmReply::Json(v)) if v == json!({})
    ));
    assert!(matches!(
        c.handle(VmmAction::KvmCounters),
        Ok(VmmReply::Kvm(None))
    ));
}

/// What the API answers for each way a hot-plug can fail; the guest tests
/// assert the MMIO refusal's status and text.
#[test]
fn hotplug_errors_become_400_409_or_500() {
    let at = PciAddress {
        segment: 0,
        slot: 3,
    };
    let mmio = DeviceManagerError::HotplugOverMmio { id: "pmem9".into() };
    let e = hotplug_error("vm.add-pmem", &mmio);
    assert_eq!(
        (e.status, e.message.as_str()),
        (
            400,
            "vm.add-pmem: hot-plug: pmem9: hot-plug is over virtio-PCI only (transport=mmio has no hot-plug)"
        )
    );
    let in_use = DeviceManagerError::IdStillPlaced {
        id: "fs0".into(),
        at,
    };
    let e = hotplug_error("vm.add-fs", &in_use);
    assert_eq!(
        (e.status, e.message.as_str()),
        (
            409,
            "vm.add-fs: hot-plug: fs0: a device with this id is still at 0000:00:03.0 (its removal waits for the guest to eject it)"
        )
    );
    let failed = DeviceManagerError::Announce {
        at,
        source: std::io::Error::from_raw_os_error(libc::EAGAIN),
    };
    assert_eq!(hotplug_error("vm.add-disk", &failed).status, 500);
}

#[test]
fn a_window_truncation_is_streamed_and_queued_for_the_daemon_other_events_only_streamed() {
    let events = EventBus::with_capacity(16);
    let mut stream = events.subscribe();
    let notices = DaemonNotices::default();
    let control = ControlLoop::new(None, events, notices.clone());
    let observer = control.observer()("fs0");
    observer.event(&WindowEvent::Unmap {
        offset: 0,
        len: 0x1000,
    });
    observer.event(&WindowEvent::Truncated {
        offset: 0x20_0000,
        len: 0x3000,
    });
    let unmap = stream.try_recv().unwrap();
    assert_eq!((unmap.kind, unmap.device.as_str()), ("unmap", "fs0"));
    let truncated = stream.try_recv().unwrap();
    assert_eq!(truncated.kind, "truncated");
    assert_eq!(
        truncated.fields,
        json!({"offset": 0x20_0000, "len": 0x3000})
    );
    assert_eq!(
        notices.take(),
        vec![(
            "fs0".to_string(),
            vec![api::DaemonNotice::Truncated(
                control_protocol::WindowTruncated {
                    offset: 0x20_0000,
                    len: 0x3000
                }
            )]
        )]
    );
}

/// What ch-remote sends for `snapshot file:///DIR`.
fn snapshot_body(dir: &std::path::Path) -> VmmAction {
    VmmAction::Snapshot(json!({"destination_url": format!("file://{}", dir.display())}))
}

/// What ch-remote sends for `restore source_url=file:///DIR`.
fn restore_body(dir: &std::path::Path) -> Value {
    json!({"source_url": format!("file://{}", dir.display()), "prefault": false,
           "memory_restore_mode": "Copy", "net_fds": null, "vfio_fds": null,
           "iommufd_fd": null, "resume": false, "zone_updates": []})
}

/// A directory of its own for one test.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("control-loop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Cloud Hypervisor's status mapping: a bad body 400 (before anything
/// else), no VM 404, a VM in any state but paused 500 naming the state.
#[test]
fn only_a_paused_vm_is_snapshotted_and_the_refusals_name_why() {
    let dir = scratch_dir("snapshot-states");
    let mut c = control();
    assert_eq!(
        refused(&mut c, snapshot_body(&dir)),
        (404, "vm.snapshot: no VM is created".into())
    );
    let (status, message) = refused(
        &mut c,
        VmmAction::Snapshot(json!({"destination_url": "tcp://10.0.0.1/s"})),
    );
    assert_eq!(status, 400);
    assert!(
        message.starts_with("vm.snapshot: VmSnapshotConfig.destination_url=\"tcp://10.0.0.1/s\""),
        "{message}"
    );
    let mut c = created();
    assert_eq!(
        refused(&mut c, snapshot_body(&dir)),
        (
            500,
            "vm.snapshot: the VM is not booted (it is Created): only a paused VM can be snapshotted"
                .into()
        )
    );
    // The state check alone: a running VM is refused before it is touched.
    c.state = State::Running;
    assert_eq!(
        refused(&mut c, snapshot_body(&dir)),
        (
            500,
            "vm.snapshot: trying to snapshot while the VM is running: pause it first (vm.pause)"
                .into()
        )
    );
    assert!(
        std::fs::read_dir(&dir).unwrap().next().is_none(),
        "nothing was written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restore_is_refused_when_a_vm_exists_and_nothing_changes() {
    let dir = scratch_dir("restore-over-vm");
    let mut c = created();
    let before = info(&mut c);
    let (status, message) = refused(&mut c, VmmAction::Restore(restore_body(&dir), Vec::new()));
    assert_eq!(status, 500);
    assert_eq!(
        message,
        "vm.restore: a VM is already created (it is Created): restore into a VMM without one (vm.delete it first)"
    );
    assert_eq!(info(&mut c), before, "the created VM is left as it was");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restore_bodies_and_fds_it_cannot_take_are_refused_with_400() {
    let dir = scratch_dir("restore-bodies");
    let mut c = control();
    let mut ondemand = restore_body(&dir);
    ondemand["memory_restore_mode"] = json!("OnDemand");
    let (status, message) = refused(&mut c, VmmAction::Restore(ondemand, Vec::new()));
    assert_eq!(status, 400);
    assert!(
        message.starts_with("vm.restore: RestoreConfig.memory_restore_mode=\"OnDemand\""),
        "{message}"
    );
    let (status, message) = refused(
        &mut c,
        VmmAction::Restore(json!({"source_url": "/no/scheme"}), Vec::new()),
    );
    assert_eq!(status, 400);
    assert!(message.contains("RestoreConfig.source_url"), "{message}");
    // An fd with a body whose net_fds names none: 400, as Cloud Hypervisor
    // answers a count that does not match.
    let fd = std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
    let (status, message) = refused(&mut c, VmmAction::Restore(restore_body(&dir), vec![fd]));
    assert_eq!(status, 400);
    assert!(
        message.starts_with("vm.restore: 1 file descriptor(s) came with the request"),
        "{message}"
    );
    assert!(c.config.is_none() && c.vm.is_none());
    // net_fds names net0, and what came is no tap: 400 naming both.
    let mut with_net = restore_body(&dir);
    with_net["net_fds"] = json!([{"id": "net0", "num_fds": 1, "fds": null}]);
    let fd = std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
    let (status, message) = refused(&mut c, VmmAction::Restore(with_net.clone(), vec![fd]));
    assert_eq!(status, 400);
    assert!(
        message.starts_with("vm.restore: net_fds: fd 0 of net0 is not a tap"),
        "{message}"
    );
    // Named but not sent.
    let (status, message) = refused(&mut c, VmmAction::Restore(with_net, Vec::new()));
    assert_eq!(status, 400);
    assert!(
        message.starts_with(
            "vm.restore: 0 file descriptor(s) came with the request, but net_fds names 1"
        ),
        "{message}"
    );
    assert!(c.config.is_none() && c.vm.is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A source that is no directory, or a directory without a snapshot:
/// 500 naming it, and the VMM still has no VM (a later restore or
/// vm.create works).
#[test]
fn a_restore_that_fails_leaves_no_vm() {
    let dir = scratch_dir("restore-empty");
    let mut c = control();
    let missing = dir.join("missing");
    let (status, message) = refused(
        &mut c,
        VmmAction::Restore(restore_body(&missing), Vec::new()),
    );
    assert_eq!(status, 500);
    assert_eq!(
        message,
        format!(
            "vm.restore: source_url: {} is not a directory",
            missing.display()
        )
    );
    let (status, message) = refused(&mut c, VmmAction::Restore(restore_body(&dir), Vec::new()));
    assert_eq!(status, 500);
    assert!(
        message.starts_with(&format!(
            "vm.restore: the VM could not be restored from {}: ",
            dir.display()
        )),
        "{message}"
    );
    assert!(c.config.is_none() && c.vm.is_none());
    assert_eq!(refused(&mut c, VmmAction::Info).0, 409);
    assert!(c.handle(VmmAction::Create(create_body())).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The whole way through the control loop on real KVM, with the snapshot
/// tests' guest (a program counting in RAM, no virtio device): a running
/// VM is refused, paused it is snapshotted; a new loop restores it from
/// ch-remote's body, paused, with the snapshot's configuration in
/// `vm.info`; resumed, the program counts on from where it was; a second
/// restore into that loop is refused. Skipped without /dev/kvm.
#[test]
fn a_vm_snapshotted_by_one_loop_is_restored_paused_by_another_and_resumes() {
    use crate::snapshot::tests::{
        boot_program, config, counter, counter_passes, have_kvm, Scratch,
    };
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("control-loop");
    let config = config();
    let mut source = control();
    source.vm = Some(boot_program(&config));
    source.config = Some(config.clone());
    source.state = State::Running;
    counter_passes(source.vm.as_ref().unwrap(), 100);
    assert_eq!(refused(&mut source, snapshot_body(&dir.0)).0, 500);
    assert!(source.handle(VmmAction::Pause).is_ok());
    assert!(matches!(
        source.handle(snapshot_body(&dir.0)),
        Ok(VmmReply::NoContent)
    ));
    let saved = counter(source.vm.as_ref().unwrap());
    assert_eq!(info(&mut source)["state"], "Paused", "still paused");
    source.stop_vm();

    let mut target = control();
    assert!(matches!(
        target.handle(VmmAction::Restore(restore_body(&dir.0), Vec::new())),
        Ok(VmmReply::NoContent)
    ));
    let restored = info(&mut target);
    assert_eq!(restored["state"], "Paused");
    assert_eq!(restored["config"], vm_config_to_json(&config));
    assert_eq!(
        counter(target.vm.as_ref().unwrap()),
        saved,
        "paused as saved"
    );
    let (status, message) = refused(
        &mut target,
        VmmAction::Restore(restore_body(&dir.0), Vec::new()),
    );
    assert_eq!(status, 500);
    assert!(
        message.contains("a VM is already created (it is Paused)"),
        "{message}"
    );
    assert!(target.handle(VmmAction::Resume).is_ok());
    counter_passes(target.vm.as_ref().unwrap(), saved);
    target.stop_vm();

    // `resume: true` (and `--restore …,resume=true`): running at once.
    let mut resumed = control();
    let mut body = restore_body(&dir.0);
    body["resume"] = json!(true);
    assert!(resumed.handle(VmmAction::Restore(body, Vec::new())).is_ok());
    assert_eq!(info(&mut resumed)["state"], "Running");
    counter_passes(resumed.vm.as_ref().unwrap(), saved);
    resumed.stop_vm();
}

/// `vm.send-migration` and `vm.receive-migration` through two loops, with
/// ch-remote's bodies: the receiving loop has the VM running, with the
/// sender's configuration; the sending loop ends once it answered. The
/// refusals: no VM (404), what is not supported yet (400, named), a
/// receive into a loop that has a VM (500). Skipped without /dev/kvm.
#[test]
fn a_vm_sent_by_one_loop_is_received_running_by_another() {
    use crate::snapshot::tests::{
        boot_program, config, counter, counter_passes, have_kvm, Scratch,
    };
    let mut empty = control();
    let send = |path: &std::path::Path| {
        VmmAction::SendMigration(
            json!({"destination_url": format!("unix:{}", path.display()),
            "local": true, "preserve_source": false, "downtime_ms": 300, "timeout_s": 3600,
            "timeout_strategy": "Cancel", "connections": 1, "tls_dir": null, "memory_mode": "Precopy"}),
        )
    };
    let (status, message) = refused(&mut empty, send(std::path::Path::new("/m.sock")));
    assert_eq!(status, 404, "{message}");
    let (status, message) = refused(
        &mut empty,
        VmmAction::SendMigration(json!({"destination_url": "tcp:10.0.0.1:6000", "local": true})),
    );
    assert_eq!(status, 400);
    assert!(
        message.contains("local=on passes guest RAM as fds"),
        "{message}"
    );
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("control-loop-migration");
    let path = dir.0.join("m.sock");
    let mut config = config();
    config.memory.shared = true;
    let mut source = control();
    source.vm = Some(boot_program(&config));
    source.config = Some(config.clone());
    source.state = State::Running;
    let (status, message) = refused(
        &mut source,
        VmmAction::ReceiveMigration(json!({"receiver_url": format!("unix:{}", path.display())})),
    );
    assert_eq!(status, 500);
    assert!(message.contains("a VM is already created"), "{message}");
    counter_passes(source.vm.as_ref().unwrap(), 100);

    let listen_at = path.clone();
    let expected = vm_config_to_json(&config);
    let target = std::thread::spawn(move || {
        let mut target = control();
        let body = json!({"receiver_url": format!("unix:{}", listen_at.display()),
            "tls_dir": null, "memory_mode": "Precopy", "vfio_fds": null, "iommufd_fd": null,
            "zone_updates": []});
        assert!(matches!(
            target.handle(VmmAction::ReceiveMigration(body)),
            Ok(VmmReply::NoContent)
        ));
        let received = info(&mut target);
        assert_eq!(received["state"], "Running");
        assert_eq!(received["config"], expected);
        let vm = target.vm.as_ref().unwrap();
        let c = counter(vm);
        counter_passes(vm, c);
        target.stop_vm();
    });
    test_infra::host::wait_for_path(&path);
    assert!(matches!(
        source.handle(send(&path)),
        Ok(VmmReply::NoContent)
    ));
    assert!(source.migrated, "the loop ends after the answer");
    target.join().unwrap();
}

/// `vm.shutdown` and `vm.delete` free the VM's devices: the writable
/// disk's image locks again and the vsock's socket path binds, so the next
/// `vm.boot` (or `vm.create` then `vm.boot`) can open them.
#[test]
fn shutdown_and_delete_release_the_disk_lock_and_the_vsock_socket() {
    use crate::snapshot::tests::{boot_program, counter_passes, have_kvm, Scratch};
    use crate::vm::tests::{assert_released, holds, with_disk_and_vsock};
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("control-loop-release");
    let (config, image, socket) = with_disk_and_vsock(&dir.0);
    for action in [VmmAction::ShutdownVm, VmmAction::Delete] {
        let mut c = control();
        c.vm = Some(boot_program(&config));
        c.config = Some(config.clone());
        c.state = State::Running;
        counter_passes(c.vm.as_ref().unwrap(), 5);
        assert!(holds(&image, &socket), "the running VM holds both");
        assert!(matches!(c.handle(action), Ok(VmmReply::NoContent)));
        assert!(c.vm.is_none());
        assert_released(&dir.0, &image, &socket);
    }
}
