#!/usr/bin/env bash
# Runs the virtio-fs guest tests (both transports) ROUNDS times in a row and
# records each guest run: wall time, and whether it stalled (the rig retries
# a stalled run once and counts it). Writes target/rig-results/soak.md.
#
#   scripts/rig-soak.sh [ROUNDS]      (default 15 rounds = 30 guest runs)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-15}
out=target/rig-results/soak.md
mkdir -p target/rig-results
cargo build --locked -p guest-tests --tests >/dev/null 2>&1 || true
{
  echo "# rig soak: virtio-fs guest tests, $rounds rounds, $(date -u +%FT%TZ)"
  echo
  echo "| round | transport | wall time (s) | stalled and retried | result |"
  echo "|---|---|---|---|---|"
} > "$out"
runs=0; stalled=0; failed=0
for i in $(seq 1 "$rounds"); do
  log=target/rig-results/soak-$i.log
  if cargo test --locked -p guest-tests -- --ignored --test-threads=1 virtiofs:: > "$log" 2>&1; then
    result=ok
  else
    result=FAILED; failed=$((failed + 1))
  fi
  for t in mmio pci; do
    f=target/rig-results/virtiofs-$t.md
    wall=$(sed -n 's/.*wall time (whole run) | \([0-9.]*\) s |/\1/p' "$f")
    st=$(sed -n 's/| stalled runs retried | \([0-9]*\) |/\1/p' "$f")
    runs=$((runs + 1)); stalled=$((stalled + ${st:-0}))
    echo "| $i | $t | ${wall:-?} | ${st:-?} | $result |" >> "$out"
  done
  echo "soak: round $i/$rounds: $result"
done
{
  echo
  echo "$runs guest runs, $stalled stalled (retried), $failed rounds failed."
} >> "$out"
cat "$out"
[ "$failed" -eq 0 ]
