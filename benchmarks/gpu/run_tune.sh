#!/usr/bin/env bash
# Runs `pbstk tune` on a lent GPU machine (see benchmarks/README.md). Usage, from the checkout root there:
#   bash benchmarks/gpu/run_tune.sh OUT_JSON PRESETS [extra pbstk tune args...]
# Expects vLLM 0.22.1 installed by shared/gpu/install-on-device.sh (staged under gpu-stage/tools) and the
# wheels pbstk needs that the image lacks under gpu-stage/extra.
set -euo pipefail
out=${1:?usage: run_tune.sh OUT_JSON PRESETS [args]}
presets=${2:?presets}
shift 2
# shellcheck disable=SC1091
source gpu-stage/tools/install-on-device.sh
if [ ! -f /tmp/pbstk-site/.done ]; then
  mkdir -p /tmp/pbstk-site
  for whl in gpu-stage/extra/*.whl; do
    mod=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    case "$mod" in pyyaml) mod=yaml ;; prometheus_client) ;; esac
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/pbstk-site "$whl"
  done
  touch /tmp/pbstk-site/.done
fi
export PYTHONPATH="$PWD:$PYTHONPATH:/tmp/pbstk-site"
[ -f /root/qwen3-1.7b/config.json ] || python3 gpu-stage/tools/mkmodel.py /root/qwen3-1.7b
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5 || true
python3 -m pbs_toolkit tune /root/qwen3-1.7b --name qwen3-1.7b --profile benchmarks/gpu/local-h200x2.yaml \
  --presets "$presets" -c 1,64,256 --input-len 128 --output-len 256 --rounds 2 \
  --vllm-arg=--load-format=dummy --timeout 400 --output "$out" --append "$@"
