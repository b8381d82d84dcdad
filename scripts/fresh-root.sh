#!/usr/bin/env bash
# fresh-root.sh — prove the README's two commands (`make run`, `make test`) work
# on a truly fresh Debian machine whose only prerequisites are the Rust toolchain
# (with cargo-nextest) and make itself.
#
#   scripts/fresh-root.sh            (or: make fresh-check)
#
# CI's machine keeps whatever was ever installed on it by hand, which once hid a
# missing libprotobuf-dev. This script builds a minimal Debian root
# (debootstrap --variant=minbase, plus make and curl, the check's own tool), mounts
# the host's Rust toolchain read-only into it (an empty CARGO_HOME, so the crate
# registry starts empty), copies a clean clone of HEAD to /src/tandem and, as
# root inside it: `make run` (which installs what it needs through
# scripts/deps.sh) until the cluster is ready, one chat request with curl,
# Ctrl-C, then `make test` (.ci/run). A package the project forgot to install
# fails here; the fix belongs in scripts/deps.sh.
#
# Everything runs in a private mount namespace, so the root's /proc, /sys, /dev,
# /run, /tmp and toolchain mounts vanish when it ends, even on failure. The host's
# network is shared (apt, PyPI, crates.io); the cluster gets free ports. Runs as
# root on Debian; installs debootstrap on the host when missing.
#
# Prints the wall time of each step at the end and exits non-zero at the first
# failing step, after printing the last 40 lines of its log.
#
# Environment:
#   FRESH_STEPS    all (default): make run + chat + stop, then make test;
#                  run: stop after the chat request (and Ctrl-C);
#                  test: make test only; setup: only build the root and mount.
#   FRESH_SUITE    Debian suite (default bookworm); the mirror is the host's own
#                  apt source for it.
#   KEEP_ROOT=1    keep the root directory afterwards (deleted by default).
#   FRESH_LOGS     where the logs go (default $TANDEM_CACHE/fresh-check/<time>).
#   FRESH_TMP      where the root is made (default ${TMPDIR:-/var/tmp}).
#   FRESH_RUN_TIMEOUT / FRESH_TEST_TIMEOUT   seconds for `make run` to become ready
#                  (default 2400, it builds cold) and for `make test` (default 7200).
set -euo pipefail

LOG_PREFIX=fresh-root
SELF="$(realpath "${BASH_SOURCE[0]}")"
REPO="$(cd "$(dirname "$SELF")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"

FRESH_STEPS="${FRESH_STEPS:-all}"
FRESH_SUITE="${FRESH_SUITE:-bookworm}"
FRESH_RUN_TIMEOUT="${FRESH_RUN_TIMEOUT:-2400}"
FRESH_TEST_TIMEOUT="${FRESH_TEST_TIMEOUT:-7200}"
KEEP_ROOT="${KEEP_ROOT:-0}"
readonly STOP_TIMEOUT=120
readonly MODEL="SmolLM2-135M-Instruct"
# Inside the root: where the host's toolchain is mounted, and the clone.
readonly RUST_DIR=/opt/rust
readonly SRC=/src/tandem
# Added to the minimal root: curl is the check's own tool (the chat request), nothing
# the project needs; make is the one thing the README's commands need that no
# Makefile can install (a minimal Debian has none). Everything else is the project's job.
readonly INCLUDE=curl,make

# ---------------------------------------------------------------- shared helpers

# record STEP SECONDS STATUS : one line of the summary table.
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$FRESH_LOGS/steps.tsv"; }

# run_step NAME FUNCTION : runs FUNCTION (in a subshell, so `set -e` holds in it)
# with its output in $FRESH_LOGS/NAME.log; on failure prints the log's tail and exits.
STEP_NAME="" STEP_T0=0
run_step() {
  local name=$1 fn=$2 log="$FRESH_LOGS/$1.log" t0=$SECONDS rc=0
  STEP_NAME=$name STEP_T0=$t0
  log "step $name ... (log: $log)"
  "$fn" >>"$log" 2>&1 </dev/null &
  wait "$!" || rc=$?
  STEP_NAME=""
  local dt=$((SECONDS - t0))
  if ((rc != 0)); then
    record "$name" "$dt" "FAILED (exit $rc)"
    log "step $name FAILED after ${dt}s (exit $rc); last 40 lines of $log:"
    tail -n 40 "$log" | sed 's/^/    | /' >&2
    exit "$rc"
  fi
  record "$name" "$dt" ok
  log "step $name ok (${dt}s)"
}

skip() { record "$1" - skipped; }

# A signal stopped the script during a step: say so in the summary.
record_interrupted() {
  [[ -n $STEP_NAME ]] || return 0
  record "$STEP_NAME" $((SECONDS - STEP_T0)) "interrupted (exit $1)"
  STEP_NAME=""
}

# The pids of processes whose root directory is the fresh root (same device and inode).
root_pids() {
  local want p
  want=$(stat -c %d:%i "$FRESH_ROOT")
  for p in /proc/[0-9]*; do
    [[ $(stat -L -c %d:%i "$p/root" 2>/dev/null) == "$want" ]] && echo "${p#/proc/}"
  done
  return 0
}

# Kills (KILL) every process left in the root; never anything else.
kill_root_pids() {
  local pids
  pids=$(root_pids)
  [[ -n $pids ]] || return 0
  log "killing processes left in the root: $(echo "$pids" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 1
}

# ---------------------------------------------------------------- inside the namespace

# root_env : ROOT_ENV, the clean environment of every command in the root.
root_env() {
  ROOT_ENV=(HOME=/root USER=root LOGNAME=root LANG=C.UTF-8 TERM=dumb SHELL=/bin/bash
    "PATH=$RUST_DIR/cargo-bin:$RUST_DIR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    "RUSTUP_HOME=$RUST_DIR/rustup" CARGO_HOME=/root/.cargo)
  local v
  # The host's registry settings: pip's environment and any proxy.
  while IFS= read -r v; do
    ROOT_ENV+=("$v=${!v}")
  done < <(compgen -e | grep -E '^(PIP_[A-Z0-9_]+|https?_proxy|no_proxy|HTTPS?_PROXY|NO_PROXY)$' || true)
}

# in_root CMD... : runs CMD as root in the fresh root with a clean environment.
in_root() {
  root_env
  chroot "$FRESH_ROOT" /usr/bin/env -i "${ROOT_ENV[@]}" "$@"
}

# alive PID : the process exists and is not a zombie.
alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

step_toolchain() {
  local r=$FRESH_ROOT
  set -x
  # The root a mount point of its own, as / is on a machine: `ip netns exec` (the tests'
  # network namespaces) runs `mount --make-rslave /`, which fails with "Invalid argument"
  # when / is a plain directory. First, so the mounts below land on top of it.
  mount --bind "$r" "$r"
  # Kernel filesystems a Debian machine has; private to this namespace.
  mount -t proc proc "$r/proc"
  mount -t sysfs sysfs "$r/sys"
  # A machine's cgroup hierarchies (systemd mounts them at boot): tests start workers
  # under a CPU quota there.
  if mountpoint -q /sys/fs/cgroup; then
    mount --rbind /sys/fs/cgroup "$r/sys/fs/cgroup"
  fi
  mount --rbind /dev "$r/dev"
  mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
  mount -t tmpfs -o mode=0755,nosuid,nodev run "$r/run"
  mkdir -p "$r/run/lock"
  mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$r/tmp"
  # The host's toolchain, read-only.
  mkdir -p "$r$RUST_DIR/rustup" "$r$RUST_DIR/cargo-bin" "$r$RUST_DIR/bin" "$r/root/.cargo"
  mount --bind "$HOST_RUSTUP_HOME" "$r$RUST_DIR/rustup"
  mount -o remount,bind,ro "$r$RUST_DIR/rustup"
  mount --bind "$HOST_CARGO_BIN" "$r$RUST_DIR/cargo-bin"
  mount -o remount,bind,ro "$r$RUST_DIR/cargo-bin"
  if [[ -n $HOST_NEXTEST ]]; then
    # cargo-nextest lives outside cargo's bin directory on this host.
    touch "$r$RUST_DIR/bin/cargo-nextest"
    mount --bind "$HOST_NEXTEST" "$r$RUST_DIR/bin/cargo-nextest"
    mount -o remount,bind,ro "$r$RUST_DIR/bin/cargo-nextest"
  fi
  set +x
  in_root cargo --version
  in_root rustc --version
  in_root cargo nextest --version
  # Read-only for real: the root cannot change the host's toolchain.
  if in_root touch "$RUST_DIR/rustup/.fresh-root-write-test" 2>/dev/null; then
    echo "rustup home is writable from the root" >&2
    return 1
  fi
  grep -F " $r" /proc/self/mountinfo | cut -d' ' -f5
}

step_clone() {
  # A clean clone of HEAD, not the working tree (others' uncommitted edits stay out).
  local head
  head=$(git -C "$REPO" rev-parse HEAD)
  echo "HEAD $head: $(git -C "$REPO" log -1 --format=%s "$head" | cut -c1-120)"
  mkdir -p "$FRESH_ROOT$(dirname "$SRC")"
  git clone --quiet --no-local --no-checkout "$REPO" "$FRESH_ROOT$SRC"
  git -C "$FRESH_ROOT$SRC" checkout --quiet --detach "$head"
  git -C "$FRESH_ROOT$SRC" status --short | head -5
  echo "$head" >"$FRESH_LOGS/head"
}

# free_port [NOT] : a TCP port below the ephemeral range that nothing on the host uses
# (listening or connected), other than NOT.
free_port() {
  local lo p hex _
  read -r lo _ </proc/sys/net/ipv4/ip_local_port_range
  for _ in $(seq 200); do
    p=$((10000 + RANDOM % (lo - 10000)))
    hex=$(printf ':%04X ' "$p")
    grep -q "$hex" /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
    [[ $p == "${1:-}" ]] && continue
    echo "$p"
    return 0
  done
  echo "no free port found" >&2
  return 1
}

step_run() {
  local http grpc state="$FRESH_ROOT/root/.cache/tandem/cluster.json" log="$FRESH_LOGS/run.log"
  http=$(free_port)
  grpc="127.0.0.1:$(free_port "$http")"
  http="127.0.0.1:$http"
  echo "$http" >"$STATE_DIR/http"
  echo "== make run HTTP=$http GRPC=$grpc (own process group)"
  # setsid: make leads its own process group, which Ctrl-C (SIGINT) goes to (a
  # forked child never leads a group, so setsid does not fork: $! is make's pid).
  root_env
  chroot "$FRESH_ROOT" /usr/bin/env -i "${ROOT_ENV[@]}" \
    setsid bash -c "cd $SRC && exec make run HTTP=$http GRPC=$grpc" >>"$log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$STATE_DIR/make.pid"
  local deadline=$((SECONDS + FRESH_RUN_TIMEOUT))
  while :; do
    # tandem up writes the state file (whole) once the cluster is ready, then the table.
    if [[ -s $state ]] && grep -q '^role' "$log"; then
      break
    fi
    if ! alive "$pid"; then
      echo "== make run exited before the cluster was ready"
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "== the cluster was not ready after ${FRESH_RUN_TIMEOUT}s"
      return 1
    fi
    sleep 5
  done
  echo "== ready; state file:"
  cat "$state"
  echo
}

step_chat() {
  local http code body
  http=$(cat "$STATE_DIR/http")
  body=$(printf '{"model":"%s","messages":[{"role":"user","content":"%s"}],"temperature":0,"max_tokens":16}' \
    "$MODEL" "What is the capital of France? Answer in one sentence.")
  echo "== POST http://$http/v1/chat/completions $body"
  code=$(in_root curl -sS --max-time 300 -o /tmp/chat.json -w '%{http_code}' \
    -H 'content-type: application/json' -d "$body" "http://$http/v1/chat/completions")
  echo "== HTTP $code"
  cat "$FRESH_ROOT/tmp/chat.json"
  echo
  [[ $code == 200 ]] || return 1
  in_root python3 -c '
import json, sys
content = json.load(open("/tmp/chat.json"))["choices"][0]["message"]["content"]
print("== answer:", repr(content))
sys.exit(0 if content.strip() else "empty content")'
}

# Ctrl-C to make's process group; waits for it to exit. Returns 1 when it had to kill.
stop_cluster() {
  local pid pgid
  [[ -f $STATE_DIR/make.pid ]] || return 0
  pid=$(cat "$STATE_DIR/make.pid")
  rm -f "$STATE_DIR/make.pid"
  alive "$pid" || return 0
  pgid=$(cat "/proc/$pid/stat")
  pgid=${pgid##*) }
  pgid=$(echo "$pgid" | cut -d' ' -f3)
  echo "== SIGINT to process group $pgid (make run, pid $pid)"
  kill -INT -- "-$pgid"
  local deadline=$((SECONDS + STOP_TIMEOUT))
  while alive "$pid"; do
    if ((SECONDS > deadline)); then
      echo "== make run still running ${STOP_TIMEOUT}s after SIGINT; killing its group"
      kill -KILL -- "-$pgid" 2>/dev/null || true
      return 1
    fi
    sleep 1
  done
}

step_stop() {
  stop_cluster
  sleep 2
  local pids p
  pids=$(root_pids)
  if [[ -n $pids ]]; then
    echo "== processes still running in the root after Ctrl-C:"
    # shellcheck disable=SC2086
    for p in $pids; do echo "  $p: $(tr '\0' ' ' <"/proc/$p/cmdline")"; done
    return 1
  fi
  # tandem up stops each process with SIGTERM and kills it only when the grace ran out.
  if grep -q 'did not stop within the grace' "$FRESH_LOGS/run.log"; then
    echo "== a process had to be killed: Ctrl-C did not stop the cluster cleanly"
    return 1
  fi
  echo "== every process of the cluster has exited"
  echo "== make run's last lines:"
  tail -n 15 "$FRESH_LOGS/run.log"
}

step_test() {
  # What CI runs.
  root_env
  timeout --kill-after=60 "$FRESH_TEST_TIMEOUT" \
    chroot "$FRESH_ROOT" /usr/bin/env -i "${ROOT_ENV[@]}" bash -c "cd $SRC && exec bash .ci/run"
}

inner_cleanup() {
  local rc=$?
  record_interrupted "$rc"
  # A step that failed with the cluster up: stop it like a user would, then make sure.
  stop_cluster >>"$FRESH_LOGS/stop.log" 2>&1 || true
  kill_root_pids
  exit "$rc"
}

inner() {
  STATE_DIR="$FRESH_LOGS/.state"
  mkdir -p "$STATE_DIR"
  trap inner_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  run_step toolchain step_toolchain
  run_step clone step_clone
  case $FRESH_STEPS in
    setup) skip run; skip chat; skip stop; skip test; return 0 ;;
    test) skip run; skip chat; skip stop ;;
    *)
      run_step run step_run
      run_step chat step_chat
      run_step stop step_stop
      ;;
  esac
  case $FRESH_STEPS in
    run) skip test ;;
    *) run_step test step_test ;;
  esac
}

# ---------------------------------------------------------------- on the host

# The host's apt mirror for $FRESH_SUITE: deb822 sources first, then sources.list.
host_mirror() {
  local f
  shopt -s nullglob
  for f in /etc/apt/sources.list.d/*.sources; do
    awk -v suite="$FRESH_SUITE" '
      function flush() {
        if (!found && types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && enabled != "no" && uris != "") {
          split(uris, u, " "); print u[1]; found = 1
        }
        types = suites = uris = enabled = ""
      }
      /^[[:space:]]*#/ { next }
      /^[[:space:]]*$/ { flush(); next }
      { key = tolower($1); $1 = ""; sub(/^[[:space:]]+/, "") }
      key == "types:" { types = $0 }
      key == "suites:" { suites = $0 }
      key == "uris:" { uris = $0 }
      key == "enabled:" { enabled = tolower($0) }
      END { flush() }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    # deb [options] URI SUITE COMPONENTS...
    sed -E 's/#.*//; s/\[[^]]*\]//' "$f" | awk -v suite="$FRESH_SUITE" '$1 == "deb" && $3 == suite { print $2 }'
  done
  shopt -u nullglob
}

step_root() {
  local r=$FRESH_ROOT mirror
  command -v debootstrap >/dev/null || apt_install debootstrap
  mirror=$(host_mirror | head -n 1)
  [[ -n $mirror ]] || { echo "no apt source for suite $FRESH_SUITE on this host" >&2; return 1; }
  echo "== debootstrap --variant=minbase --include=$INCLUDE $FRESH_SUITE $r $mirror"
  # In a private mount namespace too: the /proc and /sys debootstrap mounts in the root
  # go with it even when debootstrap is killed.
  unshare --mount --propagation private -- \
    debootstrap --variant=minbase --include="$INCLUDE" "$FRESH_SUITE" "$r" "$mirror"
  # The host's apt configuration, so the root reaches the same registries.
  rm -f "$r/etc/apt/sources.list"
  [[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$r/etc/apt/"
  cp -a /etc/apt/sources.list.d/. "$r/etc/apt/sources.list.d/"
  cp -a /etc/apt/apt.conf.d/. "$r/etc/apt/apt.conf.d/"
  local d
  for d in trusted.gpg.d keyrings; do
    [[ -d /etc/apt/$d ]] && mkdir -p "$r/etc/apt/$d" && cp -a "/etc/apt/$d/." "$r/etc/apt/$d/"
  done
  cp -L /etc/resolv.conf "$r/etc/resolv.conf"
  # The host's local CA certificates (a TLS-intercepting egress proxy's, say): they join
  # the bundle when the project installs ca-certificates (update-ca-certificates).
  if [[ -d /usr/local/share/ca-certificates ]]; then
    mkdir -p "$r/usr/local/share/ca-certificates"
    cp -a /usr/local/share/ca-certificates/. "$r/usr/local/share/ca-certificates/"
  fi
  [[ -s $r/etc/hosts ]] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$r/etc/hosts"
  # pip's configuration (PIP_* variables are passed to every command in the root).
  [[ -f /etc/pip.conf ]] && cp /etc/pip.conf "$r/etc/pip.conf"
  local home_pip
  for home_pip in .config/pip/pip.conf .pip/pip.conf; do
    if [[ -f $HOME/$home_pip ]]; then
      mkdir -p "$r/root/$(dirname "$home_pip")"
      cp "$HOME/$home_pip" "$r/root/$home_pip"
    fi
  done
  # The root shares the host's network: no package may start a daemon in it
  # (etcd-server's postinst would start etcd on the host's port 2379).
  printf '#!/bin/sh\nexit 101\n' >"$r/usr/sbin/policy-rc.d"
  chmod 755 "$r/usr/sbin/policy-rc.d"
  echo "== root: $(du -sh "$r" | cut -f1)"
}

summary() {
  [[ -f $FRESH_LOGS/steps.tsv ]] || return 0
  local total=0 name secs status
  echo
  echo "fresh-root summary ($FRESH_SUITE, FRESH_STEPS=$FRESH_STEPS, HEAD $(cut -c1-12 "$FRESH_LOGS/head" 2>/dev/null || echo '?'))"
  printf '  %-10s %9s  %s\n' step 'wall' status
  while IFS=$'\t' read -r name secs status; do
    if [[ $secs == - ]]; then
      printf '  %-10s %9s  %s\n' "$name" - "$status"
    else
      total=$((total + secs))
      printf '  %-10s %6d:%02d  %s\n' "$name" $((secs / 60)) $((secs % 60)) "$status"
    fi
  done <"$FRESH_LOGS/steps.tsv"
  printf '  %-10s %6d:%02d\n' total $((total / 60)) $((total % 60))
  echo "logs: $FRESH_LOGS"
}

outer_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  # The namespace's part records its own steps.
  [[ $STEP_NAME == inner ]] && STEP_NAME=""
  record_interrupted "$rc"
  # Nothing of the root may outlive the check (the namespace's mounts go with it).
  kill_root_pids
  if [[ $KEEP_ROOT == 1 ]]; then
    log "kept the root: $FRESH_ROOT"
  elif awk -v r="$FRESH_ROOT" '$5 == r || index($5, r "/") == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
    # Mounts are made in the private namespace only; this would be a bug. Keep it.
    log "error: something is mounted under $FRESH_ROOT here; not deleting it"
  else
    log "deleting $FRESH_ROOT"
    rm -rf --one-file-system "$FRESH_ROOT"
  fi
  summary >&2
  exit "$rc"
}

outer() {
  [[ $(id -u) == 0 ]] || die "run as root (debootstrap, chroot, mounts)"
  case $FRESH_STEPS in all | run | test | setup) ;; *) die "FRESH_STEPS must be all, run, test or setup" ;; esac
  command -v unshare >/dev/null || die "need unshare (util-linux)"
  command -v git >/dev/null || die "need git (to clone HEAD)"

  # The host's Rust toolchain (the fresh machine's one prerequisite).
  HOST_RUSTUP_HOME=$(realpath "$(rustup show home 2>/dev/null || echo "${RUSTUP_HOME:-$HOME/.rustup}")")
  local cargo nextest
  cargo=$(command -v cargo) || die "cargo not found"
  HOST_CARGO_BIN=$(dirname "$cargo")
  [[ -d $HOST_RUSTUP_HOME/toolchains ]] || die "no rustup home at $HOST_RUSTUP_HOME"
  HOST_NEXTEST=""
  nextest=$(command -v cargo-nextest) || die "cargo-nextest not found"
  [[ $(dirname "$nextest") == "$HOST_CARGO_BIN" ]] || HOST_NEXTEST=$(realpath "$nextest")

  FRESH_LOGS="${FRESH_LOGS:-$TANDEM_CACHE/fresh-check/$(date +%Y%m%d-%H%M%S)}"
  mkdir -p "$FRESH_LOGS"
  FRESH_LOGS=$(realpath "$FRESH_LOGS")
  : >"$FRESH_LOGS/steps.tsv"
  local tmp="${FRESH_TMP:-${TMPDIR:-/var/tmp}}"
  FRESH_ROOT=$(mktemp -d "$tmp/tandem-fresh-root.XXXXXX")
  FRESH_ROOT=$(realpath "$FRESH_ROOT")
  chmod 755 "$FRESH_ROOT"
  trap outer_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  log "root: $FRESH_ROOT; logs: $FRESH_LOGS; rust: $HOST_RUSTUP_HOME, $HOST_CARGO_BIN"
  export FRESH_ROOT FRESH_LOGS FRESH_STEPS FRESH_SUITE FRESH_RUN_TIMEOUT FRESH_TEST_TIMEOUT
  export HOST_RUSTUP_HOME HOST_CARGO_BIN HOST_NEXTEST

  run_step root step_root
  # The rest in a private mount namespace: its mounts end with it.
  STEP_NAME=inner
  unshare --mount --propagation private -- bash "$SELF" --inner
  STEP_NAME=""
}

if [[ ${1:-} == --inner ]]; then
  inner
else
  outer
fi
