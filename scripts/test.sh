#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine (Python 3.11, no GPU,
# no PBS) and runs lint, types and the whole suite, the end-to-end tests with real vLLM on CPU included.
#   bash scripts/test.sh            everything
#   bash scripts/test.sh -m 'not e2e'   pytest arguments are passed through
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v shellcheck >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "== installing shellcheck and openssh-server (Debian packages)"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck openssh-server >/dev/null
fi

echo "== installing pbs-toolkit with its test extras into .venv"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

echo "== installing vLLM for CPU into .venv-vllm (the job's environment, separate from the tool's)"
bash scripts/setup_cpu_vllm.sh .venv-vllm

echo "== ruff and mypy"
.venv/bin/ruff check pbs_toolkit tests scripts
.venv/bin/mypy

echo "== pytest"
export PBSTK_TEST_VLLM_VENV="$PWD/.venv-vllm"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
