//! `dax-vmm`: command-line entry point, in Cloud Hypervisor's syntax.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use vmm::config::{parse_console, ConfigError, CpusConfig, FsConfig, MemoryConfig, PayloadConfig, PmemConfig, SerialMode, VmConfig};
use vmm::signals::StopSignals;

/// Exit status for a command line the VMM cannot run (as clap uses for usage errors).
const EXIT_USAGE: u8 = 2;
const EXIT_FAILURE: u8 = 1;

#[derive(Parser, Debug)]
#[command(name = "dax-vmm", version, about = "KVM virtual machine monitor with virtio-fs DAX")]
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
    /// vCPUs: boot=<n>[,max=<n>].
    #[arg(long, value_name = "boot=N", default_value = "boot=1")]
    cpus: String,
    /// Guest RAM: size=<bytes|K|M|G>[,shared=on|off][,hugepages=on|off].
    #[arg(long, value_name = "size=SIZE,shared=on|off", default_value = "size=512M")]
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
    /// REST API socket: <path> or path=<path>.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<String>,
    /// More log output on stderr (-v info, -vv debug, -vvv trace).
    #[arg(short, action = clap::ArgAction::Count)]
    verbose: u8,
}

impl Cli {
    fn vm_config(&self) -> Result<VmConfig, ConfigError> {
        if self.api_socket.is_some() {
            return Err(ConfigError::Unsupported {
                option: "api-socket",
                message: "the REST API is not available yet in this build; configure the VM on the command line".into(),
            });
        }
        parse_console(&self.console)?;
        let kernel = self.kernel.clone().ok_or(ConfigError::Unsupported {
            option: "kernel",
            message: "a kernel is required to boot a VM".into(),
        })?;
        let config = VmConfig {
            payload: PayloadConfig { kernel, initramfs: self.initramfs.clone(), cmdline: self.cmdline.clone() },
            cpus: CpusConfig::parse(&self.cpus)?,
            memory: MemoryConfig::parse(&self.memory)?,
            serial: SerialMode::parse(&self.serial)?,
            pmem: self.pmem.iter().enumerate().map(|(i, p)| PmemConfig::parse(p, i)).collect::<Result<_, _>>()?,
            fs: self.fs.iter().enumerate().map(|(i, f)| FsConfig::parse(f, i)).collect::<Result<_, _>>()?,
        };
        config.validate()?;
        Ok(config)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();

    let config = match cli.vm_config() {
        Ok(c) => c,
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
    match vmm::vm::run(&config, &signals) {
        Ok(exit) => {
            eprintln!("dax-vmm: {}", exit.message());
            ExitCode::from(exit.status() as u8)
        }
        Err(e) => {
            eprintln!("dax-vmm: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
