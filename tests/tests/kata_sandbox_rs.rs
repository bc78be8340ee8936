//! Kata Containers' Rust runtime (runtime-rs, Kata 4's default) starting a
//! sandbox on this VMM, byte for byte as its Cloud Hypervisor driver and
//! Cloud Hypervisor's `api_client` send it (`guest_tests::kata::rs`,
//! `guest_tests::kata::api_client`): ONE API connection for the sandbox's
//! whole life, requests in two to four writes, the tap's fd on the first.
//!
//! - `runtime_rs_calls_on_one_connection_end_the_vmm` (host, fast): the
//!   calls that need no guest — ping, create with runtime-rs's default
//!   VmConfig, vm.info read as runtime-rs's serde structs read it,
//!   vmm.shutdown — on one connection, and the VMM ends.
//! - `a_runtime_rs_sandbox_starts_and_resizes_with_per_file_dax` (guest,
//!   ignored): see its note.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_tests::kata::api_client::call;
use guest_tests::kata::rs::{info, RsSandbox};

mod api_common;
use api_common::{scratch, start_vmm, wait_for};

const GIB: u64 = 1 << 30;

/// runtime-rs's default sandbox with its files under `dir` (the kernel and
/// image paths are only named: nothing boots).
fn sandbox(dir: &Path, static_resources: bool) -> RsSandbox {
    let mut s = RsSandbox::new(
        "host-test",
        &dir.join("vmlinux").display().to_string(),
        &dir.join("kata.img").display().to_string(),
        4,
        8 * GIB,
        static_resources,
    );
    s.memory_mib = 512;
    s
}

#[test]
fn runtime_rs_calls_on_one_connection_end_the_vmm() {
    let dir = scratch("kata-rs-host");
    std::fs::write(dir.join("vmlinux"), b"not booted").unwrap();
    std::fs::write(dir.join("kata.img"), vec![0u8; 1 << 20]).unwrap();
    let (mut vmm, api) = start_vmm(&dir);
    wait_for(&api);
    let mut c = UnixStream::connect(&api).unwrap();

    // cloud_hypervisor_ping_until_ready: the answer's `features` must be
    // an array (handle_ch_build_features), or the sandbox fails.
    let ping = call(&mut c, "GET", "vmm.ping", None, &[]).expect("vmm.ping");
    let features = info::parse_ping(ping.as_deref()).expect("ping as runtime-rs reads it");
    assert!(features.is_some(), "no features in {ping:?}");

    for static_resources in [true, false] {
        let body = sandbox(&dir, static_resources).vm_config().pretty();
        let created = call(&mut c, "PUT", "vm.create", Some(&body), &[]);
        assert_eq!(created, Ok(None), "vm.create as runtime-rs sends it");
        let vm = call(&mut c, "GET", "vm.info", None, &[]).expect("vm.info");
        let vm = info::parse_vm_info(vm.as_deref()).expect("vm.info as runtime-rs reads it");
        assert_eq!(vm.state, "Created");
        assert_eq!(vm.memory_size, 512 << 20);
        assert_eq!(vm.max_vcpus, if static_resources { 1 } else { 4 });
        let deleted = call(&mut c, "PUT", "vm.delete", None, &[]);
        assert_eq!(deleted, Ok(None));
    }

    // A bodiless PUT has no Content-Length; the VMM ends after answering.
    // runtime-rs needs the answer: without it, it reports the stop failed.
    let shutdown = call(&mut c, "PUT", "vmm.shutdown", None, &[]);
    assert_eq!(shutdown, Ok(None));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = vmm.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "vmm.shutdown did not end the VMM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}
