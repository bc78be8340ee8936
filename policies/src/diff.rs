//! What changing from one policy to another does: some fields apply to the
//! next LOOKUP/GETATTR, `window_granularity` to the next mount (it is
//! announced in FUSE_INIT), `cache_size` only when the device is re-created
//! (the window is guest-physical memory the guest sized at boot).

use serde::{Deserialize, Serialize};

use crate::Policy;

/// When a changed policy field takes hold. Decided here, and sent as is
/// (`live`, `remount`, `recreate`) by the daemon's control socket and the
/// VMM's API (`control_protocol::PolicyChange`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    /// On the daemon's next answer: the next LOOKUP/GETATTR of each inode.
    Live,
    /// When the guest mounts the share again (`window_granularity`).
    Remount,
    /// Only when the fs device is removed and added again (`cache_size`).
    Recreate,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub field: &'static str,
    pub from: String,
    pub to: String,
    pub effect: Effect,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyDiff {
    pub changes: Vec<Change>,
}

impl PolicyDiff {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    #[cfg(test)]
    fn with_effect(&self, effect: Effect) -> impl Iterator<Item = &Change> {
        self.changes.iter().filter(move |c| c.effect == effect)
    }
}

pub fn diff(old: &Policy, new: &Policy) -> PolicyDiff {
    let mut changes = Vec::new();
    let mut push = |field, from: String, to: String, effect| {
        if from != to {
            changes.push(Change {
                field,
                from,
                to,
                effect,
            });
        }
    };
    push(
        "cache_size",
        old.cache_size.to_string(),
        new.cache_size.to_string(),
        Effect::Recreate,
    );
    push(
        "window_granularity",
        old.window_granularity.to_string(),
        new.window_granularity.to_string(),
        Effect::Remount,
    );
    push(
        "mode",
        old.mode.as_str().into(),
        new.mode.as_str().into(),
        Effect::Live,
    );
    if old.rules != new.rules {
        let (a, b) = (old.rules.len(), new.rules.len());
        // Same count, different content: say so rather than "3 rules -> 3 rules".
        let to = if a == b {
            format!("{b} rules (changed)")
        } else {
            format!("{b} rules")
        };
        push("rules", format!("{a} rules"), to, Effect::Live);
    }
    push(
        "default",
        old.default.to_string(),
        new.default.to_string(),
        Effect::Live,
    );
    for ((field, from), (_, to)) in old.adaptive.fields().into_iter().zip(new.adaptive.fields()) {
        push(field, from, to, Effect::Live);
    }
    PolicyDiff { changes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_field_has_its_effect() {
        let old = Policy::default();
        assert!(diff(&old, &old).is_empty());
        let new = Policy::parse_json(
            r#"{"cache_size": "2G", "window_granularity": "2M", "mode": "always", "default": false,
                "rules": [{"max_size": 100, "dax": false}], "adaptive": {"pressure_low": "40%"}}"#,
        )
        .unwrap();
        let d = diff(&old, &new);
        let fields: Vec<_> = d.changes.iter().map(|c| (c.field, c.effect)).collect();
        assert_eq!(
            fields,
            vec![
                ("cache_size", Effect::Recreate),
                ("window_granularity", Effect::Remount),
                ("mode", Effect::Live),
                ("rules", Effect::Live),
                ("default", Effect::Live),
                ("adaptive.pressure_low", Effect::Live),
            ]
        );
        assert_eq!(d.changes[1].from, "auto");
        assert_eq!(d.changes[5].to, "40%");
        assert_eq!(d.changes[0].from, "1073741824");
        assert_eq!(d.changes[0].to, "2147483648");
        assert_eq!(d.changes[3].to, "1 rules (changed)");
        assert_eq!(d.with_effect(Effect::Live).count(), 4);
    }
}
