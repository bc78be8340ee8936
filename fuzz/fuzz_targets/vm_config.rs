//! `vm.create` and `vm.add-*` bodies: any JSON is accepted or refused with
//! an error; an accepted VmConfig serializes back (as `vm.info` shows it)
//! to a body that is accepted again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::config::json::{
    fs_config_from_json, pmem_config_from_json, vm_config_from_json, vm_config_to_json,
};

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(c) = vm_config_from_json(&v) {
        let back = vm_config_to_json(&c);
        vm_config_from_json(&back).expect("vm.info's VmConfig is accepted by vm.create");
    }
    let _ = fs_config_from_json(&v, 0);
    let _ = pmem_config_from_json(&v, 0);
});
