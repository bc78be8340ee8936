//! The daemon's DAX policy: which files get `FUSE_ATTR_DAX`, the window
//! size it declares and the mapping alignment it announces. Swapped whole
//! (a new policy is parsed and validated before it replaces the old one, so
//! a bad policy changes nothing); readers take an `Arc` of the current one.

use std::path::Path;
use std::sync::{Arc, RwLock};

use policies::{Evaluator, Mode, Policy};

use crate::passthrough::DaxDecision;

pub struct LoadedPolicy {
    pub policy: Policy,
    evaluator: Evaluator,
    pub generation: u64,
}

impl LoadedPolicy {
    /// Whether a regular file gets DAX; `path` is only asked for when a
    /// rule could depend on it.
    pub fn dax(&self, path: impl FnOnce() -> String, size: u64) -> bool {
        match self.policy.mode {
            Mode::Always => true,
            Mode::Never => false,
            Mode::Inode => self.evaluator.dax(&path(), size),
        }
    }

    /// log2 of the mapping alignment, as FUSE_INIT's `map_alignment`.
    pub fn map_alignment_log2(&self) -> u16 {
        self.policy.window_granularity.trailing_zeros() as u16
    }
}

pub struct DaxPolicy {
    current: RwLock<Arc<LoadedPolicy>>,
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
    fn dax(&self, path: &dyn Fn() -> String, size: u64) -> bool {
        self.current().dax(path, size)
    }
}

impl DaxPolicy {
    pub fn new(policy: Policy) -> Self {
        DaxPolicy {
            current: RwLock::new(Arc::new(Self::load(policy, 1))),
        }
    }

    fn load(policy: Policy, generation: u64) -> LoadedPolicy {
        LoadedPolicy {
            evaluator: Evaluator::new(&policy),
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
        *cur = Arc::new(Self::load(policy, generation));
        generation
    }
}
