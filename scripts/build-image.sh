#!/usr/bin/env bash
# build-image.sh — tandem's OCI images, built here without a container daemon or a
# registry (make image):
#
#   target/image/tandem   OCI layout, tag <workspace version>: tandem, tandem-coordinator,
#                         tandem-prefill-worker and tandem-decode-worker in /usr/local/bin,
#                         over the Debian packages they load (libc6, libgcc-s1, libucx0
#                         and what those depend on), user 10001, no shell, no package
#                         manager
#   target/image/etcd     OCI layout, tag <Debian's etcd version>: Debian's etcd over the
#                         same libc layer, user 10001 — what the image test and a cluster
#                         without a registry run; the Kubernetes pack runs upstream etcd
#   target/image/*.digest the manifest digest of each, to pin in an overlay
#
# The root is made from .deb files (apt-get download, the machine's own apt sources,
# cached under $TANDEM_CACHE/image/debs and checked against apt's SHA-256) unpacked with
# dpkg-deb: no maintainer script runs, so the image holds only files. The dependency
# closure skips packages that only maintainer scripts use (SKIP). Each binary is run
# inside the root (chroot, as user 10001) before packing, and every shared object of the
# UCX layer (UCX's transport modules, loaded at run time) must resolve there: a library
# the root lacks fails here, not in a pod.
#
# Packed with umoci (three layers: libc, UCX, the binaries, so a new release ships one
# small layer over a base registries already hold). File times are the commit's time, so
# the same commit, binaries and package versions give the same digest.
#
# Needs root (dpkg-deb ownership, chroot), umoci, apt-get, dpkg-deb, ldconfig, objcopy
# and the release binaries (make build).
set -euo pipefail
# A failure inside $(...) stops the script too (a failed umoci step must never leave a
# digest behind).
shopt -s inherit_errexit

LOG_PREFIX=image
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"

OUT="${IMAGE_OUT:-$REPO/target/image}"
BIN_DIR="${IMAGE_BINARIES:-$REPO/target/release}"
DEBS="$TANDEM_CACHE/image/debs"
readonly BINARIES=(tandem tandem-coordinator tandem-prefill-worker tandem-decode-worker)
# What the binaries link (ldd), one layer each: the C library and the unwinder (etcd
# needs them too: both images share that layer), then UCX (the ucx KV transport).
readonly LIBC=(libc6 libgcc-s1)
readonly UCX=(libucx0)
# Pulled in only for a maintainer script (libibverbs1's postinst adds a group with
# adduser); the image runs no maintainer scripts.
readonly SKIP=(adduser)
readonly USER_ID=10001
readonly PATH_IN_IMAGE=/usr/local/bin:/usr/bin:/bin

[[ $(id -u) == 0 ]] || die "run as root (dpkg-deb keeps file owners, the check uses chroot)"
for tool in umoci apt-get apt-cache dpkg-deb ldconfig objcopy chroot unshare python3; do
  command -v "$tool" >/dev/null || die "$tool not found (scripts/deps.sh installs umoci)"
done
for b in "${BINARIES[@]}"; do
  [[ -x $BIN_DIR/$b ]] || die "$BIN_DIR/$b missing: run make build first"
done

VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "$REPO/Cargo.toml")
[[ -n $VERSION ]] || die "no [workspace.package] version in Cargo.toml"
REVISION=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
# Built from uncommitted changes: say so in the image's revision label.
git -C "$REPO" diff --quiet HEAD 2>/dev/null || REVISION+=-dirty
EPOCH=$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || echo 0)
CREATED=$(date -u -d "@$EPOCH" +%Y-%m-%dT%H:%M:%SZ)

WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/tandem-image.XXXXXX")
trap '[[ -n ${KEEP_WORK:-} ]] || rm -rf "$WORK"' EXIT

# depends PKG : PKG's Depends and Pre-Depends: of each group of alternatives the first
# real package (apt-cache marks all but a group's last member with `|`). A group of
# virtual packages only prints `?NAME`, which closure refuses.
depends() {
  local out
  out=$(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances "$1") || die "apt-cache depends $1 failed"
  awk '
    { alt = ($1 == "|Depends:" || $1 == "|PreDepends:") }
    !alt && $1 != "Depends:" && $1 != "PreDepends:" { next }
    { if (pick == "" && $2 !~ /^</) pick = $2; if (first == "") first = $2 }
    !alt { print (pick != "" ? pick : "?" first); pick = ""; first = "" }
  ' <<<"$out"
}

# closure PKG... : every package PKG... needs, breadth first, without SKIP and without
# the packages named in $HAVE (a layer below has them). Sets CLOSURE.
closure() {
  local -A seen=()
  local queue=("$@") p d deps
  CLOSURE=()
  for p in "${SKIP[@]}" ${HAVE:-}; do seen[$p]=skip; done
  while ((${#queue[@]})); do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    [[ -z ${seen[$p]:-} ]] || continue
    seen[$p]=1
    CLOSURE+=("$p")
    deps=$(depends "$p")
    for d in $deps; do
      [[ $d != \?* ]] || die "$p depends on ${d#\?}, which only virtual packages satisfy: name a provider in the roots"
      [[ -n ${seen[$d]:-} ]] || queue+=("$d")
    done
  done
}

# fetch PKG... : the .deb of each (the candidate version), from the cache when its
# SHA-256 is apt's. Sets FETCHED to their paths, one per package or the script stops.
# (Asked from $WORK: apt-get lists no URI for a file already in its working directory.)
fetch() {
  mkdir -p "$DEBS"
  local uris=$WORK/uris uri file sum
  (cd "$WORK" && apt-get download --print-uris "$@") >"$uris" || die "apt-get download --print-uris $* failed"
  (($(wc -l <"$uris") == $#)) || die "apt listed $(wc -l <"$uris") downloads for $# packages ($*)"
  FETCHED=()
  while read -r uri file _ sum; do
    sum=${sum#SHA256:}
    if ! [[ -f $DEBS/$file ]] || ! echo "$sum  $DEBS/$file" | sha256sum --quiet -c - >/dev/null 2>&1; then
      log "downloading $file"
      rm -f "$DEBS/$file"
      # As root: the cache is root's, which apt's sandbox user may not write.
      (cd "$DEBS" && apt-get download -qq -o APT::Sandbox::User=root "${file%%_*}" >&2) ||
        die "apt-get download ${file%%_*} failed"
    fi
    echo "$sum  $DEBS/$file" | sha256sum --quiet -c - >/dev/null 2>&1 ||
      die "$file does not match apt's SHA-256 (uri ${uri//\'/})"
    FETCHED+=("$DEBS/$file")
  done <"$uris"
}

# slim ROOT : drop what nothing runs (manuals, translations, docs except copyright files).
slim() {
  local r=$1
  rm -rf "$r/usr/share/man" "$r/usr/share/info" "$r/usr/share/locale" "$r/usr/share/lintian" \
    "$r/usr/share/bug" "$r/usr/share/gdb" "$r/etc/init.d" "$r/lib/systemd" "$r/usr/lib/systemd"
  if [[ -d $r/usr/share/doc ]]; then
    find "$r/usr/share/doc" -type f ! -name copyright -delete
    find "$r/usr/share/doc" -depth -type d -empty -delete
  fi
}

# unpack DIR PKG... : the files of PKG... (their .deb files) in DIR, slimmed.
unpack() {
  local dir=$1 deb
  shift
  mkdir -p "$dir"
  fetch "$@"
  for deb in "${FETCHED[@]}"; do
    dpkg-deb -x "$deb" "$dir"
  done
  slim "$dir"
}

# in_root ROOT CMD... : CMD in ROOT as the images' user, with /proc (UCX reads the boot id).
in_root() {
  local r=$1
  shift
  unshare --mount --fork bash -c 'mount -t proc proc "$1/proc" && shift && exec chroot --userspec="$0" "$@"' \
    "$USER_ID:$USER_ID" "$r" "$r" "$@"
}

# accounts ROOT : root and the unprivileged user the images run as; /tmp.
accounts() {
  local r=$1
  mkdir -p "$r/etc" "$r/tmp" "$r/proc"
  chmod 1777 "$r/tmp"
  printf 'root:x:0:0:root:/root:/usr/sbin/nologin\ntandem:x:%s:%s:tandem:/nonexistent:/usr/sbin/nologin\n' \
    "$USER_ID" "$USER_ID" >"$r/etc/passwd"
  printf 'root:x:0:\ntandem:x:%s:\n' "$USER_ID" >"$r/etc/group"
}

# pack LAYOUT TAG DIR... : a fresh OCI layout LAYOUT:TAG, one layer per DIR (each a root
# tree), configured to run as USER_ID. Prints the manifest digest.
pack() {
  local layout=$1 tag=$2 dir
  shift 2
  rm -rf "$layout"
  umoci init --layout "$layout"
  umoci new --image "$layout:$tag"
  for dir in "$@"; do
    find "$dir" -exec touch -h -d "@$EPOCH" {} +
    umoci insert --image "$layout:$tag" --history.created "$CREATED" \
      --history.created_by "scripts/build-image.sh: $(basename "$dir")" "$dir" /
  done
  umoci config --no-history --image "$layout:$tag" --created "$CREATED" \
    --config.user "$USER_ID:$USER_ID" --config.workingdir / \
    --config.env "PATH=$PATH_IN_IMAGE" \
    --config.label "org.opencontainers.image.version=$tag" \
    --config.label "org.opencontainers.image.revision=$REVISION" \
    --config.label "org.opencontainers.image.source=tandem"
  umoci gc --layout "$layout"
  python3 - "$layout" "$tag" <<'EOF'
import json, sys
layout, tag = sys.argv[1], sys.argv[2]
index = json.load(open(f"{layout}/index.json"))
digests = [m["digest"] for m in index["manifests"]
           if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
if len(digests) != 1:
    sys.exit(f"{layout}: expected one manifest tagged {tag}, found {len(digests)}")
print(digests[0])
EOF
}

# ---------------------------------------------------------------- the layers

# 1. libc: the C library, the accounts, /tmp (both images).
closure "${LIBC[@]}"
libc_packages=("${CLOSURE[@]}")
log "layer libc: ${libc_packages[*]}"
libc="$WORK/libc"
unpack "$libc" "${libc_packages[@]}"
accounts "$libc"
printf 'include /etc/ld.so.conf.d/*.conf\n' >"$libc/etc/ld.so.conf"
ldconfig -r "$libc"

# 2. ucx: UCX and what it loads, with the loader's cache of both layers.
HAVE="${libc_packages[*]}" closure "${UCX[@]}"
ucx_packages=("${CLOSURE[@]}")
log "layer ucx: ${ucx_packages[*]}"
ucx="$WORK/ucx"
unpack "$ucx" "${ucx_packages[@]}"
check="$WORK/check"
mkdir -p "$check"
cp -a "$libc/." "$ucx/." "$check/"
ldconfig -r "$check"
mkdir -p "$ucx/etc"
cp "$check/etc/ld.so.cache" "$ucx/etc/ld.so.cache"

# 3. bin: the release binaries.
bins="$WORK/bin"
mkdir -p "$bins/usr/local/bin"
# Without their line tables (a fifth of the size; a panic's backtrace still names each
# function): keep target/release for symbolising a backtrace from the field.
for b in "${BINARIES[@]}"; do
  objcopy --strip-debug "$BIN_DIR/$b" "$bins/usr/local/bin/$b"
  chown root:root "$bins/usr/local/bin/$b"
  chmod 0755 "$bins/usr/local/bin/$b"
done

# Each binary starts in the image's root as its user: every library it loads is there.
cp -a "$bins/." "$check/"
for b in "${BINARIES[@]}"; do
  out=$(in_root "$check" "/usr/local/bin/$b" --version 2>&1) || die "$b does not start in the image's root: $out"
  log "in the root: $out"
done
# UCX loads its transport modules at run time, not at start: each shared object of the
# UCX layer must find every library it needs in the root.
while read -r so; do
  out=$(in_root "$check" /lib64/ld-linux-x86-64.so.2 --list "/$so" 2>&1) || die "${so}: $out"
  ! grep -q 'not found' <<<"$out" || die "/$so needs a library the image lacks: $(grep 'not found' <<<"$out")"
done < <(cd "$ucx" && find . -type f \( -name '*.so' -o -name '*.so.[0-9]*' \) -printf '%P\n')
log "every shared object of the ucx layer resolves in the root"
rm -rf "$check"

# 4. etcd: Debian's etcd binary (dynamically linked against libc) and its data dir.
fetch etcd-server
etcd_deb=${FETCHED[0]}
etcd_version=$(dpkg-deb -f "$etcd_deb" Version)
etcd_version=${etcd_version%%-*}
etcd_version=${etcd_version#*:}
unpacked="$WORK/etcd-deb"
dpkg-deb -x "$etcd_deb" "$unpacked"
etcd="$WORK/etcd"
mkdir -p "$etcd/usr/bin" "$etcd/usr/share/doc/etcd-server" "$etcd/var/lib/etcd"
install -m 0755 -o root -g root "$unpacked/usr/bin/etcd" "$etcd/usr/bin/etcd"
cp "$unpacked/usr/share/doc/etcd-server/copyright" "$etcd/usr/share/doc/etcd-server/"
chown "$USER_ID:$USER_ID" "$etcd/var/lib/etcd"
check="$WORK/check-etcd"
mkdir -p "$check"
cp -a "$libc/." "$etcd/." "$check/"
out=$(in_root "$check" /usr/bin/etcd --version 2>&1) || die "etcd does not start in its root: $out"
log "in the root: $(echo "$out" | head -n 1)"
rm -rf "$check"

# ---------------------------------------------------------------- the images

mkdir -p "$OUT"
digest=$(pack "$OUT/tandem" "$VERSION" "$libc" "$ucx" "$bins" | tail -n 1)
echo "$digest" >"$OUT/tandem.digest"
etcd_digest=$(pack "$OUT/etcd" "$etcd_version" "$libc" "$etcd" | tail -n 1)
echo "$etcd_digest" >"$OUT/etcd.digest"

size() { du -sh --apparent-size "$1/blobs" | cut -f1; }
log "tandem image: $OUT/tandem:$VERSION $digest ($(size "$OUT/tandem") compressed)"
log "etcd image:   $OUT/etcd:$etcd_version $etcd_digest ($(size "$OUT/etcd") compressed)"
log "pin it in your overlay: kustomize edit set image tandem=REGISTRY/tandem@$digest"
log "push it: skopeo copy oci:$OUT/tandem:$VERSION docker://REGISTRY/tandem:$VERSION"
