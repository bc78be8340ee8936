//! Host drains with `dax-fleet` against a real etcd, real VMMs and daemons
//! (see `fleet_common::spare` for how two hosts share one machine):
//! - a running VM on h1 drained to h2 moves into h2's spare, which h2's
//!   agent adopts: its policy status comes from h2 and a policy change
//!   reaches its new daemon, while h1 lets go of it, also once both agents
//!   restarted; drained from h2, it comes back to a spare on h1 in the
//!   same way;
//! - a VM whose destination cannot take it (no daemon at its fs socket)
//!   fails with the error in its drain status and keeps running on h1,
//!   its share with it (a policy still reaches its daemon), the spare
//!   serving again; it is tried again only when the drain key is written
//!   again;
//! - a drain whose destination has no spare free waits with the refusal
//!   in its status, one whose destination never answers fails after the
//!   receiver timeout, an invalid drain key is reported by field, and
//!   deleting the drain key ends the waiting.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use crate::fleet_common::spare::{halting_kernel, Spare};
use crate::fleet_common::{
    daemon_policy, free_port, scratch, vm_state, wait_for, Agent, Etcd, Store, Vm,
};

const PATIENCE: Duration = Duration::from_secs(90);
const BUILD: &str = r#"{"selector": {"tier": "build"}, "priority": 10, "policy": {"rules": [{"path": "logs/**", "dax": false}], "default": true}}"#;
const DRAIN: &str = r#"{"selector": {"tier": "build"}, "destinations": ["h2"]}"#;
const STATUS: &str = "/dax/drain-status/h1/vm1";

fn get(store: &mut Store, key: &str) -> Value {
    store.json_under(key).remove(key).unwrap_or(Value::Null)
}

/// Waits until the JSON at `key` satisfies `ok`; answers it.
fn wait_value(store: &mut Store, key: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let last = get(store, key);
        if ok(&last) {
            return last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{key}: {what}; last {last}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn build_labels() -> BTreeMap<&'static str, &'static str> {
    [("tier", "build")].into_iter().collect()
}

/// h2's `receive` section: one port on 127.0.0.1, the spares given.
fn receive_section(spares: &[&std::path::Path]) -> String {
    let port = free_port();
    let list: Vec<String> = spares
        .iter()
        .map(|s| format!("    - api_socket: {}\n", s.display()))
        .collect();
    format!(
        "receive:\n  listen: 127.0.0.1\n  advertise: 127.0.0.1\n  ports: [{port}, {port}]\n  spares:\n{}",
        list.concat()
    )
}

#[test]
fn a_drained_vm_moves_to_a_spare_on_another_host_and_back() {
    let dir = scratch("drain");
    let etcd = Etcd::start(&dir);
    let kernel = halting_kernel(&dir);
    let mut vm1 = Vm::create_booted(&dir, "vm1", &kernel);
    let mut on_h2 = Spare::start(&dir, "h2", &vm1);
    on_h2.start_daemon();
    let on_h1 = Spare::start_at_home(&dir, "h1", &vm1);
    let mut h1 = Agent::start_with(
        &dir,
        "h1",
        &etcd.url,
        &receive_section(&[&on_h1.api]),
        &[(&vm1, build_labels())],
    );
    let mut h2 = Agent::start_with(&dir, "h2", &etcd.url, &receive_section(&[&on_h2.api]), &[]);
    let mut store = Store::connect(&etcd.url);
    let rev = store.put("/dax/policies/build", BUILD);
    wait_value(&mut store, "/dax/status/h1/vm1/fs0", "build on h1", |s| {
        s["revision"] == rev
    });

    let drain = store.put("/dax/drain/h1", DRAIN);
    let done = wait_value(&mut store, STATUS, "migrated", |s| s["state"] == "migrated");
    assert_eq!(
        (
            &done["destination"],
            &done["error"],
            &done["drain_revision"]
        ),
        (&Value::from("h2"), &Value::Null, &Value::from(drain)),
        "{done}"
    );
    assert_eq!(
        on_h2.vm_state().as_deref(),
        Some("Running"),
        "in h2's spare"
    );
    wait_for("the source VMM exited", PATIENCE, || vm1.vmm_exited());
    let adopted = get(&mut store, "/dax/adopted/h2/vm1");
    assert_eq!(adopted["api_socket"], on_h2.api.display().to_string());
    assert_eq!(
        (&adopted["from"], &adopted["labels"]["tier"]),
        (&Value::from("h1"), &Value::from("build"))
    );
    assert!(store.json_under("/dax/incoming/").is_empty());
    // h2 manages it: its status comes from h2, h1's goes, and a policy
    // change reaches the daemon on h2.
    let s = wait_value(&mut store, "/dax/status/h2/vm1/fs0", "status on h2", |s| {
        s["policy"] == "build" && s["revision"] == rev
    });
    assert_eq!(s["error"], Value::Null, "{s}");
    wait_for("h1 let go of vm1", PATIENCE, || {
        store.json_under("/dax/status/h1/").is_empty()
    });
    let rev = store.put(
        "/dax/policies/build",
        &BUILD.replace(r#""default": true"#, r#""default": false"#),
    );
    wait_value(&mut store, "/dax/status/h2/vm1/fs0", "applied on h2", |s| {
        s["revision"] == rev && s["error"].is_null()
    });
    let (_, policy) = daemon_policy(&on_h2.control()).unwrap();
    assert_eq!(policy["default"], false, "h2's daemon has it: {policy}");

    // Both agents restarted: from etcd, h1 knows vm1 left (its drain
    // status) and h2 that its spare is vm1 (its adopted key).
    h1.restart();
    h2.restart();
    let rev = store.put("/dax/policies/build", BUILD);
    wait_value(
        &mut store,
        "/dax/status/h2/vm1/fs0",
        "applied after h2 restarted",
        |s| s["revision"] == rev && s["error"].is_null(),
    );
    assert_eq!(daemon_policy(&on_h2.control()).unwrap().1["default"], true);
    // Two of h1's resyncs: it would have reported the VMM it cannot reach.
    std::thread::sleep(Duration::from_secs(5));
    assert!(store.json_under("/dax/status/h1/").is_empty());

    // Maintenance over: h1 takes it back (into a spare there, its old
    // daemon gone and a fresh one at the same path), drained from h2.
    store.delete("/dax/drain/h1");
    wait_for("h1's daemon exited", PATIENCE, || vm1.daemon_exited());
    let mut on_h1 = on_h1;
    on_h1.start_daemon();
    store.put("/dax/drain/h2", r#"{"destinations": ["h1"]}"#);
    let back = wait_value(
        &mut store,
        "/dax/drain-status/h2/vm1",
        "migrated back",
        |s| s["state"] == "migrated",
    );
    assert_eq!(back["destination"], "h1", "{back}");
    assert_eq!(
        on_h1.vm_state().as_deref(),
        Some("Running"),
        "in h1's spare"
    );
    assert!(
        get(&mut store, "/dax/adopted/h2/vm1").is_null(),
        "h2 let go"
    );
    assert_eq!(
        get(&mut store, "/dax/adopted/h1/vm1")["api_socket"],
        on_h1.api.display().to_string()
    );
    let s = wait_value(&mut store, "/dax/status/h1/vm1/fs0", "status on h1", |s| {
        s["revision"] == rev
    });
    assert_eq!(s["error"], Value::Null, "{s}");
    wait_for("h2 let go of vm1", PATIENCE, || {
        store.json_under("/dax/status/h2/").is_empty()
    });
    assert!(
        get(&mut store, STATUS).is_null(),
        "h1's record of vm1 leaving went when it came back"
    );
}

#[test]
fn a_failed_migration_leaves_the_vm_running_on_its_host_until_the_drain_is_written_again() {
    let dir = scratch("drain-failed");
    let etcd = Etcd::start(&dir);
    let kernel = halting_kernel(&dir);
    let mut vm1 = Vm::create_booted(&dir, "vm1", &kernel);
    let mut spare = Spare::start(&dir, "h2", &vm1);
    spare.start_fake_daemon();
    let _h1 = Agent::start(&dir, "h1", &etcd.url, &[(&vm1, build_labels())]);
    let _h2 = Agent::start_with(&dir, "h2", &etcd.url, &receive_section(&[&spare.api]), &[]);
    let mut store = Store::connect(&etcd.url);

    // The destination cannot take the VM (no daemon at its fs socket):
    // the migration fails and says so; the VM runs on h1.
    let first = store.put("/dax/drain/h1", DRAIN);
    let failed = wait_value(&mut store, STATUS, "the migration failed", |s| {
        s["state"] == "failed"
    });
    assert_eq!(failed["destination"], "h2", "{failed}");
    assert_eq!(failed["drain_revision"], first, "{failed}");
    let error = failed["error"].as_str().unwrap_or_default();
    assert!(error.contains("vm.send-migration"), "{failed}");
    assert_eq!(vm_state(&vm1.api).as_deref(), Some("Running"), "on h1");
    assert!(!vm1.vmm_exited());
    assert_eq!(spare.vm_state(), None, "the spare is empty again");
    assert!(store.json_under("/dax/adopted/").is_empty());
    assert!(
        store.json_under("/dax/incoming/").is_empty(),
        "the request was withdrawn"
    );
    // Not tried again: two resyncs later the same failure stands.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(get(&mut store, STATUS), failed);
    // h1 still manages it, with its share: a policy reaches its daemon.
    let rev = store.put("/dax/policies/build", BUILD);
    let s = wait_value(&mut store, "/dax/status/h1/vm1/fs0", "applied on h1", |s| {
        s["revision"] == rev
    });
    assert_eq!(s["error"], Value::Null, "{s}");
    assert_eq!(
        vm1.daemon_policy().unwrap().1["rules"][0]["path"],
        "logs/**"
    );

    // The drain written again: tried again (the spare serves again), and
    // it fails again the same way.
    let second = store.put("/dax/drain/h1", DRAIN);
    let again = wait_value(&mut store, STATUS, "failed again", |s| {
        s["state"] == "failed" && s["drain_revision"] == second
    });
    assert!(
        again["error"]
            .as_str()
            .is_some_and(|e| e.contains("vm.send-migration")),
        "{again}"
    );
    assert_eq!(vm_state(&vm1.api).as_deref(), Some("Running"), "on h1");
    assert_eq!(spare.vm_state(), None);
}

#[test]
fn a_drain_waits_for_a_free_spare_fails_on_a_silent_host_and_ends_when_deleted() {
    let dir = scratch("drain-refused");
    let etcd = Etcd::start(&dir);
    // Created VMs (not booted): nothing here gets as far as a migration.
    let vm1 = Vm::create(&dir, "vm1");
    let busy = Vm::create(&dir, "busy");
    let _h1 = Agent::start_with(
        &dir,
        "h1",
        &etcd.url,
        "drain: {receiver_timeout: 3}\n",
        &[(&vm1, build_labels())],
    );
    let _h2 = Agent::start_with(&dir, "h2", &etcd.url, &receive_section(&[&busy.api]), &[]);
    let mut store = Store::connect(&etcd.url);

    // h2's only spare holds a VM: vm1 waits, saying why.
    let first = store.put("/dax/drain/h1", r#"{"destinations": ["h2"]}"#);
    let s = wait_value(&mut store, STATUS, "waiting for a spare", |s| {
        s["state"] == "waiting-receiver" && !s["error"].is_null()
    });
    let want = format!(
        "no destination has a receiver: h2: no spare VMM free of 1: {} has a VM",
        busy.api.display()
    );
    assert_eq!(s["error"], Value::from(want), "{s}");
    assert_eq!(s["drain_revision"], first, "{s}");

    // A destination without an agent: no receiver within the timeout.
    store.put("/dax/drain/h1", r#"{"destinations": ["h3"]}"#);
    let s = wait_value(&mut store, STATUS, "failed", |s| s["state"] == "failed");
    assert_eq!(s["destination"], "h3", "{s}");
    let want = "\"h3\" gave no receiver within 3 s (is its agent running, with a receive section?)";
    assert_eq!(s["error"], Value::from(want), "{s}");
    assert!(store.json_under("/dax/incoming/").is_empty());

    // An invalid drain is reported by field; deleting the key ends the
    // waiting of a VM (its status goes).
    store.put("/dax/drain/h1", r#"{"destinations": ["h1"]}"#);
    let s = wait_value(&mut store, "/dax/drain-status/h1/-", "the error", |s| {
        !s.is_null()
    });
    assert_eq!(
        s["error"],
        Value::from("drain of \"h1\": destinations[0]: \"h1\" is the host drained"),
        "{s}"
    );
    store.put("/dax/drain/h1", r#"{"destinations": ["h2"]}"#);
    wait_value(&mut store, STATUS, "waiting again", |s| {
        s["state"] == "waiting-receiver"
    });
    assert!(get(&mut store, "/dax/drain-status/h1/-").is_null());
    store.delete("/dax/drain/h1");
    wait_for("the waiting status gone", PATIENCE, || {
        get(&mut store, STATUS).is_null()
    });
}
