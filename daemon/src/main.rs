//! `dax-virtiofsd`: serves one host directory to a guest over vhost-user,
//! with DAX. Flags follow virtiofsd's where they mean the same thing.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, ValueEnum};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;

use daemon::backend::FsBackend;
use daemon::dax::DaxMapper;
use daemon::fuse::server::Server;
use daemon::limits::Limits;
use daemon::passthrough::{CachePolicy, PassthroughFs, XattrMode};
use daemon::policy::DaxPolicy;
use daemon::sandbox::{self, Sandbox};
use daemon::workers::WorkerPool;
use daemon::GuestMemoryMmap;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CacheArg {
    Never,
    Auto,
    Always,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum SandboxArg {
    Namespace,
    Chroot,
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum SeccompArg {
    Kill,
    Trap,
    Log,
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum OnOff {
    On,
    Off,
}

#[derive(Parser, Debug)]
#[command(
    name = "dax-virtiofsd",
    version,
    about = "vhost-user virtio-fs daemon with DAX (SHMEM_MAP/SHMEM_UNMAP)"
)]
struct Cli {
    /// vhost-user socket to listen on (the VMM connects to it).
    #[arg(long, value_name = "PATH")]
    socket_path: PathBuf,
    /// Directory to share with the guest.
    #[arg(long, value_name = "DIR")]
    shared_dir: Option<PathBuf>,
    /// How long the guest may cache entries, attributes and file data.
    #[arg(long, value_enum, default_value = "auto")]
    cache: CacheArg,
    /// Worker threads shared by all queues; 0 serves each queue's requests
    /// on that queue's own thread.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024))]
    thread_pool_size: u16,
    /// Confinement: own mount/pid/network namespaces with the share as the
    /// root (namespace), a chroot into the share, or none. See docs/security.md.
    #[arg(long, value_enum, default_value = "namespace")]
    sandbox: SandboxArg,
    /// What a system call outside the daemon's allowlist does: kill (report
    /// it and end the daemon), trap (SIGSYS), log (kernel audit log), none.
    #[arg(long, value_enum, default_value = "kill")]
    seccomp: SeccompArg,
    /// Serve extended attributes (off by default, as in virtiofsd); the
    /// guest's non-`user.` names are stored as `user.virtiofs.<name>`.
    #[arg(long, overrides_with = "no_xattr")]
    xattr: bool,
    /// Do not serve extended attributes (the default).
    #[arg(long)]
    no_xattr: bool,
    /// Inodes the guest may hold at once (each an open fd); default: 1Mi,
    /// or less to fit the open-file limit.
    #[arg(long, value_name = "N")]
    max_inodes: Option<u64>,
    /// File and directory handles the guest may hold open at once; default
    /// 64Ki, or less to fit the open-file limit.
    #[arg(long, value_name = "N")]
    max_handles: Option<u64>,
    /// Largest extended attribute value served or stored (at most 65536).
    #[arg(long, value_name = "BYTES")]
    max_xattr_size: Option<u32>,
    /// Requests that may wait for a --thread-pool-size worker at once; past
    /// it the queue's own thread serves the request (default 1024).
    #[arg(long, value_name = "N")]
    worker_queue_depth: Option<usize>,
    #[arg(long, value_enum, default_value = "info")]
    log_level: LogLevel,
    /// Offer a DAX window (vhost-user SHMEM) to the VMM.
    #[arg(long, value_enum, default_value = "on")]
    dax: OnOff,
    /// DAX policy document (JSON, or YAML by extension): window size, mapping
    /// granularity, which files get DAX. Default: see docs/policies.md.
    #[arg(long, value_name = "FILE")]
    dax_policy: Option<PathBuf>,
    /// Control socket (HTTP/1.1 + JSON, mode 0600) for reading and replacing
    /// the DAX policy while the guest runs; see docs/virtiofs.md.
    #[arg(long, value_name = "PATH")]
    control_socket: Option<PathBuf>,
    /// Window size to declare, overriding the policy's cache_size (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    cache_size: Option<u64>,
    /// Request queues served at most (the VMM's num_queues), plus the hiprio queue.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=63))]
    max_request_queues: u16,
    /// Open-file limit to set (every inode the guest holds is an fd);
    /// default: as high as the system allows.
    #[arg(long, value_name = "N")]
    rlimit_nofile: Option<u64>,
    /// Tell the guest which directories are other host mounts, so it gives
    /// each its own superblock (their inode numbers cannot collide).
    #[arg(long)]
    announce_submounts: bool,
    /// Options in the legacy virtiofsd form, comma-separated, as Kata and
    /// older configurations pass them: source=DIR, cache=never|auto|always,
    /// announce_submounts, xattr.
    #[arg(short = 'o', value_name = "OPT[,OPT...]")]
    compat_options: Vec<String>,
    /// Largest queue size accepted.
    #[arg(long, value_name = "N", default_value_t = 32768)]
    max_queue_size: u16,
}

fn parse_size(v: &str) -> Result<u64, String> {
    let json = serde_json_like(v);
    policies::parse_size("--cache-size", &json).map_err(|e| e.to_string())
}

/// The policy crate parses sizes from document values; a flag is a string.
fn serde_json_like(v: &str) -> policies::Value {
    match v.parse::<u64>() {
        Ok(n) => policies::Value::from(n),
        Err(_) => policies::Value::from(v),
    }
}

/// Folds `-o` options into the flags they stand for.
fn apply_compat_options(cli: &mut Cli) -> Result<(), String> {
    for opt in cli
        .compat_options
        .iter()
        .flat_map(|o| o.split(','))
        .filter(|o| !o.is_empty())
    {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        match (key, value) {
            ("source", Some(dir)) => match &cli.shared_dir {
                Some(given) if given != std::path::Path::new(dir) => {
                    return Err(format!("-o source={dir}: the shared directory is already {}", given.display()))
                }
                _ => cli.shared_dir = Some(PathBuf::from(dir)),
            },
            ("cache", Some(v)) => {
                cli.cache = CacheArg::from_str(v, true).map_err(|_| format!("-o cache={v}: expected never, auto or always"))?
            }
            ("announce_submounts", None) => cli.announce_submounts = true,
            ("xattr", None) => {
                cli.xattr = true;
                cli.no_xattr = false;
            }
            ("no_xattr", None) => {
                cli.xattr = false;
                cli.no_xattr = true;
            }
            _ => {
                return Err(format!(
                    "-o {opt}: not a supported option (supported: source=DIR, cache=never|auto|always, announce_submounts, xattr, no_xattr)"
                ))
            }
        }
    }
    Ok(())
}

fn run(mut cli: Cli) -> Result<(), String> {
    apply_compat_options(&mut cli)?;
    let shared_dir = cli
        .shared_dir
        .clone()
        .ok_or("--shared-dir (or -o source=DIR) is required")?;
    let mut policy = match &cli.dax_policy {
        Some(p) => DaxPolicy::from_file(p).map_err(|e| e.to_string())?,
        None => policies::Policy::default(),
    };
    if let Some(size) = cli.cache_size {
        if size == 0 || size % (2 << 20) != 0 {
            return Err(format!("--cache-size {size}: must be a non-zero multiple of 2M (the guest maps 2 MiB ranges)"));
        }
        policy.cache_size = size;
    }
    let window = policy.cache_size;
    let cache = match cli.cache {
        CacheArg::Never => CachePolicy::Never,
        CacheArg::Auto => CachePolicy::Auto,
        CacheArg::Always => CachePolicy::Always,
    };
    let sandbox_mode = match cli.sandbox {
        SandboxArg::Namespace => Sandbox::Namespace,
        SandboxArg::Chroot => Sandbox::Chroot,
        SandboxArg::None => Sandbox::None,
    };
    let seccomp_mode = match cli.seccomp {
        SeccompArg::Kill => seccomp::Mode::Kill,
        SeccompArg::Trap => seccomp::Mode::Trap,
        SeccompArg::Log => seccomp::Mode::Log,
        SeccompArg::None => seccomp::Mode::None,
    };
    let nofile = sandbox::raise_nofile_limit(cli.rlimit_nofile)
        .map_err(|e| format!("--rlimit-nofile: {e}"))?;
    log::debug!("open-file limit {nofile}");
    let limits = Limits::for_nofile(
        nofile,
        cli.max_inodes,
        cli.max_handles,
        cli.max_xattr_size,
        cli.worker_queue_depth,
    )
    .map_err(|e| e.to_string())?;
    // The socket is bound before the sandbox closes the host's paths off.
    let mut listener = Listener::new(&cli.socket_path, true)
        .map_err(|e| format!("--socket-path {}: {e}", cli.socket_path.display()))?;
    let control = cli
        .control_socket
        .as_deref()
        .map(daemon::control::bind)
        .transpose()
        .map_err(|e| e.to_string())?;
    // Before the sandbox: it needs the host's view of the mounts.
    let host_fs = daemon::host_fs::HostFs::probe(&shared_dir);
    log::info!(
        "shared directory on {}; window_granularity auto is {}",
        host_fs.describe(),
        if host_fs.large_folios { "2M" } else { "4K" }
    );
    let opened = sandbox::enter(&shared_dir, sandbox_mode).map_err(|e| e.to_string())?;
    // Before the first thread: every thread inherits the filter.
    if seccomp_mode == seccomp::Mode::Kill {
        seccomp::install_sigsys_report().map_err(|e| format!("--seccomp: SIGSYS handler: {e}"))?;
    }
    seccomp::apply("daemon", &daemon::seccomp_filter::serving(), seccomp_mode)
        .map_err(|e| format!("--seccomp: {e}"))?;
    let how = opened.how;
    let policy = Arc::new(DaxPolicy::for_host(policy, host_fs));
    let mut fs = PassthroughFs::new(opened.root, opened.proc_self_fd, cache, policy.clone())
        .map_err(|e| format!("--shared-dir {}: {e}", shared_dir.display()))?;
    fs.announce_submounts = cli.announce_submounts;
    fs.xattr = if cli.xattr {
        XattrMode::Mapped
    } else {
        XattrMode::Off
    };
    fs.limits = limits;
    let server = Arc::new(Server::new(fs, DaxMapper::new(window), policy));
    if let Some(listener) = control {
        daemon::control::serve(listener, server.clone())
            .map_err(|e| format!("--control-socket: {e}"))?;
    }
    let pool = match cli.thread_pool_size {
        0 => None,
        n => Some(
            WorkerPool::new(usize::from(n), limits.worker_queue_depth)
                .map_err(|e| format!("--thread-pool-size {n}: starting workers: {e}"))?,
        ),
    };
    let backend = Arc::new(FsBackend::new(
        server.clone(),
        usize::from(cli.max_request_queues),
        usize::from(cli.max_queue_size),
        cli.dax == OnOff::On,
        pool,
    ));
    let mut daemon = VhostUserDaemon::new(
        "dax-virtiofsd".into(),
        backend,
        GuestMemoryAtomic::new(GuestMemoryMmap::new()),
    )
    .map_err(|e| format!("starting the vhost-user daemon: {e}"))?;
    log::info!(
        "serving {} on {} (window {} MiB, sandbox {how}, seccomp {:?}, xattr {}, cache {:?}, thread pool {})",
        shared_dir.display(),
        cli.socket_path.display(),
        window >> 20,
        cli.seccomp,
        if cli.xattr { "mapped" } else { "off" },
        cli.cache,
        cli.thread_pool_size
    );
    daemon
        .start(&mut listener)
        .map_err(|e| format!("accepting the VMM's connection: {e}"))?;
    let result = daemon.wait();
    let s = &server.stats;
    let d = &server.dax.stats;
    use std::sync::atomic::Ordering::Relaxed;
    log::info!(
        "VMM disconnected after {} requests ({} errors); {} FUSE reads, {} FUSE writes; {} setupmappings, {} removemappings, {} DAX failures",
        s.requests.load(Relaxed),
        s.errors.load(Relaxed),
        s.fuse_reads.load(Relaxed),
        s.fuse_writes.load(Relaxed),
        d.setupmappings.load(Relaxed),
        d.removemappings.load(Relaxed),
        d.failures.load(Relaxed)
    );
    match result {
        // The VMM closing its end is how a VM ends.
        Ok(())
        | Err(vhost_user_backend::Error::HandleRequest(vhost::vhost_user::Error::Disconnected)) => {
            Ok(())
        }
        Err(e) => Err(format!("vhost-user connection: {e}")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = format!("{:?}", cli.log_level).to_lowercase();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dax-virtiofsd: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Result<Cli, String> {
        let mut cli = Cli::try_parse_from(
            [&["dax-virtiofsd", "--socket-path", "/run/fs.sock"], args].concat(),
        )
        .map_err(|e| e.to_string())?;
        apply_compat_options(&mut cli)?;
        Ok(cli)
    }

    #[test]
    fn kata_style_arguments_are_understood() {
        // What Kata's configuration passes, in both of its spellings.
        let c = cli(&[
            "--shared-dir",
            "/s",
            "--thread-pool-size=1",
            "-o",
            "announce_submounts",
        ])
        .unwrap();
        assert!(c.announce_submounts);
        assert_eq!(c.thread_pool_size, 1);
        let c = cli(&[
            "--shared-dir",
            "/s",
            "--thread-pool-size=1",
            "--announce-submounts",
        ])
        .unwrap();
        assert!(c.announce_submounts);
        let c = cli(&["-o", "source=/s,cache=always,xattr"]).unwrap();
        assert_eq!(c.shared_dir.as_deref(), Some(std::path::Path::new("/s")));
        assert!(matches!(c.cache, CacheArg::Always));
        assert!(c.xattr, "-o xattr turns extended attributes on");
        assert!(
            !cli(&["--shared-dir", "/s"]).unwrap().xattr,
            "off by default"
        );
        assert!(matches!(
            cli(&["--shared-dir", "/s"]).unwrap().sandbox,
            SandboxArg::Namespace
        ));
        assert!(matches!(
            cli(&["--shared-dir", "/s"]).unwrap().seccomp,
            SeccompArg::Kill
        ));
        assert!(!c.announce_submounts);
    }

    #[test]
    fn bad_legacy_options_are_refused_by_name() {
        let e = cli(&[
            "--shared-dir",
            "/s",
            "-o",
            "announce_submounts,no_posix_lock",
        ])
        .err()
        .unwrap();
        assert!(
            e.starts_with("-o no_posix_lock: not a supported option"),
            "{e}"
        );
        let e = cli(&["-o", "cache=sometimes", "--shared-dir", "/s"])
            .err()
            .unwrap();
        assert_eq!(e, "-o cache=sometimes: expected never, auto or always");
        let e = cli(&["--shared-dir", "/s", "-o", "source=/t"])
            .err()
            .unwrap();
        assert_eq!(e, "-o source=/t: the shared directory is already /s");
        let e = cli(&["--shared-dir", "/s", "--thread-pool-size", "5000"])
            .err()
            .unwrap();
        assert!(e.contains("5000") && e.contains("0..=1024"), "{e}");
    }
}
