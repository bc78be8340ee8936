//! The daemon's control socket (`dax-virtiofsd --control-socket`): JSON over
//! HTTP/1.1 on a unix socket. These types are the messages; the daemon
//! serializes them and the VMM's API parses them, so the two cannot drift
//! apart (an effect is an enum, not a string compared on both sides).
//!
//! | request | answer |
//! |---|---|
//! | `GET` [`POLICY`] | [`PolicyState`] |
//! | `PUT` [`POLICY`]`[?dry_run=true]` (a policy document) | [`PolicyUpdate`]; 400 with the message naming the field for an invalid one |
//! | `DELETE` [`POLICY`] | [`PolicyUpdate`] (back to the default policy) |
//! | `GET` [`STATS`] | [`DaemonStats`] |

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const POLICY: &str = "/api/v1/policy";
pub const STATS: &str = "/api/v1/stats";

/// The policy in force and its generation (1 at start, +1 per change).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    pub generation: u64,
    /// The policy document, normalized (every field filled).
    pub policy: Value,
}

/// When a changed policy field takes hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    /// At the next LOOKUP/GETATTR of each inode.
    Live,
    /// When the guest mounts the share again (`window_granularity`).
    Remount,
    /// Only when the device is created again (`cache_size`).
    Recreate,
}

/// One changed field of a policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyChange {
    /// The field's path in the document (`rules[1].min_size`).
    pub field: String,
    /// The old and new values, as the policy document spells them.
    pub from: String,
    pub to: String,
    pub effect: Effect,
}

/// The answer to a PUT or DELETE: the generation in force afterwards (the
/// same one when nothing changed or on a dry run) and what changed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyUpdate {
    pub generation: u64,
    pub applied: bool,
    pub changes: Vec<PolicyChange>,
}

/// The daemon's counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DaemonStats {
    pub requests: u64,
    pub errors: u64,
    pub fuse_reads: u64,
    pub fuse_read_bytes: u64,
    pub fuse_writes: u64,
    pub fuse_write_bytes: u64,
    pub setupmappings: u64,
    pub removemappings: u64,
    pub dax_failures: u64,
    pub inodes: u64,
    pub policy_generation: u64,
    pub file_attrs_dax: u64,
    pub file_attrs_nodax: u64,
    pub handles: u64,
    /// Requests refused at a cap, by cap name (`inodes`, `handles`, ...).
    pub cap_refusals: BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_back_as_written() {
        let update = PolicyUpdate {
            generation: 3,
            applied: true,
            changes: vec![PolicyChange {
                field: "cache_size".into(),
                from: "1G".into(),
                to: "2G".into(),
                effect: Effect::Recreate,
            }],
        };
        let text = serde_json::to_string(&update).unwrap();
        assert!(text.contains(r#""effect":"recreate""#), "{text}");
        assert_eq!(serde_json::from_str::<PolicyUpdate>(&text).unwrap(), update);
        let stats = DaemonStats {
            cap_refusals: [("inodes".to_string(), 4)].into(),
            ..Default::default()
        };
        let back: DaemonStats =
            serde_json::from_str(&serde_json::to_string(&stats).unwrap()).unwrap();
        assert_eq!(back, stats);
        // A message missing a field is refused, not read as zero.
        assert!(serde_json::from_str::<DaemonStats>(r#"{"requests": 1}"#).is_err());
    }
}
