#!/usr/bin/env bash
# Generates requests from docs/openapi.yaml with schemathesis and sends them
# to a real dax-vmm (API only; no guest) with a created VM whose fs device
# has a real daemon and control socket, over a TCP bridge (socat) to the
# API's unix socket, with every check of schemathesis on (-c all). Fails on
# any server error not by design, any status code or body the document does
# not describe, any schema-valid request refused or schema-violating one
# accepted, and if the VMM stops answering.
#
#   scripts/api-fuzz.sh [MAX_EXAMPLES]     default 30 per operation
set -euo pipefail
cd "$(dirname "$0")/.."

examples="${1:-30}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
command -v socat >/dev/null || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends socat
venv="${XDG_CACHE_HOME:-$HOME/.cache}/dax-vmm/schemathesis-venv"
if ! [ -x "$venv/bin/st" ]; then
    python3 -m venv "$venv" 2>/dev/null || { DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q python3-venv; python3 -m venv "$venv"; }
    "$venv/bin/pip" install -q "schemathesis==4.32.5"
fi

cargo build --locked -q -p vmm -p daemon
# Where cargo put them: CARGO_TARGET_DIR when set, as cargo reads it.
target="${CARGO_TARGET_DIR:-target}"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
mkdir "$work/share"
echo data > "$work/share/file"
"$target/debug/dax-virtiofsd" --socket-path "$work/fs.sock" --shared-dir "$work/share" --sandbox none \
    --cache-size 64M --control-socket "$work/fs-control.sock" --log-level error &
pids+=($!)
"$target/debug/dax-vmm" --api-socket "$work/api.sock" 2>"$work/vmm.log" &
vmm=$!
pids+=($vmm)
for _ in $(seq 100); do [ -S "$work/api.sock" ] && [ -S "$work/fs-control.sock" ] && break; sleep 0.1; done
port=$((20000 + RANDOM % 20000))
socat "TCP-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork" "UNIX-CONNECT:$work/api.sock" &
pids+=($!)
sleep 0.5
api() { curl -s -o /dev/null -w '%{http_code}' -X "$1" "http://127.0.0.1:$port/api/v1/$2" ${3:+-d "$3"}; }
# The VM the operations are about; fuzz/api/hooks.py creates it again
# after each fuzzed vm.create.
create='{"payload":{"kernel":"/nonexistent"},"memory":{"size":268435456,"shared":true}}'
add_fs='{"tag":"share","socket":"'"$work/fs.sock"'","id":"fs0","cache_size":67108864,"control_socket":"'"$work/fs-control.sock"'"}'
echo "create: $(api PUT vm.create "$create")"
echo "add-fs: $(api PUT vm.add-fs "$add_fs")"
export API_FUZZ_URL="http://127.0.0.1:$port/api/v1"
API_FUZZ_BASELINE="$(python3 -c 'import json,sys; print(json.dumps([["vm.create", sys.argv[1]], ["vm.add-fs", sys.argv[2]]]))' "$create" "$add_fs")"
export API_FUZZ_BASELINE
export SCHEMATHESIS_HOOKS=fuzz/api/hooks.py

# The request timeout is above the VMM's own bound on a daemon that does
# not answer (10 s): a vm.boot that connects while the script's daemon is
# still exiting gets the VMM's 500 naming that timeout, not a client-side
# timeout (seen once on a loaded machine).
# Not generated: vmm.shutdown ends the VMM; vm.dax-events streams for ever;
# vm.delete would remove the VM the other operations are about.
set +e
# Every check runs (-c all); the 5xx answers by design and the constraints
# the document cannot state: fuzz/api/schemathesis.toml and fuzz/api/hooks.py.
"$venv/bin/st" --config-file fuzz/api/schemathesis.toml run docs/openapi.yaml --url "http://127.0.0.1:$port/api/v1" \
    --max-examples "$examples" --workers 1 --seed 1 -c all --request-timeout 30 \
    --exclude-path /vmm.shutdown --exclude-path /vm.dax-events --exclude-path /vm.delete \
    --report junit --report-dir "$target/api-fuzz"
rc=$?
set -e
if ! kill -0 "$vmm" 2>/dev/null; then
    echo "api-fuzz: the VMM died" >&2
    tail -20 "$work/vmm.log" >&2
    exit 1
fi
echo "api-fuzz: ping after the run: $(api GET vmm.ping)"
exit $rc
