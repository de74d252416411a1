"""job helper, swapping models: wakes the model a request waits for, sleeps the least recently busy one.

Written into a swapping job's run directory by pbstk's start_vllm.sh and run there, on the job's node, beside
its vLLMs (docs/multi-model.md "Swapping"). Standard library only: it runs in the vLLM's own Python.

Every ``TICK_S`` it asks each swapping model's API server on this node's loopback how many requests are in
flight there (``GET /pbstk/inflight``, counted by pbstk_dev_guard.py: vLLM's own gauges say nothing of a request
held for a sleeping engine, which does not step) and acts on the GPU set (``SET``) each model shares with others,
at most ``--max-awake`` awake:

* a sleeping model with requests in flight (vLLM holds a request for a sleeping engine; it never refuses it) is
  woken; first, while its set has K awake, one of them sleeps: an idle one, least recently busy first; a busy
  one only once the sleeper has waited ``FAIR_S`` and that one has been awake as long (``mode=wait``: its
  running requests finish first);
* with ``--sleep-after S``, an awake model idle for S seconds sleeps;
* after each sleep the model's log line "Sleep mode freed X GiB memory, Y GiB memory is still in use" is read:
  a Y grown by more than ``LEAK_GIB`` over that model's first one (vLLM's known leak over long rotations) ends
  the swapper (``LEAK_EXIT``); the job's watcher then fails the job, which the service replaces with fresh vLLMs.
  Y is the whole GPU's memory in use, every process's (on 4x H100, vLLM 0.22.1: 2.23 GiB after the first of three
  models slept, 4.46 after the second, 6.19 once all three slept), so a sleep is compared only with an earlier one
  of the same model while the same others of its set were awake.

It writes ``RUN_DIR/swap.json`` (each model's state, wakes, sleeps and the last switch times: ``pbstk status``
shows them) and appends to ``RUN_DIR/models.events.jsonl`` one line per change (``{"t", "model", "event":
"awake"|"asleep", "seconds"}``: usage splits the GPUs' time by it). Sleep and wake carry the job's key: the
development endpoints are guarded (pbstk_dev_guard.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import time

TICK_S = 0.2
#: a busy model is put to sleep for a waiting one only after both waited / were awake this long (no thrashing)
FAIR_S = 5.0
#: GiB a model may hold asleep beyond its first sleep's figure before its job is restarted
LEAK_GIB = 2.0
#: seconds a sleep or a wake may take (a wake loads the weights back from CPU memory)
SWITCH_TIMEOUT_S = 600.0
#: the swapper's exit code when a model leaked (its job then fails naming the swapper, the line above says why)
LEAK_EXIT = 3
_STILL_IN_USE = re.compile(r"([0-9.]+) GiB memory is still in use")


class Model:
    def __init__(self, served: str, port: int, group: str, log: str) -> None:
        self.served, self.port, self.group, self.log = served, port, group, log
        self.awake = True
        self.inflight = 0  # requests in its API server now (for a sleeping model: held, waiting for it)
        self.last_busy = self.awake_since = self.waiting_since = 0.0
        self.wakes = self.sleeps = 0
        self.last_wake_s: float | None = None
        self.last_sleep_s: float | None = None
        self.asleep_gib: float | None = None
        #: the first figure of each sleep, by the others of its set awake then (the GPU's memory in use includes theirs)
        self.first_asleep_gib: dict[tuple[str, ...], float] = {}

    def state(self) -> dict[str, object]:
        return {"awake": self.awake, "group": self.group, "wakes": self.wakes, "sleeps": self.sleeps,
                "last_wake_s": self.last_wake_s, "last_sleep_s": self.last_sleep_s, "asleep_gib": self.asleep_gib}


def decide(models: list[Model], max_awake: int, now: float, sleep_after: float) -> list[tuple[str, Model]]:
    """What to do now: ``("sleep", m)`` and ``("wake", m)`` in order (pure; the tests call it)."""
    actions: list[tuple[str, Model]] = []
    awake = {id(m): m.awake for m in models}
    for m in models:  # idle too long (--sleep-after)
        if sleep_after and m.awake and not m.inflight and now - max(m.last_busy, m.awake_since) >= sleep_after:
            actions.append(("sleep", m))
            awake[id(m)] = False
    wanted = sorted((m for m in models if not awake[id(m)] and m.inflight), key=lambda m: m.waiting_since or now)
    for m in wanted:
        peers = [p for p in models if p.group == m.group and p is not m and awake[id(p)]]
        while len(peers) >= max_awake:
            idle = [p for p in peers if not p.inflight]
            fair = [p for p in peers if now - (m.waiting_since or now) >= FAIR_S and now - p.awake_since >= FAIR_S]
            pool = idle or fair
            if not pool:
                break
            victim = min(pool, key=lambda p: (p.last_busy, p.served))
            actions.append(("sleep", victim))
            awake[id(victim)] = False
            peers.remove(victim)
        if len(peers) < max_awake:
            actions.append(("wake", m))
            awake[id(m)] = True
    return actions


class Swapper:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.models = [Model(s, int(p), g, log) for s, p, g, log in args.model]
        with open(os.path.join(args.run_dir, "api_key"), encoding="utf-8") as f:
            self.key = f.read().strip()

    def call(self, m: Model, method: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.args.host, m.port, timeout=timeout)
        try:
            conn.request(method, path, headers={"Authorization": f"Bearer {self.key}", "Content-Length": "0"})
            answer = conn.getresponse()
            return answer.status, answer.read()
        finally:
            conn.close()

    def look(self, m: Model, now: float) -> None:
        try:
            status, body = self.call(m, "GET", "/pbstk/inflight", timeout=2.0)
            inflight = int(json.loads(body)["inflight"]) if status == 200 else None
        except (OSError, ValueError, KeyError, TypeError):
            inflight = None
        if inflight is None:
            return  # a busy API server answers late: the next tick looks again
        m.inflight = inflight
        if m.inflight:
            m.last_busy = now
        if m.inflight and not m.awake and not m.waiting_since:
            m.waiting_since = now
        elif not m.inflight or m.awake:
            m.waiting_since = 0.0

    def switch(self, action: str, m: Model) -> bool:
        path = "/sleep?level=1&mode=wait" if action == "sleep" else "/wake_up"
        began = time.time()
        try:
            status, body = self.call(m, "POST", path, timeout=SWITCH_TIMEOUT_S)
        except OSError as exc:
            log(f"model {m.served}: {action} failed: {exc}")
            return False
        took = time.time() - began
        if status != 200:
            log(f"model {m.served}: {action} answered {status}: {body[:200]!r}")
            return False
        m.awake = action == "wake"
        if m.awake:
            m.wakes, m.last_wake_s, m.awake_since = m.wakes + 1, round(took, 3), time.time()
        else:
            m.sleeps, m.last_sleep_s = m.sleeps + 1, round(took, 3)
            self.check_leak(m)
        log(f"model {m.served}: {'woke' if m.awake else 'fell asleep'} in {took:.2f} s")
        self.event(m, "awake" if m.awake else "asleep", took)
        return True

    def check_leak(self, m: Model) -> None:
        m.asleep_gib = last_still_in_use(m.log)
        if m.asleep_gib is None:
            return
        awake = tuple(sorted(o.served for o in self.models if o.group == m.group and o.awake and o is not m))
        first = m.first_asleep_gib.setdefault(awake, m.asleep_gib)
        if m.asleep_gib > first + LEAK_GIB:
            log(f"error: model {m.served} holds {m.asleep_gib:.2f} GiB asleep, more than {LEAK_GIB:g} GiB over its "
                f"first sleep beside the same models awake ({first:.2f}): vLLM's sleep-mode leak; ending the job (the "
                "service restarts it)")
            self.write_state()
            sys.exit(LEAK_EXIT)  # the job's watcher sees the swapper end: the job FAILS, and is replaced

    def event(self, m: Model, what: str, took: float | None) -> None:
        line = json.dumps({"t": round(time.time(), 3), "model": m.served, "event": what,
                           "seconds": None if took is None else round(took, 3)})
        with open(os.path.join(self.args.run_dir, "models.events.jsonl"), "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def write_state(self) -> None:
        path = os.path.join(self.args.run_dir, "swap.json")
        data = {"max_awake": self.args.max_awake, "sleep_after_s": self.args.sleep_after, "updated": time.time(),
                "models": {m.served: m.state() for m in self.models}}
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    def wait_listening(self) -> None:
        """Until every model answers ``/health``; the job's first model (port 0: it starts last, on a port its
        start script picks) once ``server.json`` says it is ready. Gone with the script."""
        for m in self.models:
            while True:
                if not m.port:
                    m.port = marker_port(self.args.run_dir)
                try:
                    if m.port and self.call(m, "GET", "/health")[0] == 200:
                        break
                except OSError:
                    pass
                try:
                    os.kill(self.args.script_pid, 0)
                except OSError:
                    sys.exit(0)
                time.sleep(1.0)

    def start(self) -> None:
        """Each model's state as its engine reports it; then up to K awake in each set (the first listed)."""
        self.wait_listening()
        now = time.time()
        for m in self.models:
            try:
                status, body = self.call(m, "GET", "/is_sleeping")
                m.awake = not (status == 200 and json.loads(body).get("is_sleeping"))
            except (OSError, ValueError):
                m.awake = True
            m.awake_since = m.last_busy = now
            self.event(m, "awake" if m.awake else "asleep", None)
        for m in self.models:
            peers = [p for p in self.models if p.group == m.group and p.awake]
            if not m.awake and len(peers) < self.args.max_awake:
                self.switch("wake", m)
        self.write_state()

    def run(self) -> None:
        self.start()
        while True:
            now = time.time()
            for m in self.models:
                self.look(m, now)
            actions = [(a, m) for a, m in decide(self.models, self.args.max_awake, now, self.args.sleep_after)
                       if (a == "wake") != m.awake]
            for action, m in actions:
                if not self.switch(action, m):
                    break  # a sleep that failed: no wake beside it (the GPUs would not hold both)
            if actions:
                self.write_state()
            time.sleep(TICK_S)


def marker_port(run_dir: str) -> int:
    """The port of the job's first model: ``server.json``'s, once its phase is ``ready``; 0 before."""
    try:
        with open(os.path.join(run_dir, "server.json"), encoding="utf-8") as f:
            marker = json.load(f)
        return int(marker["port"]) if marker.get("phase") == "ready" else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def last_still_in_use(path: str) -> float | None:
    """The GiB the last "... GiB memory is still in use" line of a vLLM log names (its last 64 KiB read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = _STILL_IN_USE.findall(tail)
    return float(found[-1]) if found else None


def log(message: str) -> None:
    print(time.strftime("%Y-%m-%d %H:%M:%S"), "pbstk swapper:", message, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pbstk_swapper.py")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-awake", type=int, required=True)
    parser.add_argument("--sleep-after", type=float, default=0.0)
    parser.add_argument("--script-pid", type=int, required=True)
    parser.add_argument("--model", nargs=4, action="append", required=True, metavar=("SERVED", "PORT", "SET", "LOG"))
    Swapper(parser.parse_args(argv)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
