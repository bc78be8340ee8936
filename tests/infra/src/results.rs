//! Measurements from rig runs, written to `target/rig-results/<name>.md` so a
//! CI log or a closing note can quote them. Nothing here asserts on time.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crate::rig::{target_dir, Run};
use crate::RigError;

pub struct Results {
    name: String,
    rows: Vec<(String, String)>,
}

fn secs(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.2} s", d.as_secs_f64()))
        .unwrap_or_else(|| "n/a".into())
}

impl Results {
    pub fn new(name: &str) -> Self {
        Results {
            name: name.into(),
            rows: Vec::new(),
        }
    }

    pub fn record(&mut self, what: &str, value: impl Into<String>) {
        self.rows.push((what.into(), value.into()));
    }

    /// The standard timings of one run.
    pub fn record_run(&mut self, label: &str, run: &Run) {
        let mode = if run.nested {
            "emulated host (QEMU TCG) + nested KVM"
        } else {
            "host KVM"
        };
        self.record(&format!("{label}: mode"), mode);
        if let Some(cpus) = run.host_cpus {
            self.record(&format!("{label}: emulated host CPUs"), cpus.to_string());
        }
        if run.nested {
            self.record(
                &format!("{label}: L1 boot (QEMU start to its init)"),
                secs(run.l1_boot()),
            );
        }
        self.record(
            &format!("{label}: guest boot-to-init (VMM start to guest init)"),
            secs(run.guest_boot_to_init()),
        );
        if let Some(uptime) = run
            .guest_values()
            .get("init")
            .and_then(|v| v.strip_prefix("uptime="))
        {
            self.record(
                &format!("{label}: guest uptime at init (guest clock)"),
                format!("{uptime} s"),
            );
        }
        self.record(
            &format!("{label}: wall time (whole run)"),
            secs(Some(run.wall)),
        );
    }

    /// Runs that stalled and were booted again (see `rig::run_retrying_stall`).
    pub fn record_stalls(&mut self, logs: &[PathBuf]) {
        let logs: Vec<String> = logs.iter().map(|p| p.display().to_string()).collect();
        self.record(
            "stalled runs retried",
            if logs.is_empty() {
                "0".into()
            } else {
                format!("{} ({})", logs.len(), logs.join(", "))
            },
        );
    }

    pub fn path(&self) -> PathBuf {
        target_dir()
            .join("rig-results")
            .join(format!("{}.md", self.name))
    }

    pub fn save(&self) -> Result<PathBuf, RigError> {
        self.save_with("")
    }

    /// How a benchmark ends: saves the rows with `tables`, prints the
    /// tables and where they and `run`'s log are; an error when a
    /// measurement was `missing`.
    pub fn finish_bench(&self, tables: &str, missing: bool, run: &Run) -> Result<(), String> {
        let path = self.save_with(tables).map_err(|e| e.to_string())?;
        println!("{tables}");
        println!(
            "results: {}  log: {}",
            path.display(),
            run.log_path.display()
        );
        if missing {
            return Err(format!(
                "some measurements are missing; see the log\n{}",
                run.tail(60)
            ));
        }
        Ok(())
    }

    /// [`Self::save`], with `tables` (markdown, as the docs quote them)
    /// after the rows.
    pub fn save_with(&self, tables: &str) -> Result<PathBuf, RigError> {
        let mut text = format!(
            "# rig results: {}\n\n| measurement | value |\n|---|---|\n",
            self.name
        );
        for (k, v) in &self.rows {
            let _ = writeln!(text, "| {k} | {v} |");
        }
        eprintln!("{text}");
        if !tables.is_empty() {
            let _ = write!(text, "\n{tables}");
        }
        let path = self.path();
        let dir = path.parent().expect("has a parent");
        std::fs::create_dir_all(dir).map_err(|e| RigError::io(dir, e))?;
        std::fs::write(&path, &text).map_err(|e| RigError::io(&path, e))?;
        Ok(path)
    }
}

/// The nearest-rank position (1-based) of quantile `q` among `n` samples:
/// the smallest rank with at least `q` of the samples at or below it.
pub fn nearest_rank(n: usize, q: f64) -> usize {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "q is clamped to 0..=1, so the product is within 0..=n and fits usize"
    )]
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    rank.clamp(1, n.max(1))
}

/// One quantity over several runs or processes, `digits` decimals:
/// `mean (a / b / …; spread max - min)`, or `n/a` without values.
pub fn mean_and_spread(values: &[f64], digits: usize) -> String {
    if values.is_empty() {
        return "n/a".into();
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let each: Vec<String> = values.iter().map(|v| format!("{v:.digits$}")).collect();
    format!(
        "{mean:.digits$} ({}; spread {:.digits$})",
        each.join(" / "),
        max - min
    )
}

/// The `k=v` words of a marker's value (the first `=` splits; a word
/// without one is skipped).
pub fn marker_fields(line: &str) -> std::collections::HashMap<&str, &str> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{mean_and_spread, nearest_rank};

    #[test]
    fn mean_and_spread_names_each_value() {
        assert_eq!(
            mean_and_spread(&[1.0, 3.0], 1),
            "2.0 (1.0 / 3.0; spread 2.0)"
        );
        assert_eq!(mean_and_spread(&[5.0], 0), "5 (5; spread 0)");
        assert_eq!(mean_and_spread(&[], 0), "n/a");
    }

    #[test]
    fn nearest_rank_is_the_smallest_rank_covering_the_quantile() {
        assert_eq!(nearest_rank(10, 0.5), 5);
        assert_eq!(nearest_rank(10, 0.9), 9);
        assert_eq!(nearest_rank(10, 0.91), 10);
        assert_eq!(nearest_rank(10, 1.0), 10);
        assert_eq!(nearest_rank(10, 0.0), 1);
        assert_eq!(nearest_rank(1, 0.5), 1);
        assert_eq!(nearest_rank(10, 7.0), 10, "q is clamped");
        assert_eq!(nearest_rank(10, -1.0), 1, "q is clamped");
    }

    #[test]
    fn marker_fields_split_at_the_first_equals_sign() {
        let f = super::marker_fields("send=status=204 receive=status=204 max_gap_ms=1530 body= x");
        assert_eq!(f.get("send"), Some(&"status=204"));
        assert_eq!(f.get("max_gap_ms"), Some(&"1530"));
        assert_eq!(f.get("body"), Some(&""));
        assert_eq!(f.get("x"), None);
    }
}
