//! The parts of building a VM that can be checked without running a guest:
//! the serial output, the platform devices' ports, the memory hot-plug
//! controller and what a boot that cannot load its kernel reports. The
//! ones that need a VM fd are skipped where /dev/kvm cannot be opened.

use std::path::PathBuf;

use serde_json::json;

use super::*;
use crate::config::json::vm_config_from_json;
use crate::config::MemoryConfig;

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vm-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test directory");
    dir
}

/// A VM fd with its interrupt controller, or None (skipped) without KVM.
fn kvm_vm() -> Option<VmFd> {
    let Ok(kvm) = Kvm::new() else {
        eprintln!("no /dev/kvm; skipped");
        return None;
    };
    Some(create_vm(&kvm).expect("a VM with the capabilities the VMM needs"))
}

fn config(extra: serde_json::Value) -> VmConfig {
    let mut body =
        json!({"payload": {"kernel": "/nonexistent/bzImage"}, "serial": {"mode": "Null"}});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    vm_config_from_json(&body).expect("config")
}

#[test]
fn serial_output_is_none_when_off_and_appends_to_a_file() {
    assert!(serial_output(&SerialMode::Off).expect("off").is_none());
    let dir = scratch_dir("serial");
    let path = dir.join("console.log");
    std::fs::write(&path, "before\n").expect("log");
    let mut out = serial_output(&SerialMode::File(path.clone()))
        .expect("file")
        .expect("a writer");
    out.write_all(b"after\n").expect("write");
    drop(out);
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "before\nafter\n"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn a_serial_file_that_cannot_be_opened_names_its_path() {
    let path = PathBuf::from("/nonexistent/dir/console.log");
    let e = serial_output(&SerialMode::File(path))
        .err()
        .expect("refused");
    assert!(
        matches!(&e, VmError::SerialFile { path, .. } if path == "/nonexistent/dir/console.log"),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with("--serial file=/nonexistent/dir/console.log: "),
        "{e}"
    );
}

#[test]
fn kvm_setup_names_the_step_that_failed() {
    let r: Result<(), _> = Err(kvm_ioctls::Error::new(libc::EINVAL));
    let e = kvm_setup("KVM_CREATE_PIT2", r).expect_err("failed");
    assert!(matches!(
        e,
        VmError::KvmSetup {
            what: "KVM_CREATE_PIT2",
            ..
        }
    ));
    assert!(e.to_string().starts_with("KVM_CREATE_PIT2: "), "{e}");
}

#[test]
fn platform_devices_take_their_ports_and_a_second_set_names_the_one_refused() {
    let Some(vm) = kvm_vm() else {
        return;
    };
    let pio = Bus::new();
    let exit = Arc::new(ExitHandle::new().expect("exit handle"));
    let config = config(json!({}));
    let (serial_dev, _ged, aml) =
        add_platform_devices(&vm, &config, &pio, &exit).expect("platform devices");
    assert!(serial_dev.is_some(), "serial mode Null still has a port");
    assert!(!aml.is_empty(), "the DSDT describes them");
    // The serial port comes first, and its ports are taken now.
    let e = add_platform_devices(&vm, &config, &pio, &exit)
        .err()
        .expect("ports taken");
    assert!(
        matches!(
            e,
            VmError::PlatformPorts {
                device: "serial port",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn the_memory_hotplug_controller_is_on_the_bus_only_with_hotplug_size() {
    let memory = |hotplug_size| MemoryConfig {
        hotplug_size,
        ..MemoryConfig::default()
    };
    let port = u64::from(crate::memory::hotplug_controller::MEMORY_HOTPLUG_PORT);
    let pio = Bus::new();
    let mut aml = Vec::new();
    add_memory_hotplug(&RamHotplug::new(&memory(None)), &pio, &mut aml).expect("no controller");
    assert!(
        !aml.is_empty(),
        "the DSDT has the MSCN the GED calls anyway"
    );
    assert!(
        !pio.read(port, &mut [0u8; 4]),
        "no controller without hotplug_size"
    );

    let ram = RamHotplug::new(&memory(Some(crate::config::HOTPLUG_BLOCK)));
    add_memory_hotplug(&ram, &pio, &mut Vec::new()).expect("controller");
    assert!(
        pio.read(port, &mut [0u8; 4]),
        "the controller answers at its port"
    );
    let e = add_memory_hotplug(&ram, &pio, &mut Vec::new()).expect_err("ports taken");
    assert!(
        matches!(
            e,
            VmError::PlatformPorts {
                device: "memory hot-plug controller",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_missing_kernel_fails_the_payload_with_its_path() {
    let config = config(json!({}));
    let mem = memory::create_guest_memory(&config.memory).expect("guest RAM");
    let e = load_payload(&mem, &config, &[]).expect_err("no kernel");
    assert!(matches!(e, VmError::Boot(_)), "{e}");
    assert!(e.to_string().contains("/nonexistent/bzImage"), "{e}");
}

#[test]
fn a_whole_boot_without_its_kernel_fails_naming_it() {
    if Kvm::new().is_err() {
        return eprintln!("no /dev/kvm; skipped");
    }
    let config = config(json!({"memory": {"size": crate::config::MIN_MEMORY}}));
    let e = Vm::boot(&config, None).err().expect("no kernel");
    assert!(matches!(e, VmError::Boot(_)), "{e}");
    assert!(e.to_string().contains("/nonexistent/bzImage"), "{e}");
}

/// The fds of this process that name a file under `dir`.
fn fds_under(dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(dir))
        .collect()
}

/// The snapshot tests' VM with the writable disk `disk0` on a new image in
/// `dir` and the vsock `vsock0` listening in `dir`: the config, the image
/// and the socket's path.
pub(crate) fn with_disk_and_vsock(dir: &std::path::Path) -> (VmConfig, PathBuf, PathBuf) {
    use crate::config::{DiskConfig, VsockConfig};
    let (image, socket) = (dir.join("disk.img"), dir.join("v.sock"));
    std::fs::write(&image, vec![0u8; 64 << 10]).unwrap();
    let mut config = crate::snapshot::tests::config();
    config.disks =
        vec![DiskConfig::parse(&format!("path={},id=disk0", image.display()), 0).unwrap()];
    config.vsock =
        Some(VsockConfig::parse(&format!("cid=3,socket={},id=vsock0", socket.display())).unwrap());
    (config, image, socket)
}

/// Whether a running VM holds `image`'s lock and listens on `socket`.
pub(crate) fn holds(image: &std::path::Path, socket: &std::path::Path) -> bool {
    use virtio_devices::block::{DiskError, DiskFile};
    let locked = matches!(
        DiskFile::open(image, false, false),
        Err(DiskError::Locked { .. })
    );
    locked && socket.exists()
}

/// Checks that nothing of a VM gone is left in `dir`: no fd of this
/// process names a file there, the socket's name is gone and the path
/// binds, the image locks again.
pub(crate) fn assert_released(
    dir: &std::path::Path,
    image: &std::path::Path,
    socket: &std::path::Path,
) {
    assert_eq!(fds_under(dir), Vec::<PathBuf>::new(), "fds left open");
    assert!(!socket.exists(), "the socket's name is gone");
    drop(std::os::unix::net::UnixListener::bind(socket).expect("the path binds"));
    std::fs::remove_file(socket).unwrap();
    let again = virtio_devices::block::DiskFile::open(image, false, false);
    assert!(again.is_ok(), "the image locks again");
}

/// Dropping a booted VM frees its devices: its writable disk's image can
/// be locked again, its vsock socket's name is gone (the path binds), no
/// fd of this process names either; and a VM on the same image and path
/// boots again and is freed the same way. Both buses (which hold every
/// device) are freed with it.
#[test]
fn dropping_a_vm_releases_its_disk_lock_and_vsock_socket() {
    use crate::snapshot::tests::{boot_program, counter_passes, have_kvm, Scratch};
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("vm-drop");
    let (config, image, socket) = with_disk_and_vsock(&dir.0);
    for _cycle in 0..2 {
        let vm = boot_program(&config);
        counter_passes(&vm, 5);
        assert!(holds(&image, &socket), "the running VM holds both");
        // The buses hold every device: nothing may keep them once the VM
        // is gone.
        let buses = (Arc::downgrade(&vm.buses.0), Arc::downgrade(&vm.buses.1));
        drop(vm);
        assert!(buses.0.upgrade().is_none(), "the port I/O bus is freed");
        assert!(buses.1.upgrade().is_none(), "the MMIO bus is freed");
        assert_released(&dir.0, &image, &socket);
    }
}

/// Guest RAM as a migration receives it (a memfd): the runs of it the host
/// holds are exactly the pages written, a walk stops when asked, and a
/// VM base maps those pages for the guest and no others (where KVM has
/// KVM_PRE_FAULT_MEMORY).
#[test]
fn only_the_ram_the_host_holds_is_prefaulted() {
    use crate::memory::prefault::for_each_resident_run;
    use vm_memory::{Bytes, GuestAddress};
    let config = config(json!({"memory": {"size": crate::config::MIN_MEMORY, "shared": true}}));
    let mem = memory::create_guest_memory(&config.memory).expect("guest RAM");
    mem.write_slice(&[1u8], GuestAddress(0x10_0000))
        .expect("write");
    mem.write_slice(&[1u8; 8192], GuestAddress(0x20_0000))
        .expect("write");
    let mut runs = Vec::new();
    for_each_resident_run(&mem, |gpa, len| {
        runs.push((gpa, len));
        true
    });
    assert_eq!(runs, vec![(0x10_0000, 4096), (0x20_0000, 8192)]);
    let mut calls = 0;
    for_each_resident_run(&mem, |_, _| {
        calls += 1;
        false
    });
    assert_eq!(calls, 1, "the walk stops when told");

    if Kvm::new().is_err() {
        eprintln!("no /dev/kvm; the pre-fault itself skipped");
        return;
    }
    let base = VmBase::new(&config, mem).expect("VM base");
    let mapped = base.prefault_resident();
    match base.has_prefaulter() {
        true => assert_eq!(mapped, 3 * 4096),
        false => assert_eq!(mapped, 0),
    }
}
