#!/usr/bin/env bash
# All tests: unit tests of every crate, then the guest tests, which boot real
# guests through the rig (nested KVM under QEMU where the host has no vmx/svm).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
# Habits: formatted, no clippy warning (workspace lints deny an unsafe block
# without a SAFETY comment). rustfmt and clippy come with the toolchain;
# where rustup cannot add them (no network) the check says so loudly.
if cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt >/dev/null 2>&1; then
    cargo fmt --all --check
    cargo fmt --manifest-path fuzz/Cargo.toml --check
else
    echo "test.sh: WARNING: rustfmt is not installed; formatting not checked" >&2
fi
if cargo clippy --version >/dev/null 2>&1 || rustup component add clippy >/dev/null 2>&1; then
    cargo clippy --workspace --tests --benches --locked -- -D warnings
    cargo clippy --manifest-path fuzz/Cargo.toml --bins --locked -- -D warnings
else
    echo "test.sh: WARNING: clippy is not installed; lints not checked" >&2
fi
cargo test --workspace --locked
# A short run of every fuzz target (scripts/fuzz.sh runs them for real).
scripts/fuzz.sh "${DAX_VMM_FUZZ_SMOKE_RUNS:-20000}"
# Requests generated from docs/openapi.yaml against the real API (schemathesis).
scripts/api-fuzz.sh 30
# Guest tests share the machine's cores: one at a time.
cargo test --locked -p guest-tests -- --ignored --test-threads=1
echo
echo "== rig measurements (target/rig-results) =="
cat target/rig-results/*.md
cat target/fuzz-results.md
