#!/usr/bin/env bash
# Fuzzes every parser a guest, a daemon or an API client reaches, with
# libFuzzer on the stable toolchain: the targets are built with LLVM's
# SanitizerCoverage passes (stable -C flags; libfuzzer-sys documents this
# use without cargo-fuzz) and run for a number of executions each.
#
#   scripts/fuzz.sh [RUNS] [TARGET...]     RUNS defaults to 1000000
#
# Each target's corpus lives in fuzz/corpus/<target> (kept between runs);
# crashes are written to fuzz/artifacts/<target>/ and fail the script.
# Results (executions, time, coverage, corpus size) go to
# target/fuzz-results.md.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-1000000}"
shift || true
all=(fuse_server descriptor_chain dax_window mmio_transport pci_transport pmem_queue blk_request policy vm_config api_router
     backend_requests daemon_replies fuse_dax pci_root serial fleet_policy vsock_backend vsock_queues net_queues blk_queue migration_protocol migration_memory
     daemon_state_load)
targets=("${@:-${all[@]}}")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# Its own target directory: instrumented builds must not mix with normal ones.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_FUZZ:-$PWD/target/fuzz}"
cargo build --release --locked --manifest-path fuzz/Cargo.toml --bins --target x86_64-unknown-linux-gnu
bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release"

results=target/fuzz-results.md
mkdir -p target
{
    echo "# Fuzzing: $(date -u +%Y-%m-%dT%H:%MZ), $runs executions per target"
    echo
    echo "| target | executions | seconds | coverage (edges) | corpus | result |"
    echo "|---|---|---|---|---|---|"
} > "$results"
failed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    log="target/fuzz-$t.log"
    seeds=""
    [ -d "fuzz/seeds/$t" ] && seeds="fuzz/seeds/$t"
    start=$(date +%s)
    set +e
    "$bin/$t" -runs="$runs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="fuzz/artifacts/$t/" "fuzz/corpus/$t" $seeds > "$log" 2>&1
    rc=$?
    set -e
    secs=$(( $(date +%s) - start ))
    done_line=$(grep -E '^#[0-9]+\s+DONE' "$log" | tail -1 || true)
    execs=$(echo "$done_line" | sed -n 's/^#\([0-9]*\).*/\1/p')
    cov=$(echo "$done_line" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
    corpus=$(ls "fuzz/corpus/$t" | wc -l)
    if [ $rc -eq 0 ] && [ -n "$execs" ]; then result=ok; else result="FAILED (exit $rc, see $log)"; failed=1; fi
    echo "| $t | ${execs:-?} | $secs | ${cov:-?} | $corpus | $result |" >> "$results"
    echo "fuzz: $t: ${execs:-?} executions in ${secs}s: $result"
    [ $rc -eq 0 ] || tail -30 "$log"
done
cat "$results"
exit $failed
