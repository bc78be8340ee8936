//! `vm.resize` with Cloud Hypervisor's VmResize body (`desired_vcpus`,
//! `desired_ram`, `desired_balloon`, each optional) and its answers:
//!
//! - `desired_vcpus` on a booted VM hot-plugs vCPUs or asks the guest to
//!   eject some (ACPI); 204 once asked, also when the count is already
//!   the guest's (Kata sends it on every sandbox and container start);
//!   `cpus.boot_vcpus` then reports the count, as in Cloud Hypervisor, so
//!   a reboot comes back with it;
//! - while a removed vCPU still waits for the guest to eject it: 429, as
//!   Cloud Hypervisor answers (`VcpuPendingRemovedVcpu`); Kata retries;
//! - `desired_ram` on a booted VM grows RAM by ACPI memory hot-plug
//!   ([`crate::memory::hotplug`]); a size at or below the current one changes
//!   nothing (ACPI memory is never unplugged); `memory.size` then reports
//!   what the guest has;
//! - before boot both only set the configuration (Cloud Hypervisor does the
//!   same, though without checking them: here a bad value is 400 and
//!   changes nothing);
//! - vCPUs are resized before RAM, as in Cloud Hypervisor;
//! - `desired_balloon` is refused (501, naming it): there is no balloon.

use api::{ApiError, VmmReply, VmmResult};
use serde_json::Value;

use crate::config::{MemoryConfig, VmConfig};
use crate::memory::hotplug::RamHotplugError;
use crate::vcpu::hotplug::VcpuHotplugError;
use crate::vcpu::hotplug_controller::{check_vcpu_count, VcpuResizeError};
use crate::vm::Vm;

const ENDPOINT: &str = "vm.resize";

#[derive(Debug, Default)]
struct VmResize {
    desired_vcpus: Option<u32>,
    desired_ram: Option<u64>,
    desired_balloon: Option<u64>,
}

impl VmResize {
    /// Field by field, so an error names the field.
    fn parse(body: &Value) -> Result<Self, String> {
        let obj = body
            .as_object()
            .ok_or_else(|| format!("VmResize: expected an object, got {body}"))?;
        let mut r = VmResize::default();
        for (key, value) in obj {
            // null is "not given" (ch-remote sends the fields it leaves
            // out as null), but only for a field that exists.
            if value.is_null()
                && ["desired_vcpus", "desired_ram", "desired_balloon"].contains(&key.as_str())
            {
                continue;
            }
            let n = || {
                value.as_u64().ok_or_else(|| {
                    format!("VmResize.{key}={value} is invalid: expected an unsigned integer")
                })
            };
            match key.as_str() {
                "desired_vcpus" => {
                    let v = n()?;
                    r.desired_vcpus = Some(u32::try_from(v).map_err(|_| {
                        format!(
                            "VmResize.desired_vcpus={v} is invalid: expected at most {}",
                            u32::MAX
                        )
                    })?);
                }
                "desired_ram" => r.desired_ram = Some(n()?),
                "desired_balloon" => r.desired_balloon = Some(n()?),
                // Cloud Hypervisor's VmResizeData ignores a field it does
                // not have, and so does this VMM (logged once).
                other => api::ignored_fields::ignore("VmResize", other),
            }
        }
        Ok(r)
    }
}

/// What a booted VM does with `desired_vcpus` and `desired_ram` (a trait
/// so the answers can be tested without a guest).
pub trait VmResizer {
    fn resize_vcpus(&mut self, desired: u32) -> Result<bool, VcpuHotplugError>;
    /// Guest RAM after growing it towards `desired` bytes.
    fn resize_memory(&mut self, desired: u64) -> Result<u64, RamHotplugError>;
}

impl VmResizer for Vm {
    fn resize_vcpus(&mut self, desired: u32) -> Result<bool, VcpuHotplugError> {
        Vm::resize_vcpus(self, desired)
    }

    fn resize_memory(&mut self, desired: u64) -> Result<u64, RamHotplugError> {
        Vm::resize_memory(self, desired)
    }
}

fn not_implemented(message: String) -> ApiError {
    ApiError {
        status: 501,
        message,
    }
}

/// Answers `body` for the VM configured as `config`, booted as `vm` (None
/// before boot or after shutdown).
pub fn resize(body: &Value, config: &mut VmConfig, vm: Option<&mut impl VmResizer>) -> VmmResult {
    let r = VmResize::parse(body).map_err(|e| ApiError::bad_request(format!("{ENDPOINT}: {e}")))?;
    if let Some(balloon) = r.desired_balloon {
        return Err(not_implemented(format!(
            "{ENDPOINT}: desired_balloon={balloon} is not supported by dax-vmm: there is no virtio-balloon device (see docs/api.md)"
        )));
    }
    match vm {
        None => {
            // Both checked before either is applied: a bad body changes nothing.
            let memory = r
                .desired_ram
                .map(|ram| memory_of_size(&config.memory, ram))
                .transpose()?;
            if let Some(desired) = r.desired_vcpus {
                check_vcpus(desired, config.cpus.max_vcpus)?;
                config.cpus.boot_vcpus = desired;
            }
            if let Some(m) = memory {
                config.memory = m;
            }
        }
        Some(vm) => {
            if let Some(desired) = r.desired_vcpus {
                resize_vcpus(vm, desired)?;
                config.cpus.boot_vcpus = desired;
            }
            if let Some(desired) = r.desired_ram {
                let size = vm.resize_memory(desired).map_err(|e| {
                    let message = format!("{ENDPOINT}: {e}");
                    if e.is_refusal() {
                        ApiError::bad_request(message)
                    } else {
                        ApiError::internal(message)
                    }
                })?;
                config.memory.size = size;
            }
        }
    }
    Ok(VmmReply::NoContent)
}

fn check_vcpus(desired: u32, max: u32) -> Result<(), ApiError> {
    check_vcpu_count(desired, max).map_err(|e| ApiError::bad_request(format!("{ENDPOINT}: {e}")))
}

fn resize_vcpus(vm: &mut impl VmResizer, desired: u32) -> Result<(), ApiError> {
    match vm.resize_vcpus(desired) {
        Ok(_) => Ok(()),
        Err(VcpuHotplugError::Resize(e @ VcpuResizeError::RemovalPending { .. })) => {
            Err(ApiError::too_many_requests(format!("{ENDPOINT}: {e}")))
        }
        Err(VcpuHotplugError::Resize(e)) => Err(ApiError::bad_request(format!("{ENDPOINT}: {e}"))),
        Err(e) => Err(ApiError::internal(format!("{ENDPOINT}: {e}"))),
    }
}

/// Before boot, `desired_ram` becomes the configured size, checked as
/// `--memory size=` is (with the configuration's other keys).
fn memory_of_size(m: &MemoryConfig, desired: u64) -> Result<MemoryConfig, ApiError> {
    let toggle = |b: bool| if b { "on" } else { "off" };
    let hotplug = m
        .hotplug_size
        .map(|h| format!(",hotplug_size={h}"))
        .unwrap_or_default();
    MemoryConfig::parse(&format!(
        "size={desired},shared={},hugepages={}{hotplug}",
        toggle(m.shared),
        toggle(m.hugepages),
    ))
    .map_err(|e| ApiError::bad_request(format!("{ENDPOINT}: desired_ram: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::json::vm_config_from_json;
    use serde_json::json;

    /// Answers as the hot-plug state would: `present` vCPUs, removal pending or not.
    struct FakeVm {
        present: u32,
        max: u32,
        removal_pending: bool,
        asked: Vec<u32>,
        /// Guest RAM, growing up to `ram_limit`; `ram_fails` makes adding fail.
        ram: u64,
        ram_limit: u64,
        ram_fails: bool,
    }

    impl VmResizer for FakeVm {
        fn resize_memory(&mut self, desired: u64) -> Result<u64, RamHotplugError> {
            if desired > self.ram_limit {
                return Err(RamHotplugError::AboveLimit {
                    desired,
                    limit: self.ram_limit,
                    size: 1 << 30,
                    hotplug: self.ram_limit - (1 << 30),
                });
            }
            if self.ram_fails {
                return Err(RamHotplugError::Failed("no memory".into()));
            }
            self.ram = self.ram.max(desired);
            Ok(self.ram)
        }

        fn resize_vcpus(&mut self, desired: u32) -> Result<bool, VcpuHotplugError> {
            self.asked.push(desired);
            if desired > self.max {
                return Err(VcpuResizeError::AboveMax {
                    desired,
                    max: self.max,
                }
                .into());
            }
            if desired == self.present {
                return Ok(false);
            }
            if self.removal_pending {
                return Err(VcpuResizeError::RemovalPending { cpu: 3 }.into());
            }
            self.present = desired;
            Ok(true)
        }
    }

    fn config() -> VmConfig {
        vm_config_from_json(&json!({"payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 4}}))
        .unwrap()
    }

    fn fake() -> FakeVm {
        FakeVm {
            present: 1,
            max: 4,
            removal_pending: false,
            asked: vec![],
            ram: 1 << 30,
            ram_limit: 2 << 30,
            ram_fails: false,
        }
    }

    fn status(r: VmmResult) -> (u16, String) {
        match r {
            Ok(VmmReply::NoContent) => (204, String::new()),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => (e.status, e.message),
        }
    }

    #[test]
    fn a_booted_vm_resizes_and_reports_the_count_as_boot_vcpus() {
        let (mut c, mut vm) = (config(), fake());
        let r = resize(&json!({"desired_vcpus": 3}), &mut c, Some(&mut vm));
        assert_eq!(status(r).0, 204);
        assert_eq!((vm.present, c.cpus.boot_vcpus), (3, 3));
        // The same count again: 204, nothing else changes (Kata sends it on every start).
        let r = resize(&json!({"desired_vcpus": 3}), &mut c, Some(&mut vm));
        assert_eq!(status(r).0, 204);
        assert_eq!(vm.present, 3);
        // Above the limit: 400 naming it; the config keeps its count.
        let (code, msg) = status(resize(&json!({"desired_vcpus": 5}), &mut c, Some(&mut vm)));
        assert_eq!(code, 400);
        assert_eq!(
            msg,
            "vm.resize: desired_vcpus=5 is above max_vcpus=4 (the hot-pluggable limit)"
        );
        assert_eq!(c.cpus.boot_vcpus, 3);
    }

    #[test]
    fn a_pending_removal_is_429_too_many_requests() {
        let (mut c, mut vm) = (config(), fake());
        vm.removal_pending = true;
        let (code, msg) = status(resize(&json!({"desired_vcpus": 2}), &mut c, Some(&mut vm)));
        assert_eq!(code, 429);
        assert!(msg.contains("vCPU 3 is still being removed"), "{msg}");
        assert_eq!(c.cpus.boot_vcpus, 1, "unchanged");
    }

    #[test]
    fn before_boot_the_config_takes_the_count_within_its_bounds() {
        let mut c = config();
        let none: Option<&mut FakeVm> = None;
        assert_eq!(
            status(resize(&json!({"desired_vcpus": 4}), &mut c, none)).0,
            204
        );
        assert_eq!(c.cpus.boot_vcpus, 4);
        for (body, want) in [
            (
                json!({"desired_vcpus": 0}),
                "desired_vcpus=0 is invalid: expected 1 to max_vcpus=4",
            ),
            (
                json!({"desired_vcpus": 9}),
                "desired_vcpus=9 is above max_vcpus=4",
            ),
        ] {
            let (code, msg) = status(resize(&body, &mut c, None::<&mut FakeVm>));
            assert_eq!(code, 400);
            assert!(msg.contains(want), "{msg}");
        }
        assert_eq!(c.cpus.boot_vcpus, 4, "bad input changes nothing");
    }

    #[test]
    fn balloon_and_bad_values_are_refused_and_change_nothing() {
        let (mut c, mut vm) = (config(), fake());
        for (body, code, want) in [
            (
                json!({"desired_vcpus": 2, "desired_balloon": 0}),
                501,
                "desired_balloon=0",
            ),
            (
                json!({"desired_vcpus": -1}),
                400,
                "VmResize.desired_vcpus=-1 is invalid",
            ),
            (
                json!({"desired_vcpus": 4294967296u64}),
                400,
                "expected at most 4294967295",
            ),
            (json!([1]), 400, "expected an object"),
        ] {
            let (got, msg) = status(resize(&body, &mut c, Some(&mut vm)));
            assert_eq!(got, code, "{msg}");
            assert!(msg.contains(want), "{msg}");
        }
        assert!(vm.asked.is_empty(), "no vCPU was touched");
        assert_eq!(c.cpus.boot_vcpus, 1);
        // An empty body asks for nothing: 204, as in Cloud Hypervisor.
        assert_eq!(status(resize(&json!({}), &mut c, Some(&mut vm))).0, 204);
        // So does one with only fields Cloud Hypervisor's VmResizeData
        // does not have: they are ignored, as it ignores them.
        for body in [json!({"desired_cpus": 2}), json!({"": null})] {
            assert_eq!(status(resize(&body, &mut c, Some(&mut vm))).0, 204);
        }
        assert!(vm.asked.is_empty(), "no vCPU was touched");
    }

    #[test]
    fn a_booted_vm_grows_ram_after_its_vcpus_and_reports_the_size() {
        let (mut c, mut vm) = (config(), fake());
        let body = json!({"desired_vcpus": 2, "desired_ram": 1610612736u64});
        assert_eq!(status(resize(&body, &mut c, Some(&mut vm))).0, 204);
        assert_eq!((c.cpus.boot_vcpus, c.memory.size), (2, 1610612736));
        // Shrinking changes nothing: ACPI memory is not unplugged.
        let body = json!({"desired_ram": 1073741824u64});
        assert_eq!(status(resize(&body, &mut c, Some(&mut vm))).0, 204);
        assert_eq!(c.memory.size, 1610612736);
        // Above the limit: 400 naming it; a failure to add: 500.
        let (code, msg) = status(resize(
            &json!({"desired_ram": 4294967296u64}),
            &mut c,
            Some(&mut vm),
        ));
        assert_eq!(code, 400);
        assert!(
            msg.contains("desired_ram=4294967296 is above the limit"),
            "{msg}"
        );
        vm.ram_fails = true;
        let (code, msg) = status(resize(
            &json!({"desired_ram": 2147483648u64}),
            &mut c,
            Some(&mut vm),
        ));
        assert_eq!(code, 500, "{msg}");
        assert_eq!(c.memory.size, 1610612736, "unchanged");
    }

    #[test]
    fn before_boot_ram_becomes_the_configured_size_and_a_bad_body_changes_nothing() {
        let mut c = vm_config_from_json(&json!({"payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 4},
            "memory": {"size": 536870912u64, "hotplug_size": 1073741824u64}}))
        .unwrap();
        let none = || None::<&mut FakeVm>;
        let body = json!({"desired_ram": 1073741824u64});
        assert_eq!(status(resize(&body, &mut c, none())).0, 204);
        assert_eq!(c.memory.size, 1 << 30);
        assert_eq!(c.memory.hotplug_size, Some(1 << 30), "kept");
        // A bad size with a good vCPU count: 400, neither applied.
        let body = json!({"desired_vcpus": 3, "desired_ram": 1000});
        let (code, msg) = status(resize(&body, &mut c, none()));
        assert_eq!(code, 400);
        assert!(msg.contains("desired_ram"), "{msg}");
        assert_eq!((c.cpus.boot_vcpus, c.memory.size), (1, 1 << 30));
    }
}
