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
