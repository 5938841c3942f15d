"""The compile helper: on a cold kernel cache, a second process compiles the decode step's kernels while
this one compiles the prompt's.

Numba compiles one kernel at a time in a process (one lock), on one core, so a cold `pykv run` (no
kernels cached for this CPU and these kernel sources) would compile the prompt's kernels and then the
decode step's (kernels.chain and its attention) one after the other; the helper overlaps the two
(timings: docs/code-notes.md).  start() runs `python -m pykv.tools.warm SPEC` on the same model file and KV
settings: it loads the model and samples two one-token steps, compiling the decode kernels into the
shared cache (kernels/__init__ locks its files).  The caller's model waits for the helper before its
first one-token step (Model._batch), then loads those kernels from the cache; the wait counts as compile
time (kernels.jitnote), which the tokens/s figures exclude.

Started by the CLI's run and chat commands only when it can pay and the cache's files can be locked
(POSIX flock): a CPU model, more than one CPU for this process, the decode chain's kernel not cached
yet, no --kv-bits calibration (the helper would measure it again), a model file under a quarter of the
available memory (the helper holds a second copy of the weights), and PYKV_COMPILE_HELPER not "0".
Its output goes nowhere; it is stopped when this process exits, and a helper that fails or is stopped
costs only the parallelism.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time

from pykv import kernels

WAIT_S = 600.0          # the longest a model waits for its helper (it then compiles what is missing itself)


class Helper:
    """A running compile helper: wait() once before the first one-token step; stop() at exit."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        atexit.register(self.stop)

    def wait(self) -> None:
        from pykv.kernels.jitnote import add_seconds
        t0 = time.perf_counter()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
        finally:
            add_seconds(time.perf_counter() - t0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _mem_available() -> int:
    """Bytes of memory available now (Linux /proc/meminfo), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def decode_cached() -> bool:
    """Whether the decode chain's kernel has a cache index (some model's decode step ran here before)."""
    from pykv.kernels import chain
    cf = getattr(chain.chain._cache, "_cache_file", None)      # None: Numba's cache is off
    return cf is None or os.path.exists(cf._index_path)


def wanted(model, load_kw: dict) -> bool:
    """Whether a helper would pay for this model and these load keywords (see the module docstring)."""
    if os.environ.get("PYKV_COMPILE_HELPER", "1") == "0" or model.be.name != "cpu":
        return False
    if load_kw.get("kv_bits") is not None or _cpus() < 2 or not kernels.cache_locked():
        return False
    try:
        size = os.path.getsize(model.path)
    except OSError:
        return False
    avail = _mem_available()
    if not avail or size > avail // 4:
        return False
    return not decode_cached()


def start(model, load_kw: dict) -> Helper | None:
    """Launch the helper for `model` (loaded with load_kw, pykv.api.kv_plan.load_planned's keywords) when
    wanted(); the model then waits for it before its first one-token step."""
    if not wanted(model, load_kw):
        return None
    kw = {k: v for k, v in load_kw.items() if k not in ("kv_plan_out", "kv_budget", "verbose", "threads", "n_ctx")}
    spec = json.dumps({"path": model.path, "kw": kw})
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "PYKV_COMPILE_HELPER": "0"}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pykv.tools.warm", spec], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None
    model.compile_helper = Helper(proc)
    return model.compile_helper


def main(argv=None) -> int:
    """The helper: load the model as the caller did (a short context, one thread); first the output
    product of one row and both samplers (greedy, with a temperature), which the caller needs at the end
    of its prompt, then two one-token steps."""
    spec = json.loads((argv or sys.argv[1:])[0])
    try:
        os.nice(10)     # a core the caller leaves idle (it compiles on one) is ours; its prompt's threads come first
    except (AttributeError, OSError):
        pass
    from pykv.api.generate import make_sampler
    from pykv.api.kv_plan import load_planned
    model = load_planned(spec["path"], n_ctx=256, threads=1, **spec["kw"])
    seq = model.new_sequence()
    # the caller's steps follow its prompt: they run the folded decode (KVCache.fold_args), which a
    # sequence's first token and tokens in the f16 sink rows do not (they would compile the prompt's
    # attend, append_rows and _item's prefill specialization here too); so start past them,
    # on zero K/V rows (the pools start zeroed; identity key smoothing)
    skip = max(1, model.cache.NS)
    model.cache.reserve(seq, skip)
    seq.n_tokens = skip
    tok = model.tokenizer.bos_id if 0 <= model.tokenizer.bos_id < model.n_vocab else 0
    samplers = [make_sampler(model, temperature=temp, seed=0) for temp in (0.0, 0.8)]
    logits = model._head(model.state.x[:1])
    for s in samplers:
        model.be.sampler.pick(logits[0], s, [tok], s.draw())
    chains_first(model)
    for s in samplers:
        tok = model.next_token(seq, [tok], s, [tok])
    return 0


def chains_first(model) -> None:
    """Compile (or load) each of the model's decode chains (kernels.chain: one per mix of weight types)
    before their attention: bound to chain._attn_none, run once in idle mode.  The steps after bind the
    real attention and load the chains from the cache."""
    from pykv.kernels import chain
    with chain.attention_stand_in():
        chains = model._decode_chains()
        for c in {c.lits: c for c in chains or ()}.values():
            c()
    model._chains = None


if __name__ == "__main__":
    sys.exit(main())
