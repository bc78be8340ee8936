//! The API beside a daemon that misbehaves or goes away, without booting a
//! guest: a slow event subscriber is told what it lost while the VMM keeps
//! serving, a daemon that never answers fails `vm.boot` in time, and a
//! restarted daemon gets the desired DAX policy back by itself.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::api_common::{
    create_vm_with_fs0, http, json, refused, scratch, start, start_daemon, start_vmm, subscribe,
    wait_for,
};

/// An SSE subscriber: the events it has read, by kind, and what it was told
/// it missed.
#[derive(Default, Debug)]
struct Subscriber {
    policy_events: u64,
    dropped: u64,
    lagged_events: u64,
    last_generation: u64,
}

impl Subscriber {
    /// Reads events until one carries policy generation `until`.
    fn read_until(&mut self, r: &mut BufReader<UnixStream>, until: u64) {
        let mut kind = String::new();
        let mut line = String::new();
        while self.last_generation < until {
            line.clear();
            assert!(
                r.read_line(&mut line).unwrap() > 0,
                "event stream closed after {self:?}"
            );
            if let Some(k) = line.strip_prefix("event: ") {
                kind = k.trim().to_string();
            } else if let Some(data) = line.strip_prefix("data: ") {
                let v: serde_json::Value =
                    serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
                match kind.as_str() {
                    "policy" => {
                        self.policy_events += 1;
                        self.last_generation = v["fields"]["generation"].as_u64().unwrap();
                    }
                    "lagged" => {
                        self.lagged_events += 1;
                        self.dropped += v["dropped"].as_u64().unwrap();
                    }
                    _ => {}
                }
            }
        }
    }
}

/// One subscriber reads as events come, another stops reading while a burst
/// of policy changes goes through: the burst is served in full, the slow
/// reader is told how many events it lost and then carries on, and neither
/// reader loses an event without being told.
#[test]
fn a_slow_event_subscriber_loses_events_and_is_told_while_the_vmm_keeps_serving() {
    let dir = scratch("api-slow-subscriber");
    let (_vmm, _daemon, api, control) = start(&dir);
    create_vm_with_fs0(&dir, &api, &control);

    let mut slow = subscribe(&api, Duration::from_secs(60));
    let fast_stream = subscribe(&api, Duration::from_secs(60));
    // More changes than the per-subscriber buffer plus what socket buffers
    // can hold, so the reader that stops must fall behind.
    const BURST: u64 = 3 * api::events::EVENT_BUFFER as u64;
    let fast = std::thread::spawn(move || {
        let mut r = fast_stream;
        let mut s = Subscriber::default();
        s.read_until(&mut r, BURST + 1);
        s
    });
    let policies = [
        r#"{"cache_size":"64M","rules":[{"min_size":"64K","dax":true}],"default":false}"#,
        r#"{"cache_size":"64M","rules":[{"path":"db/**","dax":true},{"min_size":"64K","dax":true}],"default":false}"#,
    ];
    let mut generation = 1;
    for i in 0..BURST {
        let put = json(
            &api,
            "PUT",
            "/api/v1/vm.dax-policy?id=fs0",
            policies[(i % 2) as usize],
        );
        generation = put["generation"].as_u64().unwrap();
    }
    assert_eq!(
        generation,
        BURST + 1,
        "every change in the burst was applied"
    );
    assert_eq!(
        json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "")["acknowledged"]["generation"],
        BURST + 1
    );
    assert!(
        json(&api, "GET", "/api/v1/vmm.ping", "")["pid"]
            .as_u64()
            .is_some(),
        "the VMM serves while a reader stalls"
    );

    let mut s = Subscriber::default();
    s.read_until(&mut slow, generation);
    assert!(
        s.lagged_events >= 1 && s.dropped > 0,
        "the stalled reader was told it lost events: {s:?}"
    );
    assert_eq!(
        s.policy_events + s.dropped,
        BURST,
        "nothing lost without being told: {s:?}"
    );
    let f = fast.join().unwrap();
    assert_eq!(
        f.policy_events + f.dropped,
        BURST,
        "nothing lost without being told: {f:?}"
    );
    eprintln!("burst of {BURST} events: stalled reader {s:?}, live reader {f:?}");

    // After the burst the slow reader is live again: the next change arrives.
    json(&api, "DELETE", "/api/v1/vm.dax-policy?id=fs0", "");
    s.read_until(&mut slow, generation + 1);
    assert_eq!(s.last_generation, generation + 1, "{s:?}");
}

/// A daemon that accepts the connection and then never answers once
/// held the VMM's control thread for ever, and with it every API call.
/// Now `vm.boot` fails naming the step and the timeout, well within a
/// minute, `vmm.ping` answers quickly all along, and the VMM serves the
/// next request.
#[test]
fn a_daemon_that_never_answers_fails_vm_boot_in_time_while_ping_answers() {
    let dir = scratch("api-silent-daemon");
    let (_vmm, api) = start_vmm(&dir);
    // Accepts, reads nothing, answers nothing; keeps the connections open.
    let silent = dir.join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    wait_for(&api);
    let create = r#"{"payload":{"kernel":"/nonexistent/bzImage"},"memory":{"size":268435456,"shared":true},"serial":{"mode":"Null"}}"#;
    assert_eq!(http(&api, "PUT", "/api/v1/vm.create", create).0, 204);
    let add_fs = format!(
        r#"{{"tag":"t","socket":"{}","id":"fs0","cache_size":67108864}}"#,
        silent.display()
    );
    assert_eq!(http(&api, "PUT", "/api/v1/vm.add-fs", &add_fs).0, 204);

    let boot_api = api.clone();
    let started = Instant::now();
    let boot = std::thread::spawn(move || {
        let r = http(&boot_api, "PUT", "/api/v1/vm.boot", "");
        (r, started.elapsed())
    });
    let mut slowest_ping = Duration::ZERO;
    let mut pings = 0;
    while !boot.is_finished() {
        let t = Instant::now();
        let pid = json(&api, "GET", "/api/v1/vmm.ping", "")["pid"].as_u64();
        assert!(pid.is_some());
        slowest_ping = slowest_ping.max(t.elapsed());
        pings += 1;
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "vm.boot still hangs after a minute"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let ((status, text), took) = boot.join().unwrap();
    assert_eq!(status, 500, "{text}");
    assert!(
        text.contains("did not answer within") && text.contains("fs fs0"),
        "the error names the device and the timeout: {text}"
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(
        pings > 10,
        "pinged {pings} times while vm.boot waited {took:?}"
    );
    // A figure for the log, not a timed assertion: pings are not queued
    // behind the stuck boot.
    eprintln!("vm.boot failed after {took:?}; {pings} pings, slowest {slowest_ping:?}");
    // The VMM serves the next request: the VM is still created, not booted.
    let info = json(&api, "GET", "/api/v1/vm.info", "");
    assert_eq!(info["state"], "Created", "{info}");
}

/// A daemon restarted under a created VM once came back with its
/// start-up policy and nobody noticed. The API's reconcile loop now pushes
/// the desired policy again within seconds, and says so in vm.dax-policy.
#[test]
fn a_restarted_daemon_gets_the_desired_policy_back_by_itself() {
    let dir = scratch("api-reconcile");
    let (_vmm, daemon, api, control) = start(&dir);
    create_vm_with_fs0(&dir, &api, &control);
    let policy = r#"{"cache_size":"64M","rules":[{"path":"db/**","dax":true}],"default":false}"#;
    json(&api, "PUT", "/api/v1/vm.dax-policy?id=fs0", policy);
    let desired = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "")["desired"].clone();
    // The daemon's own control socket (not Cloud Hypervisor's protocol).
    let daemon_policy = || {
        let mut c = UnixStream::connect(&control).unwrap();
        c.write_all(b"GET /api/v1/policy HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        std::io::Read::read_to_string(&mut c, &mut reply).unwrap();
        let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        serde_json::from_str::<serde_json::Value>(body).unwrap_or_else(|e| panic!("{e}: {reply}"))
            ["policy"]
            .clone()
    };
    assert_eq!(daemon_policy(), desired);

    // The daemon restarts: it comes back with its default policy...
    drop(daemon);
    let _ = std::fs::remove_file(&control);
    let _daemon = start_daemon(&dir);
    wait_for(&control);
    // ...and gets the desired one again without anyone asking.
    let deadline = Instant::now() + Duration::from_secs(30);
    while daemon_policy() != desired {
        assert!(
            Instant::now() < deadline,
            "not reconciled: {}",
            daemon_policy()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let state = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "");
    assert_eq!(state["reconcile"]["in_sync"], true, "{state}");
    assert!(state["reconcile"]["pushes"].as_u64() >= Some(1), "{state}");
    assert_eq!(state["acknowledged"]["policy"], desired, "{state}");
    // In step, the loop pushes nothing more: the generation stays.
    let generation = state["acknowledged"]["generation"].clone();
    std::thread::sleep(Duration::from_secs(3));
    let later = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "");
    assert_eq!(later["acknowledged"]["generation"], generation, "{later}");
    assert_eq!(
        later["reconcile"]["pushes"], state["reconcile"]["pushes"],
        "{later}"
    );

    // The desired policy is kept with the device's configuration.
    let info = json(&api, "GET", "/api/v1/vm.info", "");
    assert_eq!(info["config"]["fs"][0]["dax_policy"], desired, "{info}");

    // A device may come with its policy: the daemon gets it with no
    // vm.dax-policy call. A bad one is refused naming the field.
    assert_eq!(
        http(&api, "PUT", "/api/v1/vm.remove-device", r#"{"id":"fs0"}"#).0,
        204
    );
    let bad = format!(
        r#"{{"tag":"t","socket":"{}","id":"fs1","control_socket":"{}","dax_policy":{{"rules":[{{"min_size":"12Q","dax":true}}]}}}}"#,
        dir.join("fs.sock").display(),
        control.display()
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        &bad,
        400,
        "dax_policy: rules[0].min_size",
    );
    let with_policy = format!(
        r#"{{"tag":"t","socket":"{}","id":"fs1","cache_size":67108864,"control_socket":"{}","dax_policy":{{"cache_size":"64M","rules":[{{"path":"logs/**","dax":false}}],"default":true}}}}"#,
        dir.join("fs.sock").display(),
        control.display()
    );
    assert_eq!(http(&api, "PUT", "/api/v1/vm.add-fs", &with_policy).0, 204);
    let wanted = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs1", "")["desired"].clone();
    assert_eq!(wanted["rules"][0]["path"], "logs/**", "{wanted}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while daemon_policy() != wanted {
        assert!(Instant::now() < deadline, "not pushed: {}", daemon_policy());
        std::thread::sleep(Duration::from_millis(100));
    }
}
