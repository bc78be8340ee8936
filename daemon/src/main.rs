//! `dax-virtiofsd`: serves one host directory to a guest over vhost-user,
//! with DAX. The command line is in [`daemon::cli`].

use std::os::unix::net::UnixListener;
use std::path::Path;
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
use daemon::passthrough::{CachePolicy, PassthroughFs, XattrMode};
use daemon::policy::DaxPolicy;
use daemon::sandbox::{self, Sandbox};
use daemon::workers::WorkerPool;
use daemon::GuestMemoryMmap;

fn run(cli: Cli, inherited: Option<UnixListener>) -> Result<(), String> {
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
        CacheArg::Metadata => CachePolicy::Metadata,
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
    // An inherited one (--fd) is not: its file is the caller's to remove.
    let socket_file = match (&inherited, &cli.socket_path) {
        (Some(l), _) => l
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf)),
        (None, path) => path.clone(),
    };
    let (mut listener, listening_on) = match (inherited, &cli.socket_path) {
        (Some(l), _) => (Listener::from(l), format!("fd {}", cli.fd.unwrap_or(-1))),
        (None, Some(path)) => (
            Listener::new(path, true)
                .map_err(|e| format!("--socket-path {}: {e}", path.display()))?,
            path.display().to_string(),
        ),
        (None, None) => return Err("--socket-path PATH or --fd N is required".into()),
    };
    let control = match (&cli.control_socket, cli.no_control_socket) {
        (Some(path), _) => Some(daemon::control::bind(path).map_err(|e| e.to_string())?),
        (None, true) => None,
        (None, false) => socket_file
            .as_deref()
            .and_then(daemon::control::bind_default),
    };
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
    fs.readdirplus = !cli.no_readdirplus;
    fs.offer_killpriv_v2 = !cli.no_killpriv_v2;
    fs.xattr = if cli.xattr {
        XattrMode::Mapped
    } else {
        XattrMode::Off
    };
    fs.limits = limits;
    let server = Arc::new(Server::new(
        fs,
        DaxMapper::new(window, policy.clone()),
        policy.clone(),
    ));
    if let Some(listener) = control {
        daemon::control::serve(listener, server.clone(), policy.clone())
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
        listening_on,
        window >> 20,
        cli.seccomp,
        if cli.xattr { "mapped" } else { "off" },
        cli.cache,
        cli.thread_pool_size
    );
    // Kata's Rust runtime waits for this line on the daemon's stderr, as
    // virtiofsd prints it, before it starts the VMM.
    log::info!("Waiting for vhost-user socket connection...");
    daemon
        .start(&mut listener)
        .map_err(|e| format!("accepting the VMM's connection: {e}"))?;
    let result = daemon.wait();
    let s = server.report();
    log::info!(
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
        env_logger::Builder::from_env(
            env_logger::Env::default().default_filter_or(level.to_string().to_lowercase()),
        )
        .init();
    }
    match run(cli, inherited) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if syslog {
                log::error!("{e}");
            }
            eprintln!("dax-virtiofsd: error: {e}");
            ExitCode::FAILURE
        }
    }
}
