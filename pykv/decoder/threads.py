"""How many CPU threads a model's call runs on: the number the user gave, or the cores other work leaves free.

Numba keeps its thread count per calling thread, so a Model sets it around each of its calls (Threads)
rather than once at load: two models in one thread keep their own counts, and a worker thread (a
server's engine thread) gets the model's count too.

With threads=None the count follows the load: on a core that another process keeps busy, a thread of
ours runs half the time, and every parallel region then waits for it; one thread per free core is
faster there.  The cores in use by others are read from /proc/stat (their busy time over the last
interval, less this process's own CPU time), at most every RECHECK_S; results do not depend on the
count (docs/repeatability.md), so changing it between calls changes only the speed."""
from __future__ import annotations

import math
import os
import threading
import time

import numba

RECHECK_S = 0.5         # the free-core reading is reused for this long
BUSY_SHARE = 0.25       # a core that others use at least this much (on average) is not free

_lock = threading.Lock()
_last = None            # (wall, {cpu: non-idle jiffies}, own CPU seconds) of the previous reading
_free = None            # the free-core count read last


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), at most Numba's thread pool size."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return cpus[:max(1, numba.config.NUMBA_NUM_THREADS)]


def _read_stat(cpus) -> dict | None:
    """{cpu: non-idle jiffies} of /proc/stat for the cpus, or None where there is none (not Linux)."""
    want = {f"cpu{c}": c for c in cpus}
    out = {}
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                parts = line.split()
                c = want.get(parts[0].decode())
                if c is None:
                    continue
                v = [int(x) for x in parts[1:9]]      # user nice system idle iowait irq softirq steal
                out[c] = sum(v) - v[3] - v[4]
    except (OSError, ValueError, IndexError):
        return None
    return out


def free_cores() -> int:
    """Cores that other processes left free over the last interval (at least 1; all usable CPUs where
    /proc/stat cannot be read).  The first call starts the interval and counts every core free."""
    global _last, _free
    cpus = usable_cpus()
    with _lock:
        now = time.monotonic()
        if _last is not None and _free is not None and now - _last[0] < RECHECK_S:
            return _free
        stat = _read_stat(cpus)
        own = time.process_time()
        if stat is None:
            _free = len(cpus)
            return _free
        if _last is None or now - _last[0] < 0.02:
            if _last is None:
                _last = (now, stat, own)
            return _free if _free is not None else len(cpus)
        t0, stat0, own0 = _last
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        dt = now - t0
        busy = sum(stat[c] - stat0.get(c, stat[c]) for c in stat) / hz
        others = max(0.0, busy - (own - own0)) / dt
        _last = (now, stat, own)
        taken = max(0, math.ceil(others - BUSY_SHARE))
        _free = max(1, len(cpus) - taken)
        return _free


def resolve(threads) -> int:
    """The thread count for one call: `threads` (capped at the pool), or free_cores() for None."""
    if threads is None:
        return free_cores()
    return max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))


class Threads:
    """with Threads(n): Numba's thread count for the calling thread is resolve(n) inside, and what it was
    before, after (a model's call on whatever thread makes it)."""

    __slots__ = ("threads", "old")

    def __init__(self, threads=None):
        self.threads = threads
        self.old = None

    def __enter__(self):
        n = resolve(self.threads)
        self.old = numba.get_num_threads()
        if n != self.old:
            numba.set_num_threads(n)
        return n

    def __exit__(self, *exc):
        if numba.get_num_threads() != self.old:
            numba.set_num_threads(self.old)
        return False
