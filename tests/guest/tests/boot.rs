//! Guest tests for the VMM core: boot with 1 and 2 vCPUs, check what the
//! guest sees against what was asked, and the VMM's exit status on power-off
//! and on a guest panic. Each boot checks several things.
//!
//! Run with `cargo test -p guest-tests -- --ignored boot:: --test-threads=1`
//! (scripts/test.sh does).

use std::time::Duration;

use test_infra::results::Results;
use test_infra::rig::{self, Guest, Run};

const MEMORY_MIB: u64 = 512;

/// Reports what the guest found: CPUs, command line, memory, ACPI tables.
const REPORT_SCRIPT: &str = r#"
echo "@@GUEST nproc=$(nproc)"
echo "@@GUEST cmdline=$(cat /proc/cmdline)"
echo "@@GUEST memtotal_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)"
echo "@@GUEST online=$(cat /sys/devices/system/cpu/online)"
echo "@@GUEST acpi_tables=$(ls /sys/firmware/acpi/tables 2>/dev/null | tr '\n' ',')"
echo "@@GUEST serial=$(cat /sys/class/tty/ttyS0/type 2>/dev/null)"
"#;

/// A guest with `cpus` vCPUs that reports what it found, then runs `then`.
fn report_then(name: &str, cpus: u8, then: &str) -> Guest {
    let mut guest = Guest::new(name, &format!("{REPORT_SCRIPT}{then}"));
    guest.cpus = cpus;
    guest.memory = format!("{MEMORY_MIB}M");
    guest.cmdline = format!("rig_token={}", std::process::id());
    guest
}

/// What the guest of [`report_then`] must have found: its vCPUs, its
/// command line, its memory, the ACPI tables and the serial port.
fn check_report(guest: &Guest, run: &Run) {
    let tail = run.tail(60);
    assert!(!run.timed_out, "timed out\n{tail}");
    let cpus = guest.cpus;
    assert_eq!(
        run.guest("nproc"),
        Some(cpus.to_string().as_str()),
        "{tail}"
    );
    let online = if cpus == 1 {
        "0".to_string()
    } else {
        format!("0-{}", cpus - 1)
    };
    assert_eq!(run.guest("online"), Some(online.as_str()), "{tail}");
    assert_eq!(
        run.guest("cmdline"),
        Some(guest.cmdline().as_str()),
        "{tail}"
    );
    // MemTotal is RAM less what the kernel reserved for itself; a guest that
    // saw the wrong e820 map lands far outside this band.
    let mem: u64 = run
        .guest("memtotal_kib")
        .and_then(|v| v.parse().ok())
        .expect(&tail);
    let asked = MEMORY_MIB * 1024;
    assert!(
        mem <= asked && mem >= asked * 85 / 100,
        "MemTotal {mem} KiB for {asked} KiB\n{tail}"
    );
    let tables = run.guest("acpi_tables").unwrap_or_default();
    for t in ["APIC", "DSDT", "FACP"] {
        assert!(
            tables.split(',').any(|x| x == t),
            "ACPI table {t} missing from {tables}\n{tail}"
        );
    }
    assert_eq!(
        run.guest("serial"),
        Some("4"),
        "ttyS0 should be a 16550A (type 4)\n{tail}"
    );
}

/// Each boot checks what the guest found and then how it ends: 1 vCPU keeps
/// quiet (the rig's stall probe) and resets the Linux default way (one boot
/// for both), 2 vCPUs power off.
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn boot_one_and_two_vcpus() {
    // `reboot -f` ends the VMM with 0 and says why, whichever way the guest
    // resets: Linux's default (here: through the reset vector, where the
    // VMM's stub pulses the i8042 reset line) and the ACPI reset register
    // (`guest_panic_and_reset_end_the_vmm`).
    //
    // This run also checks the rig's stall probe on the emulated host: the
    // guest keeps quiet longer than the probe's silence, the rig records the
    // emulated CPU's state from QEMU's monitor and sends it an NMI, and the
    // run goes on to its end unharmed. (A pause, so the marker's line is out
    // before the kernel's.)
    let mut quiet = report_then(
        "boot-1cpu",
        1,
        "sleep 30\necho '@@GUEST rebooting=1'\nsleep 1\nreboot -f\n",
    );
    quiet.stall_silence = Duration::from_secs(12);
    let one = rig::run(&quiet).expect("rig run");
    check_report(&quiet, &one);
    let mut probe_results = Results::new("stall-probe");
    check_reset(&one, Some(&mut probe_results));
    probe_results.save().expect("write results");

    // Two vCPUs, and the script's end: the rig's init powers the guest off.
    let two_vcpus = report_then("boot-2cpu", 2, "");
    let two = rig::run(&two_vcpus).expect("rig run");
    check_report(&two_vcpus, &two);
    let tail = two.tail(60);
    assert_eq!(two.guest("script_exit"), Some("0"), "{tail}");
    assert_eq!(
        two.vmm_exit,
        Some(0),
        "poweroff -f must end the VMM with 0\n{tail}"
    );
    assert_eq!(two.vmm_message(), Some("guest powered off"), "{tail}");

    let mut results = Results::new("boot");
    results.record_run("1 vCPU", &one);
    results.record_run("2 vCPUs", &two);
    let vmm = rig::vmm_binary().expect("vmm binary");
    let size = std::fs::metadata(&vmm).expect("vmm binary").len();
    results.record(
        &format!("dax-vmm binary (static, {} profile)", rig::build_profile()),
        format!("{size} bytes ({:.1} MiB)", size as f64 / 1048576.0),
    );
    results.save().expect("write results");
}

/// A run that ended in `reboot -f`: the marker, exit status 0 and a reset
/// named; where `probe` is given, the rig's stall probe on the quiet guest
/// (when the run was nested), recorded there.
fn check_reset(run: &Run, probe: Option<&mut Results>) {
    let tail = run.tail(60);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("rebooting"), Some("1"), "{tail}");
    if let Some(results) = probe.filter(|_| run.nested) {
        let text = run.text();
        assert!(text.contains("@@RIG stall_probe kick=key"), "{tail}");
        let cpu = text
            .lines()
            .find_map(|l| l.split_once("@@RIG stall_probe cpu ").map(|(_, c)| c))
            .unwrap_or_else(|| panic!("no CPU state in the probe\n{tail}"));
        assert!(cpu.contains("rip=0xffffffff"), "{cpu}");
        assert!(
            text.contains("@@RIG monitor info lapic: "),
            "no LAPIC state in the probe\n{tail}"
        );
        results.record("quiet emulated host's CPU, as probed", cpu.trim());
    }
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    assert!(
        run.vmm_message().is_some_and(|m| m.contains("reset")),
        "{tail}"
    );
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn guest_panic_and_reset_end_the_vmm() {
    // A kernel panic reaches the VMM through pvpanic: exit status 3, even though
    // panic=-1 makes the guest reboot right after.
    let mut panic = Guest::new(
        "panic",
        // The pause lets the marker's line reach the console before the
        // kernel's panic messages, which would otherwise land inside it.
        "echo '@@GUEST panicking=1'\nsleep 1\necho 1 > /proc/sys/kernel/sysrq\necho c > /proc/sysrq-trigger\n",
    );
    panic.guest_modules = vec!["pvpanic_mmio".into()];
    panic.timeout = Duration::from_secs(300);
    let run = rig::run(&panic).expect("rig run");
    let tail = run.tail(60);
    assert!(!run.timed_out, "{tail}");
    // The kernel's console output can still interleave with the marker's
    // line on a loaded host; what matters is that the guest got there.
    assert!(
        run.guest("panicking").is_some_and(|v| v.starts_with('1')),
        "{tail}"
    );
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.vmm_exit, Some(3), "{tail}");
    assert_eq!(
        run.vmm_message(),
        Some("guest kernel panicked (pvpanic)"),
        "{tail}"
    );

    // The ACPI reset register (`reboot=a`) ends the VMM as a reset, as
    // Linux's default way does (`boot_one_and_two_vcpus`).
    let mut reboot = Guest::new(
        "reboot-acpi",
        "echo '@@GUEST rebooting=1'\nsleep 1\nreboot -f\n",
    );
    reboot.cmdline = "reboot=a".into();
    reboot.stall_silence = Duration::from_secs(12);
    check_reset(&rig::run(&reboot).expect("rig run"), None);
}

/// `vm.power-button` through the API, as ch-remote sends it: the guest's
/// ACPI button driver reports KEY_POWER (through the GED's event), a
/// watcher in the guest powers off as systemd-logind would, and the VMM
/// exits as for any poweroff. The guest also sees the virtio-rng device
/// Cloud Hypervisor gives every VM and reads entropy from it.
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn the_power_button_shuts_a_guest_down_and_rng_gives_entropy() {
    let mut guest = Guest::new(
        "power-button",
        r#"
echo "@@GUEST hwrng=$(cat /sys/class/misc/hw_random/rng_current 2>&1)"
echo "@@GUEST hwrng_bytes=$(head -c 64 /dev/hwrng | wc -c)"
echo "@@GUEST button=$(daxprobe power-button 2>&1 | tr '\n' ' ')"
sleep 1
poweroff -f
"#,
    );
    guest.guest_modules = vec!["button".into(), "evdev".into(), "virtio_rng".into()];
    guest.guest_tools = vec![rig::tool("guest-tools", "daxprobe").expect("daxprobe")];
    guest.host_tools = vec![rig::tool("guest-tools", "daxprobe").expect("daxprobe")];
    guest.api_script = Some(
        r#"
api() { daxprobe http /tmp/api.sock "$@"; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912},"serial":{"mode":"Tty"}}'
echo "@@HOST early_press=$(api PUT /api/v1/vm.power-button)"
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
# Pressed until the guest goes: a press before its watcher is armed is
# lost, as on real hardware.
i=0; while kill -0 $VMM_PID 2>/dev/null && [ $i -lt 300 ]; do api PUT /api/v1/vm.power-button >/dev/null 2>&1; sleep 1; i=$((i+1)); done
echo "@@HOST presses=$i"
"#
        .into(),
    );
    guest.timeout = Duration::from_secs(600);
    let run = rig::run(&guest).expect("rig run");
    let tail = run.tail(60);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert!(
        run.host("early_press")
            .is_some_and(|p| p.starts_with("status=409")),
        "no VM yet: {tail}"
    );
    assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");
    assert!(
        run.guest("button")
            .is_some_and(|b| b.contains("armed") && b.ends_with("pressed ")),
        "{tail}"
    );
    assert_eq!(
        run.vmm_exit,
        Some(0),
        "a power-button shutdown ends the VMM like a poweroff\n{tail}"
    );
    assert_eq!(run.vmm_message(), Some("guest powered off"), "{tail}");
    assert!(
        run.guest("hwrng")
            .is_some_and(|r| r.starts_with("virtio_rng")),
        "{tail}"
    );
    assert_eq!(run.guest("hwrng_bytes"), Some("64"), "{tail}");
}
