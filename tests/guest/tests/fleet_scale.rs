//! The fleet at scale (a measurement, not a speed assertion): 3 agents (3
//! "hosts" on this machine) × 20 created VMs, each a VMM with a daemon and
//! its control socket. Policy puts into a real etcd; for each, the time
//! from the put to the last matching status acknowledging it (p50/p99 over
//! the puts); then etcd restarted mid-run and the fleet converging again.
//! Writes `target/rig-results/fleet-scale.md`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::fleet_common::{scratch, Agent, Etcd, Store, Vm};
use serde_json::Value;
use test_infra::results::Results;

const HOSTS: usize = 3;
const VMS_PER_HOST: usize = 20;
const PUTS: usize = 20;
const PATIENCE: Duration = Duration::from_secs(120);

/// Every 3rd VM is tier=web, the others tier=build.
fn is_build(i: usize) -> bool {
    i % 3 != 2
}

fn doc(n: usize) -> String {
    format!(
        r#"{{"selector": {{"tier": "build"}}, "priority": 1, "policy": {{"rules": [{{"path": "run{n}/**", "dax": false}}], "default": true}}}}"#
    )
}

/// Waits until every build VM's status carries `revision`; answers how long
/// after `since` the last one did, and checks the web VMs got nothing.
fn converge(store: &mut Store, revision: i64, since: Instant) -> Duration {
    let deadline = since + PATIENCE;
    loop {
        let statuses = store.json_under("/dax/status/");
        let done = (0..HOSTS).all(|h| {
            (0..VMS_PER_HOST).filter(|&i| is_build(i)).all(|i| {
                statuses
                    .get(&format!("/dax/status/h{h}/vm{i}/fs0"))
                    .is_some_and(|s| s["revision"] == revision && s["error"].is_null())
            })
        });
        if done {
            let elapsed = since.elapsed();
            for h in 0..HOSTS {
                for i in (0..VMS_PER_HOST).filter(|&i| !is_build(i)) {
                    let s = &statuses[&format!("/dax/status/h{h}/vm{i}/fs0")];
                    assert_eq!(s["policy"], Value::Null, "h{h}/vm{i} is not selected: {s}");
                }
            }
            return elapsed;
        }
        assert!(
            Instant::now() < deadline,
            "revision {revision} not acknowledged everywhere within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[test_infra::results::nearest_rank(sorted.len(), p) - 1]
}

#[test]
#[ignore = "60 VMMs and daemons, 3 agents; run through scripts/test.sh"]
fn three_hosts_of_twenty_vms_converge_on_each_put_and_after_etcd_restarts() {
    let dir = scratch("scale");
    let mut etcd = Etcd::start(&dir);
    let started = Instant::now();
    let mut hosts = Vec::new();
    for h in 0..HOSTS {
        let vms: Vec<Vm> = (0..VMS_PER_HOST)
            .map(|i| Vm::create(&dir.join(format!("h{h}")), &format!("vm{i}")))
            .collect();
        hosts.push(vms);
    }
    let create_s = started.elapsed().as_secs_f64();
    let tier = |i: usize| if is_build(i) { "build" } else { "web" };
    let _agents: Vec<Agent> = hosts
        .iter()
        .enumerate()
        .map(|(h, vms)| {
            let list: Vec<(&Vm, BTreeMap<&str, &str>)> = vms
                .iter()
                .enumerate()
                .map(|(i, vm)| (vm, [("tier", tier(i))].into_iter().collect()))
                .collect();
            Agent::start(&dir, &format!("h{h}"), &etcd.url, &list)
        })
        .collect();
    let mut store = Store::connect(&etcd.url);
    // Every agent up and reporting before the measured puts.
    let first = store.put("/dax/policies/build", &doc(0));
    converge(&mut store, first, Instant::now());

    let mut times = Vec::new();
    for n in 1..=PUTS {
        let t = Instant::now();
        let revision = store.put("/dax/policies/build", &doc(n));
        times.push(converge(&mut store, revision, t));
    }
    times.sort();
    // Each put made a new generation in every selected daemon.
    let gen = hosts[0][0].daemon_policy().unwrap().0;
    assert!(gen > PUTS as u64, "generation {gen}");

    // etcd restarted mid-run: a put after it comes back converges again.
    etcd.stop();
    std::thread::sleep(Duration::from_secs(2));
    let restarted = Instant::now();
    etcd.restart();
    let mut store = Store::connect(&etcd.url);
    let t = Instant::now();
    let revision = store.put("/dax/policies/build", &doc(PUTS + 1));
    let after_restart = converge(&mut store, revision, t);
    let since_restart = restarted.elapsed();

    let selected = HOSTS * (0..VMS_PER_HOST).filter(|&i| is_build(i)).count();
    let mut results = Results::new("fleet-scale");
    let ms = |d: Duration| format!("{:.0} ms", d.as_secs_f64() * 1000.0);
    results.record(
        "setup",
        format!(
            "{HOSTS} agents x {VMS_PER_HOST} VMs ({selected} selected), created in {create_s:.1} s"
        ),
    );
    results.record(
        &format!("put to last acknowledgement, p50 over {PUTS} puts"),
        ms(percentile(&times, 0.5)),
    );
    results.record(
        &format!("put to last acknowledgement, p99 over {PUTS} puts"),
        ms(percentile(&times, 0.99)),
    );
    results.record("fastest put", ms(times[0]));
    results.record(
        "etcd restarted: put to last acknowledgement",
        ms(after_restart),
    );
    results.record(
        "etcd restarted: from its start to every VM acknowledging the next put",
        ms(since_restart),
    );
    let path = results.save().expect("results");
    println!("results: {}", path.display());
}
