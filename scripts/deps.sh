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
  # cargo (crates.io) and pip (pip.conf's cert=) read the CA bundle itself; today it
  # only arrives as a dependency of python3-pip.
  "test -f /etc/ssl/certs/ca-certificates.crt|ca-certificates"
  # tandem up and the tests exec kill(1) (a minimal Debian has only the shell builtin).
  "type -P kill|procps"
  "command -v flock|util-linux"
  "command -v protoc|protobuf-compiler"
  # etcd-client's build script (and ours) import google/protobuf/*.proto; Debian ships the
  # well-known protos in libprotobuf-dev, which protobuf-compiler does not pull in.
  "test -f /usr/include/google/protobuf/descriptor.proto|libprotobuf-dev"
  "command -v etcd && command -v etcdctl|etcd-server"
  "command -v etcdctl|etcd-client"
  "command -v ip|iproute2"
  "command -v iptables|iptables"
  "command -v tc|iproute2"
  # promtool checks and unit-tests deploy/prometheus (tandem/tests/deploy.rs); the package
  # also brings the prometheus server, which the cluster test of the rules runs itself.
  "command -v promtool && command -v prometheus|prometheus"
  # The ucx KV transport: ucx-sys runs bindgen over <ucp/api/ucp.h> (libclang) and links
  # libucp; ucx_perftest (ucx-utils) is the ucx bench's baseline.
  "test -f /usr/include/ucp/api/ucp.h && pkg-config --exists ucx|libucx-dev"
  "ls /usr/lib/llvm-*/lib/libclang.so|libclang-dev"
  # The file the package installs, not any ucx_perftest on PATH (a source build of UCX
  # in /usr/local may be another version than the libucp the binding links).
  "test -x /usr/bin/ucx_perftest|ucx-utils"
  # make image packs the OCI images with umoci; tandem/tests/image.rs runs them with runc.
  # objcopy (binutils, from build-essential) strips the binaries' line tables.
  "command -v umoci|umoci"
  "command -v runc|runc"
  # build-image.sh labels the image with its commit and image.rs checks it: git.
  "command -v git|git"
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
# Debian's prometheus postinst starts and enables a server on :9090. We only want the
# binaries: deny service starts during the install (policy-rc.d, when none is there
# already), and disable the unit afterwards on a systemd host.
if [[ " ${missing[*]} " == *" prometheus "* && ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt_install "${missing[@]}"
if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
  systemctl disable --now prometheus.service >&2 || true
fi
