//! Kata Containers' requests, byte for byte as its Go runtime sends them
//! (`test_infra::kata`), against the real VMM with only `--api-socket`,
//! on one kept-alive connection as Go's transport keeps it.
//!
//! Kata's default vm.create is sent, and every field refused is recorded
//! (printed as `@@gap`), given what the VMM accepts in its place, and sent
//! again, until the VM is created; a refusal of a field [`PENDING`] does
//! not list fails the test. The other tests send Kata's own values for each
//! feature (CPU and memory hot-plug, PCI segments, topology) and the
//! whole body as Kata sends it.

use std::path::Path;

use serde_json::{json, Value};
use test_infra::kata::{self, conn::Connection, RootAsset, Sandbox};

use crate::api_common::{scratch, start_vmm, wait_for, Proc};

const MIB: u64 = 1 << 20;
const CPU_HOTPLUG: &str = "ACPI CPU hot-plug";
const MEMORY_HOTPLUG: &str = "ACPI memory hot-plug";
const PCI_SEGMENTS: &str = "PCI segments";
const TOPOLOGY: &str = "cpus.topology";

/// A field of Kata's VmConfig that waits for a feature the VMM may lack
/// (CPU and memory hot-plug, PCI segments, topology): where
/// it is, how today's refusal names it, and what is accepted instead
/// (None: left out).
struct Pending {
    feature: &'static str,
    parent: &'static str,
    key: &'static str,
    needle: &'static str,
    instead: Option<fn() -> Value>,
}

const PENDING: &[Pending] = &[
    Pending {
        feature: TOPOLOGY,
        parent: "/cpus",
        key: "topology",
        needle: "VmConfig.cpus.topology",
        instead: None,
    },
    Pending {
        feature: CPU_HOTPLUG,
        parent: "/cpus",
        key: "max_vcpus",
        needle: "--cpus: max=",
        instead: Some(|| json!(1)),
    },
    Pending {
        feature: MEMORY_HOTPLUG,
        parent: "/memory",
        key: "hotplug_size",
        needle: "VmConfig.memory.hotplug_size",
        instead: None,
    },
    Pending {
        feature: PCI_SEGMENTS,
        parent: "/platform",
        key: "num_pci_segments",
        needle: "num_pci_segments",
        instead: Some(|| json!(1)),
    },
    Pending {
        feature: PCI_SEGMENTS,
        parent: "/fs/0",
        key: "pci_segment",
        needle: "--fs: only pci_segment",
        instead: Some(|| json!(0)),
    },
];

/// Kata's default sandbox on a 4-CPU, 8 GiB host: 1 vCPU of at most 4,
/// 2 GiB with 8 GiB `hotplug_size`, fs on PCI segment 1 of 2, vsock, the
/// read-only raw rootfs image, /dev/urandom, serial and console Off.
fn sandbox(dir: &Path) -> Sandbox {
    Sandbox::new(
        "/opt/kata/share/kata-containers/vmlinux.container",
        RootAsset::Image("/opt/kata/share/kata-containers/kata-containers.img".into()),
        &dir.display().to_string(),
        4,
        8192,
    )
}

fn apply_instead(body: &mut Value, p: &Pending) {
    let parent = body.pointer_mut(p.parent).expect("Kata sends the parent");
    let obj = parent.as_object_mut().expect("an object");
    match p.instead {
        Some(value) => {
            obj.insert(p.key.into(), value());
        }
        None => {
            obj.remove(p.key);
        }
    }
}

/// Kata's body with today's values for every pending field except those
/// of `keep` (features under test).
fn body_keeping(dir: &Path, keep: &[&str]) -> Value {
    let mut body = sandbox(dir).vm_config();
    for p in PENDING.iter().filter(|p| !keep.contains(&p.feature)) {
        apply_instead(&mut body, p);
    }
    body
}

fn start(name: &str) -> (Proc, std::path::PathBuf, Connection) {
    let dir = scratch(name);
    let (vmm, api) = start_vmm(&dir);
    wait_for(&api);
    let c = Connection::open(&api).unwrap();
    (vmm, dir, c)
}

fn create(c: &mut Connection, body: &Value) -> kata::conn::Response {
    c.send(&kata::vm_create_with_body(kata::go_json(body)))
        .unwrap()
}

/// vm.info as Kata reads it: 200, a JSON Content-Type (the generated
/// client fails "undefined response type" without one), the state.
fn info(c: &mut Connection, state: &str) -> Value {
    let r = c.send(&kata::vm_info()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    assert!(r.go_decodes_json());
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["state"], state, "{v}");
    v
}

#[test]
fn katas_vm_create_is_refused_only_for_issue_25s_fields() {
    let (_vmm, dir, mut c) = start("kata-gaps");
    let ping = c.send(&kata::vmm_ping()).unwrap();
    assert_eq!(ping.status, 200, "{}", ping.body);
    let mut body = sandbox(&dir).vm_config();
    let mut gaps = Vec::new();
    loop {
        let r = create(&mut c, &body);
        if r.status == 204 {
            break;
        }
        assert_eq!(r.status, 400, "vm.create: {}", r.body);
        let p = PENDING
            .iter()
            .find(|p| r.body.contains(p.needle))
            .unwrap_or_else(|| {
                panic!(
                    "Kata's vm.create refused for a field PENDING does not list: {}",
                    r.body
                )
            });
        assert!(
            !gaps
                .iter()
                .any(|(f, _): &(String, String)| f == &format!("{}/{}", p.parent, p.key)),
            "refused twice: {}",
            r.body
        );
        eprintln!(
            "@@gap needs {}: {}/{}: {}",
            p.feature, p.parent, p.key, r.body
        );
        gaps.push((format!("{}/{}", p.parent, p.key), r.body));
        apply_instead(&mut body, p);
    }
    let v = info(&mut c, "Created");
    // What Kata reads back: ResizeMemory compares config.memory.size,
    // GetTotalMemoryMB reads memory_actual_size (without it the memory
    // loop asks for 0 MiB and fails), ResizeVCPUs reads boot/max_vcpus.
    assert_eq!(v["config"]["memory"]["size"], 2048 * MIB);
    assert_eq!(v["memory_actual_size"], 2048 * MIB, "{v}");
    assert_eq!(kata::total_memory_mib(&v), 2048);
    assert_eq!(v["config"]["cpus"]["boot_vcpus"], 1);
    assert!(v["config"]["cpus"]["max_vcpus"].is_u64());
    assert_eq!(v["config"]["fs"][0]["tag"], "kataShared");
    assert_eq!(v["config"]["disks"][0]["readonly"], true);
    assert_eq!(v["config"]["vsock"]["cid"], 3);
    assert_eq!(c.dials, 1, "every call on the one kept-alive connection");
    eprintln!("@@gaps {}", gaps.len());
}

#[test]
fn katas_memory_hotplug_size_is_accepted() {
    let (_vmm, dir, mut c) = start("kata-memory");
    let r = create(&mut c, &body_keeping(&dir, &[MEMORY_HOTPLUG]));
    assert_eq!(r.status, 204, "{}", r.body);
    let v = info(&mut c, "Created");
    assert_eq!(v["config"]["memory"]["hotplug_size"], 8192 * MIB);
    assert_eq!(v["config"]["memory"]["size"], 2048 * MIB);
    assert_eq!(v["memory_actual_size"], 2048 * MIB);
    // What Kata's ResizeMemory would send for a container with a 512 MiB limit.
    assert_eq!(
        kata::resize_memory_plan(&v, 2560, kata::X86_MEMORY_BLOCK_MIB),
        Ok(Some(2560 * MIB))
    );
}

#[test]
fn katas_max_vcpus_is_accepted() {
    let (_vmm, dir, mut c) = start("kata-cpus");
    let r = create(&mut c, &body_keeping(&dir, &[CPU_HOTPLUG]));
    assert_eq!(r.status, 204, "{}", r.body);
    let v = info(&mut c, "Created");
    assert_eq!(v["config"]["cpus"]["boot_vcpus"], 1);
    assert_eq!(v["config"]["cpus"]["max_vcpus"], 4);
    assert_eq!(kata::resize_vcpus_plan(&v, 2), Ok((1, 2)));
}

#[test]
fn katas_pci_segments_are_accepted() {
    let (_vmm, dir, mut c) = start("kata-segments");
    let r = create(&mut c, &body_keeping(&dir, &[PCI_SEGMENTS]));
    assert_eq!(r.status, 204, "{}", r.body);
    let v = info(&mut c, "Created");
    assert_eq!(v["config"]["fs"][0]["pci_segment"], 1);
}

/// Kata's topology (1 thread x max cores x 1 die x 1 package) goes with
/// its max_vcpus: the product must equal it, as in Cloud Hypervisor.
#[test]
fn katas_cpu_topology_is_accepted() {
    let (_vmm, dir, mut c) = start("kata-topology");
    let r = create(&mut c, &body_keeping(&dir, &[CPU_HOTPLUG, TOPOLOGY]));
    assert_eq!(r.status, 204, "{}", r.body);
    let v = info(&mut c, "Created");
    assert_eq!(v["config"]["cpus"]["topology"]["cores_per_die"], 4);
}

#[test]
fn katas_whole_vm_create_is_accepted_as_sent() {
    let (_vmm, dir, mut c) = start("kata-whole");
    assert_eq!(c.send(&kata::vmm_ping()).unwrap().status, 200);
    let r = c.send(&kata::vm_create(&sandbox(&dir))).unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let v = info(&mut c, "Created");
    assert_eq!(v["config"]["memory"]["hotplug_size"], 8192 * MIB);
    assert_eq!(v["config"]["cpus"]["max_vcpus"], 4);
    assert_eq!(v["config"]["fs"][0]["pci_segment"], 1);
    assert_eq!(c.dials, 1);
}

/// Go's transport sends the next call only after reading the previous
/// answer to its end; an answer that ends early or late shifts every
/// later one. Fifty of Kata's calls, a 4xx among them, each answer
/// checked against its own call, on one connection.
#[test]
fn fifty_kata_calls_on_one_connection_are_answered_in_order() {
    let (_vmm, dir, mut c) = start("kata-keepalive");
    let before = c.send(&kata::vm_info()).unwrap();
    assert_eq!(
        before.status, 409,
        "vm.info before vm.create: {}",
        before.body
    );
    let r = create(&mut c, &body_keeping(&dir, &[]));
    assert_eq!(r.status, 204, "{}", r.body);
    let mut calls = 2;
    for i in 0..16 {
        let ping = c.send(&kata::vmm_ping()).unwrap();
        assert_eq!(ping.status, 200, "call {i}: {}", ping.body);
        let ping: Value = serde_json::from_str(&ping.body).unwrap();
        assert!(ping["version"].is_string(), "a vmm.ping answer: {ping}");
        info(&mut c, "Created");
        // A second vm.create: refused, the VM unchanged.
        let again = create(&mut c, &body_keeping(&dir, &[]));
        assert!(
            (400..500).contains(&again.status),
            "{}: {}",
            again.status,
            again.body
        );
        let chain: Vec<String> = serde_json::from_str(&again.body).unwrap();
        assert!(!chain.is_empty());
        calls += 3;
    }
    assert_eq!(calls, 50);
    assert_eq!(c.dials, 1, "all {calls} calls on one connection");
}
