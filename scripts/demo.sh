#!/usr/bin/env bash
# The demo: builds dax-vmm, boots a guest with 2 vCPUs through the rig and
# prints what the guest found. Extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
# The VMM, the daemon and the guest tools as released (thin LTO), not the
# tests' quicker `rig` profile: what is measured is what users run.
export DAX_VMM_RIG_PROFILE="${DAX_VMM_RIG_PROFILE:-release}"
exec cargo run --release --locked -q -p dax-bench --bin demo -- "$@"
