//! Whole-VM snapshot and restore against real KVM without a guest kernel:
//! a VM built by the boot's own construction path runs a small 64-bit
//! program (it sets two UART registers, then increments a counter in RAM
//! and writes its low byte to COM1, for ever); it is paused, snapshotted,
//! dropped, restored from the directory and resumed. Skipped where
//! /dev/kvm cannot be opened.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use vm_memory::{Bytes, GuestAddress, GuestMemoryRegion};

use super::*;
use crate::config::json::vm_config_from_json;
use crate::memory::snapshot::MemorySnapshotError;

/// Where the program runs (the boot page tables map the first GiB 1:1).
pub(crate) const PROGRAM_AT: u64 = 0x20_0000;
/// The program's counter.
pub(crate) const COUNTER_AT: u64 = 0x30_0000;
const SCRATCH_VALUE: u8 = 0x5a;
const LINE_CONTROL_VALUE: u8 = 0x1b;

/// What the program sets the master PIC's interrupt mask to.
const PIC_MASK_VALUE: u8 = 0xa5;

/// 64-bit code: the master PIC's mask := 0xa5 (the in-kernel irqchip
/// holds it), the UART's scratch register := 0x5a and line control :=
/// 0x1b, then `loop: inc qword [0x300000]; out 0x3f8, low byte; jmp loop`.
const PROGRAM: &[u8] = &[
    0xb0,
    PIC_MASK_VALUE, // mov al, 0xa5
    0xe6,
    0x21, // out 0x21, al (master PIC's mask)
    0x66,
    0xba,
    0xff,
    0x03, // mov dx, 0x3ff (scratch)
    0xb0,
    SCRATCH_VALUE, // mov al, 0x5a
    0xee,          // out dx, al
    0x66,
    0xba,
    0xfb,
    0x03, // mov dx, 0x3fb (line control)
    0xb0,
    LINE_CONTROL_VALUE, // mov al, 0x1b
    0xee,               // out dx, al
    0xbb,
    0x00,
    0x00,
    0x30,
    0x00, // mov ebx, 0x300000
    // loop:
    0x48,
    0xff,
    0x03, // inc qword [rbx]
    0x8a,
    0x03, // mov al, [rbx]
    0x66,
    0xba,
    0xf8,
    0x03, // mov dx, 0x3f8 (data)
    0xee, // out dx, al
    0xeb,
    0xf4, // jmp loop (-12)
];

/// Longest a test waits for the guest to get somewhere (a bound, not a
/// speed figure: the program needs microseconds).
const PATIENCE: Duration = Duration::from_secs(20);

pub(crate) fn have_kvm() -> bool {
    let ok = kvm_ioctls::Kvm::new().is_ok();
    if !ok {
        eprintln!("no /dev/kvm; skipped");
    }
    ok
}

pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("snapshot-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A config with no virtio device (`--rng off`), two possible vCPUs, the
/// smallest RAM.
pub(crate) fn config() -> VmConfig {
    let mut config = vm_config_from_json(&json!({
        "payload": {"kernel": "/nonexistent/bzImage"},
        "serial": {"mode": "Null"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 2},
        "memory": {"size": crate::config::MIN_MEMORY},
    }))
    .expect("config");
    config.rng = None;
    config
}

/// The VM booted on [`PROGRAM`] through `Vm::boot`'s own path.
pub(crate) fn boot_program(config: &VmConfig) -> Vm {
    Vm::boot_with(config, None, |platform| {
        platform
            .mem
            .write_slice(PROGRAM, GuestAddress(PROGRAM_AT))
            .map_err(VmError::ResetStub)?;
        Ok(PROGRAM_AT)
    })
    .expect("VM")
}

pub(crate) fn counter(vm: &Vm) -> u64 {
    vm.mem
        .read_obj(GuestAddress(COUNTER_AT))
        .expect("counter in RAM")
}

/// Waits until the counter passes `above`; its value then.
pub(crate) fn counter_passes(vm: &Vm, above: u64) -> u64 {
    let start = Instant::now();
    loop {
        let c = counter(vm);
        if c > above {
            return c;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the counter stays at {c}, not above {above}"
        );
        std::thread::yield_now();
    }
}

/// vCPU 0's general and system registers, read by its parked thread.
fn vcpu0_registers(vm: &Vm) -> serde_json::Value {
    let states = vm
        .vcpus
        .save_state(vm.caps.as_ref().expect("caps"))
        .expect("vCPU states");
    let (_, state) = states.iter().find(|(i, _)| *i == 0).expect("vCPU 0");
    json!([state.regs, state.sregs])
}

fn serial_state(vm: &Vm) -> vm_superio::serial::SerialState {
    vm.serial
        .as_ref()
        .expect("a serial port")
        .lock()
        .unwrap()
        .state()
}

/// A running VM paused, snapshotted and dropped; restored from the
/// directory it comes back paused with the counter where it was (not 0:
/// RAM was restored) and the UART's registers, and once resumed the
/// program goes on counting from there.
#[test]
fn a_restored_vm_runs_on_from_where_it_was_saved() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("roundtrip");
    let config = config();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 1000);
    vm.check_snapshottable().expect("no virtio device");
    vm.pause();
    let saved = counter(&vm);
    let serial = serial_state(&vm);
    assert_eq!(serial.scratch, SCRATCH_VALUE, "the program ran its set-up");
    let saved_pic = {
        let state = VmState::capture(&vm.vm, None).expect("VM state");
        // SAFETY: the master PIC's chip id selects the `pic` member.
        assert_eq!(unsafe { state.pic_master.chip.pic }.imr, PIC_MASK_VALUE);
        serde_json::to_value(state.pic_master).unwrap()
    };
    assert_eq!(serial.line_control, LINE_CONTROL_VALUE);
    let registers = vcpu0_registers(&vm);
    vm.snapshot(&config, &dir.0).expect("snapshot");
    assert_eq!(counter(&vm), saved, "paused: nothing ran meanwhile");
    drop(vm);

    for name in [CONFIG_FILE, STATE_FILE, MEMORY_FILE] {
        let mode = std::fs::metadata(dir.0.join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }
    let (restored_config, mut vm) =
        Vm::restore(&dir.0, false, RestoreTaps::default(), None).expect("restore");
    assert_eq!(restored_config, config, "config.json gives the same VM");
    assert!(vm.vcpus.paused(), "restored paused");
    let saved_clock = vm.paused_clock.expect("the saved clock, for resume").clock;
    // A pause of the restored VM keeps the saved clock: the guest's time
    // stood still since the snapshot, not since the restore.
    std::thread::sleep(Duration::from_millis(20));
    vm.pause();
    assert_eq!(vm.paused_clock.map(|c| c.clock), Some(saved_clock));
    assert_eq!(counter(&vm), saved, "RAM as saved");
    assert_eq!(vcpu0_registers(&vm), registers, "vCPU 0 as saved");
    let restored = serial_state(&vm);
    assert_eq!(restored, serial, "the UART as saved");
    let pic = |vm: &Vm| {
        let state = VmState::capture(&vm.vm, None).expect("VM state");
        serde_json::to_value(state.pic_master).unwrap()
    };
    assert_eq!(pic(&vm), saved_pic, "the irqchip as saved");
    vm.resume();
    let after = counter_passes(&vm, saved);
    assert!(after > saved);
    vm.stop();
}

/// A restore with prefault fills the same RAM.
#[test]
fn a_prefaulted_restore_has_the_same_ram() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("prefault");
    let config = config();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    vm.pause();
    let saved = counter(&vm);
    vm.snapshot(&config, &dir.0).expect("snapshot");
    drop(vm);
    let (_, vm) = Vm::restore(&dir.0, true, RestoreTaps::default(), None).expect("restore");
    assert_eq!(counter(&vm), saved);
}

#[test]
fn a_running_vm_is_not_snapshotted() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("running");
    let config = config();
    let mut vm = boot_program(&config);
    let e = vm.snapshot(&config, &dir.0).expect_err("running");
    assert!(matches!(e, SnapshotError::NotPaused), "{e}");
    assert!(e.to_string().contains("pause"), "{e}");
    assert!(
        std::fs::read_dir(&dir.0).unwrap().next().is_none(),
        "nothing written"
    );
}

#[test]
fn a_missing_directory_or_a_file_is_refused_by_name() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("notadir");
    let config = config();
    let mut vm = boot_program(&config);
    vm.pause();
    let missing = dir.0.join("missing");
    let e = vm.snapshot(&config, &missing).expect_err("missing");
    assert!(matches!(e, SnapshotError::Directory { .. }), "{e}");
    assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}");
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = vm.snapshot(&config, &file).expect_err("a file");
    assert!(matches!(e, SnapshotError::NotADirectory { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        format!("{}: not a directory", file.display())
    );
    for dir in [&missing, &file] {
        let e = Vm::restore(dir, false, RestoreTaps::default(), None)
            .err()
            .expect("refused");
        assert!(e.to_string().contains(&*dir.to_string_lossy()), "{e}");
    }
}

/// Saves a VM that ran a while into `dir`.
fn saved_vm(dir: &Path) {
    let config = config();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    vm.pause();
    vm.snapshot(&config, dir).expect("snapshot");
}

#[test]
fn an_unknown_section_version_is_refused_by_the_sections_name() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("version");
    saved_vm(&dir.0);
    let path = dir.0.join(STATE_FILE);
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    doc["sections"][LEGACY_SECTION]["version"] = json!(99);
    std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = Vm::restore(&dir.0, false, RestoreTaps::default(), None)
        .err()
        .expect("refused");
    assert!(
        matches!(
            &e,
            SnapshotError::State {
                source: StateError::UnknownVersion { section, found: 99, .. },
                ..
            } if section == LEGACY_SECTION
        ),
        "{e}"
    );
    assert!(
        e.to_string().starts_with("state.json: legacy: version 99"),
        "{e}"
    );
}

/// A `memory-ranges` cut short is refused before anything is built (the
/// error comes from the check that precedes the VM's construction: no
/// vCPU has a thread, no device exists).
#[test]
fn a_truncated_memory_file_is_refused_before_anything_is_built() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("truncated");
    saved_vm(&dir.0);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.0.join(MEMORY_FILE))
        .unwrap();
    let len = file.metadata().unwrap().len();
    file.set_len(len - 4096).unwrap();
    let e = Vm::restore(&dir.0, false, RestoreTaps::default(), None)
        .err()
        .expect("refused");
    assert!(
        matches!(
            e,
            SnapshotError::Memory(MemorySnapshotError::ShortFile { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().starts_with("memory-ranges: "), "{e}");
}

/// A pmem file of `size` bytes in `dir`.
fn pmem_file(dir: &Path, size: u64) -> PathBuf {
    let path = dir.join("pmem.img");
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    path
}

/// A VM with a device that cannot be carried (pmem with discard_writes:
/// the guest's writes live in this process only) is refused before it is
/// paused, naming the device, and nothing is paused.
#[test]
fn a_vm_with_a_device_that_cannot_be_saved_is_refused_by_its_name() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("discard");
    let mut config = config();
    let file = pmem_file(&dir.0, 2 << 20);
    config.pmem = vec![crate::config::PmemConfig::parse(
        &format!("file={},discard_writes=on,id=pmem0", file.display()),
        0,
    )
    .expect("pmem config")];
    let vm = boot_program(&config);
    let e = vm.check_snapshottable().expect_err("discard_writes");
    assert!(
        e.to_string()
            .starts_with("snapshot: device pmem0: cannot be moved"),
        "{e}"
    );
    assert!(e.to_string().contains("discard_writes"), "{e}");
    assert!(!vm.vcpus.paused());
}

/// [`config`] with rng and vsock on PCI and pmem on MMIO, their files in
/// `dir`.
fn config_with_devices(dir: &Path) -> VmConfig {
    let mut config = config();
    config.rng = Some(crate::config::RngConfig::default());
    let socket = dir.join("vsock.sock");
    config.vsock = Some(
        crate::config::VsockConfig::parse(&format!("cid=3,socket={},id=vsock0", socket.display()))
            .expect("vsock config"),
    );
    let file = pmem_file(dir, 2 << 20);
    config.pmem = vec![crate::config::PmemConfig::parse(
        &format!("file={},id=pmem0,transport=mmio", file.display()),
        0,
    )
    .expect("pmem config")];
    config
}

/// The rng device's PCI interrupt line register, through the config ports
/// as the guest reaches it; written when `value` is given.
fn rng_interrupt_line(vm: &Vm, value: Option<u8>) -> u8 {
    let (_, at) = vm
        .pci_addresses()
        .into_iter()
        .find(|(id, _)| id == RNG_ID)
        .expect("the rng device on PCI");
    assert_eq!(at.segment, 0);
    let address = 0x8000_0000u32 | (u32::from(at.slot) << 11) | 0x3c;
    let pio = &vm.buses.0;
    pio.write(0xcf8, &address.to_le_bytes());
    if let Some(v) = value {
        pio.write(0xcfc, &[v]);
    }
    let mut b = [0u8];
    pio.read(0xcfc, &mut b);
    b[0]
}

/// A VM with virtio devices on both transports (rng on PCI, vsock on
/// PCI, pmem on MMIO) goes through a snapshot and a restore: the device
/// manager's section is written, taken and restored onto the devices the
/// configuration builds, in the restore's order, and the guest runs on.
#[test]
fn a_vm_with_virtio_devices_is_snapshotted_and_restored() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("devices");
    let config = config_with_devices(&dir.0);
    let socket = dir.0.join("vsock.sock");
    let snap = dir.0.join("snapshot");
    std::fs::create_dir(&snap).unwrap();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    // What the guest's PCI code would have set: the restore must give it back.
    assert_eq!(rng_interrupt_line(&vm, Some(0x2a)), 0x2a);
    vm.check_snapshottable().expect("movable devices");
    vm.pause();
    vm.snapshot(&config, &snap).expect("snapshot");
    let saved = counter(&vm);
    drop(vm);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join(STATE_FILE)).unwrap()).unwrap();
    let mut ids: Vec<&str> = state["sections"][DEVICES_SECTION]["state"]["devices"]
        .as_array()
        .expect("the devices section")
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["_rng", "pmem0", "vsock0"]);
    // The socket path is free again for the restored vsock device.
    let _ = std::fs::remove_file(&socket);
    let (restored_config, mut vm) =
        Vm::restore(&snap, false, RestoreTaps::default(), None).expect("restore");
    assert_eq!(restored_config, config);
    assert_eq!(counter(&vm), saved);
    assert_eq!(rng_interrupt_line(&vm, None), 0x2a, "the device's state");
    vm.resume();
    counter_passes(&vm, saved);
    vm.stop();
}

/// RAM added by `vm.resize` comes back at its address with its bytes, the
/// memory hot-plug registers as saved; a vCPU added and then ejected by
/// the guest comes back too (KVM cannot destroy it), parked, with the CPU
/// hot-plug registers as saved.
#[test]
fn hotplugged_ram_and_an_ejected_vcpu_come_back() {
    use crate::vcpu::hotplug_controller::CPU_HOTPLUG_PORT;
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("hotplug");
    let mut config = config();
    config.memory.hotplug_size = Some(crate::config::HOTPLUG_BLOCK);
    let mut vm = boot_program(&config);
    let grown = config.memory.size + crate::config::HOTPLUG_BLOCK;
    assert_eq!(vm.resize_memory(grown).expect("RAM added"), grown);
    let added_at = vm.hotplugged_ram[0].start_addr().0;
    let pattern = 0x1234_5678_9abc_def0u64;
    let all = join_regions(vm.mem.clone(), &vm.hotplugged_ram).unwrap();
    all.write_obj(pattern, GuestAddress(added_at + 0x1000))
        .unwrap();
    assert!(vm.resize_vcpus(2).expect("vCPU 1 added"));
    assert!(vm.resize_vcpus(1).expect("vCPU 1 to go"));
    // The guest's _EJ0 for vCPU 1: select it, write the eject bit.
    let pio = vm.buses.0.clone();
    pio.write(u64::from(CPU_HOTPLUG_PORT), &1u32.to_le_bytes());
    pio.write(u64::from(CPU_HOTPLUG_PORT) + 4, &[1 << 3]);
    assert_eq!(vm.complete_vcpu_ejects(), vec![1]);
    vm.pause();
    let (ram_saved, cpus_saved) = (vm.ram.save(), vm.vcpu_hotplug.save_registers());
    assert_eq!(vm.vcpus.threads(), vec![(0, false), (1, true)]);
    vm.snapshot(&config, &dir.0).expect("snapshot");
    drop(vm);

    let (_, mut vm) = Vm::restore(&dir.0, false, RestoreTaps::default(), None).expect("restore");
    assert_eq!(vm.vcpus.threads(), vec![(0, false), (1, true)]);
    assert_eq!(vm.ram.save(), ram_saved);
    assert_eq!(vm.ram.current(), grown);
    assert_eq!(vm.vcpu_hotplug.save_registers(), cpus_saved);
    assert_eq!(vm.hotplugged_ram.len(), 1);
    assert_eq!(vm.hotplugged_ram[0].start_addr().0, added_at);
    let all = join_regions(vm.mem.clone(), &vm.hotplugged_ram).unwrap();
    assert_eq!(
        all.read_obj::<u64>(GuestAddress(added_at + 0x1000))
            .unwrap(),
        pattern
    );
    vm.resume();
    let before = counter(&vm);
    counter_passes(&vm, before);
    assert!(vm.vcpus.threads().contains(&(1, true)), "still parked");
}

/// The VM a snapshot was taken of runs on when resumed; a second snapshot
/// into the same directory replaces the first.
#[test]
fn the_snapshotted_vm_resumes_and_a_second_snapshot_replaces_the_first() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("twice");
    let config = config();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 10);
    vm.pause();
    vm.snapshot(&config, &dir.0).expect("first snapshot");
    let first = counter(&vm);
    vm.resume();
    counter_passes(&vm, first + 1000);
    vm.pause();
    let second = counter(&vm);
    vm.snapshot(&config, &dir.0).expect("second snapshot");
    drop(vm);
    let (_, vm) = Vm::restore(&dir.0, false, RestoreTaps::default(), None).expect("restore");
    assert_eq!(counter(&vm), second);
}

/// A snapshot that fails part-way leaves no state.json behind (an
/// earlier snapshot's would pair its state with this one's memory).
#[test]
fn a_failed_snapshot_leaves_no_earlier_state_behind() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("failed");
    let config = config();
    let mut vm = boot_program(&config);
    vm.pause();
    vm.snapshot(&config, &dir.0).expect("first snapshot");
    // memory-ranges cannot be created: a directory is in its place.
    std::fs::remove_file(dir.0.join(MEMORY_FILE)).unwrap();
    std::fs::create_dir(dir.0.join(MEMORY_FILE)).unwrap();
    let e = vm
        .snapshot(&config, &dir.0)
        .expect_err("memory-ranges is a directory");
    assert!(e.to_string().contains(MEMORY_FILE), "{e}");
    assert!(!dir.0.join(STATE_FILE).exists());
    let e = Vm::restore(&dir.0, false, RestoreTaps::default(), None)
        .err()
        .expect("no state");
    assert!(e.to_string().contains(STATE_FILE), "{e}");
}

/// A snapshot and a restore run on the VMM's main thread: both pass its
/// seccomp filter (kill mode), files, KVM, devices (rng, vsock, pmem) and
/// threads included. A refused
/// call would end this test process with SIGSYS.
#[test]
fn snapshot_and_restore_pass_the_main_threads_seccomp_filter() {
    use crate::seccomp_filters::{all_for, VMM};
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("seccomp");
    let program = all_for(std::process::id())
        .into_iter()
        .find(|(k, _)| *k == VMM)
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .expect("the main thread's filter");
    let config = config_with_devices(&dir.0);
    let path = dir.0.join("snapshot");
    std::fs::create_dir(&path).unwrap();
    let socket = dir.0.join("vsock.sock");
    let saved = std::thread::spawn(move || {
        seccomp::apply_filter(&program).unwrap();
        let mut vm = boot_program(&config);
        counter_passes(&vm, 10);
        vm.pause();
        vm.snapshot(&config, &path).expect("snapshot");
        let saved = counter(&vm);
        // A second snapshot finds the files there: emptied, not truncated on open.
        vm.snapshot(&config, &path).expect("snapshot again");
        drop(vm);
        let _ = std::fs::remove_file(&socket);
        let (_, mut vm) = Vm::restore(&path, true, RestoreTaps::default(), None).expect("restore");
        assert_eq!(counter(&vm), saved);
        vm.resume();
        counter_passes(&vm, saved);
        vm.stop();
        saved
    })
    .join()
    .expect("the filtered thread");
    assert!(saved > 10);
}

/// A FIFO in place of `memory-ranges` is refused by name, not waited on;
/// a hot-plug section that does not fit the configuration is refused
/// before anything is built.
#[test]
fn a_fifo_or_a_hotplug_section_that_does_not_fit_is_refused_by_name() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("fifo");
    saved_vm(&dir.0);
    let path = dir.0.join(STATE_FILE);
    let original = std::fs::read(&path).unwrap();
    let mut doc: serde_json::Value = serde_json::from_slice(&original).unwrap();
    doc["sections"][MEMORY_HOTPLUG_SECTION]["state"]["added"] = json!(128 << 20);
    std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    let e = Vm::restore(&dir.0, false, RestoreTaps::default(), None)
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .starts_with("state.json: memory-hotplug: added: 134217728 bytes, above"),
        "{e}"
    );
    std::fs::write(&path, &original).unwrap();

    let ranges = dir.0.join(MEMORY_FILE);
    std::fs::remove_file(&ranges).unwrap();
    let c = std::ffi::CString::new(ranges.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo touches nothing else.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = Vm::restore(&dir.0, false, RestoreTaps::default(), None)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not a regular file"), "{e}");
    assert!(e.to_string().contains(MEMORY_FILE), "{e}");
}

/// The configuration handed to a snapshot must describe the VM (a restore
/// builds from it): a device it lacks or adds is refused by id there.
#[test]
fn a_configuration_that_does_not_describe_the_vm_is_refused_by_device() {
    if !have_kvm() {
        return;
    }
    let dir = Scratch::new("mismatch");
    let config = config();
    let mut vm = boot_program(&config);
    vm.pause();
    let with_devices = config_with_devices(&dir.0);
    let e = vm
        .snapshot(&with_devices, &dir.0)
        .expect_err("extra devices");
    assert!(
        e.to_string()
            .ends_with("device _rng is in the configuration but not in the VM"),
        "{e}"
    );
    drop(vm);
    let mut vm = boot_program(&with_devices);
    vm.pause();
    let _ = std::fs::remove_file(dir.0.join("vsock.sock"));
    let e = vm.snapshot(&config, &dir.0).expect_err("missing devices");
    assert!(
        e.to_string()
            .ends_with("device _rng is in the VM but not in the configuration"),
        "{e}"
    );
}
