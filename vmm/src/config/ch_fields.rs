//! Every field of Cloud Hypervisor's VmConfig (v53 line: what its `vm.info`
//! returns, and what generated clients send back to `vm.create`), with what
//! this VMM does with it. A field this VMM implements is passed on; one it
//! does not is accepted only with Cloud Hypervisor's default (or an empty or
//! "off" value), and otherwise refused with its path and value — no setting
//! is dropped silently. A field Cloud Hypervisor does not have is refused.

use serde_json::{json, Map, Value};

/// The JSON type of a field Cloud Hypervisor has and this VMM does not
/// implement (docs/openapi.yaml gives each its type): `[]` is no empty
/// value of an object field, as Cloud Hypervisor's own parser refuses it.
#[derive(Clone, Copy)]
enum Shape {
    /// A string or a number: only null.
    Null,
    Array,
    Object,
}

/// What a field may hold.
#[derive(Clone, Copy)]
enum Rule {
    /// Implemented here: passed on to the typed parser.
    Ours,
    /// Not implemented: only this value (or null) is accepted.
    Default(fn() -> Value),
    /// Not implemented: only null, or the empty value of its shape.
    Empty(Shape),
    /// An object with its own rules.
    Object(&'static [(&'static str, Rule)]),
    /// An array of objects with these rules.
    Array(&'static [(&'static str, Rule)]),
}

const PAYLOAD: &[(&str, Rule)] = &[
    ("kernel", Rule::Ours),
    ("initramfs", Rule::Ours),
    ("cmdline", Rule::Ours),
    ("firmware", Rule::Empty(Shape::Null)),
    ("igvm", Rule::Empty(Shape::Null)),
    ("host_data", Rule::Empty(Shape::Null)),
];

const CPUS: &[(&str, Rule)] = &[
    ("boot_vcpus", Rule::Ours),
    ("max_vcpus", Rule::Ours),
    ("topology", Rule::Ours),
    ("kvm_hyperv", Rule::Default(|| json!(false))),
    ("max_phys_bits", Rule::Default(|| json!(46))),
    ("affinity", Rule::Empty(Shape::Array)),
    (
        "features",
        Rule::Object(&[("amx", Rule::Default(|| json!(false)))]),
    ),
    ("nested", Rule::Default(|| json!(true))),
    ("core_scheduling", Rule::Default(|| json!("Vm"))),
    ("profile", Rule::Default(|| json!("Host"))),
];

const MEMORY: &[(&str, Rule)] = &[
    ("size", Rule::Ours),
    ("shared", Rule::Ours),
    ("hugepages", Rule::Ours),
    ("hotplug_size", Rule::Ours),
    ("hotplugged_size", Rule::Empty(Shape::Null)),
    ("mergeable", Rule::Default(|| json!(false))),
    ("hotplug_method", Rule::Default(|| json!("Acpi"))),
    ("hugepage_size", Rule::Empty(Shape::Null)),
    ("prefault", Rule::Default(|| json!(false))),
    ("reserve", Rule::Default(|| json!(false))),
    ("thp", Rule::Default(|| json!(true))),
    ("zones", Rule::Empty(Shape::Array)),
];

const CONSOLE: &[(&str, Rule)] = &[
    ("mode", Rule::Ours),
    ("file", Rule::Ours),
    ("socket", Rule::Empty(Shape::Null)),
    ("iommu", Rule::Default(|| json!(false))),
    ("pci_segment", Rule::Default(|| json!(0))),
    ("url", Rule::Empty(Shape::Null)),
];

const DEBUG_CONSOLE: &[(&str, Rule)] = &[
    ("mode", Rule::Default(|| json!("Off"))),
    ("file", Rule::Empty(Shape::Null)),
    ("iobase", Rule::Default(|| json!(0xe9))),
];

/// Every field is passed on: the net parser checks those it does not
/// implement itself, with the same messages as `--net`.
const NET: &[(&str, Rule)] = &[
    ("tap", Rule::Ours),
    ("ip", Rule::Ours),
    ("mask", Rule::Ours),
    ("mac", Rule::Ours),
    ("host_mac", Rule::Ours),
    ("mtu", Rule::Ours),
    ("iommu", Rule::Ours),
    ("num_queues", Rule::Ours),
    ("queue_size", Rule::Ours),
    ("vhost_user", Rule::Ours),
    ("vhost_socket", Rule::Ours),
    ("vhost_mode", Rule::Ours),
    ("id", Rule::Ours),
    ("fds", Rule::Ours),
    ("rate_limiter_config", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("pci_device_id", Rule::Ours),
    ("offload_tso", Rule::Ours),
    ("offload_ufo", Rule::Ours),
    ("offload_csum", Rule::Ours),
    ("transport", Rule::Ours),
];

const FS: &[(&str, Rule)] = &[
    ("tag", Rule::Ours),
    ("socket", Rule::Ours),
    ("num_queues", Rule::Ours),
    ("queue_size", Rule::Ours),
    ("id", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("dax", Rule::Ours),
    ("cache_size", Rule::Ours),
    ("dax_prefault", Rule::Ours),
    ("transport", Rule::Ours),
    ("control_socket", Rule::Ours),
    ("dax_policy", Rule::Ours),
];

const PMEM: &[(&str, Rule)] = &[
    ("file", Rule::Ours),
    ("size", Rule::Ours),
    ("iommu", Rule::Ours),
    ("discard_writes", Rule::Ours),
    ("id", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("transport", Rule::Ours),
];

/// Every field is passed on: the disk parser checks those it does not
/// implement itself, with the same messages as `--disk`.
const DISK: &[(&str, Rule)] = &[
    ("path", Rule::Ours),
    ("readonly", Rule::Ours),
    ("direct", Rule::Ours),
    ("iommu", Rule::Ours),
    ("num_queues", Rule::Ours),
    ("queue_size", Rule::Ours),
    ("vhost_user", Rule::Ours),
    ("vhost_socket", Rule::Ours),
    ("rate_limit_group", Rule::Ours),
    ("rate_limiter_config", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("pci_device_id", Rule::Ours),
    ("id", Rule::Ours),
    ("serial", Rule::Ours),
    ("queue_affinity", Rule::Ours),
    ("backing_files", Rule::Ours),
    ("sparse", Rule::Ours),
    ("image_type", Rule::Ours),
    ("lock_granularity", Rule::Ours),
    ("disable_io_uring", Rule::Ours),
    ("disable_aio", Rule::Ours),
    ("transport", Rule::Ours),
];

const RNG: &[(&str, Rule)] = &[
    ("src", Rule::Ours),
    ("iommu", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("transport", Rule::Ours),
];

const VSOCK: &[(&str, Rule)] = &[
    ("cid", Rule::Ours),
    ("socket", Rule::Ours),
    ("iommu", Rule::Ours),
    ("id", Rule::Ours),
    ("pci_segment", Rule::Ours),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("transport", Rule::Ours),
];

const PLATFORM: &[(&str, Rule)] = &[
    ("num_pci_segments", Rule::Ours),
    ("iommu_segments", Rule::Empty(Shape::Array)),
    ("iommu_address_width_bits", Rule::Empty(Shape::Null)),
    ("system_serial_number", Rule::Empty(Shape::Null)),
    ("serial_number", Rule::Empty(Shape::Null)),
    ("system_uuid", Rule::Empty(Shape::Null)),
    ("uuid", Rule::Empty(Shape::Null)),
    ("oem_strings", Rule::Empty(Shape::Array)),
    ("system_manufacturer", Rule::Empty(Shape::Null)),
    ("system_product_name", Rule::Empty(Shape::Null)),
    ("system_version", Rule::Empty(Shape::Null)),
    ("system_family", Rule::Empty(Shape::Null)),
    ("system_sku_number", Rule::Empty(Shape::Null)),
    ("chassis_asset_tag", Rule::Empty(Shape::Null)),
    ("tdx", Rule::Default(|| json!(false))),
    ("sev_snp", Rule::Default(|| json!(false))),
    ("iommufd", Rule::Default(|| json!(false))),
    ("vfio_p2p_dma", Rule::Default(|| json!(true))),
];

const VM_CONFIG: &[(&str, Rule)] = &[
    ("payload", Rule::Object(PAYLOAD)),
    ("cpus", Rule::Object(CPUS)),
    ("memory", Rule::Object(MEMORY)),
    ("serial", Rule::Object(CONSOLE)),
    ("console", Rule::Object(CONSOLE)),
    ("debug_console", Rule::Object(DEBUG_CONSOLE)),
    ("fs", Rule::Array(FS)),
    ("pmem", Rule::Array(PMEM)),
    ("rng", Rule::Object(RNG)),
    ("platform", Rule::Object(PLATFORM)),
    ("rate_limit_groups", Rule::Empty(Shape::Array)),
    ("disks", Rule::Array(DISK)),
    ("net", Rule::Array(NET)),
    ("balloon", Rule::Empty(Shape::Object)),
    ("generic_vhost_user", Rule::Empty(Shape::Array)),
    ("devices", Rule::Empty(Shape::Array)),
    ("user_devices", Rule::Empty(Shape::Array)),
    ("vdpa", Rule::Empty(Shape::Array)),
    ("vsock", Rule::Object(VSOCK)),
    ("numa", Rule::Empty(Shape::Array)),
    ("pci_segments", Rule::Empty(Shape::Array)),
    ("tpm", Rule::Empty(Shape::Object)),
    ("landlock_rules", Rule::Empty(Shape::Array)),
    ("sgx_epc", Rule::Empty(Shape::Array)),
    ("iommu", Rule::Default(|| json!(false))),
    ("watchdog", Rule::Default(|| json!(false))),
    ("pvpanic", Rule::Ours),
    ("landlock_enable", Rule::Default(|| json!(false))),
];

fn is_empty(v: &Value, shape: Shape) -> bool {
    match (v, shape) {
        (Value::Null, _) => true,
        (Value::Array(a), Shape::Array) => a.is_empty(),
        (Value::Object(o), Shape::Object) => o.is_empty(),
        _ => false,
    }
}

/// Checks `v` against `rules`; returns it with only the fields this VMM
/// implements (and the nested objects it implements fields of).
fn reduce_object(path: &str, v: &Value, rules: &[(&str, Rule)]) -> Result<Value, String> {
    let Some(obj) = v.as_object() else {
        return Err(format!("{path}: expected an object, got {v}"));
    };
    let mut kept = Map::new();
    for (key, value) in obj {
        let here = format!("{path}.{key}");
        let Some((_, rule)) = rules.iter().find(|(k, _)| k == key) else {
            let known: Vec<&str> = rules.iter().map(|(k, _)| *k).collect();
            return Err(format!("{here}: unknown field (Cloud Hypervisor's VmConfig has no such field here; known: {})", known.join(", ")));
        };
        match *rule {
            Rule::Ours => {
                kept.insert(key.clone(), value.clone());
            }
            Rule::Default(default) => {
                if !value.is_null() && *value != default() {
                    return Err(format!(
                        "{here}={value} is not supported (only the default {} is)",
                        default()
                    ));
                }
            }
            Rule::Empty(shape) => {
                if !is_empty(value, shape) {
                    let empty = match shape {
                        Shape::Null => "null",
                        Shape::Array => "null or []",
                        Shape::Object => "null or {}",
                    };
                    return Err(format!(
                        "{here}={value} is not supported by this VMM (only {empty})"
                    ));
                }
            }
            Rule::Object(inner) => {
                if value.is_null() {
                    continue;
                }
                let reduced = reduce_object(&here, value, inner)?;
                if inner.iter().any(|(_, r)| matches!(r, Rule::Ours)) {
                    kept.insert(key.clone(), reduced);
                }
            }
            Rule::Array(inner) => {
                if value.is_null() {
                    continue;
                }
                let Some(items) = value.as_array() else {
                    return Err(format!("{here}: expected an array, got {value}"));
                };
                let items = items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| reduce_object(&format!("{here}[{i}]"), item, inner))
                    .collect::<Result<Vec<_>, _>>()?;
                kept.insert(key.clone(), Value::Array(items));
            }
        }
    }
    Ok(Value::Object(kept))
}

/// Checks a whole Cloud Hypervisor VmConfig; returns the fields this VMM
/// implements, for the typed parser.
pub fn reduce_vm_config(body: &Value) -> Result<Value, String> {
    reduce_object("VmConfig", body, VM_CONFIG)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What Cloud Hypervisor's vm.info returns for a created VM (the shape
    /// its generated clients send back), from ch-compat's reference.
    pub fn ch_vm_info_config() -> Value {
        json!({
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "kvm_hyperv": false, "max_phys_bits": 46,
                     "features": {"amx": false}, "nested": true, "core_scheduling": "Vm", "profile": "Host"},
            "memory": {"size": 536870912u64, "mergeable": false, "hotplug_method": "Acpi", "shared": true,
                       "hugepages": false, "prefault": false, "reserve": false, "thp": true},
            "payload": {"kernel": "/k", "cmdline": "console=ttyS0", "initramfs": "/i"},
            "rng": {"pci_segment": 0, "src": "/dev/urandom"},
            "serial": {"mode": "Tty"},
            "console": {"mode": "Off", "pci_segment": 0},
            "debug_console": {"mode": "Off", "iobase": 233},
            "fs": [{"pci_segment": 0, "tag": "t", "socket": "/s", "num_queues": 1, "queue_size": 1024}],
            "pmem": [{"pci_segment": 0, "file": "/p", "size": 67108864, "discard_writes": false}],
            "pvpanic": false, "iommu": false, "watchdog": false, "landlock_enable": false
        })
    }

    #[test]
    fn cloud_hypervisors_own_vm_info_is_accepted() {
        let reduced = reduce_vm_config(&ch_vm_info_config()).unwrap();
        assert!(
            reduced["cpus"].get("nested").is_none(),
            "CH-only fields are checked, not passed on"
        );
        assert_eq!(reduced["fs"][0]["pci_segment"], 0);
    }

    #[test]
    fn a_non_default_value_is_refused_with_its_path_and_value() {
        let with = |path: &[&str], v: Value| {
            let mut c = ch_vm_info_config();
            let mut at = &mut c;
            for p in &path[..path.len() - 1] {
                at = &mut at[*p];
            }
            at[path[path.len() - 1]] = v;
            reduce_vm_config(&c).unwrap_err()
        };
        assert_eq!(
            with(&["cpus", "kvm_hyperv"], json!(true)),
            "VmConfig.cpus.kvm_hyperv=true is not supported (only the default false is)"
        );
        assert_eq!(
            with(&["memory", "thp"], json!(false)),
            "VmConfig.memory.thp=false is not supported (only the default true is)"
        );
        assert!(with(&["disks"], json!([{"path": "/d", "frob": 1}]))
            .starts_with("VmConfig.disks[0].frob: unknown field"));
        assert!(with(&["watchdog"], json!(true)).starts_with("VmConfig.watchdog=true"));
        assert!(with(&["cpus", "features", "amx"], json!(true))
            .starts_with("VmConfig.cpus.features.amx=true"));
        assert!(with(&["bogus"], json!(1)).starts_with("VmConfig.bogus: unknown field"));
        // Empty, but of another type than Cloud Hypervisor's field (the
        // fuzzer's vm.create with `"landlock_rules": {}` was accepted).
        assert_eq!(
            with(&["landlock_rules"], json!({})),
            "VmConfig.landlock_rules={} is not supported by this VMM (only null or [])"
        );
        assert!(with(&["tpm"], json!([])).ends_with("(only null or {})"));
        assert!(with(&["payload", "firmware"], json!("")).ends_with("(only null)"));
        assert!(with(&["payload", "firmware"], json!([])).ends_with("(only null)"));
        assert!(reduce_vm_config(
            &json!({"payload": {"kernel": "/k"}, "landlock_rules": [], "tpm": {}, "balloon": null})
        )
        .is_ok());
        assert!(with(&["debug_console", "mode"], json!("Tty"))
            .starts_with("VmConfig.debug_console.mode=\"Tty\""));
    }
}
