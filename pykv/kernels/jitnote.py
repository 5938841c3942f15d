"""Say when Numba compiles (a cold cache: the first run on a machine, or after an upgrade), and how long.

numba's "numba:compile" event fires only on a real compile, never on a cache load, so the note is
printed only when there is something to wait for.  install() once per process (the CLI does);
compile_seconds() is the wall time spent in top-level compiles so far (with saving them to Numba's
cache), plus the time spent loading compiled kernels from that cache (the first call of each kernel in a
process, most of it Numba's one-time setup), which generate() subtracts from its tokens/s figures.
"""
import sys
import threading
import time

from numba.core import caching as _caching
from numba.core import event as _ev

_lock = threading.Lock()
_state = {"depth": 0, "t0": 0.0, "total": 0.0, "said": False, "installed": False, "stream": None}


def _say() -> None:
    """The one line on the stream, the first time (call with _lock held)."""
    if not _state["said"] and _state["stream"] is not None:
        _state["said"] = True
        from pykv.kernels.tiles import ISA
        stream = sys.stderr if _state["stream"] == "stderr" else _state["stream"]
        try:            # a note: never a reason for a compile to fail (a stream closed since install)
            print(f"pykv: compiling kernels for this CPU ({ISA}); once, cached for later runs "
                  "(up to a few minutes)...", file=stream, flush=True)
        except (ValueError, OSError, AttributeError):
            pass


class _Note(_ev.Listener):
    def on_start(self, event):
        with _lock:
            if _state["depth"] == 0:
                _state["t0"] = time.perf_counter()
                _say()
            _state["depth"] += 1

    def on_end(self, event):
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                _state["total"] += time.perf_counter() - _state["t0"]


def _timed(method):
    """A Cache method (load_overload, save_overload) with its wall time added to the compile total when
    it runs outside a compile (inside one it is already in that compile's time).  Numba saves a compiled
    kernel to its cache after the compile event has ended, so without this the first decode step's
    tokens/s would count that save."""
    def timed(self, *args):
        with _lock:
            outer = _state["depth"] == 0
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            if outer:
                with _lock:
                    _state["total"] += time.perf_counter() - t0
    timed.__name__, timed.pykv_timed = method.__name__, True
    return timed


def install(stream=None) -> None:
    """Track compile (and cache load) time; with a stream, also print one line at the first compile
    ("stderr": whatever sys.stderr is then)."""
    with _lock:
        if stream is not None:
            _state["stream"] = stream
        if not _state["installed"]:
            _ev.register("numba:compile", _Note())
            _caching.Cache.load_overload = _timed(_caching.Cache.load_overload)
            _caching.Cache.save_overload = _timed(_caching.Cache.save_overload)
            _state["installed"] = True


def compile_seconds() -> float:
    """Seconds spent compiling since install() (0.0 when not installed)."""
    with _lock:
        extra = time.perf_counter() - _state["t0"] if _state["depth"] else 0.0
        return _state["total"] + extra


def add_seconds(seconds: float) -> None:
    """Count `seconds` spent waiting for kernels compiled elsewhere (pykv.tools.warm's helper) as compile time."""
    with _lock:
        _state["total"] += seconds


def waiting() -> None:
    """A kernel this process needs is being compiled by another process (kernels/__init__'s claims):
    the note, as for a compile of our own."""
    with _lock:
        _say()


def waited(seconds: float) -> None:
    """`seconds` spent waiting for another process's compile: compile time, unless it was inside a
    compile of this process's (already counted there)."""
    with _lock:
        if _state["depth"] == 0:
            _state["total"] += seconds


__all__ = ["install", "compile_seconds", "add_seconds", "waiting", "waited"]


install()       # track compile time from the first import; the CLI adds the stderr note
