#!/usr/bin/env bash
# Issue 29's SIGILL on AMX Xeons: the mechanism, checked on any Linux x86-64 machine with AMX (no vLLM needed).
# Linux lets a process execute AMX tile instructions only after it asked for the permission
# (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); a tile instruction without it is killed with SIGILL (exit
# -4 / 132). One tile instruction is run (a) without asking, (b) after asking, (c) in a program exec'd by a process
# that asked, (d) in a child forked after asking; then from Python (ctypes) (e) plainly, (f) with the sitecustomize
# that pbstk's start script writes on AMX CPUs (server/start/amx.sh), (g) in a multiprocessing "spawn" child of such
# a process (how vLLM-CPU starts its workers).
# Usage: bash benchmarks/cpu/amx_probe.sh   (needs cc and python3; prints one block per case)
set -uo pipefail
grep -qw amx_tile /proc/cpuinfo || { echo "no amx_tile on this CPU: nothing to probe"; exit 0; }
here=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/tile.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <immintrin.h>
static void ask(void) { long r = syscall(SYS_arch_prctl, 0x1023, 18); printf("  arch_prctl(REQ_XCOMP_PERM, 18) = %ld\n", r); fflush(stdout); }
void tile(void) {
  unsigned char cfg[64]; memset(cfg, 0, sizeof cfg); cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
  _tile_loadconfig(cfg); _tile_zero(0); _tile_release();
  printf("  tile instructions ran\n"); fflush(stdout);
}
int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "none";
  if (!strcmp(mode, "ask") || !strcmp(mode, "ask-exec") || !strcmp(mode, "ask-fork")) ask();
  if (!strcmp(mode, "ask-exec")) { execl(argv[0], argv[0], "none", (char *)0); return 99; }
  if (!strcmp(mode, "ask-fork")) { pid_t p = fork(); if (p == 0) { tile(); _exit(0); } int s; waitpid(p, &s, 0);
    printf("  forked child: %s %d\n", WIFSIGNALED(s) ? "signal" : "exit", WIFSIGNALED(s) ? WTERMSIG(s) : WEXITSTATUS(s)); return 0; }
  tile();
  return 0;
}
C
if ! cc -O1 -mamx-tile -o "$dir/tile" "$dir/tile.c" || ! cc -O1 -mamx-tile -shared -fPIC -o "$dir/tile.so" "$dir/tile.c"; then
  echo "cannot compile the probe"; exit 0
fi
for mode in none ask ask-exec ask-fork; do
  echo "== C: $mode"; "$dir/tile" "$mode"; echo "  exit $?"
done
# the start script's prelude, as it writes it (the Python between <<'PY' and PY in server/start/amx.sh)
mkdir -p "$dir/prelude"
sed -n "/<<'PY'/,/^PY\$/p" "$here/pbs_toolkit/server/start/amx.sh" | sed '1d;$d' >"$dir/prelude/sitecustomize.py"
call="import ctypes, sys; ctypes.CDLL(sys.argv[1]).tile()"
echo "== python, no prelude"; python3 -c "$call" "$dir/tile.so"; echo "  exit $?"
echo "== python with the prelude"
PYTHONPATH="$dir/prelude" python3 -c "import os; print('  PBSTK_AMX =', os.environ.get('PBSTK_AMX')); $call" "$dir/tile.so"
echo "  exit $?"
echo "== a multiprocessing spawn child of a python with the prelude"
cat >"$dir/spawn.py" <<'PYEOF'
import ctypes, multiprocessing, sys
def child(path): ctypes.CDLL(path).tile()
if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    p.start(); p.join(); print("  spawned child exit", p.exitcode)
PYEOF
PYTHONPATH="$dir/prelude" python3 "$dir/spawn.py" "$dir/tile.so"
echo "== the same spawn child without the prelude"; python3 "$dir/spawn.py" "$dir/tile.so"
lscpu | grep -E 'Model name|^CPU\(s\)' | sed 's/^/  /'
uname -r | sed 's/^/  kernel /'
