//! From a JSON or YAML document to a validated [`Policy`]. Every error names
//! the field (`rules[2].min_size`), the value and what is accepted; nothing is
//! returned unless the whole document is valid.

use serde_json::{Map, Value};

use crate::{
    Adaptive, Granularity, Mode, Policy, Rule, MAX_GRANULARITY, MAX_RULES, MIN_GRANULARITY,
};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("not a valid {format} document: {message}")]
    Syntax {
        format: &'static str,
        message: String,
    },
    #[error("{field}: {message}")]
    Field { field: String, message: String },
}

pub(crate) fn field_err(field: &str, message: impl Into<String>) -> PolicyError {
    PolicyError::Field {
        field: field.into(),
        message: message.into(),
    }
}

/// Shows a value the way the user wrote it: strings quoted, others as JSON.
pub(crate) fn shown(v: &Value) -> String {
    v.to_string()
}

/// Bytes from an integer or a string with an optional K/M/G/T suffix (binary).
pub fn parse_size(field: &str, v: &Value) -> Result<u64, PolicyError> {
    let not_a_size = || {
        field_err(
            field,
            format!(
                "{} is not a size (bytes, or a number with K, M, G or T)",
                shown(v)
            ),
        )
    };
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(not_a_size),
        Value::String(s) => {
            let s = s.trim();
            let (digits, shift) = match s.char_indices().last() {
                Some((i, c)) if c.is_ascii_alphabetic() => {
                    let shift = match c.to_ascii_uppercase() {
                        'K' => 10,
                        'M' => 20,
                        'G' => 30,
                        'T' => 40,
                        _ => return Err(not_a_size()),
                    };
                    (&s[..i], shift)
                }
                _ => (s, 0),
            };
            let n: u64 = digits.parse().map_err(|_| not_a_size())?;
            n.checked_mul(1 << shift)
                .ok_or_else(|| field_err(field, format!("{} is too large", shown(v))))
        }
        _ => Err(not_a_size()),
    }
}

pub(crate) fn parse_bool(field: &str, v: &Value) -> Result<bool, PolicyError> {
    v.as_bool()
        .ok_or_else(|| field_err(field, format!("{} is not true or false", shown(v))))
}

pub(crate) fn check_keys(
    field: &str,
    obj: &Map<String, Value>,
    accepted: &[&str],
) -> Result<(), PolicyError> {
    for key in obj.keys() {
        if !accepted.contains(&key.as_str()) {
            let name = if field.is_empty() {
                key.clone()
            } else {
                format!("{field}.{key}")
            };
            return Err(field_err(
                &name,
                format!("unknown field (accepted: {})", accepted.join(", ")),
            ));
        }
    }
    Ok(())
}

impl Policy {
    pub fn parse_json(text: &str) -> Result<Policy, PolicyError> {
        let v: Value = serde_json::from_str(text).map_err(|e| PolicyError::Syntax {
            format: "JSON",
            message: e.to_string(),
        })?;
        Policy::from_value(&v)
    }

    pub fn parse_yaml(text: &str) -> Result<Policy, PolicyError> {
        let v: Value = serde_yaml::from_str(text).map_err(|e| PolicyError::Syntax {
            format: "YAML",
            message: e.to_string(),
        })?;
        Policy::from_value(&v)
    }

    /// Validates a parsed document. Fields left out take the default policy's values.
    pub fn from_value(v: &Value) -> Result<Policy, PolicyError> {
        let obj = v
            .as_object()
            .ok_or_else(|| field_err("policy", "must be an object"))?;
        check_keys(
            "",
            obj,
            &[
                "cache_size",
                "window_granularity",
                "mode",
                "rules",
                "default",
                "adaptive",
            ],
        )?;
        let mut p = Policy::default();
        if let Some(v) = obj.get("cache_size") {
            p.cache_size = parse_size("cache_size", v)?;
            if !dax_abi::window_size_fits(p.cache_size) {
                return Err(field_err(
                    "cache_size",
                    format!(
                        "{} must be a multiple of {} MiB between {} and {}",
                        shown(v),
                        dax_abi::GUEST_RANGE_SIZE >> 20,
                        dax_abi::size_text(dax_abi::MIN_WINDOW_SIZE),
                        dax_abi::size_text(dax_abi::MAX_WINDOW_SIZE)
                    ),
                ));
            }
        }
        if let Some(v) = obj.get("window_granularity") {
            p.window_granularity = if v.as_str() == Some("auto") {
                Granularity::Auto
            } else {
                let g = parse_size("window_granularity", v).map_err(|_| {
                    field_err(
                        "window_granularity",
                        format!("{} is not auto or a size", shown(v)),
                    )
                })?;
                if !g.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) {
                    return Err(field_err(
                        "window_granularity",
                        format!(
                            "{} must be auto or a power of two from {} to {}",
                            shown(v),
                            dax_abi::size_text(MIN_GRANULARITY),
                            dax_abi::size_text(MAX_GRANULARITY)
                        ),
                    ));
                }
                Granularity::Fixed(g)
            };
        }
        if let Some(v) = obj.get("adaptive") {
            p.adaptive = Adaptive::from_value(v)?;
        }
        if let Some(v) = obj.get("mode") {
            p.mode = match v.as_str() {
                Some("always") => Mode::Always,
                Some("never") => Mode::Never,
                Some("inode") => Mode::Inode,
                _ => {
                    return Err(field_err(
                        "mode",
                        format!("{} is not always, never or inode", shown(v)),
                    ))
                }
            };
        }
        if let Some(v) = obj.get("default") {
            p.default = parse_bool("default", v)?;
        }
        if let Some(v) = obj.get("rules") {
            let list = v
                .as_array()
                .ok_or_else(|| field_err("rules", "must be a list"))?;
            if list.len() > MAX_RULES {
                return Err(field_err(
                    "rules",
                    format!("{} rules; at most {MAX_RULES}", list.len()),
                ));
            }
            p.rules = list
                .iter()
                .enumerate()
                .map(|(i, r)| parse_rule(i, r))
                .collect::<Result<_, _>>()?;
        }
        Ok(p)
    }
}

impl Policy {
    /// The document form of a policy: what [`Policy::from_value`] reads back
    /// to the same policy (sizes in bytes).
    pub fn to_value(&self) -> Value {
        let rules: Vec<Value> = self
            .rules
            .iter()
            .map(|r| {
                let mut o = Map::new();
                if let Some(p) = &r.path {
                    o.insert("path".into(), p.clone().into());
                }
                if let Some(v) = r.min_size {
                    o.insert("min_size".into(), v.into());
                }
                if let Some(v) = r.max_size {
                    o.insert("max_size".into(), v.into());
                }
                o.insert("dax".into(), r.dax.into());
                Value::Object(o)
            })
            .collect();
        serde_json::json!({
            "cache_size": self.cache_size,
            "window_granularity": match self.window_granularity {
                Granularity::Auto => Value::from("auto"),
                Granularity::Fixed(g) => Value::from(g),
            },
            "mode": self.mode.as_str(),
            "rules": rules,
            "default": self.default,
            "adaptive": self.adaptive.to_value(),
        })
    }
}

fn parse_rule(i: usize, v: &Value) -> Result<Rule, PolicyError> {
    let field = format!("rules[{i}]");
    let obj = v
        .as_object()
        .ok_or_else(|| field_err(&field, "must be an object"))?;
    check_keys(&field, obj, &["path", "min_size", "max_size", "dax"])?;
    let path = match obj.get("path") {
        None => None,
        Some(Value::String(s)) => {
            let f = format!("{field}.path");
            if s.is_empty() {
                return Err(field_err(&f, "must not be empty"));
            }
            if s.starts_with('/') {
                return Err(field_err(
                    &f,
                    format!("\"{s}\" must be relative to the share"),
                ));
            }
            if s.split('/').any(|c| c == "..") {
                return Err(field_err(&f, format!("\"{s}\" must not contain \"..\"")));
            }
            globset::Glob::new(s)
                .map_err(|e| field_err(&f, format!("\"{s}\" is not a valid glob: {}", e.kind())))?;
            Some(s.clone())
        }
        Some(other) => {
            return Err(field_err(
                &format!("{field}.path"),
                format!("{} is not a string", shown(other)),
            ))
        }
    };
    let min_size = obj
        .get("min_size")
        .map(|v| parse_size(&format!("{field}.min_size"), v))
        .transpose()?;
    let max_size = obj
        .get("max_size")
        .map(|v| parse_size(&format!("{field}.max_size"), v))
        .transpose()?;
    if let (Some(min), Some(max)) = (min_size, max_size) {
        if min > max {
            return Err(field_err(
                &format!("{field}.min_size"),
                format!("{min} is larger than max_size {max}"),
            ));
        }
    }
    let dax = match obj.get("dax") {
        Some(v) => parse_bool(&format!("{field}.dax"), v)?,
        None => {
            return Err(field_err(
                &format!("{field}.dax"),
                "is required (true or false)",
            ))
        }
    };
    Ok(Rule {
        path,
        min_size,
        max_size,
        dax,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GIB, KIB, MIB};

    fn err(doc: &str) -> String {
        Policy::parse_json(doc).unwrap_err().to_string()
    }

    #[test]
    fn a_full_document_in_json_and_yaml() {
        let json = r#"{"cache_size": "2G", "window_granularity": 2097152, "mode": "inode",
            "rules": [{"path": "models/**", "min_size": "1M", "dax": true}, {"max_size": "32K", "dax": false}],
            "default": false}"#;
        let yaml = "cache_size: 2G\nwindow_granularity: 2097152\nmode: inode\nrules:\n  - path: \"models/**\"\n    min_size: 1M\n    dax: true\n  - max_size: 32K\n    dax: false\ndefault: false\n";
        let a = Policy::parse_json(json).unwrap();
        assert_eq!(a, Policy::parse_yaml(yaml).unwrap());
        assert_eq!(a.cache_size, 2 * GIB);
        assert_eq!(a.window_granularity, Granularity::Fixed(2 * MIB));
        assert_eq!(
            a.rules[0],
            Rule {
                path: Some("models/**".into()),
                min_size: Some(MIB),
                max_size: None,
                dax: true
            }
        );
        assert_eq!(a.rules[1].max_size, Some(32 * KIB));
        assert!(!a.default);
        assert_eq!(Policy::parse_json("{}").unwrap(), Policy::default());
    }

    #[test]
    fn documents_round_trip() {
        let p = Policy::parse_json(
            r#"{"cache_size": "2G", "mode": "inode", "rules": [{"path": "a/**", "min_size": "1M", "max_size": "2M", "dax": true}, {"dax": false}]}"#,
        )
        .unwrap();
        assert_eq!(Policy::from_value(&p.to_value()).unwrap(), p);
        assert_eq!(
            Policy::from_value(&Policy::default().to_value()).unwrap(),
            Policy::default()
        );
    }

    #[test]
    fn errors_name_field_value_and_limit() {
        let table = [
            (
                r#"{"rules": [{"dax": true}, {"dax": true}, {"min_size": "12Q", "dax": true}]}"#,
                r#"rules[2].min_size: "12Q" is not a size"#,
            ),
            (
                r#"{"cache_size": "1M"}"#,
                r#"cache_size: "1M" must be a multiple of 2 MiB between 2M and 256G"#,
            ),
            (
                r#"{"cache_size": "3M"}"#,
                "cache_size: \"3M\" must be a multiple of 2 MiB",
            ),
            (
                r#"{"window_granularity": "3K"}"#,
                r#"window_granularity: "3K" must be auto or a power of two from 4K to 2M"#,
            ),
            (
                r#"{"window_granularity": "4M"}"#,
                "window_granularity: \"4M\" must be auto or a power of two from 4K to 2M",
            ),
            (
                r#"{"window_granularity": "huge"}"#,
                "window_granularity: \"huge\" is not auto or a size",
            ),
            (
                r#"{"mode": "sometimes"}"#,
                r#"mode: "sometimes" is not always, never or inode"#,
            ),
            (
                r#"{"default": "yes"}"#,
                r#"default: "yes" is not true or false"#,
            ),
            (
                r#"{"rules": [{"path": "/etc/*", "dax": true}]}"#,
                "rules[0].path: \"/etc/*\" must be relative to the share",
            ),
            (
                r#"{"rules": [{"path": "a/../b", "dax": true}]}"#,
                "rules[0].path: \"a/../b\" must not contain \"..\"",
            ),
            (
                r#"{"rules": [{"path": "a[", "dax": true}]}"#,
                "rules[0].path: \"a[\" is not a valid glob",
            ),
            (
                r#"{"rules": [{"min_size": 10, "max_size": 5, "dax": true}]}"#,
                "rules[0].min_size: 10 is larger than max_size 5",
            ),
            (r#"{"rules": [{"path": "x"}]}"#, "rules[0].dax: is required"),
            (
                r#"{"rules": [{"dax": true, "size": 1}]}"#,
                "rules[0].size: unknown field (accepted: path, min_size, max_size, dax)",
            ),
            (r#"{"cache": 1}"#, "cache: unknown field"),
            (r#"{"rules": {}}"#, "rules: must be a list"),
            (
                r#"{"cache_size": "99999999999T"}"#,
                "cache_size: \"99999999999T\" is too large",
            ),
            (r#"{"cache_size": -1}"#, "cache_size: -1 is not a size"),
            ("[1]", "policy: must be an object"),
            ("{", "not a valid JSON document"),
        ];
        for (doc, expect) in table {
            let e = err(doc);
            assert!(
                e.starts_with(expect),
                "{doc}\n  got:  {e}\n  want: {expect}"
            );
        }
        assert!(Policy::parse_yaml("mode: [")
            .unwrap_err()
            .to_string()
            .starts_with("not a valid YAML document"));
    }
}
