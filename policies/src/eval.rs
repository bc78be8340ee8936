//! Answers "DAX for this file?" for a policy, fast enough for every LOOKUP
//! and GETATTR: path rules are compiled into one glob set, so a lookup
//! matches all globs at once and then takes the first rule (in policy order)
//! whose size bounds also hold.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

use crate::{Mode, Policy, Rule};

pub struct Evaluator {
    mode: Mode,
    default: bool,
    rules: Vec<Rule>,
    globs: GlobSet,
    /// Rule index of each glob in `globs`.
    glob_rule: Vec<usize>,
    /// Indices of rules without a path, in order.
    pathless: Vec<usize>,
}

impl Evaluator {
    /// Compiles a validated policy (globs were checked when it was parsed).
    pub fn new(policy: &Policy) -> Evaluator {
        let mut builder = GlobSetBuilder::new();
        let mut glob_rule = Vec::new();
        let mut pathless = Vec::new();
        for (i, r) in policy.rules.iter().enumerate() {
            match &r.path {
                Some(p) => {
                    // `*` stays within a path component; `**` crosses them.
                    if let Ok(g) = GlobBuilder::new(p).literal_separator(true).build() {
                        builder.add(g);
                        glob_rule.push(i);
                    }
                }
                None => pathless.push(i),
            }
        }
        Evaluator {
            mode: policy.mode,
            default: policy.default,
            rules: policy.rules.clone(),
            globs: builder.build().unwrap_or_else(|_| GlobSet::empty()),
            glob_rule,
            pathless,
        }
    }

    fn size_ok(rule: &Rule, size: u64) -> bool {
        rule.min_size.is_none_or(|m| size >= m) && rule.max_size.is_none_or(|m| size <= m)
    }

    /// Whether a regular file at `path` (relative to the share) of `size`
    /// bytes gets DAX.
    pub fn dax(&self, path: &str, size: u64) -> bool {
        match self.mode {
            Mode::Always => return true,
            Mode::Never => return false,
            Mode::Inode => {}
        }
        let path = path.trim_start_matches('/');
        let mut matched: Vec<usize> = self.globs.matches(path).into_iter().map(|g| self.glob_rule[g]).collect();
        matched.sort_unstable();
        // Merge the two ordered candidate lists; the first rule whose size
        // bounds hold decides.
        let (mut a, mut b) = (matched.iter().peekable(), self.pathless.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(&&x), Some(&&y)) if x < y => a.next(),
                (Some(_), Some(_)) | (None, Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, None) => return self.default,
            };
            let rule = &self.rules[*next.expect("peeked")];
            if Self::size_ok(rule, size) {
                return rule.dax;
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
        assert!(!e.dax("db/sub/x.wal", 10), "`*` does not cross '/', so rule 2 decides");
        assert!(e.dax("x.bin", 5), "rule 3");
        assert!(e.dax("x.bin", 50), "no rule: default");
        assert!(e.dax("/x.bin", 5), "a leading slash is ignored");
    }

    #[test]
    fn modes_override_rules() {
        assert!(policy(r#"{"mode": "always", "rules": [{"dax": false}]}"#).dax("a", 1));
        assert!(!policy(r#"{"mode": "never", "default": true}"#).dax("a", 1 << 30));
        assert!(!policy(r#"{"rules": [], "default": false}"#).dax("a", 1 << 30));
    }
}
