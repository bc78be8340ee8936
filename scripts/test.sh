#!/usr/bin/env bash
# All tests: unit tests of every crate, then the guest tests, which boot real
# guests through the rig (nested KVM under QEMU where the host has no vmx/svm).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
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
