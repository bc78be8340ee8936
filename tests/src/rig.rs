//! One guest run: build the images, start the VMM (directly or inside the
//! emulated host), collect timestamped serial lines, enforce the time limit.
//!
//! Markers the scripts print, one per line:
//! - `@@GUEST key=value` from the guest's test script,
//! - `@@HOST key=value` from the host-side script around the VMM,
//! - `@@RIG …` from the rig's own init and host script.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::cpio::CpioArchive;
use crate::host::{self, has_hardware_virtualization, static_busybox};
use crate::kernel::GuestKernel;
use crate::monitor::{self, Monitor};
use crate::RigError;

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
        let daxprobe = tool("guest-tests", "daxprobe")?;
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
    let mut stall_probe = None;
    let mut child = if nested {
        let image = emulated_host_initramfs(
            guest,
            &kernel,
            &busybox,
            &vmm,
            &guest_initramfs,
            &host_script,
        )?;
        let image_path = work.join("l1-initramfs.cpio");
        std::fs::write(&image_path, image).map_err(|e| RigError::io(&image_path, e))?;
        let monitor_path = monitor::socket_path(&guest.name);
        let _ = std::fs::remove_file(&monitor_path);
        let child = Command::new("qemu-system-x86_64")
            // One emulated CPU: with two (MTTCG) the emulated host's kernel was
            // seen to oops on an int3 left by cross-CPU code patching early in
            // its boot, and single-threaded TCG with two stalled a 2-vCPU
            // guest. The guest's vCPUs share it, as on an overcommitted host.
            .args([
                "-accel",
                "tcg",
                "-cpu",
                "max",
                "-smp",
                "1",
                "-m",
                EMULATED_HOST_MEMORY,
            ])
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
        stall_probe = Some(StallProbe {
            monitor: monitor_path,
            silence: guest.stall_silence,
        });
        child
    } else {
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
        std::fs::write(&initramfs, &guest_initramfs).map_err(|e| RigError::io(&initramfs, e))?;
        Command::new("sh")
            .arg("-c")
            .arg(&host_script)
            .env("VMM", &vmm)
            .env("KERNEL", &kernel.bzimage)
            .env("INITRAMFS", &initramfs)
            .env("WORK", &files)
            .current_dir(&files)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| RigError::Setup(format!("starting the host script: {e}")))?
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
    };
    run.vmm_exit = run
        .marker("@@RIG", "vmm_exit")
        .and_then(|(_, v)| v.trim().parse().ok());
    Ok(run)
}

/// How a nested run that has gone silent is looked into.
struct StallProbe {
    monitor: PathBuf,
    silence: Duration,
}

/// What the probe does to a silent emulated host, one stage per
/// [`STAGE_GAP`] of further silence: first a key press (an interrupt
/// through the emulated IOAPIC, which makes QEMU re-evaluate the CPU's
/// pending interrupts), then an NMI (which reaches a CPU whatever its
/// interrupt flag).
const KICKS: [(&str, &str); 2] = [("key", "sendkey shift"), ("nmi", "nmi")];
const STAGE_GAP: Duration = Duration::from_secs(30);

impl StallProbe {
    /// Records the emulated CPU's state, then kicks it with `KICKS[stage]`.
    fn probe(&self, stage: usize, silence: Duration) -> Vec<String> {
        let (kick, command) = KICKS[stage];
        let mut out = vec![format!(
            "@@RIG stall_probe silence={:.0}s stage={stage}",
            silence.as_secs_f64()
        )];
        match Monitor::connect(&self.monitor) {
            Ok(mut m) => {
                out.extend(monitor::dump(&mut m));
                match m.command(command) {
                    Ok(_) => out.push(format!("@@RIG stall_probe kick={kick}")),
                    Err(e) => out.push(format!("@@RIG stall_probe kick={kick} failed: {e}")),
                }
            }
            Err(e) => out.push(format!(
                "@@RIG stall_probe monitor {}: {e}",
                self.monitor.display()
            )),
        }
        out
    }
}

/// Reads stdout and stderr line by line with arrival times; kills the child
/// at the deadline. A nested run silent for its probe's time is probed, and
/// kicked harder at each further [`STAGE_GAP`] of silence.
fn collect_output(
    child: &mut Child,
    start: Instant,
    timeout: Duration,
    stall_probe: Option<&StallProbe>,
) -> (Vec<Line>, bool) {
    let (tx, rx) = mpsc::channel::<Line>();
    let readers: Vec<Box<dyn Read + Send>> = vec![
        Box::new(child.stdout.take().expect("stdout is piped")),
        Box::new(child.stderr.take().expect("stderr is piped")),
    ];
    for reader in readers {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(reader);
            let mut buf = Vec::new();
            while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\r', '\n'])
                    .replace('\r', "");
                let at = start.elapsed();
                let sent = split_markers(&text).into_iter().all(|text| {
                    tx.send(Line {
                        at,
                        text: text.to_string(),
                    })
                    .is_ok()
                });
                if !sent {
                    break;
                }
                buf.clear();
            }
        });
    }
    drop(tx);
    let deadline = start + timeout;
    let echo = std::env::var_os("DAX_VMM_RIG_ECHO").is_some();
    let mut lines = Vec::new();
    let mut timed_out = false;
    let mut last_line = Instant::now();
    // Probe stages done since the last line; which kick the output resumed after.
    let mut stages = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(probe) = stall_probe {
            let due = probe.silence + STAGE_GAP * stages as u32;
            if stages < KICKS.len() && last_line.elapsed() >= due {
                for text in probe.probe(stages, last_line.elapsed()) {
                    let line = Line {
                        at: start.elapsed(),
                        text,
                    };
                    eprintln!("[{:7.3}] {}", line.at.as_secs_f64(), line.text);
                    lines.push(line);
                }
                stages += 1;
            }
        }
        match rx.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(line) => {
                if echo {
                    eprintln!("[{:7.3}] {}", line.at.as_secs_f64(), line.text);
                }
                if stages > 0 {
                    let resumed =
                        format!("@@RIG stall_probe resumed_after={}", KICKS[stages - 1].0);
                    eprintln!("[{:7.3}] {resumed}", line.at.as_secs_f64());
                    lines.push(Line {
                        at: line.at,
                        text: resumed,
                    });
                    stages = 0;
                }
                last_line = Instant::now();
                lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                timed_out = true;
                let _ = child.kill();
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    let _ = child.wait();
    // Lines that arrived between the kill and the pipes closing.
    lines.extend(rx.try_iter());
    lines.sort_by_key(|l| l.at);
    (lines, timed_out)
}

/// The markers scripts print at the start of their lines.
const MARKERS: [&str; 4] = ["@@GUEST ", "@@HOST ", "@@RIG ", "@@DIAG "];

/// One console line as the lines its writers meant. The guest (through the
/// VMM) and the emulated host's scripts share one console, and a line of one
/// can land in the middle of another's, as in `@@GUEST gone=fs:gone@@HOST
/// daemon_after_remove=exited`; a marker never starts inside a line on
/// purpose, so the text is cut before each one.
fn split_markers(text: &str) -> Vec<&str> {
    let mut cuts: Vec<usize> = MARKERS
        .iter()
        .flat_map(|m| text.match_indices(m).map(|(i, _)| i))
        .filter(|&i| i > 0)
        .collect();
    cuts.sort_unstable();
    let mut parts = Vec::with_capacity(cuts.len() + 1);
    let mut from = 0;
    for cut in cuts {
        parts.push(&text[from..cut]);
        from = cut;
    }
    parts.push(&text[from..]);
    parts.retain(|p| !p.is_empty());
    if parts.is_empty() {
        parts.push("");
    }
    parts
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Passes the VMM's standard output (the guest's serial) on a line at a
/// time. The VMM writes the serial byte by byte, as the guest sends it, and
/// the host script's own marker lines share the console (or pipe) with it: a
/// marker written while a guest line was half out split that line in two
/// (`@` then `@GUEST rw_queues=2`), and the guest's value was lost. One
/// `write` per whole line keeps each writer's lines whole, since a `write`
/// to a tty or a short one to a pipe is not interleaved with another.
const WHOLE_LINES: &str = "rm -f \"$WORK/.serial\"; mkfifo \"$WORK/.serial\"\n\
     awk '{print; fflush()}' <\"$WORK/.serial\" &\nLINES_PID=$!\n";

fn host_script(guest: &Guest) -> String {
    let mut args = vec![
        "--kernel".to_string(),
        "$KERNEL".into(),
        "--initramfs".into(),
        "$INITRAMFS".into(),
        "--cmdline".into(),
        sh_quote(&guest.cmdline()),
        "--cpus".into(),
        format!("boot={}", guest.cpus),
        "--memory".into(),
        sh_quote(&format!("size={}", guest.memory)),
        "--serial".into(),
        "tty".into(),
    ];
    args.extend(guest.vmm_args.iter().map(|a| sh_quote(a)));
    if let Some(api) = &guest.api_script {
        let mut api_args = vec!["--api-socket".to_string(), "/tmp/api.sock".into()];
        api_args.extend(guest.vmm_args.iter().map(|a| sh_quote(a)));
        return format!(
            "cd \"$WORK\"\nexport PATH=\"$WORK/bin:$PATH\" RUST_LOG_STYLE=never CMDLINE={cmdline}\n{before}\n\
             {lines}echo '@@RIG vmm_start'\n\"$VMM\" {api_args} </dev/null >\"$WORK/.serial\" &\nVMM_PID=$!\n\
             i=0; while [ ! -S /tmp/api.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n\
             {api}\nwait $VMM_PID\necho \"@@RIG vmm_exit=$?\"\nwait $LINES_PID\n{after}\n",
            lines = WHOLE_LINES,
            cmdline = sh_quote(&guest.cmdline()),
            before = guest.host_before,
            api_args = api_args.join(" "),
            after = guest.host_after,
        );
    }
    format!(
        "cd \"$WORK\"\nexport PATH=\"$WORK/bin:$PATH\" RUST_LOG_STYLE=never\n{before}\n{lines}echo '@@RIG vmm_start'\n\"$VMM\" {args} </dev/null >\"$WORK/.serial\"\necho \"@@RIG vmm_exit=$?\"\nwait $LINES_PID\n{after}\n",
        before = guest.host_before,
        lines = WHOLE_LINES,
        args = args.join(" "),
        after = guest.host_after,
    )
}

/// The guest's initramfs: busybox, modules, an init that runs the script.
fn guest_initramfs(
    guest: &Guest,
    kernel: &GuestKernel,
    busybox: &[u8],
) -> Result<Vec<u8>, RigError> {
    let names: Vec<&str> = guest.guest_modules.iter().map(String::as_str).collect();
    let modules = kernel.modules_with_deps(&names)?;
    let mut image = base_image(busybox);
    let load = add_modules(&mut image, &modules, |name| {
        format!(" || echo \"@@GUEST insmod_failed={name}\"")
    });
    for f in &guest.guest_files {
        image.file(&f.path, f.perm, &f.data);
    }
    for tool in &guest.guest_tools {
        image.file(
            &format!("bin/{}", tool_name(tool)?),
            0o755,
            &read_tool(tool)?,
        );
    }
    image.file("test.sh", 0o755, guest.script.as_bytes());
    let init = format!(
        "{INIT_PREAMBLE}\
         echo \"@@GUEST init uptime=$(cut -d' ' -f1 /proc/uptime)\"\n\
         {load}\
         sh /test.sh\n\
         echo \"@@GUEST script_exit=$?\"\n\
         sleep 0.5\n\
         poweroff -f\n"
    );
    // (The pause lets the last marker line out before the kernel's own
    // power-down message, which could otherwise land inside it.)
    image.file("init", 0o755, init.as_bytes());
    Ok(image.finish())
}

/// The emulated host's initramfs: busybox, KVM modules, the VMM, the guest's
/// kernel and initramfs, the host files and the host script.
fn emulated_host_initramfs(
    guest: &Guest,
    kernel: &GuestKernel,
    busybox: &[u8],
    vmm: &Path,
    guest_initramfs: &[u8],
    host_script: &str,
) -> Result<Vec<u8>, RigError> {
    let mut wanted = vec!["kvm_amd"];
    wanted.extend(guest.host_modules.iter().map(String::as_str));
    let kvm = kernel.modules_with_deps(&wanted)?;
    let mut image = base_image(busybox);
    let load = add_modules(&mut image, &kvm, |_| String::new());
    let vmm_bytes = std::fs::read(vmm).map_err(|e| RigError::io(vmm, e))?;
    image.file("bin/dax-vmm", 0o755, &vmm_bytes);
    for tool in &guest.host_tools {
        image.file(
            &format!("bin/{}", tool_name(tool)?),
            0o755,
            &read_tool(tool)?,
        );
    }
    let bzimage = std::fs::read(&kernel.bzimage).map_err(|e| RigError::io(&kernel.bzimage, e))?;
    image.file("guest/vmlinuz", 0o644, &bzimage);
    image.file("guest/initramfs.cpio", 0o644, guest_initramfs);
    image.dir("work");
    for f in &guest.host_files {
        image.file(&format!("work/{}", f.path), f.perm, &f.data);
    }
    image.file("rig/host.sh", 0o755, host_script.as_bytes());
    let init = format!(
        "{INIT_PREAMBLE}\
         mount -t tmpfs tmpfs /tmp\n\
         {load}\
         [ -c /dev/kvm ] || echo '@@RIG error=no /dev/kvm in the emulated host'\n\
         echo \"@@RIG l1_ready uptime=$(cut -d' ' -f1 /proc/uptime)\"\n\
         VMM=/bin/dax-vmm KERNEL=/guest/vmlinuz INITRAMFS=/guest/initramfs.cpio WORK=/work sh /rig/host.sh\n\
         poweroff -f\n"
    );
    image.file("init", 0o755, init.as_bytes());
    Ok(image.finish())
}

/// How both inits start: busybox applets on PATH, proc, sysfs and devtmpfs.
const INIT_PREAMBLE: &str = "#!/bin/busybox sh\n\
    /bin/busybox --install -s /bin\n\
    export PATH=/bin\n\
    mount -t proc proc /proc\n\
    mount -t sysfs sysfs /sys\n\
    mount -t devtmpfs devtmpfs /dev\n";

/// Puts decompressed modules in `/lib/modules` and returns the shell lines
/// that load them in order; `on_failure` appends to each `insmod` line.
fn add_modules(
    image: &mut CpioArchive,
    modules: &[(String, Vec<u8>)],
    on_failure: impl Fn(&str) -> String,
) -> String {
    let mut load = String::new();
    for (name, data) in modules {
        image.file(&format!("lib/modules/{name}.ko"), 0o644, data);
        load.push_str(&format!(
            "insmod /lib/modules/{name}.ko{}\n",
            on_failure(name)
        ));
    }
    load
}

fn base_image(busybox: &[u8]) -> CpioArchive {
    let mut image = CpioArchive::new();
    for dir in ["proc", "sys", "dev", "tmp", "etc", "mnt", "root"] {
        image.dir(dir);
    }
    image.char_device("dev/console", 0o600, 5, 1);
    image.file("bin/busybox", 0o755, busybox);
    image.symlink("bin/sh", "busybox");
    image
}

fn write_file(path: &Path, f: &ImageFile) -> Result<(), RigError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| RigError::io(parent, e))?;
    }
    std::fs::write(path, &f.data).map_err(|e| RigError::io(path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(f.perm))
        .map_err(|e| RigError::io(path, e))
}

/// The workspace's `target/` directory.
pub fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target")
}

/// `target/rig/runs/<name>`, emptied first.
fn scratch_dir(name: &str) -> Result<PathBuf, RigError> {
    let dir = target_dir().join("rig/runs").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| RigError::io(&dir, e))?;
    Ok(dir)
}

/// A static release build of a workspace binary, built once per process so
/// it runs in an initramfs without libraries.
pub fn static_binary(package: &str, bin: &str) -> Result<PathBuf, RigError> {
    let target = "x86_64-unknown-linux-gnu";
    let target_dir = target_dir().join("rig/build");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            package,
            "--bin",
            bin,
            "--target",
            target,
        ])
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .status()
        .map_err(|e| RigError::Setup(format!("cargo build {bin}: {e}")))?;
    if !status.success() {
        return Err(RigError::Setup(format!(
            "cargo build of {bin} failed ({status})"
        )));
    }
    let path = target_dir.join(target).join("release").join(bin);
    if !host::is_static_elf(&path)? {
        return Err(RigError::Setup(format!(
            "{} is not statically linked",
            path.display()
        )));
    }
    Ok(path)
}

fn tool_name(path: &Path) -> Result<String, RigError> {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| RigError::Setup(format!("{} has no file name", path.display())))
}

fn read_tool(path: &Path) -> Result<Vec<u8>, RigError> {
    std::fs::read(path).map_err(|e| RigError::io(path, e))
}

/// A static binary of this workspace for a guest or host image (built once
/// per process and binary).
pub fn tool(package: &str, bin: &str) -> Result<PathBuf, RigError> {
    static BUILT: std::sync::Mutex<Vec<(String, Result<PathBuf, String>)>> =
        std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = built.iter().find(|(b, _)| b == bin) {
        return r.clone().map_err(RigError::Setup);
    }
    let r = static_binary(package, bin).map_err(|e| e.to_string());
    built.push((bin.to_string(), r.clone()));
    r.map_err(RigError::Setup)
}

/// The VMM binary the rig runs (built once per process).
pub fn vmm_binary() -> Result<PathBuf, RigError> {
    static VMM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    VMM.get_or_init(|| match std::env::var_os(VMM_BIN_ENV) {
        Some(p) => Ok(PathBuf::from(p)),
        None => static_binary("vmm", "dax-vmm").map_err(|e| e.to_string()),
    })
    .clone()
    .map_err(RigError::Setup)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    #[test]
    fn lines_of_two_writers_run_together_are_cut_at_each_marker() {
        assert_eq!(
            split_markers("@@GUEST gone=fs:gone blk:gone@@HOST daemon_after_remove=exited"),
            [
                "@@GUEST gone=fs:gone blk:gone",
                "@@HOST daemon_after_remove=exited"
            ]
        );
        assert_eq!(
            split_markers("[ 1.0] kernel text@@RIG vmm_exit=0"),
            ["[ 1.0] kernel text", "@@RIG vmm_exit=0"]
        );
        assert_eq!(split_markers("@@GUEST a=1"), ["@@GUEST a=1"]);
        assert_eq!(split_markers(""), [""]);
        assert_eq!(
            split_markers("a@@GUESTb"),
            ["a@@GUESTb"],
            "a marker needs its space"
        );
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

    #[test]
    fn host_script_quotes_arguments() {
        let mut g = Guest::new("q", "true");
        g.cmdline = "it's".into();
        g.vmm_args = vec!["--pmem".into(), "file=a b".into()];
        let s = host_script(&g);
        assert!(s.contains(r"'console=ttyS0 panic=-1 quiet it'\''s'"), "{s}");
        assert!(s.contains("'file=a b'"), "{s}");
        assert!(s.contains("</dev/null"));
    }

    #[test]
    fn a_marker_written_mid_line_does_not_split_the_guest_line() {
        // The guest's line goes out a byte at a time, as the VMM writes the
        // serial; the host's marker is written while it is half out.
        let work = std::env::temp_dir().join(format!("rig-lines-{}", std::process::id()));
        std::fs::create_dir_all(&work).unwrap();
        let script = format!(
            "{WHOLE_LINES}(for c in @ @ G U E S T ' ' k = 2; do printf '%s' \"$c\"; sleep 0.02; done; echo) >\"$WORK/.serial\" &\n\
             sleep 0.1; echo '@@HOST mid=1'\nwait $LINES_PID\n"
        );
        let out = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .env("WORK", &work)
            .output()
            .unwrap();
        std::fs::remove_dir_all(&work).unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"@@GUEST k=2"), "{text:?}");
        assert!(lines.contains(&"@@HOST mid=1"), "{text:?}");
        assert_eq!(lines.len(), 2, "{text:?}");
    }

    #[test]
    fn api_mode_starts_the_vmm_with_only_its_socket_and_runs_the_api_script() {
        let mut g = Guest::new("a", "true");
        g.vmm_args = vec!["-v".into()];
        g.api_script = Some("api PUT /api/v1/vm.boot".into());
        g.host_before = "BEFORE".into();
        g.host_after = "AFTER".into();
        let s = host_script(&g);
        assert!(
            s.contains("\"$VMM\" --api-socket /tmp/api.sock '-v' </dev/null >\"$WORK/.serial\" &"),
            "{s}"
        );
        assert!(
            !s.contains("--kernel"),
            "the VM is created by the API script: {s}"
        );
        // The kernel command line reaches the script, which puts it in vm.create.
        assert!(s.contains("CMDLINE='console=ttyS0"), "{s}");
        let order: Vec<usize> = [
            "BEFORE",
            "vmm_start",
            "-S /tmp/api.sock",
            "api PUT /api/v1/vm.boot",
            "wait $VMM_PID",
            "vmm_exit",
            "AFTER",
        ]
        .iter()
        .map(|needle| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing: {s}"))
        })
        .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "steps out of order: {s}"
        );
    }
}
