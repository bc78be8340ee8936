//! The JSON documents of a host drain, as etcd holds them, and the
//! placement rule. Every parse error names the field.
//!
//! - `<prefix>/drain/<host>` (the operator's): `{"selector": {labels},
//!   "destinations": ["h2", …]}`;
//! - `<prefix>/incoming/<destination>/<vm>` (the source agent's request):
//!   `{"from": "h1", "labels": {…}}`, which the destination's agent answers
//!   by adding `"receiver_url"` (a spare listens there) or `"error"`;
//! - `<prefix>/drain-status/<host>/<vm>` (the source agent's): `{"state":
//!   …, "destination": …, "error": …, "drain_revision": …}`;
//! - `<prefix>/adopted/<host>/<vm>` (the destination agent's): the spare
//!   that now holds a received VM, and its labels.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub type Labels = BTreeMap<String, String>;

/// Why a document was refused; the text names the document and the field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DocError {
    #[error("{doc}: not a JSON object: {reason}")]
    NotJson { doc: String, reason: String },
    #[error("{doc}: {field}: {reason}")]
    Field {
        doc: String,
        field: String,
        reason: String,
    },
}

fn field(doc: &str, field: impl Into<String>, reason: impl Into<String>) -> DocError {
    DocError::Field {
        doc: doc.to_string(),
        field: field.into(),
        reason: reason.into(),
    }
}

fn object(doc: &str, value: &[u8]) -> Result<Map<String, Value>, DocError> {
    let not_json = |reason: String| DocError::NotJson {
        doc: doc.to_string(),
        reason,
    };
    match serde_json::from_slice::<Value>(value) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(not_json(format!("{other} is not an object"))),
        Err(e) => Err(not_json(e.to_string())),
    }
}

fn only_fields(doc: &str, obj: &Map<String, Value>, accepted: &[&str]) -> Result<(), DocError> {
    match obj.keys().find(|k| !accepted.contains(&k.as_str())) {
        Some(k) => Err(field(
            doc,
            k.clone(),
            format!("unknown field (accepted: {})", accepted.join(", ")),
        )),
        None => Ok(()),
    }
}

/// A host name or VM name used as one etcd key component.
pub fn check_component(doc: &str, name: &str, v: &str) -> Result<(), DocError> {
    if v.is_empty() || v.contains('/') || v.len() > 253 {
        return Err(field(
            doc,
            name,
            format!("\"{v}\" must be 1 to 253 characters without '/'"),
        ));
    }
    Ok(())
}

fn labels(doc: &str, name: &str, v: Option<&Value>) -> Result<Labels, DocError> {
    let Some(v) = v else {
        return Ok(Labels::new());
    };
    let obj = v
        .as_object()
        .ok_or_else(|| field(doc, name, "must be an object of label: value strings"))?;
    obj.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(field(
                doc,
                format!("{name}.{k}"),
                format!("{v} is not a string"),
            )),
        })
        .collect()
}

fn string(doc: &str, name: &str, v: Option<&Value>) -> Result<Option<String>, DocError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(field(doc, name, format!("{other} is not a string"))),
    }
}

/// The most destinations one drain may name.
pub const MAX_DESTINATIONS: usize = 1000;

/// `<prefix>/drain/<host>`.
#[derive(Clone, Debug, PartialEq)]
pub struct DrainDoc {
    pub selector: Labels,
    pub destinations: Vec<String>,
}

impl DrainDoc {
    /// Reads the drain of `host`.
    pub fn parse(host: &str, value: &[u8]) -> Result<DrainDoc, DocError> {
        let doc = format!("drain of \"{host}\"");
        let obj = object(&doc, value)?;
        only_fields(&doc, &obj, &["selector", "destinations"])?;
        let selector = labels(&doc, "selector", obj.get("selector"))?;
        let list = obj
            .get("destinations")
            .ok_or_else(|| field(&doc, "destinations", "is required (a list of host names)"))?
            .as_array()
            .ok_or_else(|| field(&doc, "destinations", "must be a list of host names"))?;
        if list.is_empty() {
            return Err(field(&doc, "destinations", "must name at least one host"));
        }
        if list.len() > MAX_DESTINATIONS {
            return Err(field(
                &doc,
                "destinations",
                format!("{} hosts; at most {MAX_DESTINATIONS}", list.len()),
            ));
        }
        let mut destinations = Vec::new();
        for (i, d) in list.iter().enumerate() {
            let name = format!("destinations[{i}]");
            let d = d
                .as_str()
                .ok_or_else(|| field(&doc, &name, format!("{d} is not a host name")))?;
            check_component(&doc, &name, d)?;
            if d == host {
                return Err(field(&doc, &name, format!("\"{d}\" is the host drained")));
            }
            if destinations.iter().any(|x| x == d) {
                return Err(field(&doc, &name, format!("\"{d}\" is listed twice")));
            }
            destinations.push(d.to_string());
        }
        Ok(DrainDoc {
            selector,
            destinations,
        })
    }
}

/// `<prefix>/incoming/<destination>/<vm>`: the request, and the answer once
/// the destination gave one.
#[derive(Clone, Debug, PartialEq)]
pub struct Incoming {
    pub from: String,
    pub labels: Labels,
    pub answer: Option<Answer>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// A spare listens at this URL for the VM.
    Receiver(String),
    /// No receiver: why (no spare free, no `receive` section, …).
    Refused(String),
}

impl Incoming {
    pub fn parse(destination: &str, vm: &str, value: &[u8]) -> Result<Incoming, DocError> {
        let doc = format!("request for \"{vm}\" to \"{destination}\"");
        // The key's last components: they name keys this host writes.
        check_component(&doc, "the key's VM name", vm)?;
        check_component(&doc, "the key's host name", destination)?;
        let obj = object(&doc, value)?;
        only_fields(&doc, &obj, &["from", "labels", "receiver_url", "error"])?;
        let from = string(&doc, "from", obj.get("from"))?
            .ok_or_else(|| field(&doc, "from", "is required (the source host)"))?;
        check_component(&doc, "from", &from)?;
        let labels = labels(&doc, "labels", obj.get("labels"))?;
        let url = string(&doc, "receiver_url", obj.get("receiver_url"))?;
        let error = string(&doc, "error", obj.get("error"))?;
        let answer = match (url, error) {
            (Some(_), Some(_)) => {
                return Err(field(
                    &doc,
                    "receiver_url",
                    "and error: an answer has one or the other",
                ))
            }
            (Some(u), None) => Some(Answer::Receiver(u)),
            (None, Some(e)) => Some(Answer::Refused(e)),
            (None, None) => None,
        };
        Ok(Incoming {
            from,
            labels,
            answer,
        })
    }

    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({"from": self.from, "labels": self.labels});
        match &self.answer {
            Some(Answer::Receiver(u)) => v["receiver_url"] = Value::String(u.clone()),
            Some(Answer::Refused(e)) => v["error"] = Value::String(e.clone()),
            None => {}
        }
        v.to_string()
    }
}

/// Where one VM of a drained host stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// Selected; another migration goes first.
    Queued,
    /// A destination was asked for a receiver (or none had a spare free).
    WaitingReceiver,
    Migrating,
    /// The VM runs on `destination`; this host no longer manages it.
    Migrated,
    /// The VM still runs here; `error` says why it did not move.
    Failed,
}

/// `<prefix>/drain-status/<host>/<vm>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainStatus {
    pub state: State,
    pub destination: Option<String>,
    pub error: Option<String>,
    /// The mod revision of the drain key this status belongs to: a failed
    /// VM is tried again only under a newer one.
    pub drain_revision: i64,
}

impl DrainStatus {
    pub fn parse(vm: &str, value: &[u8]) -> Result<DrainStatus, DocError> {
        serde_json::from_slice(value).map_err(|e| DocError::NotJson {
            doc: format!("drain status of \"{vm}\""),
            reason: e.to_string(),
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// `<prefix>/adopted/<host>/<vm>`: a VM this host received, in which spare.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adopted {
    pub api_socket: PathBuf,
    pub labels: Labels,
    pub from: String,
}

impl Adopted {
    pub fn parse(vm: &str, value: &[u8]) -> Result<Adopted, DocError> {
        serde_json::from_slice(value).map_err(|e| DocError::NotJson {
            doc: format!("adopted VM \"{vm}\""),
            reason: e.to_string(),
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The placement rule: of `destinations`, leaving out those in `full`, the
/// one with the fewest VMs sent to it by this drain (`sent`: migrating or
/// migrated), ties going to the lowest name.
pub fn place<'a>(
    destinations: &'a [String],
    sent: &BTreeMap<String, usize>,
    full: &BTreeSet<String>,
) -> Option<&'a str> {
    destinations
        .iter()
        .filter(|d| !full.contains(*d))
        .min_by(|a, b| {
            let count = |d: &String| sent.get(d).copied().unwrap_or(0);
            count(a).cmp(&count(b)).then_with(|| a.cmp(b))
        })
        .map(String::as_str)
}

#[cfg(test)]
#[path = "doc_tests.rs"]
mod tests;
