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
    runtime.block_on(async {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("dax-fleet: error: SIGTERM handler: {e}");
                std::process::exit(1);
            }
        };
        tokio::select! {
            () = Agent::new(cfg).run() => {}
            _ = term.recv() => log::info!("SIGTERM: stopping (the status keys expire with the lease)"),
            _ = tokio::signal::ctrl_c() => log::info!("interrupted: stopping"),
        }
    });
}
