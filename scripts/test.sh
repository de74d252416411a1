#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine (Python 3.11, no GPU,
# no PBS) and runs lint, types and the whole suite, the end-to-end tests with real vLLM on CPU included.
#   bash scripts/test.sh            everything
#   bash scripts/test.sh -m 'not e2e'   pytest arguments are passed through
#   PBSTK_TEST_WORKERS=0 bash scripts/test.sh   one process (default: 6 pytest-xdist workers; most tests wait on
#                                     servers and schedulers rather than compute, so more workers than cores pay)
set -euo pipefail
cd "$(dirname "$0")/.."

# What a bare Debian + Python 3.11 lacks: python3-venv (ensurepip, for `python3 -m venv`), shellcheck (render
# tests), openssh-server and -client (sshd, ssh-keygen: the login-node tests), hostname (the job scripts),
# libnuma1 (vLLM's CPU build links libnuma.so.1), slurmctld slurmd slurm-client munge (the real two-node Slurm
# that tests/slurm_cluster.py starts on loopback). Installed only where missing.
need=()
python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
command -v hostname >/dev/null 2>&1 || need+=(hostname)
dpkg -s libnuma1 >/dev/null 2>&1 || need+=(libnuma1)
[ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
[ -x /usr/sbin/munged ] || need+=(munge)
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
apt_install() {
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
# The three installs wait on disks and archives more than on CPU: they run side by side (a minute or more less on
# a fresh 2-core machine), each into a log of its own that is shown when it fails. python3-venv comes first when
# it is missing: both venvs need it.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
if [[ " ${need[*]} " == *" python3-venv "* ]]; then
  echo "== installing ${need[*]} (Debian packages)"
  apt_install "${need[@]}"
  need=()
fi
step() {  # NAME COMMAND...: in the background, its output in $logs/NAME
  "${@:2}" >"$logs/$1" 2>&1 &
  pid[$1]=$!
}
finish() {  # NAME...: wait for these steps; the log of each that failed is shown, and the run ends
  local name failed=0
  for name in "$@"; do
    [ -n "${pid[$name]:-}" ] || continue
    if ! wait "${pid[$name]}"; then
      echo "== $name failed:" >&2
      cat "$logs/$name" >&2
      failed=1
    fi
    unset "pid[$name]"
  done
  [ "$failed" = 0 ] || stop_all
}
stop_all() {  # a step or the lint failed: the steps still running go, and the run ends
  local name
  for name in "${!pid[@]}"; do kill "${pid[$name]}" 2>/dev/null || true; done
  exit 1
}
declare -A pid=()
echo "== installing vLLM for CPU into .venv-vllm (the job's environment, separate from the tool's)"
step vllm bash scripts/setup_cpu_vllm.sh .venv-vllm
if [ "${#need[@]}" -gt 0 ]; then
  echo "== installing ${need[*]} (Debian packages)"
  step apt apt_install "${need[@]}"
fi
echo "== installing pbs-toolkit with its test extras into .venv"
step tool bash -c '{ [ -x .venv/bin/python ] || python3 -m venv .venv; } &&
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"'
finish tool

# while vLLM still installs (the longest of the three)
echo "== ruff and mypy"
lint=0
.venv/bin/ruff check pbs_toolkit tests scripts benchmarks || lint=1
.venv/bin/mypy || lint=1
[ "$lint" = 0 ] || stop_all
finish apt vllm
rm -rf "$logs"
trap - EXIT

# The bytecode of pbs_toolkit and of the tests' stand-ins, written once now: the suite starts about a thousand
# Python processes that import them (keepers, routers' fronts, fake PBS tools, stand-ins), and where
# PYTHONDONTWRITEBYTECODE is set (this workplace's machines set it) none of them may write it, so each compiled what
# it imported, every time (a keeper's imports: 285 instead of 189 ms of CPU). pip did the same for the venvs.
.venv/bin/python -m compileall -q -j 0 pbs_toolkit tests >/dev/null

echo "== pytest"
export PBSTK_TEST_VLLM_VENV="$PWD/.venv-vllm"
export PBSTK_TEST_REQUIRE_SSHD=1  # sshd was installed above: a missing one fails the SSH tests, never skips them
export PBSTK_TEST_REQUIRE_SLURM=1  # so was Slurm: a missing one fails the Slurm tests, never skips them
# Parallel: tests that share a costly session fixture (the Slurm cluster, the render matrix) are one xdist group on
# one worker (tests/conftest.py marks them); the e2e tests are collected first so the longest start first.
# --durations=20: the slowest tests at the end of every run.
workers="${PBSTK_TEST_WORKERS:-6}"
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadgroup)
# --reruns 2: a test that fails is run again, at most twice, and the run reports it as rerun ("R"): on 2 shared
# cores with the e2e tier running, a different timing-bound test lost now and then in fresh-clone runs (see the
# closing notes); a test that fails three times in a row still fails the run. Set PBSTK_TEST_RERUNS=0 to see them.
# -rfER: the usual failed/error summary, and each rerun test named at the end (a flaky test is found and fixed,
# not hidden).
reruns="${PBSTK_TEST_RERUNS:-2}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${parallel[@]}" --reruns "$reruns" -rfER --durations=20 "$@"
