#!/usr/bin/env bash
# The virtio-fs read benchmark: our daemon without and with DAX, and the Rust
# virtiofsd, in one rig run. Writes target/rig-results/virtiofs-bench.md.
# `bench.sh PHASE...` runs only those phases of it.
#
# Other benchmarks, one rig run each (docs/benchmarks.md):
#   bench.sh density     10 guests at once, each with its own daemon on one share,
#                        with and without DAX: host memory the reads cost
#                        (target/rig-results/density-bench.md)
#   bench.sh overhead    what a guest costs the host beyond its RAM: the VMM's and
#                        the daemon's own memory and threads, and vm.create to the
#                        guest's init, ours and, with BASELINE_VMM=/path/to/cloud-hypervisor
#                        and BASELINE_VIRTIOFSD=/path/to/virtiofsd (both static),
#                        Cloud Hypervisor with virtiofsd, alternating
#                        (target/rig-results/overhead-bench.md)
#   bench.sh windowcost  guest memory a DAX window costs at boot, per size
#                        (target/rig-results/window-cost.md)
#   bench.sh roundtrip   one SETUPMAPPING against one 4 KiB FUSE READ, in the
#                        guest, with the daemon's and the VMM's map latency,
#                        a touch of a mapped range's other page, and each
#                        thread's CPU time per operation
#                        (target/rig-results/roundtrip-bench.md);
#                        DAX_VMM_RIG_HOST_CPUS=2 gives the emulated host two
#                        CPUs; `bench.sh roundtrip floor` runs a measurement
#                        build of the daemon that answers the guest before the
#                        VMM's ack (unsafe: the least any asynchronous map could
#                        cost; target/rig-results/roundtrip-floor-bench.md)
#   bench.sh devices     virtio-blk (fio) and virtio-net (iperf3) throughput of
#                        the same guest under our VMM and, with
#                        BASELINE_VMM=/path/to/cloud-hypervisor, under Cloud
#                        Hypervisor, alternating (target/rig-results/devices-bench.md)
#   bench.sh kata-start  Kata runtime-rs's sandbox start, vm.create to the agent's
#                        answer, with where it goes, under our VMM and daemon and,
#                        with BASELINE_VMM=/path/to/cloud-hypervisor and
#                        BASELINE_VIRTIOFSD=/path/to/virtiofsd (both static), under
#                        Cloud Hypervisor and virtiofsd, alternating
#                        (target/rig-results/kata-start-bench.md);
#                        KATA_START_OURS_DAEMON_ARGS='--cache-size=64M' adds
#                        words to our daemon's command line only
#   bench.sh snapshot    a 1 GiB guest with a DAX share: vm.snapshot time and
#                        size, vm.restore time to Paused and to running, with
#                        the window idle and busy; local migration downtime
#                        (the longest stop of a heartbeat in guest RAM, read
#                        by the host) and vm.send-migration time, ours without
#                        DAX and with a busy window and, with
#                        BASELINE_VMM=/path/to/cloud-hypervisor (static), Cloud
#                        Hypervisor's without a share, alternating
#                        (target/rig-results/snapshot-bench.md)
#   bench.sh snapshot tcp
#                        live migration over TCP, twice per boot (the second of
#                        the VM that arrived): downtime (the guest's RAM heartbeat
#                        followed from the source VMM's memory to the
#                        destination's) and total time, ours with a busy DAX
#                        window and, with BASELINE_VMM=/path/to/cloud-hypervisor
#                        and BASELINE_VIRTIOFSD=/path/to/virtiofsd (both static),
#                        Cloud Hypervisor with virtiofsd without DAX, alternating
#                        (target/rig-results/migration-tcp-bench.md)
#   bench.sh fio         the seed's fio table: psync, libaio and mmap × seq and
#                        random reads and writes, 4 KiB blocks, 1 and 4 jobs, on
#                        our daemon with and without DAX, the guest's tmpfs and,
#                        with BASELINE_VMM=/path/to/cloud-hypervisor and
#                        BASELINE_VIRTIOFSD=/path/to/virtiofsd (both static),
#                        Cloud Hypervisor + virtiofsd --cache=never, on 4 KiB and
#                        2 MiB host pages; what fsync/msync cost after a write;
#                        and parallel reads on 2 request queues against 1 and
#                        virtiofsd (target/rig-results/fio-bench.md);
#                        FIO_BENCH_ROUNDS=2 runs every boot twice; `bench.sh fio
#                        ours|ch|mq...` runs only those boots;
#                        FIO_BENCH_WINDOW=MIB sets our DAX window (512);
#                        FIO_BENCH_JOBS=randread_psync_1,... runs only those
#                        jobs; around each DAX job the VMM's counters are
#                        noted (maps, pre-faults, KVM page faults)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
# The VMM, the daemon and the guest tools as released (thin LTO), not the
# tests' quicker `rig` profile: what is measured is what users run.
export DAX_VMM_RIG_PROFILE="${DAX_VMM_RIG_PROFILE:-release}"
# virtiofsd is built static with cargo install; it links libseccomp and libcap-ng.
if ! [ -e /usr/lib/x86_64-linux-gnu/libseccomp.a ] || ! [ -e /usr/lib/x86_64-linux-gnu/libcap-ng.a ]; then
    apt-get install -y --no-install-recommends libseccomp-dev libcap-ng-dev
fi
case "${1:-}" in
    devices)
        # Debian's, copied into the guests with their shared libraries.
        command -v fio >/dev/null && command -v iperf3 >/dev/null ||
            $([ "$(id -u)" -eq 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends fio iperf3
        exec cargo run --release --locked -q -p dax-bench --bin bench-devices ;;
    fio)
        command -v fio >/dev/null ||
            $([ "$(id -u)" -eq 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends fio
        exec cargo run --release --locked -q -p dax-bench --bin bench-fio -- "${@:2}" ;;
    density | windowcost) exec cargo run --release --locked -q -p dax-bench --bin bench-density -- "$1" ;;
    overhead) exec cargo run --release --locked -q -p dax-bench --bin bench-overhead ;;
    roundtrip) exec cargo run --release --locked -q -p dax-bench --bin bench-roundtrip -- "${@:2}" ;;
    kata-start) exec cargo run --release --locked -q -p dax-bench --bin bench-kata-start ;;
    snapshot) exec cargo run --release --locked -q -p dax-bench --bin bench-snapshot -- "${@:2}" ;;
esac
exec cargo run --release --locked -q -p dax-bench --bin bench-virtiofs -- "$@"
