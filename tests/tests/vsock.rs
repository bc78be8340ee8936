//! virtio-vsock with the hybrid unix-socket backend in real guests, one
//! boot per transport:
//! - MMIO: the device from the command line (`--vsock ...,transport=mmio`);
//! - PCI: the VM created and booted through the API with no vsock, then
//!   `vm.add-vsock` on the running guest (200 with its PCI address, as
//!   Cloud Hypervisor answers; a second one 409), the guest finding it by
//!   ACPI PCI hot-plug; after the checks below, `vm.remove-device` has the
//!   guest eject it (the VMM then removes its socket), and the same socket
//!   path hot-added again serves a new connection.
//!
//! Each boot checks, with the guest's vsock driver bound to the device:
//! - host → guest: four host processes at once connect to the VMM's unix
//!   socket, write `CONNECT 1234`, read `OK <port>`, and exchange 1 MiB
//!   each way with a guest listener on vsock port 1234;
//! - guest → host: a guest connection to host port 5000 reaches the unix
//!   listener `<socket>_5000`, 1 MiB each way;
//! - a guest connection to a host port nobody listens on is refused (RST).
//!
//! 1 MiB each way is four times what either side may hold for a
//! connection, so the transfers go through the credit flow control.
//!
//! Run with `cargo test -p guest-tests --test vsock -- --ignored`
//! (scripts/test.sh does).

use std::time::Duration;

use guest_tests::results::Results;
use guest_tests::rig::{self, Guest};

const MIB: &str = "1048576";

/// Listener for the guest's connections and four hybrid clients, each
/// retrying until the VMM's socket exists and the guest listens.
const HOST_BEFORE: &str = r#"
daxprobe unix-serve /tmp/v.sock_5000 1048576 > g2h.out 2>&1 &
G2H=$!
CLIENTS=""
for n in 1 2 3 4; do
    ( i=0; while [ $i -lt 900 ]; do
          daxprobe hybrid-connect /tmp/v.sock 1234 1048576 > h2g.$n.out 2> h2g.$n.err && break
          sleep 0.2; i=$((i+1))
      done ) &
    CLIENTS="$CLIENTS $!"
done
"#;

const HOST_AFTER: &str = r#"
[ -n "$TAIL" ] && { sleep 1; kill $TAIL; }
kill $CLIENTS $G2H 2>/dev/null
echo "@@HOST h2g_matched=$(cat h2g.*.out 2>/dev/null | grep -c 'sent=1048576 received=1048576 match=1')"
echo "@@HOST h2g_ports=$(cat h2g.*.out 2>/dev/null | sed -n 's/^ok_port=\([0-9]*\).*/\1/p' | sort -u | wc -l)"
echo "@@HOST h2g_first=$(cat h2g.1.out 2>/dev/null) $(tail -1 h2g.1.err 2>/dev/null)"
echo "@@HOST g2h=$(cat g2h.out)"
"#;

/// The API run: no vsock at boot, hot-added once the guest runs.
const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 3000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912},"serial":{"mode":"File","file":"'$WORK'/serial.log"}}'
: > serial.log; tail -n +1 -f serial.log & TAIL=$!
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST add_vsock=$(api PUT /api/v1/vm.add-vsock '{"cid":3,"socket":"/tmp/v.sock","id":"vsock0"}')"
echo "@@HOST add_again=$(api PUT /api/v1/vm.add-vsock '{"cid":4,"socket":"/tmp/w.sock"}')"
echo "@@HOST info_vsock=$(api GET /api/v1/vm.info | grep -o '"vsock":{[^}]*}')"
seen '@@GUEST done=1'
echo "@@HOST remove=$(api PUT /api/v1/vm.remove-device '{"id":"vsock0"}')"
seen '@@GUEST unbound='
i=0; while [ -e /tmp/v.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@HOST socket_after_remove=$([ -e /tmp/v.sock ] && echo present || echo gone)"
daxprobe unix-serve /tmp/v.sock_5001 65536 > g2h2.out 2>&1 &
G2H2=$!
echo "@@HOST readd=$(api PUT /api/v1/vm.add-vsock '{"cid":3,"socket":"/tmp/v.sock","id":"vsock1"}')"
seen '@@GUEST done2=1'
wait $G2H2
echo "@@HOST g2h2=$(cat g2h2.out)"
"#;

const GUEST_SCRIPT: &str = r#"
echo "@@GUEST ready=1"
drv=/sys/bus/virtio/drivers/vmw_vsock_virtio_transport
i=0; while ! ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST vsock_bound=$(ls $drv 2>/dev/null | grep -c virtio)"
daxprobe vsock-serve 1234 1048576 4 > /tmp/serve.out 2> /tmp/serve.err &
SERVE=$!
echo "@@GUEST g2h=$(daxprobe vsock-connect 2 5000 1048576 2>&1)"
echo "@@GUEST refused=$(daxprobe vsock-connect 2 5999 16 2>&1)"
i=0; while kill -0 $SERVE 2>/dev/null && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST h2g_matched=$(grep -c 'sent=1048576 received=1048576 match=1' /tmp/serve.out)"
echo "@@GUEST serve_err=$(grep -v listening /tmp/serve.err | tail -1)"
echo "@@GUEST done=1"
if grep -q vsock_replug /proc/cmdline; then
    i=0; while ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    echo "@@GUEST unbound=$(ls $drv 2>/dev/null | grep -q virtio && echo no || echo yes)"
    i=0; while ! ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    echo "@@GUEST rebound=$(ls $drv 2>/dev/null | grep -c virtio)"
    echo "@@GUEST g2h2=$(daxprobe vsock-connect 2 5001 65536 2>&1)"
    echo "@@GUEST done2=1"
fi
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn vsock_over_mmio() {
    vsock_test("mmio");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn vsock_over_pci_hot_added_through_the_api() {
    vsock_test("pci");
}

fn vsock_test(transport: &str) {
    let mut guest = Guest::new(&format!("vsock-{transport}"), GUEST_SCRIPT);
    guest.guest_modules = vec!["virtio_mmio".into(), "vmw_vsock_virtio_transport".into()];
    let daxprobe = rig::tool("guest-tests", "daxprobe").expect("daxprobe");
    guest.guest_tools = vec![daxprobe.clone()];
    guest.host_tools = vec![daxprobe];
    guest.host_before = HOST_BEFORE.into();
    guest.host_after = HOST_AFTER.into();
    if transport == "pci" {
        guest.api_script = Some(API_SCRIPT.into());
        guest.cmdline = "vsock_replug=1".into();
    } else {
        guest.vmm_args = vec![
            "--vsock".into(),
            "cid=3,socket=/tmp/v.sock,transport=mmio".into(),
        ];
    }
    guest.timeout = Duration::from_secs(600);
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.guest("vsock_bound"), Some("1"), "{tail}");
    if transport == "pci" {
        let added = run.host("add_vsock").unwrap_or_default();
        assert!(
            added.starts_with("status=200")
                && added.contains("\"id\":\"vsock0\"")
                && added.contains("\"bdf\":\"0000:00:"),
            "{added}\n{tail}"
        );
        assert!(
            run.host("add_again")
                .unwrap_or_default()
                .starts_with("status=409"),
            "{tail}"
        );
        assert!(
            run.host("info_vsock")
                .unwrap_or_default()
                .contains("\"cid\":3"),
            "{tail}"
        );
    }
    let full = format!("sent={MIB} received={MIB} match=1");
    // Guest → host: both ends saw every byte.
    assert_eq!(run.guest("g2h"), Some(full.as_str()), "{tail}");
    assert_eq!(run.host("g2h"), Some(full.as_str()), "{tail}");
    // Host → guest, four at once, each on its own host port.
    assert_eq!(run.guest("h2g_matched"), Some("4"), "{tail}");
    assert_eq!(run.host("h2g_matched"), Some("4"), "{tail}");
    assert_eq!(run.host("h2g_ports"), Some("4"), "{tail}");
    assert_eq!(run.guest("serve_err"), Some(""), "{tail}");
    let refused = run.guest("refused").unwrap_or_default();
    assert!(
        refused.contains("reset") || refused.contains("refused"),
        "a host port without a listener: {refused}\n{tail}"
    );
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new(&format!("vsock-{transport}"));
    results.record_run(&format!("vsock over virtio-{transport}"), &run);
    for key in ["g2h", "h2g_first"] {
        results.record(
            &format!("virtio-{transport}: {key}"),
            run.host(key).unwrap_or("n/a").to_string(),
        );
    }
    results.save().expect("write results");
}
