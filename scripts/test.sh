#!/usr/bin/env bash
# All tests: unit tests of every crate, then the guest tests, which boot real
# guests through the rig (nested KVM under QEMU where the host has no vmx/svm).
# Each phase and each guest test prints how long it took, and a summary of
# all of them comes last (printed, never checked: docs/testing.md).
set -euo pipefail
# The guest tests' times, read at the end of a pipe, stay in this shell.
shopt -s lastpipe
cd "$(dirname "$0")/.."

timings=()
# `phase NAME COMMAND...`: runs COMMAND and prints how long it took.
phase() {
    local name=$1 start=$EPOCHREALTIME
    shift
    "$@"
    record "$name" "$start"
}
# `record NAME START`: the time since START (an $EPOCHREALTIME), printed and kept.
record() {
    local secs disk
    secs=$(awk -v a="$2" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    disk=$({ du -sh target 2>/dev/null || true; } | cut -f1)
    echo "test.sh: $1: $secs s (target/: ${disk:-none}; free: $(free_disk))"
    timings+=("| $1 | $secs | ${disk:-none} |")
}
# Free space where the build writes: a full disk shows up as a linker's bus
# error, so the summary says how much was left.
free_disk() {
    df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' '
}
# libtest's lines, passed on with each test's time. With one test thread a
# test's line ends when it does, so the time since the previous line is its
# own (the first includes what the rig sets up once: the guest kernel).
time_tests() {
    local line last=$EPOCHREALTIME
    while IFS= read -r line; do
        case $line in
            "test "*" ... "*)
                echo "$line"
                record "guest test ${line#test }" "$last"
                last=$EPOCHREALTIME ;;
            *) echo "$line" ;;
        esac
    done
}
# The rig's static builds, made as a test makes them (then a no-op there),
# once up front so the tests that need them, on the host too, do not pay for
# them.
rig_build() {
    cargo run --locked -q -p test-infra --bin rig-build -- \
        vmm:dax-vmm daemon:dax-virtiofsd guest-tools:daxprobe guest-tools:sleep fleet:dax-fleet
}
# The summary, also when a phase fails.
summary() {
    echo
    echo "== test.sh: time per phase ($(nproc) CPUs; load average $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end) =="
    echo
    echo "free disk at the end: $(free_disk)"
    echo
    echo "| phase | seconds | target/ after it |"
    echo "|---|---|---|"
    record "whole run" "$started" >/dev/null
    printf '%s\n' "${timings[@]}"
}
# A CI build is never rebuilt incrementally: the incremental caches would only
# take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
started=$EPOCHREALTIME
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
trap summary EXIT

phase "setup (setup-host.sh)" scripts/setup-host.sh
# Habits: formatted, no clippy warning (workspace lints deny an unsafe block
# without a SAFETY comment). rustfmt and clippy come with the toolchain;
# where rustup cannot add them (no network) the check says so loudly.
check_fmt() {
    cargo fmt --all --check
    cargo fmt --manifest-path fuzz/Cargo.toml --check
}
if cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt >/dev/null 2>&1; then
    phase "fmt" check_fmt
else
    echo "test.sh: WARNING: rustfmt is not installed; formatting not checked" >&2
fi
check_clippy() {
    cargo clippy --workspace --tests --benches --locked -- -D warnings
    # The daemon's measurement build (`bench.sh roundtrip floor`), so its
    # code is checked too though no test runs it.
    cargo clippy -p daemon --features bench-unacked-maps --locked -- -D warnings
    # In the workspace's target directory: the fuzz workspace locks the same
    # versions, so its dependencies' checks are the ones just made.
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" \
        cargo clippy --manifest-path fuzz/Cargo.toml --bins --locked -- -D warnings
}
if cargo clippy --version >/dev/null 2>&1 || rustup component add clippy >/dev/null 2>&1; then
    phase "clippy (workspace and fuzz)" check_clippy
else
    echo "test.sh: WARNING: clippy is not installed; lints not checked" >&2
fi
phase "rig build (static VMM, daemon, guest tools, dax-fleet)" rig_build
phase "cargo test --workspace (build)" cargo test --workspace --locked --no-run
phase "cargo test --workspace (run)" cargo test --workspace --locked
# A short run of every fuzz target (scripts/fuzz.sh runs them for real).
phase "fuzz smoke (build and run)" scripts/fuzz.sh "${DAX_VMM_FUZZ_SMOKE_RUNS:-20000}"
# Requests generated from docs/openapi.yaml against the real API (schemathesis).
phase "api-fuzz" scripts/api-fuzz.sh 30
# Guest tests share the machine's cores: one at a time.
guest_start=$EPOCHREALTIME
cargo test --locked -p guest-tests -- --ignored --test-threads=1 | time_tests
record "guest tests (all)" "$guest_start"
echo
echo "== rig measurements (target/rig-results) =="
cat target/rig-results/*.md
cat target/fuzz-results.md
