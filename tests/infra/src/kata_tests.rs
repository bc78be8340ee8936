//! The expected bytes below were captured from Go's `net/http` (1.19)
//! sending Kata's generated client models (`model_*.go`), built the way
//! clh.go's CreateVM, ResizeVCPUs, ResizeMemory and vmAddNetPutRequest
//! build them, through a Transport dialing a unix socket as Kata's does.

use super::*;

fn sandbox() -> Sandbox {
    Sandbox::new(
        "/opt/kata/share/kata-containers/vmlinux.container",
        RootAsset::Image("/opt/kata/share/kata-containers/kata-containers.img".into()),
        "/run/vc/vm/sb",
        4,
        8192,
    )
}

fn text(r: &Request) -> String {
    String::from_utf8(r.to_bytes()).unwrap()
}

/// The VmConfig body Go wrote for the capture (its cmdline had `a<b&c`
/// appended to show Go's escapes).
const CAPTURED_VM_CREATE: &str = r#"{"console":{"iommu":false,"mode":"Off"},"cpus":{"boot_vcpus":1,"kvm_hyperv":false,"max_vcpus":4,"nested":true,"topology":{"cores_per_die":4,"dies_per_package":1,"packages":1,"threads_per_core":1}},"disks":[{"backing_files":false,"direct":false,"image_type":"Raw","iommu":false,"num_queues":1,"path":"/opt/kata/share/kata-containers/kata-containers.img","queue_size":128,"readonly":true,"sparse":true,"vhost_user":false}],"fs":[{"num_queues":1,"pci_segment":1,"queue_size":1024,"socket":"/run/vc/vm/sb/virtiofsd.sock","tag":"kataShared"}],"iommu":false,"landlock_enable":false,"memory":{"hotplug_method":"Acpi","hotplug_size":8589934592,"hugepages":false,"mergeable":false,"prefault":false,"shared":true,"size":2147483648,"thp":true},"payload":{"cmdline":"root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4 panic=1 no_timer_check noreplace-smp quiet a\u003cb\u0026c","kernel":"/opt/kata/share/kata-containers/vmlinux.container"},"platform":{"num_pci_segments":2,"sev_snp":false,"tdx":false},"pvpanic":false,"rng":{"iommu":false,"src":"/dev/urandom"},"serial":{"iommu":false,"mode":"Off"},"vsock":{"cid":3,"iommu":false,"socket":"/run/vc/vm/sb/clh.sock"},"watchdog":false}"#;

#[test]
fn vm_create_is_what_go_wrote() {
    let mut config = sandbox().vm_config();
    config["payload"]["cmdline"] = json!(
        "root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4 \
         panic=1 no_timer_check noreplace-smp quiet a<b&c"
    );
    assert_eq!(go_json(&config), CAPTURED_VM_CREATE);
    let body = format!("{CAPTURED_VM_CREATE}\n");
    let request = Request {
        body: Some(CAPTURED_VM_CREATE.into()),
        ..vm_create(&sandbox())
    };
    assert_eq!(
        text(&request),
        format!(
            "PUT /api/v1/vm.create HTTP/1.1\r\nHost: localhost\r\n\
             User-Agent: OpenAPI-Generator/1.0.0/go\r\nContent-Length: {}\r\n\
             Content-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n{body}",
            body.len()
        )
    );
    assert_eq!(body.len(), 1195, "Go's Content-Length");
}

#[test]
fn bodiless_calls_are_what_go_wrote() {
    assert_eq!(
        text(&vmm_ping()),
        "GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\n\
         User-Agent: OpenAPI-Generator/1.0.0/go\r\nAccept: application/json\r\n\
         Accept-Encoding: gzip\r\n\r\n"
    );
    assert_eq!(text(&vmm_ping()).len(), 139);
    assert_eq!(
        text(&vm_info()),
        "GET /api/v1/vm.info HTTP/1.1\r\nHost: localhost\r\n\
         User-Agent: OpenAPI-Generator/1.0.0/go\r\nAccept: application/json\r\n\
         Accept-Encoding: gzip\r\n\r\n"
    );
    assert_eq!(
        text(&vm_boot()),
        "PUT /api/v1/vm.boot HTTP/1.1\r\nHost: localhost\r\n\
         User-Agent: OpenAPI-Generator/1.0.0/go\r\nContent-Length: 0\r\n\
         Accept-Encoding: gzip\r\n\r\n"
    );
    assert_eq!(text(&vmm_shutdown()).len(), 136);
    assert!(text(&vmm_shutdown()).starts_with("PUT /api/v1/vmm.shutdown HTTP/1.1\r\n"));
}

#[test]
fn resizes_are_what_go_wrote() {
    assert_eq!(
        text(&vm_resize_vcpus(2)),
        "PUT /api/v1/vm.resize HTTP/1.1\r\nHost: localhost\r\n\
         User-Agent: OpenAPI-Generator/1.0.0/go\r\nContent-Length: 20\r\n\
         Content-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n\
         {\"desired_vcpus\":2}\n"
    );
    assert_eq!(text(&vm_resize_vcpus(2)).len(), 186);
    assert!(text(&vm_resize_ram(2684354560))
        .ends_with("Content-Length: 27\r\nContent-Type: application/json\r\nAccept-Encoding: gzip\r\n\r\n{\"desired_ram\":2684354560}\n"));
}

#[test]
fn add_net_is_what_go_dumped() {
    let body = add_net_body("02:00:00:00:00:01");
    assert_eq!(
        body,
        r#"{"iommu":false,"ip":"192.168.249.1","mac":"02:00:00:00:00:01","mask":"255.255.255.0","num_queues":2,"offload_csum":true,"offload_tso":true,"offload_ufo":true,"queue_size":256,"vhost_mode":"Client","vhost_user":false}"#
    );
    assert_eq!(
        add_net_request(&body),
        format!(
            "PUT /api/v1/vm.add-net HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
             Content-Length: 216\r\nContent-Type: application/json\r\n\r\n{body}"
        )
    );
}

#[test]
fn go_escapes_what_serde_json_does_not() {
    let v = json!({"b": "<>&\u{2028}\u{2029}\u{1}\u{8}\u{c}\n\"\\é", "a": [1, null, true]});
    assert_eq!(
        go_json(&v),
        r#"{"a":[1,null,true],"b":"\u003c\u003e\u0026\u2028\u2029\u0001\b\f\n\"\\é"}"#
    );
}

#[test]
fn the_default_cmdline_is_katas() {
    assert_eq!(
        sandbox().cmdline(),
        "root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4 panic=1 \
         no_timer_check noreplace-smp quiet systemd.unit=kata-containers.target \
         systemd.mask=systemd-networkd.service systemd.mask=systemd-networkd.socket \
         agent.cdh_api_timeout=50"
    );
    let mut initrd = sandbox();
    initrd.root = RootAsset::Initramfs("/i".into());
    assert!(!initrd.cmdline().contains("systemd"));
    let c = initrd.vm_config();
    assert_eq!(c["payload"]["initramfs"], "/i");
    assert!(c.get("disks").is_none());
}

#[test]
fn resize_plans_follow_katas_arithmetic() {
    let info = |boot: u64, max: u64, size_mib: u64, hotplug_mib: Option<u64>| {
        let mut memory = json!({"size": size_mib * MIB});
        if let Some(h) = hotplug_mib {
            memory["hotplug_size"] = json!(h * MIB);
        }
        json!({"config": {"cpus": {"boot_vcpus": boot, "max_vcpus": max}, "memory": memory}})
    };
    // Sent even when unchanged; cut to max_vcpus.
    assert_eq!(resize_vcpus_plan(&info(1, 4, 2048, None), 1), Ok((1, 1)));
    assert_eq!(resize_vcpus_plan(&info(1, 4, 2048, None), 9), Ok((1, 4)));
    assert!(resize_vcpus_plan(&json!({}), 2)
        .unwrap_err()
        .contains("config.cpus.boot_vcpus"));
    // 2048 + 512 MiB: 512 is a multiple of 128.
    assert_eq!(
        resize_memory_plan(&info(1, 4, 2048, Some(8192)), 2560, 128),
        Ok(Some(2560 * MIB))
    );
    // 2048 + 100 MiB is aligned up to one 128 MiB block.
    assert_eq!(
        resize_memory_plan(&info(1, 4, 2048, Some(8192)), 2148, 128),
        Ok(Some(2176 * MIB))
    );
    // Cut to hotplug_size; nothing when equal or smaller, or no hotplug_size.
    assert_eq!(
        resize_memory_plan(&info(1, 4, 2048, Some(3000)), 9000, 128),
        Ok(Some(3000 * MIB))
    );
    assert_eq!(
        resize_memory_plan(&info(1, 4, 2048, Some(8192)), 2048, 128),
        Ok(None)
    );
    assert_eq!(
        resize_memory_plan(&info(1, 4, 2048, None), 4096, 128),
        Ok(None)
    );
    // GetTotalMemoryMB and the loop's step.
    assert_eq!(
        total_memory_mib(&json!({"memory_actual_size": 2048 * MIB})),
        2048
    );
    assert_eq!(total_memory_mib(&json!({})), 0);
    assert_eq!(memory_step_mib(2048, 2560), 2560);
    assert_eq!(
        memory_step_mib(0, 2560),
        0,
        "no memory_actual_size: a step to 0"
    );
    assert_eq!(memory_step_mib(10, 1000), 490);
}
