#!/usr/bin/env bash
# One device call of a session on a lent 4-GPU machine, from the checkout root there, results under OUT:
#   bash benchmarks/gpu/session.sh setup          install vLLM (the staged parts), pbstk's wheels and the router,
#                                                 compile the bytecode once, write the models
#   bash benchmarks/gpu/session.sh A|...|J        one step of issue 28/30/31's measurements (below); each starts by
#                                                 cancelling whatever an earlier, cut call left running
# A: GPUs 0,1 dp2 then a 2-replica service at c=256 and 1024 (issue 28), beside it GPU 2 three models packed and
#    alone, GPU 3 three models swapped (issue 31). B: GPUs 0,1 the autoscaled burst and the 1-replica service at c=512
#    (28), GPU 2 `run --each` against separate runs (31), GPU 3 the VL image chat and the text-only switch (30).
# C, D: the VL model's `pbstk tune` on all four GPUs with images (30), split in two calls (one call is at most 600 s).
# E: what A and B left open after session 10, in one call: GPUs 0,1 the autoscaled burst then the 1-replica service
#    at c=512 (28, BURST1 prompts, default 4000), GPU 2 three models packed and alone, GPU 3 `run --each` (31).
# What session 11 left open, in four calls: G, H the VL tune of baseline-eager,dp4 then tp4,tp2dp2 (30; pbstk's own
# client, see run_vl.sh); I dp2 on GPUs 0,1 beside the 2-replica service on GPUs 2,3 at c=256 and 1024, at the same
# time (28); J the separate `pbstk run`s of the 1.7B (GPU 2) and the 4B (GPU 3), each the model alone on a whole
# GPU (31's packed against alone) and its node-hours (31's `run --each` against separate runs).
# On a lent 2-GPU machine (no 4-GPU kind lent, session 13): I2 is I with dp2 and then the service on GPUs 0,1, one
# after the other (PROMPTS28 prompts a level, default 4000, so that both fit one call), and I2N its service without
# the front (router_isolation: none), and R2 dp2 then the service at c=1024 three times each; V2 is what pbstk's
# client drives on that host, then dp2's VL tune with images (30's common ceiling near 30 requests a second: client
# or server?). On a lent 1-GPU machine (session 14): R1, the plain `single` job against a 1-replica service of it;
# R1X, that service's levels each beside the same level straight at its replica, with each process's CPU; R1K, the
# service again with its load through the router alone.
# CLIENT=builtin measures I, I2, I2N and R2 with pbstk's own client in several processes (run_service.sh): at c=256
# and 1024 one `vllm bench serve` process drove 122-175 requests/s, about what one client process can there.
# Session 15 (1 GPU, issues 41-43): X, the kill -9 of a replica's API server and two one-GPU launches on the one GPU
# (run_crash.sh); P, three models packed with the GPU given out whole, each alone, together and the 4B at c=256, with
# vLLM's memory lines (run_models.sh); AS, the API-server count 1, 2, 4 at c=256, 512, 1024 (run_api_servers.sh);
# S1, the plain `single` against its 1-replica service at c=512 and 1024 with API_SERVERS (default 2) processes.
# STEP_S (default 540) bounds the whole step: every stream ends by then.
set -uo pipefail
out=${OUT:?OUT: where the results go}
step=${1:?setup|A|B|C|D|E|G|H|I|I2|I2N|R1|R1X|R1K|R2|J|K|V2|X|P|AS|S1}
cap=${STEP_S:-540}
# shellcheck source=benchmarks/gpu/setup_device.sh
source benchmarks/gpu/setup_device.sh
clean() {  # what a cut call left: pbstk's jobs and services, then any vLLM or router still holding a GPU
  python3 -m pbs_toolkit cancel --all >/dev/null 2>&1 || true
  pkill -f '[v]llm serve|[v]llm-router|[p]bstk_swapper' 2>/dev/null || true  # [v]: never this shell's own line
  for _ in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break
    sleep 1
  done
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' '; echo
}
deadline=$(( $(date +%s) + cap ))
stream() {  # NAME COMMAND...: one stream, cut at the step's deadline (streams that follow each other share it)
  local name=$1 left; shift
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 5 ] || { echo "[$name] no time left" | tee "$out/$name.log"; return 0; }
  timeout "$left" "$@" >"$out/$name.log" 2>&1; echo "[$name] exit $?" | tee -a "$out/$name.log"
}
mkdir -p "$out"
case "$step" in
  setup)
    python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1 || true
    [ -x /tmp/pbstk-site/bin/vllm-router ] \
      || python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/pbstk-site gpu-stage/router/*.whl
    for size in 0.6b 4b 8b; do
      [ -f "/root/qwen3-$size/config.json" ] || python3 benchmarks/gpu/mkmodel_qwen3.py "$size" "/root/qwen3-$size" &
    done
    [ -f /root/qwen3-vl-2b/config.json ] || python3 benchmarks/gpu/mkmodel_vl.py /root/qwen3-vl-2b &
    # vLLM's registry probe of each model class (27-35 s of a first start here), once into the shared modelinfos
    # every compile-cache key links to (docs/coldstart.md), so that no step's first start pays it
    for arch in Qwen3ForCausalLM Qwen3VLForConditionalGeneration; do
      VLLM_CACHE_ROOT=/tmp/vllm-compile-cache python3 -c 'import sys
from vllm.model_executor.models.registry import ModelRegistry
print(sys.argv[1], "probed:", ModelRegistry._try_inspect_model_cls(sys.argv[1]) is not None)' "$arch" 2>&1 | tail -1 &
    done
    wait
    for root in /tmp/vcc-packed /tmp/vcc-each; do mkdir -p "$root" && cp -r /tmp/vllm-compile-cache/modelinfos "$root/"; done
    ls /tmp/vllm-compile-cache/modelinfos
    nvidia-smi -L; nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-200
    python3 -c 'import vllm; print("vllm", vllm.__version__)' ;;
  A)
    clean
    CUDA_VISIBLE_DEVICES=2 PORT=8300 CACHE_ROOT=/tmp/vcc-packed PROMPTS=${PROMPTS31:-300} \
      stream m-packed bash benchmarks/gpu/run_models.sh "$out/m" packed &
    CUDA_VISIBLE_DEVICES=3 PORT=8400 CACHE_ROOT=/tmp/vcc-swap stream m-swap bash benchmarks/gpu/run_models.sh "$out/m" swap &
    CUDA_VISIBLE_DEVICES=0,1 LEVELS="256 1024" C1=0 PAIR=0 stream s-latency bash benchmarks/gpu/run_service.sh "$out/s" dp2 service
    wait ;;
  B)
    clean
    CUDA_VISIBLE_DEVICES=2 PORT=8300 CACHE_ROOT=/tmp/vcc-packed PROMPTS=${PROMPTS31:-300} \
      stream m-each bash benchmarks/gpu/run_models.sh "$out/m" each &
    CUDA_VISIBLE_DEVICES=3 PORT=8400 CACHE_ROOT=/tmp/vcc-vl1 GPUS=1 PRESET=single stream vl-chat bash benchmarks/gpu/run_vl.sh "$out/v" chat &
    CUDA_VISIBLE_DEVICES=0,1 BURST=12000 stream s-burst bash benchmarks/gpu/run_service.sh "$out/s" autoscale-c512 svc1-c512
    wait ;;
  E)
    clean
    CUDA_VISIBLE_DEVICES=2 PORT=8300 CACHE_ROOT=/tmp/vcc-packed PROMPTS=${PROMPTS31:-300} \
      stream m-packed bash benchmarks/gpu/run_models.sh "$out/m" packed &
    CUDA_VISIBLE_DEVICES=3 PORT=8400 CACHE_ROOT=/tmp/vcc-each PROMPTS=${PROMPTS31:-300} \
      stream m-each bash benchmarks/gpu/run_models.sh "$out/m" each &
    CUDA_VISIBLE_DEVICES=0,1 BURST=12000 stream s-burst bash benchmarks/gpu/run_service.sh "$out/s" autoscale-c512
    CUDA_VISIBLE_DEVICES=0,1 BURST=${BURST1:-4000} stream s-svc1 bash benchmarks/gpu/run_service.sh "$out/s1" svc1-c512
    wait ;;
  G)  # first what pbstk's own client can drive on this host (its ceiling bounds the tune's figures)
    clean; python3 benchmarks/cpu/bench_client_ceiling.py --prompts 256 2>&1 | tee "$out/client-ceiling.txt"
    stream vl-tune-g bash benchmarks/gpu/run_vl.sh "$out/v" tune baseline-eager,dp4 ;;
  H) clean; stream vl-tune-h bash benchmarks/gpu/run_vl.sh "$out/v" tune tp4,tp2dp2 ;;
  I)
    clean
    CUDA_VISIBLE_DEVICES=2,3 PORT=8200 LEVELS="256 1024" C1=0 PAIR=0 \
      stream s-service bash benchmarks/gpu/run_service.sh "$out/svc" service &
    CUDA_VISIBLE_DEVICES=0,1 LEVELS="256 1024" stream s-dp2 bash benchmarks/gpu/run_service.sh "$out/dp2" dp2
    wait ;;
  I2)
    clean
    CUDA_VISIBLE_DEVICES=0,1 LEVELS="256 1024" C1=0 PAIR=0 PROMPTS=${PROMPTS28:-4000} \
      stream s-dp2-service bash benchmarks/gpu/run_service.sh "$out/s" dp2 service ;;
  I2N)  # I2's service with its router reached directly (router_isolation: none), not through the front
    clean
    CUDA_VISIBLE_DEVICES=0,1 LEVELS="256 1024" C1=0 PAIR=0 PROMPTS=${PROMPTS28:-4000} ISOLATION=none \
      stream s-service-none bash benchmarks/gpu/run_service.sh "$out/s" service ;;
  R2)  # I2 at c=1024 only, three levels of each side (one pair of levels moved by more than the bar's 5%)
    clean
    CUDA_VISIBLE_DEVICES=0,1 LEVELS=1024 C256=0 REPEAT=3 C1=0 PAIR=0 PROMPTS=${PROMPTS28:-4096} \
      stream s-repeat bash benchmarks/gpu/run_service.sh "$out/s" dp2 service ;;
  R1)  # one GPU (session 14 was lent no 2-GPU kind): `single` as a plain job, then as a 1-replica service behind
        # the router and its front, at c=1024 three times each: what R2's open question (the service at c=1024)
        # costs without a second GPU's balance in it
    clean
    CUDA_VISIBLE_DEVICES=0 LEVELS=1024 C256=0 REPEAT=3 C1=0 REPLICAS=1 PROMPTS=${PROMPTS28:-4096} \
      stream s-repeat1 bash benchmarks/gpu/run_service.sh "$out/s" single service ;;
  R1X)  # R1's service again, each level followed by the same level straight at its replica, every process's CPU
         # sampled; then the service without the front (router_isolation: none): where R1's service lost its tokens/s
    clean
    CUDA_VISIBLE_DEVICES=0 LEVELS=1024 C256=0 REPEAT=2 C1=0 REPLICAS=1 DIRECT=1 CPU_TOP=1 PROMPTS=${PROMPTS28:-4096} \
      stream s-direct1 bash benchmarks/gpu/run_service.sh "$out/s" service
    CUDA_VISIBLE_DEVICES=0 LEVELS=1024 C256=0 REPEAT=2 C1=0 REPLICAS=1 CPU_TOP=1 ISOLATION=none \
      PROMPTS=${PROMPTS28:-4096} stream s-none1 bash benchmarks/gpu/run_service.sh "$out/n" service ;;
  R1K)  # R1X's service again with all its load through the router (R1X's levels straight at the replica took it
         # out of the router), the keeper saying what the router saw: at c=1024 its busy replica must stay in it
    clean
    CUDA_VISIBLE_DEVICES=0 LEVELS=1024 C256=0 REPEAT=2 C1=0 REPLICAS=1 CPU_TOP=1 PROMPTS=${PROMPTS28:-4096} \
      stream s-keeper1 bash benchmarks/gpu/run_service.sh "$out/s" service ;;
  V2)
    clean; python3 benchmarks/cpu/bench_client_ceiling.py --prompts 256 2>&1 | tee "$out/client-ceiling.txt"
    GPUS=2 stream vl-tune-dp2 bash benchmarks/gpu/run_vl.sh "$out/v" tune dp2 ;;
  J)  # each separate run is also the model alone on a whole GPU: the same c=64 bench as packed's
    clean
    CUDA_VISIBLE_DEVICES=2 PORT=8300 CACHE_ROOT=/tmp/vcc-packed PROMPTS=${PROMPTS31:-300} MODELS="q17:1.7b" \
      stream m-sep-q17 bash benchmarks/gpu/run_models.sh "$out/m17" sep &
    CUDA_VISIBLE_DEVICES=3 PORT=8400 CACHE_ROOT=/tmp/vcc-each PROMPTS=${PROMPTS31:-300} MODELS="q4:4b" \
      stream m-sep-q4 bash benchmarks/gpu/run_models.sh "$out/m4" sep
    wait ;;
  K)  # 31's packed, `run --each` and the 0.6B's separate run on the machine of J (GPUs 1, 2, 3)
    clean
    CUDA_VISIBLE_DEVICES=1 PORT=8200 PROMPTS=${PROMPTS31:-300} stream m-packed bash benchmarks/gpu/run_models.sh "$out/m" packed &
    CUDA_VISIBLE_DEVICES=2 PORT=8300 CACHE_ROOT=/tmp/vcc-packed PROMPTS=${PROMPTS31:-300} \
      stream m-each bash benchmarks/gpu/run_models.sh "$out/e" each &
    CUDA_VISIBLE_DEVICES=3 PORT=8400 CACHE_ROOT=/tmp/vcc-each PROMPTS=${PROMPTS31:-300} MODELS="q06:0.6b" \
      stream m-sep-q06 bash benchmarks/gpu/run_models.sh "$out/m06" sep
    wait ;;
  X) clean; stream crash bash benchmarks/gpu/run_crash.sh "$out/x" crash booking ;;
  P)
    clean
    SOLO=0 WIDE=q4:4b:256 PROMPTS=${PROMPTS31:-300} stream m-packed bash benchmarks/gpu/run_models.sh "$out/m" packed ;;
  AS) clean; stream api-servers bash benchmarks/gpu/run_api_servers.sh "$out/a" "${COUNTS:-1 2 4}" ;;
  S1)
    clean
    CUDA_VISIBLE_DEVICES=0 LEVELS="512 1024" C256=0 C1=0 REPLICAS=1 CLIENT=builtin API_SERVERS=${API_SERVERS:-2} \
      PROMPTS=${PROMPTS28:-4096} stream s-plain-service bash benchmarks/gpu/run_service.sh "$out/s" single service ;;
  C) clean; stream vl-tune-1 bash benchmarks/gpu/run_vl.sh "$out/v" tune dp4,baseline-eager ;;
  D) clean; stream vl-tune-2 bash benchmarks/gpu/run_vl.sh "$out/v" tune tp4,tp2dp2 ;;
  *) echo "unknown step: $step" >&2; exit 2 ;;
esac
grep -h -E '^\[|^== ' "$out"/*.log 2>/dev/null | grep -v -E '^\[ +[0-9]+s\]' | tail -n 80
# two archives, so that the call's limit on the number of files returned drops none: the results, and the run
# directories (vLLM's logs) without the servers' keys
tar czf "$out/runs-$step.tgz" --exclude='api_key' --exclude='*api_key*' -C ~/pbstk-runs . 2>/dev/null || true
(cd "$out" && tar czf "results-$step.tgz" --exclude='*.tgz' --exclude='endpoints.py' . 2>/dev/null) || true
# a call returns at most 8 files: leave the two archives and the streams' logs, so that none of them is dropped
# (session 13 lost a whole step's results to that limit when two steps shared one call)
find "$out" -mindepth 2 -type f -delete 2>/dev/null || true
find "$out" -maxdepth 1 -type f ! -name '*.tgz' ! -name '*.log' -delete 2>/dev/null || true
find "$out" -mindepth 1 -depth -type d -empty -delete 2>/dev/null || true
