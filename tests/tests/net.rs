//! virtio-net on a tap in real guests, one boot per transport. The emulated
//! host (L1) configures nothing by hand: it loads `tun`, and the VMM
//! creates the tap `dtap0` and gives it 192.168.249.1/24 (`ip=`/`mask=`).
//! - MMIO: the device from the command line (`--net tap=...,transport=mmio`);
//! - PCI: the VM created and booted through the API with no net device,
//!   then `vm.add-net` on the running guest (200 with its PCI address, as
//!   Cloud Hypervisor answers), the guest finding it by ACPI PCI hot-plug;
//!   then a second device added as Kata adds one: its own tap (`ktap0`),
//!   the fd sent as SCM_RIGHTS with the request in one `sendmsg`; the
//!   guest pings the host over it; then `vm.remove-device` has the guest
//!   eject the first and `vm.info` no longer lists it.
//!
//! Each boot checks that the guest's eth0 has the configured MAC (and MTU
//! over PCI), gives it 192.168.249.2/24 with busybox `ip`, pings the host's
//! tap address, and moves 4 MiB each way with busybox `nc` (guest → host
//! port 5001, host → guest port 5002), compared by md5sum on both sides.
//!
//! Run with `cargo test -p guest-tests --test net -- --ignored`
//! (scripts/test.sh does).

use std::time::Duration;

use guest_tests::results::Results;
use guest_tests::rig::{self, Guest};

const HOST_IP: &str = "192.168.249.1";
const MAC: &str = "52:54:00:12:34:56";
const MIB: u64 = 4;

/// A listener for the guest's bytes (its stdin never ends, so it does not
/// shut its side first; a pipeline waits for its `sleep`, so what it got
/// is reported after the run), a sender that retries until the guest listens,
/// and a watcher that reports the tap once the VMM has set it up.
const HOST_BEFORE: &str = r#"
dd if=/dev/urandom of=h2g.src bs=1M count=MIB 2>/dev/null
echo "@@HOST h2g_md5=$(md5sum < h2g.src | cut -d' ' -f1)"
sleep 100000 | nc -l -p 5001 > g2h.bin &
( i=0; while [ $i -lt 3000 ]; do nc 192.168.249.2 5002 < h2g.src 2>/dev/null && break; sleep 0.2; i=$((i+1)); done
  echo "@@HOST h2g_sent=$i" ) &
SENDER=$!
( i=0; while [ $i -lt 3000 ]; do
      a=$(ip -4 addr show dev dtap0 2>/dev/null | grep -o 'inet [0-9./]*')
      [ -n "$a" ] && { echo "@@HOST tap=$a state=$(cat /sys/class/net/dtap0/operstate) mtu=$(cat /sys/class/net/dtap0/mtu)"; break; }
      sleep 0.1; i=$((i+1))
  done ) &
"#;

const HOST_AFTER: &str = r#"
[ -n "$TAIL" ] && { sleep 1; kill $TAIL; }
kill $SENDER 2>/dev/null
# The guest's nc ended only after the sink had read its EOF.
echo "@@HOST g2h_md5=$(md5sum < g2h.bin | cut -d' ' -f1) g2h_bytes=$(wc -c < g2h.bin)"
echo "@@HOST tap_after_exit=$([ -e /sys/class/net/dtap0 ] && echo present || echo gone)"
"#;

/// The API run: no net device at boot, hot-added once the guest runs.
const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
seen() { i=0; while ! grep -q "$1" serial.log 2>/dev/null && [ $i -lt 6000 ] && kill -0 $VMM_PID 2>/dev/null; do sleep 0.1; i=$((i+1)); done; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912},"serial":{"mode":"File","file":"'$WORK'/serial.log"}}'
: > serial.log; tail -n +1 -f serial.log & TAIL=$!
echo "@@HOST create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST boot=$(api PUT /api/v1/vm.boot)"
seen '@@GUEST ready=1'
echo "@@HOST add_net=$(api PUT /api/v1/vm.add-net '{"tap":"dtap0","ip":"192.168.249.1","mask":"255.255.255.0","mac":"MAC","mtu":1400,"id":"net0","num_queues":2,"queue_size":256}')"
echo "@@HOST info_net=$(api GET /api/v1/vm.info | grep -o '"net":\[[^]]*\]')"
seen '@@GUEST done=1'
# Kata's way: its own tap, the fd sent with the request (its NetConfig
# defaults, ip/mask included, which the VMM leaves alone with a passed fd).
echo "@@HOST kata_add=$(daxprobe kata-add-net /tmp/api.sock ktap0 '{"ip":"192.168.249.1","mask":"255.255.255.0","mac":"52:54:00:12:34:57","iommu":false,"num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}')"
ip addr add 192.168.250.1/24 dev ktap0 && ip link set ktap0 up
echo "@@HOST ktap=$(echo $(ip -4 addr show dev ktap0 | grep -o 'inet [0-9./]*'))"
seen '@@GUEST kata_done=1'
echo "@@HOST remove=$(api PUT /api/v1/vm.remove-device '{"id":"net0"}')"
seen '@@GUEST unbound='
sleep 1
echo "@@HOST info_after=$(api GET /api/v1/vm.info | grep -o '"net":\[[^]]*\]')"
echo "@@HOST tap_after_remove=$([ -e /sys/class/net/dtap0 ] && echo present || echo gone)"
"#;

const GUEST_SCRIPT: &str = r#"
echo "@@GUEST ready=1"
i=0; while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST mac=$(cat /sys/class/net/eth0/address 2>/dev/null)"
echo "@@GUEST mtu=$(cat /sys/class/net/eth0/mtu 2>/dev/null)"
ip addr add 192.168.249.2/24 dev eth0 && ip link set eth0 up
i=0; while [ "$(cat /sys/class/net/eth0/operstate 2>/dev/null)" != up ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST operstate=$(cat /sys/class/net/eth0/operstate)"
echo "@@GUEST offloads=$(cat /sys/bus/virtio/drivers/virtio_net/virtio*/features 2>/dev/null | cut -c1-16)"
echo "@@GUEST ping=$(ping -c 3 -W 10 HOST_IP 2>&1 | grep -o '[0-9]* packets received')"
sleep 100000 | nc -l -p 5002 > /tmp/h2g.bin &
dd if=/dev/urandom of=/tmp/g2h.bin bs=1M count=MIB 2>/dev/null
echo "@@GUEST g2h_md5=$(md5sum < /tmp/g2h.bin | cut -d' ' -f1)"
t0=$(cut -d' ' -f1 /proc/uptime)
nc HOST_IP 5001 < /tmp/g2h.bin; echo "@@GUEST g2h_rc=$?"
t1=$(cut -d' ' -f1 /proc/uptime)
echo "@@GUEST g2h_s=$(awk "BEGIN{print $t1-$t0}")"
i=0; while [ "$(wc -c < /tmp/h2g.bin)" -lt $((MIB * 1048576)) ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
sleep 0.5
t2=$(cut -d' ' -f1 /proc/uptime)
echo "@@GUEST h2g_md5=$(md5sum < /tmp/h2g.bin | cut -d' ' -f1) h2g_bytes=$(wc -c < /tmp/h2g.bin) h2g_wait_s=$(awk "BEGIN{print $t2-$t1}")"
echo "@@GUEST rx_tx=$(cat /sys/class/net/eth0/statistics/rx_packets) $(cat /sys/class/net/eth0/statistics/tx_packets) dropped=$(cat /sys/class/net/eth0/statistics/rx_dropped)"
echo "@@GUEST done=1"
if grep -q net_unplug /proc/cmdline; then
    i=0; while [ ! -e /sys/class/net/eth1 ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
    echo "@@GUEST kata_mac=$(cat /sys/class/net/eth1/address 2>/dev/null)"
    ip addr add 192.168.250.2/24 dev eth1 && ip link set eth1 up
    i=0; while ! ping -c 1 -W 2 192.168.250.1 >/dev/null 2>&1 && [ $i -lt 30 ]; do i=$((i+1)); done
    echo "@@GUEST kata_ping=$(ping -c 3 -W 10 192.168.250.1 2>&1 | grep -o '[0-9]* packets received')"
    echo "@@GUEST kata_done=1"
    i=0; while [ -e /sys/class/net/eth0 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    echo "@@GUEST unbound=$([ -e /sys/class/net/eth0 ] && echo no || echo yes)"
    # The host asks vm.info after the eject; the VM must still be there.
    sleep 8
fi
"#;

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn net_over_mmio() {
    net_test("mmio");
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn net_over_pci_hot_added_through_the_api() {
    net_test("pci");
}

fn net_test(transport: &str) {
    let fill = |s: &str| {
        s.replace("HOST_IP", HOST_IP)
            .replace("MIB", &MIB.to_string())
            .replace("\"MAC\"", &format!("\"{MAC}\""))
    };
    let mut guest = Guest::new(&format!("net-{transport}"), &fill(GUEST_SCRIPT));
    guest.guest_modules = vec!["virtio_mmio".into(), "virtio_net".into()];
    guest.host_modules = vec!["tun".into()];
    let daxprobe = rig::tool("guest-tests", "daxprobe").expect("daxprobe");
    guest.host_tools = vec![daxprobe];
    guest.host_before = fill(HOST_BEFORE);
    guest.host_after = HOST_AFTER.into();
    if transport == "pci" {
        guest.api_script = Some(fill(API_SCRIPT));
        guest.cmdline = "net_unplug=1".into();
    } else {
        guest.vmm_args = vec![
            "--net".into(),
            format!("tap=dtap0,ip={HOST_IP},mask=255.255.255.0,mac={MAC},transport=mmio"),
        ];
    }
    guest.timeout = Duration::from_secs(900);
    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.guest("mac"), Some(MAC), "{tail}");
    let tap = run.host("tap").unwrap_or_default();
    assert!(
        tap.starts_with(&format!("inet {HOST_IP}/24")),
        "the VMM gave the tap its address: {tap}\n{tail}"
    );
    if transport == "pci" {
        let added = run.host("add_net").unwrap_or_default();
        assert!(
            added.starts_with("status=200")
                && added.contains("\"id\":\"net0\"")
                && added.contains("\"bdf\":\"0000:00:"),
            "{added}\n{tail}"
        );
        assert_eq!(run.guest("mtu"), Some("1400"), "{tail}");
        assert!(tap.contains("mtu=1400"), "{tap}");
        assert!(
            run.host("info_net")
                .unwrap_or_default()
                .contains(&format!("\"mac\":\"{MAC}\"")),
            "{tail}"
        );
        assert!(
            run.host("remove")
                .unwrap_or_default()
                .starts_with("status=204"),
            "{tail}"
        );
        assert_eq!(run.guest("unbound"), Some("yes"), "{tail}");
        let after = run.host("info_after").unwrap_or_default();
        assert!(
            !after.contains("\"id\":\"net0\"") && after.contains("\"id\":\"_net1\""),
            "{after}\n{tail}"
        );
        // Kata's tap fd: the device runs on it, its address is Kata's own.
        let kata = run.host("kata_add").unwrap_or_default();
        assert!(
            kata.starts_with("status=200") && kata.contains("\"id\":\"_net1\""),
            "{kata}\n{tail}"
        );
        assert_eq!(run.host("ktap"), Some("inet 192.168.250.1/24"), "{tail}");
        assert_eq!(run.guest("kata_mac"), Some("52:54:00:12:34:57"), "{tail}");
        assert_eq!(run.guest("kata_ping"), Some("3 packets received"), "{tail}");
        assert_eq!(run.host("tap_after_remove"), Some("gone"), "{tail}");
    }
    assert_eq!(run.guest("operstate"), Some("up"), "{tail}");
    assert_eq!(run.guest("ping"), Some("3 packets received"), "{tail}");
    // Guest → host: the host's sink got the guest's bytes.
    let g2h = run.guest("g2h_md5").unwrap_or("guest");
    let sink = run.host("g2h_md5").unwrap_or_default();
    assert_eq!(
        sink,
        format!("{g2h} g2h_bytes={}", MIB << 20),
        "guest to host\n{tail}"
    );
    assert_eq!(run.guest("g2h_rc"), Some("0"), "{tail}");
    // Host → guest.
    let h2g = run.host("h2g_md5").unwrap_or("host");
    let got = run.guest("h2g_md5").unwrap_or_default();
    assert!(
        got.starts_with(&format!("{h2g} h2g_bytes={}", MIB << 20)),
        "host to guest: {got}\n{tail}"
    );
    assert_eq!(run.host("tap_after_exit"), Some("gone"), "{tail}");
    let mut results = Results::new(&format!("net-{transport}"));
    results.record_run(&format!("net over virtio-{transport}"), &run);
    results.record(
        &format!("virtio-{transport}: {MIB} MiB guest to host (s)"),
        run.guest("g2h_s").unwrap_or("n/a").to_string(),
    );
    results.record(
        &format!("virtio-{transport}: host to guest"),
        got.to_string(),
    );
    results.record(
        &format!("virtio-{transport}: guest rx/tx packets"),
        run.guest("rx_tx").unwrap_or("n/a").to_string(),
    );
    results.save().expect("write results");
}
