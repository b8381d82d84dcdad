# Shared helpers for scripts/*.sh. Source it; do not run it.
# shellcheck shell=bash

# Cache root shared by every script: models/, llama/.
TANDEM_CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"

log() { echo "${LOG_PREFIX:-tandem}: $*" >&2; }
die() { log "error: $*"; exit 1; }

# apt_install PKG... : install Debian packages (root only), running `apt-get update`
# once per script run. Output goes to stderr so stdout stays machine-readable.
_apt_updated=0
apt_install() {
  command -v apt-get >/dev/null || die "need packages ($*) but apt-get is not available"
  [[ $(id -u) == 0 ]] || die "need packages ($*); run as root or install them first"
  export DEBIAN_FRONTEND=noninteractive
  if [[ $_apt_updated == 0 ]]; then
    log "apt-get update"
    apt-get update -qq >&2
    _apt_updated=1
  fi
  log "apt-get install $*"
  apt-get install -y -qq --no-install-recommends "$@" >&2
}

# ensure_pip : make `python3 -m pip` work.
ensure_pip() {
  command -v python3 >/dev/null || apt_install python3
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
}

# free_port : print a free loopback TCP port.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# stop_pid PID NAME : SIGTERM, up to 30 s (tandem up drains), then SIGKILL; reaps PID.
stop_pid() {
  local pid=$1 name=$2 i
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  log "stopping ${name} (pid ${pid})"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "${name} (pid ${pid}) did not stop; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

# wait_ready URL PID NAME LOG [SECONDS] : poll URL until it answers 200 (default: up to
# 300 s) while PID lives; on failure print LOG's tail and die.
wait_ready() {
  local url=$1 pid=$2 name=$3 logfile=$4 wait_s=${5:-300} i
  for ((i = 0; i < wait_s * 5; i++)); do
    if [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == 200 ]]; then
      log "${name} is ready (${url})"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$logfile" >&2 || true
      die "${name} exited before ${url} answered 200 (log above)"
    fi
    sleep 0.2
  done
  tail -n 20 "$logfile" >&2 || true
  die "${url} did not answer 200 within ${wait_s}s"
}
