//! API benchmark (not a test): starts `dax-vmm --api-socket` and a daemon
//! with a control socket, creates a VM with a DAX share (not booted: policy
//! pushes and the API do not need a running guest), then measures from this
//! separate process:
//!
//! 1. `PUT vm.dax-policy` to acknowledged-by-daemon latency (the answer
//!    carries the daemon's new generation), p50/p99 over alternating policies;
//! 2. request latency and throughput of `GET vm.info` and `GET vmm.ping`
//!    under load from concurrent connections for a fixed time.
//!
//! Writes `target/rig-results/api-bench.md`. Usage:
//! `DAX_VMM_RIG_PROFILE=release cargo run --release -p dax-bench --bin bench-api [pushes] [seconds] [connections]`

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use test_infra::host::{wait_for_path as wait_for, KillOnDrop as Proc};
use test_infra::results::Results;
use test_infra::rig;

fn request(sock: &Path, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut s = UnixStream::connect(sock).map_err(|e| format!("connect: {e}"))?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status line")?;
    Ok((
        status,
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    ))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[test_infra::results::nearest_rank(sorted.len(), p) - 1]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let pushes = usize::try_from(*args.first().unwrap_or(&500)).expect("pushes fits usize");
    let seconds = *args.get(1).unwrap_or(&5);
    let connections = usize::try_from(*args.get(2).unwrap_or(&8)).expect("connections fits usize");

    let vmm = rig::tool("vmm", "dax-vmm").expect("dax-vmm");
    let dir: PathBuf = rig::target_dir().join("api-bench");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("share")).unwrap();
    let (api, control) = (dir.join("api.sock"), dir.join("control.sock"));
    let _vmm = Proc(
        Command::new(&vmm)
            .arg("--api-socket")
            .arg(&api)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _daemon =
        test_infra::host::spawn_daemon(&dir.join("share"), &dir.join("fs.sock"), &control);
    wait_for(&api);
    wait_for(&control);
    let create = r#"{"payload":{"kernel":"/unused"},"memory":{"size":268435456,"shared":true}}"#;
    assert_eq!(
        request(&api, "PUT", "/api/v1/vm.create", create).unwrap().0,
        204
    );
    let fs = format!(
        r#"{{"tag":"t","socket":"/unused","id":"fs0","control_socket":"{}"}}"#,
        control.display()
    );
    assert_eq!(
        request(&api, "PUT", "/api/v1/vm.add-fs", &fs).unwrap().0,
        204
    );

    // 1. Policy push to acknowledgement.
    let policies = [
        r#"{"mode":"inode","cache_size":"64M","rules":[{"min_size":"32K","dax":true}],"default":false}"#,
        r#"{"mode":"inode","cache_size":"64M","rules":[{"path":"db/**","dax":true}],"default":false}"#,
    ];
    let mut push = Vec::with_capacity(pushes);
    let mut last_generation = 0;
    for i in 0..pushes {
        let t = Instant::now();
        let (status, body) =
            request(&api, "PUT", "/api/v1/vm.dax-policy?id=fs0", policies[i % 2]).unwrap();
        push.push(t.elapsed());
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let generation = v["generation"].as_u64().unwrap();
        assert!(
            generation > last_generation,
            "each push is a new generation acknowledged by the daemon: {body}"
        );
        last_generation = generation;
    }
    push.sort();

    // 2. Load: `connections` clients, each one request per connection (as ch-remote does).
    let mut results = Results::new("api-bench");
    results.record(
        "policy pushes (PUT vm.dax-policy → daemon ack)",
        pushes.to_string(),
    );
    results.record("push latency p50", us(percentile(&push, 0.50)));
    results.record("push latency p99", us(percentile(&push, 0.99)));
    for endpoint in ["/api/v1/vmm.ping", "/api/v1/vm.info"] {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                let (api, stop) = (api.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut lat = Vec::new();
                    let mut errors = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        match request(&api, "GET", endpoint, "") {
                            Ok((200, _)) => lat.push(t.elapsed()),
                            _ => errors += 1,
                        }
                    }
                    (lat, errors)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(seconds));
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        let mut errors = 0;
        for w in workers {
            let (lat, e) = w.join().unwrap();
            all.extend(lat);
            errors += e;
        }
        let elapsed = started.elapsed().as_secs_f64();
        all.sort();
        let name = endpoint.trim_start_matches("/api/v1/");
        results.record(
            &format!("GET {name}: connections × seconds"),
            format!("{connections} × {seconds}"),
        );
        results.record(
            &format!("GET {name}: requests/s"),
            format!("{:.0}", all.len() as f64 / elapsed),
        );
        results.record(
            &format!("GET {name}: p50 / p99"),
            format!(
                "{} / {}",
                us(percentile(&all, 0.50)),
                us(percentile(&all, 0.99))
            ),
        );
        results.record(&format!("GET {name}: errors"), errors.to_string());
    }
    let _ = request(&api, "PUT", "/api/v1/vmm.shutdown", "");
    let path = results.save().expect("write results");
    eprintln!("wrote {}", path.display());
}
