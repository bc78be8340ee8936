//! virtio-net's part of the devices boot, on a tap. The emulated host (L1)
//! configures nothing by hand: it loads `tun`, and the VMM creates the tap
//! `dtap0` and gives it 192.168.249.1/24 (`ip=`/`mask=`).
//! - MMIO: the device from `--net tap=...,transport=mmio`;
//! - PCI: the VM starts without one and `vm.add-net` adds it to the
//!   running guest (200 with its PCI address, as Cloud Hypervisor
//!   answers); later a second device is added as Kata adds one: its own
//!   tap (`ktap0`), the fd sent as SCM_RIGHTS with the request in one
//!   `sendmsg`; the guest pings the host over it; then
//!   `vm.remove-device` has the guest eject the first and `vm.info` no
//!   longer lists it.
//!
//! The guest's eth0 has the configured MAC (and MTU over PCI); it takes
//! 192.168.249.2/24 with busybox `ip`, pings the host's tap address, and
//! moves 4 MiB each way with busybox `nc` (guest → host port 5001, host →
//! guest port 5002), compared by md5sum on both sides.

use test_infra::results::Results;
use test_infra::rig::Run;

const HOST_IP: &str = "192.168.249.1";
const MAC: &str = "52:54:00:12:34:56";
const MIB: u64 = 4;

pub const GUEST_MODULES: &[&str] = &["virtio_net"];
pub const HOST_MODULES: &[&str] = &["tun"];

/// A listener for the guest's bytes (its stdin never ends, so it does not
/// shut its side first; a pipeline waits for its `sleep`, so what it got
/// is reported after the run), a sender that retries until the guest
/// listens, and a watcher that reports the tap once the VMM has set it up.
const HOST_BEFORE: &str = r#"
dd if=/dev/urandom of=h2g.src bs=1M count=MIB 2>/dev/null
echo "@@HOST h2g_md5=$(md5sum < h2g.src | cut -d' ' -f1)"
sleep 100000 | nc -l -p 5001 > g2h.bin &
( i=0; while [ $i -lt 6000 ]; do nc 192.168.249.2 5002 < h2g.src 2>/dev/null && break; sleep 0.2; i=$((i+1)); done
  echo "@@HOST h2g_sent=$i" ) &
SENDER=$!
( i=0; while [ $i -lt 6000 ]; do
      a=$(ip -4 addr show dev dtap0 2>/dev/null | grep -o 'inet [0-9./]*')
      [ -n "$a" ] && { echo "@@HOST tap=$a state=$(cat /sys/class/net/dtap0/operstate) mtu=$(cat /sys/class/net/dtap0/mtu)"; break; }
      sleep 0.1; i=$((i+1))
  done ) &
"#;

const HOST_AFTER: &str = r#"
kill $SENDER 2>/dev/null
# The guest's nc ended only after the sink had read its EOF.
echo "@@HOST g2h_md5=$(md5sum < g2h.bin | cut -d' ' -f1) g2h_bytes=$(wc -c < g2h.bin)"
echo "@@HOST tap_after_exit=$([ -e /sys/class/net/dtap0 ] && echo present || echo gone)"
"#;

/// Once the guest runs.
const API_ADD: &str = r#"
echo "@@HOST add_net=$(api PUT /api/v1/vm.add-net '{"tap":"dtap0","ip":"192.168.249.1","mask":"255.255.255.0","mac":"MAC","mtu":1400,"id":"net0","num_queues":2,"queue_size":256}')"
echo "@@HOST info_net=$(api GET /api/v1/vm.info | grep -o '"net":\[[^]]*\]')"
"#;

/// In step with [`GUEST_REPLUG`]. Kata's way: its own tap, the fd sent
/// with the request (its NetConfig defaults, ip/mask included, which the
/// VMM leaves alone with a passed fd).
const API_REPLUG: &str = r#"
echo "@@HOST kata_add=$(daxprobe kata-add-net /tmp/api.sock ktap0 '{"ip":"192.168.249.1","mask":"255.255.255.0","mac":"52:54:00:12:34:57","iommu":false,"num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}')"
ip addr add 192.168.250.1/24 dev ktap0 && ip link set ktap0 up
echo "@@HOST ktap=$(echo $(ip -4 addr show dev ktap0 | grep -o 'inet [0-9./]*'))"
seen '@@GUEST kata_done=1'
echo "@@HOST net_remove=$(api PUT /api/v1/vm.remove-device '{"id":"net0"}')"
seen '@@GUEST net_unbound='
sleep 1
echo "@@HOST info_after=$(api GET /api/v1/vm.info | grep -o '"net":\[[^]]*\]')"
echo "@@HOST tap_after_remove=$([ -e /sys/class/net/dtap0 ] && echo present || echo gone)"
"#;

const GUEST_BOOT: &str = r#"
i=0; while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST mac=$(cat /sys/class/net/eth0/address 2>/dev/null)"
echo "@@GUEST mtu=$(cat /sys/class/net/eth0/mtu 2>/dev/null)"
ip addr add 192.168.249.2/24 dev eth0 && ip link set eth0 up
i=0; while [ "$(cat /sys/class/net/eth0/operstate 2>/dev/null)" != up ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST operstate=$(cat /sys/class/net/eth0/operstate)"
echo "@@GUEST features=$(cat /sys/class/net/eth0/device/features 2>/dev/null)"
# The first echo waits on ARP, which the emulated host may answer late:
# one reply first, then three counted (as for Kata's NIC below).
i=0; while ! ping -c 1 -W 2 HOST_IP >/dev/null 2>&1 && [ $i -lt 30 ]; do i=$((i+1)); done
echo "@@GUEST ping_tries=$i"
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
"#;

/// PCI only: Kata's device, then the first one ejected.
const GUEST_REPLUG: &str = r#"
i=0; while [ ! -e /sys/class/net/eth1 ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST kata_mac=$(cat /sys/class/net/eth1/address 2>/dev/null)"
ip addr add 192.168.250.2/24 dev eth1 && ip link set eth1 up
i=0; while ! ping -c 1 -W 2 192.168.250.1 >/dev/null 2>&1 && [ $i -lt 30 ]; do i=$((i+1)); done
echo "@@GUEST kata_ping=$(ping -c 3 -W 10 192.168.250.1 2>&1 | grep -o '[0-9]* packets received')"
echo "@@GUEST kata_done=1"
i=0; while [ -e /sys/class/net/eth0 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST net_unbound=$([ -e /sys/class/net/eth0 ] && echo no || echo yes)"
# The host asks vm.info after the eject; the VM must still be there.
sleep 8
"#;

/// The script fragments with their placeholders filled.
pub struct Scripts {
    pub guest_boot: String,
    pub guest_replug: String,
    pub host_before: String,
    pub host_after: String,
    pub api_add: String,
    pub api_replug: String,
}

pub fn scripts() -> Scripts {
    let fill = |s: &str| {
        s.replace("HOST_IP", HOST_IP)
            .replace("MIB", &MIB.to_string())
            .replace("\"MAC\"", &format!("\"{MAC}\""))
    };
    Scripts {
        guest_boot: fill(GUEST_BOOT),
        guest_replug: GUEST_REPLUG.into(),
        host_before: fill(HOST_BEFORE),
        host_after: HOST_AFTER.into(),
        api_add: fill(API_ADD),
        api_replug: API_REPLUG.into(),
    }
}

pub fn mmio_args() -> Vec<String> {
    vec![
        "--net".into(),
        format!("tap=dtap0,ip={HOST_IP},mask=255.255.255.0,mac={MAC},transport=mmio"),
    ]
}

pub fn check(run: &Run, pci: bool, tail: &str) {
    assert_eq!(run.guest("mac"), Some(MAC), "{tail}");
    let tap = run.host("tap").unwrap_or_default();
    assert!(
        tap.starts_with(&format!("inet {HOST_IP}/24")),
        "the VMM gave the tap its address: {tap}\n{tail}"
    );
    assert_eq!(run.guest("operstate"), Some("up"), "{tail}");
    // Linux's driver took mergeable receive buffers (feature bit 15, one
    // character a bit): its frames span page-sized buffers.
    let features = run.guest("features").unwrap_or_default();
    assert_eq!(
        features.as_bytes().get(15),
        Some(&b'1'),
        "VIRTIO_NET_F_MRG_RXBUF in {features}\n{tail}"
    );
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
    if pci {
        check_hot_plug(run, tap, tail);
    }
}

fn check_hot_plug(run: &Run, tap: &str, tail: &str) {
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
    // Kata's tap fd: the device runs on it, its address is Kata's own.
    let kata = run.host("kata_add").unwrap_or_default();
    assert!(
        kata.starts_with("status=200") && kata.contains("\"id\":\"_net"),
        "{kata}\n{tail}"
    );
    assert_eq!(run.host("ktap"), Some("inet 192.168.250.1/24"), "{tail}");
    assert_eq!(run.guest("kata_mac"), Some("52:54:00:12:34:57"), "{tail}");
    assert_eq!(run.guest("kata_ping"), Some("3 packets received"), "{tail}");
    assert!(
        run.host("net_remove")
            .unwrap_or_default()
            .starts_with("status=204"),
        "{tail}"
    );
    assert_eq!(run.guest("net_unbound"), Some("yes"), "{tail}");
    let after = run.host("info_after").unwrap_or_default();
    assert!(
        !after.contains("\"id\":\"net0\"") && after.contains("\"id\":\"_net"),
        "{after}\n{tail}"
    );
    assert_eq!(run.host("tap_after_remove"), Some("gone"), "{tail}");
}

pub fn record(results: &mut Results, run: &Run, transport: &str) {
    results.record(
        &format!("virtio-net over virtio-{transport}: {MIB} MiB guest to host (s)"),
        run.guest("g2h_s").unwrap_or("n/a").to_string(),
    );
    results.record(
        &format!("virtio-net over virtio-{transport}: host to guest"),
        run.guest("h2g_md5").unwrap_or("n/a").to_string(),
    );
    results.record(
        &format!("virtio-net over virtio-{transport}: guest rx/tx packets"),
        run.guest("rx_tx").unwrap_or("n/a").to_string(),
    );
}
