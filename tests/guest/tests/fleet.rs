//! `dax-fleet` against a real etcd and real VMMs and daemons (created VMs,
//! not booted): a policy object reaches exactly the VMs it selects, its
//! status comes back into etcd, an invalid object is reported and changes
//! nothing, and the fleet converges again after the agent, a VMM, a daemon
//! or etcd itself restarts. The 3-host scale run is `fleet_scale.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::fleet_common::{header, raw, scratch, wait_for, Agent, Etcd, Pki, Store, Vm};
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(60);
const BUILD: &str = r#"{"selector": {"tier": "build"}, "priority": 10, "policy": {"rules": [{"path": "logs/**", "dax": false}], "default": true}}"#;
const STORAGE: &str =
    r#"{"selector": {"team": "storage"}, "priority": 20, "policy": {"mode": "never"}}"#;
const BAD: &str = r#"{"selector": {"tier": "build"}, "priority": 99, "policy": {"rules": [{"min_size": "12Q", "dax": true}]}}"#;

fn status(store: &mut Store, vm: &str) -> Value {
    store
        .json_under("/dax/status/h1/")
        .remove(&format!("/dax/status/h1/{vm}/fs0"))
        .unwrap_or(Value::Null)
}

/// Waits until `vm`'s status satisfies `ok`; answers it.
fn wait_status(store: &mut Store, vm: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let last = status(store, vm);
        if ok(&last) {
            return last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{vm}: {what}; last status {last}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn policies_from_etcd_reach_the_selected_vms_and_status_comes_back() {
    let dir = scratch("agent");
    let mut etcd = Etcd::start(&dir);
    let mut vm1 = Vm::create(&dir, "vm1");
    let mut vm2 = Vm::create(&dir, "vm2");
    let vm3 = Vm::create(&dir, "vm3");
    let labels = |pairs: &[(&'static str, &'static str)]| -> BTreeMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    };
    let mut agent = Agent::start(
        &dir,
        "h1",
        &etcd.url,
        &[
            (&vm1, labels(&[("tier", "build")])),
            (&vm2, labels(&[("tier", "build"), ("team", "storage")])),
            (&vm3, labels(&[("tier", "web")])),
        ],
    );
    let mut store = Store::connect(&etcd.url);

    // No object yet: every VM has the daemon's default, acknowledged.
    for vm in ["vm1", "vm2", "vm3"] {
        let s = wait_status(&mut store, vm, "a status", |s| !s.is_null());
        assert_eq!(s["policy"], Value::Null, "{s}");
        assert_eq!(s["generation"], 1, "the default again is no change: {s}");
        assert_eq!(s["error"], Value::Null, "{s}");
    }

    // One object for tier=build: vm1 and vm2 get it, vm3 does not.
    let rev = store.put("/dax/policies/build", BUILD);
    for vm in ["vm1", "vm2"] {
        let s = wait_status(&mut store, vm, "build applied", |s| s["revision"] == rev);
        assert_eq!(
            (s["policy"].as_str(), s["generation"].as_u64()),
            (Some("build"), Some(2)),
            "{s}"
        );
    }
    let (generation, doc) = vm1.daemon_policy().unwrap();
    assert_eq!(generation, 2);
    assert_eq!(doc["rules"][0]["path"], "logs/**", "{doc}");
    assert_eq!(status(&mut store, "vm3")["policy"], Value::Null);
    assert_eq!(vm3.daemon_policy().unwrap().0, 1, "not selected: untouched");

    // The same document again: a new revision, no new generation.
    let rev = store.put("/dax/policies/build", BUILD);
    let s = wait_status(&mut store, "vm1", "the re-put seen", |s| {
        s["revision"] == rev
    });
    assert_eq!(s["generation"], 2, "{s}");
    assert_eq!(vm1.daemon_policy().unwrap().0, 2);

    // A higher priority object for team=storage takes vm2 only.
    store.put("/dax/policies/storage", STORAGE);
    let s = wait_status(&mut store, "vm2", "storage wins", |s| {
        s["policy"] == "storage"
    });
    assert_eq!(s["generation"], 3, "{s}");
    assert_eq!(vm2.daemon_policy().unwrap().1["mode"], "never");
    assert_eq!(status(&mut store, "vm1")["policy"], "build");

    // An invalid object: reported in every status it selects, applies nothing.
    store.put("/dax/policies/bad", BAD);
    for vm in ["vm1", "vm2"] {
        let s = wait_status(&mut store, vm, "the bad object reported", |s| {
            s["error"]
                .as_str()
                .is_some_and(|e| e.contains("policy object \"bad\""))
        });
        let e = s["error"].as_str().unwrap();
        assert!(
            e.contains(r#"policy.rules[0].min_size: "12Q" is not a size"#),
            "{e}"
        );
    }
    assert_eq!(status(&mut store, "vm3")["error"], Value::Null);
    assert_eq!(vm1.daemon_policy().unwrap().0, 2, "nothing applied");
    assert_eq!(vm2.daemon_policy().unwrap().0, 3, "nothing applied");
    store.delete("/dax/policies/bad");
    wait_status(&mut store, "vm1", "the error cleared", |s| {
        s["error"].is_null()
    });

    // The REST API directly: ETag is the daemon's generation, If-Match guards a PUT.
    let (code, head, _) = raw(&vm3.api, "GET", "/api/v1/vm.dax-policy?id=fs0", &[], "");
    assert_eq!(code, 200);
    assert_eq!(header(&head, "etag"), Some("\"1\""), "{head}");
    let doc = r#"{"mode": "always"}"#;
    let (code, _, body) = raw(
        &vm3.api,
        "PUT",
        "/api/v1/vm.dax-policy?id=fs0",
        &[("If-Match", "\"5\"")],
        doc,
    );
    assert_eq!(code, 412, "{body}");
    assert!(body.contains("generation 1"), "{body}");
    assert_eq!(
        vm3.daemon_policy().unwrap().0,
        1,
        "a failed precondition changes nothing"
    );
    let (code, head, _) = raw(
        &vm3.api,
        "PUT",
        "/api/v1/vm.dax-policy?id=fs0",
        &[("If-Match", "\"1\"")],
        doc,
    );
    assert_eq!(code, 200);
    assert_eq!(header(&head, "etag"), Some("\"2\""));
    // The fleet is the source of truth: the next pass puts the default back.
    wait_for("vm3 back on the default", PATIENCE, || {
        vm3.daemon_policy()
            .is_some_and(|(_, p)| p["mode"] == "inode")
    });
    wait_status(&mut store, "vm3", "generation 3 reported", |s| {
        s["generation"] == 3
    });

    // A daemon restarted comes back with its start-up policy and gets the
    // fleet's again (the VMM re-pushes it; the agent reports it).
    vm1.restart_daemon();
    wait_for("vm1's daemon back on build", PATIENCE, || {
        vm1.daemon_policy()
            .is_some_and(|(_, p)| p["rules"][0]["path"] == "logs/**")
    });
    // A VMM restarted (and the VM defined again) gets it from the agent.
    vm2.restart_vmm();
    wait_for("vm2's new VMM told storage", PATIENCE, || {
        let (code, body) =
            crate::fleet_common::api(&vm2.api, "GET", "/api/v1/vm.dax-policy?id=fs0", None);
        code == 200 && body.contains(r#""mode":"never""#)
    });

    // The agent killed: its status goes with its lease; restarted, it comes back.
    agent.stop();
    wait_for("the dead agent's status expired", PATIENCE, || {
        store.json_under("/dax/status/h1/").is_empty()
    });
    let rev = store.put(
        "/dax/policies/build",
        &BUILD.replace(r#""default": true"#, r#""default": false"#),
    );
    agent.restart();
    let s = wait_status(
        &mut store,
        "vm1",
        "the change made while the agent was down",
        |s| s["revision"] == rev,
    );
    assert_eq!(s["policy"], "build");
    assert_eq!(vm1.daemon_policy().unwrap().1["default"], false);

    // etcd restarted: the agent reconnects, and a change made after is applied.
    etcd.restart();
    let mut store = Store::connect(&etcd.url);
    let rev = store.put("/dax/policies/storage", &STORAGE.replace("never", "always"));
    let s = wait_status(&mut store, "vm2", "applied after etcd came back", |s| {
        s["revision"] == rev
    });
    assert_eq!(s["error"], Value::Null, "{s}");
    assert_eq!(vm2.daemon_policy().unwrap().1["mode"], "always");

    // Compacted history does not stop the watch of an agent that is current.
    store.compact();
    store.delete("/dax/policies/storage");
    let s = wait_status(&mut store, "vm2", "storage gone: build applies", |s| {
        s["policy"] == "build"
    });
    assert_eq!(s["error"], Value::Null, "{s}");
}

/// etcd as fleets run it: TLS with client certificates and user
/// authentication. The agent is given the CA, its certificate and key, and
/// a user whose password it reads from a file.
#[test]
fn the_agent_talks_to_an_etcd_with_tls_client_certificates_and_users() {
    let dir = scratch("tls");
    let pki = Pki::make(&dir);
    let etcd = Etcd::start_with(&dir, Some(pki.clone()));
    let vm = Vm::create(&dir, "vm1");
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(
            std::fs::read(pki.file("ca.pem")).unwrap(),
        ))
        .identity(etcd_client::Identity::from_pem(
            std::fs::read(pki.file("client.pem")).unwrap(),
            std::fs::read(pki.file("client.key")).unwrap(),
        ));
    let mut admin = Store::connect_with(
        &etcd.url,
        Some(etcd_client::ConnectOptions::new().with_tls(tls.clone())),
    );
    admin.enable_auth("fleet-pw");
    let mut store = Store::connect_with(
        &etcd.url,
        Some(
            etcd_client::ConnectOptions::new()
                .with_tls(tls)
                .with_user("root", "fleet-pw"),
        ),
    );
    std::fs::write(dir.join("password"), "fleet-pw\n").unwrap();
    let extra = format!(
        "tls: {{ca: {}, cert: {}, key: {}}}\nauth: {{user: root, password_file: {}}}\n",
        pki.file("ca.pem").display(),
        pki.file("client.pem").display(),
        pki.file("client.key").display(),
        dir.join("password").display()
    );
    let labels: BTreeMap<&str, &str> = [("tier", "build")].into_iter().collect();
    let _agent = Agent::start_with(&dir, "h1", &etcd.url, &extra, &[(&vm, labels)]);
    let rev = store.put("/dax/policies/build", BUILD);
    let s = wait_status(&mut store, "vm1", "applied over TLS", |s| {
        s["revision"] == rev
    });
    assert_eq!(
        (s["policy"].as_str(), s["error"].clone()),
        (Some("build"), Value::Null),
        "{s}"
    );
    assert_eq!(vm.daemon_policy().unwrap().1["rules"][0]["path"], "logs/**");

    // A configuration naming a file that is not there is refused at start.
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        format!(
            "host: h\netcd: [\"{}\"]\ntls: {{ca: /nonexistent/ca.pem}}\nvms: []\n",
            etcd.url
        ),
    )
    .unwrap();
    let out = std::process::Command::new(test_infra::rig::tool("fleet", "dax-fleet").unwrap())
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls.ca: /nonexistent/ca.pem"), "{err}");
}
