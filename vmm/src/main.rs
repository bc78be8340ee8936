//! `dax-vmm`: command-line entry point, in Cloud Hypervisor's syntax.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};

use virtio_devices::dependency_log::SiteLimitedLogger;
use virtio_devices::log_limit::stderr;
use vmm::config::OptionValues;
use vmm::config::{
    parse_console, ConfigError, CpusConfig, DiskConfig, FsConfig, MemoryConfig, NetConfig,
    PayloadConfig, PlatformConfig, PmemConfig, RestoreConfig, RngConfig, SerialMode, VmConfig,
    VsockConfig,
};
use vmm::control_loop::{ControlLoop, LoopExit};
use vmm::signals::StopSignals;
use vmm::snapshot::RestoreTaps;

/// Exit status for a command line the VMM cannot run (as clap uses for usage errors).
const EXIT_USAGE: u8 = 2;
const EXIT_FAILURE: u8 = 1;

#[derive(Parser, Debug)]
#[command(
    name = "dax-vmm",
    version,
    about = "KVM virtual machine monitor with virtio-fs DAX"
)]
struct Cli {
    /// Linux bzImage to boot.
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initramfs (cpio, optionally compressed) handed to the kernel.
    #[arg(long, value_name = "PATH")]
    initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, value_name = "STRING", default_value = "")]
    cmdline: String,
    /// vCPUs: boot=<n>[,max=<n>][,topology=<threads>:<cores>:<dies>:<packages>]; those above boot are hot-pluggable (vm.resize).
    #[arg(long, value_name = "boot=N", default_value = "boot=1")]
    cpus: String,
    /// Guest RAM: size=<bytes|K|M|G>[,shared=on|off][,hugepages=on|off].
    #[arg(
        long,
        value_name = "size=SIZE,shared=on|off",
        default_value = "size=512M"
    )]
    memory: String,
    /// 16550 serial port on ttyS0: tty, off, null or file=<path>.
    #[arg(long, value_name = "tty|off|null|file=PATH", default_value = "tty")]
    serial: String,
    /// virtio-console: only "off" (use --serial for the console).
    #[arg(long, value_name = "off", default_value = "off")]
    console: String,
    /// virtio-pmem: file=<path>[,size=<size>][,discard_writes=on|off][,id=<id>][,transport=pci|mmio]
    #[arg(long, value_name = "file=PATH,size=SIZE", num_args = 1..)]
    pmem: Vec<String>,
    /// virtio-fs over vhost-user: tag=<tag>,socket=<path>[,num_queues=<n>][,queue_size=<n>][,id=<id>]
    /// [,dax=on|off][,cache_size=<size>][,transport=pci|mmio]. Needs --memory shared=on.
    #[arg(long, value_name = "tag=TAG,socket=PATH", num_args = 1..)]
    fs: Vec<String>,
    /// virtio-blk on a raw image: path=<path>[,readonly=on|off][,direct=on|off][,id=<id>]
    /// [,num_queues=<n>][,queue_size=<n>][,serial=<s>][,transport=pci|mmio]
    #[arg(long, value_name = "path=PATH", num_args = 1..)]
    disk: Vec<String>,
    /// virtio-net on a tap: tap=<name>[,ip=<ipv4>,mask=<ipv4>][,mac=<mac>][,mtu=<n>]
    /// [,num_queues=2][,queue_size=<n>][,id=<id>][,offload_tso=on|off][,offload_csum=on|off]
    /// [,transport=pci|mmio]
    #[arg(long, value_name = "tap=NAME", num_args = 1..)]
    net: Vec<String>,
    /// virtio-rng: src=<path>[,transport=pci|mmio], or off.
    #[arg(long, value_name = "src=PATH|off", default_value = "src=/dev/urandom")]
    rng: String,
    /// virtio-vsock with the hybrid unix-socket backend:
    /// cid=<cid>,socket=<path>[,id=<id>][,transport=pci|mmio].
    #[arg(long, value_name = "cid=CID,socket=PATH")]
    vsock: Option<String>,
    /// PCI segments: num_pci_segments=<1..96>. Devices choose theirs with
    /// pci_segment=<n>.
    #[arg(
        long,
        value_name = "num_pci_segments=N",
        default_value = "num_pci_segments=1"
    )]
    platform: String,
    /// Restore the VM of a snapshot instead of describing one:
    /// source_url=file:///<dir>[,prefault=on|off][,resume=true|false]. Needs
    /// --api-socket; the VM comes back paused (vm.resume) unless resume=true.
    #[arg(long, value_name = "source_url=file:///DIR")]
    restore: Option<String>,
    /// REST API socket: <path> or path=<path>.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<String>,
    /// Seccomp filters on every thread: true (a blocked call is reported and
    /// ends the VMM), false, log (allowed and written to the kernel's audit
    /// log), or trap (SIGSYS for a debugger). See docs/security.md.
    #[arg(long, value_name = "true|false|log|trap", default_value = "true")]
    seccomp: String,
    /// More log output on stderr (-v info, -vv debug, -vvv trace).
    #[arg(short, action = clap::ArgAction::Count)]
    verbose: u8,
}

impl Cli {
    /// `--api-socket <path>` or `--api-socket path=<path>`.
    fn api_socket(&self) -> Result<Option<PathBuf>, ConfigError> {
        let Some(v) = &self.api_socket else {
            return Ok(None);
        };
        let path = if v.contains('=') {
            let o = OptionValues::parse("api-socket", v, &["path"])?;
            o.get("path")
                .ok_or(ConfigError::MissingKey {
                    option: "api-socket",
                    key: "path",
                })?
                .to_string()
        } else {
            v.clone()
        };
        if path.is_empty() {
            return Err(ConfigError::MissingKey {
                option: "api-socket",
                key: "path",
            });
        }
        Ok(Some(PathBuf::from(path)))
    }

    /// `--restore`, which stands alone: the restored VM's configuration is
    /// the snapshot's, so an option describing a VM is refused with it (as
    /// Cloud Hypervisor's VM options require `--kernel`, which `--restore`
    /// does not take), and it needs the API to be resumed and driven.
    fn restore(&self, matches: &ArgMatches) -> Result<Option<RestoreConfig>, ConfigError> {
        let Some(input) = &self.restore else {
            return Ok(None);
        };
        const VM_OPTIONS: &[&str] = &[
            "kernel",
            "initramfs",
            "cmdline",
            "cpus",
            "memory",
            "serial",
            "console",
            "pmem",
            "fs",
            "disk",
            "net",
            "rng",
            "vsock",
            "platform",
        ];
        if let Some(option) = VM_OPTIONS
            .iter()
            .find(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
        {
            return Err(ConfigError::Unsupported {
                option: "restore",
                message: format!(
                    "cannot be given with --{option}: the restored VM's configuration is the snapshot's"
                ),
            });
        }
        if self.api_socket.is_none() {
            return Err(ConfigError::Unsupported {
                option: "restore",
                message: "needs --api-socket (the restored VM is driven through the API)".into(),
            });
        }
        RestoreConfig::parse(input).map(Some)
    }

    /// The VM the command line describes; None when it gives no kernel and
    /// the API will create the VM.
    fn vm_config(&self, api: bool) -> Result<Option<VmConfig>, ConfigError> {
        if api && self.kernel.is_none() {
            let given = [
                ("initramfs", self.initramfs.is_some()),
                ("pmem", !self.pmem.is_empty()),
                ("fs", !self.fs.is_empty()),
                ("disk", !self.disk.is_empty()),
                ("vsock", self.vsock.is_some()),
                ("net", !self.net.is_empty()),
            ];
            if let Some((option, _)) = given.iter().find(|(_, g)| *g) {
                return Err(ConfigError::Unsupported {
                    option,
                    message: "describes a VM, which needs --kernel too (or create the whole VM through the API)".into(),
                });
            }
            return Ok(None);
        }
        let console = parse_console(&self.console)?;
        let kernel = self.kernel.clone().ok_or(ConfigError::Unsupported {
            option: "kernel",
            message: "a kernel is required to boot a VM".into(),
        })?;
        let config = VmConfig {
            payload: PayloadConfig {
                kernel,
                initramfs: self.initramfs.clone(),
                cmdline: self.cmdline.clone(),
            },
            cpus: CpusConfig::parse(&self.cpus)?,
            memory: MemoryConfig::parse(&self.memory)?,
            serial: SerialMode::parse(&self.serial)?,
            console,
            pmem: self
                .pmem
                .iter()
                .enumerate()
                .map(|(i, p)| PmemConfig::parse(p, i))
                .collect::<Result<_, _>>()?,
            fs: self
                .fs
                .iter()
                .enumerate()
                .map(|(i, f)| FsConfig::parse(f, i))
                .collect::<Result<_, _>>()?,
            disks: self
                .disk
                .iter()
                .enumerate()
                .map(|(i, d)| DiskConfig::parse(d, i))
                .collect::<Result<_, _>>()?,
            net: self
                .net
                .iter()
                .enumerate()
                .map(|(i, n)| NetConfig::parse(n, i))
                .collect::<Result<_, _>>()?,
            rng: RngConfig::parse(&self.rng)?,
            vsock: self.vsock.as_deref().map(VsockConfig::parse).transpose()?,
            pvpanic: true,
            platform: PlatformConfig::parse(&self.platform)?,
        };
        config.validate()?;
        Ok(Some(config))
    }
}

/// Every thread allocates from glibc's main arena. A thread arena that
/// shrinks makes glibc read `/proc/sys/vm/overcommit_memory` (once, from
/// whichever thread trims first), and `openat` is refused on every thread
/// but the main one: the API thread freeing the buffers of thousands of
/// connections was killed by its seccomp filter for it. The main arena
/// shrinks with `brk`, which every filter allows. Before any thread starts.
fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; no thread exists yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Our crates, whose events are shown (a guest cannot make them log
/// without a per-site limit of their own); dependencies are heard only
/// through `log`, per-site limited.
const OWN_CRATES: &[&str] = &[
    "dax_vmm",
    "vmm",
    "virtio_devices",
    "pci",
    "api",
    "narrow",
    "policies",
    "control_protocol",
    "dax_abi",
    "seccomp",
    "log_limit",
];

/// stderr in env_logger's line format, as `RUST_LOG` or `-v` says; the
/// records dependencies log through `log` (virtio-queue logs per invalid
/// register write or kick) are limited per call site
/// (`virtio_devices::dependency_log`) before they are bridged to `tracing`.
fn install_logger(level: &str) {
    let Ok(max) = stderr::install(stderr::Levels::from_env(level, OWN_CRATES)) else {
        return;
    };
    let bridge = SiteLimitedLogger::new(
        stderr::LogTracer::new(),
        OWN_CRATES,
        virtio_devices::log_limit::PERIOD,
    );
    if log::set_logger(Box::leak(Box::new(bridge))).is_ok() {
        log::set_max_level(stderr::as_log(max));
    }
}

fn main() -> ExitCode {
    one_malloc_arena();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    install_logger(level);

    let (api_socket, config, restore) = match cli.api_socket().and_then(|a| {
        let restore = cli.restore(&matches)?;
        let config = match restore {
            Some(_) => None,
            None => cli.vm_config(a.is_some())?,
        };
        Ok((a, config, restore))
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let seccomp_mode = match seccomp::Mode::parse("--seccomp", &cli.seccomp) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let signals = match StopSignals::block() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dax-vmm: error: blocking SIGINT/SIGTERM: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    // Every API connection, device and guest-memory region takes an fd; the
    // default soft limit (1024) is a shell's, not a VMM's.
    match raise_nofile_limit() {
        Ok(n) => tracing::info!("RLIMIT_NOFILE: {n}"),
        Err(e) => tracing::warn!("RLIMIT_NOFILE: raising the soft limit to the hard one: {e}"),
    }
    // Before any other thread: each starts under this filter and adds its own.
    if let Err(e) = vmm::seccomp_filters::install(seccomp_mode) {
        eprintln!("dax-vmm: error: --seccomp: {e}");
        return ExitCode::from(EXIT_FAILURE);
    }
    if let Some(path) = api_socket {
        return serve_api(&path, config, restore.as_ref(), &signals);
    }
    let config = config.expect("without --api-socket the command line describes the VM");
    match vmm::vm::run(&config, &signals) {
        Ok(exit) => {
            eprintln!("dax-vmm: {}", exit.message());
            ExitCode::from(exit.status())
        }
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// Raises the open-file soft limit to the hard limit; answers the new limit.
fn raise_nofile_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct it is given, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit only reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// Serves the REST API on `path`; boots `config` first if the command line
/// gave one, or restores the VM of `restore`'s snapshot.
fn serve_api(
    path: &std::path::Path,
    config: Option<VmConfig>,
    restore: Option<&RestoreConfig>,
    signals: &StopSignals,
) -> ExitCode {
    let events = api::EventBus::default();
    let (channel, requests) = match api::vmm_channel() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let _server = match api::ApiServer::start(
        path,
        channel,
        events.clone(),
        vmm::control_loop::ping_info(),
    ) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    tracing::info!("REST API on {}", path.display());
    let boot_now = config.is_some();
    let mut control = ControlLoop::new(config, events, requests.notices());
    if boot_now {
        if let Err(e) = control.boot() {
            eprintln!("dax-vmm: error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    }
    if let Some(restore) = restore {
        if let Err(e) = control.restore("--restore", restore, RestoreTaps::default()) {
            eprintln!("dax-vmm: error: {}", e.message);
            return ExitCode::from(EXIT_FAILURE);
        }
    }
    match control.run(&requests, signals) {
        Ok(LoopExit::Requested) => {
            eprintln!("dax-vmm: shut down through the API");
            ExitCode::SUCCESS
        }
        Ok(LoopExit::Migrated) => {
            eprintln!("dax-vmm: the VM migrated to another VMM");
            ExitCode::SUCCESS
        }
        Ok(LoopExit::Vm(exit)) => {
            eprintln!("dax-vmm: {}", exit.message());
            ExitCode::from(exit.status())
        }
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--restore` as parsed from `args` (after the program name).
    fn restore(args: &[&str]) -> Result<Option<RestoreConfig>, String> {
        let matches = Cli::command()
            .try_get_matches_from(std::iter::once("dax-vmm").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        cli.restore(&matches).map_err(|e| e.to_string())
    }

    #[test]
    fn restore_as_cloud_hypervisors_docs_give_it() {
        let r = restore(&[
            "--api-socket",
            "/tmp/ch.sock",
            "--restore",
            "source_url=file:///tmp/snap,resume=true",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (r.source_dir.as_path(), r.prefault, r.resume),
            (std::path::Path::new("/tmp/snap"), false, true)
        );
        assert_eq!(restore(&["--api-socket", "/tmp/ch.sock"]).unwrap(), None);
    }

    #[test]
    fn restore_stands_alone_and_needs_the_api() {
        let with = |option: &str, value: &str| {
            restore(&[
                "--api-socket",
                "/s",
                "--restore",
                "source_url=file:///d",
                option,
                value,
            ])
            .unwrap_err()
        };
        assert_eq!(
            with("--kernel", "/k"),
            "--restore: cannot be given with --kernel: the restored VM's configuration is the snapshot's"
        );
        // Options with a default are refused only when given.
        assert!(with("--cpus", "boot=1").contains("with --cpus"));
        assert!(with("--memory", "size=1G").contains("with --memory"));
        assert!(with("--fs", "tag=t,socket=/s").contains("with --fs"));
        assert_eq!(
            restore(&["--restore", "source_url=file:///d"]).unwrap_err(),
            "--restore: needs --api-socket (the restored VM is driven through the API)"
        );
        assert!(
            restore(&["--api-socket", "/s", "--restore", "source_url=/d"])
                .unwrap_err()
                .contains("source_url=\"/d\" is invalid")
        );
    }
}
