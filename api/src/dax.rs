//! DAX endpoints, per fs device id:
//!
//! - `GET /api/v1/vm.dax-policy?id=` — the policy last accepted here, and
//!   what the device's daemon has in force (its generation and document);
//! - `PUT …?id=[&dry_run=true]` — validate (JSON or YAML), push to the
//!   daemon, answer what changed grouped by when it takes effect; a dry run
//!   answers the same and changes nothing;
//! - `DELETE …?id=` — back to the default policy;
//! - `GET /api/v1/vm.dax-metrics` — Prometheus text.
//!
//! An invalid policy is refused here, before any daemon sees it; a daemon
//! that refuses or cannot be reached leaves the accepted policy as it was.
//! Putting the same document again makes no new generation. `GET` answers
//! the daemon's generation as an `ETag`; a `PUT` or `DELETE` with
//! `If-Match` is refused with 412 unless the daemon is still at that
//! generation (a fleet tool's read-modify-write does not overwrite a
//! change it has not seen).
//!
//! The accepted (desired) policy is kept with the device's configuration
//! in the VMM (`vm.info` shows it as the fs device's `dax_policy`, and
//! `vm.add-fs` may give one), and [`reconcile`] compares it
//! with what each daemon has every [`RECONCILE_PERIOD`]: a daemon that was
//! restarted (and came back with its start-up policy) gets it again by
//! itself. `GET` shows how the last comparison went. The same loop relays
//! each daemon's adaptive-policy decisions into `vm.dax-events` ([`relay_adaptive`]).

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use control_protocol::{
    AdaptiveEvents, DaemonStats, Effect, PolicyChange, PolicyState, PolicyUpdate, ADAPTIVE_EVENTS,
    POLICY, STATS,
};
use policies::Policy;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::client;
use crate::events::DaxEvent;
use crate::metrics::{self, FsDaxStatus, PageFaults};
use crate::routes::AppState;
use crate::{control_socket_of, ApiError, VmmAction, VmmReply};

/// How often [`reconcile`] compares desired policies with the daemons'.
pub const RECONCILE_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// What the reconcile loop last found for one device.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReconcileState {
    /// Whether the daemon had the desired policy (after any re-push).
    pub in_sync: bool,
    /// Times the loop pushed the desired policy again.
    pub pushes: u64,
    /// Why the last comparison or push failed (daemon unreachable...).
    pub last_error: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicyQuery {
    id: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

impl PolicyQuery {
    fn id(&self) -> Result<&str, ApiError> {
        self.id.as_deref().ok_or_else(|| {
            ApiError::bad_request("vm.dax-policy: the query needs id=<fs device id>")
        })
    }
}

async fn dax_status(s: &AppState) -> Result<Vec<FsDaxStatus>, ApiError> {
    fs_devices(s, true).await
}

pub(crate) async fn fs_devices(
    s: &AppState,
    window_stats: bool,
) -> Result<Vec<FsDaxStatus>, ApiError> {
    match s.vmm.call(VmmAction::DaxStatus { window_stats }).await? {
        VmmReply::Dax(d) => Ok(d),
        other => Err(ApiError::internal(format!(
            "unexpected answer from the VMM: {other:?}"
        ))),
    }
}

/// Sends one request to a daemon's control socket; its answer as the
/// control protocol's type `T`, or a 502 that carries the daemon's own
/// message (or says the answer was not a `T`).
async fn daemon_json<T: serde::de::DeserializeOwned>(
    socket: &std::path::Path,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> Result<T, ApiError> {
    let answer = client::request(socket, method, uri, body)
        .await
        .map_err(|e| ApiError::bad_gateway(e.to_string()))?;
    if answer.status != 200 {
        return Err(ApiError::bad_gateway(format!(
            "the daemon at {} answered {}: {}",
            socket.display(),
            answer.status,
            answer.body.trim()
        )));
    }
    serde_json::from_str(&answer.body).map_err(|e| {
        ApiError::bad_gateway(format!(
            "the daemon at {} answered something the control protocol does not know: {e}",
            socket.display()
        ))
    })
}

fn parse_policy(body: &Bytes) -> Result<Policy, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("vm.dax-policy: the body is not UTF-8"))?;
    let trimmed = text.trim_start();
    if trimmed.is_empty() {
        return Err(ApiError::bad_request(
            "vm.dax-policy: a policy document (JSON or YAML) is required",
        ));
    }
    let parsed = if trimmed.starts_with('{') {
        Policy::parse_json(text)
    } else {
        Policy::parse_yaml(text)
    };
    parsed.map_err(|e| ApiError::bad_request(format!("vm.dax-policy: {e}")))
}

pub(crate) async fn get_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
) -> Result<Response, ApiError> {
    let id = q.id()?;
    let devices = dax_status(&s).await?;
    if !devices.iter().any(|d| d.id == id) {
        return Err(ApiError::not_found(format!(
            "no fs device with id \"{id}\""
        )));
    }
    let desired = devices
        .iter()
        .find(|d| d.id == id)
        .and_then(|d| d.desired_policy.clone());
    let desired_generation = s
        .accepted_generation
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .copied();
    let (acknowledged, daemon_error, etag) = match control_socket_of(&devices, id) {
        Ok(socket) => match daemon_json::<PolicyState>(&socket, "GET", POLICY, None).await {
            Ok(v) => (json!(v), Value::Null, Some(etag(v.generation))),
            Err(e) => (Value::Null, Value::String(e.message), None),
        },
        Err(e) => (Value::Null, Value::String(e.message), None),
    };
    let reconcile = s
        .reconcile
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .cloned();
    let body = Json(json!({
        "id": id,
        "desired": desired,
        "desired_generation": desired_generation,
        "acknowledged": acknowledged,
        "daemon_error": daemon_error,
        "reconcile": reconcile.map(|r| json!({
            "in_sync": r.in_sync, "pushes": r.pushes, "last_error": r.last_error,
        })),
    }));
    Ok(match etag {
        Some(tag) => ([(header::ETAG, tag)], body).into_response(),
        None => body.into_response(),
    })
}

/// A generation as an entity tag.
fn etag(generation: u64) -> String {
    format!("\"{generation}\"")
}

/// What an `If-Match` header (RFC 9110, 13.1.1) asks for.
#[derive(Debug, PartialEq, Eq)]
enum IfMatch {
    /// `*`: any generation.
    Any,
    /// A list of entity tags: the opaque text of the strong ones. A weak
    /// tag (`W/"…"`) never matches: If-Match compares strongly.
    Tags(Vec<String>),
}

impl IfMatch {
    fn matches(&self, generation: u64) -> bool {
        match self {
            IfMatch::Any => true,
            IfMatch::Tags(tags) => tags.iter().any(|t| *t == generation.to_string()),
        }
    }
}

/// The `If-Match` header(s), None without one. A value that is not `*` or
/// a list of entity tags (`"<text>"` or `W/"<text>"`) names no entity tag
/// of ours, so it matches no generation: the precondition fails (412, whose
/// message shows how the tag is written) rather than the request being
/// malformed; any string is a valid If-Match to send.
fn if_match(headers: &HeaderMap) -> Option<IfMatch> {
    let mut tags = Vec::new();
    let mut seen = false;
    for value in headers.get_all(header::IF_MATCH) {
        seen = true;
        let Ok(v) = value.to_str() else {
            continue;
        };
        if v.trim() == "*" {
            return Some(IfMatch::Any);
        }
        tags.extend(strong_entity_tags(v).unwrap_or_default());
    }
    seen.then_some(IfMatch::Tags(tags))
}

/// The opaque text of the strong tags in an RFC 9110 entity-tag list;
/// None if `v` is not one.
fn strong_entity_tags(v: &str) -> Option<Vec<String>> {
    let mut tags = Vec::new();
    let mut listed = false;
    let mut rest = v;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            break;
        }
        let (weak, quoted) = match rest.strip_prefix("W/") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let opaque = quoted.strip_prefix('"')?;
        let end = opaque.find('"')?;
        let text = &opaque[..end];
        // etagc: visible characters but DQUOTE.
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return None;
        }
        if !weak {
            tags.push(text.to_string());
        }
        listed = true;
        rest = opaque[end + 1..].trim_start_matches([' ', '\t']);
        if !rest.is_empty() && !rest.starts_with(',') {
            return None;
        }
    }
    listed.then_some(tags)
}

/// Keeps every daemon on its device's desired policy, for ever (a task on
/// the API's runtime).
pub(crate) async fn reconcile(s: AppState) {
    let mut tick = tokio::time::interval(RECONCILE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        reconcile_once(&s).await;
        relay_adaptive(&s).await;
    }
}

/// Publishes, as `adaptive` events, what each daemon's adaptive policy
/// decided since the last call. The first contact with a daemon only
/// takes its cursor (what it decided before is history, in its stats); a
/// daemon that restarted numbers from 1 again and answers all it has.
pub(crate) async fn relay_adaptive(s: &AppState) {
    let Ok(devices) = fs_devices(s, false).await else {
        return;
    };
    let mut cursors = s
        .adaptive_cursor
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    cursors.retain(|id, _| devices.iter().any(|d| &d.id == id));
    for d in &devices {
        let Some(socket) = &d.control_socket else {
            continue;
        };
        let known = cursors.get(&d.id).copied();
        let uri = format!("{ADAPTIVE_EVENTS}?after={}", known.unwrap_or(u64::MAX));
        let Ok(answer) = daemon_json::<AdaptiveEvents>(socket, "GET", &uri, None).await else {
            continue;
        };
        cursors.insert(d.id.clone(), answer.next);
        if known.is_none() {
            continue;
        }
        if answer.missed > 0 {
            s.events.publish(DaxEvent::new(
                "adaptive",
                &d.id,
                json!({"decision": "missed", "count": answer.missed}),
            ));
        }
        for e in answer.events {
            s.events.publish(DaxEvent::new(
                "adaptive",
                &d.id,
                json!({
                    "decision": e.kind, "path": e.path, "nodeid": e.nodeid,
                    "reason": e.reason, "occupancy_pct": e.occupancy_pct,
                    "seq": e.seq, "daemon_at_ms": e.at_ms,
                }),
            ));
        }
    }
    *s.adaptive_cursor.lock().unwrap_or_else(|p| p.into_inner()) = cursors;
}

/// One pass: each device with a desired policy whose daemon has another
/// gets the desired one pushed again. A device that left the VM takes its
/// desired policy with it (a new device with its id starts afresh).
pub(crate) async fn reconcile_once(s: &AppState) {
    let _push = s.push_lock.lock().await;
    let Ok(devices) = fs_devices(s, false).await else {
        return;
    };
    // Devices that left the VM: forget what was recorded for them.
    let present = |id: &String| devices.iter().any(|d| &d.id == id);
    s.accepted_generation
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|id, _| present(id));
    s.reconcile
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|id, _| present(id));
    let desired: Vec<(String, Value)> = devices
        .iter()
        .filter_map(|d| Some((d.id.clone(), d.desired_policy.clone()?)))
        .collect();
    for (id, policy) in desired {
        let outcome = match control_socket_of(&devices, &id) {
            Ok(socket) => reconcile_device(s, &id, &socket, &policy).await,
            Err(e) => Err(e.message),
        };
        let mut states = s.reconcile.lock().unwrap_or_else(|p| p.into_inner());
        let state = states.entry(id).or_default();
        match outcome {
            Ok(pushed) => {
                state.in_sync = true;
                state.pushes += u64::from(pushed);
                state.last_error = None;
            }
            Err(e) => {
                state.in_sync = false;
                state.last_error = Some(e);
            }
        }
    }
}

/// Compares one daemon's policy with `policy`; pushes it if they differ.
/// Ok(true) when it pushed.
async fn reconcile_device(
    s: &AppState,
    id: &str,
    socket: &std::path::Path,
    policy: &Value,
) -> Result<bool, String> {
    let current: PolicyState = daemon_json(socket, "GET", POLICY, None)
        .await
        .map_err(|e| e.message)?;
    if current.policy == *policy {
        return Ok(false);
    }
    let answer: PolicyUpdate = daemon_json(socket, "PUT", POLICY, Some(policy.to_string()))
        .await
        .map_err(|e| e.message)?;
    let generation = answer.generation;
    log::info!("DAX policy of {id}: the daemon had another one (restarted?); pushed again as generation {generation}");
    s.accepted_generation
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id.to_string(), generation);
    s.events.publish(DaxEvent::new(
        "policy",
        id,
        json!({"generation": generation, "changes": answer.changes, "reconciled": true}),
    ));
    Ok(true)
}

/// Pushes `policy` (None: the default) and answers what changed; with
/// `expected`, only if the daemon is still at that generation.
async fn push(
    s: &AppState,
    id: &str,
    policy: Option<Policy>,
    dry_run: bool,
    expected: Option<IfMatch>,
) -> Result<Response, ApiError> {
    let _push = s.push_lock.lock().await;
    let devices = dax_status(s).await?;
    let socket = control_socket_of(&devices, id)?;
    if let Some(expected) = expected.filter(|e| *e != IfMatch::Any) {
        let current: PolicyState = daemon_json(&socket, "GET", POLICY, None).await?;
        if !expected.matches(current.generation) {
            return Err(ApiError {
                status: 412,
                message: format!(
                    "vm.dax-policy: If-Match names no strong entity tag of the daemon of \"{id}\", which is at generation {}: read it again (it is given as ETag and written If-Match: {})",
                    current.generation,
                    etag(current.generation)
                ),
            });
        }
    }
    let dry = format!("{POLICY}?dry_run=true");
    let uri = if dry_run { dry.as_str() } else { POLICY };
    let answer: PolicyUpdate = match &policy {
        Some(p) => daemon_json(&socket, "PUT", uri, Some(p.to_value().to_string())).await?,
        // The daemon's own default: the policy it started with.
        None => daemon_json(&socket, "DELETE", uri, None).await?,
    };
    let generation = answer.generation;
    let changes = answer.changes;
    let by_effect = |effect: Effect| -> Vec<&PolicyChange> {
        changes.iter().filter(|c| c.effect == effect).collect()
    };
    if !dry_run {
        let doc = match policy {
            Some(p) => p.to_value(),
            // What the daemon went back to is what it should keep.
            None => {
                daemon_json::<PolicyState>(&socket, "GET", POLICY, None)
                    .await?
                    .policy
            }
        };
        // Kept with the device's configuration in the VMM (vm.info shows
        // it), from where the reconcile loop keeps the daemon on it.
        s.vmm
            .call(VmmAction::SetDesiredPolicy {
                id: id.to_string(),
                policy: doc,
            })
            .await?;
        s.accepted_generation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), generation);
        if !changes.is_empty() {
            s.events.publish(DaxEvent::new(
                "policy",
                id,
                json!({"generation": generation, "changes": changes}),
            ));
        }
    }
    let body = Json(json!({
        "id": id,
        "generation": generation,
        "applied": !dry_run,
        "changes": changes,
        "live": by_effect(Effect::Live),
        "remount": by_effect(Effect::Remount),
        "recreate": by_effect(Effect::Recreate),
    }));
    Ok(([(header::ETAG, etag(generation))], body).into_response())
}

pub(crate) async fn put_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let id = q.id()?;
    let expected = if_match(&headers);
    let policy = parse_policy(&body)?;
    push(&s, id, Some(policy), q.dry_run, expected).await
}

pub(crate) async fn delete_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let expected = if_match(&headers);
    push(&s, q.id()?, None, q.dry_run, expected).await
}

pub(crate) async fn metrics(State(s): State<AppState>) -> Response {
    let devices = match dax_status(&s).await {
        Ok(d) => d,
        Err(e) => return e.into_response(),
    };
    let mut stats = Vec::with_capacity(devices.len());
    for d in &devices {
        let st = match &d.control_socket {
            Some(sock) => daemon_json::<DaemonStats>(sock, "GET", STATS, None)
                .await
                .ok(),
            None => None,
        };
        stats.push(st);
    }
    let kvm = match s.vmm.call(VmmAction::KvmCounters).await {
        Ok(VmmReply::Kvm(k)) => k,
        _ => None,
    };
    let text = metrics::render(
        &devices,
        &stats,
        PageFaults::of_this_process(),
        kvm.as_ref(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_reads_rfc_9110_entity_tag_lists_and_matches_strongly() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::IF_MATCH, v.parse().unwrap());
            }
            if_match(&h)
        };
        let tags = |t: &[&str]| Some(IfMatch::Tags(t.iter().map(|s| s.to_string()).collect()));
        assert_eq!(if_match(&HeaderMap::new()), None);
        assert_eq!(with(&["\"7\""]), tags(&["7"]));
        assert_eq!(with(&["*"]), Some(IfMatch::Any));
        // What a generic client (or a fuzzer) may send: valid, and simply
        // not the daemon's generation.
        assert_eq!(with(&["\"x\", W/\"7\",\"a,b\""]), tags(&["x", "a,b"]));
        assert_eq!(with(&["\"1\"", "\"2\""]), tags(&["1", "2"]));
        assert_eq!(with(&["\"\""]), tags(&[""]));
        let seven = with(&["\"9\", \"7\""]).unwrap();
        assert!(seven.matches(7) && !seven.matches(8));
        let weak = with(&["W/\"7\""]).unwrap();
        assert!(!weak.matches(7), "If-Match compares strongly");
        assert!(IfMatch::Any.matches(3));
        // Not entity tags (the bare `0` is what the fuzzer sent): they
        // match no generation, so the precondition fails (412), never a
        // 400 for a string the schema allows.
        for other in ["7", "0", "\"7", "\"1\" \"2\"", ",", "W/7", "\"a b\""] {
            let got = with(&[other]).unwrap();
            assert_eq!(got, IfMatch::Tags(Vec::new()), "{other}");
            assert!(!got.matches(7) && !got.matches(0), "{other}");
        }
        assert_eq!(etag(7), "\"7\"");
    }

    /// A component schema's string pattern in docs/openapi.yaml.
    fn schema_pattern(name: &str) -> regex::Regex {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.yaml");
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let pattern = doc["components"]["schemas"][name]["oneOf"]
            .as_sequence()
            .unwrap()
            .iter()
            .find_map(|s| s["pattern"].as_str())
            .unwrap();
        regex::Regex::new(pattern).unwrap()
    }

    /// The schema's Percent and Duration strings are exactly those the
    /// policy parser takes (the fuzzer's PUT with `"max_file_share": "0"`
    /// was schema-valid and refused).
    #[test]
    fn percent_and_duration_patterns_agree_with_the_policy_parser() {
        let numbers = [
            "0", "00", "1", "01", "9", "10", "24", "25", "99", "100", "0100", "101", "999", "1000",
            "1439", "1440", "1441", "9999", "86399", "86400", "86401", "99999", "9999999",
            "86399999", "86400000", "86400001", "99999999", "",
        ];
        let percent = schema_pattern("Percent");
        let duration = schema_pattern("Duration");
        for n in numbers {
            for suffix in ["", "%", "%%", ".5"] {
                let v = format!("{n}{suffix}");
                let doc = format!(r#"{{"adaptive": {{"max_file_share": "{v}"}}}}"#);
                assert_eq!(
                    percent.is_match(&v),
                    Policy::parse_json(&doc).is_ok(),
                    "max_file_share {v:?}"
                );
            }
            for unit in ["", "ms", "s", "m", "h", "d", "mss"] {
                let v = format!("{n}{unit}");
                let doc = format!(r#"{{"adaptive": {{"cool_down": "{v}"}}}}"#);
                assert_eq!(
                    duration.is_match(&v),
                    Policy::parse_json(&doc).is_ok(),
                    "cool_down {v:?}"
                );
            }
        }
    }
}
