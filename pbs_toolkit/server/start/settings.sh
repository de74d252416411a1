# shellcheck shell=bash
# The static body of every rendered start_vllm.sh (the parts in pbs_toolkit/server/start/, joined in render.py's
# START_PARTS order): plain bash that reads the settings header the launch rendered in front of it; no Jinja here.
# The settings the header assigns (start_vllm.sh.j2, server/phases.py), declared so that shellcheck of this body
# alone knows them and flags any other name (a misspelt $PHASE_SETUPP) as never assigned; `declare NAME` without
# a value keeps the header's, and a setting the header lacks stays unset (set -u stops at its first use).
# tests/test_start_script.py checks this list against the header.
declare RUN_DIR MODEL VENV PROXY HF_HOME_DIR HF_HUB_OFFLINE_ON VLLM_CACHE_DIR ADDRESS_MODE ADDRESS_SUFFIX BIND_HOST
declare PORT_LO FIXED_PORT PORT_SPAN VLLM_ENTRYPOINT EAGER DEVICE COMPILE_ERROR_RE PORT_IN_USE_RE IDLE_CANCEL_S LEASE_S
declare NNODES NODE_ENGINE TP PP DP DP_LOCAL NODE_LAUNCHER NCCL_IFNAME GLOO_IFNAME
declare PHASE_SETUP PHASE_STARTING PHASE_READY PHASE_FAILED PHASE_EXITED PHASE_CANCELLED
declare CACHE_KEY_MODEL CACHE_KEY_LAYOUT CONTAINER_IMAGE CONTAINER_RUNTIME API_KEY_VIA
declare -a SITE_SETUP ENV_EXPORTS VLLM_ARGS
set -uo pipefail
