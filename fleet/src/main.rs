//! `dax-fleet --config FILE`: see docs/fleet.md.

use std::path::PathBuf;

use clap::Parser;
use fleet::agent::Agent;
use fleet::config::Config;

#[derive(Parser)]
#[command(
    name = "dax-fleet",
    version,
    about = "Takes DAX policies from etcd and applies them to every VM on this host"
)]
struct Cli {
    /// The agent's configuration (YAML): host, etcd, prefix, vms.
    #[arg(long)]
    config: PathBuf,
    /// error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log_level: tracing::level_filters::LevelFilter,
}

/// Our crates, whose events are shown; dependencies are heard only through
/// `log` (log_limit::stderr).
const OWN_CRATES: &[&str] = &["dax_fleet", "fleet", "log_limit"];

/// stderr in env_logger's line format at `level` (`RUST_LOG` is not read).
fn install_logger(level: tracing::level_filters::LevelFilter) {
    let levels = log_limit::stderr::Levels::at(level, OWN_CRATES);
    if let Ok(max) = log_limit::stderr::install(levels) {
        log_limit::stderr::bridge_log(max);
    }
}

fn main() {
    let cli = Cli::parse();
    install_logger(cli.log_level);
    let cfg = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dax-fleet: error: {e}");
            std::process::exit(2);
        }
    };
    let secrets = match cfg.secrets() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dax-fleet: error: --config {}: {e}", cli.config.display());
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dax-fleet: error: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    tracing::info!(
        "host {}: {} VM(s), etcd {}, prefix {}",
        cfg.host,
        cfg.vms.len(),
        cfg.etcd.join(","),
        cfg.prefix
    );
    // No signal handling of its own: SIGTERM ends the process, and its
    // status keys expire with their lease. (tokio's signal driver would
    // also, by feature unification, put a socketpair into the other
    // binaries' runtimes, which their seccomp filters refuse.)
    runtime.block_on(Agent::new(cfg, secrets).run());
}
