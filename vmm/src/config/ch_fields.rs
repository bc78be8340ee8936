//! Every field of Cloud Hypervisor's VmConfig and of its `vm.add-*` bodies
//! (v53 line: what its `vm.info` returns, and what generated clients send
//! back to `vm.create`), with what this VMM does with it — the one place
//! that decides which fields a Cloud Hypervisor body may carry:
//!
//! - a field this VMM implements is passed on to the typed parser;
//! - one Cloud Hypervisor has and this VMM does not is accepted only with
//!   Cloud Hypervisor's default (or an empty or "off" value), and otherwise
//!   refused with its path and value — no setting is dropped silently;
//! - null is accepted where Cloud Hypervisor's field is optional, and
//!   refused by name where it is not (its serde refuses null for a plain
//!   `bool` or number even when the field may be left out);
//! - a field Cloud Hypervisor does not have is ignored, as its serde
//!   structs ignore it ([`api::ignored_fields`] logs it once): Kata's
//!   runtime-rs sends `payload.mrconfigid`, which no current Cloud
//!   Hypervisor has.
//!
//! It is also the one list of Cloud Hypervisor's defaults for what this
//! VMM does not implement: `vm.info` adds those Cloud Hypervisor's own
//! `vm.info` shows to the serialized config ([`report_defaults`]).

use serde_json::{json, Map, Value};

/// The JSON type of a field Cloud Hypervisor has and this VMM does not
/// implement (docs/openapi.yaml gives each its type): `[]` is no empty
/// value of an object field, as Cloud Hypervisor's own parser refuses it.
#[derive(Clone, Copy)]
pub(super) enum Shape {
    /// A string or a number: only null.
    Null,
    Array,
    Object,
}

/// Whether a field may be null: where Cloud Hypervisor's field is an
/// `Option`, null is "not given"; where it is not, its serde refuses null.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Null {
    Allowed,
    Refused,
}

/// What a field may hold.
#[derive(Clone, Copy)]
pub(super) enum Rule {
    /// Implemented here: passed on to the typed parser.
    Ours(Null),
    /// Passed on to the typed parser, which accepts only what changes
    /// nothing here; `vm.info` reports this value, Cloud Hypervisor's default.
    OursReported(fn() -> Value, Null),
    /// Not implemented: only this value is accepted.
    Default(fn() -> Value, Null),
    /// Not implemented: only this value is accepted, and `vm.info`
    /// reports it (as Cloud Hypervisor's own `vm.info` does).
    Reported(fn() -> Value, Null),
    /// Not implemented: only null, or the empty value of its shape.
    Empty(Shape),
    /// An object with its own rules.
    Object(&'static [(&'static str, Rule)], Null),
    /// An array of objects with these rules (null allowed: every such
    /// field of Cloud Hypervisor's is an `Option`).
    Array(&'static [(&'static str, Rule)]),
}

/// Ours, null allowed (an `Option` in Cloud Hypervisor, or one of this
/// VMM's own fields).
const OURS: Rule = Rule::Ours(Null::Allowed);
/// Ours, and not an `Option` in Cloud Hypervisor: null is refused.
const OURS_SET: Rule = Rule::Ours(Null::Refused);

const PAYLOAD: &[(&str, Rule)] = &[
    ("kernel", OURS),
    ("initramfs", OURS),
    ("cmdline", OURS),
    ("firmware", Rule::Empty(Shape::Null)),
    ("igvm", Rule::Empty(Shape::Null)),
    ("host_data", Rule::Empty(Shape::Null)),
];

/// Cloud Hypervisor's CpuTopology: every part required, as there.
const TOPOLOGY: &[(&str, Rule)] = &[
    ("threads_per_core", OURS_SET),
    ("cores_per_die", OURS_SET),
    ("dies_per_package", OURS_SET),
    ("packages", OURS_SET),
];

const CPUS: &[(&str, Rule)] = &[
    ("boot_vcpus", OURS_SET),
    ("max_vcpus", OURS_SET),
    ("topology", Rule::Object(TOPOLOGY, Null::Allowed)),
    ("kvm_hyperv", Rule::Reported(|| json!(false), Null::Refused)),
    ("max_phys_bits", Rule::Reported(|| json!(46), Null::Refused)),
    ("affinity", Rule::Empty(Shape::Array)),
    (
        "features",
        Rule::Object(
            &[("amx", Rule::Reported(|| json!(false), Null::Refused))],
            Null::Refused,
        ),
    ),
    ("nested", Rule::Reported(|| json!(true), Null::Refused)),
    (
        "core_scheduling",
        Rule::Reported(|| json!("Vm"), Null::Refused),
    ),
    ("profile", Rule::Reported(|| json!("Host"), Null::Refused)),
];

const MEMORY: &[(&str, Rule)] = &[
    ("size", OURS_SET),
    ("shared", OURS_SET),
    ("hugepages", OURS_SET),
    ("hotplug_size", OURS),
    ("hotplugged_size", Rule::Empty(Shape::Null)),
    ("mergeable", Rule::Reported(|| json!(false), Null::Refused)),
    (
        "hotplug_method",
        Rule::Reported(|| json!("Acpi"), Null::Refused),
    ),
    ("hugepage_size", Rule::Empty(Shape::Null)),
    ("prefault", Rule::Reported(|| json!(false), Null::Refused)),
    ("reserve", Rule::Reported(|| json!(false), Null::Refused)),
    ("thp", Rule::Reported(|| json!(true), Null::Refused)),
    ("zones", Rule::Empty(Shape::Array)),
];

/// The serial port (Cloud Hypervisor's ConsoleConfig; the PCI fields
/// mean nothing for it, so they are harmless there).
const SERIAL: &[(&str, Rule)] = &[
    ("mode", OURS_SET),
    ("file", OURS),
    ("socket", Rule::Empty(Shape::Null)),
    ("url", Rule::Empty(Shape::Null)),
    ("id", Rule::Empty(Shape::Null)),
    ("iommu", Rule::Default(|| json!(false), Null::Refused)),
    ("pci_segment", Rule::Default(|| json!(0), Null::Refused)),
    ("pci_device_id", Rule::Empty(Shape::Null)),
];

/// The virtio-console: the serial port's fields, its PCI segment reported.
const CONSOLE: &[(&str, Rule)] = &[
    ("mode", OURS_SET),
    ("file", OURS),
    ("socket", Rule::Empty(Shape::Null)),
    ("url", Rule::Empty(Shape::Null)),
    ("id", Rule::Empty(Shape::Null)),
    ("iommu", Rule::Default(|| json!(false), Null::Refused)),
    ("pci_segment", Rule::Reported(|| json!(0), Null::Refused)),
    ("pci_device_id", Rule::Empty(Shape::Null)),
];

const DEBUG_CONSOLE: &[(&str, Rule)] = &[
    ("mode", Rule::Reported(|| json!("Off"), Null::Refused)),
    ("file", Rule::Empty(Shape::Null)),
    ("socket", Rule::Empty(Shape::Null)),
    ("iobase", Rule::Reported(|| json!(0xe9), Null::Allowed)),
];

/// Every field is passed on: the net parser checks those it does not
/// implement itself, with the same messages as `--net`.
pub(super) const NET: &[(&str, Rule)] = &[
    ("tap", OURS),
    ("ip", OURS),
    ("mask", OURS),
    ("mac", OURS),
    ("host_mac", OURS),
    ("mtu", OURS),
    ("iommu", OURS_SET),
    ("num_queues", OURS_SET),
    ("queue_size", OURS_SET),
    ("vhost_user", OURS_SET),
    ("vhost_socket", OURS),
    (
        "vhost_mode",
        Rule::OursReported(|| json!("Client"), Null::Refused),
    ),
    ("id", OURS),
    ("fds", OURS),
    ("rate_limiter_config", OURS),
    ("pci_segment", OURS_SET),
    ("pci_device_id", OURS),
    ("offload_tso", OURS_SET),
    (
        "offload_ufo",
        Rule::OursReported(|| json!(true), Null::Refused),
    ),
    ("offload_csum", OURS_SET),
    ("transport", OURS),
];

pub(super) const FS: &[(&str, Rule)] = &[
    ("tag", OURS_SET),
    ("socket", OURS_SET),
    ("num_queues", OURS_SET),
    ("queue_size", OURS_SET),
    ("id", OURS),
    ("iommu", Rule::Default(|| json!(false), Null::Refused)),
    ("pci_segment", OURS_SET),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("dax", OURS),
    ("cache_size", OURS),
    ("dax_prefault", OURS),
    ("transport", OURS),
    ("control_socket", OURS),
    ("dax_policy", OURS),
];

pub(super) const PMEM: &[(&str, Rule)] = &[
    ("file", OURS_SET),
    ("size", OURS),
    ("iommu", OURS_SET),
    ("discard_writes", OURS_SET),
    ("id", OURS),
    ("pci_segment", OURS_SET),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("transport", OURS),
];

/// Every field is passed on: the disk parser checks those it does not
/// implement itself, with the same messages as `--disk`.
pub(super) const DISK: &[(&str, Rule)] = &[
    ("path", OURS),
    ("readonly", OURS_SET),
    ("direct", OURS_SET),
    ("iommu", OURS_SET),
    ("num_queues", OURS_SET),
    ("queue_size", OURS_SET),
    ("vhost_user", OURS_SET),
    ("vhost_socket", OURS),
    ("rate_limit_group", OURS),
    ("rate_limiter_config", OURS),
    ("pci_segment", OURS_SET),
    ("pci_device_id", OURS),
    ("id", OURS),
    ("serial", OURS),
    ("queue_affinity", OURS),
    ("backing_files", OURS_SET),
    ("sparse", OURS_SET),
    (
        "image_type",
        Rule::OursReported(|| json!("Raw"), Null::Refused),
    ),
    ("lock_granularity", OURS_SET),
    ("disable_io_uring", OURS_SET),
    ("disable_aio", OURS_SET),
    ("transport", OURS),
];

const RNG: &[(&str, Rule)] = &[
    ("src", OURS_SET),
    ("iommu", OURS_SET),
    ("pci_segment", OURS_SET),
    ("id", Rule::Empty(Shape::Null)),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("transport", OURS),
];

pub(super) const VSOCK: &[(&str, Rule)] = &[
    ("cid", OURS_SET),
    ("socket", OURS_SET),
    ("iommu", OURS_SET),
    ("id", OURS),
    ("pci_segment", OURS_SET),
    ("pci_device_id", Rule::Empty(Shape::Null)),
    ("transport", OURS),
];

const PLATFORM: &[(&str, Rule)] = &[
    ("num_pci_segments", OURS_SET),
    ("iommu_segments", Rule::Empty(Shape::Array)),
    (
        "iommu_address_width_bits",
        Rule::Default(|| json!(64), Null::Refused),
    ),
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
    ("tdx", Rule::Default(|| json!(false), Null::Refused)),
    ("sev_snp", Rule::Default(|| json!(false), Null::Refused)),
    ("iommufd", Rule::Default(|| json!(false), Null::Refused)),
    ("iommufd_fd", Rule::Empty(Shape::Null)),
    ("vfio_p2p_dma", Rule::Default(|| json!(true), Null::Refused)),
];

pub(super) const VM_CONFIG: &[(&str, Rule)] = &[
    ("payload", Rule::Object(PAYLOAD, Null::Allowed)),
    ("cpus", Rule::Object(CPUS, Null::Refused)),
    ("memory", Rule::Object(MEMORY, Null::Refused)),
    ("serial", Rule::Object(SERIAL, Null::Refused)),
    ("console", Rule::Object(CONSOLE, Null::Refused)),
    ("debug_console", Rule::Object(DEBUG_CONSOLE, Null::Refused)),
    ("fs", Rule::Array(FS)),
    ("pmem", Rule::Array(PMEM)),
    ("rng", Rule::Object(RNG, Null::Refused)),
    ("platform", Rule::Object(PLATFORM, Null::Allowed)),
    ("rate_limit_groups", Rule::Empty(Shape::Array)),
    ("disks", Rule::Array(DISK)),
    ("net", Rule::Array(NET)),
    ("balloon", Rule::Empty(Shape::Object)),
    ("generic_vhost_user", Rule::Empty(Shape::Array)),
    ("devices", Rule::Empty(Shape::Array)),
    ("user_devices", Rule::Empty(Shape::Array)),
    ("vdpa", Rule::Empty(Shape::Array)),
    ("vsock", Rule::Object(VSOCK, Null::Allowed)),
    ("numa", Rule::Empty(Shape::Array)),
    ("pci_segments", Rule::Empty(Shape::Array)),
    ("tpm", Rule::Empty(Shape::Object)),
    ("rtc", Rule::Empty(Shape::Null)),
    ("ivshmem", Rule::Empty(Shape::Null)),
    ("pvmemcontrol", Rule::Empty(Shape::Null)),
    ("landlock_rules", Rule::Empty(Shape::Array)),
    ("sgx_epc", Rule::Empty(Shape::Array)),
    ("iommu", Rule::Reported(|| json!(false), Null::Refused)),
    ("watchdog", Rule::Reported(|| json!(false), Null::Refused)),
    ("gdb", Rule::Default(|| json!(false), Null::Refused)),
    ("pvpanic", OURS_SET),
    (
        "landlock_enable",
        Rule::Reported(|| json!(false), Null::Refused),
    ),
];

/// Cloud Hypervisor's VmSnapshotConfig (`vm.snapshot`).
pub(super) const SNAPSHOT: &[(&str, Rule)] = &[("destination_url", OURS_SET)];

/// Cloud Hypervisor's RestoredNetConfig: the fds themselves come with the
/// request (SCM_RIGHTS); numbers in the body would name fds of the
/// sender's process, so only null (what ch-remote sends) or [] is taken.
const RESTORED_NET: &[(&str, Rule)] = &[
    ("id", OURS_SET),
    ("num_fds", OURS_SET),
    ("fds", Rule::Empty(Shape::Array)),
];

/// Cloud Hypervisor's RestoreConfig (`vm.restore`): memory is restored by
/// copy only; new tap fds come as `net_fds` says, no VFIO fds.
pub(super) const RESTORE: &[(&str, Rule)] = &[
    ("source_url", OURS_SET),
    ("prefault", OURS_SET),
    (
        "memory_restore_mode",
        Rule::Default(|| json!("Copy"), Null::Refused),
    ),
    ("net_fds", Rule::Array(RESTORED_NET)),
    ("vfio_fds", Rule::Empty(Shape::Array)),
    ("iommufd_fd", Rule::Empty(Shape::Null)),
    ("resume", OURS_SET),
    ("zone_updates", Rule::Empty(Shape::Array)),
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
pub(super) fn reduce_object(
    path: &str,
    v: &Value,
    rules: &[(&str, Rule)],
) -> Result<Value, String> {
    let Some(obj) = v.as_object() else {
        return Err(format!("{path}: expected an object, got {v}"));
    };
    let mut kept = Map::new();
    for (key, value) in obj {
        let here = format!("{path}.{key}");
        let Some((_, rule)) = rules.iter().find(|(k, _)| k == key) else {
            api::ignored_fields::ignore(path, key);
            continue;
        };
        let null = match *rule {
            Rule::Ours(null)
            | Rule::OursReported(_, null)
            | Rule::Default(_, null)
            | Rule::Reported(_, null)
            | Rule::Object(_, null) => null,
            Rule::Empty(_) | Rule::Array(_) => Null::Allowed,
        };
        if value.is_null() {
            if null == Null::Refused {
                return Err(format!(
                    "{here}=null is invalid: the field is not optional (leave it out for its default)"
                ));
            }
            // Allowed null is "not given", ours or not: the typed
            // config then takes its default, as for a missing key.
            continue;
        }
        match *rule {
            Rule::Ours(_) | Rule::OursReported(..) => {
                kept.insert(key.clone(), value.clone());
            }
            Rule::Default(default, _) | Rule::Reported(default, _) => {
                if *value != default() {
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
            Rule::Object(inner, _) => {
                let reduced = reduce_object(&here, value, inner)?;
                if inner.iter().any(|(_, r)| is_ours(*r)) {
                    kept.insert(key.clone(), reduced);
                }
            }
            Rule::Array(inner) => {
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

/// Whether the typed parser gets the field.
fn is_ours(rule: Rule) -> bool {
    matches!(rule, Rule::Ours(_) | Rule::OursReported(..))
}

/// Whether `rules` (or a nested object's) report a value in `vm.info`.
fn reports(rules: &[(&str, Rule)]) -> bool {
    rules.iter().any(|(_, rule)| match rule {
        Rule::Reported(..) | Rule::OursReported(..) => true,
        Rule::Object(inner, _) => reports(inner),
        _ => false,
    })
}

/// Adds to a serialized VmConfig the values `vm.info` reports for what
/// this VMM does not implement: Cloud Hypervisor's defaults, from the
/// tables above (the one list of them).
pub(super) fn report_defaults(config: &mut Value) {
    report(config, VM_CONFIG);
}

fn report(v: &mut Value, rules: &[(&str, Rule)]) {
    let Some(obj) = v.as_object_mut() else {
        return;
    };
    for (key, rule) in rules {
        match *rule {
            Rule::Reported(default, _) | Rule::OursReported(default, _) => {
                obj.insert((*key).to_string(), default());
            }
            Rule::Object(inner, _) => {
                // An object the config does not have is added when it
                // reports something (Cloud Hypervisor's debug console).
                if !obj.contains_key(*key) && reports(inner) {
                    obj.insert((*key).to_string(), Value::Object(Map::new()));
                }
                if let Some(nested) = obj.get_mut(*key) {
                    report(nested, inner);
                }
            }
            Rule::Array(inner) => {
                if let Some(items) = obj.get_mut(*key).and_then(Value::as_array_mut) {
                    for item in items {
                        report(item, inner);
                    }
                }
            }
            Rule::Ours(_) | Rule::Default(..) | Rule::Empty(_) => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Checks a whole Cloud Hypervisor VmConfig; returns the fields this
    /// VMM implements, for the typed parser.
    fn reduce_vm_config(body: &Value) -> Result<Value, String> {
        reduce_object("VmConfig", body, VM_CONFIG)
    }

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
        assert!(with(&["watchdog"], json!(true)).starts_with("VmConfig.watchdog=true"));
        assert!(with(&["cpus", "features", "amx"], json!(true))
            .starts_with("VmConfig.cpus.features.amx=true"));
        // Null where Cloud Hypervisor's field is not optional (its serde
        // refuses it): refused by name, whatever the field's rule.
        for path in [
            &["landlock_enable"][..],
            &["cpus"],
            &["cpus", "max_vcpus"],
            &["cpus", "kvm_hyperv"],
            &["memory", "shared"],
            &["fs", "0", "num_queues"],
        ] {
            let mut c = ch_vm_info_config();
            let mut at = &mut c;
            for p in &path[..path.len() - 1] {
                at = match p.parse::<usize>() {
                    Ok(i) => &mut at[i],
                    Err(_) => &mut at[*p],
                };
            }
            at[path[path.len() - 1]] = Value::Null;
            let e = reduce_vm_config(&c).unwrap_err();
            assert!(
                e.ends_with(
                    "=null is invalid: the field is not optional (leave it out for its default)"
                ),
                "{path:?}: {e}"
            );
        }
        assert!(with(&["landlock_enable"], json!("false"))
            .starts_with("VmConfig.landlock_enable=\"false\" is not supported"));
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

    #[test]
    fn fields_cloud_hypervisor_does_not_have_are_ignored_at_every_level() {
        let mut c = ch_vm_info_config();
        c["bogus"] = json!(1);
        c["payload"]["mrconfigid"] = Value::Null;
        c["payload"]["host_data"] = Value::Null;
        c["cpus"]["features"]["future"] = json!(true);
        c["fs"][0]["frob"] = json!({"x": 1});
        c["serial"]["iommu"] = json!(false);
        c["cpus"]["topology"] = json!({"threads_per_core": 1, "cores_per_die": 1,
                                       "dies_per_package": 1, "packages": 1, "modules": 1});
        let reduced = reduce_vm_config(&c).unwrap();
        let mut want = ch_vm_info_config();
        want["cpus"]["topology"] = json!({"threads_per_core": 1, "cores_per_die": 1,
                                          "dies_per_package": 1, "packages": 1});
        assert_eq!(reduced, reduce_vm_config(&want).unwrap());
        // Where Cloud Hypervisor's field is optional, null is "not given".
        c["debug_console"]["iobase"] = Value::Null;
        c["platform"] = Value::Null;
        c["vsock"] = Value::Null;
        assert!(reduce_vm_config(&c).is_ok());
        // A device body on its own, as vm.add-fs sends it.
        let fs = reduce_object(
            "FsConfig",
            &json!({"tag": "t", "socket": "/s", "frob": 1, "id": null}),
            FS,
        )
        .unwrap();
        // An allowed null is dropped like a missing key: the typed config
        // takes its default (None for `id`).
        assert_eq!(fs, json!({"tag": "t", "socket": "/s"}));
    }
}
