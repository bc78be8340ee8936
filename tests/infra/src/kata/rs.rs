//! Kata Containers' Rust runtime (runtime-rs, the default since Kata 4.0)
//! and its Cloud Hypervisor driver, byte for byte: the bodies it sends,
//! the daemon's command line, and the decisions it takes from answers.
//! Written from reading kata-containers at `7c6ba40c54ea` (2026-08-22),
//! not copied: `src/runtime-rs/crates/hypervisor/ch-config/` (`lib.rs`
//! structs, `convert.rs`, `ch_api.rs`), `crates/hypervisor/src/ch/`
//! (`inner_hypervisor.rs`, `inner_device.rs`), `kernel_param.rs`,
//! `crates/resource/` (`cpu_mem/`, `share_fs/`), kata-types' defaults,
//! `config/configuration-clh-runtime-rs.toml.in` and the Makefile.
//!
//! The calls ([`api_client`](super::api_client) writes them), all on the
//! ONE connection runtime-rs opens when the VMM starts and keeps until it
//! stops it:
//!
//! ```text
//! GET vmm.ping            until it answers (handle_ch_build_features reads `features`)
//! PUT vm.create           VmConfig, serde_json::to_string_pretty
//! PUT vm.add-net          NetConfig (compact) per NIC, the tap fds on the request line's write
//! PUT vm.boot
//! (static_sandbox_resource_mgmt = false, per container)
//! PUT vm.resize           {"desired_vcpus":N,"desired_ram":null,"desired_balloon":null},
//!                         only when the vCPU count changes; no vm.info
//! GET vm.info             resize_memory, each container: config.memory.size is the current memory
//! PUT vm.resize           {"desired_vcpus":null,"desired_ram":B,"desired_balloon":null} when it grows
//! PUT vmm.shutdown        at stop; a failure leaves the VMM running
//! ```
//!
//! A `429` is an error like any other (the client has no retry).

use super::SHARE_TAG;

pub mod info;
pub mod json;

use json::Json;

const MIB: u64 = 1 << 20;
/// convert.rs `PMEM_ALIGN_BYTES`: hotplug_size is aligned to it.
const PMEM_ALIGN_BYTES: u64 = 2 * MIB;
/// convert.rs `DEFAULT_CH_MAX_PHYS_BITS`.
const MAX_PHYS_BITS: u64 = 46;
/// convert.rs `DEFAULT_VSOCK_CID`.
pub const GUEST_VSOCK_CID: u64 = 3;
/// The agent's vsock port, dialled as `connect 1024\n`
/// (agent `sock/hybrid_vsock.rs`).
pub const AGENT_PORT: u32 = 1024;
/// kata-types `KATA_PATH`: sandboxes live in `/run/kata/<id>`.
pub const KATA_PATH: &str = "/run/kata";
/// share_fs `DEFAULT_KATA_HOST_SHARED_DIR`.
pub const HOST_SHARED_DIR: &str = "/run/kata-containers/shared/sandboxes";
/// share_fs `DEFAULT_KATA_GUEST_SHARE_DIR`: where the agent mounts the share.
pub const GUEST_SHARE_DIR: &str = "/run/kata-containers/shared/containers/";
/// share_virtio_fs_standalone.rs: the share's only mount option.
pub const SHARE_OPTIONS: &[&str] = &["nodev"];
/// share_virtio_fs_standalone.rs: runtime-rs starts the VMM only after the
/// daemon printed this on its stderr.
pub const DAEMON_READY_LINE: &str = "Waiting for vhost-user socket connection";
/// The x86-64 guest memory block the agent reports (128 MiB): resize_memory
/// aligns growth to it.
pub const X86_MEMORY_BLOCK_MIB: u64 = 128;

/// One sandbox's settings that shape what runtime-rs sends.
/// [`RsSandbox::new`] gives the defaults of `configuration-clh-runtime-rs.toml`.
#[derive(Clone, Debug)]
pub struct RsSandbox {
    /// The sandbox id: its sockets live in `/run/kata/<id>`.
    pub id: String,
    /// `kernel`.
    pub kernel: String,
    /// `image` (the toml's default) — a read-only disk.
    pub image: String,
    /// `default_vcpus` (DEFVCPUS 1), after static sizing.
    pub vcpus: u32,
    /// `default_maxvcpus`: with `static_sandbox_resource_mgmt = true` (the
    /// default) the boot count; else DEFMAXVCPUS 0, i.e. the host's CPUs.
    pub max_vcpus: u32,
    /// `default_memory` (DEFMEMSZ 2048), MiB.
    pub memory_mib: u64,
    /// `default_maxmemory` (DEFMAXMEMSZ 0 = the host's RAM), MiB: the cap
    /// resize_memory checks.
    pub max_memory_mib: u64,
    /// The host's RAM in bytes (`sysinfo`): MemoryConfig's hotplug_size is
    /// all of it but the boot memory.
    pub host_ram_bytes: u64,
    /// The toml's `kernel_params` (KERNELPARAMS, empty by default), after
    /// which come none: the agent's params go first.
    pub kernel_params: Vec<String>,
    /// `virtio_fs_queue_size` (DEFVIRTIOFSQUEUESIZE 1024).
    pub virtio_fs_queue_size: u64,
    /// `/dev/mshv` on the host: `nested` false.
    pub mshv: bool,
}

impl RsSandbox {
    pub fn new(
        id: &str,
        kernel: &str,
        image: &str,
        host_cpus: u32,
        host_ram_bytes: u64,
        static_resources: bool,
    ) -> RsSandbox {
        RsSandbox {
            id: id.into(),
            kernel: kernel.into(),
            image: image.into(),
            vcpus: 1,
            max_vcpus: if static_resources { 1 } else { host_cpus },
            memory_mib: 2048,
            max_memory_mib: host_ram_bytes / MIB,
            host_ram_bytes,
            kernel_params: Vec::new(),
            virtio_fs_queue_size: 1024,
            mshv: false,
        }
    }

    /// `/run/kata/<id>`.
    pub fn dir(&self) -> String {
        format!("{KATA_PATH}/{}", self.id)
    }

    /// ch `utils.rs` `get_vsock_path`.
    pub fn vsock_socket(&self) -> String {
        format!("{}/ch-vm.sock", self.dir())
    }

    /// ch `utils.rs` `get_api_socket_path`.
    pub fn api_socket(&self) -> String {
        format!("{}/ch-api.sock", self.dir())
    }

    /// The daemon's socket, in the jailer root (`<dir>/root`).
    pub fn virtiofsd_socket(&self) -> String {
        format!("{}/root/virtiofsd.sock", self.dir())
    }

    /// The daemon's `--shared-dir`: the read-only bind of the sandbox's
    /// share (`get_host_ro_shared_path`).
    pub fn shared_dir(&self) -> String {
        format!("{HOST_SHARED_DIR}/{}/ro", self.id)
    }

    /// share_virtio_fs_standalone.rs `virtiofsd_args` with the toml's
    /// `virtio_fs_cache = "auto"`, `virtio_fs_extra_args =
    /// ["--thread-pool-size=1", "-o", "announce_submounts"]`, and
    /// `disable_guest_selinux` true (kata-types' default: no `--xattr`).
    /// The daemon binds the socket itself: no `--fd`.
    pub fn virtiofsd_args(&self) -> Vec<String> {
        [
            "--socket-path",
            &self.virtiofsd_socket(),
            "--shared-dir",
            &self.shared_dir(),
            "--cache",
            "auto",
            "--thread-pool-size=1",
            "-o",
            "announce_submounts",
        ]
        .map(String::from)
        .to_vec()
    }

    /// inner_hypervisor.rs `get_kernel_params`: KernelParams::new (reboot,
    /// panic, the systemd unit and masks), `quiet`, the rootfs params for
    /// virtio-blk-pci and ext4, CH's extra three, then the config's
    /// kernel_params, which `update_agent_kernel_params` prefixed with the
    /// agent's (sorted: `cdh_api_timeout` 50 s from 50000 ms,
    /// `container_pipe_size` PIPESIZE 1).
    pub fn cmdline(&self) -> String {
        let mut p: Vec<String> = [
            "reboot=k",
            "panic=1",
            "systemd.unit=kata-containers.target",
            "systemd.mask=systemd-networkd.service",
            "systemd.mask=systemd-networkd.socket",
            "quiet",
            "root=/dev/vda1",
            "rootflags=data=ordered,errors=remount-ro ro",
            "rootfstype=ext4",
            "no_timer_check",
            "noreplace-smp",
            "systemd.log_target=console",
            "agent.cdh_api_timeout=50",
            "agent.container_pipe_size=1",
        ]
        .map(String::from)
        .to_vec();
        p.extend(self.kernel_params.iter().cloned());
        p.join(" ")
    }

    /// MemoryConfig's hotplug_size: the host's RAM less the boot memory,
    /// through convert.rs `checked_next_multiple_of` (which moves an
    /// already aligned value up a whole step).
    pub fn hotplug_size(&self) -> u64 {
        let rest = self.host_ram_bytes.saturating_sub(self.memory_mib * MIB);
        rest - rest % PMEM_ALIGN_BYTES + PMEM_ALIGN_BYTES
    }

    /// `VmConfig::try_from(NamedHypervisorConfig)` for this sandbox (image
    /// boot, not confidential, no template, no balloon), with the share
    /// and no NIC (bootVM adds NICs with vm.add-net), and the serde
    /// output of ch-config's structs: fields in declaration order, `None`
    /// as `null` where no `skip_serializing_if` says otherwise.
    pub fn vm_config(&self) -> Json {
        let s = |x: &str| Json::str(x);
        let u = Json::uint;
        let f = Json::Bool(false);
        let null = || Json::Null;
        let cpus = Json::Obj(vec![
            ("boot_vcpus", u(self.vcpus.into())),
            ("max_vcpus", u(self.max_vcpus.into())),
            (
                "topology",
                Json::Obj(vec![
                    ("threads_per_core", u(1)),
                    ("cores_per_die", u(self.max_vcpus.into())),
                    ("dies_per_package", u(1)),
                    ("packages", u(1)),
                ]),
            ),
            ("kvm_hyperv", f.clone()),
            ("nested", Json::Bool(!self.mshv)),
            ("max_phys_bits", u(MAX_PHYS_BITS)),
            ("features", Json::Obj(vec![("amx", f.clone())])),
        ]);
        let memory = Json::Obj(vec![
            ("size", u(self.memory_mib * MIB)),
            ("mergeable", f.clone()),
            ("hotplug_method", s("Acpi")),
            ("hotplug_size", u(self.hotplug_size())),
            ("shared", Json::Bool(true)),
            ("hugepages", f.clone()),
            ("prefault", f.clone()),
        ]);
        let payload = Json::Obj(vec![
            ("firmware", null()),
            ("kernel", s(self.kernel.as_str())),
            ("cmdline", s(&self.cmdline())),
            ("initramfs", null()),
            ("mrconfigid", null()),
            ("host_data", null()),
        ]);
        let disk = Json::Obj(vec![
            ("path", s(self.image.as_str())),
            ("readonly", Json::Bool(true)),
            ("direct", f.clone()),
            ("iommu", f.clone()),
            ("num_queues", u(1)),
            ("queue_size", u(128)),
            ("vhost_user", f.clone()),
            ("vhost_socket", null()),
            ("rate_limiter_config", null()),
            ("id", null()),
            ("disable_io_uring", f.clone()),
            ("pci_segment", u(0)),
            ("sparse", Json::Bool(true)),
            ("image_type", s("Unknown")),
        ]);
        let fs = Json::Obj(vec![
            ("tag", s(SHARE_TAG)),
            ("socket", s(&self.virtiofsd_socket())),
            ("num_queues", u(1)),
            ("queue_size", u(self.virtio_fs_queue_size)),
            ("id", null()),
            ("pci_segment", u(0)),
        ]);
        let console = || {
            Json::Obj(vec![
                ("file", null()),
                ("mode", s("Off")),
                ("iommu", f.clone()),
            ])
        };
        Json::Obj(vec![
            ("cpus", cpus),
            ("memory", memory),
            ("payload", payload),
            ("disks", Json::Arr(vec![disk])),
            (
                "rng",
                Json::Obj(vec![("src", s("/dev/urandom")), ("iommu", f.clone())]),
            ),
            ("fs", Json::Arr(vec![fs])),
            ("serial", console()),
            ("console", console()),
            ("devices", Json::Arr(vec![])),
            (
                "vsock",
                Json::Obj(vec![
                    ("cid", u(GUEST_VSOCK_CID)),
                    ("socket", s(&self.vsock_socket())),
                    ("iommu", f.clone()),
                    ("id", null()),
                    ("pci_segment", u(0)),
                ]),
            ),
            ("iommu", f.clone()),
            ("watchdog", f),
        ])
    }
}

/// vm.add-net's body (`serde_json::to_string` of the NetConfig
/// get_shared_devices builds: a veth endpoint's MAC, queue_size 256,
/// `network_queues` 1 → num_queues 2, tap and id cleared, and the tap's fd
/// numbers in `fds` as the runtime holds them; the fds themselves ride on
/// the request).
pub fn add_net_body(mac: &str, fds: &[i32]) -> String {
    Json::Obj(vec![
        ("ip", Json::str("192.168.249.1")),
        ("mask", Json::str("255.255.255.0")),
        ("mac", Json::str(mac)),
        ("iommu", Json::Bool(false)),
        ("num_queues", Json::uint(2)),
        ("queue_size", Json::uint(256)),
        ("vhost_user", Json::Bool(false)),
        ("vhost_mode", Json::str("Client")),
        (
            "fds",
            Json::Arr(fds.iter().map(|fd| Json::Int((*fd).into())).collect()),
        ),
    ])
    .compact()
}

/// vm.resize's body: ch-config `VmResize`, every field written.
pub fn resize_body(vcpus: Option<u32>, ram: Option<u64>) -> String {
    Json::Obj(vec![
        ("desired_vcpus", Json::opt_uint(vcpus.map(u64::from))),
        ("desired_ram", Json::opt_uint(ram)),
        ("desired_balloon", Json::Null),
    ])
    .compact()
}

/// cpu.rs `calc_cpu_resources` for containers with CPU quotas
/// `(quota, period)`: the quotas over the largest period, plus
/// `default_vcpus`; then `do_update_cpu_resources` rounds up. With no
/// container, `default_vcpus`.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "runtime-rs's own f32 arithmetic; the result is at least 1 and at most a few hundred"
)]
pub fn vcpus_required(default_vcpus: f64, quotas: &[(i64, u64)]) -> u32 {
    let max_period = quotas.iter().map(|q| q.1).max().unwrap_or(0) as f64;
    let total: f64 = quotas
        .iter()
        .filter(|(q, p)| *q >= 0 && *p > 0)
        .map(|(q, p)| *q as f64 * (max_period / *p as f64))
        .sum();
    let vcpus = if total > 0.0 && max_period > 0.0 {
        total / max_period + default_vcpus
    } else {
        default_vcpus.max(1.0)
    };
    vcpus.max(1.0).ceil() as u32
}

/// ch `resize_vcpu`: the count to send, None when nothing is sent (the
/// same count); cut to `max_vcpus`.
pub fn resize_vcpus_request(old: u32, new: u32, max_vcpus: u32) -> Result<Option<u32>, String> {
    if new == 0 {
        return Err("resize to 0 vcpus requested".into());
    }
    let new = new.min(max_vcpus);
    Ok((new != old).then_some(new))
}

/// ch `resize_memory` after its vm.info: the `desired_ram` to send, or
/// None (the same size, or a shrink). `current` is vm.info's
/// `config.memory.size`; the growth is aligned up to the guest's memory
/// block; beyond `max_memory_mib` it fails.
pub fn resize_memory_request(
    current: u64,
    new_mib: u64,
    block_mib: u64,
    max_memory_mib: u64,
) -> Result<Option<u64>, String> {
    let new = new_mib * MIB;
    if new <= current {
        return Ok(None);
    }
    let block = block_mib * MIB;
    let mut growth = new - current;
    if block > 0 && !growth.is_multiple_of(block) {
        growth = growth - growth % block + block;
    }
    let aligned = current + growth;
    if aligned > max_memory_mib * MIB {
        return Err(format!(
            "requested memory ({} MB) is greater than maximum allowed ({max_memory_mib} MB)",
            aligned / MIB
        ));
    }
    Ok(Some(aligned))
}

/// mem.rs `get_current_mb`: the toml's `default_memory` plus every
/// container's memory limit, in MiB.
pub fn memory_required_mib(default_memory_mib: u64, limits_bytes: &[u64]) -> u64 {
    default_memory_mib + (limits_bytes.iter().sum::<u64>() >> 20)
}

#[cfg(test)]
#[path = "rs_tests.rs"]
mod tests;
