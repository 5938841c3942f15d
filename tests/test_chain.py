"""The decode chain (kernels.chain): a layer's products between two attentions in one parallel region,
equal bit for bit to the same work as separate calls; and the atomics it schedules with."""
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import njit, prange

import pykv
from pykv.kernels import matmul as mm
from pykv.kernels.sync import fetch_add, load_acquire
from tests.reference import write_tiny_gguf
from tests.test_model import TYPE_SETS as MODEL_SETS

# integer tile weights of every family the chain runs (legacy: q8_0 activations, Q4_0 ... Q8_0; kquant:
# q8_K activations, with a Q8_0 key weight in the K-quants' Q/K/V stage: both activation kinds at once),
# and one float set it leaves to the separate calls.  legacy is test_model's set (its chain compiles once).
TYPE_SETS = {
    "legacy": MODEL_SETS["legacy"],
    "kquant": {"default": T.Q4_K, "attn_q": T.Q5_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "ffn_up": T.Q5_K,
               "ffn_down": T.Q6_K, "token_embd": T.Q6_K, "output": T.Q5_K},
    "f16": {"default": T.F16},
}


@pytest.fixture(scope="module", params=sorted(TYPE_SETS))
def tiny(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("chain") / f"tiny-{name}.gguf"
    write_tiny_gguf(path, TYPE_SETS[name], tied=(name != "kquant"), seed=3)
    return name, str(path)


def _decode(m, ids, chains: bool):
    m._chains = None if chains else False       # False: Model._decode_chains answers None
    seq = m.new_sequence()
    out = [m.eval(seq, ids[:3])]                 # a prefill, then one token a step
    out += [m.eval(seq, [i]) for i in ids[3:]]
    return np.concatenate(out)


@pytest.mark.parametrize("kv", ["f16", "q4_0"])      # q4_0: a rotated cache (the chain undoes the rotation)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_chain_equals_the_separate_calls(tiny, kv, threads):
    name, path = tiny
    try:
        m = pykv.load(path, n_ctx=64, threads=threads, kv_type_k=kv, kv_type_v=kv)
        assert m.rotate == (kv != "f16")
        if name == "f16":
            assert m._decode_chains() is None
            return
        assert m._decode_chains() is not None and len(m._chains) == m.config.n_layers + 1
        ids = [5, 77, 3, 260, 261, 9, 140, 33, 2, 250, 1, 17]
        want, got = _decode(m, ids, False), _decode(m, ids, True)
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got).all() and got.std() > 0
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_no_chain_in_exact_mode(tiny):
    name, path = tiny
    m = pykv.load(path, n_ctx=64)
    mm.set_exact(True)
    try:
        assert m._decode_chains() is None
    finally:
        mm.set_exact(False)
    assert (m._decode_chains() is None) == (name == "f16")


@njit(parallel=True)
def _count(a, n):
    for i in prange(n):
        fetch_add(a, 0, 1)
        fetch_add(a, 8, i)
    return load_acquire(a, 0), load_acquire(a, 8)


def test_fetch_add_is_atomic_across_threads():
    a = np.zeros(16, np.int64)
    n = 200_000
    assert _count(a, n) == (n, n * (n - 1) // 2)
    assert a[0] == n
