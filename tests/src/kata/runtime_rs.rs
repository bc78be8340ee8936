//! Kata Containers' runtime-rs (the default runtime since Kata 4.0), its
//! Cloud Hypervisor driver: the `vm.create` body it sends for a default
//! sandbox, byte for byte. Written from reading runtime-rs's source
//! (kata-containers `main` at 7c6ba40c54ea), not copied:
//!
//! - `src/runtime-rs/crates/hypervisor/ch-config/src/lib.rs`: the serde
//!   structs. `Option` fields without `skip_serializing_if` go out as
//!   `null` (`payload.firmware`, `initramfs`, `mrconfigid`, `host_data`;
//!   a disk's `vhost_socket`, `rate_limiter_config`, `id`; an fs's and the
//!   vsock's `id`; the consoles' `file`); `VmConfig.kernel`, `initramfs`,
//!   `balloon`, `pmem`, `net`, `platform` and `cmdline` are left out when
//!   unset or empty; `max_phys_bits` when 0.
//! - `convert.rs`: `VmConfig::try_from(NamedHypervisorConfig)`. One
//!   read-only disk for the image (1 queue of 128, `image_type` left at
//!   its default `Unknown`); memory shared, with `hotplug_size` the host's
//!   RAM less the sandbox's, rounded up to 2 MiB as
//!   `checked_next_multiple_of` does (a whole 2 MiB more when already
//!   aligned); cpus with `max_phys_bits` 46, a flat topology of
//!   `max_vcpus` cores, `nested` from `disable_nested_virtualization`;
//!   serial and console off (no debug); vsock cid 3; rng `/dev/urandom`.
//! - `ch_api.rs` `cloud_hypervisor_vm_create`: the body is
//!   `serde_json::to_string_pretty` of that VmConfig (fields in struct
//!   order, two-space indents).
//! - `src/runtime-rs/crates/hypervisor/src/ch/inner_device.rs`
//!   `get_shared_devices`: `fs` is the virtio-fs share (`kataShared`, on
//!   segment 0, 1 queue of `virtio_fs_queue_size`), `devices` is always
//!   there (empty without VFIO); the net devices go out later, one
//!   `vm.add-net` each, not in this body.
//! - `configuration-clh-runtime-rs.toml.in` and the Makefile: 1 vCPU,
//!   2048 MiB, `static_sandbox_resource_mgmt = true` (so `max_vcpus` is
//!   `boot_vcpus`: `cpu_mem/initial_size.rs` `setup_config`),
//!   `virtio_fs_queue_size` 1024, `disable_nested_virtualization = false`,
//!   rootfs ext4 on virtio-blk.
//!
//! Shared by the API's unit test (the VMM must accept this body) and the
//! guest test that replays a runtime-rs sandbox start.

/// `DEFVCPUS`: the sandbox's vCPUs (also `max_vcpus`, with static sizing).
pub const DEFAULT_VCPUS: u32 = 1;
/// `DEFMEMSZ`: the sandbox's memory in MiB.
pub const DEFAULT_MEMORY_MIB: u64 = 2048;
/// `DEFVIRTIOFSQUEUESIZE`: the virtio-fs queue size.
pub const VIRTIO_FS_QUEUE_SIZE: u16 = 1024;
/// `share_fs` `MOUNT_GUEST_TAG`: the share's tag.
pub const SHARE_TAG: &str = "kataShared";
/// `convert.rs` `DEFAULT_VSOCK_CID`.
pub const GUEST_VSOCK_CID: u32 = 3;

const MIB: u64 = 1 << 20;

/// What varies between sandboxes and hosts in runtime-rs's default body.
#[derive(Clone, Debug)]
pub struct DefaultSandbox {
    /// `kernel` of the configuration file.
    pub kernel: String,
    /// `image` of the configuration file: the root image, a read-only disk.
    pub image: String,
    /// The guest command line ([`default_cmdline`] for an unchanged
    /// configuration file).
    pub cmdline: String,
    /// `<sandbox dir>/…/virtiofsd.sock`, which the daemon creates.
    pub virtiofsd_socket: String,
    /// `/run/kata/<sandbox id>/ch-vm.sock`: the hybrid vsock's socket.
    pub vsock_socket: String,
    /// The host's RAM in bytes (`sysinfo`'s `ram_total`), which sets
    /// `memory.hotplug_size`.
    pub host_ram: u64,
}

/// `inner_hypervisor.rs` `get_kernel_params` for an unchanged
/// configuration file (no debug, ext4 root on virtio-blk, no verity, no
/// extra `kernel_params`).
pub fn default_cmdline() -> String {
    [
        // KernelParams::new(false)
        "reboot=k panic=1 systemd.unit=kata-containers.target",
        "systemd.mask=systemd-networkd.service systemd.mask=systemd-networkd.socket",
        // no debug: "quiet" instead of a console
        "quiet",
        // new_rootfs_kernel_params(virtio-blk, ext4)
        "root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4",
        // the options CH needs
        "no_timer_check noreplace-smp systemd.log_target=console",
    ]
    .join(" ")
}

/// `convert.rs`: the host's RAM less the sandbox's, rounded up to a
/// multiple of 2 MiB the way `checked_next_multiple_of` does it (which adds
/// a whole 2 MiB to a size already aligned).
pub fn hotplug_size(host_ram: u64, memory: u64) -> u64 {
    let free = host_ram.saturating_sub(memory);
    free - free % (2 * MIB) + 2 * MIB
}

/// The exact bytes of runtime-rs's `vm.create` body for `sandbox`.
pub fn vm_create_body(sandbox: &DefaultSandbox) -> String {
    let s = |v: &str| serde_json::to_string(v).expect("a string serializes");
    let memory = DEFAULT_MEMORY_MIB * MIB;
    format!(
        r#"{{
  "cpus": {{
    "boot_vcpus": {vcpus},
    "max_vcpus": {vcpus},
    "topology": {{
      "threads_per_core": 1,
      "cores_per_die": {vcpus},
      "dies_per_package": 1,
      "packages": 1
    }},
    "kvm_hyperv": false,
    "nested": true,
    "max_phys_bits": 46,
    "features": {{
      "amx": false
    }}
  }},
  "memory": {{
    "size": {memory},
    "mergeable": false,
    "hotplug_method": "Acpi",
    "hotplug_size": {hotplug},
    "shared": true,
    "hugepages": false,
    "prefault": false
  }},
  "payload": {{
    "firmware": null,
    "kernel": {kernel},
    "cmdline": {cmdline},
    "initramfs": null,
    "mrconfigid": null,
    "host_data": null
  }},
  "disks": [
    {{
      "path": {image},
      "readonly": true,
      "direct": false,
      "iommu": false,
      "num_queues": 1,
      "queue_size": 128,
      "vhost_user": false,
      "vhost_socket": null,
      "rate_limiter_config": null,
      "id": null,
      "disable_io_uring": false,
      "pci_segment": 0,
      "sparse": true,
      "image_type": "Unknown"
    }}
  ],
  "rng": {{
    "src": "/dev/urandom",
    "iommu": false
  }},
  "fs": [
    {{
      "tag": {tag},
      "socket": {fs_socket},
      "num_queues": 1,
      "queue_size": {fs_queue},
      "id": null,
      "pci_segment": 0
    }}
  ],
  "serial": {{
    "file": null,
    "mode": "Off",
    "iommu": false
  }},
  "console": {{
    "file": null,
    "mode": "Off",
    "iommu": false
  }},
  "devices": [],
  "vsock": {{
    "cid": {cid},
    "socket": {vsock_socket},
    "iommu": false,
    "id": null,
    "pci_segment": 0
  }},
  "iommu": false,
  "watchdog": false
}}"#,
        vcpus = DEFAULT_VCPUS,
        hotplug = hotplug_size(sandbox.host_ram, memory),
        kernel = s(&sandbox.kernel),
        cmdline = s(&sandbox.cmdline),
        image = s(&sandbox.image),
        tag = s(SHARE_TAG),
        fs_socket = s(&sandbox.virtiofsd_socket),
        fs_queue = VIRTIO_FS_QUEUE_SIZE,
        cid = GUEST_VSOCK_CID,
        vsock_socket = s(&sandbox.vsock_socket),
    )
}
