#!/usr/bin/env bash
# Installs what the build, the demo and the guest rig need on a fresh Debian
# machine. Safe to run again: it installs only what is missing.
set -euo pipefail

# prometheus: its promtool checks the metrics the API serves; socat bridges
# the API socket to TCP for the OpenAPI fuzzer (scripts/api-fuzz.sh);
# protobuf-compiler: dax-fleet's etcd client compiles etcd's protos at build
# time; etcd-server: the real etcd the fleet tests start.
packages=(qemu-system-x86 busybox-static cpio xz-utils e2fsprogs prometheus socat protobuf-compiler etcd-server)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

# The rig downloads the guest kernel with apt-get download, which needs
# current package lists; refresh them when they are missing or stale.
if [ ${#missing[@]} -gt 0 ] || [ -z "$(apt-cache pkgnames linux-image-6.12. 2>/dev/null | head -1)" ] \
    || [ -n "${DAX_VMM_APT_UPDATE:-}" ]; then
    $sudo apt-get update -q
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-host: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

command -v cargo >/dev/null || { echo "setup-host: cargo is required (https://rustup.rs)" >&2; exit 1; }
rustup target list --installed 2>/dev/null | grep -q x86_64-unknown-linux-gnu \
    || rustup target add x86_64-unknown-linux-gnu
