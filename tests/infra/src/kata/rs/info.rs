//! What runtime-rs's serde structs accept when they read an answer:
//! `vm.info` into its `VmInfo` (ch-config `lib.rs`: `VmConfig` and every
//! struct under it) and `vmm.ping` as `handle_ch_build_features` reads it.
//! A field without `#[serde(default)]` that is not an `Option` must be
//! there; an `Option` may be missing or `null`; any other field present
//! must have its type (`null` is not a bool); enums take only their
//! variants; unknown fields are ignored (no `deny_unknown_fields`). An
//! answer runtime-rs could not read fails here naming the field.

use serde_json::Value;

/// The type of one field as serde reads it.
#[derive(Debug)]
enum Ty {
    Bool,
    /// An unsigned integer at most this large.
    Uint(u64),
    I32,
    Str,
    /// `std::net::Ipv4Addr` from its dotted string.
    Ipv4,
    /// ch-config's `MacAddr`: six two-digit hex parts.
    Mac,
    Enum(&'static [&'static str]),
    Opt(&'static Ty),
    Vec(&'static Ty),
    Obj(&'static [Field]),
    /// kata-types' `RateLimiterConfig`, not modelled: any value.
    Any,
}

#[derive(Debug)]
struct Field {
    name: &'static str,
    ty: Ty,
    /// `#[serde(default)]` (or an `Option`): may be missing.
    default: bool,
}

const fn req(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        default: false,
    }
}

const fn def(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        default: true,
    }
}

const fn opt(name: &'static str, ty: &'static Ty) -> Field {
    Field {
        name,
        ty: Ty::Opt(ty),
        default: true,
    }
}

const U8: Ty = Ty::Uint(u8::MAX as u64);
const U16: Ty = Ty::Uint(u16::MAX as u64);
const U32: Ty = Ty::Uint(u32::MAX as u64);
const U64: Ty = Ty::Uint(u64::MAX);
const USIZE: Ty = Ty::Uint(u64::MAX);
const PATH: Ty = Ty::Str;

const TOPOLOGY: &[Field] = &[
    req("threads_per_core", U16),
    req("cores_per_die", U16),
    req("dies_per_package", U16),
    req("packages", U16),
];
const AFFINITY: &[Field] = &[req("vcpu", U32), req("host_cpus", Ty::Vec(&USIZE))];
const CPUS: &[Field] = &[
    req("boot_vcpus", U32),
    req("max_vcpus", U32),
    opt("topology", &Ty::Obj(TOPOLOGY)),
    def("kvm_hyperv", Ty::Bool),
    opt("nested", &Ty::Bool),
    // No `#[serde(default)]` in ch-config: a vm.info without it fails.
    req("max_phys_bits", U8),
    opt("affinity", &Ty::Vec(&Ty::Obj(AFFINITY))),
    def("features", Ty::Obj(&[def("amx", Ty::Bool)])),
];
const ZONE: &[Field] = &[
    req("id", Ty::Str),
    req("size", U64),
    opt("file", &PATH),
    def("shared", Ty::Bool),
    def("hugepages", Ty::Bool),
    opt("hugepage_size", &U64),
    opt("host_numa_node", &U32),
    opt("hotplug_size", &U64),
    opt("hotplugged_size", &U64),
    def("prefault", Ty::Bool),
];
const MEMORY: &[Field] = &[
    req("size", U64),
    def("mergeable", Ty::Bool),
    def("hotplug_method", Ty::Enum(&["Acpi", "VirtioMem"])),
    opt("hotplug_size", &U64),
    opt("hotplugged_size", &U64),
    def("shared", Ty::Bool),
    def("hugepages", Ty::Bool),
    opt("hugepage_size", &U64),
    def("prefault", Ty::Bool),
    opt("zones", &Ty::Vec(&Ty::Obj(ZONE))),
];
const PAYLOAD: &[Field] = &[
    opt("firmware", &PATH),
    opt("kernel", &PATH),
    opt("cmdline", &Ty::Str),
    opt("initramfs", &PATH),
    opt("mrconfigid", &Ty::Str),
    opt("host_data", &Ty::Str),
];
const DISK: &[Field] = &[
    opt("path", &PATH),
    def("readonly", Ty::Bool),
    def("direct", Ty::Bool),
    def("iommu", Ty::Bool),
    req("num_queues", USIZE),
    req("queue_size", U16),
    def("vhost_user", Ty::Bool),
    opt("vhost_socket", &Ty::Str),
    opt("rate_limiter_config", &Ty::Any),
    opt("id", &Ty::Str),
    def("disable_io_uring", Ty::Bool),
    def("pci_segment", U16),
    def("sparse", Ty::Bool),
    def(
        "image_type",
        Ty::Enum(&["FixedVhd", "Qcow2", "Raw", "Vhdx", "Unknown"]),
    ),
];
const NET: &[Field] = &[
    opt("tap", &Ty::Str),
    req("ip", Ty::Ipv4),
    req("mask", Ty::Ipv4),
    req("mac", Ty::Mac),
    opt("host_mac", &Ty::Mac),
    opt("mtu", &U16),
    def("iommu", Ty::Bool),
    req("num_queues", USIZE),
    req("queue_size", U16),
    def("vhost_user", Ty::Bool),
    opt("vhost_socket", &Ty::Str),
    def("vhost_mode", Ty::Enum(&["Client", "Server"])),
    opt("id", &Ty::Str),
    opt("fds", &Ty::Vec(&Ty::I32)),
    opt("rate_limiter_config", &Ty::Any),
    def("pci_segment", U16),
];
const CONSOLE: &[Field] = &[
    opt("file", &PATH),
    req("mode", Ty::Enum(&["Off", "Pty", "Tty", "File", "Null"])),
    def("iommu", Ty::Bool),
];
const FS: &[Field] = &[
    req("tag", Ty::Str),
    req("socket", PATH),
    req("num_queues", USIZE),
    req("queue_size", U16),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const PMEM: &[Field] = &[
    req("file", PATH),
    opt("size", &U64),
    def("iommu", Ty::Bool),
    def("discard_writes", Ty::Bool),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const DEVICE: &[Field] = &[
    req("path", PATH),
    def("iommu", Ty::Bool),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const USER_DEVICE: &[Field] = &[
    req("socket", PATH),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const VDPA: &[Field] = &[
    req("path", PATH),
    req("num_queues", USIZE),
    def("iommu", Ty::Bool),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const VSOCK: &[Field] = &[
    req("cid", U32),
    req("socket", PATH),
    def("iommu", Ty::Bool),
    opt("id", &Ty::Str),
    def("pci_segment", U16),
];
const NUMA: &[Field] = &[
    def("guest_numa_id", U32),
    opt("cpus", &Ty::Vec(&U32)),
    opt(
        "distances",
        &Ty::Vec(&Ty::Obj(&[def("destination", U32), def("distance", U8)])),
    ),
    opt("memory_zones", &Ty::Vec(&Ty::Str)),
    opt("sgx_epc_sections", &Ty::Vec(&Ty::Str)),
];
const PLATFORM: &[Field] = &[
    req("num_pci_segments", U16),
    opt("iommu_segments", &Ty::Vec(&U16)),
    opt("serial_number", &Ty::Str),
    opt("uuid", &Ty::Str),
    opt("oem_strings", &Ty::Vec(&Ty::Str)),
    def("tdx", Ty::Bool),
];
const VM_CONFIG: &[Field] = &[
    def("cpus", Ty::Obj(CPUS)),
    def("memory", Ty::Obj(MEMORY)),
    opt("kernel", &Ty::Obj(&[req("path", PATH)])),
    opt("initramfs", &Ty::Obj(&[req("path", PATH)])),
    def("cmdline", Ty::Obj(&[req("args", Ty::Str)])),
    opt("payload", &Ty::Obj(PAYLOAD)),
    opt("disks", &Ty::Vec(&Ty::Obj(DISK))),
    opt("net", &Ty::Vec(&Ty::Obj(NET))),
    def("rng", Ty::Obj(&[req("src", PATH), def("iommu", Ty::Bool)])),
    opt(
        "balloon",
        &Ty::Obj(&[
            req("size", U64),
            def("deflate_on_oom", Ty::Bool),
            def("free_page_reporting", Ty::Bool),
        ]),
    ),
    opt("fs", &Ty::Vec(&Ty::Obj(FS))),
    opt("pmem", &Ty::Vec(&Ty::Obj(PMEM))),
    req("serial", Ty::Obj(CONSOLE)),
    req("console", Ty::Obj(CONSOLE)),
    opt("devices", &Ty::Vec(&Ty::Obj(DEVICE))),
    opt("user_devices", &Ty::Vec(&Ty::Obj(USER_DEVICE))),
    opt("vdpa", &Ty::Vec(&Ty::Obj(VDPA))),
    opt("vsock", &Ty::Obj(VSOCK)),
    def("iommu", Ty::Bool),
    opt(
        "sgx_epc",
        &Ty::Vec(&Ty::Obj(&[
            req("id", Ty::Str),
            def("size", U64),
            def("prefault", Ty::Bool),
        ])),
    ),
    opt("numa", &Ty::Vec(&Ty::Obj(NUMA))),
    def("watchdog", Ty::Bool),
    opt("platform", &Ty::Obj(PLATFORM)),
];
const VM_INFO: &[Field] = &[
    req("config", Ty::Obj(VM_CONFIG)),
    req(
        "state",
        Ty::Enum(&["Created", "Running", "Shutdown", "Paused"]),
    ),
    opt("memory_actual_size", &U64),
];

fn check(v: &Value, ty: &Ty, at: &str) -> Result<(), String> {
    let bad = |want: &str| Err(format!("{at}: {want} expected, got {v}"));
    match ty {
        Ty::Any => Ok(()),
        Ty::Opt(inner) => {
            if v.is_null() {
                Ok(())
            } else {
                check(v, inner, at)
            }
        }
        Ty::Bool if v.is_boolean() => Ok(()),
        Ty::Bool => bad("a bool"),
        Ty::Uint(max) => match v.as_u64() {
            Some(n) if n <= *max => Ok(()),
            _ => bad(&format!("an integer 0..={max}")),
        },
        Ty::I32 => match v.as_i64() {
            Some(n) if i32::try_from(n).is_ok() => Ok(()),
            _ => bad("an i32"),
        },
        Ty::Str if v.is_string() => Ok(()),
        Ty::Str => bad("a string"),
        Ty::Ipv4 => match v.as_str().map(str::parse::<std::net::Ipv4Addr>) {
            Some(Ok(_)) => Ok(()),
            _ => bad("an IPv4 address"),
        },
        Ty::Mac => {
            let ok = v.as_str().is_some_and(|s| {
                let parts: Vec<&str> = s.split(':').collect();
                parts.len() == 6
                    && parts
                        .iter()
                        .all(|p| p.len() == 2 && u8::from_str_radix(p, 16).is_ok())
            });
            if ok {
                Ok(())
            } else {
                bad("a MAC address")
            }
        }
        Ty::Enum(variants) => match v.as_str() {
            Some(s) if variants.contains(&s) => Ok(()),
            _ => bad(&format!("one of {variants:?}")),
        },
        Ty::Vec(item) => {
            let Some(items) = v.as_array() else {
                return bad("an array");
            };
            for (i, x) in items.iter().enumerate() {
                check(x, item, &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        Ty::Obj(fields) => {
            let Some(map) = v.as_object() else {
                return bad("an object");
            };
            for f in *fields {
                let path = format!("{at}.{}", f.name);
                match map.get(f.name) {
                    None if f.default => {}
                    None => return Err(format!("{path}: missing field")),
                    Some(x) => check(x, &f.ty, &path)?,
                }
            }
            Ok(())
        }
    }
}

/// What runtime-rs takes from a `vm.info` answer it could read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmInfo {
    pub state: String,
    /// `config.memory.size`: resize_memory's "current memory".
    pub memory_size: u64,
    pub boot_vcpus: u64,
    pub max_vcpus: u64,
    pub memory_actual_size: Option<u64>,
}

/// `cloud_hypervisor_vm_info`: the body must be there and read as
/// runtime-rs's `VmInfo`.
pub fn parse_vm_info(body: Option<&str>) -> Result<VmInfo, String> {
    let body = body.ok_or("failed to get vminfo (no body)")?;
    let v: Value = serde_json::from_str(body).map_err(|e| format!("failed to serde: {e}"))?;
    check(&v, &Ty::Obj(VM_INFO), "VmInfo")?;
    Ok(VmInfo {
        state: v["state"].as_str().unwrap_or_default().to_string(),
        memory_size: v["config"]["memory"]["size"].as_u64().unwrap_or(0),
        boot_vcpus: v["config"]["cpus"]["boot_vcpus"].as_u64().unwrap_or(0),
        max_vcpus: v["config"]["cpus"]["max_vcpus"].as_u64().unwrap_or(0),
        memory_actual_size: v["memory_actual_size"].as_u64(),
    })
}

/// `handle_ch_build_features`: a ping body must be JSON; its `features`,
/// when not null, must be an array. Returns the features (None when the
/// answer has none).
pub fn parse_ping(body: Option<&str>) -> Result<Option<Vec<String>>, String> {
    let Some(body) = body else {
        return Ok(None);
    };
    let v: Value = serde_json::from_str(body).map_err(|e| format!("ping body: {e}"))?;
    let got = &v["features"];
    if got.is_null() {
        return Ok(None);
    }
    let list = got
        .as_array()
        .ok_or("expected CH to return array of features")?;
    Ok(Some(
        list.iter()
            .map(|f| f.to_string().trim_matches('"').to_string())
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info() -> Value {
        json!({
            "config": {
                "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "max_phys_bits": 46,
                         "features": {"amx": false}, "kvm_hyperv": false},
                "memory": {"size": 536870912, "hotplug_method": "Acpi", "shared": true},
                "payload": {"kernel": "/k", "cmdline": "c", "mrconfigid": null},
                "disks": [{"path": "/img", "readonly": true, "num_queues": 1,
                           "queue_size": 128, "image_type": "Raw", "pci_segment": 0}],
                "net": [{"ip": "192.168.249.1", "mask": "255.255.255.0",
                         "mac": "52:54:00:ca:7a:01", "num_queues": 2, "queue_size": 256,
                         "vhost_mode": "Client", "fds": [7]}],
                "rng": {"src": "/dev/urandom"},
                "fs": [{"tag": "kataShared", "socket": "/s", "num_queues": 1,
                        "queue_size": 1024, "id": "_fs0"}],
                "serial": {"mode": "Off"},
                "console": {"mode": "Off", "pci_segment": 0},
                "vsock": {"cid": 3, "socket": "/v"},
                "landlock_enable": false
            },
            "state": "Running",
            "memory_actual_size": 536870912u64
        })
    }

    #[test]
    fn a_vm_info_runtime_rs_reads() {
        let got = parse_vm_info(Some(&info().to_string())).unwrap();
        assert_eq!(got.state, "Running");
        assert_eq!(got.memory_size, 512 << 20);
        assert_eq!(got.memory_actual_size, Some(512 << 20));
    }

    #[test]
    fn what_runtime_rs_cannot_read_is_named() {
        let cases: &[(&str, Value, &str)] = &[
            (
                "/config/cpus/max_phys_bits",
                Value::Null,
                "cpus.max_phys_bits",
            ),
            ("/config/serial/mode", json!("Socket"), "serial.mode"),
            ("/config/disks/0/image_type", json!("raw"), "image_type"),
            ("/config/net/0/mac", json!("52:54:00:ca:7a"), "mac"),
            ("/config/memory/shared", Value::Null, "memory.shared"),
            ("/state", json!("running"), "state"),
            ("/config/cpus/max_phys_bits", json!(300), "max_phys_bits"),
        ];
        for (ptr, value, needle) in cases {
            let mut v = info();
            *v.pointer_mut(ptr).unwrap() = value.clone();
            let e = parse_vm_info(Some(&v.to_string())).unwrap_err();
            assert!(e.contains(needle), "{ptr}: {e}");
        }
        let mut v = info();
        v["config"]["cpus"]
            .as_object_mut()
            .unwrap()
            .remove("max_phys_bits");
        let e = parse_vm_info(Some(&v.to_string())).unwrap_err();
        assert!(e.contains("max_phys_bits: missing field"), "{e}");
        v["config"].as_object_mut().unwrap().remove("console");
        assert!(parse_vm_info(None).is_err());
    }

    #[test]
    fn ping_features_must_be_an_array() {
        assert_eq!(
            parse_ping(Some(r#"{"version":"v1","features":["kvm"]}"#)),
            Ok(Some(vec!["kvm".into()]))
        );
        assert_eq!(parse_ping(Some(r#"{"version":"v1"}"#)), Ok(None));
        assert_eq!(parse_ping(None), Ok(None));
        assert!(parse_ping(Some(r#"{"features":"kvm"}"#)).is_err());
        assert!(parse_ping(Some("pong")).is_err());
    }
}
