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
    log_level: log::LevelFilter,
}

fn main() {
    let cli = Cli::parse();
    env_logger::Builder::new()
        .filter_level(cli.log_level)
        .init();
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
    log::info!(
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
