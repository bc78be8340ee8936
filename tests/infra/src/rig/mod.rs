//! One guest run: build the images, start the VMM (directly or inside the
//! emulated host), collect timestamped serial lines, enforce the time limit.
//!
//! Markers the scripts print, one per line:
//! - `@@GUEST key=value` from the guest's test script,
//! - `@@HOST key=value` from the host-side script around the VMM,
//! - `@@RIG …` from the rig's own init and host script.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::host::{has_hardware_virtualization, static_busybox};
use crate::kernel::GuestKernel;
use crate::monitor;
use crate::RigError;

mod binaries;
mod initramfs;
mod output;

pub use binaries::{
    build_profile, static_binary, static_binary_with, target_dir, tool, vmm_binary,
};
use binaries::{read_tool, scratch_dir, tool_name, write_file};
use initramfs::{emulated_host_initramfs, guest_initramfs, host_script};
use output::{collect_output, StallProbe};

/// Forces the emulated host even where the CPU has vmx/svm (`1`), or the
/// direct mode where it has not (`0`, which fails on a paravirtual-only KVM).
pub const NESTED_ENV: &str = "DAX_VMM_RIG_NESTED";
/// Use this VMM binary instead of building a static one.
pub const VMM_BIN_ENV: &str = "DAX_VMM_BIN";

/// The console and panic behaviour every guest gets; a test adds its own words.
const GUEST_BASE_CMDLINE: &str = "console=ttyS0 panic=-1 quiet";
const EMULATED_HOST_MEMORY: &str = "3072";
/// Output silence after which the rig asks the emulated host's QEMU monitor
/// what the CPU is doing and sends it an NMI. Longer than the two minutes
/// between the virtio-fs tests' `@@DIAG` lines, so a working run never
/// reaches it.
const STALL_SILENCE: Duration = Duration::from_secs(200);

/// A file placed in an image: path inside it, permissions, contents.
#[derive(Clone)]
pub struct ImageFile {
    pub path: String,
    pub perm: u32,
    pub data: Vec<u8>,
}

/// What to boot and what to run. Host-side scripts run in the VMM's host
/// (the emulated host, or a scratch directory on the real one) with `$VMM`,
/// `$KERNEL`, `$INITRAMFS` and `$WORK` set, working directory `$WORK`.
#[derive(Clone)]
pub struct Guest {
    /// Names the logs and results files.
    pub name: String,
    pub cpus: u8,
    pub memory: String,
    /// Words added to the guest kernel command line.
    pub cmdline: String,
    /// The guest's test script (busybox sh), run by its init.
    pub script: String,
    /// Guest kernel modules to load before the script, with their dependencies.
    pub guest_modules: Vec<String>,
    /// Modules the emulated host loads besides KVM's (e.g. `tun` for a
    /// net device's tap), with their dependencies.
    pub host_modules: Vec<String>,
    pub guest_files: Vec<ImageFile>,
    /// Files put in `$WORK` on the VMM's host.
    pub host_files: Vec<ImageFile>,
    pub host_before: String,
    pub host_after: String,
    /// Extra VMM arguments (after the kernel, cpus, memory and serial ones).
    pub vmm_args: Vec<String>,
    /// Binaries on the VMM host's PATH (e.g. the virtio-fs daemon).
    pub host_tools: Vec<PathBuf>,
    /// Binaries in the guest's /bin (e.g. `daxprobe`).
    pub guest_tools: Vec<PathBuf>,
    pub timeout: Duration,
    /// Nested runs: output silence after which the rig probes the emulated
    /// host through its QEMU monitor ([`STALL_SILENCE`] unless a test that
    /// checks the probe itself sets it shorter).
    pub stall_silence: Duration,
    /// API mode: the VMM starts with only `--api-socket /tmp/api.sock` (plus
    /// `vmm_args`) and this host script creates and boots the VM through
    /// the API while it runs; `$CMDLINE` holds the guest command line.
    pub api_script: Option<String>,
}

impl Guest {
    pub fn new(name: &str, script: &str) -> Self {
        Guest {
            name: name.into(),
            cpus: 1,
            memory: "512M".into(),
            cmdline: String::new(),
            script: script.into(),
            guest_modules: Vec::new(),
            host_modules: Vec::new(),
            guest_files: Vec::new(),
            host_files: Vec::new(),
            host_before: String::new(),
            host_after: String::new(),
            vmm_args: Vec::new(),
            host_tools: Vec::new(),
            guest_tools: Vec::new(),
            timeout: Duration::from_secs(300),
            stall_silence: STALL_SILENCE,
            api_script: None,
        }
    }

    /// A guest created and driven through the API (`api_script`), with
    /// shared RAM for a virtio-fs daemon, `dax-virtiofsd` and `daxprobe` on
    /// the VMM's host, `daxprobe` in the guest, and the VMM logging at info.
    pub fn through_api_with_daemon(
        name: &str,
        script: &str,
        host_before: &str,
        api_script: &str,
        host_after: &str,
    ) -> Result<Self, RigError> {
        let mut guest = Guest::new(name, script);
        guest.memory = "512M,shared=on".into();
        let daxprobe = tool("guest-tools", "daxprobe")?;
        guest.guest_tools = vec![daxprobe.clone()];
        guest.host_tools = vec![tool("daemon", "dax-virtiofsd")?, daxprobe];
        guest.host_before = host_before.into();
        guest.host_after = host_after.into();
        guest.vmm_args = vec!["-v".into()];
        guest.api_script = Some(api_script.into());
        guest.timeout = Duration::from_secs(600);
        Ok(guest)
    }

    pub fn cmdline(&self) -> String {
        format!("{GUEST_BASE_CMDLINE} {}", self.cmdline)
            .trim()
            .to_string()
    }
}

/// A line of serial (or VMM) output and when the host saw it.
#[derive(Clone, Debug)]
pub struct Line {
    pub at: Duration,
    pub text: String,
}

#[derive(Debug)]
pub struct Run {
    pub name: String,
    pub nested: bool,
    pub lines: Vec<Line>,
    /// The VMM's exit status, as its host script saw it.
    pub vmm_exit: Option<i32>,
    pub timed_out: bool,
    pub wall: Duration,
    pub log_path: PathBuf,
    /// The emulated host's CPUs ([`HOST_CPUS_ENV`]) as it was booted; None
    /// on a run without the emulated host or one read back from its log.
    pub host_cpus: Option<u8>,
}

impl Run {
    fn marker<'a>(&'a self, prefix: &str, key: &str) -> Option<(&'a Line, &'a str)> {
        self.lines.iter().find_map(|l| {
            // `key=value` (value to the end of the line) or a bare `key`,
            // optionally followed by other words (`init uptime=0.7`).
            let rest = l
                .text
                .split_once(prefix)?
                .1
                .strip_prefix(' ')?
                .strip_prefix(key)?;
            if let Some(value) = rest.strip_prefix('=') {
                Some((l, value))
            } else if rest.is_empty() || rest.starts_with(' ') {
                Some((l, rest.trim_start()))
            } else {
                None
            }
        })
    }

    /// Value of the first `@@GUEST key=value` line.
    pub fn guest(&self, key: &str) -> Option<&str> {
        self.marker("@@GUEST", key).map(|(_, v)| v)
    }

    /// All `@@GUEST key=value` pairs, first occurrence wins.
    pub fn guest_values(&self) -> HashMap<String, String> {
        let mut out = HashMap::new();
        for l in &self.lines {
            let Some((_, rest)) = l.text.split_once("@@GUEST ") else {
                continue;
            };
            let (k, v) = match rest.split_once(' ') {
                Some((word, tail)) if !word.contains('=') => (word, tail),
                _ => rest.split_once('=').unwrap_or((rest, "")),
            };
            {
                out.entry(k.to_string()).or_insert_with(|| v.to_string());
            }
        }
        out
    }

    pub fn host(&self, key: &str) -> Option<&str> {
        self.marker("@@HOST", key).map(|(_, v)| v)
    }

    /// When the rig's marker `key` was seen.
    pub fn rig_at(&self, key: &str) -> Option<Duration> {
        self.marker("@@RIG", key).map(|(l, _)| l.at)
    }

    pub fn guest_at(&self, key: &str) -> Option<Duration> {
        self.marker("@@GUEST", key).map(|(l, _)| l.at)
    }

    /// Emulated host start to its init (nested runs only).
    pub fn l1_boot(&self) -> Option<Duration> {
        self.rig_at("l1_ready")
    }

    /// VMM start to the guest's init running.
    pub fn guest_boot_to_init(&self) -> Option<Duration> {
        self.guest_at("init")?
            .checked_sub(self.rig_at("vmm_start")?)
    }

    /// The VMM's one-line reason for stopping (`dax-vmm: …`). The guest may
    /// have left its last serial line unterminated, so the message can start
    /// mid-line.
    pub fn vmm_message(&self) -> Option<&str> {
        self.lines
            .iter()
            .rev()
            .find_map(|l| l.text.rsplit_once("dax-vmm: ").map(|(_, m)| m))
    }

    pub fn text(&self) -> String {
        self.lines
            .iter()
            .map(|l| l.text.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The end of the output, for assertion messages.
    pub fn tail(&self, n: usize) -> String {
        let start = self.lines.len().saturating_sub(n);
        let lines: Vec<_> = self.lines[start..]
            .iter()
            .map(|l| format!("[{:7.3}] {}", l.at.as_secs_f64(), l.text))
            .collect();
        format!(
            "--- last {} lines of {} (full log: {}) ---\n{}",
            lines.len(),
            self.name,
            self.log_path.display(),
            lines.join("\n")
        )
    }
}

/// Like [`run`], but a run that stalled (hit its timeout) is booted once
/// more. The emulated host has been seen to stall a guest for good, rarely
/// and not reproducibly (docs/testing.md); a second stall fails the test as
/// before. The stalled run's log is kept, its tail printed, and its path
/// returned so results files record it: a retry is never silent.
pub fn run_retrying_stall(guest: &Guest) -> Result<(Run, Vec<PathBuf>), RigError> {
    let first = run(guest)?;
    if !first.timed_out {
        return Ok((first, Vec::new()));
    }
    // Beside the run's directory, which the second run empties.
    let kept = target_dir()
        .join("rig/runs")
        .join(format!("{}-stalled.log", guest.name));
    std::fs::rename(&first.log_path, &kept).map_err(|e| RigError::io(&kept, e))?;
    eprintln!(
        "RIG: {} stalled after {:.0} s; booting it once more\n{}",
        guest.name,
        first.wall.as_secs_f64(),
        first.tail(120)
    );
    Ok((run(guest)?, vec![kept]))
}

/// [`run`] for a benchmark, which has no use for a run that did not end:
/// a rig error, or a run that timed out (with the end of its log), is the
/// error.
pub fn run_to_end(guest: &Guest) -> Result<Run, String> {
    let run = run(guest).map_err(|e| e.to_string())?;
    if run.timed_out {
        return Err(format!("timed out\n{}", run.tail(80)));
    }
    Ok(run)
}

/// Boots `guest` and returns its output once the VMM's host has stopped.
pub fn run(guest: &Guest) -> Result<Run, RigError> {
    let nested = match std::env::var(NESTED_ENV).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => !has_hardware_virtualization(),
    };
    let kernel = GuestKernel::fetch()?;
    let busybox =
        std::fs::read(static_busybox()?).map_err(|e| RigError::io(Path::new("/bin/busybox"), e))?;
    let vmm = vmm_binary()?;
    let guest_initramfs = guest_initramfs(guest, &kernel, &busybox)?;
    let host_script = host_script(guest);
    let work = scratch_dir(&guest.name)?;
    let log_path = work.join("serial.log");

    let start = Instant::now();
    let (mut child, stall_probe, host_cpus) = if nested {
        let (child, probe, cpus) = start_emulated_host(
            guest,
            &kernel,
            &busybox,
            &vmm,
            &guest_initramfs,
            &host_script,
            &work,
        )?;
        (child, Some(probe), Some(cpus))
    } else {
        let child = start_direct(guest, &kernel, &vmm, &guest_initramfs, &host_script, &work)?;
        (child, None, None)
    };

    let (lines, timed_out) = collect_output(&mut child, start, guest.timeout, stall_probe.as_ref());
    if let Some(probe) = &stall_probe {
        let _ = std::fs::remove_file(&probe.monitor);
    }
    let wall = start.elapsed();
    let log: String = lines
        .iter()
        .map(|l| format!("[{:8.3}] {}\n", l.at.as_secs_f64(), l.text))
        .collect();
    std::fs::write(&log_path, log).map_err(|e| RigError::io(&log_path, e))?;
    let mut run = Run {
        name: guest.name.clone(),
        nested,
        lines,
        vmm_exit: None,
        timed_out,
        wall,
        log_path,
        host_cpus,
    };
    run.vmm_exit = run
        .marker("@@RIG", "vmm_exit")
        .and_then(|(_, v)| v.trim().parse().ok());
    Ok(run)
}

/// Names the emulated host's CPU count for a benchmark: 1 (the default) or 2.
pub const HOST_CPUS_ENV: &str = "DAX_VMM_RIG_HOST_CPUS";

/// The emulated host's CPUs, from [`HOST_CPUS_ENV`]. One by
/// default: with two (QEMU's multi-threaded TCG) the emulated host's kernel
/// was once seen to oops on an int3 left by cross-CPU code patching early
/// in its boot, and single-threaded TCG with two stalled a 2-vCPU guest.
/// The guest's vCPUs then share the one CPU, as on an overcommitted host.
/// Two, multi-threaded, let a benchmark show what changes where the VMM's
/// and the daemon's threads have a CPU besides the guest's (each takes one
/// of the machine's cores); the tests keep one.
fn emulated_host_cpus() -> Result<u8, RigError> {
    host_cpus(std::env::var(HOST_CPUS_ENV).ok().as_deref())
}

fn host_cpus(value: Option<&str>) -> Result<u8, RigError> {
    match value.map(str::trim) {
        None | Some("" | "1") => Ok(1),
        Some("2") => Ok(2),
        Some(v) => Err(RigError::Setup(format!(
            "{HOST_CPUS_ENV}={v}: the emulated host has 1 or 2 CPUs"
        ))),
    }
}

/// Starts QEMU (TCG) with the emulated host: its initramfs holds the VMM,
/// the guest's kernel and initramfs, the host files and the host script.
fn start_emulated_host(
    guest: &Guest,
    kernel: &GuestKernel,
    busybox: &[u8],
    vmm: &Path,
    guest_initramfs: &[u8],
    host_script: &str,
    work: &Path,
) -> Result<(Child, StallProbe, u8), RigError> {
    let cpus = emulated_host_cpus()?;
    let image = emulated_host_initramfs(guest, kernel, busybox, vmm, guest_initramfs, host_script)?;
    let image_path = work.join("l1-initramfs.cpio");
    std::fs::write(&image_path, image).map_err(|e| RigError::io(&image_path, e))?;
    let monitor_path = monitor::socket_path(&guest.name);
    let _ = std::fs::remove_file(&monitor_path);
    let child = Command::new("qemu-system-x86_64")
        .args(["-accel", if cpus == 1 { "tcg" } else { "tcg,thread=multi" }])
        .args(["-cpu", "max", "-smp", &cpus.to_string(), "-m", EMULATED_HOST_MEMORY])
        .args([
            "-nodefaults",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(&kernel.bzimage)
        .arg("-initrd")
        .arg(&image_path)
        .arg("-monitor")
        .arg(format!(
            "unix:{},server=on,wait=off",
            monitor_path.display()
        ))
        // nokaslr: a stalled CPU's address means the same in every run (Debian's
        // System.map is a stub; the -dbg package's names it).
        .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=3 nokaslr"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            RigError::Setup(format!(
                "starting qemu-system-x86_64 (apt-get install qemu-system-x86): {e}"
            ))
        })?;
    let probe = StallProbe {
        monitor: monitor_path,
        silence: guest.stall_silence,
    };
    Ok((child, probe, cpus))
}

/// Runs the host script on this machine, whose KVM boots the guest.
fn start_direct(
    guest: &Guest,
    kernel: &GuestKernel,
    vmm: &Path,
    guest_initramfs: &[u8],
    host_script: &str,
    work: &Path,
) -> Result<Child, RigError> {
    let files = work.join("host");
    std::fs::create_dir_all(&files).map_err(|e| RigError::io(&files, e))?;
    for f in &guest.host_files {
        write_file(&files.join(&f.path), f)?;
    }
    for tool in &guest.host_tools {
        write_file(
            &files.join("bin").join(tool_name(tool)?),
            &ImageFile {
                path: String::new(),
                perm: 0o755,
                data: read_tool(tool)?,
            },
        )?;
    }
    let initramfs = work.join("guest-initramfs.cpio");
    std::fs::write(&initramfs, guest_initramfs).map_err(|e| RigError::io(&initramfs, e))?;
    Command::new("sh")
        .arg("-c")
        .arg(host_script)
        .env("VMM", vmm)
        .env("KERNEL", &kernel.bzimage)
        .env("INITRAMFS", &initramfs)
        .env("WORK", &files)
        .current_dir(&files)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| RigError::Setup(format!("starting the host script: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_emulated_host_has_one_cpu_unless_two_are_asked_for() {
        assert_eq!(host_cpus(None).unwrap(), 1);
        assert_eq!(host_cpus(Some("1")).unwrap(), 1);
        assert_eq!(host_cpus(Some(" 2\n")).unwrap(), 2);
        for bad in ["0", "3", "two", "-1"] {
            let e = host_cpus(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(HOST_CPUS_ENV) && e.contains("1 or 2"), "{e}");
        }
    }

    fn run_with(lines: &[(u64, &str)]) -> Run {
        Run {
            name: "t".into(),
            nested: true,
            lines: lines
                .iter()
                .map(|(ms, t)| Line {
                    at: Duration::from_millis(*ms),
                    text: t.to_string(),
                })
                .collect(),
            vmm_exit: None,
            timed_out: false,
            wall: Duration::ZERO,
            log_path: PathBuf::new(),
            host_cpus: Some(1),
        }
    }

    #[test]
    fn markers_parse_and_time() {
        let r = run_with(&[
            (100, "@@RIG l1_ready uptime=1.2"),
            (200, "@@RIG vmm_start"),
            (900, "[  0.5] noise @@GUEST init uptime=0.7"),
            (950, "@@GUEST nproc=2"),
            (960, "@@GUEST cmdline=console=ttyS0 a=b"),
            (970, "@@GUEST nproc=3"),
            (990, "[ 2.8] Kernel Offdax-vmm: guest powered off"),
        ]);
        assert_eq!(r.l1_boot(), Some(Duration::from_millis(100)));
        assert_eq!(r.guest_boot_to_init(), Some(Duration::from_millis(700)));
        assert_eq!(r.guest("nproc"), Some("2"));
        assert_eq!(r.guest("cmdline"), Some("console=ttyS0 a=b"));
        assert_eq!(r.guest("missing"), None);
        assert_eq!(r.guest_values()["nproc"], "2");
        assert_eq!(r.guest("init"), Some("uptime=0.7"));
        assert_eq!(r.guest_values()["init"], "uptime=0.7");
        assert_eq!(r.guest("nproc2"), None);
        assert_eq!(r.vmm_message(), Some("guest powered off"));
    }
}
