//! `dax-virtiofsd`: serves one host directory to a guest over vhost-user,
//! with DAX. The command line is in [`daemon::cli`].

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;

use daemon::backend::FsBackend;
use daemon::cli::{CacheArg, Cli, OnOff, SandboxArg, SeccompArg};
use daemon::dax::DaxMapper;
use daemon::fuse::server::Server;
use daemon::limits::Limits;
use daemon::log_limit::stderr;
use daemon::passthrough::{CachePolicy, PassthroughFs, XattrMode};
use daemon::policy::DaxPolicy;
use daemon::sandbox::{self, Sandbox};
use daemon::workers::WorkerPool;
use daemon::GuestMemoryMmap;

/// The DAX policy the daemon starts with: `--dax-policy` (or the
/// default), its window sized by `--cache-size` when given.
fn startup_policy(cli: &Cli) -> Result<policies::Policy, String> {
    let mut policy = match &cli.dax_policy {
        Some(p) => DaxPolicy::from_file(p).map_err(|e| e.to_string())?,
        None => policies::Policy::default(),
    };
    if let Some(size) = cli.cache_size {
        if !dax_abi::window_size_fits(size) {
            return Err(format!(
                "--cache-size {size}: must be a multiple of {} from {} to {} (the guest maps {} ranges; \
                 the VMM refuses a larger window)",
                dax_abi::size_text(dax_abi::GUEST_RANGE_SIZE),
                dax_abi::size_text(dax_abi::MIN_WINDOW_SIZE),
                dax_abi::size_text(dax_abi::MAX_WINDOW_SIZE),
                dax_abi::size_text(dax_abi::GUEST_RANGE_SIZE),
            ));
        }
        policy.cache_size = size;
    }
    Ok(policy)
}

fn cache_policy(arg: CacheArg) -> CachePolicy {
    match arg {
        CacheArg::Never => CachePolicy::Never,
        CacheArg::Metadata => CachePolicy::Metadata,
        CacheArg::Auto => CachePolicy::Auto,
        CacheArg::Always => CachePolicy::Always,
    }
}

fn sandbox_mode(arg: SandboxArg) -> Sandbox {
    match arg {
        SandboxArg::Namespace => Sandbox::Namespace,
        SandboxArg::Chroot => Sandbox::Chroot,
        SandboxArg::None => Sandbox::None,
    }
}

fn seccomp_mode(arg: SeccompArg) -> seccomp::Mode {
    match arg {
        SeccompArg::Kill => seccomp::Mode::Kill,
        SeccompArg::Trap => seccomp::Mode::Trap,
        SeccompArg::Log => seccomp::Mode::Log,
        SeccompArg::None => seccomp::Mode::None,
    }
}

/// Raises the open-file limit (`--rlimit-nofile`) and sizes the inode,
/// handle, xattr and worker-queue caps within it.
fn limits(cli: &Cli) -> Result<Limits, String> {
    let nofile = sandbox::raise_nofile_limit(cli.rlimit_nofile)
        .map_err(|e| format!("--rlimit-nofile: {e}"))?;
    tracing::debug!("open-file limit {nofile}");
    Limits::for_nofile(
        nofile,
        cli.max_inodes,
        cli.max_handles,
        cli.max_xattr_size,
        cli.worker_queue_depth,
    )
    .map_err(|e| e.to_string())
}

/// Where the VMM connects: the vhost-user listener, how to name it in the
/// log, and its socket file (the default control socket goes beside it).
struct VhostSocket {
    listener: Listener,
    shown: String,
    file: Option<PathBuf>,
}

/// The socket is bound before the sandbox closes the host's paths off.
/// An inherited one (--fd) is not: its file is the caller's to remove.
fn vhost_socket(cli: &Cli, inherited: Option<UnixListener>) -> Result<VhostSocket, String> {
    match (inherited, &cli.socket_path) {
        (Some(l), _) => Ok(VhostSocket {
            file: l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(Path::to_path_buf)),
            listener: Listener::from(l),
            shown: format!("fd {}", cli.fd.unwrap_or(-1)),
        }),
        (None, Some(path)) => Ok(VhostSocket {
            listener: Listener::new(path, true)
                .map_err(|e| format!("--socket-path {}: {e}", path.display()))?,
            shown: path.display().to_string(),
            file: Some(path.clone()),
        }),
        (None, None) => Err("--socket-path PATH or --fd N is required".into()),
    }
}

/// `--control-socket`, or the default beside the vhost-user socket
/// unless `--no-control-socket`.
fn control_socket(cli: &Cli, vhost_file: Option<&Path>) -> Result<Option<UnixListener>, String> {
    Ok(match (&cli.control_socket, cli.no_control_socket) {
        (Some(path), _) => Some(daemon::control::bind(path).map_err(|e| e.to_string())?),
        (None, true) => None,
        (None, false) => vhost_file.and_then(daemon::control::bind_default),
    })
}

/// Enters the sandbox and installs the seccomp filter; returns the share's
/// root as the sandbox opened it.
fn confine(shared_dir: &Path, cli: &Cli) -> Result<sandbox::Opened, String> {
    let opened =
        sandbox::enter(shared_dir, sandbox_mode(cli.sandbox)).map_err(|e| e.to_string())?;
    let seccomp_mode = seccomp_mode(cli.seccomp);
    // Before the first thread: every thread inherits the filter.
    if seccomp_mode == seccomp::Mode::Kill {
        seccomp::install_sigsys_report().map_err(|e| format!("--seccomp: SIGSYS handler: {e}"))?;
    }
    seccomp::apply("daemon", &daemon::seccomp_filter::serving(), seccomp_mode)
        .map_err(|e| format!("--seccomp: {e}"))?;
    Ok(opened)
}

/// The passthrough filesystem over the share, with the options that shape it.
fn filesystem(
    cli: &Cli,
    shared_dir: &Path,
    opened: sandbox::Opened,
    policy: Arc<DaxPolicy>,
    limits: Limits,
) -> Result<PassthroughFs, String> {
    let mut fs = PassthroughFs::new(
        opened.root,
        opened.proc_self_fd,
        cache_policy(cli.cache),
        policy,
    )
    .map_err(|e| format!("--shared-dir {}: {e}", shared_dir.display()))?;
    fs.announce_submounts = cli.announce_submounts;
    fs.readdirplus = !cli.no_readdirplus;
    fs.offer_killpriv_v2 = !cli.no_killpriv_v2;
    fs.xattr = if cli.xattr {
        XattrMode::Mapped
    } else {
        XattrMode::Off
    };
    fs.limits = limits;
    Ok(fs)
}

/// `--thread-pool-size` workers, or none (each queue serves its own).
fn worker_pool(cli: &Cli, limits: &Limits) -> Result<Option<WorkerPool>, String> {
    match cli.thread_pool_size {
        0 => Ok(None),
        n => WorkerPool::new(usize::from(n), limits.worker_queue_depth)
            .map(Some)
            .map_err(|e| format!("--thread-pool-size {n}: starting workers: {e}")),
    }
}

/// Serves the VMM's connection until it ends, then logs what was done.
fn serve_vmm(
    mut daemon: VhostUserDaemon<Arc<FsBackend>>,
    listener: &mut Listener,
    server: &Server,
) -> Result<(), String> {
    // Kata's Rust runtime waits for this line on the daemon's stderr, as
    // virtiofsd prints it, before it starts the VMM.
    tracing::info!("Waiting for vhost-user socket connection...");
    daemon
        .start(listener)
        .map_err(|e| format!("accepting the VMM's connection: {e}"))?;
    let result = daemon.wait();
    let s = server.report();
    tracing::info!(
        "VMM disconnected after {} requests ({} errors); {} FUSE reads, {} FUSE writes; {} setupmappings, {} removemappings, {} DAX failures",
        s.requests,
        s.errors,
        s.fuse_reads,
        s.fuse_writes,
        s.setupmappings,
        s.removemappings,
        s.dax_failures
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

/// Everything that may need the host's view (the policy file, the sockets,
/// the mounts) happens before [`confine`]; threads start only after it.
fn run(cli: Cli, inherited: Option<UnixListener>) -> Result<(), String> {
    let shared_dir = cli
        .shared_dir
        .clone()
        .ok_or("--shared-dir (or -o source=DIR) is required")?;
    let policy = startup_policy(&cli)?;
    let window = policy.cache_size;
    let limits = limits(&cli)?;
    let mut socket = vhost_socket(&cli, inherited)?;
    let control = control_socket(&cli, socket.file.as_deref())?;
    // Before the sandbox: it needs the host's view of the mounts.
    let host_fs = daemon::host_fs::HostFs::probe(&shared_dir);
    tracing::info!(
        "shared directory on {}; window_granularity auto is {}",
        host_fs.describe(),
        if host_fs.large_folios { "2M" } else { "4K" }
    );
    let opened = confine(&shared_dir, &cli)?;
    let how = opened.how;
    let policy = Arc::new(DaxPolicy::for_host(policy, host_fs));
    let fs = filesystem(&cli, &shared_dir, opened, policy.clone(), limits)?;
    let dax = DaxMapper::new(window, policy.clone());
    let server = Arc::new(Server::new(fs, dax, policy.clone()));
    if let Some(listener) = control {
        daemon::control::serve(listener, server.clone(), policy)
            .map_err(|e| format!("--control-socket: {e}"))?;
    }
    let backend = Arc::new(
        FsBackend::new(
        server.clone(),
        usize::from(cli.max_request_queues),
        usize::from(cli.max_queue_size),
        cli.dax == OnOff::On,
        worker_pool(&cli, &limits)?,
    )
    // Every --migration-mode the CLI takes (find-paths) moves the state,
    // so the transfer is offered, as virtiofsd offers it.
    .with_migration(true),
    );
    let daemon = VhostUserDaemon::new(
        "dax-virtiofsd".into(),
        backend,
        GuestMemoryAtomic::new(GuestMemoryMmap::new()),
    )
    .map_err(|e| format!("starting the vhost-user daemon: {e}"))?;
    tracing::info!(
        "serving {} on {} (window {} MiB, sandbox {how}, seccomp {:?}, xattr {}, cache {:?}, thread pool {})",
        shared_dir.display(),
        socket.shown,
        window >> 20,
        cli.seccomp,
        if cli.xattr { "mapped" } else { "off" },
        cli.cache,
        cli.thread_pool_size
    );
    serve_vmm(daemon, &mut socket.listener, &server)
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if cli.print_capabilities {
        print!("{}", daemon::cli::virtiofsd::CAPABILITIES);
        return ExitCode::SUCCESS;
    }
    if let Err(e) = cli.check() {
        eprintln!("dax-virtiofsd: {e}");
        return ExitCode::from(2);
    }
    #[cfg(feature = "bench-unacked-maps")]
    daemon::backend::UNACKED_MAPS
        .store(cli.bench_unacked_maps, std::sync::atomic::Ordering::Relaxed);
    // Claimed before anything else opens an fd, so a closed --fd is not
    // mistaken for one the daemon opened itself (the syslog socket).
    let inherited = match cli.fd.map(daemon::listen::inherited).transpose() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("dax-virtiofsd: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let level = cli.log_level.filter();
    // Connected now, before the sandbox hides /dev/log.
    let syslog = cli.syslog && daemon::syslog::install(Path::new(daemon::syslog::DEV_LOG), level);
    if !syslog {
        // stderr in env_logger's line format; RUST_LOG overrides the level.
        let levels =
            stderr::Levels::from_env(&level.to_string().to_lowercase(), daemon::OWN_CRATES);
        if let Ok(max) = stderr::install(levels) {
            stderr::bridge_log(max);
        }
    }
    match run(cli, inherited) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if syslog {
                tracing::error!("{e}");
            }
            eprintln!("dax-virtiofsd: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cache_size(arg: &str) -> Result<u64, String> {
        let cli =
            Cli::try_parse_from(["dax-virtiofsd", "--socket-path=/s", "--shared-dir=/d", arg])
                .map_err(|e| e.to_string())?;
        startup_policy(&cli).map(|p| p.cache_size)
    }

    #[test]
    fn cache_size_is_a_window_the_vmm_accepts() {
        assert_eq!(cache_size("--cache-size=64M"), Ok(64 << 20));
        assert_eq!(cache_size("--cache-size=256G"), Ok(256 << 30));
        for refused in ["--cache-size=3M", "--cache-size=512G", "--cache-size=4K"] {
            let e = cache_size(refused).unwrap_err();
            assert!(
                e.contains("--cache-size") && e.contains("from 2M to 256G"),
                "{refused}: {e}"
            );
        }
    }
}
