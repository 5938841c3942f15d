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


def _decode(m, ids, chains: bool, fold: bool = True):
    """Logits of a 3-token prefill, then one token a step: through the chains (fold: with the layers'
    attention inside them, KVCache.fold_args) or the separate calls.  Returns them and how many layer
    steps ran their attention in a chain."""
    m._chains = None if chains else False       # False: Model._decode_chains answers None
    seq = m.new_sequence()
    f0, n = m.cache.fold_args, [0]

    def counted(seq, chunk):
        a = f0(seq, chunk) if fold else [None] * m.config.n_layers
        n[0] += sum(x is not None for x in a)
        return a
    m.cache.fold_args = counted
    try:
        out = [m.eval(seq, ids[:3])]                 # a prefill, then one token a step
        out += [m.eval(seq, [i]) for i in ids[3:]]
    finally:
        del m.cache.fold_args
    return np.concatenate(out), n[0]


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
        want, n0 = _decode(m, ids, False)
        got, n1 = _decode(m, ids, True)
        apart, n2 = _decode(m, ids, True, fold=False)
        np.testing.assert_array_equal(got, want)      # attention inside the chains
        np.testing.assert_array_equal(apart, want)    # attention between them
        assert np.isfinite(got).all() and got.std() > 0
        L, steps = m.config.n_layers, len(ids) - 3
        # every decode step folds its layers' attention, but q4_0's steps whose token lands in a sink row
        assert n0 == n2 == 0 and n1 == L * (steps if kv == "f16" else len(ids) - max(3, m.cache.NS))
        _one_specialization()
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def _one_specialization():
    """The chain calls the separate calls' functions with their argument types: a constant passed as a
    literal (Literal[int](0)) or a prange index (uint64) compiled a second copy of each on a cold cache
    (attention's work item: ~25 s more on Zen 3)."""
    from numba.core import types

    from pykv.kernels import attention, kvquant, ops

    def sigs(f):      # compiled here, or saved in the cache's index by whichever process compiled them (on a
        # warm cache a callee is never loaded on its own: its callers' cached code holds it)
        return set(f.signatures) | {k[0] for k in f._cache._cache_file._load_index()}

    for f in (attention._item, attention.merge_row, ops.qkv_prep, ops.rmsnorm_act_row, ops.add_rmsnorm_act_row,
              ops.swiglu_act_row, ops.attn_out_act_row, kvquant.wr_u16, kvquant.wr_f32):
        for sig in sigs(f):
            if f is attention._item:     # its last argument is a literal by design: prefill True, decode (and
                # the chain, whose attention is that same specialization) False
                assert isinstance(sig[-1], types.BooleanLiteral), sig
                sig = sig[:-1]
            assert not any(isinstance(t, types.Literal) for t in sig), (f.__name__, sig)
    for f in (ops.rmsnorm_act_row, ops.add_rmsnorm_act_row, ops.swiglu_act_row, ops.attn_out_act_row):
        assert {sig[-1] for sig in sigs(f)} == {types.int64}, (f.__name__, sigs(f))


class _Rows:
    """A bound chain that records the rows of each call."""

    def __init__(self, c, log):
        self.c, self.log = c, log

    def __call__(self, fa=None, T=1):
        self.log.append(T)
        self.c(fa, T)


@pytest.mark.parametrize("kv", ["f16", "q4_0"])      # q4_0: its first steps land in the sink rows (no decode group)
def test_batched_step_runs_the_chains_over_its_rows(tiny, kv):
    """A step of S one-token sequences runs each layer boundary's chain once over all S rows (9: a group
    of 8 tokens and one alone in the Q4 / Q8 tiles, two of 4 and one in the K tiles), with each sequence's
    logits those of the separate calls; a chain refuses more rows than it was bound to."""
    name, path = tiny
    S = 9
    m = pykv.load(path, n_ctx=64, threads=2, kv_type_k=kv, kv_type_v=kv, max_seqs=S)
    try:
        if name == "f16":
            assert m._decode_chains() is None
            return
        L = m.config.n_layers
        out, log = {}, []
        for chains in (False, True):
            m._chains = None if chains else False
            if chains:
                m._chains = [_Rows(c, log) for c in m._decode_chains()]
            seqs = [m.new_sequence() for _ in range(S)]
            for i, s in enumerate(seqs):
                m.eval(s, [5 + i, 77, 3 + 2 * i])
            out[chains] = np.stack([m.step([(s, [100 + 7 * i + k]) for i, s in enumerate(seqs)]) for k in range(3)])
            for s in seqs:
                m.cache.free_sequence(s)
        np.testing.assert_array_equal(out[True], out[False])
        assert np.isfinite(out[True]).all() and out[True].std() > 0
        assert log == [S] * (3 * (L + 1))          # three steps, each chain once, every row in each call
        with pytest.raises(ValueError, match="rows"):
            m._chains[1].c(None, m.step_rows + 1)
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


@pytest.mark.parametrize("opts,folds", [({}, True), ({"kv_type_k": "kivi4", "kv_type_v": "kivi4"}, False),
                                        ({"kv_type_k": "q8_0", "kv_type_v": "q8_0", "kv_window": 8}, False),
                                        ({"kv_type_k": "q8_0", "kv_type_v": "q8_0", "kv_prerope": True}, False)])
def test_fold_args_only_where_the_chain_covers_the_layer(tiny, opts, folds):
    """The chain runs a layer's attention only for caches whose decode append and reads it does the same
    way (KVCache.fold_args): not a KIVI ring, not an f16 window, not pre-RoPE keys; never a sequence's
    first token, a sink row's token or during a key capture."""
    name, path = tiny
    m = pykv.load(path, n_ctx=64, **opts)
    L, c = m.config.n_layers, m.cache
    seq = m.new_sequence()
    assert c.fold_args(seq, 32) == [None] * L        # the first token fixes the key smoothing
    m.eval(seq, [5, 6, 7, 8, 9, 10])
    fa = c.fold_args(seq, 32)
    assert [a is not None for a in fa] == [folds] * L
    if folds:
        assert fa[1][:5] == (6, 32, 0, 0, 1) and fa[1][6] is seq.pt_dev
        c.capture = object()
        assert c.fold_args(seq, 32) == [None] * L
