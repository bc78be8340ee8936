//! dax-virtiofsd's command line. Flags follow virtiofsd 1.14's where they
//! mean the same thing; every virtiofsd option is either taken with its
//! meaning or refused by name ([`virtiofsd`]), so a command line written
//! for virtiofsd (Kata Containers', libvirt's) never half-works. The table
//! is in docs/virtiofs.md.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use tracing::level_filters::LevelFilter;

pub mod virtiofsd;

#[cfg(test)]
#[path = "cli_tests.rs"]
mod tests;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum CacheArg {
    Never,
    /// Attributes and entries cached long, file data never (direct I/O).
    Metadata,
    Auto,
    Always,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum SandboxArg {
    Namespace,
    Chroot,
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum SeccompArg {
    Kill,
    Trap,
    Log,
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn filter(self) -> LevelFilter {
        match self {
            LogLevel::Off => LevelFilter::OFF,
            LogLevel::Error => LevelFilter::ERROR,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Trace => LevelFilter::TRACE,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

#[derive(Parser, Debug)]
#[command(
    name = "dax-virtiofsd",
    version,
    about = "vhost-user virtio-fs daemon with DAX (SHMEM_MAP/SHMEM_UNMAP)",
    after_help = "virtiofsd options this daemon does not implement are refused by name (exit status 2); see docs/virtiofs.md."
)]
pub struct Cli {
    /// vhost-user socket to bind and listen on (the VMM connects to it);
    /// exactly one of this and --fd. `--socket` is virtiofsd's old name.
    #[arg(long, alias = "socket", value_name = "PATH")]
    pub socket_path: Option<PathBuf>,
    /// An inherited vhost-user socket, already bound and listening, to
    /// serve on (as Kata Containers passes it: --fd=3); the socket file is
    /// the caller's, never removed. Exactly one of this and --socket-path.
    #[arg(long, value_name = "FD", allow_negative_numbers = true)]
    pub fd: Option<i32>,
    /// Directory to share with the guest.
    #[arg(long, value_name = "DIR")]
    pub shared_dir: Option<PathBuf>,
    /// How long the guest may cache entries, attributes and file data.
    #[arg(long, value_enum, default_value = "auto")]
    pub cache: CacheArg,
    /// Worker threads shared by all queues; 0 serves each queue's requests
    /// on that queue's own thread.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub thread_pool_size: u16,
    /// Confinement: own mount/pid/network namespaces with the share as the
    /// root (namespace), a chroot into the share, or none. See docs/security.md.
    #[arg(long, value_enum, default_value = "namespace")]
    pub sandbox: SandboxArg,
    /// What a system call outside the daemon's allowlist does: kill (report
    /// it and end the daemon), trap (SIGSYS), log (kernel audit log), none.
    #[arg(long, value_enum, default_value = "kill")]
    pub seccomp: SeccompArg,
    /// Serve extended attributes (off by default, as in virtiofsd); the
    /// guest's non-`user.` names are stored as `user.virtiofs.<name>`.
    #[arg(long, overrides_with = "no_xattr")]
    pub xattr: bool,
    /// Do not serve extended attributes (the default).
    #[arg(long)]
    pub no_xattr: bool,
    /// Inodes the guest may hold at once (each an open fd); default: 1Mi,
    /// or less to fit the open-file limit.
    #[arg(long, value_name = "N")]
    pub max_inodes: Option<u64>,
    /// File and directory handles the guest may hold open at once; default
    /// 64Ki, or less to fit the open-file limit.
    #[arg(long, value_name = "N")]
    pub max_handles: Option<u64>,
    /// Largest extended attribute value served or stored (at most 65536).
    #[arg(long, value_name = "BYTES")]
    pub max_xattr_size: Option<u32>,
    /// Requests that may wait for a --thread-pool-size worker at once; past
    /// it the queue's own thread serves the request (default 1024).
    #[arg(long, value_name = "N")]
    pub worker_queue_depth: Option<usize>,
    #[arg(long, value_enum, default_value = "info")]
    pub log_level: LogLevel,
    /// Log to syslog (/dev/log) instead of stderr.
    #[arg(long)]
    pub syslog: bool,
    /// Offer a DAX window (vhost-user SHMEM) to the VMM.
    #[arg(long, value_enum, default_value = "on")]
    pub dax: OnOff,
    /// DAX policy document (JSON, or YAML by extension): window size, mapping
    /// granularity, which files get DAX. Default: see docs/policies.md.
    #[arg(long, value_name = "FILE")]
    pub dax_policy: Option<PathBuf>,
    /// Control socket (HTTP/1.1 + JSON, mode 0600) for reading and replacing
    /// the DAX policy while the guest runs; see docs/virtiofs.md. Default:
    /// `<vhost-user socket>.control`, the path the VMM looks for when its
    /// fs device names none (so Kata, which cannot name one, gets it).
    #[arg(long, value_name = "PATH", conflicts_with = "no_control_socket")]
    pub control_socket: Option<PathBuf>,
    /// Serve no control socket.
    #[arg(long)]
    pub no_control_socket: bool,
    /// Window size to declare, overriding the policy's cache_size (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Request queues served at most (the VMM's num_queues), plus the hiprio
    /// queue. Each is a thread, started with the daemon whether the guest
    /// uses it or not; 1, as virtiofsd serves and as Cloud Hypervisor and
    /// Kata ask (`num_queues=1`), so a guest costs no idle threads.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=63))]
    pub max_request_queues: u16,
    /// Open-file limit to set (every inode the guest holds is an fd); 0
    /// leaves it as it is; default: as high as the system allows.
    #[arg(long, value_name = "N")]
    pub rlimit_nofile: Option<u64>,
    /// Tell the guest which directories are other host mounts, so it gives
    /// each its own superblock (their inode numbers cannot collide).
    #[arg(long, overrides_with = "no_announce_submounts")]
    pub announce_submounts: bool,
    /// Do not tell the guest which directories are mounts (the default).
    #[arg(long)]
    pub no_announce_submounts: bool,
    /// Do not offer READDIRPLUS: the guest lists directories with READDIR
    /// and looks entries up one by one.
    #[arg(long)]
    pub no_readdirplus: bool,
    /// Offer FUSE_HANDLE_KILLPRIV_V2 (the default).
    #[arg(long, overrides_with = "no_killpriv_v2")]
    pub killpriv_v2: bool,
    /// Do not offer FUSE_HANDLE_KILLPRIV_V2: the guest clears setuid and
    /// setgid bits itself, with SETATTR.
    #[arg(long)]
    pub no_killpriv_v2: bool,
    /// Keep the guest's O_NOATIME on opens (the daemon always does).
    #[arg(long)]
    pub preserve_noatime: bool,
    /// Print the vhost-user backend capabilities (vhost-user.json) and exit.
    #[arg(long)]
    pub print_capabilities: bool,
    /// Log level debug (virtiofsd's old `-d`).
    #[arg(short = 'd')]
    pub compat_debug: bool,
    /// No effect: the daemon always runs in the foreground (virtiofsd's old `-f`).
    #[arg(short = 'f')]
    pub compat_foreground: bool,
    /// Options in the legacy virtiofsd form, comma-separated, as Kata and
    /// older configurations pass them: source=DIR, cache=, loglevel=,
    /// sandbox=, announce_submounts, xattr; see docs/virtiofs.md.
    #[arg(short = 'o', value_name = "OPT[,OPT...]")]
    pub compat_options: Vec<String>,
    /// Largest queue size accepted.
    #[arg(long, value_name = "N", default_value_t = 32768)]
    pub max_queue_size: u16,
    /// Answer the guest before the VMM acknowledges a map: unsafe (the
    /// guest may read zeros), for measuring only (`bench.sh roundtrip
    /// floor`). Exists only in a build with the `bench-unacked-maps`
    /// feature, and does nothing there unless given.
    #[cfg(feature = "bench-unacked-maps")]
    #[arg(long, hide = true)]
    pub bench_unacked_maps: bool,
    #[command(flatten)]
    pub virtiofsd: virtiofsd::VirtiofsdOnly,
}

fn parse_size(v: &str) -> Result<u64, String> {
    let json = match v.parse::<u64>() {
        Ok(n) => policies::Value::from(n),
        Err(_) => policies::Value::from(v),
    };
    policies::parse_size("--cache-size", &json).map_err(|e| e.to_string())
}

impl Cli {
    /// Checks what clap cannot: `-o` options folded into the flags they
    /// stand for, virtiofsd options this daemon does not implement, exactly
    /// one of `--socket-path` and `--fd`. An error here is a usage error
    /// (exit status 2).
    pub fn check(&mut self) -> Result<(), String> {
        self.apply_compat_options()?;
        self.virtiofsd.refuse_unsupported()?;
        match (&self.socket_path, self.fd) {
            (Some(_), Some(_)) => {
                return Err("--socket-path and --fd are exclusive: give exactly one".into())
            }
            (None, None) => {
                return Err("--socket-path PATH or --fd N is required (exactly one)".into())
            }
            _ => {}
        }
        if self.compat_debug {
            self.log_level = LogLevel::Debug;
        }
        Ok(())
    }

    /// Folds `-o` options into the flags they stand for; virtiofsd's that
    /// this daemon does not implement are refused by name.
    fn apply_compat_options(&mut self) -> Result<(), String> {
        let options: Vec<String> = self
            .compat_options
            .iter()
            .flat_map(|o| o.split(','))
            .filter(|o| !o.is_empty())
            .map(String::from)
            .collect();
        for opt in &options {
            self.apply_compat_option(opt)?;
        }
        Ok(())
    }

    fn apply_compat_option(&mut self, opt: &str) -> Result<(), String> {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        match (key, value) {
            ("source", Some(dir)) => match &self.shared_dir {
                Some(given) if given != std::path::Path::new(dir) => {
                    return Err(format!(
                        "-o source={dir}: the shared directory is already {}",
                        given.display()
                    ))
                }
                _ => self.shared_dir = Some(PathBuf::from(dir)),
            },
            // virtiofsd spells never `none` here.
            ("cache", Some("none")) => self.cache = CacheArg::Never,
            ("cache", Some(v)) => {
                self.cache = CacheArg::from_str(v, false).map_err(|_| {
                    format!("-o cache={v}: expected none, never, metadata, auto or always")
                })?
            }
            ("loglevel", Some(v)) => {
                self.log_level = match v {
                    "debug" => LogLevel::Debug,
                    "info" => LogLevel::Info,
                    "warn" => LogLevel::Warn,
                    "err" => LogLevel::Error,
                    _ => {
                        return Err(format!(
                            "-o loglevel={v}: expected debug, info, warn or err"
                        ))
                    }
                }
            }
            ("sandbox", Some(v)) => {
                self.sandbox = match v {
                    "namespace" => SandboxArg::Namespace,
                    "chroot" => SandboxArg::Chroot,
                    _ => return Err(format!("-o sandbox={v}: expected namespace or chroot")),
                }
            }
            ("announce_submounts", None) => {
                self.announce_submounts = true;
                self.no_announce_submounts = false;
            }
            ("xattr", None) => {
                self.xattr = true;
                self.no_xattr = false;
            }
            ("no_xattr", None) => {
                self.xattr = false;
                self.no_xattr = true;
            }
            ("readdirplus", None) => self.no_readdirplus = false,
            ("no_readdirplus", None) => self.no_readdirplus = true,
            ("killpriv_v2", None) => {
                self.killpriv_v2 = true;
                self.no_killpriv_v2 = false;
            }
            ("no_killpriv_v2", None) => {
                self.killpriv_v2 = false;
                self.no_killpriv_v2 = true;
            }
            // What the daemon does anyway: no writeback cache, O_DIRECT not
            // honoured, no POSIX ACLs or security labels, no POSIX or BSD
            // locks served (the guest kernel keeps locks local).
            ("no_writeback" | "no_allow_direct_io" | "no_posix_acl", None)
            | ("no_security_label" | "no_posix_lock" | "no_flock", None) => {}
            ("xattrmap" | "modcaps", Some(_))
            | ("writeback" | "allow_direct_io" | "posix_acl" | "security_label", None) => {
                return Err(virtiofsd::refusal(&format!("-o {key}")))
            }
            _ => {
                return Err(format!(
                "-o {opt}: not a virtiofsd option (see docs/virtiofs.md for the -o options taken)"
            ))
            }
        }
        Ok(())
    }
}
