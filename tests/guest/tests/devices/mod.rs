//! The devices every Kata sandbox needs — virtio-blk, hybrid vsock and
//! virtio-net on a tap — together in one real guest per transport, as a
//! sandbox has them. Each device's part (scripts and checks) is in its own
//! module; this file puts them into one boot:
//!
//! - MMIO: all from the command line (`--disk`, `--vsock`, `--net`).
//! - PCI: the VM created through the API with its disks in the VmConfig as
//!   Kata sends them, booted; once the guest runs, vsock, net and a third
//!   disk are hot-added (`vm.add-*`); after the checks the guest sees, in
//!   turn, the hot disk removed, the vsock removed and re-added, a second
//!   NIC added the Kata way (tap fd over SCM_RIGHTS) and the first removed.
//!
//! The guest runs the parts in order (disks, vsock, net), then `done=1`;
//! the host's API script waits for the guest's markers before each step.
//!
//! [`hostile`] boots a guest of its own: a hostile driver programming a
//! PCI and an MMIO disk through their registers.
//!
//! Run with `cargo test -p guest-tests -- --ignored devices::`
//! (scripts/test.sh does).

pub(crate) mod blk;
mod hostile;
pub(crate) mod net;
pub(crate) mod vsock;

use std::time::Duration;

use test_infra::results::Results;
use test_infra::rig::{self, Guest};

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn blk_vsock_net_over_mmio() {
    devices_test("mmio");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn blk_vsock_net_over_pci_hot_plugged_through_the_api() {
    devices_test("pci");
}

/// Serial goes to a file in the API run; `seen` waits for a guest marker.
const API_PRELUDE: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 6000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":536870912},"serial":{"mode":"File","file":"'$WORK'/serial.log"},"disks":DISKS}'
follow serial.log
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
"#;

/// `vm.counters` once the guest has done its transfers: each disk and NIC
/// by its id with Cloud Hypervisor's counter names, at least the bytes the
/// guest moved.
fn check_counters(run: &test_infra::rig::Run, tail: &str) {
    let reply = run.host("counters").unwrap_or_default();
    let body = reply
        .strip_prefix("status=200 body=")
        .unwrap_or_else(|| panic!("vm.counters: {reply}\n{tail}"));
    let c: serde_json::Value = serde_json::from_str(body).expect(body);
    let get = |dev: &str, name: &str| {
        c[dev][name]
            .as_u64()
            .unwrap_or_else(|| panic!("vm.counters has no {dev}.{name}: {body}"))
    };
    const MIB: u64 = 1 << 20;
    // The raw disk took a 512-byte pattern, 1 MiB of 0xff and 16 MiB.
    assert!(get("rw", "write_bytes") >= 17 * MIB, "{body}");
    assert!(get("rw", "read_bytes") >= 16 * MIB, "{body}");
    assert!(get("rw", "write_ops") >= 17, "{body}");
    // The ext4 disk was read (4 MiB file and metadata), never written.
    assert!(get("ro", "read_bytes") >= 4 * MIB, "{body}");
    assert_eq!(get("ro", "write_ops"), 0, "{body}");
    // The NIC moved 4 MiB each way (frames with their vnet headers).
    assert!(get("net0", "tx_bytes") >= 4 * MIB, "{body}");
    assert!(get("net0", "rx_bytes") >= 4 * MIB, "{body}");
    assert!(
        get("net0", "rx_frames") > 0 && get("net0", "tx_frames") > 0,
        "{body}"
    );
}

fn devices_test(transport: &str) {
    let pci = transport == "pci";
    let blk = blk::scripts();
    let net = net::scripts();

    let mut script = format!(
        "echo \"@@GUEST ready=1\"\n{}{}{}echo \"@@GUEST done=1\"\n",
        blk.guest_boot,
        vsock::GUEST_BOOT,
        net.guest_boot
    );
    if pci {
        script += &blk.guest_hot;
        script += vsock::GUEST_REPLUG;
        script += &net.guest_replug;
    }
    script += &blk.guest_end;

    let mut guest = Guest::new(&format!("devices-{transport}"), &script);
    guest.cpus = 2;
    guest.guest_modules = ["virtio_mmio"]
        .iter()
        .chain(blk::GUEST_MODULES)
        .chain(vsock::GUEST_MODULES)
        .chain(net::GUEST_MODULES)
        .map(|m| m.to_string())
        .collect();
    guest.host_modules = net::HOST_MODULES.iter().map(|m| m.to_string()).collect();
    let daxprobe = rig::tool("guest-tools", "daxprobe").expect("daxprobe");
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![daxprobe];
    guest.host_files = blk::host_files();
    guest.host_before = [&blk.host_before, vsock::HOST_BEFORE, &net.host_before].concat();
    let after = [&blk.host_after, vsock::HOST_AFTER, &net.host_after].concat();
    if pci {
        guest.api_script = Some(
            [
                &API_PRELUDE.replace("DISKS", blk::CREATE_DISKS),
                vsock::API_ADD,
                &net.api_add,
                &blk.api_add,
                "seen '@@GUEST done=1'\n",
                "echo \"@@HOST counters=$(api GET /api/v1/vm.counters)\"\n",
                &blk.api_hot,
                vsock::API_REPLUG,
                &net.api_replug,
            ]
            .concat(),
        );
        guest.host_after = format!("sleep 1; kill $TAIL\n{after}");
    } else {
        guest.vmm_args = blk::mmio_args();
        guest
            .vmm_args
            .extend(vsock::MMIO_ARGS.iter().map(|a| a.to_string()));
        guest.vmm_args.extend(net::mmio_args());
        guest.host_after = after;
    }
    guest.timeout = Duration::from_secs(1200);

    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    if pci {
        assert_eq!(run.host("create"), Some("status=204 body="), "{tail}");
        assert_eq!(run.host("boot"), Some("status=204 body="), "{tail}");
    }
    assert_eq!(run.guest("done"), Some("1"), "{tail}");
    blk::check(&run, pci, &tail);
    vsock::check(&run, pci, &tail);
    net::check(&run, pci, &tail);
    if pci {
        check_counters(&run, &tail);
    }
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new(&format!("devices-{transport}"));
    results.record_run(&format!("blk, vsock and net over virtio-{transport}"), &run);
    blk::record(&mut results, &run, transport, &tail);
    vsock::record(&mut results, &run, transport);
    net::record(&mut results, &run, transport);
    results.save().expect("write results");
}
