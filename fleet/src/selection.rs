//! Policy objects (`<prefix>/policies/<name>`) and which one a VM gets.
//!
//! ```json
//! {"selector": {"tier": "build"}, "priority": 10, "policy": {…a policy document…}}
//! ```
//!
//! A selector matches a VM when every pair is among its labels (`{}`
//! matches every VM). A VM's effective policy is the matching valid object
//! with the highest priority, ties going to the lowest name. An invalid
//! object applies nothing; it is reported in the status of every VM its
//! selector matches (of every VM, when not even its selector can be read).

use std::collections::BTreeMap;

use policies::Policy;
use serde_json::Value;

/// A valid policy object.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyObject {
    pub name: String,
    pub selector: BTreeMap<String, String>,
    pub priority: i64,
    /// The document, normalized (what the daemon reports back).
    pub policy: Value,
    /// The etcd mod revision of the key.
    pub mod_revision: i64,
}

/// What an object's key held.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    Valid(PolicyObject),
    Invalid {
        name: String,
        /// None when the selector itself could not be read.
        selector: Option<BTreeMap<String, String>>,
        error: String,
        mod_revision: i64,
    },
}

impl Parsed {
    pub fn name(&self) -> &str {
        match self {
            Parsed::Valid(o) => &o.name,
            Parsed::Invalid { name, .. } => name,
        }
    }
}

fn parse_selector(v: Option<&Value>) -> Result<BTreeMap<String, String>, String> {
    let Some(v) = v else {
        return Ok(BTreeMap::new());
    };
    let obj = v
        .as_object()
        .ok_or("selector: must be an object of label: value strings")?;
    obj.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(format!("selector.{k}: {v} is not a string")),
        })
        .collect()
}

/// Reads the value of `<prefix>/policies/<name>`.
pub fn parse_object(name: &str, value: &[u8], mod_revision: i64) -> Parsed {
    let invalid = |selector, error: String| Parsed::Invalid {
        name: name.to_string(),
        selector,
        error: format!("policy object \"{name}\": {error}"),
        mod_revision,
    };
    if name.is_empty() || name.contains('/') {
        return invalid(
            None,
            "the name must be one key component, without '/'".into(),
        );
    }
    let doc: Value = match serde_json::from_slice(value) {
        Ok(v) => v,
        Err(e) => return invalid(None, format!("not a JSON object: {e}")),
    };
    let Some(obj) = doc.as_object() else {
        return invalid(None, "must be a JSON object".into());
    };
    let selector = match parse_selector(obj.get("selector")) {
        Ok(s) => s,
        Err(e) => return invalid(None, e),
    };
    let sel = Some(selector.clone());
    if let Some(k) = obj
        .keys()
        .find(|k| !["selector", "priority", "policy"].contains(&k.as_str()))
    {
        return invalid(
            sel,
            format!("{k}: unknown field (accepted: selector, priority, policy)"),
        );
    }
    let priority = match obj.get("priority") {
        None => 0,
        Some(v) => match v.as_i64() {
            Some(p) => p,
            None => return invalid(sel, format!("priority: {v} is not a whole number")),
        },
    };
    let Some(policy) = obj.get("policy") else {
        return invalid(sel, "policy: is required (a policy document)".into());
    };
    match Policy::from_value(policy) {
        Ok(p) => Parsed::Valid(PolicyObject {
            name: name.to_string(),
            selector,
            priority,
            policy: p.to_value(),
            mod_revision,
        }),
        Err(e) => invalid(sel, format!("policy.{e}")),
    }
}

pub fn matches(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A VM's effective object, and the invalid objects that match it.
#[derive(Debug, PartialEq)]
pub struct Effective<'a> {
    pub winner: Option<&'a PolicyObject>,
    pub errors: Vec<&'a str>,
}

/// `objects` by name.
pub fn effective<'a>(
    objects: &'a BTreeMap<String, Parsed>,
    labels: &BTreeMap<String, String>,
) -> Effective<'a> {
    let mut winner: Option<&PolicyObject> = None;
    let mut errors = Vec::new();
    // Names ascend: on equal priority the first seen stays.
    for parsed in objects.values() {
        match parsed {
            Parsed::Valid(o) if matches(&o.selector, labels) => {
                if winner.is_none_or(|w| o.priority > w.priority) {
                    winner = Some(o);
                }
            }
            Parsed::Valid(_) => {}
            Parsed::Invalid {
                selector, error, ..
            } => {
                if selector.as_ref().is_none_or(|s| matches(s, labels)) {
                    errors.push(error.as_str());
                }
            }
        }
    }
    Effective { winner, errors }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn objects(list: &[(&str, &str)]) -> BTreeMap<String, Parsed> {
        list.iter()
            .enumerate()
            .map(|(i, (n, v))| {
                (
                    n.to_string(),
                    parse_object(n, v.as_bytes(), i64::try_from(i + 1).unwrap()),
                )
            })
            .collect()
    }

    #[test]
    fn highest_priority_wins_and_ties_go_to_the_lowest_name() {
        let objs = objects(&[
            ("all", r#"{"selector": {}, "policy": {"mode": "never"}}"#),
            (
                "build-b",
                r#"{"selector": {"tier": "build"}, "priority": 10, "policy": {"mode": "always"}}"#,
            ),
            (
                "build-a",
                r#"{"selector": {"tier": "build"}, "priority": 10, "policy": {"default": false}}"#,
            ),
            (
                "storage",
                r#"{"selector": {"tier": "build", "team": "storage"}, "priority": 5, "policy": {}}"#,
            ),
        ]);
        let build = labels(&[("tier", "build"), ("team", "storage")]);
        let e = effective(&objs, &build);
        assert_eq!(e.winner.unwrap().name, "build-a");
        assert!(e.errors.is_empty());
        assert_eq!(
            e.winner.unwrap().policy["default"],
            false,
            "normalized document"
        );
        let web = labels(&[("tier", "web")]);
        assert_eq!(effective(&objs, &web).winner.unwrap().name, "all");
        let none = objects(&[("x", r#"{"selector": {"tier": "db"}, "policy": {}}"#)]);
        assert_eq!(effective(&none, &web).winner, None);
    }

    #[test]
    fn an_invalid_object_applies_nothing_and_is_reported_where_it_matches() {
        let objs = objects(&[
            ("good", r#"{"selector": {"tier": "build"}, "policy": {}}"#),
            (
                "bad",
                r#"{"selector": {"tier": "build"}, "priority": 99, "policy": {"rules": [{"min_size": "12Q", "dax": true}]}}"#,
            ),
            ("garbage", "{not json"),
            (
                "elsewhere",
                r#"{"selector": {"tier": "db"}, "policy": {"mode": 3}}"#,
            ),
        ]);
        let e = effective(&objs, &labels(&[("tier", "build")]));
        assert_eq!(
            e.winner.unwrap().name,
            "good",
            "the invalid one outranks it but applies nothing"
        );
        assert_eq!(e.errors.len(), 2, "{:?}", e.errors);
        assert!(e.errors.iter().any(|m| m
            .starts_with(r#"policy object "bad": policy.rules[0].min_size: "12Q" is not a size"#)));
        assert!(e
            .errors
            .iter()
            .any(|m| m.starts_with(r#"policy object "garbage": not a JSON object"#)));
    }

    #[test]
    fn object_errors_name_the_field() {
        for (doc, want) in [
            (
                r#"{"selector": {"a": 1}, "policy": {}}"#,
                "selector.a: 1 is not a string",
            ),
            (
                r#"{"priority": "high", "policy": {}}"#,
                r#"priority: "high" is not a whole number"#,
            ),
            (r#"{"selector": {}}"#, "policy: is required"),
            (r#"{"policy": {}, "prio": 1}"#, "prio: unknown field"),
            (r#"[1]"#, "must be a JSON object"),
        ] {
            let Parsed::Invalid { error, .. } = parse_object("p", doc.as_bytes(), 1) else {
                panic!("{doc} parsed");
            };
            let want = format!("policy object \"p\": {want}");
            assert!(
                error.starts_with(&want),
                "{doc}\n  got:  {error}\n  want: {want}"
            );
        }
        assert!(matches!(
            parse_object("a/b", b"{}", 1),
            Parsed::Invalid { .. }
        ));
    }
}
