//! The daemon's DAX policy: which files get `FUSE_ATTR_DAX`, the window
//! size it declares and the mapping alignment it announces. Swapped whole
//! (a new policy is parsed and validated before it replaces the old one, so
//! a bad policy changes nothing); readers take an `Arc` of the current one.
//!
//! Files the policy's `default` gives DAX are then asked of the adaptive
//! part ([`AdaptiveDax`]), which watches the window; explicit rules and the
//! `always`/`never` modes are final.

use std::path::Path;
use std::sync::{Arc, RwLock};

use policies::{Evaluator, Mode, Policy};

use crate::dax::adaptive::AdaptiveDax;
use crate::dax::WindowUse;
use crate::host_fs::HostFs;
use crate::passthrough::DaxDecision;

pub struct LoadedPolicy {
    pub policy: Policy,
    evaluator: Evaluator,
    pub generation: u64,
    /// `window_granularity`, `auto` resolved for the host file system.
    map_alignment: u64,
}

impl LoadedPolicy {
    /// log2 of the mapping alignment, as FUSE_INIT's `map_alignment`.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a u64 has at most 64 trailing zeros"
    )]
    pub fn map_alignment_log2(&self) -> u16 {
        self.map_alignment.trailing_zeros() as u16
    }

    pub fn map_alignment(&self) -> u64 {
        self.map_alignment
    }
}

pub struct DaxPolicy {
    current: RwLock<Arc<LoadedPolicy>>,
    /// What the shared directory's file system was found to be.
    pub host_fs: HostFs,
    pub adaptive: AdaptiveDax,
    /// The policy the daemon started with (`--dax-policy`, `--cache-size`):
    /// what `DELETE` goes back to.
    startup: Policy,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    #[error("--dax-policy {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("--dax-policy {path}: {source}")]
    Invalid {
        path: String,
        source: policies::PolicyError,
    },
}

/// The passthrough layer asks the policy in force now.
impl DaxDecision for DaxPolicy {
    fn dax(&self, nodeid: u64, path: &dyn Fn() -> String, size: u64) -> bool {
        let cur = self.current();
        match cur.policy.mode {
            Mode::Always => true,
            Mode::Never => false,
            Mode::Inode => {
                let path = path();
                let d = cur.evaluator.decide(&path, size);
                if d.by_default && d.dax {
                    self.adaptive.decide(nodeid, size, &|| path.clone())
                } else {
                    d.dax
                }
            }
        }
    }

    fn forget(&self, nodeid: u64) {
        self.adaptive.forget(nodeid);
    }

    fn reset(&self) {
        self.adaptive.reset();
    }
}

/// What the VMM mapped and unmapped feeds the adaptive part.
impl WindowUse for DaxPolicy {
    fn mapped(&self, nodeid: u64, moffset: u64, len: u64) {
        self.adaptive.mapped(nodeid, moffset, len);
    }

    fn unmapped(&self, moffset: u64, len: u64) {
        self.adaptive.unmapped(moffset, len);
    }
}

impl DaxPolicy {
    /// On a host file system of unknown kind (tests): `auto` granularity is 4 KiB.
    pub fn new(policy: Policy) -> Self {
        Self::for_host(policy, HostFs::unknown())
    }

    /// `policy.cache_size` is the window the adaptive part watches.
    pub fn for_host(policy: Policy, host_fs: HostFs) -> Self {
        let adaptive = AdaptiveDax::new(policy.adaptive.clone(), policy.cache_size);
        let startup = policy.clone();
        let loaded = Self::load(policy, 1, &host_fs);
        DaxPolicy {
            current: RwLock::new(Arc::new(loaded)),
            host_fs,
            adaptive,
            startup,
        }
    }

    /// The policy the daemon started with.
    pub fn startup(&self) -> Policy {
        self.startup.clone()
    }

    fn load(policy: Policy, generation: u64, host_fs: &HostFs) -> LoadedPolicy {
        LoadedPolicy {
            evaluator: Evaluator::new(&policy),
            map_alignment: policy.window_granularity.resolve(host_fs.large_folios),
            policy,
            generation,
        }
    }

    /// Reads a JSON (or, by extension, YAML) policy document.
    pub fn from_file(path: &Path) -> Result<Policy, PolicyFileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| PolicyFileError::Read {
            path: shown.clone(),
            source,
        })?;
        let yaml = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        );
        let parsed = if yaml {
            Policy::parse_yaml(&text)
        } else {
            Policy::parse_json(&text)
        };
        parsed.map_err(|source| PolicyFileError::Invalid {
            path: shown,
            source,
        })
    }

    pub fn current(&self) -> Arc<LoadedPolicy> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the policy atomically; returns the new generation.
    pub fn replace(&self, policy: Policy) -> u64 {
        let mut cur = self.current.write().unwrap_or_else(|p| p.into_inner());
        let generation = cur.generation + 1;
        self.adaptive.set_tuning(policy.adaptive.clone());
        *cur = Arc::new(Self::load(policy, generation, &self.host_fs));
        generation
    }
}
