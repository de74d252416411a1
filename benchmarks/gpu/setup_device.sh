#!/usr/bin/env bash
# Sourced on a lent GPU machine from the checkout root: vLLM 0.22.1 (shared/gpu/install-on-device.sh, staged
# under gpu-stage/tools), the wheels pbstk needs that the image lacks (gpu-stage/extra), and the model.
# shellcheck disable=SC1091
source gpu-stage/tools/install-on-device.sh
if [ ! -f /tmp/pbstk-site/.done ]; then
  mkdir -p /tmp/pbstk-site
  for whl in gpu-stage/extra/*.whl; do
    mod=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    [ "$mod" = pyyaml ] && mod=yaml
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/pbstk-site "$whl"
  done
  touch /tmp/pbstk-site/.done
fi
export PYTHONPATH="$PWD:$PYTHONPATH:/tmp/pbstk-site"
[ -f /root/qwen3-1.7b/config.json ] || python3 gpu-stage/tools/mkmodel.py /root/qwen3-1.7b
