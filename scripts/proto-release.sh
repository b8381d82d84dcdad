#!/usr/bin/env bash
# Writes proto/released/VERSION.binpb: the descriptor set of the .proto files as
# they are at git revision REV (default HEAD), which proto/tests/compat.rs holds every
# later build to (no field, method or enum value of a release removed or changed).
# Run it when cutting a release: scripts/proto-release.sh 0.2.0 [REV]
set -euo pipefail

LOG_PREFIX=proto-release
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $# -ge 1 ]] || die "usage: $0 VERSION [REV]"
readonly VERSION=$1 REV=${2:-HEAD}
readonly ROOT=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
readonly OUT="$ROOT/proto/released/$VERSION.binpb"
command -v protoc >/dev/null || die "protoc is missing: run make deps"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
files=()
while IFS= read -r f; do
  mkdir -p "$tmp/$(dirname "$f")"
  git -C "$ROOT" show "$REV:$f" >"$tmp/$f"
  files+=("${f#proto/proto/}")
done < <(git -C "$ROOT" ls-tree -r --name-only "$REV" -- proto/proto | grep '\.proto$')
mkdir -p "$(dirname "$OUT")"
protoc --proto_path="$tmp/proto/proto" --include_imports --descriptor_set_out="$OUT" "${files[@]}"
log "wrote $OUT from ${#files[@]} file(s) at $REV"
