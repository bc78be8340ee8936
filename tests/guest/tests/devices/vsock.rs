//! virtio-vsock's part of the devices boot, with the hybrid unix-socket
//! backend. MMIO: the device from `--vsock`. PCI: the VM starts without
//! one and `vm.add-vsock` adds it to the running guest (200 with its PCI
//! address, as Cloud Hypervisor answers; a second one 409), the guest
//! finding it by ACPI PCI hot-plug; after the checks, `vm.remove-device`
//! has the guest eject it (the VMM then removes its socket), and the same
//! socket path hot-added again serves a new connection.
//!
//! Checked with the guest's vsock driver bound to the device:
//! - host → guest: four host processes at once connect to the VMM's unix
//!   socket, write `CONNECT 1234`, read `OK <port>`, and exchange 1 MiB
//!   each way with a guest listener on vsock port 1234;
//! - guest → host: a guest connection to host port 5000 reaches the unix
//!   listener `<socket>_5000`, 1 MiB each way;
//! - a guest connection to a host port nobody listens on is refused (RST).
//!
//! 1 MiB each way is four times what either side may hold for a
//! connection, so the transfers go through the credit flow control.

use test_infra::results::Results;
use test_infra::rig::Run;

const MIB: &str = "1048576";

pub const GUEST_MODULES: &[&str] = &["vmw_vsock_virtio_transport"];

/// Listener for the guest's connections and four hybrid clients, each
/// retrying until the VMM's socket exists and the guest listens (which
/// is after the disk checks that come first in the boot).
pub const HOST_BEFORE: &str = r#"
daxprobe unix-serve /tmp/v.sock_5000 1048576 > g2h.out 2>&1 &
G2H=$!
CLIENTS=""
for n in 1 2 3 4; do
    ( i=0; while [ $i -lt 3000 ]; do
          daxprobe hybrid-connect /tmp/v.sock 1234 1048576 > h2g.$n.out 2> h2g.$n.err && break
          sleep 0.2; i=$((i+1))
      done ) &
    CLIENTS="$CLIENTS $!"
done
"#;

pub const HOST_AFTER: &str = r#"
kill $CLIENTS $G2H 2>/dev/null
echo "@@HOST h2g_matched=$(cat h2g.*.out 2>/dev/null | grep -c 'sent=1048576 received=1048576 match=1')"
echo "@@HOST h2g_ports=$(cat h2g.*.out 2>/dev/null | sed -n 's/^ok_port=\([0-9]*\).*/\1/p' | sort -u | wc -l)"
echo "@@HOST h2g_first=$(cat h2g.1.out 2>/dev/null) $(tail -1 h2g.1.err 2>/dev/null)"
echo "@@HOST g2h=$(cat g2h.out)"
"#;

pub const MMIO_ARGS: &[&str] = &["--vsock", "cid=3,socket=/tmp/v.sock,transport=mmio"];

/// Once the guest runs.
pub const API_ADD: &str = r#"
echo "@@HOST add_vsock=$(api PUT /api/v1/vm.add-vsock '{"cid":3,"socket":"/tmp/v.sock","id":"vsock0"}')"
echo "@@HOST vsock_add_again=$(api PUT /api/v1/vm.add-vsock '{"cid":4,"socket":"/tmp/w.sock"}')"
echo "@@HOST info_vsock=$(api GET /api/v1/vm.info | grep -o '"vsock":{[^}]*}')"
"#;

/// In step with [`GUEST_REPLUG`].
pub const API_REPLUG: &str = r#"
echo "@@HOST vsock_remove=$(api PUT /api/v1/vm.remove-device '{"id":"vsock0"}')"
seen '@@GUEST vsock_unbound='
i=0; while [ -e /tmp/v.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@HOST socket_after_remove=$([ -e /tmp/v.sock ] && echo present || echo gone)"
daxprobe unix-serve /tmp/v.sock_5001 65536 > g2h2.out 2>&1 &
G2H2=$!
echo "@@HOST readd=$(api PUT /api/v1/vm.add-vsock '{"cid":3,"socket":"/tmp/v.sock","id":"vsock1"}')"
seen '@@GUEST vsock_done2=1'
wait $G2H2
echo "@@HOST g2h2=$(cat g2h2.out)"
"#;

pub const GUEST_BOOT: &str = r#"
drv=/sys/bus/virtio/drivers/vmw_vsock_virtio_transport
i=0; while ! ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST vsock_bound=$(ls $drv 2>/dev/null | grep -c virtio)"
daxprobe vsock-serve 1234 1048576 4 > /tmp/serve.out 2> /tmp/serve.err &
SERVE=$!
echo "@@GUEST g2h=$(daxprobe vsock-connect 2 5000 1048576 2>&1)"
echo "@@GUEST refused=$(daxprobe vsock-connect 2 5999 16 2>&1)"
i=0; while kill -0 $SERVE 2>/dev/null && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST h2g_matched=$(grep -c 'sent=1048576 received=1048576 match=1' /tmp/serve.out)"
echo "@@GUEST serve_err=$(grep -v listening /tmp/serve.err | tail -1)"
"#;

/// PCI only: ejected, re-added, used again.
pub const GUEST_REPLUG: &str = r#"
i=0; while ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST vsock_unbound=$(ls $drv 2>/dev/null | grep -q virtio && echo no || echo yes)"
i=0; while ! ls $drv 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST rebound=$(ls $drv 2>/dev/null | grep -c virtio)"
echo "@@GUEST g2h2=$(daxprobe vsock-connect 2 5001 65536 2>&1)"
echo "@@GUEST vsock_done2=1"
"#;

pub fn check(run: &Run, pci: bool, tail: &str) {
    assert_eq!(run.guest("vsock_bound"), Some("1"), "{tail}");
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
    if pci {
        check_hot_plug(run, tail);
    }
}

fn check_hot_plug(run: &Run, tail: &str) {
    let added = run.host("add_vsock").unwrap_or_default();
    assert!(
        added.starts_with("status=200")
            && added.contains("\"id\":\"vsock0\"")
            && added.contains("\"bdf\":\"0000:00:"),
        "{added}\n{tail}"
    );
    assert!(
        run.host("vsock_add_again")
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
    assert_eq!(run.host("vsock_remove"), Some("status=204 body="), "{tail}");
    assert_eq!(run.guest("vsock_unbound"), Some("yes"), "{tail}");
    assert_eq!(run.host("socket_after_remove"), Some("gone"), "{tail}");
    assert!(
        run.host("readd")
            .unwrap_or_default()
            .starts_with("status=200"),
        "{tail}"
    );
    assert_eq!(run.guest("rebound"), Some("1"), "{tail}");
    let small = "sent=65536 received=65536 match=1";
    assert_eq!(run.guest("g2h2"), Some(small), "{tail}");
    assert_eq!(run.host("g2h2"), Some(small), "{tail}");
}

pub fn record(results: &mut Results, run: &Run, transport: &str) {
    for key in ["g2h", "h2g_first"] {
        results.record(
            &format!("vsock over virtio-{transport}: {key}"),
            run.host(key).unwrap_or("n/a").to_string(),
        );
    }
}
