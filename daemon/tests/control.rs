//! The daemon's control socket over a real unix socket: read the policy,
//! refuse a bad one without changing anything, dry-run, apply, reset.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmm_sys_util::tempdir::TempDir;

#[path = "common/http.rs"]
mod http;
use http::http;

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn json(sock: &Path, method: &str, path: &str, body: &str) -> Value {
    let (status, text) = http(sock, method, path, body);
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: {e}: {text}"))
}

#[test]
fn policies_are_read_validated_diffed_and_swapped() {
    let share = TempDir::new().unwrap();
    let dir = TempDir::new().unwrap();
    let control = dir.as_path().join("control.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_dax-virtiofsd"))
        .args(["--sandbox", "none", "--log-level", "warn"])
        .arg("--socket-path")
        .arg(dir.as_path().join("vhost.sock"))
        .arg("--shared-dir")
        .arg(share.as_path())
        .arg("--control-socket")
        .arg(&control)
        .spawn()
        .unwrap();
    let _daemon = Daemon(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(&control).is_err() {
        assert!(
            Instant::now() < deadline,
            "the control socket never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mode = std::fs::metadata(&control).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "owner only");

    let v = json(&control, "GET", "/api/v1/policy", "");
    assert_eq!(v["generation"], 1);
    assert_eq!(v["policy"]["cache_size"], 1u64 << 30);
    assert_eq!(v["policy"]["mode"], "inode");

    // A bad policy is refused with the field named, and changes nothing.
    let (status, text) = http(
        &control,
        "PUT",
        "/api/v1/policy",
        r#"{"rules": [{"dax": true}, {"min_size": "12Q", "dax": true}]}"#,
    );
    assert_eq!(status, 400);
    assert!(
        text.contains("rules[1].min_size: \"12Q\" is not a size"),
        "{text}"
    );
    let (status, text) = http(&control, "PUT", "/api/v1/policy", "not json");
    assert_eq!(status, 400, "{text}");
    assert_eq!(json(&control, "GET", "/api/v1/policy", "")["generation"], 1);

    // A dry run answers the diff and applies nothing.
    let new = r#"{"mode": "never", "window_granularity": "2M", "cache_size": "2G"}"#;
    let v = json(&control, "PUT", "/api/v1/policy?dry_run=true", new);
    assert_eq!(
        (v["generation"].as_u64(), v["applied"].as_bool()),
        (Some(1), Some(false))
    );
    let effects: Vec<(String, String)> = v["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["field"].as_str().unwrap().to_string(),
                c["effect"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        effects.contains(&("mode".into(), "live".into())),
        "{effects:?}"
    );
    assert!(
        effects.contains(&("window_granularity".into(), "remount".into())),
        "{effects:?}"
    );
    assert!(
        effects.contains(&("cache_size".into(), "recreate".into())),
        "{effects:?}"
    );
    assert_eq!(
        json(&control, "GET", "/api/v1/policy", "")["policy"]["mode"],
        "inode"
    );

    // Applied: a new generation; the same policy again changes nothing.
    let v = json(&control, "PUT", "/api/v1/policy", new);
    assert_eq!(
        (v["generation"].as_u64(), v["applied"].as_bool()),
        (Some(2), Some(true))
    );
    assert_eq!(
        json(&control, "GET", "/api/v1/policy", "")["policy"]["mode"],
        "never"
    );
    assert_eq!(
        json(&control, "PUT", "/api/v1/policy", new)["generation"],
        2
    );

    // DELETE goes back to the default.
    assert_eq!(
        json(&control, "DELETE", "/api/v1/policy", "")["generation"],
        3
    );
    assert_eq!(
        json(&control, "GET", "/api/v1/policy", "")["policy"]["mode"],
        "inode"
    );

    let stats = json(&control, "GET", "/api/v1/stats", "");
    assert_eq!(stats["setupmappings"], 0);
    assert_eq!(stats["window_truncations"], 0);
    // The VMM's notice that a mapped file shrank on the host: counted.
    let notice = r#"{"offset": 4194304, "len": 2097152}"#;
    assert_eq!(
        http(&control, "POST", "/api/v1/window/truncated", notice).0,
        204
    );
    let stats = json(&control, "GET", "/api/v1/stats", "");
    assert_eq!(stats["window_truncations"], 1);
    assert_eq!(stats["window_truncated_bytes"], 2097152);
    let (status, text) = http(
        &control,
        "POST",
        "/api/v1/window/truncated",
        r#"{"offset": -1}"#,
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("/api/v1/window/truncated"), "{text}");
    assert_eq!(http(&control, "GET", "/api/v1/nope", "").0, 404);
}
