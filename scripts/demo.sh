#!/usr/bin/env bash
# The demo: builds dax-vmm, boots a guest with 2 vCPUs through the rig and
# prints what the guest found. Extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
exec cargo run --release --locked -q -p dax-bench --bin demo -- "$@"
