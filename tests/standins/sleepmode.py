"""The stand-in vLLM's sleep mode (docs/multi-model.md "The stand-in's sleep mode"), as vLLM 0.22-0.32 behaves,
read from its source (entrypoints/serve/dev/sleep/api_router.py, v1/engine/core.py, v1/executor/abstract.py,
v1/metrics/loggers.py):

* ``POST /sleep?level=0|1|2&mode=abort|wait``, ``POST /wake_up[?tags=...]`` and ``GET /is_sleeping`` exist only
  with VLLM_SERVER_DEV_MODE=1; no API key guards them (vLLM's ``--api-key`` covers ``/v1`` only);
* sleep pauses the scheduler first: requests running then are aborted (``mode=abort``, the default) or finish
  first (``mode=wait``); requests sent while asleep are queued (in no metric: a paused engine does not step),
  never refused, and run after a full
  wake; level 1 frees the weights (kept in CPU RAM) and the KV cache, level 2 both, level 0 only pauses;
* ``wake_up`` with tags wakes those parts; the scheduler resumes only once nothing is asleep.

Knobs: PBSTK_TEST_STANDIN_WAKE_S (seconds a wake takes, default 0.2), PBSTK_TEST_STANDIN_SLEEP_S (falling asleep,
default 0.05), PBSTK_TEST_STANDIN_GPU_BYTES (the process's GPU memory awake, default 8 GiB; 1 GiB of CUDA graphs
and context stays while asleep), PBSTK_TEST_STANDIN_SLEEP_LEAK_GIB (each sleep leaves this much more behind, awake
and asleep: the leak over long rotations, vllm#36651; default 0). Without --enable-sleep-mode, a sleep of level
1 or 2 answers 500 (the stand-in's choice: nothing would be freed).
"""

import os
import threading
import time
from urllib.parse import parse_qs, urlsplit

PATHS = {"/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET"}
TAGS = ("weights", "kv_cache")
GIB = 1 << 30


def _seconds(name, default):
    return float(os.environ.get(name) or default)


class SleepMode:
    def __init__(self, argv, running, log, memory=lambda _used, _awake, _kept: None):
        # (bytes in use now, in use awake, kept asleep): the stand-in GPUs' ledger follows what sleep frees
        self.memory = memory
        self.enabled = "--enable-sleep-mode" in argv
        self.dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        self.running = running  # () -> requests running now
        self.log = log
        self.lock = threading.Lock()
        self.paused = False
        self.level = 0
        self.asleep = set()  # the tags whose memory is freed
        self.resumed = threading.Event()
        self.resumed.set()
        self.abort_epoch = 0
        self.gpu_bytes = int(os.environ.get("PBSTK_TEST_STANDIN_GPU_BYTES") or 8 * GIB)
        self.kept_bytes = min(GIB, self.gpu_bytes)

    # -- what the server's request paths ask ------------------------------------------------------------------

    def answer(self, method, raw_path):
        """(status, JSON body) for a sleep-mode path, or None: not one."""
        url = urlsplit(raw_path)
        if url.path not in PATHS:
            return None
        if not self.dev:  # not mounted: FastAPI's 404 (vLLM's --api-key guards /v1 only)
            return 404, {"detail": "Not Found"}
        if PATHS[url.path] != method:
            return 405, {"detail": "Method Not Allowed"}
        query = parse_qs(url.query)
        if url.path == "/is_sleeping":
            return 200, {"is_sleeping": self.is_sleeping()}
        if url.path == "/wake_up":
            return self.wake_up(query.get("tags") or None)
        return self.sleep(query)

    def wait_until_resumed(self):
        """A request that arrives while the scheduler is paused waits here, counted in no metric: vLLM's paused
        engine does not step, and its requests gauges come from its steps (the stand-in's own DEBUG line says it
        is held, for tests to wait on)."""
        if not self.resumed.is_set():
            self.log("DEBUG 11-22 02:40:00 [standin] a request is held: the engine is paused (asleep)")
        self.resumed.wait()

    def epoch(self):
        return self.abort_epoch

    def aborted(self, epoch):
        """Whether a sleep with mode=abort came since the request started running at ``epoch``."""
        return self.abort_epoch != epoch

    def is_sleeping(self):
        return self.paused or bool(self.asleep)

    def used_bytes(self):
        freed = (self.gpu_bytes - self.kept_bytes) * len(self.asleep) // len(TAGS)
        return self.gpu_bytes - freed

    def metrics(self, served):
        """vLLM's ``vllm:engine_sleep_state`` and the stand-in's own GPU memory gauge."""
        with self.lock:
            state = {"awake": 0 if self.is_sleeping() else 1,
                     "weights_offloaded": int(self.is_sleeping() and self.level == 1),
                     "discard_all": int(self.is_sleeping() and self.level == 2)}
            used = self.used_bytes()
        lines = ["# TYPE vllm:engine_sleep_state gauge"]
        lines += [f'vllm:engine_sleep_state{{engine="0",model_name="{served}",sleep_state="{k}"}} {v}.0'
                  for k, v in state.items()]
        lines += ["# HELP standin:gpu_memory_used_bytes the stand-in's GPU memory (what nvidia-smi would show)",
                  "# TYPE standin:gpu_memory_used_bytes gauge", f"standin:gpu_memory_used_bytes {used}.0"]
        return "\n".join(lines) + "\n"

    # -- sleep and wake -----------------------------------------------------------------------------------

    def sleep(self, query):
        level_text, mode = query.get("level", ["1"])[0], query.get("mode", ["abort"])[0]
        if not level_text.isdigit() or not 0 <= int(level_text) <= 2:  # FastAPI's Query(ge=0, le=2)
            return 422, {"detail": [{"type": "less_than_equal", "loc": ["query", "level"],
                                     "msg": "Input should be a valid integer between 0 and 2"}]}
        if mode not in ("abort", "wait", "keep"):
            return 422, {"detail": [{"type": "literal_error", "loc": ["query", "mode"],
                                     "msg": "Input should be 'abort', 'wait' or 'keep'"}]}
        if mode == "keep":
            return 400, {"error": "the stand-in does not do mode=keep"}
        level = int(level_text)
        if level >= 1 and not self.enabled:
            return 500, {"error": "sleep mode is not enabled: start with --enable-sleep-mode"}
        with self.lock:
            self.paused = True
            self.resumed.clear()
            if mode == "abort":
                self.abort_epoch += 1
        while mode == "wait" and self.running() > 0:  # in-flight requests finish first
            time.sleep(0.01)
        if level >= 1 and self.asleep:
            self.log("WARNING 11-22 02:40:00 [abstract.py:384] Executor is already sleeping.")
        elif level >= 1:
            took = _seconds("PBSTK_TEST_STANDIN_SLEEP_S", 0.05)
            time.sleep(took)
            with self.lock:
                before = self.used_bytes()
                self.asleep, self.level = set(TAGS), level
                leak = int(float(os.environ.get("PBSTK_TEST_STANDIN_SLEEP_LEAK_GIB") or 0) * GIB)
                self.gpu_bytes, self.kept_bytes = self.gpu_bytes + leak, self.kept_bytes + leak
                freed = before - self.used_bytes()
                self.memory(self.used_bytes(), self.gpu_bytes, self.kept_bytes)
            self.log(f"INFO 11-22 02:40:00 [gpu_worker.py:326] Sleep mode freed {freed / GIB:.2f} GiB memory, "
                     f"{self.used_bytes() / GIB:.2f} GiB memory is still in use.")
            self.log(f"INFO 11-22 02:40:00 [abstract.py:390] It took {took:.6f} seconds to fall asleep.")
        with self.lock:
            self.level = level if level >= 1 else self.level
        return 200, {"status": "sleeping", "level": level}

    def wake_up(self, tags):
        tags_shown = tags
        self.log(f"INFO 11-22 02:40:01 [api_router.py:47] wake up the engine with tags: {tags}")
        wanted = [t for t in tags if t != "scheduling"] if tags is not None else None
        if wanted is None or wanted:
            if not self.asleep:
                self.log("WARNING 11-22 02:40:01 [abstract.py:396] Executor is not sleeping.")
            elif wanted and any(t not in self.asleep for t in wanted):
                self.log(f"WARNING 11-22 02:40:01 [abstract.py:401] Tag {wanted} is not in sleeping tags "
                         f"{sorted(self.asleep)}")
            else:
                took = _seconds("PBSTK_TEST_STANDIN_WAKE_S", 0.2)
                time.sleep(took)
                with self.lock:
                    self.asleep -= set(wanted or TAGS)
                    self.memory(self.used_bytes(), self.gpu_bytes, self.kept_bytes)
                self.log(f"INFO 11-22 02:40:01 [abstract.py:409] It took {took:.6f} seconds to wake up tags "
                         f"{wanted or list(TAGS)}.")
        with self.lock:
            fully_awake = not self.asleep
            if fully_awake:
                self.paused = False
                self.level = 0
                self.resumed.set()
        return 200, {"status": "awake" if fully_awake else "sleeping", "tags": tags_shown}
