//! Kata Containers' Cloud Hypervisor drivers, byte for byte. This module
//! is the Go runtime's; [`rs`] is the Rust runtime's (runtime-rs, Kata 4's
//! default) and [`api_client`] the HTTP client it uses.
//!
//! The Go runtime's Cloud Hypervisor driver: the requests
//! its runtime sends to start a sandbox, and the decisions it takes from
//! the answers, so tests can replay a Kata start against this VMM without
//! Kata. Written from reading Kata's source (`src/runtime/virtcontainers/
//! clh.go`, `sandbox.go`, `hypervisor.go`, `pkg/katautils/`, the generated
//! client in `virtcontainers/pkg/cloud-hypervisor/client/`), not copied;
//! each value names where it comes from.
//!
//! How the generated Go client writes a request (`client.go`
//! `prepareRequest`, `api_default.go`, Go's `net/http` `Request.write`):
//!
//! ```text
//! <METHOD> /api/v1/<call> HTTP/1.1
//! Host: localhost                       (the client's server URL http://localhost/api/v1)
//! User-Agent: OpenAPI-Generator/1.0.0/go
//! Content-Length: <n>                   (with a body, and "0" for a PUT without one)
//! Accept: application/json              (only calls that return a body: vmm.ping, vm.info)
//! Content-Type: application/json        (only calls with a body)
//! Accept-Encoding: gzip                 (added by Go's Transport)
//!
//! <body>                                json.NewEncoder: the JSON and a "\n"
//! ```
//!
//! Host, User-Agent and Content-Length come first; the other headers in
//! key order; the transport's Accept-Encoding last. All calls share one
//! kept-alive connection (Go's pool; the client reads every body to the
//! end), except vm.add-net, which clh.go's `vmAddNetPutRequest` writes
//! itself on a fresh connection, as `httputil.DumpRequest` prints it, with
//! the tap fds as SCM_RIGHTS ([`add_net_request`]).
//!
//! Bodies are Go's `encoding/json` of the models' `MarshalJSON`: a map,
//! so keys sorted at every level, only the fields that are set (the `New*`
//! constructors set defaults, listed in [`Sandbox::vm_config`]), and `<`,
//! `>`, `&`, U+2028, U+2029 escaped ([`go_json`]).

use std::collections::BTreeMap;

use serde_json::{json, Value};

pub mod api_client;
pub mod conn;
pub mod rs;

/// `configuration.go` `UserAgent` of the generated client.
pub const USER_AGENT: &str = "OpenAPI-Generator/1.0.0/go";
/// `kata_agent.go` `mountGuestTag`: the tag of the shared directory.
pub const SHARE_TAG: &str = "kataShared";
/// `fc.go` `defaultGuestVSockCID`, which clh.go's `AddDevice` also uses.
pub const GUEST_VSOCK_CID: u64 = 3;
/// `sandbox.go` `acpiMemoryHotplugFactor`: at most this many times the
/// current memory is added in one step.
pub const ACPI_MEMORY_HOTPLUG_FACTOR: u64 = 48;
/// The guest's memory block size that Kata's agent reports
/// (`/sys/devices/system/memory/block_size_bytes`), 128 MiB on x86-64:
/// `ResizeMemory` aligns the growth to it.
pub const X86_MEMORY_BLOCK_MIB: u64 = 128;

const MIB: u64 = 1 << 20;

/// What the sandbox boots from (`ImageOrInitrdAssetPath`): Kata's default
/// configuration has an `image`, a read-only raw disk.
#[derive(Clone, Debug)]
pub enum RootAsset {
    Image(String),
    Initramfs(String),
}

/// The settings of one sandbox that shape Kata's VmConfig. [`Sandbox::new`]
/// gives Kata's defaults (configuration-clh.toml.in and the Makefile).
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// `kernel` (the toml's `@KERNELPATH_CLH@`).
    pub kernel: String,
    pub root: RootAsset,
    /// `default_vcpus = 1`.
    pub vcpus: u32,
    /// `default_maxvcpus = 0` (Makefile `DEFMAXVCPUS`): 0 means the host's
    /// CPU count (katautils `defaultMaxVCPUs`).
    pub max_vcpus: u32,
    /// `default_memory` (Makefile `DEFMEMSZ := 2048`), MiB.
    pub memory_mib: u64,
    /// `default_maxmemory = 0` (Makefile `DEFMAXMEMSZ`): 0 means the
    /// host's RAM (katautils `defaultMaxMemSz`). CreateVM sends all of it
    /// as `hotplug_size`, not the difference to `memory_mib`.
    pub max_memory_mib: u64,
    /// `<VMStorePath>/<id>/clh.sock` (`vsockSocketPath`).
    pub vsock_socket: String,
    /// `<VMStorePath>/<id>/virtiofsd.sock` (`virtioFsSocketPath`).
    pub virtiofsd_socket: String,
    pub share_tag: String,
    /// `virtio_fs_queue_size` (Makefile `DEFVIRTIOFSQUEUESIZE ?= 1024`).
    pub virtio_fs_queue_size: u32,
    /// The hypervisor's `entropy_source`, not in the clh toml: katautils'
    /// `defaultEntropySource = "/dev/urandom"`.
    pub entropy_source: String,
    /// `rootfs_type` (Makefile `DEFROOTFSTYPE := ext4`).
    pub rootfs_type: String,
    /// The toml's `kernel_params` (Makefile `KERNELPARAMS`, empty).
    pub kernel_params: Vec<String>,
    /// `enable_debug`: a Tty serial console and debug kernel parameters.
    pub debug: bool,
    /// `/dev/mshv` exists on the host: CreateVM then sets `nested: false`.
    pub mshv: bool,
}

impl Sandbox {
    /// Kata's default sandbox on a host with `host_cpus` CPUs and
    /// `host_ram_mib` MiB, its sockets in `sandbox_dir`
    /// (`/run/vc/vm/<id>` under Kata).
    pub fn new(
        kernel: &str,
        root: RootAsset,
        sandbox_dir: &str,
        host_cpus: u32,
        host_ram_mib: u64,
    ) -> Sandbox {
        Sandbox {
            kernel: kernel.into(),
            root,
            vcpus: 1,
            max_vcpus: host_cpus,
            memory_mib: 2048,
            max_memory_mib: host_ram_mib,
            vsock_socket: format!("{sandbox_dir}/clh.sock"),
            virtiofsd_socket: format!("{sandbox_dir}/virtiofsd.sock"),
            share_tag: SHARE_TAG.into(),
            virtio_fs_queue_size: 1024,
            entropy_source: "/dev/urandom".into(),
            rootfs_type: "ext4".into(),
            kernel_params: Vec::new(),
            debug: false,
            mshv: false,
        }
    }

    /// The kernel command line CreateVM sends: `GetKernelRootParams`
    /// (hypervisor.go; no NVDIMM, no DAX for the rootfs), `clhKernelParams`,
    /// `quiet` unless debug (`getNonUserDefinedKernelParams`), then the
    /// config's params as katautils `updateRuntimeConfigHypervisor`
    /// assembles them: the systemd ones when booting an image
    /// (`needSystemd`), the agent's (`KataAgentKernelParams`: the toml's
    /// `cdh_api_timeout = 50`), the toml's `kernel_params`.
    pub fn cmdline(&self) -> String {
        let mut p: Vec<String> = vec!["root=/dev/vda1".into()];
        p.push(match self.rootfs_type.as_str() {
            "ext4" => "rootflags=data=ordered,errors=remount-ro ro".into(),
            _ => "rootflags=ro".into(),
        });
        p.push(format!("rootfstype={}", self.rootfs_type));
        p.extend(["panic=1", "no_timer_check", "noreplace-smp"].map(String::from));
        if self.debug {
            p.push("console=ttyS0,115200n8".into());
            p.push("systemd.log_target=console".into());
        } else {
            p.push("quiet".into());
        }
        if matches!(self.root, RootAsset::Image(_)) {
            p.extend(
                [
                    "systemd.unit=kata-containers.target",
                    "systemd.mask=systemd-networkd.service",
                    "systemd.mask=systemd-networkd.socket",
                ]
                .map(String::from),
            );
        }
        if self.debug {
            p.push("agent.log=debug".into());
        }
        p.push("agent.cdh_api_timeout=50".into());
        p.extend(self.kernel_params.iter().cloned());
        p.join(" ")
    }

    /// The VmConfig CreateVM builds (non-confidential, no IOMMU, no
    /// hugepages, no templating, `reclaim_guest_freed_memory = false`),
    /// with the fs (`addVolume`) and vsock (`addVSock`) that the sandbox
    /// adds before StartVM. Net devices are not in it: bootVM adds them
    /// with vm.add-net. Each object is what its constructor sets plus
    /// CreateVM's setters:
    ///
    /// - `NewVmConfig`: iommu, watchdog, pvpanic, landlock_enable = false;
    /// - `NewPlatformConfig`: tdx, sev_snp = false; `SetNumPciSegments(2)`;
    /// - `NewMemoryConfig(size)`: mergeable false, hotplug_method "Acpi",
    ///   shared false, hugepages false, prefault false, thp true; then
    ///   shared = true (a shared fs), hugepages, hotplug_size;
    /// - `NewCpusConfig(boot, max)`: kvm_hyperv false, nested true; the
    ///   topology 1 thread per core, max_vcpus cores per die, 1 die, 1
    ///   package;
    /// - `NewRngConfig(src)`: iommu false;
    /// - `NewDiskConfig()`: readonly, direct, iommu false, num_queues 1,
    ///   queue_size 128, vhost_user false, backing_files false, sparse
    ///   true; then path, readonly true, image_type "Raw";
    /// - `NewConsoleConfig(mode)`: iommu false (serial "Off" or "Tty" in
    ///   debug, console "Off");
    /// - `NewFsConfig(tag, socket, 1, queue_size)` and `SetPciSegment(1)`:
    ///   no `cache_size`, whatever `virtio_fs_cache_size` says;
    /// - `NewVsockConfig(3, socket)`: iommu false.
    pub fn vm_config(&self) -> Value {
        let mut payload = json!({"kernel": self.kernel, "cmdline": self.cmdline()});
        let mut c = json!({
            "iommu": false, "watchdog": false, "pvpanic": false, "landlock_enable": false,
            "platform": {"tdx": false, "sev_snp": false, "num_pci_segments": 2},
            "memory": {
                "size": self.memory_mib * MIB, "mergeable": false, "hotplug_method": "Acpi",
                "shared": true, "hugepages": false, "prefault": false, "thp": true,
                "hotplug_size": self.max_memory_mib * MIB,
            },
            "cpus": {
                "boot_vcpus": self.vcpus, "max_vcpus": self.max_vcpus,
                "kvm_hyperv": false, "nested": !self.mshv,
                "topology": {"threads_per_core": 1, "cores_per_die": self.max_vcpus,
                             "dies_per_package": 1, "packages": 1},
            },
            "rng": {"src": self.entropy_source, "iommu": false},
            "serial": {"mode": if self.debug { "Tty" } else { "Off" }, "iommu": false},
            "console": {"mode": "Off", "iommu": false},
            "fs": [{"tag": self.share_tag, "socket": self.virtiofsd_socket, "num_queues": 1,
                    "queue_size": self.virtio_fs_queue_size, "pci_segment": 1}],
            "vsock": {"cid": GUEST_VSOCK_CID, "socket": self.vsock_socket, "iommu": false},
        });
        match &self.root {
            RootAsset::Image(path) => {
                c["disks"] = json!([{
                    "path": path, "readonly": true, "direct": false, "iommu": false,
                    "num_queues": 1, "queue_size": 128, "vhost_user": false,
                    "backing_files": false, "sparse": true, "image_type": "Raw",
                }]);
            }
            RootAsset::Initramfs(path) => payload["initramfs"] = json!(path),
        }
        c["payload"] = payload;
        c
    }
}

/// Go's `encoding/json` text of `v` as the generated models marshal it:
/// object keys sorted (Go sorts map keys), no spaces, and Go's string
/// escapes (`<`, `>`, `&`, U+2028, U+2029 as `\u00XX`/`\u20XX`, which
/// serde_json leaves as they are).
pub fn go_json(v: &Value) -> String {
    let mut out = String::new();
    write_go_json(v, &mut out);
    out
}

fn write_go_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_go_string(k, out);
                out.push(':');
                write_go_json(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_go_json(item, out);
            }
            out.push(']');
        }
        Value::String(s) => write_go_string(s, out),
        other => out.push_str(&other.to_string()),
    }
}

fn write_go_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One call of the generated client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: &'static str,
    /// e.g. `vm.info`.
    pub call: String,
    /// The call returns a body: `Accept: application/json`.
    pub accept_json: bool,
    /// The JSON body (without Go's trailing newline); sent with
    /// `Content-Type: application/json`.
    pub body: Option<String>,
}

impl Request {
    /// The bytes Go's transport writes for it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = self.body.as_ref().map(|b| format!("{b}\n"));
        let mut head = format!(
            "{} /api/v1/{} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: {USER_AGENT}\r\n",
            self.method, self.call
        );
        // Go's transferWriter: a Content-Length for any body, and "0" for
        // a bodiless PUT/POST/PATCH ("many servers expect" one).
        match &body {
            Some(b) => head.push_str(&format!("Content-Length: {}\r\n", b.len())),
            None if self.method != "GET" => head.push_str("Content-Length: 0\r\n"),
            None => {}
        }
        if self.accept_json {
            head.push_str("Accept: application/json\r\n");
        }
        if body.is_some() {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str("Accept-Encoding: gzip\r\n\r\n");
        let mut bytes = head.into_bytes();
        if let Some(b) = body {
            bytes.extend_from_slice(b.as_bytes());
        }
        bytes
    }
}

/// `VmmPingGet`: isClhRunning polls it after launching the VMM and
/// before shutting it down.
pub fn vmm_ping() -> Request {
    get("vmm.ping")
}

/// `VmInfoGet`: bootVM checks `state` after create and boot; ResizeVCPUs,
/// ResizeMemory and GetTotalMemoryMB read it.
pub fn vm_info() -> Request {
    get("vm.info")
}

/// `CreateVM` with the sandbox's VmConfig.
pub fn vm_create(sandbox: &Sandbox) -> Request {
    vm_create_with_body(go_json(&sandbox.vm_config()))
}

/// `CreateVM` with a VmConfig already in Go's JSON (no trailing newline).
pub fn vm_create_with_body(body: String) -> Request {
    put("vm.create", Some(body))
}

/// `BootVM`.
pub fn vm_boot() -> Request {
    put("vm.boot", None)
}

/// `VmResizePut` from ResizeVCPUs: only `desired_vcpus`.
pub fn vm_resize_vcpus(vcpus: u32) -> Request {
    put("vm.resize", Some(go_json(&json!({"desired_vcpus": vcpus}))))
}

/// `VmResizePut` from ResizeMemory: only `desired_ram`, in bytes.
pub fn vm_resize_ram(bytes: u64) -> Request {
    put("vm.resize", Some(go_json(&json!({"desired_ram": bytes}))))
}

/// `ShutdownVMM` (StopVM → terminate, after a vmm.ping).
pub fn vmm_shutdown() -> Request {
    put("vmm.shutdown", None)
}

/// Another GET that returns JSON, written as the generated client writes
/// vm.info (e.g. `vm.counters`).
pub fn get(call: &str) -> Request {
    Request {
        method: "GET",
        call: call.into(),
        accept_json: true,
        body: None,
    }
}

fn put(call: &str, body: Option<String>) -> Request {
    Request {
        method: "PUT",
        call: call.into(),
        accept_json: false,
        body,
    }
}

/// The NetConfig clh.go's `addNet` stores for vm.add-net: `NewNetConfig()`
/// (ip 192.168.249.1, mask 255.255.255.0, iommu false, num_queues 2,
/// queue_size 256, vhost_user false, vhost_mode "Client", offload_tso,
/// offload_ufo, offload_csum true), the endpoint's MAC, `SetIommu(false)`;
/// marshalled with `json.Marshal` (no trailing newline). No `tap`, no `id`:
/// the tap comes as an fd.
pub fn add_net_body(mac: &str) -> String {
    go_json(&json!({
        "ip": "192.168.249.1", "mask": "255.255.255.0", "mac": mac, "iommu": false,
        "num_queues": 2, "queue_size": 256, "vhost_user": false, "vhost_mode": "Client",
        "offload_tso": true, "offload_ufo": true, "offload_csum": true,
    }))
}

/// vm.add-net as `vmAddNetPutRequest` writes it: `httputil.DumpRequest`
/// of a request with Accept, Content-Type and Content-Length set by hand
/// (Host first, then the headers in key order; no User-Agent, no
/// Accept-Encoding: the transport never sees it), sent in one `sendmsg`
/// with the tap fds.
pub fn add_net_request(body: &str) -> String {
    format!(
        "PUT /api/v1/vm.add-net HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}",
        body.len()
    )
}

/// ResizeVCPUs' request from vm.info: `config.cpus.boot_vcpus` is the
/// current count, a request above `config.cpus.max_vcpus` is cut to it,
/// and `desired_vcpus` is sent even when it equals the current count.
/// Returns (current, desired).
pub fn resize_vcpus_plan(info: &Value, requested: u32) -> Result<(u64, u64), String> {
    if requested == 0 {
        return Err("Cannot resize vCPU to 0".into());
    }
    let cpus = &info["config"]["cpus"];
    let current = field_u64(cpus, "boot_vcpus", "config.cpus")?;
    let max = field_u64(cpus, "max_vcpus", "config.cpus")?;
    Ok((current, u64::from(requested).min(max)))
}

/// GetTotalMemoryMB: `memory_actual_size` in MiB, 0 when vm.info has none
/// (the Go model's getter returns its zero value).
pub fn total_memory_mib(info: &Value) -> u64 {
    info["memory_actual_size"].as_u64().unwrap_or(0) / MIB
}

/// One step of updateResources' memory loop: from the current memory
/// (GetTotalMemoryMB) towards `final_mib`, at most 48 times the current
/// memory at once. With no `memory_actual_size` the current memory is 0,
/// so the step is 0 MiB and ResizeMemory fails ("Can not resize memory to
/// 0").
pub fn memory_step_mib(current_mib: u64, final_mib: u64) -> u64 {
    let max_step = current_mib.saturating_mul(ACPI_MEMORY_HOTPLUG_FACTOR);
    if final_mib.saturating_sub(current_mib) > max_step {
        current_mib.saturating_add(max_step)
    } else {
        final_mib
    }
}

/// ResizeMemory from vm.info: the request is cut to `hotplug_size` (0 when
/// absent), compared with `config.memory.size` (no change, or a shrink:
/// nothing is sent), the growth aligned up to the block size and cut to
/// `hotplug_size`. Returns the `desired_ram` to send, in bytes, or None.
pub fn resize_memory_plan(
    info: &Value,
    requested_mib: u64,
    block_mib: u64,
) -> Result<Option<u64>, String> {
    if requested_mib == 0 {
        return Err("Can not resize memory to 0".into());
    }
    let memory = &info["config"]["memory"];
    let max_hotplug_mib = memory["hotplug_size"].as_u64().unwrap_or(0) / MIB;
    let requested_mib = requested_mib.min(max_hotplug_mib);
    let current = field_u64(memory, "size", "config.memory")?;
    let new = requested_mib * MIB;
    if new <= current {
        return Ok(None);
    }
    let block = block_mib.max(1) * MIB;
    let growth = (new - current).div_ceil(block) * block;
    let aligned = current + growth;
    Ok(Some(aligned.min(max_hotplug_mib * MIB)))
}

fn field_u64(obj: &Value, key: &str, at: &str) -> Result<u64, String> {
    obj[key]
        .as_u64()
        .ok_or_else(|| format!("vm.info has no {at}.{key} (got {})", obj[key]))
}

/// A stand-in agent's read-only root image, as both runtimes' sandboxes
/// boot it: busybox with `applets` linked to it, daxprobe, the agent's
/// script as `/agent.sh`, and the mount points; one ext4 partition of
/// 64 MiB named `name`.
pub fn agent_root_disk(
    name: &str,
    busybox: &[u8],
    daxprobe: &[u8],
    agent: &str,
    applets: &[&str],
) -> Vec<u8> {
    use crate::images::{self, Entry};
    let links: Vec<String> = applets.iter().map(|a| format!("bin/{a}")).collect();
    let mut entries = vec![
        Entry::File {
            path: "bin/busybox",
            mode: 0o755,
            data: busybox,
        },
        Entry::File {
            path: "bin/daxprobe",
            mode: 0o755,
            data: daxprobe,
        },
        Entry::File {
            path: "agent.sh",
            mode: 0o755,
            data: agent.as_bytes(),
        },
    ];
    entries.extend(links.iter().map(|path| Entry::Symlink {
        path,
        target: "busybox",
    }));
    entries.extend(["proc", "sys", "dev", "run", "tmp"].map(Entry::Dir));
    images::mbr_disk(&images::ext4_tree(name, 64 << 20, &entries))
}

#[cfg(test)]
#[path = "kata_tests.rs"]
mod tests;
