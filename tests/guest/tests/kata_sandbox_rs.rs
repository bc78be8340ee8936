//! Kata Containers' Rust runtime (runtime-rs, Kata 4's default) starting a
//! sandbox on this VMM, byte for byte as its Cloud Hypervisor driver and
//! Cloud Hypervisor's `api_client` send it (`test_infra::kata::rs`,
//! `test_infra::kata::api_client`): ONE API connection for the sandbox's
//! whole life, requests in two to four writes, the tap's fd on the first.
//!
//! - `runtime_rs_calls_on_one_connection_end_the_vmm` (host, fast): the
//!   calls that need no guest — ping, create with runtime-rs's default
//!   VmConfig (static and dynamic sizing; the vm.delete between them is
//!   the test's, not runtime-rs's), vm.info read as runtime-rs's serde
//!   structs read it, vmm.shutdown — on one connection, and the VMM ends.
//! - `a_runtime_rs_sandbox_starts_and_resizes_with_per_file_dax` (guest,
//!   ignored): see its note.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use test_infra::images;
use test_infra::kata::api_client::call;
use test_infra::kata::rs::json::Json;
use test_infra::kata::rs::{self, info, RsSandbox};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile};

use crate::api_common::{scratch, start_vmm, wait_for};

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

// ---------------------------------------------------------------------
// The guest test: two sandboxes in one emulated host (one boot of it).
// ---------------------------------------------------------------------

/// The sandboxes' memory at boot and the container's memory limit, MiB.
const BOOT_MIB: u64 = 512;
const CONTAINER_MIB: u64 = 512;
/// What the replay takes for the host's RAM (hotplug_size, the resize cap).
const HOST_RAM_MIB: u64 = 2048;
/// The container's CPU quota: one CPU (cfs quota / period).
const CONTAINER_QUOTA: (i64, u64) = (100_000, 100_000);
/// How long the agent dial and the guest's markers may take under TCG.
const GUEST_SECS: u64 = 900;

/// One sandbox of the run: runtime-rs's settings, and what differs for
/// the rig.
struct Run {
    /// `static` (static_sandbox_resource_mgmt = true, the default) or
    /// `dynamic` (false): also the guest's marker prefix (`kata_run=`).
    name: &'static str,
    tap: &'static str,
    mac: &'static str,
    /// The third octet of the tap's /24.
    subnet: u8,
}

const RUNS: [Run; 2] = [
    Run {
        name: "static",
        tap: "ktap0",
        mac: "52:54:00:ca:7a:01",
        subnet: 250,
    },
    Run {
        name: "dynamic",
        tap: "ktap1",
        mac: "52:54:00:ca:7a:02",
        subnet: 251,
    },
];

impl Run {
    fn sandbox(&self) -> RsSandbox {
        let mut s = RsSandbox::new(
            &format!("krs-{}", self.name),
            "/guest/vmlinuz",
            "/tmp/root.img",
            4,
            HOST_RAM_MIB << 20,
            self.name == "static",
        );
        s.memory_mib = BOOT_MIB;
        s.kernel_params = vec!["console=ttyS0".into(), format!("kata_run={}", self.name)];
        s
    }

    fn serial(&self) -> String {
        format!("/work/serial-{}.log", self.name)
    }

    /// runtime-rs's VmConfig with the rig's differences: the serial to a
    /// file (runtime-rs sends Off) and an initramfs beside the image (the
    /// Debian kernel's virtio-blk, virtio-net and vsock are modules).
    fn create_body(&self) -> String {
        let mut body = self.sandbox().vm_config();
        let payload = body.get_mut("payload").expect("payload");
        *payload.get_mut("initramfs").expect("initramfs") = Json::str("/guest/initramfs.cpio");
        *body.get_mut("serial").expect("serial") = Json::Obj(vec![
            ("file", Json::str(self.serial())),
            ("mode", Json::str("File")),
            ("iommu", Json::Bool(false)),
        ]);
        body.pretty()
    }

    /// runtime-rs's calls for this sandbox, in its order.
    fn script(&self) -> String {
        let n = self.name;
        let p = &n[..1];
        let s = self.sandbox();
        let mut script = format!(
            "{p}_ping ping\n\
             {p}_create create /work/{n}.json\n\
             {p}_net add-net {tap} {mac}\n\
             {p}_boot boot\n\
             {p}_agent agent {vsock} {port} 65536 {GUEST_SECS}\n\
             {p}_guest wait {serial} {n}_share_done=1 {GUEST_SECS}\n",
            tap = self.tap,
            mac = self.mac,
            vsock = s.vsock_socket(),
            port = rs::AGENT_PORT,
            serial = self.serial(),
        );
        if n == "dynamic" {
            // The pause container (no limits): the vCPU count is unchanged
            // (no call), resize_memory reads vm.info and sends nothing.
            // Then the container with a quota and a limit; then a second
            // container without limits: resize_memory's vm.info must show
            // the grown size (Cloud Hypervisor sets memory.size to
            // desired_ram), or runtime-rs would grow the VM again.
            let vcpus = rs::vcpus_required(1.0, &[CONTAINER_QUOTA]);
            let mib = rs::memory_required_mib(BOOT_MIB, &[CONTAINER_MIB << 20]);
            script.push_str(&format!(
                "{p}_pause_mem resize-memory {BOOT_MIB} {block} {HOST_RAM_MIB}\n\
                 {p}_ctr_cpus resize-vcpus 1 {vcpus} {max}\n\
                 {p}_ctr_mem resize-memory {mib} {block} {HOST_RAM_MIB}\n\
                 {p}_resized wait {serial} {n}_resized=1 {GUEST_SECS}\n\
                 {p}_ctr2_mem resize-memory {mib} {block} {HOST_RAM_MIB}\n",
                block = rs::X86_MEMORY_BLOCK_MIB,
                max = s.max_vcpus,
                serial = self.serial(),
            ));
        }
        script.push_str(&format!("{p}_end shutdown\n"));
        script
    }

    /// runtime-rs before the VMM: the sandbox's directories, the share
    /// (rw bound read-only onto ro), the daemon on its command line,
    /// waited for by its stderr line; the tap's host side once it exists.
    fn host_before(&self) -> String {
        let s = self.sandbox();
        let shared = s.shared_dir();
        let share_root = shared.trim_end_matches("/ro");
        format!(
            "mkdir -p {dir}/root {share_root}/rw {shared}\n\
             cp big.bin {share_root}/rw/big.bin; printf 'small file' > {share_root}/rw/small.txt\n\
             mount --bind {share_root}/rw {shared} && mount -o remount,bind,ro {shared}\n\
             dax-virtiofsd {args} 2> virtiofsd-{n}.log &\n\
             DAEMON_{n}=$!\n\
             i=0; while ! grep -q '{ready}' virtiofsd-{n}.log && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n\
             echo \"@@HOST {n}_daemon_ready=$(grep -c '{ready}' virtiofsd-{n}.log)\"\n\
             ( i=0; while [ ! -e /sys/class/net/{tap} ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done\n\
               ip addr add 192.168.{net}.1/24 dev {tap} && ip link set {tap} up ) &\n",
            dir = s.dir(),
            args = s.virtiofsd_args().join(" "),
            n = self.name,
            ready = rs::DAEMON_READY_LINE,
            tap = self.tap,
            net = self.subnet,
        )
    }

    /// After its VMM ended: the daemon ended with it (runtime-rs would
    /// SIGKILL it), and the root image is unchanged.
    fn host_after(&self) -> String {
        let n = self.name;
        format!(
            "sleep 1; kill $TAIL\n\
             kill -0 $DAEMON_{n} 2>/dev/null && echo \"@@HOST {n}_daemon_left=1\"; kill -9 $DAEMON_{n} 2>/dev/null\n\
             echo \"@@HOST {n}_root_md5_after=$(md5sum < /tmp/root.img | cut -d' ' -f1)\"\n\
             echo \"@@HOST {n}_daemon_log=$(head -c 300 virtiofsd-{n}.log | tr '\\n' '|')\"\n"
        )
    }
}

/// The rig's initramfs (after its modules): the root disk, then the
/// stand-in agent from it. `kata_run=` on the command line names the
/// sandbox; every marker carries it.
const GUEST_SCRIPT: &str = r#"
R=$(sed -n 's/.*kata_run=\([a-z]*\).*/\1/p' /proc/cmdline)
echo "@@GUEST ${R}_modules_loaded=$(cut -d' ' -f1 /proc/uptime)"
i=0; while [ ! -b /dev/vda1 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /newroot
mount -t ext4 -o ro /dev/vda1 /newroot; echo "@@GUEST ${R}_root_mount=$?"
echo "@@GUEST ${R}_root_mounted=$(cut -d' ' -f1 /proc/uptime)"
for d in proc sys dev; do mount -o bind /$d /newroot/$d; done
mount -t tmpfs tmpfs /newroot/run; mount -t tmpfs tmpfs /newroot/tmp
chroot /newroot /bin/sh /agent.sh "$R"
echo "@@GUEST ${R}_agent_exit=$?"
"#;

/// The stand-in kata-agent on the read-only root image: it listens on
/// vsock 1024, mounts the share as runtime-rs asks (virtiofs `kataShared`
/// at /run/kata-containers/shared/containers, options `nodev` only),
/// checks per-file DAX, and in the dynamic sandbox onlines what the
/// container's resize adds (the agent's online_cpu_mem).
const AGENT: &str = r#"
R=$1
up() { cut -d' ' -f1 /proc/uptime; }
echo "@@GUEST ${R}_root=$(grep '^/dev/vda1 ' /proc/mounts | cut -d' ' -f3,4 | cut -d, -f1)"
echo "@@GUEST ${R}_root_writable=$(touch /probe 2>/dev/null && echo yes || echo no)"
i=0; while ! ls /sys/bus/virtio/drivers/vmw_vsock_virtio_transport 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
daxprobe vsock-serve 1024 65536 1 > /tmp/agent.out 2> /tmp/agent.err &
AGENT=$!
echo "@@GUEST ${R}_agent_listening=$(up)"
S=/run/kata-containers/shared/containers
mkdir -p $S
mount -t virtiofs -o nodev kataShared $S; echo "@@GUEST ${R}_share_mount=$?"
echo "@@GUEST ${R}_share_mounted=$(up)"
echo "@@GUEST ${R}_share_opts=$(grep " $S " /proc/mounts | cut -d' ' -f4)"
echo "@@GUEST ${R}_statx=$(daxprobe statx $S/big.bin $S/small.txt)"
echo "@@GUEST ${R}_big_md5=$(daxprobe mmap-copy $S/big.bin /tmp/big.copy && md5sum < /tmp/big.copy | cut -d' ' -f1)"
echo "@@GUEST ${R}_small=$(cat $S/small.txt)"
N=250; [ "$R" = dynamic ] && N=251
ip addr add 192.168.$N.2/24 dev eth0 && ip link set eth0 up
i=0; while ! ping -c 1 -W 2 192.168.$N.1 >/dev/null 2>&1 && [ $i -lt 30 ]; do i=$((i+1)); done
echo "@@GUEST ${R}_ping=$(ping -c 3 -W 10 192.168.$N.1 2>&1 | grep -o '[0-9]* packets received')"
i=0; while kill -0 $AGENT 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST ${R}_agent=$(cat /tmp/agent.out) $(grep -v listening /tmp/agent.err | tail -1)"
mem_kib() { sed -n 's/^MemTotal: *\([0-9]*\) kB/\1/p' /proc/meminfo; }
echo "@@GUEST ${R}_before=cpus=$(cat /sys/devices/system/cpu/online) mem=$(mem_kib)"
BEFORE=$(mem_kib)
echo "@@GUEST ${R}_share_done=1"
if [ "$R" = dynamic ]; then
  i=0; while [ "$(cat /sys/devices/system/cpu/present)" = 0 ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
  for c in /sys/devices/system/cpu/cpu[1-9]*; do [ -e $c/online ] && echo 1 > $c/online; done
  i=0; while [ "$(mem_kib)" -le $((BEFORE + 400000)) ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
  echo "@@GUEST ${R}_after=cpus=$(cat /sys/devices/system/cpu/online) mem=$(mem_kib)"
  echo "@@GUEST ${R}_resized=1"
fi
sleep 600
"#;

/// The host side: the static sandbox's VMM is the rig's (started with only
/// `--api-socket`, as runtime-rs starts it); the dynamic one's is started
/// the same way once the first has ended.
fn host_scripts() -> (String, String, String) {
    let [st, dy] = &RUNS;
    let before = format!(
        "cp root.img /tmp/root.img\n\
         echo \"@@HOST root_md5=$(md5sum < /tmp/root.img | cut -d' ' -f1)\"\n\
         echo \"@@HOST big_md5=$(md5sum < big.bin | cut -d' ' -f1)\"\n{}",
        st.host_before()
    );
    let api = "follow serial-static.log\ndaxprobe kata-rs-replay /tmp/api.sock static.script\n";
    let after = format!(
        "{}{}follow serial-dynamic.log\n\
         \"$VMM\" --api-socket /tmp/api2.sock </dev/null >vmm-dynamic.out 2>&1 &\n\
         VMM2=$!\n\
         daxprobe kata-rs-replay /tmp/api2.sock dynamic.script\n\
         wait $VMM2; echo \"@@HOST dynamic_vmm_exit=$?\"\n{}",
        st.host_after(),
        dy.host_before(),
        dy.host_after()
    );
    (before, api.into(), after)
}

/// Each `@@GUEST init uptime=` in order: the static guest's, then the
/// dynamic one's (the rig's init prints it before loading modules).
fn init_uptimes(run: &rig::Run) -> Vec<f64> {
    run.lines
        .iter()
        .filter_map(|l| l.text.split_once("@@GUEST init uptime=").map(|x| x.1))
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Milliseconds the replay printed for `key` (`krs_<key>`).
fn ms(run: &rig::Run, key: &str) -> Option<u64> {
    run.host(&format!("krs_{key}"))?.trim().parse().ok()
}

fn guest_secs(run: &rig::Run, key: &str) -> Option<f64> {
    run.guest(key)?.trim().parse().ok()
}

/// Two runtime-rs sandboxes in one emulated host, each on its own VMM
/// started with only `--api-socket` and driven on ONE connection from
/// vmm.ping to vmm.shutdown (`daxprobe kata-rs-replay`):
///
/// - `static` (static_sandbox_resource_mgmt = true, runtime-rs's default):
///   ping, create with runtime-rs's default VmConfig, add-net with the
///   tap's fd on the request line's write, boot; the daemon started on
///   runtime-rs's command line, binding its own socket, waited for by its
///   stderr line; the agent reached with `connect 1024`; the share mounted
///   as runtime-rs's agent mounts it (`nodev` only) with per-file DAX;
///   nothing sent until vmm.shutdown, which ends the VMM.
/// - `dynamic` (false): the same, then the pause container's vm.info and a
///   container with a one-CPU quota and a 512 MiB limit: vm.resize with
///   desired_vcpus 2, vm.info, vm.resize with desired_ram, all with
///   runtime-rs's explicit nulls; the guest gets the vCPU and the memory.
///
/// Where the replay differs from runtime-rs, and why: the serial is a file
/// (runtime-rs sends Off; the rig reads the guest there), the payload has
/// an initramfs beside the image (the Debian kernel's virtio-blk, net and
/// vsock are modules; Kata's kernel builds them in), the command line adds
/// `console=ttyS0 kata_run=NAME`, the sandbox has 512 MiB, and the agent
/// dial may take up to 900 s (runtime-rs gives up after 301 tries 10 ms
/// apart; the emulated guest boots far slower than a real one).
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_runtime_rs_sandbox_starts_and_resizes_with_per_file_dax() {
    let (before, api, after) = host_scripts();
    let mut guest = Guest::new("kata-sandbox-rs", GUEST_SCRIPT);
    guest.guest_modules = vec![
        "virtio_blk".into(),
        "virtio_net".into(),
        "vmw_vsock_virtio_transport".into(),
    ];
    guest.host_modules = vec!["tun".into()];
    guest.host_tools = vec![
        rig::tool("guest-tools", "daxprobe").expect("daxprobe"),
        rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd"),
    ];
    guest.host_files = vec![
        ImageFile {
            path: "root.img".into(),
            perm: 0o644,
            data: crate::kata_sandbox::root_disk(AGENT),
        },
        ImageFile {
            path: "big.bin".into(),
            perm: 0o644,
            data: images::incompressible(4 << 20),
        },
    ];
    for r in &RUNS {
        guest.host_files.push(ImageFile {
            path: format!("{}.json", r.name),
            perm: 0o644,
            data: r.create_body().into_bytes(),
        });
        guest.host_files.push(ImageFile {
            path: format!("{}.script", r.name),
            perm: 0o644,
            data: r.script().into_bytes(),
        });
    }
    guest.host_before = before;
    guest.api_script = Some(api);
    guest.host_after = after;
    guest.timeout = Duration::from_secs(2400);

    let (run, stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(120);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    let ok = |k: &str| {
        let v = run.host(&format!("krs_{k}")).unwrap_or_default();
        assert!(v.starts_with("ok"), "{k}: {v}\n{tail}");
        v.to_string()
    };

    for r in &RUNS {
        let n = r.name;
        let p = &n[..1];
        assert_eq!(run.host(&format!("{n}_daemon_ready")), Some("1"), "{tail}");
        // The calls, each answered as api_client and runtime-rs need it.
        ok(&format!("{p}_ping"));
        let features = run.host(&format!("krs_{p}_ping_features"));
        assert!(features.is_some_and(|f| f.starts_with("Some(")), "{tail}");
        assert_eq!(ok(&format!("{p}_create")), "ok body=-", "{tail}");
        assert_eq!(ok(&format!("{p}_net")), "ok body=-", "{tail}");
        assert_eq!(ok(&format!("{p}_boot")), "ok body=-", "{tail}");
        // The agent, dialled with the lower-case `connect 1024`.
        let agent = run.host(&format!("krs_{p}_agent")).unwrap_or_default();
        let exchanged = "sent=65536 received=65536 match=1";
        assert!(
            agent.starts_with("OK ") && agent.contains(exchanged),
            "{agent}\n{tail}"
        );
        assert!(
            run.guest(&format!("{n}_agent"))
                .is_some_and(|a| a.starts_with(exchanged)),
            "{tail}"
        );
        assert_eq!(run.host(&format!("krs_{p}_guest")), Some("seen"), "{tail}");
        // The guest: the read-only root, the tap, the share with per-file DAX.
        assert_eq!(run.guest(&format!("{n}_root_mount")), Some("0"), "{tail}");
        assert_eq!(run.guest(&format!("{n}_root")), Some("ext4 ro"), "{tail}");
        assert_eq!(run.guest(&format!("{n}_root_writable")), Some("no"));
        assert_eq!(
            run.guest(&format!("{n}_ping")),
            Some("3 packets received"),
            "{tail}"
        );
        assert_eq!(run.guest(&format!("{n}_share_mount")), Some("0"), "{tail}");
        let opts = run.guest(&format!("{n}_share_opts")).unwrap_or_default();
        assert!(
            opts.split(',').any(|o| o == "nodev") && !opts.contains("dax"),
            "mounted as runtime-rs's agent mounts it: {opts}"
        );
        let dir = rs::GUEST_SHARE_DIR;
        assert_eq!(
            run.guest(&format!("{n}_statx")),
            Some(format!("{dir}big.bin:1 {dir}small.txt:0").as_str()),
            "the daemon's default policy: DAX for the big file only\n{tail}"
        );
        assert_eq!(run.guest(&format!("{n}_big_md5")), run.host("big_md5"));
        assert_eq!(run.guest(&format!("{n}_small")), Some("small file"));
        // vmm.shutdown on the same connection answered, and ended the VMM
        // and with it the daemon.
        assert_eq!(ok(&format!("{p}_end")), "ok body=-", "{tail}");
        assert_eq!(run.host(&format!("{n}_daemon_left")), None, "{tail}");
        assert_eq!(
            run.host(&format!("{n}_root_md5_after")),
            run.host("root_md5"),
            "{tail}"
        );
    }
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    assert_eq!(run.host("dynamic_vmm_exit"), Some("0"), "{tail}");

    // The dynamic sandbox's container: runtime-rs's exact resize calls.
    assert!(ok("d_pause_mem_info").contains("\"state\":\"Running\""));
    assert_eq!(run.host("krs_d_pause_mem"), Some("unchanged"), "{tail}");
    assert_eq!(ok("d_ctr_cpus"), "ok body=-", "{tail}");
    assert!(ok("d_ctr_mem_info").contains("\"state\":\"Running\""));
    assert_eq!(ok("d_ctr_mem"), "ok body=-", "{tail}");
    assert_eq!(run.host("krs_d_resized"), Some("seen"), "{tail}");
    assert_eq!(
        run.host("krs_d_ctr2_mem_info_vm"),
        Some("state=Running memory_size=1073741824 boot_vcpus=2 max_vcpus=4"),
        "{tail}"
    );
    assert_eq!(run.host("krs_d_ctr2_mem"), Some("unchanged"), "{tail}");
    let before = run.guest("dynamic_before").unwrap_or_default();
    let after = run.guest("dynamic_after").unwrap_or_default();
    assert!(after.starts_with("cpus=0-1 "), "{after}\n{tail}");
    let mem = |v: &str| -> u64 {
        v.split("mem=")
            .nth(1)
            .and_then(|m| m.trim().parse().ok())
            .unwrap_or_else(|| panic!("{v}\n{tail}"))
    };
    let grew_kib = mem(after) - mem(before);
    assert_eq!(grew_kib, CONTAINER_MIB * 1024, "{tail}");

    // The sandbox start, vm.create to the agent's answer, and where it went.
    let mut results = Results::new("kata-sandbox-rs");
    results.record_run("two runtime-rs sandboxes replayed", &run);
    results.record_stalls(&stalls);
    let inits = init_uptimes(&run);
    for (i, r) in RUNS.iter().enumerate() {
        let (n, p) = (r.name, &r.name[..1]);
        let create = ms(&run, &format!("{p}_create_start_ms"));
        let span = |from: Option<u64>, to: Option<u64>| match (from, to) {
            (Some(a), Some(b)) => format!("{} ms", b.saturating_sub(a)),
            _ => "n/a".into(),
        };
        let agent = ms(&run, &format!("{p}_agent_ok_ms"));
        let boot = ms(&run, &format!("{p}_boot_end_ms"));
        results.record(
            &format!("{n}: vm.create to the agent's OK (host clock)"),
            span(create, agent),
        );
        results.record(
            &format!("{n}: VMM set-up, vm.create to vm.boot answered"),
            span(create, boot),
        );
        results.record(
            &format!("{n}: vm.boot answered to the agent's OK"),
            span(boot, agent),
        );
        let g = |k: &str| guest_secs(&run, &format!("{n}_{k}"));
        let step = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => format!("{:.2} s", b - a),
            _ => "n/a".into(),
        };
        let init = inits.get(i).copied();
        results.record(
            &format!("{n}: guest kernel to init (guest uptime at init)"),
            init.map_or("n/a".into(), |s| format!("{s:.2} s")),
        );
        results.record(
            &format!("{n}: module loads (virtio_blk, virtio_net, vsock)"),
            step(init, g("modules_loaded")),
        );
        results.record(
            &format!("{n}: root disk found and mounted"),
            step(g("modules_loaded"), g("root_mounted")),
        );
        results.record(
            &format!("{n}: root mounted to the agent listening"),
            step(g("root_mounted"), g("agent_listening")),
        );
        results.record(
            &format!("{n}: virtio-fs share mounted (after the agent listens)"),
            step(g("agent_listening"), g("share_mounted")),
        );
    }
    results.record(
        "dynamic: guest MemTotal grown by the container's limit",
        format!("{grew_kib} KiB"),
    );
    results.save().expect("write results");
}
