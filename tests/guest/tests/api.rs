//! The REST API over a real unix socket, without booting a guest: the VMM
//! started with only `--api-socket`, requests shaped as ch-remote sends them
//! (no Content-Type), every malformed body answered 4xx naming the problem,
//! DAX policies pushed to a real daemon, metrics checked by `promtool`, and
//! the event stream delivering a policy change (a slow subscriber and
//! daemons that misbehave: `api_events.rs`).
//!
//! The guest-side API flow (create, add a DAX share, boot, flip a policy,
//! watch maps and reclaim) is in `virtiofs.rs`.

use std::io::{BufRead, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::api_common::{http, json, refused, scratch, start, subscribe};

#[test]
fn rest_api_over_a_unix_socket() {
    let dir = scratch("api-test");
    let (_vmm, _daemon, api, control) = start(&dir);
    let mode = std::fs::metadata(&api).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "only the VMM's user may drive the VM");

    // vmm.ping, and the state before any VM exists.
    let ping = json(&api, "GET", "/api/v1/vmm.ping", "");
    assert_eq!(ping["pid"].as_u64().map(|p| p > 0), Some(true), "{ping}");
    refused(&api, "GET", "/api/v1/vm.info", "", 409, "no VM is created");
    refused(&api, "PUT", "/api/v1/vm.boot", "", 409, "vm.create first");
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        r#"{"tag":"t","socket":"/s"}"#,
        409,
        "vm.create first",
    );
    refused(
        &api,
        "GET",
        "/api/v1/vm.nonsense",
        "",
        404,
        "no endpoint /api/v1/vm.nonsense",
    );
    refused(&api, "GET", "/api/v1/vm.boot", "", 405, "does not take GET");

    // vm.create: malformed bodies change nothing.
    refused(
        &api,
        "PUT",
        "/api/v1/vm.create",
        "",
        400,
        "a JSON body is required",
    );
    refused(&api, "PUT", "/api/v1/vm.create", "{", 400, "not valid JSON");
    refused(
        &api,
        "PUT",
        "/api/v1/vm.create",
        r#"{"payload":{"kernel":"/k"},"landlock_enable":null}"#,
        400,
        "VmConfig.landlock_enable=null is invalid",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.create",
        r#"{"payload":{"kernel":"/k"},"cpus":{"boot_vcpus":1,"max_vcpus":1,"kvm_hyperv":true}}"#,
        400,
        "VmConfig.cpus.kvm_hyperv=true is not supported",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.create",
        r#"{"payload":{"kernel":"/k"},"memory":{"size":4096}}"#,
        400,
        "between 32M and 512G",
    );
    refused(&api, "GET", "/api/v1/vm.info", "", 409, "no VM is created");
    let create = r#"{"payload":{"kernel":"/nonexistent/bzImage","cmdline":"console=ttyS0"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":268435456,"shared":true},"serial":{"mode":"Null"}}"#;
    assert_eq!(http(&api, "PUT", "/api/v1/vm.create", create).0, 204);
    refused(
        &api,
        "PUT",
        "/api/v1/vm.create",
        create,
        409,
        "already created",
    );

    // Devices before boot, with ch-remote's bodies.
    let add_fs = format!(
        r#"{{"pci_segment":0,"tag":"myfs","socket":"{}","num_queues":1,"queue_size":1024,"id":"fs0","cache_size":67108864,"control_socket":"{}"}}"#,
        dir.join("fs.sock").display(),
        control.display()
    );
    assert_eq!(http(&api, "PUT", "/api/v1/vm.add-fs", &add_fs).0, 204);
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        &add_fs,
        409,
        "\"fs0\" is used twice",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        r#"{"tag":"t","socket":"/s","num_queues":null}"#,
        400,
        "FsConfig.num_queues=null is invalid",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        r#"{"socket":"/s"}"#,
        400,
        "missing field `tag`",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        r#"{"tag":"t","socket":"/s","cache_size":3145728}"#,
        400,
        "multiple of 2M",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-fs",
        r#"{"tag":"t","socket":"/s","transport":"vsock"}"#,
        400,
        "pci or mmio",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.add-pmem",
        r#"{"file":"/p","size":1000}"#,
        400,
        "multiple of 2M",
    );
    let add_pmem =
        r#"{"pci_segment":0,"file":"/tmp/p.img","size":67108864,"discard_writes":false}"#;
    assert_eq!(http(&api, "PUT", "/api/v1/vm.add-pmem", add_pmem).0, 204);
    let info = json(&api, "GET", "/api/v1/vm.info", "");
    assert_eq!(info["state"], "Created");
    assert_eq!(info["config"]["fs"][0]["cache_size"], 67108864);
    assert_eq!(info["config"]["fs"][0]["tag"], "myfs");
    assert_eq!(info["config"]["pmem"][0]["id"], "_pmem0");
    refused(
        &api,
        "PUT",
        "/api/v1/vm.remove-device",
        r#"{"id":"nope"}"#,
        404,
        "no device with id \"nope\"",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.remove-device",
        r#"{"name":"x"}"#,
        400,
        "missing field `id`",
    );
    assert_eq!(
        http(
            &api,
            "PUT",
            "/api/v1/vm.remove-device",
            r#"{"id":"_pmem0"}"#
        )
        .0,
        204
    );
    assert_eq!(
        json(&api, "GET", "/api/v1/vm.info", "")["config"]["pmem"]
            .as_array()
            .map(Vec::len),
        Some(0)
    );
    assert_eq!(
        json(&api, "GET", "/api/v1/vm.counters", ""),
        serde_json::json!({})
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.pause",
        "",
        409,
        "vm.pause: the VM is not running (it is Created)",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.resume",
        "",
        409,
        "vm.resume: the VM is not paused (it is Created)",
    );
    refused(&api, "PUT", "/api/v1/vm.shutdown", "", 409, "not running");

    // DAX policy for a device added before boot: its daemon answers.
    refused(
        &api,
        "GET",
        "/api/v1/vm.dax-policy",
        "",
        400,
        "id=<fs device id>",
    );
    refused(
        &api,
        "GET",
        "/api/v1/vm.dax-policy?id=_pmem9",
        "",
        404,
        "no fs device with id",
    );
    let p = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "");
    assert_eq!(p["acknowledged"]["generation"], 1, "{p}");
    assert!(p["desired"].is_null(), "{p}");

    // The event stream: subscribe, then change the policy.
    let mut events = subscribe(&api, Duration::from_secs(20));

    let bad = "rules:\n  - min_size: 32K\n    dax: true\n  - min_size: 12Q\n    dax: false\n";
    refused(
        &api,
        "PUT",
        "/api/v1/vm.dax-policy?id=fs0",
        bad,
        400,
        "rules[1].min_size",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.dax-policy?id=fs0",
        "",
        400,
        "policy document",
    );
    let policy = r#"{"mode":"inode","cache_size":"64M","window_granularity":"64K","rules":[{"path":"db/**","dax":true},{"max_size":"32K","dax":false}],"default":true}"#;
    let dry = json(
        &api,
        "PUT",
        "/api/v1/vm.dax-policy?id=fs0&dry_run=true",
        policy,
    );
    assert_eq!(
        (dry["applied"].as_bool(), dry["generation"].as_u64()),
        (Some(false), Some(1)),
        "{dry}"
    );
    assert!(
        dry["remount"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["field"] == "window_granularity")),
        "{dry}"
    );
    assert_eq!(
        json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "")["acknowledged"]["generation"],
        1,
        "a dry run changes nothing"
    );
    let put = json(&api, "PUT", "/api/v1/vm.dax-policy?id=fs0", policy);
    assert_eq!(
        (put["applied"].as_bool(), put["generation"].as_u64()),
        (Some(true), Some(2)),
        "{put}"
    );
    assert!(
        put["live"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["field"] == "rules")),
        "{put}"
    );
    let p = json(&api, "GET", "/api/v1/vm.dax-policy?id=fs0", "");
    assert_eq!(
        (
            p["desired_generation"].as_u64(),
            p["acknowledged"]["generation"].as_u64()
        ),
        (Some(2), Some(2)),
        "{p}"
    );
    assert_eq!(
        p["acknowledged"]["policy"]["window_granularity"], p["desired"]["window_granularity"],
        "{p}"
    );
    let (mut seen, mut line) = (String::new(), String::new());
    while !seen.contains("event: policy") {
        line.clear();
        assert!(
            events.read_line(&mut line).unwrap() > 0,
            "event stream closed"
        );
        seen.push_str(&line);
    }
    line.clear();
    events.read_line(&mut line).unwrap();
    assert!(
        line.contains("\"generation\":2") && line.contains("\"device\":\"fs0\""),
        "{line}"
    );

    let reset = json(&api, "DELETE", "/api/v1/vm.dax-policy?id=fs0", "");
    assert_eq!(reset["generation"], 3, "{reset}");

    // Metrics: Prometheus text that promtool accepts.
    let (status, metrics) = http(&api, "GET", "/api/v1/vm.dax-metrics", "");
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("daxvmm_fs_up{device=\"fs0\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("daxvmm_fs_policy_generation{device=\"fs0\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("daxvmm_process_page_faults_total{kind=\"minor\"}"),
        "{metrics}"
    );
    let promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus; scripts/setup-host.sh installs it)");
    promtool
        .stdin
        .as_ref()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{metrics}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A boot that cannot work fails that request; the VMM keeps serving.
    refused(
        &api,
        "PUT",
        "/api/v1/vm.boot",
        "",
        500,
        "/nonexistent/bzImage",
    );
    assert_eq!(json(&api, "GET", "/api/v1/vm.info", "")["state"], "Created");
    // Snapshot and restore, with ch-remote's bodies, refused for the
    // created VM's state with Cloud Hypervisor's 500.
    refused(
        &api,
        "PUT",
        "/api/v1/vm.snapshot",
        r#"{"destination_url":"file:///tmp/s"}"#,
        500,
        "vm.snapshot: the VM is not booted (it is Created)",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.restore",
        r#"{"source_url":"file:///tmp/s","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}"#,
        500,
        "vm.restore: a VM is already created",
    );

    check_openapi_document(&api);
    // What CH has and this VMM does not: 501 (a code ch-remote names) with the reason.
    refused(
        &api,
        "PUT",
        "/api/v1/vm.resize-disk",
        r#"{"id":"_disk0","desired_size":1048576}"#,
        501,
        "vm.resize-disk: not supported by dax-vmm: disks cannot be resized",
    );
    refused(
        &api,
        "PUT",
        "/api/v1/vm.coredump",
        r#"{"destination_url":"file:///tmp/core"}"#,
        501,
        "vm.coredump: not supported by dax-vmm: guest core dumps are not supported",
    );
    refused(
        &api,
        "GET",
        "/api/v1/vm.balloon-stats",
        "",
        501,
        "no virtio-balloon",
    );

    // vm.delete, then vmm.shutdown: answered, and the socket goes away.
    assert_eq!(http(&api, "PUT", "/api/v1/vm.delete", "").0, 204);
    refused(&api, "GET", "/api/v1/vm.info", "", 409, "no VM is created");
    // Without a VM: nothing to snapshot (404); a restore from a directory
    // that is not there is 500 naming it, and the VMM keeps serving.
    refused(
        &api,
        "PUT",
        "/api/v1/vm.snapshot",
        r#"{"destination_url":"file:///tmp/s"}"#,
        404,
        "vm.snapshot: no VM is created",
    );
    let missing = dir.join("no-snapshot");
    refused(
        &api,
        "PUT",
        "/api/v1/vm.restore",
        &format!(r#"{{"source_url":"file://{}"}}"#, missing.display()),
        500,
        &format!(
            "vm.restore: source_url: {} is not a directory",
            missing.display()
        ),
    );
    // A VmConfig as Cloud Hypervisor's own vm.info returns it (and generated
    // clients send it), every field filled: accepted, and given back.
    let ch_config = r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1,"kvm_hyperv":false,"max_phys_bits":46,"features":{"amx":false},"nested":true,"core_scheduling":"Vm","profile":"Host"},"memory":{"size":268435456,"mergeable":false,"hotplug_method":"Acpi","shared":true,"hugepages":false,"prefault":false,"reserve":false,"thp":true},"payload":{"kernel":"/nonexistent/bzImage","cmdline":"console=ttyS0","initramfs":null},"rng":{"pci_segment":0,"src":"/dev/urandom"},"serial":{"mode":"Null"},"console":{"mode":"Off","pci_segment":0},"debug_console":{"mode":"Off","iobase":233},"fs":[{"pci_segment":0,"tag":"t","socket":"/tmp/none.sock","num_queues":1,"queue_size":1024}],"pmem":null,"pvpanic":false,"iommu":false,"watchdog":false,"landlock_enable":false}"#;
    assert_eq!(http(&api, "PUT", "/api/v1/vm.create", ch_config).0, 204);
    let info = json(&api, "GET", "/api/v1/vm.info", "");
    assert_eq!(info["config"]["rng"]["src"], "/dev/urandom", "{info}");
    assert_eq!(info["config"]["cpus"]["core_scheduling"], "Vm", "{info}");
    assert_eq!(info["config"]["pvpanic"], false, "{info}");
    assert_eq!(http(&api, "PUT", "/api/v1/vm.delete", "").0, 204);
    assert_eq!(http(&api, "PUT", "/api/v1/vmm.shutdown", "").0, 204);
    let deadline = Instant::now() + Duration::from_secs(10);
    while api.exists() {
        assert!(
            Instant::now() < deadline,
            "the API socket outlived vmm.shutdown"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// docs/openapi.yaml against the running server: every documented path and
/// method is served (not 404/405), and every route the server declares is
/// documented.
fn check_openapi_document(api: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("docs/openapi.yaml")).unwrap())
            .unwrap();
    let paths = doc["paths"].as_mapping().expect("paths");
    let mut documented = Vec::new();
    for (path, item) in paths {
        let path = path.as_str().unwrap();
        documented.push(path.to_string());
        for method in ["get", "put", "delete"] {
            if item.get(method).is_none() {
                continue;
            }
            // Not probed here: one ends the VMM, one streams for ever (both tested above).
            if path == "/vmm.shutdown" || path == "/vm.dax-events" {
                continue;
            }
            let (status, text) = http(
                api,
                &method.to_uppercase(),
                &format!("/api/v1{path}?id=fs0"),
                "",
            );
            assert!(
                status != 404 || !text.contains("no endpoint"),
                "{method} {path} is documented but not served: {text}"
            );
            assert_ne!(
                status, 405,
                "{method} {path} is documented but not served: {text}"
            );
        }
    }
    let routes = std::fs::read_to_string(root.join("api/src/routes.rs")).unwrap();
    let unsupported = routes
        .split("UNSUPPORTED: &[(&str, &str)] = &[")
        .nth(1)
        .and_then(|r| r.split("];").next())
        .expect("the UNSUPPORTED table");
    for endpoint in unsupported
        .split("(\"")
        .skip(1)
        .filter_map(|r| r.split('"').next())
    {
        assert!(
            documented.iter().any(|d| d == &format!("/{endpoint}")),
            "/{endpoint} answers 501 but is not in docs/openapi.yaml"
        );
    }
    for route in routes
        .split("\"/api/v1")
        .skip(1)
        .filter_map(|r| r.split('"').next())
        .filter(|r| !r.contains('{'))
    {
        assert!(
            documented.iter().any(|d| d == route),
            "{route} is served but not in docs/openapi.yaml"
        );
    }
}
