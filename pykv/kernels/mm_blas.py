"""Float-activation prefill: tiles dequantized to float32 W^T chunks, each multiplied by a single-threaded
sgemm on a pool of Python threads (fixed work items, the same at every thread count)."""
from __future__ import annotations
import itertools
import threading
import numpy as np
import numba
from pykv.kernels.mm_tiles import _KIND_TILE_Q4, _deq_tiles_q4_T, _deq_tiles_q8_T


_BLAS_MIN_T = 16            # tile weights with at least this many tokens: dequantize + sgemm
_BLAS_CHUNK = 1 << 20       # floats of dequantized W^T per sgemm call per thread (4 MB: stays in L2/L3)


class _BlasPool:
    """Runs a prefill matmul's work items on numba.get_num_threads() Python threads (the calling one
    included), each taking the next item as it finishes one (a descheduled thread holds up one item, not
    a fixed share); an item dequantizes its row tiles to a private float32 W^T and calls sgemm (numpy
    releases the GIL).  BLAS runs single-threaded for the whole run: its thread count (process-wide in
    OpenBLAS's pthreads build, whatever the name of its "local" setter) is set to 1 before the first item
    and put back after the last, through threadpoolctl, for whichever BLAS numpy loaded.  Set and
    restored per part instead, one thread's restore let another's sgemm run multi-threaded."""

    def __init__(self):
        self.pool = None
        self.n = 0
        self.bufs = {}
        self.blas = None        # threadpoolctl's controllers of the loaded BLAS libraries (made on first use)
        self.lock = threading.Lock()
        self.active = 0         # runs in progress (models on several threads): the last one restores BLAS
        self.saved = []

    def buf(self, size):
        """The calling thread's float32 scratch of at least size floats."""
        key = threading.get_ident()
        b = self.bufs.get(key)
        if b is None or b.size < size:
            b = self.bufs[key] = np.zeros(size, np.float32)
        return b

    def _enter(self):
        with self.lock:
            if self.active == 0:
                ctl = self._controllers()
                self.saved = [c.get_num_threads() for c in ctl]
                for c, n in zip(ctl, self.saved):
                    if n != 1:
                        c.set_num_threads(1)
            self.active += 1

    def _exit(self):
        with self.lock:
            self.active -= 1
            if self.active == 0:
                for c, n in zip(self._controllers(), self.saved):
                    if n != 1:
                        c.set_num_threads(n)

    def _controllers(self):
        if self.blas is None:
            try:
                from threadpoolctl import ThreadpoolController
                self.blas = ThreadpoolController().select(user_api="blas").lib_controllers
            except Exception:       # no threadpoolctl, or a BLAS it cannot inspect: leave its threads alone
                self.blas = []
        return self.blas

    def run(self, n_items: int, item, threads: int) -> None:
        """item(k) for k in range(n_items) on up to `threads` threads, BLAS at one thread meanwhile."""
        self._enter()
        try:
            nth = max(1, min(threads, n_items))
            if nth == 1:
                for k in range(n_items):
                    item(k)
                return
            with self.lock:
                if self.pool is None or self.n < nth - 1:
                    from concurrent.futures import ThreadPoolExecutor
                    self.n = nth - 1
                    self.pool = ThreadPoolExecutor(self.n)
            claim = itertools.count()         # next() is atomic under the GIL

            def worker():
                for k in claim:
                    if k >= n_items:
                        return
                    item(k)
            futs = [self.pool.submit(worker) for _ in range(nth - 1)]
            try:
                worker()
            finally:
                for f in futs:
                    f.result()
        finally:
            self._exit()


_blas = _BlasPool()
_BLAS_ITEMS = 8             # a weight splits into at least this many work items where it has the tiles


def _matmul_blas(w: Weight, T: int, X: np.ndarray, out: np.ndarray) -> None:
    """out[:T] = X[:T] @ W.T through float32 copies of W^T, by row tiles (tile kernels only).  The work
    items (runs of `per` row tiles) do not depend on the thread count, so neither do the bits: each
    output column comes from one sgemm of the same shape whichever thread runs it."""
    nt, R = w.qt.shape[0], w.qt.shape[3]
    cols = w.cols
    per = max(1, min(-(-nt // _BLAS_ITEMS), _BLAS_CHUNK // (cols * R)))
    n_items = -(-nt // per)
    x = X[:T]
    q4 = w.kind == _KIND_TILE_Q4

    def item(k):
        t0 = k * per
        t1 = min(nt, t0 + per)
        r0, n = t0 * R, (t1 - t0) * R
        WT = _blas.buf(cols * per * R)[:cols * n].reshape(cols, n)
        if q4:
            _deq_tiles_q4_T(w.qt, w.sc, t0, t1, WT)
        else:
            _deq_tiles_q8_T(w.qt, w.sc, t0, t1, WT)
        m = min(n, w.rows - r0)
        out[:T, r0:r0 + m] = np.matmul(x, WT)[:, :m]
    _blas.run(n_items, item, numba.get_num_threads())
