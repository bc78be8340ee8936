use super::*;

const GIB: u64 = 1 << 30;

fn sandbox() -> RsSandbox {
    RsSandbox::new("sb1", "/k", "/img", 4, 8 * GIB, true)
}

/// runtime-rs's default VmConfig, compact, as ch-config's structs
/// serialize it (checked field by field against `lib.rs` and convert.rs).
#[test]
fn the_default_vm_config_is_runtime_rs_serde_output() {
    let want = concat!(
        r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1,"topology":{"threads_per_core":1,"#,
        r#""cores_per_die":1,"dies_per_package":1,"packages":1},"kvm_hyperv":false,"#,
        r#""nested":true,"max_phys_bits":46,"features":{"amx":false}},"#,
        r#""memory":{"size":2147483648,"mergeable":false,"hotplug_method":"Acpi","#,
        r#""hotplug_size":6444548096,"shared":true,"hugepages":false,"prefault":false},"#,
        r#""payload":{"firmware":null,"kernel":"/k","cmdline":"reboot=k panic=1 "#,
        r#"systemd.unit=kata-containers.target systemd.mask=systemd-networkd.service "#,
        r#"systemd.mask=systemd-networkd.socket quiet root=/dev/vda1 "#,
        r#"rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4 no_timer_check "#,
        r#"noreplace-smp systemd.log_target=console agent.cdh_api_timeout=50 "#,
        r#"agent.container_pipe_size=1","initramfs":null,"mrconfigid":null,"host_data":null},"#,
        r#""disks":[{"path":"/img","readonly":true,"direct":false,"iommu":false,"#,
        r#""num_queues":1,"queue_size":128,"vhost_user":false,"vhost_socket":null,"#,
        r#""rate_limiter_config":null,"id":null,"disable_io_uring":false,"pci_segment":0,"#,
        r#""sparse":true,"image_type":"Unknown"}],"#,
        r#""rng":{"src":"/dev/urandom","iommu":false},"#,
        r#""fs":[{"tag":"kataShared","socket":"/run/kata/sb1/root/virtiofsd.sock","#,
        r#""num_queues":1,"queue_size":1024,"id":null,"pci_segment":0}],"#,
        r#""serial":{"file":null,"mode":"Off","iommu":false},"#,
        r#""console":{"file":null,"mode":"Off","iommu":false},"devices":[],"#,
        r#""vsock":{"cid":3,"socket":"/run/kata/sb1/ch-vm.sock","iommu":false,"id":null,"#,
        r#""pci_segment":0},"iommu":false,"watchdog":false}"#
    );
    assert_eq!(sandbox().vm_config().compact(), want);
    // Sent with to_string_pretty.
    let pretty = sandbox().vm_config().pretty();
    assert!(
        pretty.starts_with("{\n  \"cpus\": {\n    \"boot_vcpus\": 1,\n"),
        "{pretty}"
    );
    assert!(pretty.contains("\n  \"devices\": [],\n"), "{pretty}");
    assert!(pretty.ends_with("\n  \"watchdog\": false\n}"), "{pretty}");
}

#[test]
fn dynamic_sizing_offers_the_hosts_cpus() {
    let s = RsSandbox::new("sb1", "/k", "/img", 4, 8 * GIB, false);
    let v = s.vm_config().to_value();
    assert_eq!(v["cpus"]["boot_vcpus"], 1);
    assert_eq!(v["cpus"]["max_vcpus"], 4);
    assert_eq!(v["cpus"]["topology"]["cores_per_die"], 4);
}

/// convert.rs's checked_next_multiple_of moves an aligned value a step up.
#[test]
fn hotplug_size_is_aligned_as_convert_rs_aligns_it() {
    let mut s = sandbox();
    assert_eq!(s.hotplug_size(), 6 * GIB + 2 * MIB);
    s.host_ram_bytes = 8 * GIB + 1;
    assert_eq!(s.hotplug_size(), 6 * GIB + 2 * MIB);
    s.host_ram_bytes = 8 * GIB - 1;
    assert_eq!(s.hotplug_size(), 6 * GIB);
}

#[test]
fn the_daemon_runs_on_runtime_rs_command_line() {
    assert_eq!(
        sandbox().virtiofsd_args().join(" "),
        "--socket-path /run/kata/sb1/root/virtiofsd.sock \
         --shared-dir /run/kata-containers/shared/sandboxes/sb1/ro --cache auto \
         --thread-pool-size=1 -o announce_submounts"
    );
}

#[test]
fn add_net_and_resize_bodies() {
    assert_eq!(
        add_net_body("52:54:00:ca:7a:01", &[42]),
        r#"{"ip":"192.168.249.1","mask":"255.255.255.0","mac":"52:54:00:ca:7a:01","iommu":false,"num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","fds":[42]}"#
    );
    // ch-config's own test of VmResize.
    assert_eq!(
        resize_body(Some(2), None),
        r#"{"desired_vcpus":2,"desired_ram":null,"desired_balloon":null}"#
    );
    assert_eq!(
        resize_body(None, Some(1 << 30)),
        r#"{"desired_vcpus":null,"desired_ram":1073741824,"desired_balloon":null}"#
    );
}

#[test]
fn a_containers_quota_and_limit_become_runtime_rs_requests() {
    // A quota of one CPU on top of default_vcpus 1: 2 vCPUs.
    assert_eq!(vcpus_required(1.0, &[(100_000, 100_000)]), 2);
    assert_eq!(vcpus_required(1.0, &[(50_000, 100_000)]), 2);
    assert_eq!(vcpus_required(1.0, &[(-1, 100_000)]), 1);
    assert_eq!(vcpus_required(1.0, &[]), 1);
    assert_eq!(resize_vcpus_request(1, 2, 4), Ok(Some(2)));
    assert_eq!(resize_vcpus_request(1, 8, 4), Ok(Some(4)));
    assert_eq!(resize_vcpus_request(2, 2, 4), Ok(None));
    assert!(resize_vcpus_request(1, 0, 4).is_err());
    // 512 MiB + a 512 MiB limit.
    assert_eq!(memory_required_mib(512, &[512 << 20]), 1024);
    assert_eq!(
        resize_memory_request(512 * MIB, 1024, 128, 2048),
        Ok(Some(1024 * MIB))
    );
    assert_eq!(
        resize_memory_request(512 * MIB, 1000, 128, 2048),
        Ok(Some(1024 * MIB))
    );
    assert_eq!(resize_memory_request(512 * MIB, 512, 128, 2048), Ok(None));
    assert_eq!(resize_memory_request(512 * MIB, 256, 128, 2048), Ok(None));
    assert!(resize_memory_request(512 * MIB, 4096, 128, 2048).is_err());
}
