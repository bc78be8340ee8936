//! Answers "DAX for this file?" for a policy, fast enough for every LOOKUP
//! and GETATTR even with thousands of rules.
//!
//! Rules are indexed by the literal directory their path glob starts with
//! (`logs/app/*.log` → `logs/app`; `**/*.tmp` and path-less rules → the
//! root). A lookup of `a/b/c.txt` only tests the rules filed under the root,
//! `a` and `a/b` — a glob that starts with a literal directory cannot match
//! a path outside it — in policy order, and the first rule whose glob and
//! size bounds hold decides. With rules spread over many directories, a
//! lookup tests a handful of globs instead of all of them.

use std::collections::HashMap;

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};

use crate::{Mode, Policy, Rule};

/// The path globs filed under one literal directory, compiled together (a
/// glob set matches simple shapes — extensions, literals, prefixes — by
/// hashing rather than one regex per glob).
struct Bucket {
    set: GlobSet,
    /// Rule index of each glob in `set`.
    rule_of: Vec<usize>,
}

/// An answer: DAX or not, and whether the policy's `default` gave it (no
/// rule matched, mode `inode`) — the answers the adaptive part may refine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub dax: bool,
    pub by_default: bool,
}

pub struct Evaluator {
    mode: Mode,
    default: bool,
    rules: Vec<Rule>,
    /// Literal directory prefix ("" for the root) → its globs.
    by_prefix: HashMap<String, Bucket>,
    /// Rules without a path condition, ascending.
    pathless: Vec<usize>,
}

/// The leading path components of a glob that contain no glob syntax, minus
/// the last component (which names the file, or is itself a pattern).
fn literal_dir_prefix(glob: &str) -> String {
    let glob = glob.trim_start_matches('/');
    let components: Vec<&str> = glob.split('/').collect();
    let is_literal = |c: &&str| !c.contains(['*', '?', '[', ']', '{', '}', '\\']);
    let literal: Vec<&str> = components[..components.len().saturating_sub(1)]
        .iter()
        .copied()
        .take_while(is_literal)
        .collect();
    literal.join("/")
}

fn compile(pattern: &str) -> Option<Glob> {
    // `*` stays within a path component; `**` crosses them.
    GlobBuilder::new(pattern.trim_start_matches('/'))
        .literal_separator(true)
        .build()
        .ok()
}

impl Evaluator {
    /// Compiles a validated policy (globs were checked when it was parsed;
    /// one that still fails to compile matches nothing).
    pub fn new(policy: &Policy) -> Evaluator {
        let mut builders: HashMap<String, (GlobSetBuilder, Vec<usize>)> = HashMap::new();
        let mut pathless = Vec::new();
        for (i, r) in policy.rules.iter().enumerate() {
            match &r.path {
                Some(p) => {
                    let Some(glob) = compile(p) else { continue };
                    let (b, rule_of) = builders
                        .entry(literal_dir_prefix(p))
                        .or_insert_with(|| (GlobSetBuilder::new(), Vec::new()));
                    b.add(glob);
                    rule_of.push(i);
                }
                None => pathless.push(i),
            }
        }
        let by_prefix = builders
            .into_iter()
            .map(|(prefix, (b, rule_of))| {
                (
                    prefix,
                    Bucket {
                        set: b.build().unwrap_or_else(|_| GlobSet::empty()),
                        rule_of,
                    },
                )
            })
            .collect();
        Evaluator {
            mode: policy.mode,
            default: policy.default,
            rules: policy.rules.clone(),
            by_prefix,
            pathless,
        }
    }

    fn size_ok(rule: &Rule, size: u64) -> bool {
        rule.min_size.is_none_or(|m| size >= m) && rule.max_size.is_none_or(|m| size <= m)
    }

    /// Whether a regular file at `path` (relative to the share) of `size`
    /// bytes gets DAX.
    pub fn dax(&self, path: &str, size: u64) -> bool {
        self.decide(path, size).dax
    }

    /// The answer and what gave it.
    pub fn decide(&self, path: &str, size: u64) -> Decision {
        let by = |dax, by_default| Decision { dax, by_default };
        match self.mode {
            Mode::Always => return by(true, false),
            Mode::Never => return by(false, false),
            Mode::Inode => {}
        }
        let path = path.trim_start_matches('/');
        // Rules whose glob matches, from the root's bucket and each ancestor
        // directory's: a glob starting with a literal directory cannot match
        // outside it.
        let mut matched = Vec::new();
        let mut collect = |prefix: &str| {
            if let Some(b) = self.by_prefix.get(prefix) {
                matched.extend(b.set.matches(path).into_iter().map(|g| b.rule_of[g]));
            }
        };
        collect("");
        for (i, _) in path.match_indices('/') {
            collect(&path[..i]);
        }
        matched.sort_unstable();
        // Merge with the path-less rules; the first rule, in policy order,
        // whose size bounds hold decides.
        let (mut a, mut b) = (matched.iter().peekable(), self.pathless.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(&&x), Some(&&y)) if x < y => a.next(),
                (Some(_), Some(_)) | (None, Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, None) => return by(self.default, true),
            };
            let rule = &self.rules[*next.expect("peeked")];
            if Self::size_ok(rule, size) {
                return by(rule.dax, false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KIB;

    fn policy(doc: &str) -> Evaluator {
        Evaluator::new(&Policy::parse_json(doc).unwrap())
    }

    #[test]
    fn default_policy_skips_small_files() {
        let e = Evaluator::new(&Policy::default());
        assert!(!e.dax("a.txt", 100));
        assert!(!e.dax("a.txt", 32 * KIB - 1));
        assert!(e.dax("a.txt", 32 * KIB));
        assert!(e.dax("deep/dir/big.bin", 1 << 30));
    }

    #[test]
    fn first_match_wins_across_path_and_size_rules() {
        let e = policy(
            r#"{"rules": [
                {"path": "db/*.wal", "dax": false},
                {"min_size": "1M", "dax": true},
                {"path": "db/**", "dax": false},
                {"path": "*.bin", "max_size": 10, "dax": true}
            ], "default": true}"#,
        );
        assert!(!e.dax("db/x.wal", 1 << 30), "rule 0 before the size rule");
        assert!(e.dax("db/big.dat", 2 << 20), "rule 1 before rule 2");
        assert!(!e.dax("db/small.dat", 10), "rule 2");
        assert!(
            !e.dax("db/sub/x.wal", 10),
            "`*` does not cross '/', so rule 2 decides"
        );
        assert!(e.dax("x.bin", 5), "rule 3");
        assert!(e.dax("x.bin", 50), "no rule: default");
        assert!(e.dax("/x.bin", 5), "a leading slash is ignored");
    }

    #[test]
    fn the_index_files_rules_under_their_literal_directory() {
        assert_eq!(literal_dir_prefix("logs/app/*.log"), "logs/app");
        assert_eq!(literal_dir_prefix("logs/**"), "logs");
        assert_eq!(literal_dir_prefix("**/*.tmp"), "");
        assert_eq!(literal_dir_prefix("*.bin"), "");
        assert_eq!(literal_dir_prefix("a/b*/c"), "a");
        assert_eq!(literal_dir_prefix("/abs/x"), "abs");
        assert_eq!(literal_dir_prefix("exact.txt"), "");
        // Rules in sibling, nested and root buckets keep policy order.
        let e = policy(
            r#"{"rules": [
                {"path": "a/b/**", "min_size": 100, "dax": true},
                {"path": "**/*.log", "dax": false},
                {"path": "a/**", "dax": true},
                {"path": "a/c/*", "dax": false},
                {"path": "exact.txt", "dax": true}
            ], "default": false}"#,
        );
        assert!(
            e.dax("a/b/x.log", 200),
            "rule 0 (nested bucket) before rule 1 (root)"
        );
        assert!(!e.dax("a/b/x.log", 50), "rule 0's size fails: rule 1");
        assert!(e.dax("a/c/d", 1), "rule 2 before rule 3");
        assert!(!e.dax("a/c.log", 1), "rule 1");
        assert!(e.dax("exact.txt", 1));
        assert!(
            !e.dax("sub/exact.txt", 1),
            "a literal name matches only at its own path"
        );
        assert!(!e.dax("b/x", 1), "default");
    }

    #[test]
    fn decisions_say_whether_the_default_gave_them() {
        let e = Evaluator::new(&Policy::default());
        assert_eq!(
            e.decide("a", 100),
            Decision {
                dax: false,
                by_default: false
            }
        );
        assert_eq!(
            e.decide("a", 1 << 20),
            Decision {
                dax: true,
                by_default: true
            }
        );
        assert!(!policy(r#"{"mode": "always"}"#).decide("a", 1).by_default);
    }

    #[test]
    fn modes_override_rules() {
        assert!(policy(r#"{"mode": "always", "rules": [{"dax": false}]}"#).dax("a", 1));
        assert!(!policy(r#"{"mode": "never", "default": true}"#).dax("a", 1 << 30));
        assert!(!policy(r#"{"rules": [], "default": false}"#).dax("a", 1 << 30));
    }
}
