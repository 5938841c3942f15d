"""The repeatability promise (docs/repeatability.md): for one model file, KV types and device, the same
ids give the same bits, run to run, while other work loads the CPU, and at any thread count.

The evaluations run three times at 2 threads while a second process keeps both cores busy, so a
thread is descheduled at any point of a parallel region; a split of work or a reduction order that
followed the timing, the thread count or uninitialised scratch would show as unequal bits."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import pykv
from pykv.kernels import matmul as M
from tests.reference import write_tiny_gguf

# two threads in one process that hash large buffers (hashlib lets go of the GIL): both cores busy
LOAD = "import hashlib, threading\nb = bytes(1 << 24)\n" \
       "def f():\n    while True: hashlib.sha256(b).digest()\n" \
       "ts = [threading.Thread(target=f) for _ in range(2)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"


@pytest.fixture(scope="module")
def loaded():
    p = subprocess.Popen([sys.executable, "-c", LOAD])
    time.sleep(0.5)
    yield p
    p.kill()
    p.wait()


def _same(runs):
    for r in runs[1:]:
        assert len(r) == len(runs[0])
        for a, b in zip(r, runs[0]):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=False), float(np.abs(a - b).max())


def _evals(m, ids, n_dec=12):
    """Every logit of a prefill of ids[:-n_dec], then of n_dec single-token decodes."""
    full = m.forward(ids[:-n_dec])
    seq = m.new_sequence()
    m.eval(seq, ids[:-n_dec])
    dec = np.concatenate([m.eval(seq, [t]) for t in ids[-n_dec:]])
    return [full.copy(), dec]


CASES = {     # name -> load keywords: float activations with a q4_0 cache, q8 activations, an int2 cache,
    "float-q4_0": dict(q8_act=False, kv_type_k="q4_0", kv_type_v="q4_0"),     # prefill batches of 64
    "q8-f16": dict(),
    "q8-int2": dict(kv_type_k="int2", kv_type_v="int2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_three_evaluations_under_load_are_equal(case, smollm2_path, ref, loaded):
    ids = [int(i) for i in ref["text_ids"][:300]]
    m = pykv.load(smollm2_path, n_ctx=512, threads=2, n_batch=64, **CASES[case])
    _same([_evals(m, ids) for _ in range(3)])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_thread_counts_give_the_same_bits(case, smollm2_path, ref):
    """1 and 2 threads (and the default, which picks its count per call from the free cores)."""
    ids = [int(i) for i in ref["text_ids"][:300]]
    runs = [_evals(pykv.load(smollm2_path, n_ctx=512, threads=t, n_batch=64, **CASES[case]), ids)
            for t in (1, 2, None)]
    _same(runs)


def test_models_keep_their_thread_counts(tmp_path):
    """Numba's thread count is per calling thread: each Model sets its own around its calls, on whatever
    thread calls it (a server's engine thread), and leaves the caller's as it was."""
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 CPUs")
    path = write_tiny_gguf(tmp_path / "t.gguf", {"default": T.Q8_0}, dim=128, ff=256, n_kv=2)
    seen = {}
    from pykv.api.model import Model
    real = Model._eval_batches

    def spy(self, *a, **k):
        seen.setdefault(self.threads, set()).add(numba.get_num_threads())
        return real(self, *a, **k)
    m1, m2 = pykv.load(str(path), n_ctx=32, threads=1), pykv.load(str(path), n_ctx=32, threads=2)
    before = numba.get_num_threads()
    Model._eval_batches = spy
    try:
        m1.forward([1, 2, 3])
        m2.forward([1, 2, 3])
        m1.forward([1, 2, 3])
        t = threading.Thread(target=lambda: (m1.forward([1, 2]), m2.forward([1, 2])))
        t.start()
        t.join()
    finally:
        Model._eval_batches = real
    assert seen == {1: {1}, 2: {2}}
    assert numba.get_num_threads() == before


def test_cuda_simulator_repeats(tmp_path, loaded):
    """device="cuda" (numba's simulator in the tests): three evaluations, the same bits."""
    path = write_tiny_gguf(tmp_path / "c.gguf", {"default": T.Q4_0, "token_embd": T.Q8_0}, dim=64, ff=128,
                           n_heads=2, n_kv=1, n_layers=1)      # small: the simulator is slow under load
    try:
        m = pykv.load(str(path), n_ctx=32, device="cuda", kv_type_k="q8_0", kv_type_v="q4_0")
    except pykv.PykvError as e:
        pytest.skip(str(e))
    ids = [3, 70, 140, 9, 33, 200, 5, 17]
    _same([_evals(m, ids, n_dec=3) for _ in range(3)])


def test_blas_stays_single_threaded_through_a_prefill(monkeypatch):
    """A float-activation prefill matmul's sgemm calls all run with BLAS at one thread (our threads are
    the parallelism), also when one thread's share ends long before another's: the pool once put BLAS's
    thread count back when its own part ended, while another thread still called sgemm."""
    from threadpoolctl import ThreadpoolController
    import numba
    ctl = ThreadpoolController()
    libs = ctl.select(user_api="blas").lib_controllers
    if not libs or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a BLAS that threadpoolctl controls, and 2 CPUs")
    rng = np.random.default_rng(5)
    rows, cols = 2048, 4096
    from tests.kernels.test_matmul import make_weight
    raw = make_weight(T.Q8_0, rows, cols, rng)[0]
    w = M.prepare_weight(int(T.Q8_0), raw, rows, cols, q8_act=False)
    act = M.Act(cols, 32)
    act.set(rng.standard_normal((32, cols)).astype(np.float32))
    out, ref = np.zeros((32, rows), np.float32), np.zeros((32, rows), np.float32)
    M.matmul(w, act, ref)           # compiled before numpy is watched (Numba reads np at compile time)
    main = threading.get_ident()
    seen = []
    real = np.matmul

    class NP:       # numpy as the BLAS pool (kernels/mm_blas.py) sees it, with sgemm watched
        def __getattr__(self, k):
            return getattr(np, k)

        @staticmethod
        def matmul(a, b):
            seen.append(min(c.get_num_threads() for c in libs))
            if threading.get_ident() != main:
                time.sleep(0.02)        # the other threads' items run long: the main thread ends first
            return real(a, b)
    from pykv.kernels import mm_blas
    monkeypatch.setattr(mm_blas, "np", NP())
    old = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        with ctl.limit(limits=2, user_api="blas"):
            M.matmul(w, act, out)
            after = [c.get_num_threads() for c in libs]
    finally:
        numba.set_num_threads(old)
    assert len(seen) > 2 and set(seen) == {1}, seen
    assert after == [2] * len(libs)         # and put back once the matmul is done
    assert np.array_equal(out, ref)

