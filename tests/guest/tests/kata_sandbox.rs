//! A Kata sandbox start, replayed as Kata's Cloud Hypervisor driver sends
//! it, in one real guest (the end-to-end test of Kata's support).
//!
//! The emulated host plays Kata's runtime:
//! - it starts `dax-virtiofsd` as Kata's `virtiofsd.go` does: a unix socket
//!   it bound and listens on, passed as fd 3, and Kata's exact command
//!   line (`--syslog --cache=auto --shared-dir=DIR --fd=3
//!   --thread-pool-size=1 --announce-submounts`); no policy, no control
//!   socket named, no window size;
//! - the VMM starts with only `--api-socket`, and `daxprobe kata-replay`
//!   sends Kata's calls byte for byte (`test_infra::kata`) on one
//!   kept-alive connection: vmm.ping, vm.create with Kata's default
//!   VmConfig, vm.info (`Created`), vm.add-net with a tap fd over
//!   SCM_RIGHTS (its own connection, as Kata does), vm.boot, vm.info
//!   (`Running`), the pause container's ResizeVCPUs and memory update,
//!   then — once the guest's agent is up — a container with a CPU quota
//!   (one more vCPU) and a 512 MiB memory limit (RAM grows), vm.counters,
//!   and vmm.shutdown;
//! - it reaches the guest's agent through the hybrid vsock
//!   (`CONNECT 1024`, Kata's agent port) and pings the guest over the tap.
//!
//! The guest boots from a read-only root image on virtio-blk (Kata's
//! `image`, a raw disk with one ext4 partition, `root=/dev/vda1`): the
//! rig's initramfs only loads the modules Debian's kernel has as modules
//! (Kata's guest kernel builds them in), mounts `/dev/vda1` read-only and
//! runs the stand-in agent from it. The agent listens on vsock port 1024,
//! mounts the share exactly as the kata-agent does (`virtiofs`, tag
//! `kataShared`, no options: Kata passes `dax` only when
//! `virtio_fs_cache_size` > 0), and checks that a large file has the DAX
//! attribute and a small one does not — the daemon's default per-file
//! policy, with nothing configured anywhere.
//!
//! Where the replay differs from Kata's bytes, and why: the VmConfig's
//! `serial` is a file instead of `Off` (the rig reads the guest there), its
//! payload has an `initramfs` beside the image (for those modules), its
//! command line adds `console=ttyS0`, and the sandbox has 512 MiB and up
//! to 4 vCPUs (Kata's defaults are 2 GiB and the host's CPU count).
//!
//! Run with `cargo test -p guest-tests -- --ignored kata_sandbox::`
//! (scripts/test.sh does).

use std::time::Duration;

use serde_json::json;
use test_infra::host::static_busybox;
use test_infra::images;
use test_infra::kata::{self, RootAsset, Sandbox};
use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile};

const MIB: u64 = 1 << 20;
/// The sandbox's memory before and after the container's limit.
const BOOT_MIB: u64 = 512;
const CONTAINER_MIB: u64 = 512;
const KATA_MAC: &str = "52:54:00:ca:7a:01";

/// The rig's initramfs: the modules, then the root disk, then the agent
/// from it (chroot: the rig's init is PID 1 and powers off after this).
const GUEST_SCRIPT: &str = r#"
i=0; while [ ! -b /dev/vda1 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /newroot
mount -t ext4 -o ro /dev/vda1 /newroot; echo "@@GUEST root_mount=$?"
for d in proc sys dev; do mount -o bind /$d /newroot/$d; done
mount -t tmpfs tmpfs /newroot/run; mount -t tmpfs tmpfs /newroot/tmp
chroot /newroot /bin/sh /agent.sh
echo "@@GUEST agent_exit=$?"
"#;

/// The stand-in kata-agent, on the read-only root image.
const AGENT: &str = r#"
echo "@@GUEST root=$(grep '^/dev/vda1 ' /proc/mounts | cut -d' ' -f3,4 | cut -d, -f1)"
echo "@@GUEST root_writable=$(touch /probe 2>/dev/null && echo yes || echo no)"
i=0; while ! ls /sys/bus/virtio/drivers/vmw_vsock_virtio_transport 2>/dev/null | grep -q virtio && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
daxprobe vsock-serve 1024 65536 1 > /tmp/agent.out 2> /tmp/agent.err &
AGENT=$!
ip addr add 192.168.250.2/24 dev eth0 && ip link set eth0 up
i=0; while ! ping -c 1 -W 2 192.168.250.1 >/dev/null 2>&1 && [ $i -lt 30 ]; do i=$((i+1)); done
echo "@@GUEST ping=$(ping -c 3 -W 10 192.168.250.1 2>&1 | grep -o '[0-9]* packets received')"
S=/run/kata-containers/shared/containers
mkdir -p $S
mount -t virtiofs kataShared $S; echo "@@GUEST share_mount=$?"
echo "@@GUEST share_opts=$(grep ' /run/kata-containers/shared/containers ' /proc/mounts | cut -d' ' -f4)"
echo "@@GUEST statx=$(daxprobe statx $S/big.bin $S/small.txt)"
echo "@@GUEST big_md5=$(daxprobe mmap-copy $S/big.bin /tmp/big.copy && md5sum < /tmp/big.copy | cut -d' ' -f1)"
echo "@@GUEST small=$(cat $S/small.txt)"
i=0; while kill -0 $AGENT 2>/dev/null && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST agent=$(cat /tmp/agent.out) $(grep -v listening /tmp/agent.err | tail -1)"
mem_kib() { sed -n 's/^MemTotal: *\([0-9]*\) kB/\1/p' /proc/meminfo; }
echo "@@GUEST cpus_before=$(cat /sys/devices/system/cpu/online) mem_before=$(mem_kib)"
BEFORE=$(mem_kib)
echo "@@GUEST share_done=1"
# The container's resources: Kata's agent onlines hot-added CPUs (its
# OnlineCPUMem); Linux onlines hot-added memory blocks by itself.
i=0; while [ "$(cat /sys/devices/system/cpu/present)" = 0 ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
for c in /sys/devices/system/cpu/cpu[1-9]*; do [ -e $c/online ] && echo 1 > $c/online; done
i=0; while [ "$(mem_kib)" -le $((BEFORE + 400000)) ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST cpus_after=$(cat /sys/devices/system/cpu/online) mem_after=$(mem_kib)"
echo "@@GUEST resized=1"
# Until the runtime shuts the VM down.
sleep 600
"#;

/// Kata's runtime before the VMM starts: the share, the daemon as Kata
/// launches it, the agent check and the tap's host side.
const HOST_BEFORE: &str = r#"
mkdir -p /tmp/sbx /tmp/share
cp big.bin /tmp/share/big.bin; printf 'small file' > /tmp/share/small.txt
echo "@@HOST big_md5=$(md5sum < /tmp/share/big.bin | cut -d' ' -f1)"
cp root.img /tmp/root.img
echo "@@HOST root_md5=$(md5sum < /tmp/root.img | cut -d' ' -f1)"
daxprobe listen-exec /tmp/sbx/virtiofsd.sock dax-virtiofsd --syslog --cache=auto --shared-dir=/tmp/share --fd=3 --thread-pool-size=1 --announce-submounts > virtiofsd.log 2>&1 &
DAEMON=$!
( i=0; while [ $i -lt 3000 ]; do
      daxprobe hybrid-connect /tmp/sbx/clh.sock 1024 65536 > agent.out 2> agent.err && break
      sleep 0.2; i=$((i+1))
  done ) &
AGENT_CHECK=$!
( i=0; while [ ! -e /sys/class/net/ktap0 ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
  ip addr add 192.168.250.1/24 dev ktap0 && ip link set ktap0 up ) &
"#;

const API_SCRIPT: &str = r#"
follow serial.log
daxprobe kata-replay /tmp/api.sock kata.script
"#;

const HOST_AFTER: &str = r#"
sleep 1; kill $TAIL
kill $AGENT_CHECK 2>/dev/null
echo "@@HOST agent=$(cat agent.out 2>/dev/null) $(tail -1 agent.err 2>/dev/null)"
echo "@@HOST control_socket=$([ -S /tmp/sbx/virtiofsd.sock.control ] && echo yes || echo no)"
kill -9 $DAEMON 2>/dev/null
echo "@@HOST root_md5_after=$(md5sum < /tmp/root.img | cut -d' ' -f1)"
echo "@@HOST daemon_log=$(head -c 300 virtiofsd.log | tr '\n' '|')"
"#;

/// The calls, in Kata's order (see `daxprobe/kata_replay.rs`).
fn replay_script() -> String {
    let total = BOOT_MIB + CONTAINER_MIB;
    format!(
        "ping ping\n\
         create create /work/create.json\n\
         created info\n\
         net add-net ktap0 {KATA_MAC}\n\
         boot boot\n\
         running info\n\
         pause_cpus resize-vcpus 1\n\
         pause_mem resize-memory {BOOT_MIB}\n\
         agent wait /work/serial.log share_done=1 600\n\
         ctr_cpus resize-vcpus 2\n\
         ctr_mem resize-memory {total}\n\
         resized wait /work/serial.log resized=1 600\n\
         counters get vm.counters\n\
         policy get vm.dax-policy?id=_fs0\n\
         end shutdown\n"
    )
}

/// Kata's default VmConfig for this sandbox, with the rig's differences.
fn create_body() -> String {
    let mut sandbox = Sandbox::new(
        "/guest/vmlinuz",
        RootAsset::Image("/tmp/root.img".into()),
        "/tmp/sbx",
        4,
        BOOT_MIB + 1024,
    );
    sandbox.memory_mib = BOOT_MIB;
    sandbox.kernel_params = vec!["console=ttyS0".into()];
    let mut body = sandbox.vm_config();
    body["payload"]["initramfs"] = json!("/guest/initramfs.cpio");
    body["serial"] = json!({"mode": "File", "file": "/work/serial.log", "iommu": false});
    kata::go_json(&body)
}

/// The root image: busybox with its applets, the agent's tools and its
/// script (`agent`: each runtime's sandbox test has its own).
pub(crate) fn root_disk(agent: &str) -> Vec<u8> {
    let busybox = std::fs::read(static_busybox().expect("busybox")).unwrap();
    let daxprobe = std::fs::read(rig::tool("guest-tools", "daxprobe").expect("daxprobe")).unwrap();
    let applets = [
        "sh", "cat", "cut", "grep", "sed", "ls", "mkdir", "mount", "touch", "ping", "ip", "md5sum",
        "sleep", "kill", "tail", "head", "tr",
    ];
    kata::agent_root_disk("kata-root", &busybox, &daxprobe, agent, &applets)
}

#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn a_kata_sandbox_starts_as_katas_driver_starts_it_with_per_file_dax() {
    let mut guest = Guest::new("kata-sandbox", GUEST_SCRIPT);
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
    let big = images::incompressible(4 * MIB);
    guest.host_files = vec![
        ImageFile {
            path: "root.img".into(),
            perm: 0o644,
            data: root_disk(AGENT),
        },
        ImageFile {
            path: "big.bin".into(),
            perm: 0o644,
            data: big,
        },
        ImageFile {
            path: "create.json".into(),
            perm: 0o644,
            data: create_body().into_bytes(),
        },
        ImageFile {
            path: "kata.script".into(),
            perm: 0o644,
            data: replay_script().into_bytes(),
        },
    ];
    guest.host_before = HOST_BEFORE.into();
    guest.api_script = Some(API_SCRIPT.into());
    guest.host_after = HOST_AFTER.into();
    guest.timeout = Duration::from_secs(1200);

    let (run, _stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(100);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    let ok = |k: &str, status: &str| {
        let v = run.host(&format!("kata_{k}")).unwrap_or_default();
        assert!(
            v.starts_with(&format!("status={status}")),
            "{k}: {v}\n{tail}"
        );
        v.to_string()
    };

    // Kata's calls, each answered as its driver needs.
    ok("ping", "200");
    ok("create", "204");
    assert!(
        ok("created", "200").contains("\"state\":\"Created\""),
        "{tail}"
    );
    // Before boot the NIC joins the configuration: 204, as Cloud
    // Hypervisor answers (Kata takes 200 or 204).
    ok("net", "204");
    ok("boot", "204");
    let running = ok("running", "200");
    assert!(running.contains("\"state\":\"Running\""), "{running}");
    assert!(
        running.contains(&format!("\"memory_actual_size\":{}", BOOT_MIB * MIB)),
        "{running}"
    );
    for k in ["pause_cpus", "ctr_cpus"] {
        assert_eq!(run.host(&format!("kata_{k}_attempts")), Some("1"), "{tail}");
        ok(k, "204");
    }
    assert_eq!(run.host("kata_agent"), Some("seen"), "{tail}");
    assert_eq!(run.host("kata_resized"), Some("seen"), "{tail}");
    let grown = run.host("kata_ctr_mem0").unwrap_or_default();
    assert!(grown.starts_with("status=204"), "{grown}\n{tail}");
    ok("counters", "200");
    // The daemon's control socket, found with nothing configured: the
    // policy it has in force is readable (and replaceable) through the API.
    let policy = ok("policy", "200");
    assert!(
        policy.contains("\"daemon_error\":null") && policy.contains("\"generation\""),
        "{policy}"
    );
    ok("end_ping", "200");
    ok("end", "204");
    assert_eq!(
        run.host("kata_connections"),
        Some("1"),
        "every call but add-net on one kept-alive connection\n{tail}"
    );
    for k in ["pause_mem", "ctr_mem"] {
        assert_eq!(run.host(&format!("kata_{k}_error")), None, "{tail}");
    }

    // The guest: a read-only root on virtio-blk, the agent, the share.
    assert_eq!(run.guest("root_mount"), Some("0"), "{tail}");
    assert_eq!(run.guest("root"), Some("ext4 ro"), "{tail}");
    assert_eq!(run.guest("root_writable"), Some("no"), "{tail}");
    assert_eq!(run.host("root_md5_after"), run.host("root_md5"), "{tail}");
    let exchanged = "sent=65536 received=65536 match=1";
    assert!(
        run.host("agent").is_some_and(|a| a.contains(exchanged)),
        "CONNECT 1024 through the hybrid vsock\n{tail}"
    );
    assert!(
        run.guest("agent").is_some_and(|a| a.starts_with(exchanged)),
        "{tail}"
    );
    assert_eq!(run.guest("ping"), Some("3 packets received"), "{tail}");
    assert_eq!(run.guest("share_mount"), Some("0"), "{tail}");
    let opts = run.guest("share_opts").unwrap_or_default();
    assert!(
        !opts.contains("dax"),
        "mounted as the agent mounts it: {opts}"
    );
    assert_eq!(
        run.guest("statx"),
        Some(
            "/run/kata-containers/shared/containers/big.bin:1 \
             /run/kata-containers/shared/containers/small.txt:0"
        ),
        "the daemon's default policy: DAX for the big file only\n{tail}"
    );
    assert_eq!(run.guest("big_md5"), run.host("big_md5"), "{tail}");
    assert_eq!(run.guest("small"), Some("small file"), "{tail}");

    // The container's resources reached the guest.
    let cpus = run.guest("cpus_after").unwrap_or_default();
    assert!(cpus.starts_with("0-1 "), "{cpus}\n{tail}");
    let mem = |k: &str| -> u64 {
        run.guest(k)
            .and_then(|v| v.split("mem_").nth(1))
            .and_then(|v| v.split('=').nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k}\n{tail}"))
    };
    let grew_kib = mem("cpus_after") - mem("cpus_before");
    assert_eq!(grew_kib, CONTAINER_MIB * 1024, "{tail}");

    // The daemon as Kata runs it: its control socket where the VMM looks
    // for it (it ends with its VMM, as virtiofsd does, before Kata's
    // SIGKILL).
    assert_eq!(run.host("control_socket"), Some("yes"), "{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");

    let mut results = Results::new("kata-sandbox");
    results.record_run("a Kata sandbox start replayed", &run);
    results.record(
        "guest MemTotal grown by the container's limit",
        format!("{grew_kib} KiB"),
    );
    results.record(
        "vm.counters at the end",
        run.host("kata_counters").unwrap_or("n/a").to_string(),
    );
    results.save().expect("write results");
}
