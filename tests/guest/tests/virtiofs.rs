//! virtio-fs with DAX in real guests, over virtio-MMIO and over virtio-PCI:
//! our daemon serves a directory on the (emulated) host, the VMM gives the
//! device a 32 MiB window, and one boot per transport checks:
//! - `dax=inode`: `statx` shows STATX_ATTR_DAX exactly on the files the
//!   policy selects (size ≥ 32 KiB, not under `nodax/`);
//! - a 96 MiB DAX file reads back identically through read() and mmap,
//!   through a window a third its size (the guest's reclaim path);
//! - writes through DAX (dd conv=fsync, a shared writable mmap + msync) and
//!   through FUSE WRITE reach the host file, as the host sees after power-off;
//! - `cp -a`, `tar` and `find` over a tree of small files; rename, hard link,
//!   symlink;
//! - a policy replaced through the daemon's control socket while the guest
//!   runs flips `STATX_ATTR_DAX` on files the guest already looked up;
//! - `dax=always`: every regular file is DAX;
//! - a DAX-mapped file cut short on the host while a guest process has it
//!   mapped: the process reads zeros where the pages vanished,
//!   and the VM lives on (the VMM shows the scratch there; without it the
//!   vCPU hung in KVM or KVM_RUN failed and the VM ended);
//! - (a boot of its own, over MMIO) a page of a file cut short on the host,
//!   then read and written by a forked child and through a new mapping,
//!   which the guest maps again (writable, for a write): zeros or SIGBUS,
//!   and the VM lives on.
//!
//! The PCI run also starts the daemon the way Kata does
//! (`--thread-pool-size=2 -o announce_submounts`) with a tmpfs mounted
//! inside the share, which the guest must see as a submount of its own.

use test_infra::results::Results;
use test_infra::rig::{self, Guest, ImageFile};

const DIRS: u32 = 20;
const FILES_PER_DIR: u32 = 100;

const POLICY: &str = r#"{
  "mode": "inode",
  "rules": [
    { "path": "nodax/**", "dax": false },
    { "min_size": "32K", "dax": true }
  ],
  "default": false
}"#;

/// Pushed while the guest runs: small.txt gains DAX by a rule; big.bin
/// falls to the default, where the adaptive part keeps a file larger than
/// half the 32 MiB window off DAX (an `adaptive` event says so).
const FLIPPED_POLICY: &str = r#"{"mode": "inode", "rules": [{"path": "small.txt", "dax": true}, {"path": "nodax/**", "dax": false}, {"max_size": "32K", "dax": false}], "default": true}"#;

const HOST_BEFORE: &str = r#"
mkdir -p share/nodax share/tree
dd if=/dev/urandom of=share/big.bin bs=1M count=96 2>/dev/null
dd if=/dev/zero of=share/target.bin bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=share/trunc.bin bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=share/nodax/large.bin bs=1M count=1 2>/dev/null
dd if=/dev/zero of=share/wmap.bin bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=share/nodax/wsrc.bin bs=1M count=1 2>/dev/null
printf 'small file\n' > share/small.txt
i=0; while [ $i -lt DIRS ]; do mkdir share/tree/d$i; j=0; while [ $j -lt FILES ]; do echo "file $i $j" > share/tree/d$i/f$j; j=$((j+1)); done; i=$((i+1)); done
ln -s ../small.txt share/tree/link
echo "@@HOST big_md5=$(md5sum < share/big.bin | cut -d' ' -f1)"
echo "@@HOST large_md5=$(md5sum < share/nodax/large.bin | cut -d' ' -f1)"
SUBMOUNT_CMD
# A tmpfs with 2 MiB pages inside the share: its files' st_blksize is 2 MiB
# on the host, which the guest must not take as their block size (its DAX
# writeback refuses any but the page size).
mkdir share/huge && mount -t tmpfs -o size=8m,huge=always tmpfs share/huge && head -c 4194304 /dev/zero > share/huge/hp.bin
echo "@@HOST huge_blksize=$(stat -c %o share/huge/hp.bin)"
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --dax-policy policy.json \
    --control-socket /tmp/fs-control.sock --log-level warn DAEMON_ARGS &
DAEMON=$!
i=0; while [ ! -S /tmp/fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
# When the guest asks (a file in the share), push the flipped policy.
# (Gives up as soon as the VMM is gone, so a VMM that died fails the run
# at once instead of after the wait.)
( i=0; while [ ! -e share/.flip-request ] && [ $i -lt 6000 ] && { [ $i -lt 300 ] || pidof dax-vmm >/dev/null; }; do sleep 0.1; i=$((i+1)); done
  echo "@@HOST daemon_workers=$(for p in $(pidof dax-virtiofsd); do cat /proc/$p/task/*/comm; done | grep -c fs-worker)"
  # Confinement, with every thread of both processes running (vCPUs, device
  # workers, the API; the daemon's queue threads and workers).
  tot=0; ok=0; bad=""
  for p in $(pidof dax-virtiofsd dax-vmm); do for t in /proc/$p/task/*; do
    tot=$((tot+1))
    if grep -q '^Seccomp:[[:space:]]*2$' $t/status && grep -q '^NoNewPrivs:[[:space:]]*1$' $t/status; then ok=$((ok+1)); else bad="$bad,$(cat $t/comm)"; fi
  done; done
  echo "@@HOST confined_threads=$ok/$tot$bad"
  caps=""; ns=""
  for p in $(pidof dax-virtiofsd); do
    caps="$caps $(awk '/^CapEff/{print $2}' /proc/$p/status)"
    [ "$(readlink /proc/$p/ns/mnt)" = "$(readlink /proc/1/ns/mnt)" ] && ns="$ns host" || ns="$ns own"
  done
  echo "@@HOST daemon_capeff=${caps# }"
  echo "@@HOST daemon_mntns=${ns# }"
  METRICS_CMD
  FLIP_CMD > flip.out 2>&1
  echo done > share/.flip-done ) &
WATCHER=$!
# Progress for the log, and what every thread waits on if the guest stalls.
( while sleep 120; do
    echo "@@DIAG daemon_stats=$(daxprobe http /tmp/fs-control.sock GET /api/v1/stats 2>&1 | tr -d '\n')"
    for p in $(pidof dax-virtiofsd dax-vmm); do
      for t in /proc/$p/task/*; do echo "@@DIAG thread=$(cat $t/comm) state=$(cut -d' ' -f3 $t/stat) wchan=$(cat $t/wchan)"; done
    done
  done ) &
DIAG=$!
# When the guest has trunc.bin mapped through DAX, cut it to 1 MiB under it.
( i=0; while [ ! -e share/.trunc-ready ] && [ $i -lt 6000 ] && { [ $i -lt 300 ] || pidof dax-vmm >/dev/null; }; do sleep 0.1; i=$((i+1)); done
  truncate -s 1048576 share/trunc.bin; echo "@@HOST truncated_rc=$?"
  sleep 1
  daxprobe http /tmp/fs-control.sock GET /api/v1/stats > trunc-stats.out
  echo "@@HOST daemon_truncations=$(grep -o '"window_truncations":[0-9]*' trunc-stats.out | cut -d: -f2)"
  # The window-io passes ran before the guest mapped trunc.bin.
  echo "@@HOST wbuf_stats=$(grep -o '"window_buffer_[a-z]*":[0-9]*' trunc-stats.out | cut -d_ -f3 | tr -d '"' | tr '\n' ' ')"
  echo "@@HOST wbuf_location=$(grep -o '"window_location":{[^}]*}' trunc-stats.out | grep -c gpa)"
  touch share/.trunc-go ) &
"#;

/// Without the API the flip goes straight to the daemon's control socket.
const CLI_FLIP: &str =
    r#"daxprobe http /tmp/fs-control.sock PUT /api/v1/policy "$(cat flipped.json)""#;

/// With the API: metrics after the 96 MiB file went through the window,
/// then the flip through `vm.dax-policy`.
const API_METRICS: &str = r#"daxprobe http /tmp/api.sock GET /api/v1/vm.dax-metrics > metrics.out 2>&1
  m() { sed -n "s/.* $1{device=\"fs0\"} \([0-9]*\).*/\1/p" metrics.out; }
  k() { sed -n "s/.* $1 \([0-9]*\).*/\1/p" metrics.out; }
  echo "@@HOST metrics=maps:$(m daxvmm_dax_maps_total) unmaps:$(m daxvmm_dax_unmaps_total) ranges:$(m daxvmm_dax_mapped_ranges) attrs_dax:$(m daxvmm_fs_file_attrs_dax_total) window:$(m daxvmm_dax_window_bytes) prefaulted:$(m daxvmm_dax_prefaulted_bytes_total) guest_prefaulted:$(m daxvmm_dax_guest_prefaulted_bytes_total) prefault_failures:$(m daxvmm_dax_prefault_failures_total) roundtrips:$(m daxvmm_fs_map_roundtrip_seconds_count) kvm_exits:$(k daxvmm_kvm_exits_total) kvm_page_faults:$(k daxvmm_kvm_page_faults_total) kvm_pages_4k:$(sed -n 's/.* daxvmm_kvm_mapped_pages{size="4k"} \([0-9]*\).*/\1/p' metrics.out)""#;
const API_FLIP: &str =
    r#"daxprobe http /tmp/api.sock PUT '/api/v1/vm.dax-policy?id=fs0' "$(cat flipped.json)""#;

/// API mode: the VMM starts with only --api-socket; the VM is created, given
/// its DAX share and booted through the API, as an orchestrator would.
const API_SCRIPT: &str = r#"
api() { daxprobe http /tmp/api.sock "$@"; }
CREATE='{"payload":{"kernel":"'$KERNEL'","initramfs":"'$INITRAMFS'","cmdline":"'$CMDLINE'"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":536870912,"shared":true},"serial":{"mode":"Tty"}}'
echo "@@HOST api_create=$(api PUT /api/v1/vm.create "$CREATE")"
echo "@@HOST api_add_fs=$(api PUT /api/v1/vm.add-fs '{"tag":"share","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024,"id":"fs0","cache_size":33554432,"transport":"TRANSPORT","control_socket":"/tmp/fs-control.sock"}')"
echo "@@HOST api_policy_before_boot=$(api GET '/api/v1/vm.dax-policy?id=fs0')"
daxprobe sse /tmp/api.sock /api/v1/vm.dax-events > events.out 2>&1 &
EVENTS=$!
echo "@@HOST api_boot=$(api PUT /api/v1/vm.boot)"
# Pause while the guest reads a DAX file (its vCPU is busy): the vCPU
# thread takes no CPU time until vm.resume, and the read completes after.
i=0; while [ ! -e share/.reading ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
state() { api GET /api/v1/vm.info | grep -o '"state":"[A-Za-z]*"' | cut -d'"' -f4; }
vcpu_ticks() { for t in /proc/$VMM_PID/task/*; do [ "$(cat $t/comm)" = vcpu0 ] && awk '{print $14+$15}' $t/stat; done; }
a=$(vcpu_ticks); sleep 1; b=$(vcpu_ticks)
echo "@@HOST api_pause=$(api PUT /api/v1/vm.pause)"
echo "@@HOST api_paused_state=$(state)"
c=$(vcpu_ticks); sleep 2; d=$(vcpu_ticks)
echo "@@HOST api_resume=$(api PUT /api/v1/vm.resume)"
echo "@@HOST vcpu_ticks=running:$((b-a)) paused:$((d-c))"
echo "@@HOST api_state=$(state)"
"#;

const HOST_AFTER: &str = r#"
kill $DIAG
[ -n "$EVENTS" ] && wait $EVENTS && echo "@@HOST events=$(cat events.out)"
wait $DAEMON; echo "@@HOST daemon_exit=$?"
wait $WATCHER; echo "@@HOST flip=$(cat flip.out)"
echo "@@HOST target_md5=$(md5sum < share/target.bin | cut -d' ' -f1)"
echo "@@HOST huge_filled=$(head -c 2097152 share/huge/hp.bin | tr -d M | wc -c)"
echo "@@HOST written_md5=$(md5sum < share/written.bin | cut -d' ' -f1)"
diff -r share/tree share/tree-copy >/dev/null && echo "@@HOST tree_copy=same"
echo "@@HOST copy_link=$(readlink share/tree-copy/link)"
# What the window-io passes left on the host: OUT as SRC's first 256 KiB,
# and those bytes in the mapped file where each pass's buffer was.
head -c 262144 share/nodax/wsrc.bin > wwant
for pass in direct:1 buffered:16; do
  name=${pass%:*}; skip=${pass#*:}
  cmp -s wwant share/nodax/wout-$name.bin && echo "@@HOST wbuf_out_$name=same"
  dd if=share/wmap.bin bs=65536 skip=$skip count=4 2>/dev/null > wmap-$name
  cmp -s wwant wmap-$name && echo "@@HOST wbuf_map_$name=same"
done
"#;

const GUEST_SCRIPT: &str = r#"
up() { cut -d' ' -f1 /proc/uptime; }
secs() { awk "BEGIN{print $2-$1}"; }
mkdir -p /mnt
mount -t virtiofs share /mnt -o dax=inode; echo "@@GUEST mount_inode_rc=$?"
echo "@@GUEST mount_inode_opts=$(grep ' /mnt ' /proc/mounts | cut -d' ' -f4)"
cd /mnt
echo "@@GUEST statx_inode=$(daxprobe statx big.bin target.bin small.txt nodax/large.bin tree/d0/f0)"
# A host mount inside the share (the Kata-style run announces submounts):
# the guest mounts it on its own superblock when it is first walked into.
if [ -d sub ]; then
  same=$( [ "$(stat -c %d sub/inner.txt)" = "$(stat -c %d small.txt)" ] && echo same-dev || echo own-dev )
  echo "@@GUEST submount=$(cat sub/inner.txt) $same mounts:$(grep -c ' /mnt/sub ' /proc/mounts)"
fi
touch .reading
t0=$(up); echo "@@GUEST big_md5=$(md5sum < big.bin | cut -d' ' -f1)"; t1=$(up)
daxprobe mmap-copy big.bin /tmp/big.copy && echo "@@GUEST big_mmap_md5=$(md5sum < /tmp/big.copy | cut -d' ' -f1)"; t2=$(up)
rm -f /tmp/big.copy
touch .flip-request
i=0; while [ ! -e .flip-done ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
echo "@@GUEST statx_after_push=$(daxprobe statx big.bin small.txt)"
echo "@@GUEST statx_flipped=$(daxprobe statx big.bin small.txt target.bin)"
rm -f .flip-request .flip-done
# The API relays the daemon's decisions once a second.
sleep 2
echo "@@GUEST big_read_s=$(secs $t0 $t1)"
echo "@@GUEST big_mmap_s=$(secs $t1 $t2)"
echo "@@GUEST large_md5=$(md5sum < nodax/large.bin | cut -d' ' -f1)"
dd if=/dev/urandom of=/tmp/chunk bs=1M count=2 2>/dev/null
dd if=/tmp/chunk of=target.bin bs=1M seek=1 conv=notrunc,fsync 2>/dev/null; echo "@@GUEST dd_rc=$?"
daxprobe mmap-fill target.bin 4096 65536 90; echo "@@GUEST mmap_fill_rc=$?"
echo "@@GUEST target_md5=$(md5sum < target.bin | cut -d' ' -f1)"
# A program's I/O buffer in a DAX mapping (wmap.bin) of another file:
# read() nodax/wsrc.bin into it, write() it out. With O_DIRECT the FUSE
# requests carry window pages, which the daemon serves through wmap.bin.
echo "@@GUEST wbuf_statx=$(daxprobe statx wmap.bin nodax/wsrc.bin)"
echo "@@GUEST wbuf_direct=$(daxprobe window-io wmap.bin nodax/wsrc.bin nodax/wout-direct.bin 65536 262144 direct)"
echo "@@GUEST wbuf_buffered=$(daxprobe window-io wmap.bin nodax/wsrc.bin nodax/wout-buffered.bin 1048576 262144 buffered)"
echo "@@GUEST statx_trunc=$(daxprobe statx trunc.bin)"
echo "@@GUEST trunc_touch=$(daxprobe mmap-truncated trunc.bin .trunc-ready .trunc-go)"
echo "@@GUEST trunc_alive=yes"
dd if=/dev/urandom of=/tmp/w bs=1M count=8 2>/dev/null
cp /tmp/w written.bin && sync
echo "@@GUEST written_md5=$(md5sum < /tmp/w | cut -d' ' -f1)"
echo "@@GUEST written_read_md5=$(md5sum < written.bin | cut -d' ' -f1)"
# Progress every minute (from /, so the mount is not kept busy); if none, what the guest's tasks are blocked on.
( cd /; last=-1; while sleep 60; do
    n=$(ls /mnt/tree-copy/d* 2>/dev/null | wc -l); echo "@@DIAG up=$(up) copied=$n"
    if [ "$n" = "$last" ]; then echo w > /proc/sysrq-trigger; dmesg | tail -60 | sed 's/^/@@DIAG /'; grep -i virtio /proc/interrupts | sed 's/^/@@DIAG /'; fi
    last=$n
  done ) &
WATCH=$!
t3=$(up); cp -a tree tree-copy; echo "@@GUEST cp_rc=$?"; t4=$(up)
kill $WATCH
echo "@@GUEST cp_s=$(secs $t3 $t4)"
echo "@@GUEST find_files=$(find tree-copy -type f | wc -l)"
mkdir /tmp/x && tar cf - tree | tar xf - -C /tmp/x; echo "@@GUEST tar_files=$(find /tmp/x/tree -type f | wc -l)"
echo "@@GUEST link=$(readlink tree-copy/link) $(cat tree-copy/link)"
mv small.txt moved.txt && mv moved.txt small.txt && ln small.txt hard.txt && echo "@@GUEST nlink=$(stat -c %h small.txt)"
rm hard.txt
mkdir newdir && rmdir newdir && echo "@@GUEST mkdir_rmdir=ok"
echo "@@GUEST df=$(df -k /mnt | tail -1 | awk '{print ($2 > 0)}')"
cd /; if [ -d /mnt/sub ]; then umount /mnt/sub; echo "@@GUEST umount_sub_rc=$?"; fi
umount /mnt; echo "@@GUEST umount_inode_rc=$?"
mount -t virtiofs share /mnt -o dax=always; echo "@@GUEST mount_always_rc=$?"
echo "@@GUEST statx_always=$(cd /mnt && daxprobe statx big.bin small.txt nodax/large.bin)"
echo "@@GUEST small=$(cat /mnt/small.txt)"
echo "@@GUEST large_md5_always=$(md5sum < /mnt/nodax/large.bin | cut -d' ' -f1)"
echo "@@GUEST huge_blksize=$(stat -c %o /mnt/huge/hp.bin)"
daxprobe mmap-fill /mnt/huge/hp.bin 0 2097152 77; echo "@@GUEST huge_msync_rc=$?"
umount /mnt/huge 2>/dev/null
umount /mnt; echo "@@GUEST umount_always_rc=$?"
echo "@@GUEST fuse_errors=$(dmesg | grep -i 'fuse\|virtio.fs\|virtiofs' | grep -ci 'error\|fail\|bug\|warn')"
"#;

/// Over MMIO the VM is described on the command line.
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn virtiofs_dax_over_mmio() {
    virtiofs_test("mmio", false);
}

/// Over PCI the VM is created, given its share and booted through the REST
/// API, paused and resumed while it reads a DAX file, the policy flipped through
/// `vm.dax-policy`, and metrics and events read while the guest works.
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn virtiofs_dax_over_pci() {
    virtiofs_test("pci", true);
}

fn virtiofs_test(transport: &str, api: bool) {
    let mut guest = Guest::new(&format!("virtiofs-{transport}"), GUEST_SCRIPT);
    // One vCPU: a 2-vCPU guest was once seen to stall before init under the
    // emulated host while the machine was loaded (see docs/testing.md); the
    // daemon's per-queue threads and the VMM's relay still run concurrently.
    guest.cpus = 1;
    guest.memory = "512M,shared=on".into();
    // virtiofs and fuse are built into the Debian cloud kernel.
    guest.guest_modules = vec!["virtio_mmio".into()];
    guest.guest_tools = vec![rig::tool("guest-tools", "daxprobe").expect("daxprobe")];
    guest.host_tools = vec![
        rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd"),
        rig::tool("guest-tools", "daxprobe").expect("daxprobe"),
    ];
    guest.host_files = vec![
        ImageFile {
            path: "policy.json".into(),
            perm: 0o644,
            data: POLICY.as_bytes().to_vec(),
        },
        ImageFile {
            path: "flipped.json".into(),
            perm: 0o644,
            data: FLIPPED_POLICY.as_bytes().to_vec(),
        },
    ];
    let (metrics, flip) = if api {
        (API_METRICS, API_FLIP)
    } else {
        ("true", CLI_FLIP)
    };
    // The API run starts the daemon as Kata does (a worker pool, submounts
    // announced) and puts a tmpfs inside the share; the other run keeps the
    // defaults (a thread per queue).
    let (submount, daemon_args) = if api {
        ("mkdir share/sub && mount -t tmpfs -o size=4m tmpfs share/sub && echo inside > share/sub/inner.txt", "--thread-pool-size=2 -o announce_submounts")
    } else {
        ("true", "")
    };
    guest.host_before = HOST_BEFORE
        .replace("DIRS", &DIRS.to_string())
        .replace("FILES", &FILES_PER_DIR.to_string())
        .replace("METRICS_CMD", metrics)
        .replace("FLIP_CMD", flip)
        .replace("SUBMOUNT_CMD", submount)
        .replace("DAEMON_ARGS", daemon_args);
    guest.host_after = HOST_AFTER.into();
    if api {
        guest.vmm_args = vec!["-v".into()];
        guest.api_script = Some(API_SCRIPT.replace("TRANSPORT", transport));
    } else {
        // The VM is described on the command line; the API socket beside it
        // tells the daemon where the window is (window-io passes).
        guest.vmm_args = vec![
            "-v".into(),
            "--api-socket".into(),
            "/tmp/api.sock".into(),
            "--fs".into(),
            format!("tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=32M,transport={transport},id=fs0,control_socket=/tmp/fs-control.sock"),
        ];
    }
    guest.timeout = std::time::Duration::from_secs(900);
    let (run, stalls) = rig::run_retrying_stall(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("insmod_failed"), None, "{tail}");
    assert_eq!(run.guest("mount_inode_rc"), Some("0"), "{tail}");
    assert!(
        run.guest("mount_inode_opts")
            .is_some_and(|o| o.contains("dax=inode")),
        "{tail}"
    );
    assert_eq!(
        run.guest("statx_inode"),
        Some("big.bin:1 target.bin:1 small.txt:0 nodax/large.bin:0 tree/d0/f0:0"),
        "the policy picks the DAX files\n{tail}"
    );
    // The daemon acknowledged generation 2; the next forced GETATTR saw the
    // new flags and Linux re-instantiated the inodes with DAX flipped.
    assert!(
        run.host("flip")
            .is_some_and(|f| f.starts_with("status=200") && f.contains("\"generation\":2")),
        "{tail}"
    );
    assert_eq!(
        run.guest("statx_flipped"),
        Some("big.bin:0 small.txt:1 target.bin:1"),
        "a live policy change; the adaptive default keeps the 96 MiB file off the 32 MiB window\n{tail}"
    );
    let big = run.host("big_md5").expect(&tail);
    assert_eq!(
        run.guest("big_md5"),
        Some(big),
        "96 MiB through a 32 MiB window, read()\n{tail}"
    );
    assert_eq!(
        run.guest("big_mmap_md5"),
        Some(big),
        "the same through mmap\n{tail}"
    );
    assert_eq!(run.guest("large_md5"), run.host("large_md5"), "{tail}");
    assert_eq!(run.guest("dd_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("mmap_fill_rc"), Some("0"), "{tail}");
    // A file cut from 4 MiB to 1 MiB on the host under a guest
    // process's DAX mapping: the vanished 3 MiB read zeros, the rest is
    // the file's, and the guest goes on.
    assert_eq!(run.guest("statx_trunc"), Some("trunc.bin:1"), "{tail}");
    assert_eq!(run.host("truncated_rc"), Some("0"), "{tail}");
    assert!(
        run.guest("trunc_touch")
            .is_some_and(|t| t.starts_with("zeros=768 data=256 ")),
        "{tail}"
    );
    assert_eq!(run.guest("trunc_alive"), Some("yes"), "{tail}");
    check_window_buffers(&run, &tail);
    assert!(
        run.text().contains("a mapped file shrank on the host"),
        "the VMM says what it repaired\n{tail}"
    );
    assert_eq!(
        run.host("target_md5"),
        run.guest("target_md5"),
        "DAX writes are in the host file\n{tail}"
    );
    assert_eq!(
        run.host("written_md5"),
        run.guest("written_md5"),
        "FUSE writes are in the host file\n{tail}"
    );
    assert_eq!(
        run.guest("written_read_md5"),
        run.guest("written_md5"),
        "{tail}"
    );
    let files = (DIRS * FILES_PER_DIR).to_string();
    assert_eq!(run.guest("cp_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("find_files"), Some(files.as_str()), "{tail}");
    assert_eq!(run.guest("tar_files"), Some(files.as_str()), "{tail}");
    assert_eq!(run.host("tree_copy"), Some("same"), "{tail}");
    assert_eq!(run.host("copy_link"), Some("../small.txt"), "{tail}");
    assert_eq!(run.guest("link"), Some("../small.txt small file"), "{tail}");
    assert_eq!(run.guest("nlink"), Some("2"), "{tail}");
    assert_eq!(run.guest("mkdir_rmdir"), Some("ok"), "{tail}");
    assert_eq!(run.guest("df"), Some("1"), "{tail}");
    assert_eq!(run.guest("umount_inode_rc"), Some("0"), "{tail}");
    let (workers, submount) = if api {
        ("2", Some("inside own-dev mounts:1"))
    } else {
        ("0", None)
    };
    assert_eq!(
        run.host("daemon_workers"),
        Some(workers),
        "--thread-pool-size\n{tail}"
    );
    // Both processes confined by default: every thread under a seccomp
    // filter with no_new_privs; no daemon process keeps CAP_SYS_ADMIN; the
    // one that serves is in a mount namespace of its own.
    let confined = run.host("confined_threads").expect(&tail);
    let (ok, total) = confined.split_once('/').expect(&tail);
    assert!(total.parse::<u32>().unwrap() > 4, "{confined}\n{tail}");
    assert_eq!(
        ok, total,
        "threads without Seccomp: 2 / NoNewPrivs: 1: {confined}\n{tail}"
    );
    let capeff = run.host("daemon_capeff").expect(&tail);
    for caps in capeff.split(' ') {
        let caps = u64::from_str_radix(caps, 16).expect(&tail);
        assert_eq!(
            caps & (1 << 21),
            0,
            "a daemon process holds CAP_SYS_ADMIN: {capeff}\n{tail}"
        );
    }
    assert!(
        run.host("daemon_mntns")
            .is_some_and(|n| n.split(' ').any(|n| n == "own")),
        "{tail}"
    );
    assert_eq!(
        run.guest("submount"),
        submount,
        "a host mount in the share is a guest submount\n{tail}"
    );
    if api {
        assert_eq!(run.guest("umount_sub_rc"), Some("0"), "{tail}");
    }
    assert_eq!(run.guest("mount_always_rc"), Some("0"), "{tail}");
    assert_eq!(
        run.guest("statx_always"),
        Some("big.bin:1 small.txt:1 nodax/large.bin:1"),
        "{tail}"
    );
    assert_eq!(run.guest("small"), Some("small file"), "{tail}");
    assert_eq!(
        run.guest("large_md5_always"),
        run.host("large_md5"),
        "{tail}"
    );
    // A file on a host tmpfs with 2 MiB pages: the guest is given the page
    // size as its block size, so a DAX mapping of it syncs (EIO before).
    assert_eq!(run.host("huge_blksize"), Some("2097152"), "{tail}");
    assert_eq!(run.guest("huge_blksize"), Some("4096"), "{tail}");
    assert_eq!(run.guest("huge_msync_rc"), Some("0"), "{tail}");
    assert_eq!(run.host("huge_filled"), Some("0"), "{tail}");
    assert_eq!(run.guest("umount_always_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("fuse_errors"), Some("0"), "{tail}");
    // MSI-X gives each queue's vector an irqfd the daemon writes itself;
    // virtio-MMIO's InterruptStatus register needs the VMM in the path.
    let interrupts = if transport == "pci" {
        "2 straight from the daemon (irqfd), 0 relayed"
    } else {
        "0 straight from the daemon (irqfd), 2 relayed"
    };
    assert!(
        run.text()
            .contains(&format!("fs fs0: queue interrupts: {interrupts}")),
        "{interrupts}\n{tail}"
    );
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    assert_eq!(
        run.host("daemon_exit"),
        Some("0"),
        "the daemon ends cleanly with its VMM\n{tail}"
    );
    if api {
        check_api_run(&run, &tail);
    }

    let mut results = Results::new(&format!("virtiofs-{transport}"));
    results.record_run(&format!("virtio-fs DAX over virtio-{transport}"), &run);
    results.record_stalls(&stalls);
    for (k, what) in [
        (
            "big_read_s",
            "md5sum of a 96 MiB DAX file through a 32 MiB window, s",
        ),
        ("big_mmap_s", "the same file copied through mmap, s"),
        ("cp_s", "cp -a of 2000 small files (no DAX), s"),
    ] {
        results.record(
            &format!("virtio-{transport}: {what}, guest clock"),
            run.guest(k).unwrap_or("n/a"),
        );
    }
    if api {
        results.record(
            &format!("virtio-{transport}: DAX metrics after the 96 MiB file (via vm.dax-metrics)"),
            run.host("metrics").unwrap_or("n/a"),
        );
        results.record(
            &format!("virtio-{transport}: vm.dax-events received during the run"),
            run.host("events").unwrap_or("n/a"),
        );
    }
    results.save().expect("write results");
}

/// What only the API run shows: the VM built through the API, the window's
/// maps and reclaim in the metrics, events streamed while the guest worked.
/// A program's read() into, and write() from, a DAX mapping of
/// another file. With O_DIRECT the guest's FUSE READ and WRITE name window
/// pages; the daemon (told where the window is by the VMM's API) serves them
/// through the file mapped there. Buffered, the guest's page cache sits
/// between and the daemon sees guest RAM; both must leave the same bytes.
fn check_window_buffers(run: &rig::Run, tail: &str) {
    assert_eq!(
        run.guest("wbuf_statx"),
        Some("wmap.bin:1 nodax/wsrc.bin:0"),
        "the buffer is a DAX mapping, the source is not DAX\n{tail}"
    );
    for pass in ["direct", "buffered"] {
        assert_eq!(
            run.guest(&format!("wbuf_{pass}")),
            Some("dax=1 read=262144 write=262144 match=1"),
            "{pass}\n{tail}"
        );
        assert_eq!(
            run.host(&format!("wbuf_out_{pass}")),
            Some("same"),
            "{pass}\n{tail}"
        );
        assert_eq!(
            run.host(&format!("wbuf_map_{pass}")),
            Some("same"),
            "{pass}\n{tail}"
        );
    }
    assert_eq!(
        run.host("wbuf_location"),
        Some("1"),
        "the daemon knows the window's place\n{tail}"
    );
    // "ios:N bytes:M refusals:R": the direct pass's READ and WRITE (the
    // guest may split each into several requests), nothing refused.
    let stats = run.host("wbuf_stats").unwrap_or_default();
    let field = |name: &str| -> u64 {
        stats
            .split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {stats:?}\n{tail}"))
    };
    assert!(field("ios") >= 2, "{stats}\n{tail}");
    assert_eq!(field("bytes"), 2 * 262144, "{stats}\n{tail}");
    assert_eq!(field("refusals"), 0, "{stats}\n{tail}");
}

fn check_api_run(run: &rig::Run, tail: &str) {
    for step in [
        "api_create",
        "api_add_fs",
        "api_boot",
        "api_pause",
        "api_resume",
    ] {
        assert!(
            run.host(step).is_some_and(|s| s.starts_with("status=204")),
            "{step}\n{tail}"
        );
    }
    // A device added before boot has a policy: its daemon's.
    assert!(
        run.host("api_policy_before_boot")
            .is_some_and(|s| s.contains("\"generation\":1")),
        "{tail}"
    );
    assert_eq!(run.host("api_paused_state"), Some("Paused"), "{tail}");
    assert_eq!(run.host("api_state"), Some("Running"), "resumed\n{tail}");
    let ticks = run.host("vcpu_ticks").expect(tail);
    assert!(
        !ticks.starts_with("running:0 "),
        "the vCPU was busy booting before the pause: {ticks}\n{tail}"
    );
    assert!(
        ticks.ends_with(" paused:0"),
        "a paused vCPU runs no guest code: {ticks}\n{tail}"
    );
    let metrics = run.host("metrics").expect(tail);
    let value = |key: &str| -> u64 {
        metrics
            .split(' ')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix(':')?.parse().ok())
            .unwrap_or_else(|| panic!("{key} missing from metrics: {metrics}\n{tail}"))
    };
    assert_eq!(value("window"), 32 << 20, "{metrics}");
    // 96 MiB read twice (read() and mmap) through 2 MiB ranges of a 32 MiB window.
    assert!(value("maps") >= 48, "{metrics}");
    assert!(
        value("unmaps") > 0,
        "the guest reclaimed ranges of the full window: {metrics}"
    );
    assert!(value("ranges") <= 16, "{metrics}");
    assert!(value("attrs_dax") > 0, "{metrics}");
    // Maps were pre-faulted: into KVM's page tables where the host's KVM
    // can (Linux 6.10+, as the emulated host's 6.12), else into the VMM's.
    // The file is read in order, so even while the guest reclaims ranges of
    // the full window most maps continue the one before and are pre-faulted.
    assert!(
        value("guest_prefaulted") + value("prefaulted") >= 24 * (2 << 20),
        "{metrics}"
    );
    assert_eq!(value("prefault_failures"), 0, "{metrics}");
    // The daemon timed every SETUPMAPPING's round trip to the VMM.
    assert!(value("roundtrips") >= 48, "{metrics}");
    // KVM's own counters come through: the guest ran and touched memory.
    assert!(value("kvm_exits") > 0, "{metrics}");
    assert!(value("kvm_page_faults") > 0, "{metrics}");
    assert!(value("kvm_pages_4k") > 0, "{metrics}");
    let events = run.host("events").expect(tail);
    let count = |kind: &str| -> u64 {
        events
            .split(' ')
            .find_map(|kv| kv.strip_prefix(kind)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(count("subscribed"), 1, "{events}");
    assert!(count("map") >= 48, "map events streamed: {events}");
    assert!(count("unmap") > 0, "{events}");
    assert_eq!(count("policy"), 1, "the flip: {events}");
    assert!(
        count("truncated") >= 1,
        "trunc.bin cut on the host, relayed as an event: {events}"
    );
    assert!(
        run.host("daemon_truncations")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n >= 1),
        "the API tells the daemon of the truncation\n{tail}"
    );
    assert!(
        count("adaptive") >= 1,
        "the adaptive decision for big.bin, relayed from the daemon: {events}"
    );
}

/// A DAX page whose file the host cut short, then read and written by a
/// forked child and by a new mapping (daxprobe mmap-truncated-rw). On the
/// host: the 8 MiB file goes to 4 KiB once the guest has touched its page
/// at 6 MiB; a minute on, what the VMM's threads wait on and how often KVM
/// retried an async page fault, for the log.
const TRUNC_RW_HOST: &str = r#"
mkdir -p share
dd if=/dev/urandom of=share/trw.bin bs=1M count=8 2>/dev/null
mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
echo 1 > /sys/kernel/tracing/events/kvm/kvm_try_async_get_page/enable 2>/dev/null
dax-virtiofsd --socket-path /tmp/fs.sock --shared-dir share --cache-size 32M --log-level warn &
DAEMON=$!
i=0; while [ ! -S /tmp/fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
( i=0; while [ ! -e share/.trw-ready ] && [ $i -lt 6000 ] && { [ $i -lt 300 ] || pidof dax-vmm >/dev/null; }; do sleep 0.1; i=$((i+1)); done
  truncate -s 4096 share/trw.bin; echo "@@HOST truncated_rc=$?"
  sleep 1
  touch share/.trw-go
  sleep 60
  for p in $(pidof dax-vmm); do
    for t in /proc/$p/task/*; do echo "@@DIAG thread=$(cat $t/comm) state=$(cut -d' ' -f3 $t/stat) wchan=$(cat $t/wchan)"; done
  done
  echo "@@DIAG async_pf_tries=$(grep -c kvm_try_async_get_page /sys/kernel/tracing/trace 2>/dev/null)" ) &
"#;

const TRUNC_RW_HOST_AFTER: &str = r#"
wait $DAEMON; echo "@@HOST daemon_exit=$?"
"#;

const TRUNC_RW_GUEST: &str = r#"
mkdir -p /mnt
mount -t virtiofs share /mnt -o dax=always; echo "@@GUEST mount_rc=$?"
cd /mnt
echo "@@GUEST statx=$(daxprobe statx trw.bin)"
daxprobe mmap-truncated-rw trw.bin 6291456 .trw-ready .trw-go | while read -r l; do echo "@@GUEST trw_$l"; done
echo "@@GUEST alive=yes"
cd /; umount /mnt; echo "@@GUEST umount_rc=$?"
"#;

/// After the host truncation the touching processes read zeros
/// or get SIGBUS, their writes complete or get SIGBUS, and the VM goes on
/// and powers off (a write once made the guest's fault set up a new,
/// writable mapping of the vanished range, which hung the vCPU in KVM).
#[test]
#[ignore = "boots real guests; run through scripts/test.sh"]
fn virtiofs_dax_truncated_then_written() {
    let mut guest = Guest::new("virtiofs-truncated-rw", TRUNC_RW_GUEST);
    guest.cpus = 1;
    guest.memory = "512M,shared=on".into();
    guest.guest_modules = vec!["virtio_mmio".into()];
    guest.guest_tools = vec![rig::tool("guest-tools", "daxprobe").expect("daxprobe")];
    guest.host_tools = vec![rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd")];
    guest.host_before = TRUNC_RW_HOST.into();
    guest.host_after = TRUNC_RW_HOST_AFTER.into();
    guest.vmm_args = vec![
        "-v".into(),
        "--fs".into(),
        "tag=share,socket=/tmp/fs.sock,num_queues=1,queue_size=1024,cache_size=32M,transport=mmio,id=fs0".into(),
    ];
    guest.timeout = std::time::Duration::from_secs(420);
    let run = rig::run(&guest).expect("rig run");
    let tail = run.tail(80);
    assert!(!run.timed_out, "{tail}");
    assert_eq!(run.guest("mount_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("statx"), Some("trw.bin:1"), "{tail}");
    assert_eq!(run.host("truncated_rc"), Some("0"), "{tail}");
    assert_eq!(run.guest("trw_touched"), Some("data"), "{tail}");
    for (step, allowed) in [
        ("fork_read", ["zeros", "sigbus"]),
        ("new_read", ["zeros", "sigbus"]),
        ("fork_write", ["wrote", "sigbus"]),
        ("new_write", ["wrote", "sigbus"]),
        ("reopen_read", ["zeros", "sigbus"]),
    ] {
        let got = run.guest(&format!("trw_{step}"));
        assert!(
            got.is_some_and(|g| allowed.contains(&g)),
            "{step}: {got:?}, expected one of {allowed:?}\n{tail}"
        );
    }
    assert_eq!(run.guest("alive"), Some("yes"), "{tail}");
    assert_eq!(run.guest("umount_rc"), Some("0"), "{tail}");
    assert_eq!(run.vmm_message(), Some("guest powered off"), "{tail}");
    assert_eq!(run.vmm_exit, Some(0), "{tail}");
    assert_eq!(run.host("daemon_exit"), Some("0"), "{tail}");
}
