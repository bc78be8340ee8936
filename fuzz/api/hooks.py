"""schemathesis hooks for scripts/api-fuzz.sh (every check on: `-c all`).

1. vm.create is fuzzed against a VMM with no VM: before each call the VM is
   deleted, and after it the VM the other operations are about is created
   again (the script's own vm.create and vm.add-fs, in API_FUZZ_BASELINE).
   Without this every vm.create but the script's answers 409 and its body
   is never checked against the document.

2. A schema-valid request refused for a constraint OpenAPI 3.0 cannot state
   (one between two fields, or on the VM's state) is not a failure — only
   when the server's message names that constraint and the request does
   break it. Each is also stated in the document's descriptions:
   - a DAX policy's adaptive.pressure_low above its pressure_high (defaults
     75% and 50%), and a rule's min_size above its max_size (vm.dax-policy,
     and the dax_policy of vm.add-fs and of vm.create's fs devices);
   - a vsock socket path over the byte limit while within maxLength, which
     counts characters;
   - vm.create's memory.size plus memory.hotplug_size over 512G, its
     cpus.boot_vcpus above max_vcpus, a cpus.topology whose product is not
     max_vcpus;
   - vm.resize's desired_vcpus above the VM's max_vcpus (the script's VM
     has 1), or a desired_ram the VM's memory cannot take.
   - vm.restore's net_fds: the fds it counts are sent as SCM_RIGHTS, which
     the fuzzer's HTTP client cannot send, and each device is named once.
"""

import json
import os
import re

import requests
import schemathesis

BASE = os.environ["API_FUZZ_URL"]
BASELINE = json.loads(os.environ["API_FUZZ_BASELINE"])
# vmm/src/config/vsock.rs MAX_SOCKET_PATH
VSOCK_SOCKET_BYTES = 96
# vmm/src/config: guest RAM, hot-pluggable part included
MAX_RAM = 512 << 30
# The script's VM: cpus left out, so boot_vcpus = max_vcpus = 1.
FUZZ_VM_MAX_VCPUS = 1

# policies/src/parse.rs parse_size: bytes, or a number with K, M, G or T
# in either case.
_SIZE = re.compile(r"^\s*([0-9]+)([KMGTkmgt]?)\s*$")


def _is_create(case):
    return case.operation.method.upper() == "PUT" and case.operation.path == "/vm.create"


def _restore_baseline():
    requests.put(f"{BASE}/vm.delete", timeout=30)
    for endpoint, body in BASELINE:
        r = requests.put(f"{BASE}/{endpoint}", data=body, timeout=30)
        if r.status_code != 204:
            raise RuntimeError(f"api-fuzz: restoring the VM: {endpoint}: {r.status_code} {r.text}")


@schemathesis.hook
def before_call(context, case, kwargs):
    if _is_create(case):
        requests.put(f"{BASE}/vm.delete", timeout=30)


@schemathesis.hook
def after_call(context, case, response):
    if _is_create(case):
        _restore_baseline()


def _size(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    m = _SIZE.match(str(v))
    if not m:
        return None
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]


def _percent(v):
    try:
        return int(str(v).rstrip("%"))
    except ValueError:
        return None


def _policy_breaks(doc):
    """The cross-field rules a policy document breaks, as the server names them."""
    if not isinstance(doc, dict):
        return []
    broken = []
    adaptive = doc.get("adaptive")
    if isinstance(adaptive, dict):
        high = _percent(adaptive.get("pressure_high", 75))
        low = _percent(adaptive.get("pressure_low", 50))
        if high is not None and low is not None and low > high:
            broken.append("must not be above pressure_high")
    for rule in doc.get("rules") or []:
        if isinstance(rule, dict) and "min_size" in rule and "max_size" in rule:
            lo, hi = _size(rule["min_size"]), _size(rule["max_size"])
            if lo is not None and hi is not None and lo > hi:
                broken.append("is larger than max_size")
    return broken


def _breaks(case):
    """Constraints the document cannot state that this request breaks."""
    path, body = case.operation.path, case.body
    if not isinstance(body, dict):
        return []
    if path == "/vm.dax-policy":
        return _policy_breaks(body)
    if path == "/vm.add-fs":
        return _policy_breaks(body.get("dax_policy"))
    if path == "/vm.create":
        broken = [b for fs in body.get("fs") or [] if isinstance(fs, dict)
                  for b in _policy_breaks(fs.get("dax_policy"))]
        cpus = body.get("cpus")
        if isinstance(cpus, dict) and isinstance(cpus.get("boot_vcpus"), int):
            boot = cpus["boot_vcpus"]
            top = cpus.get("max_vcpus")
            top = top if isinstance(top, int) else boot
            if boot > top:
                broken.append("at most max=")
            t = cpus.get("topology")
            if isinstance(t, dict):
                parts = [t.get(k) for k in ("threads_per_core", "cores_per_die",
                                            "dies_per_package", "packages")]
                if all(isinstance(p, int) for p in parts):
                    product = parts[0] * parts[1] * parts[2] * parts[3]
                    if product != top:
                        broken.append("expected parts whose product")
        memory = body.get("memory")
        if isinstance(memory, dict) and isinstance(memory.get("hotplug_size"), int):
            if memory.get("size", 0) + memory["hotplug_size"] > MAX_RAM:
                broken.append("size plus hotplug_size at most 512G")
        return broken
    if path == "/vm.restore":
        # The fds net_fds counts travel as SCM_RIGHTS, which no HTTP
        # client of the fuzzer sends; and each device is named once.
        if isinstance(body.get("net_fds"), list) and body["net_fds"]:
            return ["file descriptor(s) came with the request", "each net device named once"]
    if path == "/vm.add-vsock":
        socket = body.get("socket")
        if isinstance(socket, str) and len(socket.encode()) > VSOCK_SOCKET_BYTES:
            return ["a unix socket path of 1 to"]
    if path == "/vm.resize":
        broken = []
        vcpus = body.get("desired_vcpus")
        if isinstance(vcpus, int) and vcpus > FUZZ_VM_MAX_VCPUS:
            broken.append("is above max_vcpus")
        if body.get("desired_ram") is not None:
            broken.append("desired_ram: ")
        return broken
    return []


@schemathesis.hook
def filter_failure(context, failure, case, response):
    """False drops the failure: see 2. above."""
    if getattr(failure, "code", None) != "ST202" or response.status_code != 400:
        return True
    text = response.content.decode(errors="replace")
    return not any(reason in text for reason in _breaks(case))
