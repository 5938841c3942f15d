"""numba.cuda twins of the CPU kernel modules (pykv.kernels.{matmul, ops, sampler, kvquant, attention}):
same public names and arguments, device arrays in and out. Picked through kernels.backend.get_backend("cuda").

Reductions: on a GPU, warp sums use shuffles (cuda.shfl_down_sync); under NUMBA_ENABLE_CUDASIM=1 (the
simulator has no shuffles) they go through shared memory instead (SIM below, fixed at import)."""
import functools
import os
import types

import numpy as np

# numba-cuda registers an overload for np.row_stack, which NumPy 2.5 removed (an alias of np.vstack since
# 2.0): without the alias every first kernel compile fails with AttributeError.  Put the alias back
# before numba.cuda's array overloads load.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import config, cuda  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
# lanes of a "warp" (the threads that share one weight row): 32 on a GPU (shuffle sums); 2 under the
# simulator, which runs every thread as a Python thread (same code, far fewer threads to start and join)
WL = 2 if SIM else 32


def _sim_shared_lock():
    """The simulator's cuda.shared.array looks an allocation up by call site and creates it on a miss
    without a lock, so two threads of a block that reach the line together can get two different arrays
    (a block-wide sum then misses a thread's part: seen as rare wrong rows in the tests). Serialize it."""
    import sys
    import threading
    from numba.cuda.simulator import kernelapi
    from numba.core import types
    from numba.np import numpy_support
    cls = kernelapi.FakeCUDAShared
    if getattr(cls, "_pykv_locked", False):
        return
    lock = threading.Lock()
    dynamic = cls.array

    def array(self, shape, dtype):
        if shape == 0:
            return dynamic(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)     # the simulator's key: the calling line
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    cls.array = array
    cls._pykv_locked = True


def _sim_counted_swap():
    """The simulator points a function's module global `cuda` at the launch's fake module for each call
    and back after it.  Two threads inside a device function of another module race: the first to
    return restores the real module while the other still reads cuda.threadIdx.  Count the entries per
    module instead: the first swaps, the last restores."""
    import threading
    from contextlib import contextmanager
    from numba.cuda.simulator import kernel as simk
    if getattr(simk, "_pykv_counted", False):
        return
    lock = threading.Lock()
    held = {}       # id(globals) -> [entries, original bindings]

    @contextmanager
    def swapped(fn, fake):
        g = fn.__globals__
        with lock:
            h = held.get(id(g))
            if h is None:
                orig = {k: v for k, v in g.items() if v is cuda}
                g.update({k: fake for k in orig})
                h = held[id(g)] = [0, orig]
            h[0] += 1
        try:
            yield
        finally:
            with lock:
                h[0] -= 1
                if h[0] == 0:
                    g.update(h[1])
                    del held[id(g)]
    simk.swapped_cuda_module = swapped
    simk._pykv_counted = True


def _sim_direct_device_calls():
    """The simulator swaps a device function's module global `cuda` around every call, under the lock
    above: a lock round trip and a GIL hand-off per call, for element decoders called once per weight
    element.  A device function whose code (nested code included) names no global bound to the cuda
    module cannot see the swap: call it directly."""
    from numba.cuda.simulator import kernel as simk
    from numba.cuda.simulator.kernelapi import FakeCUDAModule
    if getattr(simk, "_pykv_direct", False):
        return
    call = simk.FakeCUDAKernel.__call__

    def names(code):
        out = set(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                out |= names(c)
        return out

    def pure(fn):
        g = fn.__globals__
        return not any(g.get(n) is cuda or isinstance(g.get(n), FakeCUDAModule) for n in names(fn.__code__))

    def direct(self, *args):
        if self._device:
            p = self.__dict__.get("_pykv_pure")
            if p is None:
                p = self._pykv_pure = pure(self.fn)
            if p:
                return self.fn(*args)
        return call(self, *args)
    simk.FakeCUDAKernel.__call__ = direct
    simk._pykv_direct = True


def _sim_waiting_blocks():
    """The simulator's block manager polls its threads in a loop (is_alive, blocked flags) while they
    run: it holds the GIL they need, worst on a loaded host.  Same rule (a barrier opens when every live
    thread of the block waits at it), kept by counts under one condition that the threads signal."""
    import threading
    from numba.cuda.simulator import kernel as simk
    if getattr(simk, "_pykv_waiting", False):
        return

    def run(self, grid_point, *args):
        self._cond, self._waiting, self._gen = threading.Condition(), 0, 0
        threads = [simk.BlockThread(lambda: self._f(*args), self, grid_point, p, self._debug)
                   for p in np.ndindex(*self._block_dim)]
        self._alive = len(threads)
        for t in threads:
            t.start()
        with self._cond:
            while self._alive and not any(t.exception for t in threads):
                self._cond.wait()
            for t in threads:
                if t.exception:         # stop the others at their next barrier, then report it
                    for o in threads:
                        o.abort = True
                    self._cond.notify_all()
                    raise t.exception[0].with_traceback(t.exception[1])

    def _open_if_all_wait(m):
        if m._waiting and m._waiting == m._alive:
            m._waiting, m._gen = 0, m._gen + 1
            m._cond.notify_all()

    def syncthreads(self):
        m = self._manager
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        with m._cond:
            gen = m._gen
            m._waiting += 1
            _open_if_all_wait(m)
            while m._gen == gen and not self.abort:
                m._cond.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def thread_run(self):
        try:
            real_run(self)
        finally:
            m = self._manager
            with m._cond:
                m._alive -= 1
                _open_if_all_wait(m)
                m._cond.notify_all()
    real_run = simk.BlockThread.run
    simk.BlockManager.run = run
    simk.BlockThread.syncthreads = syncthreads
    simk.BlockThread.run = thread_run
    simk._pykv_waiting = True


def _sim_record_signatures(path):
    """Under the simulator, record (module, kernel, argument types) of every kernel launch and append the
    set to `path` (a pickle stream) at exit: tools/cuda_ptx_check.py --sigs compiles exactly those for a real GPU (the
    simulator runs kernels as Python, so it never tells whether NVVM can compile them)."""
    import atexit
    import pickle
    import numba
    from numba.cuda.simulator import kernel as simk
    seen = set()
    call = simk.FakeCUDAKernel.__call__

    def typ(a):
        a = getattr(a, "_ary", a)                       # a simulator device array: its numpy array
        return numba.typeof(a)

    def record(self, *args):
        if not self._device:
            try:
                seen.add((self.fn.__module__, self.fn.__name__, tuple(typ(a) for a in args)))
            except Exception:                           # an argument numba cannot type: the launch says so
                pass
        return call(self, *args)
    simk.FakeCUDAKernel.__call__ = record

    def dump():                                         # appended: subprocesses record too
        with open(path, "ab") as f:
            pickle.dump(sorted(seen, key=str), f)
    atexit.register(dump)


if SIM:
    _sim_shared_lock()
    _sim_counted_swap()
    _sim_direct_device_calls()
    _sim_waiting_blocks()
    if os.environ.get("PYKV_CUDA_SIGS"):
        _sim_record_signatures(os.environ["PYKV_CUDA_SIGS"])


@cuda.jit(device=True, inline=True)
def warp_sums(acc, sh, w, lane):
    """acc[i] <- its sum over the WL lanes of warp w, for every i (lane 0 holds the sums; all lanes on a
    GPU). sh: shared float32 (n_warps, len(acc), WL), used only under the simulator (two block barriers
    for the whole array instead of two per element: the simulator's barriers are slow)."""
    if SIM:
        for i in range(acc.shape[0]):
            sh[w, i, lane] = acc[i]
        cuda.syncthreads()
        if lane == 0:
            for i in range(acc.shape[0]):
                s = np.float32(0.0)
                for j in range(WL):
                    s += sh[w, i, j]
                acc[i] = s
        cuda.syncthreads()
        return
    for i in range(acc.shape[0]):
        v = acc[i]
        off = 16
        while off > 0:
            v += cuda.shfl_down_sync(0xFFFFFFFF, v, off)
            off //= 2
        acc[i] = v


@cuda.jit(device=True, inline=True)
def block_sum(v, sh):
    """Sum of v over the whole (1-D, power-of-two sized) block, returned to every thread; sh: shared
    float32 scratch of at least blockDim.x. Tree reduction in shared memory (GPU and simulator)."""
    i = cuda.threadIdx.x
    n = cuda.blockDim.x
    sh[i] = v
    cuda.syncthreads()
    s = n // 2
    while s > 0:
        if i < s:
            sh[i] += sh[i + s]
        cuda.syncthreads()
        s //= 2
    r = sh[0]
    cuda.syncthreads()
    return r


@functools.lru_cache(maxsize=None)
def specialise(kernel, **consts):
    """A copy of kernel (a module-level @cuda.jit) compiled with these module constants (weight kinds,
    widths) in place of the module's defaults: numba freezes globals as constants, so the branches for
    other values are dead code (a kernel per weight type, as the CPU's literal kinds)."""
    fn = kernel.py_func
    g = dict(fn.__globals__)
    g.update(consts)
    f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__module__ = fn.__module__
    return cuda.jit(f)


def grid(n, per):
    """Blocks of `per` covering n items."""
    return max(1, -(-int(n) // per))
