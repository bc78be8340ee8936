//! ACPI CPU hot-plug driven through `vm.resize`, as Kata's Cloud
//! Hypervisor driver drives it. One boot checks:
//! - a VM created through the API with Kata's CpusConfig (boot 1, max 4,
//!   topology 1:4:1:1) boots with 1 CPU online and 4 possible, 1 present;
//! - `vm.resize` to the same count is 204 and changes nothing; to 3 (with
//!   ch-remote's body: the other fields null) the guest gets CPUs 1 and 2,
//!   brings them online and runs work on each (their /proc/stat time grows);
//! - `vm.resize` to 2 while paused: a resize while CPU 2's removal waits for
//!   the guest is 429 (Kata retries it); resumed, the guest offlines and
//!   ejects CPU 2 by itself and the VMM parks its vCPU;
//! - `vm.resize` to 4: CPU 2's parked vCPU comes back and CPU 3 is new;
//! - `vm.resize` to 5 or 0 is 400 naming the limit; `vm.info` reports the
//!   count as `boot_vcpus`, with max and topology as given.
//!
//! Run with `cargo test -p guest-tests -- --ignored cpu_hotplug::`.

use std::time::Duration;

use test_infra::results::Results;
use test_infra::rig::{self, Guest};

const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
resize() { api PUT /api/v1/vm.resize "{\"desired_vcpus\":$1}"; }
CPUS='{"boot_vcpus":1,"max_vcpus":4,"topology":{"threads_per_core":1,"cores_per_die":4,"dies_per_package":1,"packages":1},"kvm_hyperv":false,"nested":true}'
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":'$CPUS',"memory":{"size":536870912},"serial":{"mode":"File","file":"'$WORK'/serial.log"}}'
follow serial.log
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST same=$(resize 1)"
echo "@@HOST above=$(resize 5)"
echo "@@HOST zero=$(resize 0)"
echo "@@HOST up3=$(api PUT /api/v1/vm.resize '{"desired_vcpus":3,"desired_ram":null,"desired_balloon":null}')"
echo "@@HOST info3=$(api GET /api/v1/vm.info | grep -o '"[a-z_]*_vcpus":[0-9]*' | tr '\n' ' ')"
seen '@@GUEST worked=1'
# Paused, the guest cannot eject CPU 2 yet: a resize meanwhile is 429.
echo "@@HOST pause=$(api PUT /api/v1/vm.pause)"
echo "@@HOST down2=$(resize 2)"
echo "@@HOST pending=$(resize 4)"
echo "@@HOST resume=$(api PUT /api/v1/vm.resume)"
seen '@@GUEST down2='
# As Kata does: retry while the removal waits for the guest (429).
answers=""; i=0
while [ $i -lt 600 ]; do
  r=$(resize 4); code=${r%% *}; answers="$answers ${code#status=}"
  [ "$code" = status=429 ] || break
  sleep 0.1; i=$((i+1))
done
echo "@@HOST up4=$r"
echo "@@HOST up4_codes=$(echo $answers | tr ' ' '\n' | sort | uniq -c | tr -s ' \n' ' ')"
echo "@@HOST info4=$(api GET /api/v1/vm.info)"
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
"#;

const GUEST_SCRIPT: &str = r#"
C=/sys/devices/system/cpu
wait_for() { i=0; until eval "$1"; do [ $i -ge 1200 ] && return 1; sleep 0.1; i=$((i+1)); done; }
cpus() { echo "online:$(cat $C/online) present:$(cat $C/present) possible:$(cat $C/possible)"; }
# user + nice + system ticks of one CPU.
busy_ticks() { grep "^cpu$1 " /proc/stat | { read n u ni s rest; echo $((u + ni + s)); }; }
online_all() { for c in "$@"; do [ "$(cat $C/cpu$c/online)" = 1 ] || echo 1 > $C/cpu$c/online; done; }
echo "@@GUEST boot=$(cpus)"
echo "@@GUEST ready=1"
wait_for '[ "$(cat $C/present)" = 0-2 ]'
echo "@@GUEST added=$(cpus)"
echo "@@GUEST auto_online=cpu1:$(cat $C/cpu1/online) cpu2:$(cat $C/cpu2/online)"
online_all 1 2
echo "@@GUEST up3=$(cpus)"
before="$(busy_ticks 1) $(busy_ticks 2)"
if command -v taskset >/dev/null; then how=taskset; else how=spread; fi
pids=""
for c in 0 1 2; do
  if [ $how = taskset ]; then taskset -c $c sh -c 'while :; do :; done' & else sh -c 'while :; do :; done' & fi
  pids="$pids $!"
done
sleep 4; kill $pids
after="$(busy_ticks 1) $(busy_ticks 2)"
echo "@@GUEST work=$how before:$before after:$after"
echo "@@GUEST worked=1"
wait_for '[ "$(cat $C/present)" = 0-1 ]'
echo "@@GUEST down2=$(cpus) cpu2_dir:$([ -e $C/cpu2 ] && echo present || echo gone)"
wait_for '[ "$(cat $C/present)" = 0-3 ]'
online_all 2 3
echo "@@GUEST up4=$(cpus)"
echo "@@GUEST hotplug_errors=$(dmesg | grep -i 'acpi.*processor\|cpu.*hotplug\|smpboot' | grep -ci 'fail\|error\|timed out\|stuck')"
echo "@@GUEST up=1"
poweroff -f
"#;

/// Per-CPU busy ticks from `before:A B after:C D`: (cpu1 grew, cpu2 grew).
fn grew(work: &str) -> (bool, bool) {
    let nums: Vec<u64> = work
        .split([' ', ':'])
        .filter_map(|w| w.parse().ok())
        .collect();
    match nums[..] {
        [b1, b2, a1, a2] => (a1 > b1, a2 > b2),
        _ => (false, false),
    }
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn vcpus_hot_plug_and_unplug_through_vm_resize() {
    let mut guest = Guest::new("cpu_hotplug", GUEST_SCRIPT);
    let daxprobe = rig::tool("guest-tools", "daxprobe").expect("daxprobe");
    guest.host_tools = vec![daxprobe];
    guest.host_after = HOST_AFTER.into();
    guest.vmm_args = vec!["-v".into()];
    guest.api_script = Some(API_SCRIPT.into());
    guest.timeout = Duration::from_secs(900);
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.host("create"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");
    assert_eq!(
        run.guest("boot"),
        Some("online:0 present:0 possible:0-3"),
        "1 CPU at boot, 4 possible\n{tail}"
    );

    // Same count: nothing to do. Out of bounds: 400 naming the limit.
    assert_eq!(run.host("same"), Some("status=204 body="), "{tail}");
    for key in ["above", "zero"] {
        let r = run.host(key).unwrap_or_default();
        assert!(
            r.starts_with("status=400") && r.contains("max_vcpus=4"),
            "{key}: {r}\n{tail}"
        );
    }

    // Up to 3 with ch-remote's body; the guest registers the new CPUs.
    assert_eq!(run.host("up3"), Some("status=204 body="), "{tail}");
    assert_eq!(
        run.host("info3").map(str::trim),
        Some("\"boot_vcpus\":3 \"max_vcpus\":4"),
        "vm.info reports the count asked for\n{tail}"
    );
    assert_eq!(
        run.guest("added").map(|a| a.contains("present:0-2")),
        Some(true),
        "{tail}"
    );
    assert_eq!(
        run.guest("up3"),
        Some("online:0-2 present:0-2 possible:0-3"),
        "{tail}"
    );
    let work = run.guest("work").unwrap_or_default();
    assert_eq!(
        grew(work),
        (true, true),
        "the new CPUs ran the guest's work: {work}\n{tail}"
    );

    // Down to 2 (while paused): asked, not done until the guest ejects;
    // a resize meanwhile is 429 with Cloud Hypervisor's meaning.
    assert_eq!(run.host("pause"), Some("status=204 body="), "{tail}");
    assert_eq!(run.host("down2"), Some("status=204 body="), "{tail}");
    let pending = run.host("pending").unwrap_or_default();
    assert!(
        pending.starts_with("status=429") && pending.contains("vCPU 2 is still being removed"),
        "{pending}\n{tail}"
    );
    assert_eq!(run.host("resume"), Some("status=204 body="), "{tail}");
    // Resumed, the guest offlines and ejects CPU 2 on its own.
    assert_eq!(
        run.guest("down2"),
        Some("online:0-1 present:0-1 possible:0-3 cpu2_dir:gone"),
        "{tail}"
    );
    let text = run.text();
    assert!(
        text.contains("vCPU 2: ejected by the guest"),
        "the VMM parked vCPU 2 on the guest's eject\n{tail}"
    );

    // Up to 4: retried through 429s (if any) until the eject completed.
    assert_eq!(run.host("up4"), Some("status=204 body="), "{tail}");
    let codes = run.host("up4_codes").unwrap_or_default();
    assert!(
        codes
            .split_whitespace()
            .collect::<Vec<_>>()
            .chunks(2)
            .all(|c| c
                .get(1)
                .is_some_and(|code| *code == "429" || *code == "204")),
        "only 429 before the 204: {codes}\n{tail}"
    );
    let info4 = run.host("info4").unwrap_or_default();
    assert!(
        info4.contains("\"boot_vcpus\":4")
            && info4.contains("\"max_vcpus\":4")
            && info4.contains("\"cores_per_die\":4")
            && info4.contains("\"threads_per_core\":1"),
        "{info4}\n{tail}"
    );
    assert_eq!(
        run.guest("up4"),
        Some("online:0-3 present:0-3 possible:0-3"),
        "CPU 2 came back (its parked vCPU) and CPU 3 is new\n{tail}"
    );
    assert_eq!(run.guest("hotplug_errors"), Some("0"), "{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new("cpu_hotplug");
    results.record_run("vCPU hot-plug 1 -> 3 -> 2 -> 4", &run);
    results.record(
        "hot-added CPUs online without a write to cpuN/online",
        run.guest("auto_online").unwrap_or("?"),
    );
    results.record(
        "vm.resize answers after resume, until CPU 2's eject completed",
        codes,
    );
    results.record("per-CPU work", work);
    results.save().expect("write results");
}
