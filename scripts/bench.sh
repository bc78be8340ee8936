#!/usr/bin/env bash
# The virtio-fs read benchmark: our daemon without and with DAX, and the Rust
# virtiofsd, in one rig run. Writes target/rig-results/virtiofs-bench.md.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-host.sh
# virtiofsd is built static with cargo install; it links libseccomp and libcap-ng.
if ! [ -e /usr/lib/x86_64-linux-gnu/libseccomp.a ] || ! [ -e /usr/lib/x86_64-linux-gnu/libcap-ng.a ]; then
    apt-get install -y --no-install-recommends libseccomp-dev libcap-ng-dev
fi
exec cargo run --release --locked -q -p guest-tests --bin bench-virtiofs -- "$@"
