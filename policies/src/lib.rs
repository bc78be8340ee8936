//! DAX policies: which files the virtio-fs daemon maps through the DAX
//! window, how big the window is and how finely it is mapped.
//!
//! A policy is a declarative document (JSON or YAML):
//!
//! ```json
//! { "cache_size": "1G", "window_granularity": "auto", "mode": "inode",
//!   "rules": [ { "max_size": "32K", "dax": false },
//!              { "path": "models/**", "dax": true } ],
//!   "default": true, "adaptive": { "pressure_high": "75%" } }
//! ```
//!
//! [`Policy::parse_json`] / [`Policy::parse_yaml`] validate it with errors
//! that name the field, the value and the limit; [`Evaluator`] answers
//! "DAX for this path and size?"; [`diff`] says what changes live and what
//! needs a remount or the device re-created.

mod adaptive;
mod diff;
mod eval;
mod parse;

pub use adaptive::Adaptive;
pub use diff::{diff, Change, Effect, PolicyDiff};
pub use eval::{Decision, Evaluator};
pub use parse::{parse_size, PolicyError};
/// A parsed document value (what [`parse_size`] reads).
pub use serde_json::Value;

/// How the daemon answers FUSE_ATTR_DAX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every regular file.
    Always,
    /// No file.
    Never,
    /// Per file, by the rules and then the default.
    Inode,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Always => "always",
            Mode::Never => "never",
            Mode::Inode => "inode",
        }
    }
}

/// One rule: every condition given must hold; the first matching rule wins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Glob relative to the share (`*` within a path component, `**` across).
    pub path: Option<String>,
    pub min_size: Option<u64>,
    pub max_size: Option<u64>,
    pub dax: bool,
}

/// The mapping alignment the daemon announces in FUSE_INIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// 2 MiB where the host file system caches the share in large folios
    /// (the daemon probes it at start), 4 KiB elsewhere.
    Auto,
    Fixed(u64),
}

impl Granularity {
    /// Bytes, with `auto` resolved by `large_folios`.
    pub fn resolve(self, large_folios: bool) -> u64 {
        match self {
            Granularity::Fixed(g) => g,
            Granularity::Auto if large_folios => MAX_GRANULARITY,
            Granularity::Auto => MIN_GRANULARITY,
        }
    }
}

impl std::fmt::Display for Granularity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Granularity::Auto => f.write_str("auto"),
            Granularity::Fixed(g) => write!(f, "{g}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Size of the DAX window in bytes.
    pub cache_size: u64,
    /// Mapping alignment announced in FUSE_INIT (`map_alignment`).
    pub window_granularity: Granularity,
    pub mode: Mode,
    pub rules: Vec<Rule>,
    /// The answer when no rule matches (mode `inode`).
    pub default: bool,
    /// How the daemon refines `default: true` at run time.
    pub adaptive: Adaptive,
}

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// Limits checked by validation. `cache_size`: what the VMM accepts too
/// ([`dax_abi::window_size_fits`]). The mapping alignment: from a host page
/// up to the guest's range, past which Linux turns DAX off.
pub const MIN_GRANULARITY: u64 = 4 * KIB;
pub const MAX_GRANULARITY: u64 = dax_abi::GUEST_RANGE_SIZE;
pub const MAX_RULES: usize = 100_000;

impl Default for Policy {
    /// A 1 GiB window (the guest spends ~1.5 % of it, 16 MiB, on `struct
    /// page`s), the mapping alignment the host file system suits, and DAX
    /// for every file except those under 32 KiB: each mapped file holds a
    /// whole 2 MiB range of the window, which small files would waste while
    /// gaining little over the page cache. The adaptive part keeps files
    /// whose working set does not fit, or that would waste ranges under
    /// pressure, off the window.
    fn default() -> Self {
        Policy {
            cache_size: GIB,
            window_granularity: Granularity::Auto,
            mode: Mode::Inode,
            rules: vec![Rule {
                path: None,
                min_size: None,
                max_size: Some(32 * KIB - 1),
                dax: false,
            }],
            default: true,
            adaptive: Adaptive::default(),
        }
    }
}
