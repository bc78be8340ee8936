//! dax-fleet's etcd policy objects (`fleet::selection::parse_object`: selector, priority, policy) and the choice of each VM's effective one.
//!
//! The input is up to three (name, value) pairs separated by NUL bytes, as
//! keys under `<prefix>/policies/` could hold them. A valid object must
//! round-trip (written back from its parts it parses to itself, and its
//! normalized policy is a fixed point); an invalid one must say which
//! object; and `effective` must pick what its documented rule picks.
#![no_main]

use std::collections::BTreeMap;

use fleet::selection::{effective, matches, parse_object, Parsed};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fn check_one(name: &str, value: &[u8], rev: i64) -> Parsed {
    let parsed = parse_object(name, value, rev);
    match &parsed {
        Parsed::Valid(o) => {
            assert_eq!((o.name.as_str(), o.mod_revision), (name, rev));
            let policy = policies::Policy::from_value(&o.policy)
                .unwrap_or_else(|e| panic!("normalized policy {} refused: {e}", o.policy));
            assert_eq!(policy.to_value(), o.policy, "normalizing twice changed it");
            let again = json!({"selector": o.selector, "priority": o.priority, "policy": o.policy});
            let reparsed = parse_object(name, again.to_string().as_bytes(), rev);
            assert_eq!(reparsed, parsed, "{again} does not read back as itself");
        }
        Parsed::Invalid {
            name: n,
            error,
            mod_revision,
            ..
        } => {
            assert_eq!((n.as_str(), *mod_revision), (name, rev));
            let prefix = format!("policy object \"{name}\": ");
            assert!(
                error.starts_with(&prefix),
                "{error:?} does not name the object"
            );
        }
    }
    parsed
}

fuzz_target!(|data: &[u8]| {
    let parts: Vec<&[u8]> = data.split(|&b| b == 0).collect();
    let mut objects = BTreeMap::new();
    for (i, pair) in parts.chunks(2).take(3).enumerate() {
        let name = String::from_utf8_lossy(pair[0]).into_owned();
        let value = pair.get(1).copied().unwrap_or_default();
        let parsed = check_one(&name, value, i64::try_from(i).expect("at most 3") + 1);
        objects.insert(name, parsed);
    }
    // A VM labelled as the first valid selector asks, plus one more label.
    let mut labels: BTreeMap<String, String> = objects
        .values()
        .find_map(|p| match p {
            Parsed::Valid(o) => Some(o.selector.clone()),
            Parsed::Invalid { .. } => None,
        })
        .unwrap_or_default();
    labels.insert("tier".into(), "build".into());
    let e = effective(&objects, &labels);
    // The documented rule: the highest priority among matching valid
    // objects, ties to the lowest name; errors from every invalid object
    // whose selector (if readable) matches.
    let mut want: Option<&fleet::selection::PolicyObject> = None;
    let mut errors = Vec::new();
    for p in objects.values() {
        match p {
            Parsed::Valid(o) if matches(&o.selector, &labels) => {
                if want.is_none_or(|w| {
                    (o.priority, std::cmp::Reverse(&o.name))
                        > (w.priority, std::cmp::Reverse(&w.name))
                }) {
                    want = Some(o);
                }
            }
            Parsed::Valid(_) => {}
            Parsed::Invalid {
                selector, error, ..
            } => {
                if selector
                    .as_ref()
                    .is_none_or(|s| s.iter().all(|(k, v)| labels.get(k) == Some(v)))
                {
                    errors.push(error.as_str());
                }
            }
        }
    }
    assert_eq!(e.winner.map(|w| &w.name), want.map(|w| &w.name));
    assert_eq!(e.errors, errors);
    if let Some(w) = e.winner {
        assert!(matches(&w.selector, &labels));
    }
});
