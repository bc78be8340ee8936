//! The `adaptive` section of a policy: how the daemon adjusts, at run time,
//! the DAX answer for files no rule names (those the policy's `default`
//! gives DAX). Explicit rules are never overridden.
//!
//! ```yaml
//! adaptive:
//!   enabled: true
//!   max_file_share: 50%   # a file larger than this share of the window starts without DAX
//!   pressure_high: 75%    # window occupancy at which the window is under pressure
//!   pressure_low: 50%     # occupancy below which pressure ends (after cool_down)
//!   cool_down: 10s
//!   small_file: 1M        # under pressure, smaller files get no new DAX
//!   thrash_reclaims: 16   # a file reclaimed this often (half its maps or more) loses DAX
//!   retry_after: 60s      # ...and gets it back after this, once pressure ended
//!   reread_factor: 4      # a file without DAX read through FUSE this many times its size regains it
//!   random_reads: 64      # ...or read at this many places out of sequence
//! ```

use serde_json::{json, Map, Value};

use crate::parse::{check_keys, field_err, parse_bool, parse_size, shown};
use crate::{PolicyError, GIB, MIB};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adaptive {
    pub enabled: bool,
    /// Percent of the window a file may be and still start with DAX.
    pub max_file_share: u8,
    /// Percent of the window's 2 MiB ranges mapped at which pressure starts.
    pub pressure_high: u8,
    /// Percent below which pressure ends, once `cool_down_ms` passed; at
    /// most `pressure_high`. Equal marks are one threshold, with the
    /// cool-down as the only hysteresis (pressure_high 100%, pressure_low
    /// 100%: pressure only while the window is full, and for cool_down
    /// after). A low mark above the high one would never be reached while
    /// the window is above the high mark, so it is refused.
    pub pressure_low: u8,
    pub cool_down_ms: u64,
    /// Under pressure, files below this many bytes get no new DAX: each
    /// would hold a whole 2 MiB range for less than its size.
    pub small_file: u64,
    /// Reclaims of a file's ranges after which it loses DAX (when they
    /// are also at least half of its maps).
    pub thrash_reclaims: u32,
    /// How long a file that lost DAX waits before it may get it back.
    pub retry_after_ms: u64,
    /// A file read through FUSE `reread_factor` times its size gains DAX
    /// even under pressure.
    pub reread_factor: u32,
    /// So does one read through FUSE at `random_reads` places that do not
    /// follow the read before: each is a round trip DAX would save.
    pub random_reads: u32,
}

impl Default for Adaptive {
    /// Pressure starts at 75 % so that it is seen before Linux's own
    /// reclaim, which starts when fewer than 20 % of the ranges are free
    /// ([`dax_abi::GUEST_RECLAIM_OCCUPANCY_PCT`]).
    fn default() -> Self {
        Adaptive {
            enabled: true,
            max_file_share: 50,
            pressure_high: 75,
            pressure_low: 50,
            cool_down_ms: 10_000,
            small_file: MIB,
            thrash_reclaims: 16,
            retry_after_ms: 60_000,
            reread_factor: 4,
            random_reads: 64,
        }
    }
}

/// Limits checked by validation.
pub const MAX_DURATION_MS: u64 = 24 * 3600 * 1000;
pub const MAX_THRASH_RECLAIMS: u32 = 1_000_000;
pub const MAX_REREAD_FACTOR: u32 = 1000;
pub const MAX_RANDOM_READS: u32 = 1_000_000;
pub const MAX_SMALL_FILE: u64 = GIB;

/// The section's fields, each as its full name in a policy (diffs name
/// fields that way); the key in the section is what follows `adaptive.`.
const FIELDS: &[&str] = &[
    "adaptive.enabled",
    "adaptive.max_file_share",
    "adaptive.pressure_high",
    "adaptive.pressure_low",
    "adaptive.cool_down",
    "adaptive.small_file",
    "adaptive.thrash_reclaims",
    "adaptive.retry_after",
    "adaptive.reread_factor",
    "adaptive.random_reads",
];

fn key(full: &'static str) -> &'static str {
    full.strip_prefix("adaptive.").unwrap_or(full)
}

/// A percentage: 75 or "75%", 1 to 100.
fn parse_percent(field: &str, v: &Value) -> Result<u8, PolicyError> {
    let bad = || {
        field_err(
            field,
            format!("{} is not a percentage from 1% to 100%", shown(v)),
        )
    };
    let n = match v {
        Value::Number(n) => n.as_u64().ok_or_else(bad)?,
        Value::String(s) => {
            let digits = s.strip_suffix('%').unwrap_or(s);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            digits.parse().map_err(|_| bad())?
        }
        _ => return Err(bad()),
    };
    match u8::try_from(n) {
        Ok(p @ 1..=100) => Ok(p),
        _ => Err(bad()),
    }
}

/// A duration: seconds as a number, or a string with ms, s, m or h.
fn parse_duration_ms(field: &str, v: &Value) -> Result<u64, PolicyError> {
    let bad = || {
        field_err(
            field,
            format!(
                "{} is not a duration up to 24h (seconds, or a number with ms, s, m or h)",
                shown(v)
            ),
        )
    };
    let ms = match v {
        Value::Number(n) => n.as_u64().and_then(|s| s.checked_mul(1000)),
        Value::String(s) => {
            let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (digits, unit) = s.split_at(split);
            let n: u64 = digits.parse().map_err(|_| bad())?;
            let scale = match unit {
                "ms" => 1,
                "" | "s" => 1000,
                "m" => 60_000,
                "h" => 3_600_000,
                _ => return Err(bad()),
            };
            n.checked_mul(scale)
        }
        _ => None,
    };
    ms.filter(|&ms| ms <= MAX_DURATION_MS).ok_or_else(bad)
}

fn parse_count(field: &str, v: &Value, max: u32) -> Result<u32, PolicyError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| {
            field_err(
                field,
                format!("{} is not a whole number from 1 to {max}", shown(v)),
            )
        })
}

impl Adaptive {
    /// Validates the `adaptive` object; fields left out keep their defaults.
    pub fn from_value(v: &Value) -> Result<Adaptive, PolicyError> {
        let obj = v
            .as_object()
            .ok_or_else(|| field_err("adaptive", "must be an object"))?;
        let keys: Vec<&str> = FIELDS.iter().map(|f| key(f)).collect();
        check_keys("adaptive", obj, &keys)?;
        let mut a = Adaptive::default();
        let f = |name: &str| format!("adaptive.{name}");
        for (key, v) in obj {
            let field = f(key);
            match key.as_str() {
                "enabled" => a.enabled = parse_bool(&field, v)?,
                "max_file_share" => a.max_file_share = parse_percent(&field, v)?,
                "pressure_high" => a.pressure_high = parse_percent(&field, v)?,
                "pressure_low" => a.pressure_low = parse_percent(&field, v)?,
                "cool_down" => a.cool_down_ms = parse_duration_ms(&field, v)?,
                "retry_after" => a.retry_after_ms = parse_duration_ms(&field, v)?,
                "small_file" => {
                    a.small_file = parse_size(&field, v)?;
                    if a.small_file > MAX_SMALL_FILE {
                        return Err(field_err(
                            &field,
                            format!("{} is larger than the limit, 1G", shown(v)),
                        ));
                    }
                }
                "thrash_reclaims" => {
                    a.thrash_reclaims = parse_count(&field, v, MAX_THRASH_RECLAIMS)?
                }
                "reread_factor" => a.reread_factor = parse_count(&field, v, MAX_REREAD_FACTOR)?,
                "random_reads" => a.random_reads = parse_count(&field, v, MAX_RANDOM_READS)?,
                _ => unreachable!("check_keys accepted only FIELDS"),
            }
        }
        if a.pressure_low > a.pressure_high {
            return Err(field_err(
                &f("pressure_low"),
                format!(
                    "{}% must not be above pressure_high ({}%)",
                    a.pressure_low, a.pressure_high
                ),
            ));
        }
        Ok(a)
    }

    /// The document form, which [`Adaptive::from_value`] reads back.
    pub fn to_value(&self) -> Value {
        json!({
            "enabled": self.enabled,
            "max_file_share": format!("{}%", self.max_file_share),
            "pressure_high": format!("{}%", self.pressure_high),
            "pressure_low": format!("{}%", self.pressure_low),
            "cool_down": format!("{}ms", self.cool_down_ms),
            "small_file": self.small_file,
            "thrash_reclaims": self.thrash_reclaims,
            "retry_after": format!("{}ms", self.retry_after_ms),
            "reread_factor": self.reread_factor,
            "random_reads": self.random_reads,
        })
    }

    /// `(field, value)` pairs, for diffs.
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        let Value::Object(map): Value = self.to_value() else {
            unreachable!("to_value builds an object")
        };
        let map: Map<String, Value> = map;
        FIELDS
            .iter()
            .map(|&full| {
                let v = &map[key(full)];
                (
                    full,
                    v.as_str().map_or_else(|| v.to_string(), str::to_string),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;

    fn err(doc: &str) -> String {
        Policy::parse_json(doc).unwrap_err().to_string()
    }

    #[test]
    fn equal_pressure_marks_are_one_threshold_and_accepted() {
        let p =
            Policy::parse_json(r#"{"adaptive": {"pressure_low": 100, "pressure_high": "100%"}}"#)
                .unwrap();
        assert_eq!(
            (p.adaptive.pressure_low, p.adaptive.pressure_high),
            (100, 100)
        );
        let p = Policy::parse_json(r#"{"adaptive": {"pressure_low": 75}}"#).unwrap();
        assert_eq!(p.adaptive.pressure_low, p.adaptive.pressure_high);
    }

    #[test]
    fn default_pressure_comes_before_the_guest_reclaims() {
        let d = Adaptive::default();
        assert!(u64::from(d.pressure_high) < dax_abi::GUEST_RECLAIM_OCCUPANCY_PCT);
        assert!(d.pressure_low < d.pressure_high);
    }

    #[test]
    fn fields_parse_in_their_units_and_round_trip() {
        let p = Policy::parse_yaml(
            "adaptive:\n  enabled: false\n  max_file_share: 25%\n  pressure_high: 90\n  pressure_low: \"60%\"\n  cool_down: 500ms\n  small_file: 512K\n  thrash_reclaims: 3\n  retry_after: 2m\n  reread_factor: 8\n  random_reads: 5\n",
        )
        .unwrap();
        let a = &p.adaptive;
        assert!(!a.enabled);
        assert_eq!(
            (a.max_file_share, a.pressure_high, a.pressure_low),
            (25, 90, 60)
        );
        assert_eq!((a.cool_down_ms, a.retry_after_ms), (500, 120_000));
        assert_eq!(a.small_file, 512 << 10);
        assert_eq!(
            (a.thrash_reclaims, a.reread_factor, a.random_reads),
            (3, 8, 5)
        );
        assert_eq!(Policy::from_value(&p.to_value()).unwrap(), p);
        assert_eq!(
            Policy::parse_json(r#"{"adaptive": {"cool_down": 3}}"#)
                .unwrap()
                .adaptive
                .cool_down_ms,
            3000
        );
        assert_eq!(
            Policy::parse_json("{}").unwrap().adaptive,
            Adaptive::default()
        );
    }

    #[test]
    fn errors_name_the_field_and_the_limit() {
        for (doc, want) in [
            (
                r#"{"adaptive": {"pressure_high": "120%"}}"#,
                r#"adaptive.pressure_high: "120%" is not a percentage from 1% to 100%"#,
            ),
            (
                r#"{"adaptive": {"pressure_low": 0}}"#,
                "adaptive.pressure_low: 0 is not a percentage",
            ),
            (
                r#"{"adaptive": {"pressure_low": 80}}"#,
                "adaptive.pressure_low: 80% must not be above pressure_high (75%)",
            ),
            (
                r#"{"adaptive": {"pressure_low": 100, "pressure_high": 99}}"#,
                "adaptive.pressure_low: 100% must not be above pressure_high (99%)",
            ),
            (
                r#"{"adaptive": {"cool_down": "5 days"}}"#,
                r#"adaptive.cool_down: "5 days" is not a duration up to 24h"#,
            ),
            (
                r#"{"adaptive": {"retry_after": "25h"}}"#,
                r#"adaptive.retry_after: "25h" is not a duration up to 24h"#,
            ),
            (
                r#"{"adaptive": {"thrash_reclaims": 0}}"#,
                "adaptive.thrash_reclaims: 0 is not a whole number from 1 to 1000000",
            ),
            (
                r#"{"adaptive": {"reread_factor": 2.5}}"#,
                "adaptive.reread_factor: 2.5 is not a whole number from 1 to 1000",
            ),
            (
                r#"{"adaptive": {"small_file": "2G"}}"#,
                r#"adaptive.small_file: "2G" is larger than the limit, 1G"#,
            ),
            (
                r#"{"adaptive": {"speed": 1}}"#,
                "adaptive.speed: unknown field (accepted: enabled, max_file_share",
            ),
            (r#"{"adaptive": true}"#, "adaptive: must be an object"),
        ] {
            let e = err(doc);
            assert!(e.starts_with(want), "{doc}\n  got:  {e}\n  want: {want}");
        }
    }
}
