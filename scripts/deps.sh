#!/usr/bin/env bash
# Install the system packages the build, tests and scripts need (Debian, as root).
# Idempotent and fast: when every tool is already present, apt is not touched.
# The Rust toolchain (cargo, rustc) and cargo-nextest are expected to be installed.
set -euo pipefail

LOG_PREFIX=deps
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# "probe package": the package is needed when the probe (a shell test) fails.
# Add a line here when the project starts needing a new system tool.
readonly NEEDS=(
  "command -v cc && command -v c++ && command -v make|build-essential"
  "command -v pkg-config|pkg-config"
  "command -v python3|python3"
  "python3 -m pip --version|python3-pip"
  "command -v sha256sum|coreutils"
  "command -v flock|util-linux"
  "command -v protoc|protobuf-compiler"
  "command -v etcd && command -v etcdctl|etcd-server"
  "command -v etcdctl|etcd-client"
  "command -v ip|iproute2"
  "command -v iptables|iptables"
)

missing=()
for entry in "${NEEDS[@]}"; do
  probe="${entry%|*}"
  pkg="${entry##*|}"
  if ! bash -c "$probe" >/dev/null 2>&1; then
    missing+=("$pkg")
  fi
done

command -v cargo >/dev/null || log "warning: cargo not found; install the Rust toolchain (rustup)"

if [[ ${#missing[@]} == 0 ]]; then
  log "all system dependencies present"
  exit 0
fi
apt_install "${missing[@]}"
