//! Tests of `json.rs`: Cloud Hypervisor's and Kata's JSON bodies.

use serde_json::{json, Value};

use super::*;
use crate::config::{CpuTopology, RngConfig, SerialMode, Transport};

#[test]
fn ch_remote_add_fs_body_is_accepted_with_our_fields() {
    // What ch-remote puts on the wire for `add-fs tag=myfs,socket=/tmp/x.sock`.
    let body = json!({"pci_segment":0,"tag":"myfs","socket":"/tmp/x.sock","num_queues":1,"queue_size":1024});
    let f = fs_config_from_json(&body, 2).unwrap();
    assert_eq!(
        (f.tag.as_str(), f.id.as_str(), f.dax, f.cache_size),
        ("myfs", "_fs2", true, None)
    );
    let body = json!({"tag":"t","socket":"s","dax":true,"cache_size":67108864,"transport":"mmio","id":"fs0","control_socket":"/c","dax_prefault":false});
    let f = fs_config_from_json(&body, 0).unwrap();
    assert_eq!(
        (f.cache_size, f.transport, f.control_socket, f.dax_prefault),
        (Some(64 << 20), Transport::Mmio, Some("/c".into()), false)
    );
    // A policy document comes back normalized, and round-trips.
    let body =
        json!({"tag":"t","socket":"s","dax_policy":{"rules":[{"min_size":"1M","dax":true}]}});
    let f = fs_config_from_json(&body, 0).unwrap();
    let doc = f.dax_policy.clone().expect("kept");
    assert_eq!(doc["rules"][0]["dax"], true, "{doc}");
    assert!(doc.get("default").is_some(), "normalized: {doc}");
    let mut c = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).unwrap();
    c.fs.push(f);
    let info = vm_config_to_json(&c);
    assert_eq!(info["fs"][0]["dax_policy"], doc);
    let again = json!({"tag":"t","socket":"s","dax_policy":{"mode":"sometimes"}});
    assert!(fs_config_from_json(&again, 0)
        .unwrap_err()
        .to_string()
        .contains("dax_policy: mode"));
}

#[test]
fn bad_bodies_name_the_field() {
    let e = |v: Value| fs_config_from_json(&v, 0).unwrap_err().to_string();
    // Cloud Hypervisor's FsConfig has no `cache`: ignored, as it ignores it.
    assert!(fs_config_from_json(&json!({"tag":"t","socket":"s","cache":"always"}), 0).is_ok());
    assert!(e(json!({"tag":"t","socket":"s","num_queues":null}))
        .contains("FsConfig.num_queues=null is invalid"));
    assert!(e(json!({"socket":"s"})).contains("missing field `tag`"));
    assert!(e(json!({"tag":"t","socket":"s","num_queues":"two"}))
        .starts_with("FsConfig.num_queues: invalid type"));
    assert!(e(json!({"tag":"t","socket":"s","cache_size":3145728})).contains("multiple of 2M"));
    assert!(e(json!({"tag":"t","socket":"s","transport":"vsock"})).contains("pci or mmio"));
    let p = |v: Value| pmem_config_from_json(&v, 0).unwrap_err().to_string();
    assert!(p(json!({"file":"f","iommu":true})).contains("iommu"));
    assert!(p(json!({"file":"f","size":1000})).contains("multiple of 2M"));
    assert!(pmem_config_from_json(
        &json!({"pci_segment":0,"file":"/tmp/p.img","size":67108864,"discard_writes":false}),
        0
    )
    .is_ok());
}

#[test]
fn a_value_its_type_cannot_hold_names_the_field_and_type() {
    let d = disk_config_from_json(&json!({"path":"/d.img","queue_size":70000}), 0)
        .unwrap_err()
        .to_string();
    assert!(
        d.starts_with("DiskConfig.queue_size: invalid value: integer `70000`, expected u16"),
        "{d}"
    );
    let n = net_config_from_json(&json!({"mtu":70000}), 0)
        .unwrap_err()
        .to_string();
    assert!(n.starts_with("NetConfig.mtu: invalid value"), "{n}");
    let body =
        json!({"payload":{"kernel":"/k"},"disks":[{"path":"/a"},{"path":"/b","num_queues":-1}]});
    let v = vm_config_from_json(&body).unwrap_err().to_string();
    assert!(
        v.starts_with("VmConfig.disks[1].num_queues: invalid value"),
        "{v}"
    );
}

#[test]
fn net_bodies_as_kata_and_ch_remote_send_them() {
    // Kata's clh.go: NewNetConfig's defaults plus the endpoint's MAC
    // (its tap fds travel beside the body).
    let kata = json!({"ip": "192.168.249.1", "mask": "255.255.255.0", "mac": "02:42:ac:11:00:02",
        "iommu": false, "num_queues": 2, "queue_size": 256, "vhost_user": false,
        "vhost_mode": "Client", "offload_tso": true, "offload_ufo": true, "offload_csum": true});
    let n = net_config_from_json(&kata, 1).unwrap();
    assert_eq!(
        (n.mac.to_string().as_str(), n.id.as_str()),
        ("02:42:ac:11:00:02", "_net1")
    );
    assert_eq!(
        (n.num_queues, n.queue_size, n.tap.is_none()),
        (2, 256, true)
    );
    // ch-remote add-net tap=tap0,mtu=1400.
    let n =
        net_config_from_json(&json!({"tap": "tap0", "mtu": 1400, "pci_segment": 0}), 0).unwrap();
    assert_eq!((n.tap.as_deref(), n.mtu), (Some("tap0"), Some(1400)));
    let e = |b: Value| net_config_from_json(&b, 0).unwrap_err().to_string();
    assert!(e(json!({"tap": "t", "num_queues": 4})).contains("num_queues=\"4\""));
    // Fd numbers in a body mean nothing in this process: ignored.
    let n = net_config_from_json(&json!({"tap": "t", "fds": [3, 4]}), 0).unwrap();
    assert!(n.fds.is_empty());
    let two = vec![
        std::fs::File::open("/dev/null").unwrap().into(),
        std::fs::File::open("/dev/null").unwrap().into(),
    ];
    assert!(n
        .clone()
        .with_fds(two)
        .unwrap_err()
        .to_string()
        .contains("expected one tap fd"));
    let one = vec![std::fs::File::open("/dev/null").unwrap().into()];
    assert_eq!(n.with_fds(one).unwrap().fds.0.len(), 1);
    assert!(e(json!({"tap": "t", "vhost_user": true})).contains("vhost_user=on"));
    assert!(e(
        json!({"tap": "t", "rate_limiter_config": {"bandwidth": {"size": 1, "refill_time": 1}}})
    )
    .contains("rate_limiter_config"));
    assert!(net_config_from_json(&json!({"tap": "t", "speed": 1}), 0).is_ok());
    assert!(e(json!({"tap": "t", "pci_device_id": 3})).contains("pci_device_id"));
    // In a VmConfig, and back out of vm.info with the same MAC.
    let body = json!({"payload": {"kernel": "/k"}, "net": [{"tap": "tap1", "ip": "10.0.0.1", "mask": "255.0.0.0"}]});
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(c.net[0].id, "_net0");
    let info = vm_config_to_json(&c);
    assert_eq!(info["net"][0]["vhost_mode"], "Client");
    assert_eq!(vm_config_from_json(&info).unwrap(), c);
}

#[test]
fn kata_disk_bodies_are_accepted_and_round_trip() {
    // What Kata's clh.go sends for a hot-plugged block device (its Go
    // client fills the defaults NewDiskConfig sets).
    let body = json!({"path": "/run/kata/img", "readonly": true, "direct": false, "iommu": false,
        "num_queues": 2, "queue_size": 1024, "vhost_user": false, "image_type": "Raw",
        "backing_files": false, "sparse": true, "pci_segment": 0});
    let d = disk_config_from_json(&body, 3).unwrap();
    assert_eq!(
        (d.readonly, d.num_queues, d.queue_size, d.id.as_str()),
        (true, 2, 1024, "_disk3")
    );
    let mut c =
        vm_config_from_json(&json!({"payload": {"kernel": "/k"}, "disks": [body]})).unwrap();
    assert_eq!(c.disks[0].id, "_disk0");
    c.disks[0].serial = Some("S1".into());
    let info = vm_config_to_json(&c);
    assert_eq!(info["disks"][0]["image_type"], "Raw");
    assert_eq!(vm_config_from_json(&info).unwrap(), c);
    let e = |v: Value| disk_config_from_json(&v, 0).unwrap_err().to_string();
    assert!(e(
        json!({"path": "/d", "rate_limiter_config": {"bandwidth": {"size": 1, "refill_time": 1}}})
    )
    .contains("rate_limiter_config is not supported"));
    assert!(e(json!({"path": "/d", "vhost_user": true})).contains("vhost_user=on is not supported"));
    assert!(e(json!({"path": "/d", "num_queues": 0})).contains("num_queues=\"0\""));
    assert!(disk_config_from_json(&json!({"path": "/d", "cache": "none"}), 0).is_ok());
    assert!(e(json!({"readonly": true})).contains("missing required key \"path\""));
    assert!(e(json!({"path": "/d", "pci_device_id": 3})).contains("pci_device_id=3"));
}

#[test]
fn vsock_bodies_as_kata_and_ch_remote_send_them() {
    // Kata's clh.go: NewVsockConfig(cid, path) and SetIommu(false).
    let v = vsock_config_from_json(
        &json!({"cid": 3, "socket": "/run/vc/vm/x/clh.sock", "iommu": false}),
    )
    .unwrap();
    assert_eq!((v.cid, v.id.as_str()), (3, "_vsock0"));
    // An id, as other clients send.
    let v = vsock_config_from_json(&json!({"cid": 3, "socket": "/s", "id": "vsock0"})).unwrap();
    assert_eq!(v.id, "vsock0");
    // ch-remote add-vsock: its defaults too.
    let v = vsock_config_from_json(
        &json!({"cid": 4, "socket": "/s", "iommu": false, "pci_segment": 0}),
    )
    .unwrap();
    assert_eq!((v.id.as_str(), v.transport), ("_vsock0", Transport::Pci));
    let e = |b: Value| vsock_config_from_json(&b).unwrap_err().to_string();
    assert!(e(json!({"cid": 2, "socket": "/s"})).contains("cid=\"2\""));
    assert!(e(json!({"socket": "/s"})).contains("missing field `cid`"));
    assert!(vsock_config_from_json(&json!({"cid": 3, "socket": "/s", "port": 1})).is_ok());
    assert!(e(json!({"cid": 3, "socket": "/s", "pci_device_id": 5})).contains("pci_device_id"));
    // In a VmConfig, and back out of vm.info.
    let body =
        json!({"payload": {"kernel": "/k"}, "vsock": {"cid": 5, "socket": "/v", "id": "vs"}});
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(c.vsock.as_ref().map(|v| v.cid), Some(5));
    assert_eq!(vm_config_from_json(&vm_config_to_json(&c)).unwrap(), c);
    let mut dup = body.clone();
    dup["pmem"] = json!([{"file": "/p", "id": "vs"}]);
    assert!(vm_config_from_json(&dup)
        .unwrap_err()
        .to_string()
        .contains("\"vs\" is used twice"));
}

/// The cpus part of the VmConfig Kata's Cloud Hypervisor driver sends
/// (clh.go: NewCpusConfig(boot, DefaultMaxVCPUs) and a topology of
/// 1 thread x max cores x 1 die x 1 package), as its generated client
/// writes it.
#[test]
fn katas_cpus_with_max_and_topology_are_taken_and_reported() {
    let kata = json!({"boot_vcpus": 1, "max_vcpus": 4, "kvm_hyperv": false, "nested": true,
        "topology": {"threads_per_core": 1, "cores_per_die": 4, "dies_per_package": 1, "packages": 1}});
    let body = json!({"payload": {"kernel": "/k"}, "cpus": kata});
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!((c.cpus.boot_vcpus, c.cpus.max_vcpus), (1, 4));
    assert_eq!(c.cpus.topology, Some(CpuTopology::flat(4)));
    let info = vm_config_to_json(&c);
    assert_eq!(info["cpus"]["max_vcpus"], 4);
    assert_eq!(info["cpus"]["topology"], kata["topology"]);
    assert_eq!(vm_config_from_json(&info).unwrap(), c);

    let e = |cpus: Value| {
        vm_config_from_json(&json!({"payload": {"kernel": "/k"}, "cpus": cpus}))
            .unwrap_err()
            .to_string()
    };
    assert!(e(json!({"boot_vcpus": 1, "max_vcpus": 4,
        "topology": {"threads_per_core": 1, "cores_per_die": 2, "dies_per_package": 1, "packages": 1}}))
    .contains("topology=\"1:2:1:1\" is invalid: expected parts whose product (2) equals max=4"));
    assert!(
        e(json!({"boot_vcpus": 1, "max_vcpus": 4, "topology": {"threads_per_core": 1}}))
            .contains("missing field `cores_per_die`")
    );
    assert!(e(json!({"boot_vcpus": 5, "max_vcpus": 4})).contains("at most max=4"));
    assert!(e(json!({"boot_vcpus": 1, "max_vcpus": 300})).contains("1 to 254 vCPUs"));
}

#[test]
fn vm_config_round_trips_through_info() {
    let body = json!({
        "payload": {"kernel": "/k", "initramfs": "/i", "cmdline": "console=ttyS0"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 536870912u64, "shared": true},
        "serial": {"mode": "Tty"},
        "fs": [{"tag": "t", "socket": "/s", "num_queues": 1, "queue_size": 1024, "id": "fs0", "cache_size": 33554432}],
    });
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(
        (c.cpus.boot_vcpus, c.memory.size, c.serial.clone()),
        (2, 512 << 20, SerialMode::Tty)
    );
    assert_eq!(vm_config_from_json(&vm_config_to_json(&c)).unwrap(), c);
}

#[test]
fn cloud_hypervisors_own_vm_info_config_creates_a_vm_and_round_trips() {
    // Every field CH's vm.info fills; CH's defaults are accepted.
    let body = crate::config::ch_fields::tests::ch_vm_info_config();
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(
        c.rng,
        Some(RngConfig::default()),
        "rng is on, from /dev/urandom, as in CH"
    );
    assert!(!c.pvpanic, "pvpanic: false is honoured (no device)");
    let info = vm_config_to_json(&c);
    for key in [
        "kvm_hyperv",
        "max_phys_bits",
        "nested",
        "core_scheduling",
        "profile",
    ] {
        assert!(info["cpus"].get(key).is_some(), "vm.info has cpus.{key}");
    }
    assert_eq!(info["memory"]["thp"], true);
    assert_eq!(info["debug_console"]["iobase"], 233);
    assert_eq!(
        vm_config_from_json(&info).unwrap(),
        c,
        "vm.info's config creates the same VM"
    );
    // Without rng or pvpanic: both on.
    let c = vm_config_from_json(&json!({"payload": {"kernel": "/k"}})).unwrap();
    assert!(c.rng.is_some() && c.pvpanic);
}

#[test]
fn kata_puts_its_share_on_segment_one_of_two() {
    // What Kata's clh driver sends: platform.num_pci_segments 2 and the
    // virtio-fs share with pci_segment 1 (generated client's defaults).
    let body = json!({
        "payload": {"kernel": "/k"},
        "memory": {"size": 536870912u64, "shared": true},
        "platform": {"num_pci_segments": 2, "iommu_segments": null, "tdx": false},
        "fs": [{"tag": "kataShared", "socket": "/run/vc/vm/x/vhost-fs.sock", "num_queues": 1,
                "queue_size": 1024, "pci_segment": 1}],
        "disks": [{"path": "/d", "pci_segment": 0}],
    });
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(c.platform.num_pci_segments, 2);
    assert_eq!((c.fs[0].pci_segment, c.disks[0].pci_segment), (1, 0));
    let info = vm_config_to_json(&c);
    assert_eq!(info["platform"]["num_pci_segments"], 2);
    assert_eq!(info["fs"][0]["pci_segment"], 1);
    assert_eq!(vm_config_from_json(&info).unwrap(), c);

    let e = |v: Value| vm_config_from_json(&v).unwrap_err().to_string();
    let mut one = body.clone();
    one["platform"] = json!({"num_pci_segments": 1});
    assert!(e(one).starts_with("--fs: device \"_fs0\": pci_segment=1 does not exist"));
    let mut many = body.clone();
    many["platform"]["num_pci_segments"] = json!(97);
    assert!(e(many).contains("num_pci_segments=\"97\" is invalid: expected 1 to 96"));
    let mut apertures = body.clone();
    apertures["pci_segments"] = json!([{"pci_segment": 1, "mmio32_aperture_weight": 2}]);
    assert!(e(apertures).starts_with("VmConfig.pci_segments=[{"));
    let mut iommu = body.clone();
    iommu["platform"]["iommu_segments"] = json!([0]);
    assert!(e(iommu).starts_with("VmConfig.platform.iommu_segments=[0] is not supported"));
    let mut mmio = body;
    mmio["fs"][0]["transport"] = json!("mmio");
    assert!(e(mmio).contains("--fs: pci_segment=1 is not supported: a transport=mmio device"));
    // A hot-plug body names its segment the same way.
    let f = fs_config_from_json(&json!({"tag": "t", "socket": "/s", "pci_segment": 1}), 0).unwrap();
    assert_eq!(f.pci_segment, 1);
}

#[test]
fn vm_config_errors() {
    let e = |v: Value| vm_config_from_json(&v).unwrap_err().to_string();
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "rng": {"src": "/dev/urandom", "iommu": true}}))
            .contains("iommu=on")
    );
    assert!(vm_config_from_json(&json!({"payload": {"kernel": "/k"}, "frobnicate": 1})).is_ok());
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "landlock_enable": null}))
            .contains("VmConfig.landlock_enable=null is invalid")
    );
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "disks": [{"path": "/d", "vhost_user": true}]}))
            .contains("--disk: vhost_user=on is not supported")
    );
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "vdpa": [{"path": "/v"}]}))
            .contains("VmConfig.vdpa=[{\"path\":\"/v\"}] is not supported")
    );
    assert!(e(json!({"payload": {}})).contains("payload.kernel"));
    // docs/openapi.yaml: kernel has minLength 1 (the fuzzer's vm.create
    // with "" was created, then failed only at boot).
    assert!(e(json!({"payload": {"kernel": ""}}))
        .contains("payload.kernel=\"\" is invalid: expected a path to the kernel image"));
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "memory": {"size": 1024}}))
            .contains("between 32M and 512G")
    );
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "fs": [{"tag": "t", "socket": "s"}]}))
            .contains("shared=on")
    );
    assert!(
        e(json!({"payload": {"kernel": "/k"}, "console": {"mode": "Tty"}}))
            .contains("virtio-console")
    );
}

#[test]
fn kata_memory_with_acpi_hotplug_is_accepted_and_round_trips() {
    // clh.go: NewMemoryConfig(size)'s defaults, shared for virtio-fs,
    // HotplugSize from default_maxmemory; Go's omitempty drops the rest.
    let body = json!({"payload": {"kernel": "/k"},
        "memory": {"size": 536870912u64, "hotplug_size": 1073741824u64, "mergeable": false,
                   "hotplug_method": "Acpi", "shared": true, "hugepages": false,
                   "prefault": false, "thp": true}});
    let c = vm_config_from_json(&body).unwrap();
    assert_eq!(c.memory.hotplug_size, Some(1 << 30));
    let info = vm_config_to_json(&c);
    assert_eq!(info["memory"]["hotplug_size"], 1u64 << 30);
    assert_eq!(info["memory"]["hotplug_method"], "Acpi");
    assert_eq!(vm_config_from_json(&info).unwrap(), c);
    let mut virtio_mem = body.clone();
    virtio_mem["memory"]["hotplug_method"] = json!("VirtioMem");
    let e = vm_config_from_json(&virtio_mem).unwrap_err().to_string();
    assert!(e.contains("memory.hotplug_method=\"VirtioMem\""), "{e}");
    let mut small = body;
    small["memory"]["hotplug_size"] = json!(64u64 << 20);
    let e = vm_config_from_json(&small).unwrap_err().to_string();
    assert!(e.contains("hotplug_size") && e.contains("128M"), "{e}");
}

/// `vm.info`'s config, byte for byte, for a VmConfig that sets every
/// field this VMM has (the text the hand-written `vm.info` gave before the
/// config types were serialized; Kata's Go and runtime-rs clients parse it).
#[test]
fn vm_info_is_byte_for_byte_what_it_was() {
    let body = json!({"payload": {"kernel": "/k", "initramfs": "/i", "cmdline": "x"},
        "rng": {"src": "/dev/random", "transport": "mmio"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 4, "topology": {"threads_per_core": 1, "cores_per_die": 4, "dies_per_package": 1, "packages": 1}},
        "memory": {"size": 1073741824u64, "shared": true, "hotplug_size": 1073741824u64, "hugepages": true},
        "serial": {"mode": "File", "file": "/tmp/s"},
        "platform": {"num_pci_segments": 3},
        "fs": [{"tag": "t", "socket": "/s", "dax": true, "cache_size": 67108864, "control_socket": "/c", "pci_segment": 2},
               {"tag": "u", "socket": "/u", "id": "fs9", "dax": false, "dax_prefault": false, "transport": "mmio"}],
        "pmem": [{"file": "/p", "size": 4194304, "discard_writes": true, "id": "pm"}, {"file": "/q"}],
        "disks": [{"path": "/d", "readonly": true, "direct": true, "num_queues": 4, "queue_size": 256, "serial": "SER",
                   "image_type": "Unknown", "lock_granularity": "ByteRange"}, {"path": "/e", "transport": "mmio"}],
        "net": [{"tap": "t0", "ip": "10.0.0.1", "mask": "255.0.0.0", "mac": "52:54:00:00:00:01", "mtu": 1400,
                 "offload_ufo": false, "vhost_mode": "Client", "offload_tso": false}],
        "vsock": {"cid": 3, "socket": "/v"},
        "pvpanic": false});
    let c = vm_config_from_json(&body).unwrap();
    let info = serde_json::to_string(&vm_config_to_json(&c)).unwrap();
    assert_eq!(info, VM_INFO);
    assert_eq!(vm_config_from_json(&vm_config_to_json(&c)).unwrap(), c);
}

const VM_INFO: &str = r#"{"console":{"mode":"Off","pci_segment":0},"cpus":{"boot_vcpus":2,"core_scheduling":"Vm","features":{"amx":false},"kvm_hyperv":false,"max_phys_bits":46,"max_vcpus":4,"nested":true,"profile":"Host","topology":{"cores_per_die":4,"dies_per_package":1,"packages":1,"threads_per_core":1}},"debug_console":{"iobase":233,"mode":"Off"},"disks":[{"backing_files":false,"direct":true,"id":"_disk0","image_type":"Raw","iommu":false,"num_queues":4,"path":"/d","pci_segment":0,"queue_size":256,"readonly":true,"serial":"SER","sparse":true,"transport":"pci","vhost_user":false},{"backing_files":false,"direct":false,"id":"_disk1","image_type":"Raw","iommu":false,"num_queues":1,"path":"/e","pci_segment":0,"queue_size":128,"readonly":false,"serial":null,"sparse":true,"transport":"mmio","vhost_user":false}],"fs":[{"cache_size":67108864,"control_socket":"/c","dax":true,"dax_policy":null,"dax_prefault":true,"id":"_fs0","num_queues":1,"pci_segment":2,"queue_size":1024,"socket":"/s","tag":"t","transport":"pci"},{"cache_size":null,"control_socket":null,"dax":false,"dax_policy":null,"dax_prefault":false,"id":"fs9","num_queues":1,"pci_segment":0,"queue_size":1024,"socket":"/u","tag":"u","transport":"mmio"}],"iommu":false,"landlock_enable":false,"memory":{"hotplug_method":"Acpi","hotplug_size":1073741824,"hugepages":true,"mergeable":false,"prefault":false,"reserve":false,"shared":true,"size":1073741824,"thp":true},"net":[{"id":"_net0","iommu":false,"ip":"10.0.0.1","mac":"52:54:00:00:00:01","mask":"255.0.0.0","mtu":1400,"num_queues":2,"offload_csum":true,"offload_tso":false,"offload_ufo":true,"pci_segment":0,"queue_size":256,"tap":"t0","transport":"pci","vhost_mode":"Client","vhost_user":false}],"payload":{"cmdline":"x","initramfs":"/i","kernel":"/k"},"platform":{"num_pci_segments":3},"pmem":[{"discard_writes":true,"file":"/p","id":"pm","iommu":false,"pci_segment":0,"size":4194304,"transport":"pci"},{"discard_writes":false,"file":"/q","id":"_pmem1","iommu":false,"pci_segment":0,"size":null,"transport":"pci"}],"pvpanic":false,"rng":{"iommu":false,"pci_segment":0,"src":"/dev/random","transport":"mmio"},"serial":{"file":"/tmp/s","mode":"File"},"vsock":{"cid":3,"id":"_vsock0","iommu":false,"pci_segment":0,"socket":"/v","transport":"pci"},"watchdog":false}"#;

/// The command line and an API body fill the same config type and go
/// through the same checks: the same value gives the same error, naming
/// the option, the key and the limit.
#[test]
fn the_command_line_and_a_body_are_checked_alike() {
    use crate::config::{DiskConfig, FsConfig, NetConfig, PmemConfig, VsockConfig};
    let body = |e: JsonConfigError| e.to_string();
    let cli = |e: ConfigError| e.to_string();
    let pairs = [
        (
            cli(DiskConfig::parse("path=/d,num_queues=0", 0).unwrap_err()),
            body(disk_config_from_json(&json!({"path": "/d", "num_queues": 0}), 0).unwrap_err()),
        ),
        (
            cli(DiskConfig::parse("path=/d,serial=123456789012345678901", 0).unwrap_err()),
            body(
                disk_config_from_json(&json!({"path": "/d", "serial": "123456789012345678901"}), 0)
                    .unwrap_err(),
            ),
        ),
        (
            cli(FsConfig::parse("tag=t,socket=/s,cache_size=3M", 0).unwrap_err()),
            body(
                fs_config_from_json(
                    &json!({"tag": "t", "socket": "/s", "cache_size": 3u64 << 20}),
                    0,
                )
                .unwrap_err(),
            ),
        ),
        (
            cli(PmemConfig::parse("file=/p,size=3M", 0).unwrap_err()),
            body(pmem_config_from_json(&json!({"file": "/p", "size": 3u64 << 20}), 0).unwrap_err()),
        ),
        (
            cli(NetConfig::parse("tap=t,mtu=67", 0).unwrap_err()),
            body(net_config_from_json(&json!({"tap": "t", "mtu": 67}), 0).unwrap_err()),
        ),
        (
            cli(VsockConfig::parse("cid=2,socket=/v").unwrap_err()),
            body(vsock_config_from_json(&json!({"cid": 2, "socket": "/v"})).unwrap_err()),
        ),
        (
            cli(DiskConfig::parse("path=/d,pci_segment=1,transport=mmio", 0).unwrap_err()),
            body(
                disk_config_from_json(
                    &json!({"path": "/d", "pci_segment": 1, "transport": "mmio"}),
                    0,
                )
                .unwrap_err(),
            ),
        ),
    ];
    for (from_cli, from_body) in pairs {
        assert_eq!(from_cli, from_body);
        assert!(from_cli.starts_with("--"), "{from_cli}");
    }
    // An id spelled out empty is refused both ways (absent, it is named).
    assert!(DiskConfig::parse("path=/d,id=", 0)
        .unwrap_err()
        .to_string()
        .contains("id=\"\" is invalid: expected a non-empty device id"));
    assert!(disk_config_from_json(&json!({"path": "/d", "id": ""}), 0)
        .unwrap_err()
        .to_string()
        .contains("id=\"\" is invalid: expected a non-empty device id"));
}

#[test]
fn null_where_the_schema_allows_it_is_not_given() {
    // Bodies as schemathesis generated them from docs/openapi.yaml
    // (`nullable: true` fields sent as null): each takes the default.
    let fs = fs_config_from_json(
        &json!({"tag":"t","socket":"s","id":null,"dax":null,"cache_size":null,
                "dax_prefault":null,"transport":null,"control_socket":null,"dax_policy":null}),
        0,
    )
    .unwrap();
    assert_eq!(
        fs,
        fs_config_from_json(&json!({"tag":"t","socket":"s"}), 0).unwrap()
    );
    let disk = disk_config_from_json(
        &json!({"path":"/d","transport":null,"serial":null,"id":null,"vhost_socket":null}),
        0,
    )
    .unwrap();
    assert_eq!(
        disk,
        disk_config_from_json(&json!({"path":"/d"}), 0).unwrap()
    );
    assert!(net_config_from_json(
        &json!({"tap":null,"mtu":null,"transport":null,"fds":null}),
        0
    )
    .is_ok());
    assert!(
        pmem_config_from_json(&json!({"file":"/p","size":2097152,"transport":null}), 0).is_ok()
    );
    assert!(vsock_config_from_json(&json!({"cid":3,"socket":"/v","transport":null})).is_ok());
    let vm = vm_config_from_json(
        &json!({"payload":{"kernel":"/k","cmdline":null,"initramfs":null},
                                         "platform":null,"disks":null,"fs":null}),
    )
    .unwrap();
    assert_eq!(
        vm,
        vm_config_from_json(&json!({"payload":{"kernel":"/k"}})).unwrap()
    );
    // Not optional in Cloud Hypervisor: still refused by name.
    let e = fs_config_from_json(&json!({"tag":"t","socket":"s","num_queues":null}), 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("FsConfig.num_queues=null is invalid"),
        "{e}"
    );
}

/// What ch-remote puts on the wire for `snapshot file:///tmp/snap` (its
/// VmSnapshotConfig serialized) and `restore source_url=file:///tmp/snap`
/// (its RestoreConfig serialized after the fds were taken out): the
/// development head's (v54 line), and v53.0's, which had fewer fields.
const CH_REMOTE_SNAPSHOT: &str = r#"{"destination_url":"file:///tmp/snap"}"#;
const CH_REMOTE_RESTORE: &str = r#"{"source_url":"file:///tmp/snap","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}"#;
const CH_REMOTE_53_RESTORE: &str = r#"{"source_url":"file:///tmp/snap","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"resume":false}"#;

#[test]
fn ch_remote_snapshot_and_restore_bodies_are_accepted() {
    let s = snapshot_config_from_json(&serde_json::from_str(CH_REMOTE_SNAPSHOT).unwrap()).unwrap();
    assert_eq!(s.destination_dir, std::path::Path::new("/tmp/snap"));
    for body in [CH_REMOTE_RESTORE, CH_REMOTE_53_RESTORE] {
        let r = restore_config_from_json(&serde_json::from_str(body).unwrap()).unwrap();
        assert_eq!(
            r,
            RestoreConfig {
                source_dir: "/tmp/snap".into(),
                prefault: false,
                resume: false,
                net_fds: Vec::new(),
            }
        );
    }
    // Every field but the URL has a default; unknown fields are ignored.
    let r = restore_config_from_json(
        &json!({"source_url": "file:///s", "resume": true, "prefault": true, "later_field": 1}),
    )
    .unwrap();
    assert_eq!((r.prefault, r.resume), (true, true));
    let s = snapshot_config_from_json(&json!({"destination_url": "file:///d", "x": null})).unwrap();
    assert_eq!(s.destination_dir, std::path::Path::new("/d"));
    // Empty fd lists carry nothing to refuse.
    assert!(restore_config_from_json(
        &json!({"source_url": "file:///s", "net_fds": [], "vfio_fds": []})
    )
    .is_ok());
}

/// What ch-remote v53 sends for `restore
/// source_url=file:///tmp/snap,net_fds=[net0@[3],net1@[4]]` (the fd
/// numbers taken out of the body: the fds go as SCM_RIGHTS).
const CH_REMOTE_53_RESTORE_NET_FDS: &str = r#"{"source_url":"file:///tmp/snap","prefault":false,"memory_restore_mode":"Copy","net_fds":[{"id":"net0","num_fds":1,"fds":null},{"id":"net1","num_fds":1,"fds":null}],"resume":false}"#;

#[test]
fn ch_remotes_net_fds_name_the_devices_and_their_fd_counts() {
    let r = restore_config_from_json(&serde_json::from_str(CH_REMOTE_53_RESTORE_NET_FDS).unwrap())
        .unwrap();
    let net = |id: &str| crate::config::RestoredNet {
        id: id.into(),
        num_fds: 1,
    };
    assert_eq!(r.net_fds, [net("net0"), net("net1")]);
    let r = restore_config_from_json(
        &json!({"source_url": "file:///s", "net_fds": [{"id": "net2", "num_fds": 1, "fds": []}]}),
    )
    .unwrap();
    assert_eq!(r.net_fds, [net("net2")]);
}

#[test]
fn bad_snapshot_and_restore_bodies_are_refused_naming_the_field() {
    let r = |v: Value| restore_config_from_json(&v).unwrap_err().to_string();
    let s = |v: Value| snapshot_config_from_json(&v).unwrap_err().to_string();
    let mut ondemand: Value = serde_json::from_str(CH_REMOTE_RESTORE).unwrap();
    ondemand["memory_restore_mode"] = json!("OnDemand");
    assert_eq!(
        r(ondemand),
        "RestoreConfig.memory_restore_mode=\"OnDemand\" is not supported (only the default \"Copy\" is)"
    );
    assert_eq!(
        r(json!({"source_url": "tcp://10.0.0.1/s"})),
        format!("RestoreConfig.source_url=\"tcp://10.0.0.1/s\" is invalid: expected {FILE_URL_EXPECTED}")
    );
    assert_eq!(
        s(json!({"destination_url": "/tmp/snap"})),
        format!("VmSnapshotConfig.destination_url=\"/tmp/snap\" is invalid: expected {FILE_URL_EXPECTED}")
    );
    // net_fds: fd numbers of the sender's process, a device named twice,
    // no fd, a field RestoredNetConfig does not have.
    assert_eq!(
        r(
            json!({"source_url": "file:///s", "net_fds": [{"id": "net0", "num_fds": 1, "fds": [3]}]})
        ),
        "RestoreConfig.net_fds[0].fds=[3] is not supported by this VMM (only null or [])"
    );
    assert_eq!(
        r(json!({"source_url": "file:///s", "net_fds": [
            {"id": "net0", "num_fds": 1, "fds": null}, {"id": "net0", "num_fds": 1}]})),
        "RestoreConfig.net_fds[].id=\"net0\" is invalid: expected each net device named once"
    );
    assert!(
        r(json!({"source_url": "file:///s", "net_fds": [{"id": "net0", "num_fds": 0}]}))
            .starts_with("RestoreConfig.net_fds[].num_fds=0 is invalid")
    );
    assert!(
        r(json!({"source_url": "file:///s", "net_fds": [{"id": "net0", "num_fds": -1}]}))
            .starts_with("RestoreConfig.net_fds[0].num_fds: ")
    );
    assert!(
        r(json!({"source_url": "file:///s", "net_fds": [{"num_fds": 1}]}))
            .contains("missing field `id`")
    );
    assert!(
        r(json!({"source_url": "file:///s", "net_fds": {"id": "net0"}}))
            .starts_with("RestoreConfig.net_fds: expected an array")
    );
    assert!(
        r(json!({"source_url": "file:///s", "vfio_fds": [{"id": "v", "fd": null}]}))
            .starts_with("RestoreConfig.vfio_fds=")
    );
    assert!(r(json!({"source_url": "file:///s", "iommufd_fd": 7}))
        .starts_with("RestoreConfig.iommufd_fd=7"));
    assert!(r(
        json!({"source_url": "file:///s", "zone_updates": [{"id": "z", "host_numa_node": 1}]})
    )
    .starts_with("RestoreConfig.zone_updates="));
    assert!(r(json!({"prefault": true})).contains("missing field `source_url`"));
    assert!(r(json!({"source_url": "file:///s", "prefault": "yes"}))
        .starts_with("RestoreConfig.prefault: "));
    assert!(r(json!({"source_url": "file:///s", "resume": null}))
        .starts_with("RestoreConfig.resume=null is invalid"));
    assert!(r(json!({"source_url": 5})).starts_with("RestoreConfig.source_url: "));
    assert!(r(json!(["file:///s"])).starts_with("RestoreConfig: expected an object"));
    assert!(s(json!({})).contains("missing field `destination_url`"));
    assert!(s(json!({"destination_url": "file://"})).contains("is invalid"));
}
