//! The controller against a stand-in VMM (a thread answering the device
//! list) and a stand-in daemon (a control socket on a thread that keeps a
//! policy and its generation as dax-virtiofsd does).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::*;
use crate::vmm_channel;

/// What the stand-in daemon keeps, and the requests it got.
struct DaemonState {
    generation: u64,
    policy: Value,
    /// Answer 400 to every PUT.
    refuse: bool,
    seen: Vec<String>,
}

/// The policy a daemon starts with.
fn start_up_policy() -> Value {
    Policy::default().to_value()
}

impl DaemonState {
    fn new() -> Self {
        DaemonState {
            generation: 1,
            policy: start_up_policy(),
            refuse: false,
            seen: Vec::new(),
        }
    }

    /// A PUT or DELETE of `doc`: a new generation only if it changes something.
    fn update(&mut self, doc: Value, dry_run: bool) -> (u16, String) {
        let changes = if doc == self.policy {
            json!([])
        } else {
            json!([{"field": "rules", "from": "old", "to": "new", "effect": "live"}])
        };
        if !dry_run && doc != self.policy {
            self.generation += 1;
            self.policy = doc;
        }
        let answer =
            json!({"generation": self.generation, "applied": !dry_run, "changes": changes});
        (200, answer.to_string())
    }

    fn answer(&mut self, method: &str, uri: &str, body: &str) -> (u16, String) {
        self.seen.push(format!("{method} {uri}"));
        let dry_run = uri.ends_with("?dry_run=true");
        match (method, uri.split('?').next().unwrap_or_default()) {
            ("GET", "/api/v1/policy") => (
                200,
                json!({"generation": self.generation, "policy": self.policy}).to_string(),
            ),
            ("PUT", "/api/v1/policy") if self.refuse => (400, "rules: refused".into()),
            ("PUT", "/api/v1/policy") => {
                let doc = serde_json::from_str(body).unwrap();
                self.update(doc, dry_run)
            }
            ("DELETE", "/api/v1/policy") => self.update(start_up_policy(), dry_run),
            ("GET", "/api/v1/adaptive/events") => {
                (200, r#"{"events":[],"next":0,"missed":0}"#.into())
            }
            _ => (404, "no such endpoint".into()),
        }
    }
}

/// Serves `state` on a control socket at `path`, one request per connection.
fn stand_in_daemon(path: &Path, state: Arc<Mutex<DaemonState>>) {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let mut reader = BufReader::new(conn.unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let mut parts = line.split_whitespace();
            let (method, uri) = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
            );
            let mut length = 0;
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).unwrap();
                if header.trim().is_empty() {
                    break;
                }
                if let Some((name, value)) = header.split_once(':') {
                    if name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse().unwrap();
                    }
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let body = String::from_utf8(body).unwrap();
            let (status, text) = state.lock().unwrap().answer(method, uri, &body);
            let answer = format!(
                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
            let _ = reader.get_mut().write_all(answer.as_bytes());
        }
    });
}

/// The stand-in VMM: answers the device list with `listed`, and records
/// whether each list asked for window statistics.
struct StandInVmm {
    listed: Arc<Mutex<Vec<FsDaxStatus>>>,
    asked_stats: Arc<Mutex<Vec<bool>>>,
}

fn stand_in_vmm() -> (StandInVmm, Arc<PolicyController>, EventBus) {
    let (channel, receiver) = vmm_channel().unwrap();
    let vmm = StandInVmm {
        listed: Arc::default(),
        asked_stats: Arc::default(),
    };
    let (listed, asked) = (vmm.listed.clone(), vmm.asked_stats.clone());
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(2));
        for req in receiver.drain() {
            let answer = match req.action {
                VmmAction::DaxStatus { window_stats } => {
                    asked.lock().unwrap().push(window_stats);
                    Ok(VmmReply::Dax(listed.lock().unwrap().clone()))
                }
                other => Err(ApiError::internal(format!("not asked of it: {other:?}"))),
            };
            let _ = req.reply.send(answer);
        }
    });
    let events = EventBus::default();
    let controller = PolicyController::new(channel, events.clone());
    (vmm, controller, events)
}

fn device(id: &str, socket: Option<&Path>, configured: Option<Value>) -> FsDaxStatus {
    FsDaxStatus {
        id: id.into(),
        control_socket: socket.map(Path::to_path_buf),
        configured_policy: configured,
        ..Default::default()
    }
}

/// A controller with fs device `fs0` whose daemon is the stand-in.
struct Rig {
    _dir: vmm_sys_util::tempdir::TempDir,
    socket: PathBuf,
    daemon: Arc<Mutex<DaemonState>>,
    vmm: StandInVmm,
    controller: Arc<PolicyController>,
    events: EventBus,
}

fn rig() -> Rig {
    let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
    let socket = dir.as_path().join("control.sock");
    let daemon = Arc::new(Mutex::new(DaemonState::new()));
    stand_in_daemon(&socket, daemon.clone());
    let (vmm, controller, events) = stand_in_vmm();
    vmm.listed
        .lock()
        .unwrap()
        .push(device("fs0", Some(&socket), None));
    Rig {
        _dir: dir,
        socket,
        daemon,
        vmm,
        controller,
        events,
    }
}

fn policy(doc: &str) -> Policy {
    parse_policy(doc.as_bytes()).unwrap()
}

const DB_ON_DAX: &str = r#"{"rules":[{"path":"db/**","dax":true}],"default":false}"#;
const LOGS_OFF_DAX: &str = "rules:\n  - path: logs/**\n    dax: false\n";

fn apply() -> PolicyRequest {
    PolicyRequest {
        dry_run: false,
        expected: None,
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_desired_policy_and_its_generation_follow_each_put_and_never_ask_for_window_stats() {
    let r = rig();
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!((view.desired, view.desired_generation), (None, None));
    assert_eq!(view.acknowledged.unwrap().generation, 1);

    let answer = r
        .controller
        .put("fs0", Some(policy(DB_ON_DAX)), apply())
        .await
        .unwrap();
    assert_eq!((answer.generation, answer.changes.len()), (2, 1));
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(view.desired, Some(policy(DB_ON_DAX).to_value()));
    assert_eq!(view.desired_generation, Some(2));
    assert_eq!(
        view.acknowledged.unwrap().policy,
        policy(DB_ON_DAX).to_value()
    );

    // A dry run answers what would change and changes nothing.
    let dry = PolicyRequest {
        dry_run: true,
        expected: None,
    };
    let answer = r
        .controller
        .put("fs0", Some(policy(LOGS_OFF_DAX)), dry)
        .await
        .unwrap();
    assert_eq!((answer.generation, answer.changes.len()), (2, 1));
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(view.desired, Some(policy(DB_ON_DAX).to_value()));
    assert_eq!(r.daemon.lock().unwrap().generation, 2);

    // The same document again: no new generation.
    let again = r
        .controller
        .put("fs0", Some(policy(DB_ON_DAX)), apply())
        .await
        .unwrap();
    assert_eq!((again.generation, again.changes.len()), (2, 0));

    // DELETE: the daemon's default becomes the desired policy.
    let reset = r.controller.put("fs0", None, apply()).await.unwrap();
    assert_eq!(reset.generation, 3);
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(view.desired, Some(start_up_policy()));
    assert_eq!(view.desired_generation, Some(3));

    let asked = r.vmm.asked_stats.lock().unwrap().clone();
    assert!(!asked.is_empty() && asked.iter().all(|s| !s), "{asked:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn if_match_is_checked_against_the_daemons_generation_before_anything_changes() {
    let r = rig();
    let stale = PolicyRequest {
        dry_run: false,
        expected: Some(IfMatch::Tags(vec!["7".into()])),
    };
    let e = r
        .controller
        .put("fs0", Some(policy(DB_ON_DAX)), stale)
        .await
        .unwrap_err();
    assert_eq!(e.status, 412, "{e:?}");
    assert!(
        e.message.contains("at generation 1") && e.message.contains("If-Match: \"1\""),
        "{e:?}"
    );
    assert_eq!(r.daemon.lock().unwrap().seen, vec!["GET /api/v1/policy"]);
    assert_eq!(r.controller.policy("fs0").await.unwrap().desired, None);

    let current = PolicyRequest {
        dry_run: false,
        expected: Some(IfMatch::Tags(vec!["9".into(), "1".into()])),
    };
    let answer = r
        .controller
        .put("fs0", Some(policy(DB_ON_DAX)), current)
        .await
        .unwrap();
    assert_eq!(answer.generation, 2);
    let any = PolicyRequest {
        dry_run: false,
        expected: Some(IfMatch::Any),
    };
    assert_eq!(
        r.controller.put("fs0", None, any).await.unwrap().generation,
        3
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_bad_policy_or_a_refusing_daemon_changes_nothing() {
    let r = rig();
    r.controller
        .put("fs0", Some(policy(DB_ON_DAX)), apply())
        .await
        .unwrap();
    let seen = r.daemon.lock().unwrap().seen.len();

    let bad = "rules:\n  - min_size: 32K\n    dax: true\n  - min_size: 12Q\n    dax: false\n";
    let e = parse_policy(bad.as_bytes()).unwrap_err();
    assert_eq!(e.status, 400);
    assert!(e.message.contains("rules[1].min_size"), "{e:?}");
    assert!(parse_policy(b"  ")
        .unwrap_err()
        .message
        .contains("policy document"));
    assert!(parse_policy(&[0xff])
        .unwrap_err()
        .message
        .contains("not UTF-8"));
    assert_eq!(
        r.daemon.lock().unwrap().seen.len(),
        seen,
        "no daemon saw it"
    );

    r.daemon.lock().unwrap().refuse = true;
    let e = r
        .controller
        .put("fs0", Some(policy(LOGS_OFF_DAX)), apply())
        .await
        .unwrap_err();
    assert_eq!(e.status, 502, "{e:?}");
    assert!(e.message.contains("answered 400: rules: refused"), "{e:?}");
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(view.desired, Some(policy(DB_ON_DAX).to_value()));
    assert_eq!(view.desired_generation, Some(2));

    // No such device; a device without a control socket.
    let e = r.controller.put("fs9", None, apply()).await.unwrap_err();
    assert_eq!(
        (e.status, e.message.as_str()),
        (404, "no fs device with id \"fs9\"")
    );
    r.vmm.listed.lock().unwrap().push(device("fs1", None, None));
    let e = r.controller.put("fs1", None, apply()).await.unwrap_err();
    assert_eq!(e.status, 409, "{e:?}");
    assert!(e.message.contains("has no control socket"), "{e:?}");
    let view = r.controller.policy("fs1").await.unwrap();
    assert!(view
        .acknowledged
        .unwrap_err()
        .contains("has no control socket"));
}

#[tokio::test(flavor = "current_thread")]
async fn a_restarted_daemon_gets_the_desired_policy_again_and_only_once() {
    let r = rig();
    let mut events = r.events.subscribe();
    r.controller
        .put("fs0", Some(policy(DB_ON_DAX)), apply())
        .await
        .unwrap();
    r.controller.sync().await.unwrap();
    r.controller.reconcile_once().await;
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(
        view.reconcile,
        Some(ReconcileState {
            in_sync: true,
            pushes: 0,
            last_error: None
        })
    );

    // The daemon restarts with its start-up policy.
    *r.daemon.lock().unwrap() = DaemonState::new();
    r.controller.sync().await.unwrap();
    r.controller.reconcile_once().await;
    assert_eq!(
        r.daemon.lock().unwrap().policy,
        policy(DB_ON_DAX).to_value()
    );
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(
        view.reconcile,
        Some(ReconcileState {
            in_sync: true,
            pushes: 1,
            last_error: None
        })
    );
    assert_eq!(view.desired_generation, Some(2));
    r.controller.reconcile_once().await;
    assert_eq!(
        r.controller
            .policy("fs0")
            .await
            .unwrap()
            .reconcile
            .unwrap()
            .pushes,
        1
    );

    let kinds: Vec<Value> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == "policy")
        .map(|e| e.fields)
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert_eq!(kinds[1]["reconciled"], true, "{kinds:?}");

    // A daemon that is gone: out of sync, saying why.
    std::fs::remove_file(&r.socket).unwrap();
    r.controller.reconcile_once().await;
    let state = r.controller.policy("fs0").await.unwrap().reconcile.unwrap();
    assert!(!state.in_sync && state.last_error.is_some(), "{state:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_device_that_leaves_takes_its_state_and_one_created_again_starts_from_its_configuration()
{
    let r = rig();
    let configured = policy(LOGS_OFF_DAX).to_value();
    *r.vmm.listed.lock().unwrap() = vec![device("fs0", Some(&r.socket), Some(configured.clone()))];
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!(view.desired, Some(configured.clone()));
    r.controller
        .put("fs0", Some(policy(DB_ON_DAX)), apply())
        .await
        .unwrap();

    // vm.info shows the desired policy in place of the configured one.
    let mut info = json!({"config": {"fs": [{"id": "fs0", "dax_policy": configured}]}});
    r.controller.show_desired(&mut info);
    assert_eq!(
        info["config"]["fs"][0]["dax_policy"],
        policy(DB_ON_DAX).to_value()
    );

    // Removed, then added again with another policy, between two lists.
    let listed = r.vmm.listed.clone();
    let change = async move {
        *listed.lock().unwrap() = vec![device("fs0", Some(Path::new("/nowhere")), None)];
        Ok(VmmReply::NoContent)
    };
    r.controller.device_change(change).await.unwrap();
    let view = r.controller.policy("fs0").await.unwrap();
    assert_eq!((view.desired, view.desired_generation), (None, None));
    let mut info = json!({"config": {"fs": [{"id": "fs0", "dax_policy": null}]}});
    r.controller.show_desired(&mut info);
    assert_eq!(info["config"]["fs"][0]["dax_policy"], Value::Null);

    r.vmm.listed.lock().unwrap().clear();
    let e = r.controller.policy("fs0").await.unwrap_err();
    assert_eq!(e.status, 404);
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
        "1439", "1440", "1441", "9999", "86399", "86400", "86401", "99999", "9999999", "86399999",
        "86400000", "86400001", "99999999", "",
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
