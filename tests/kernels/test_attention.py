"""Fused attention over the paged, quantized KV cache against a float64 reference.

The reference is tests/reference.py `attention()` over the K/V rows the cache actually stores,
dequantized row by row with kvquant (KIVI keys: blocks.deq_kivi_k_rows on full pages, the f16 residual rows
for the newest partial page).  So the only allowed difference is float32 arithmetic in the kernel:
1e-4 relative per (query token, head) output vector.

Caches are built through KVCache (two sequences appended interleaved, free list shuffled, so page
tables are neither contiguous nor increasing; pools pre-filled with 0x7F bytes = NaN / huge values,
so reading any slot that was never written fails the comparison).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from pykv.files.config import Config
from pykv.files.formats import CODE_Q8_0, KV_FORMATS, bytes_per_token
from pykv.kernels.blocks import deq_kivi_k_rows
from pykv.kernels.kvquant import dequantize_row
from pykv.kernels.kvdot import ok_hd
from pykv.kv.cache import KVCache

from tests.reference import attention as ref_attention
from tests.reference import q16_query

FORMATS = list(KV_FORMATS)


def _vt(fmt):
    """The value type tested beside key type fmt: itself, or nl2 for the key-only klt types."""
    return "nl2" if KV_FORMATS[fmt].kind == "klt" else fmt
THREADS = sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), numba.config.NUMBA_NUM_THREADS})
RTOL = 1e-4


def make_cfg(n_heads, n_kv_heads, head_dim=64, n_layers=1):
    return Config(arch="llama", n_layers=n_layers, dim=n_heads * head_dim, ff_dim=4 * head_dim,
                  n_heads=n_heads, n_kv_heads=n_kv_heads, rope_base=10000.0, rope_dims=head_dim,
                  norm_eps=1e-5, n_ctx_train=4096, n_vocab=32)


def new_cache(cfg, kt, vt, n_ctx, P, rng, max_seqs=2):
    cache = KVCache(cfg, n_ctx, kt, vt, page_tokens=P, max_seqs=max_seqs)
    for l in cache.layers:          # unwritten slots decode to NaN / huge: reading one fails
        l.k_pool.fill(0x7F)
        l.v_pool.fill(0x7F)
    rng.shuffle(cache.free_pages)
    return cache


def kv_rows(cfg, n, rng):
    """Random K or V rows (n, KVH, HD) with uneven per-channel scales and a few outliers."""
    KVH, HD = cfg.n_kv_heads, cfg.head_dim
    x = rng.standard_normal((n, KVH, HD)) * rng.uniform(0.3, 2.0, (1, KVH, HD))
    x[rng.random(x.shape) < 0.01] *= 6.0
    return x.astype(np.float32)


def push(cache, seq, n, rng):
    cache.reserve(seq, n)
    cache.append(0, seq, kv_rows(cache.cfg, n, rng), kv_rows(cache.cfg, n, rng))
    seq.n_tokens += n


def dequant_cache(cache, seq, li=0):
    """(n, KVH, HD) float64 K and V exactly as stored."""
    l, P, HD, KVH = cache.layers[li], cache.P, cache.cfg.head_dim, cache.cfg.n_kv_heads
    n = seq.n_tokens
    out = []
    for name, fmt, pool in (("k", l.k_fmt, l.k_pool), ("v", l.v_fmt, l.v_pool)):
        nq = cache.n_quantized(fmt, n)
        ns = cache.n_sink(fmt, n)
        res = cache.residual(seq, li, name)
        sink = cache.sink(seq, li, name)
        x = np.zeros((n, KVH, HD), np.float32)
        dk, mk = np.empty(HD, np.float32), np.empty(HD, np.float32)
        rb = pool.shape[2] // P
        for j in range(n):
            page = seq.page_table[j // P]
            for g in range(KVH):
                if j < ns:
                    dequantize_row(cache.F16_CODE, sink[g, j], x[j, g])
                elif j >= nq:
                    dequantize_row(cache.F16_CODE, res[g, j % res.shape[1]], x[j, g])
                elif name == "k" and l.k_bits:
                    deq_kivi_k_rows(l.k_bits, pool[g, page], j % P, 1, x[j, g][None], dk, mk)
                else:
                    o = (j % P) * rb
                    dequantize_row(fmt.code, pool[g, page, o:o + rb], x[j, g])
        assert np.isfinite(x).all()
        out.append(x.astype(np.float64))
    return out


def run_attend(cache, seq, q, chunk, li=0):
    """attend() exactly as model.py calls it, for the last T = len(q) tokens of seq."""
    T, H, HD = q.shape
    KVH = cache.cfg.n_kv_heads
    n_tot = seq.n_tokens
    n_past = n_tot - T
    C = -(-n_tot // chunk)
    part = np.full((T, KVH, C, H // KVH, HD + 2), np.nan, np.float32)
    out = np.full((T, H, HD), np.nan, np.float32)
    cache.attend(li, seq, q, n_past, chunk, part, out)
    return out


def int_keys(cache, li=0):
    """Whether attention scores layer li's pool keys by kvdot's integer dots (q8_0 keys, whole units,
    no pre-RoPE transform): their scores see the query's int16 form (reference.q16_query)."""
    l = cache.layers[li]
    return l.k_fmt.code == CODE_Q8_0 and not l.k_bits and not cache.k_pre[li] and ok_hd(cache.cfg.head_dim)


def check(cache, seq, T, chunks, rng, what=""):
    H, HD = cache.cfg.n_heads, cache.cfg.head_dim
    k, v = dequant_cache(cache, seq)
    q = (rng.standard_normal((T, H, HD)) * 2.0 / math.sqrt(HD)).astype(np.float32)  # pre-scaled
    qf = q.astype(np.float64) * math.sqrt(HD)
    ref = ref_attention(qf, k, v, n_past=seq.n_tokens - T)
    if int_keys(cache):       # pool keys: the int16 query; the f16 sink rows: the float one (no window here)
        assert not cache.W
        plain = ref
        ref = ref_attention(qf, k, v, seq.n_tokens - T, q16_query(q) * math.sqrt(HD),
                            cache.n_sink(cache.layers[0].k_fmt, seq.n_tokens))
        # what the int16 query alone costs (an 8-bit query moved the kernel's outputs by 3e-2 here)
        assert (np.abs(ref - plain) / np.abs(plain).max(axis=2, keepdims=True)).max() < 1e-3
    scale = np.abs(ref).max(axis=2, keepdims=True)
    for chunk in chunks:
        for th in THREADS:
            numba.set_num_threads(th)
            try:
                out = run_attend(cache, seq, q, chunk)
            finally:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
            err = (np.abs(out - ref) / scale).max()
            assert err <= RTOL, (f"{what} n={seq.n_tokens} T={T} chunk={chunk} threads={th}: "
                                 f"relative error {err:.3g}")


@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_matches_reference(fmt, G):
    rng = np.random.default_rng(1000 + 13 * FORMATS.index(fmt) + G)
    KVH, P = 2, 16
    cfg = make_cfg(KVH * G, KVH)
    cache = new_cache(cfg, fmt, _vt(fmt), 256, P, rng)
    a, b = cache.new_sequence(), cache.new_sequence()
    what = f"{fmt} G={G}"
    # prefill from 0 (odd length, leaves a partial page), interleaved with another sequence
    push(cache, a, 37, rng)
    check(cache, a, 37, [1024, 16], rng, what)
    push(cache, b, 20, rng)
    # prefill with n_past > 0, crossing a page boundary; chunks not multiples of P as well
    push(cache, a, 7, rng)
    check(cache, a, 7, [16, 7, 1024], rng, what)
    push(cache, b, 13, rng)
    # decode at depths below, at and past a page boundary, and over many chunks
    while a.n_tokens < 63:
        push(cache, a, 1 if a.n_tokens % 5 else 2, rng)
        push(cache, b, 1, rng)
    push(cache, a, 1, rng)            # 64 = 4 pages exactly
    check(cache, a, 1, [16, 5, 1024], rng, what)
    push(cache, a, 1, rng)            # 65
    check(cache, a, 1, [32, 1024], rng, what)
    push(cache, a, 85, rng)
    push(cache, b, 30, rng)
    push(cache, a, 1, rng)            # 151: > 9 chunks of 16
    check(cache, a, 1, [16, 48, 1024], rng, what)
    pt = a.page_table[:math.ceil(a.n_tokens / P)]
    assert (np.diff(pt) != 1).any()   # the page table really is out of order


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_0", "int4", "fp8_e4m3"])
def test_attention_smollm2_shape(fmt):
    """SmolLM2's head layout (9 heads, 3 KV heads, HD 64), P = 32, a long decode with model.py's chunks."""
    rng = np.random.default_rng(7)
    cfg = make_cfg(9, 3)
    cache = new_cache(cfg, fmt, fmt, 1200, 32, rng, max_seqs=1)
    seq = cache.new_sequence()
    push(cache, seq, 1000, rng)
    push(cache, seq, 1, rng)          # 1001: not a multiple of P
    chunks = []
    for th in (1, 2, 8):              # the decode chunk model.py picks for these thread counts
        want = max(1, (4 * th) // cfg.n_kv_heads)
        chunks.append(cache.P * max(1, -(-seq.n_tokens // (cache.P * want))))
    check(cache, seq, 1, sorted(set(chunks)) + [32], rng, fmt)
    push(cache, seq, 19, rng)         # prefill of 19 on top of 1001
    check(cache, seq, 19, [cache.P * -(-seq.n_tokens // cache.P), 64], rng, fmt)


def test_attention_mixed_k_v_types():
    """K and V in different formats (KIVI keys with ggml values and the reverse): separate boundaries."""
    rng = np.random.default_rng(3)
    cfg = make_cfg(6, 2)
    for kt, vt in (("int4", "q8_0"), ("q4_1", "int2"), ("f16", "fp8_e5m2")):
        cache = new_cache(cfg, kt, vt, 128, 16, rng)
        seq = cache.new_sequence()
        push(cache, seq, 45, rng)
        check(cache, seq, 45, [1024], rng, f"{kt}/{vt}")
        push(cache, seq, 1, rng)
        check(cache, seq, 1, [16, 1024], rng, f"{kt}/{vt}")


# ---- byte accounting ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_token_matches_allocation(fmt):
    cfg = make_cfg(9, 3, n_layers=2)
    for P in (16, 32):
        cache = KVCache(cfg, 300, fmt, "q4_0" if fmt == "f16" else _vt(fmt), page_tokens=P)
        per_tok = cache.nbytes() / cache.capacity_tokens()
        assert cache.bytes_per_token() == per_tok
        assert cache.bytes_per_token() == bytes_per_token(cache.layers[0].k_fmt, cache.layers[0].v_fmt,
                                                          cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, P)


@pytest.mark.parametrize("fmt,expected", [("f16", 23040), ("q8_0", 12240), ("q4_0", 6480)])
def test_bytes_per_token_smollm2(fmt, expected):
    cfg = make_cfg(9, 3, n_layers=30)
    cache = KVCache(cfg, 64, fmt, fmt, page_tokens=32)
    assert cache.bytes_per_token() == expected
    assert cache.nbytes() / cache.capacity_tokens() == expected


def _prerope_back(seq, sign, cos, sin):
    """Stored pre-RoPE key rows (n, KVH, HD) at positions 0.. -> the roped keys attention must see:
    inverse Hadamard (signs sign; None: no rotation), * k_scale + k_shift, RoPE (layer 0)."""
    HD = cos.shape[1] * 2
    H = np.array([[1.0]])
    while H.shape[0] < HD:
        H = np.block([[H, H], [H, -H]])
    R = H / np.sqrt(HD) * sign[None, :] if sign is not None else np.eye(HD)   # stored row @ R = smoothed key

    def back(ks):
        k = (ks @ R) * seq.k_scale[0] + seq.k_shift[0]
        c, s = cos[:len(k), None, :], sin[:len(k), None, :]
        out = k.copy()
        out[..., 0::2] = k[..., 0::2] * c - k[..., 1::2] * s
        out[..., 1::2] = k[..., 0::2] * s + k[..., 1::2] * c
        return out
    return back


@pytest.mark.parametrize("fmt,rotate", [("q4_0", True), ("nl3", True), ("q8_0", False)])
def test_attention_prerope_keys(fmt, rotate):
    """Pre-RoPE keys (kv_cache k_pre): the stored rows are R((k - shift) / scale) of unroped keys;
    attention maps each decoded row back (inverse Hadamard, * scale + shift) and ropes it at its
    position.  Against the reference over exactly those keys, sink rows included (they hold the same
    transform)."""
    from pykv.kernels.ops import rope_tables
    rng = np.random.default_rng(11)
    cfg = make_cfg(6, 2)
    KVH, HD, P = 2, cfg.head_dim, 16
    cache = KVCache(cfg, 128, fmt, fmt, page_tokens=P, max_seqs=2, k_prerope=True)
    cos, sin = rope_tables(128, HD, 10000.0)
    sign = rng.choice(np.array([-1.0, 1.0], np.float32), HD) if rotate else None
    cache.set_k_transform(cos, sin, sign)
    rng.shuffle(cache.free_pages)
    seq = cache.new_sequence()
    seq.k_shift[0] = rng.standard_normal((KVH, HD))
    seq.k_scale[0] = rng.uniform(0.5, 2.0, (KVH, HD))
    keys_back = _prerope_back(seq, sign, cos, sin)
    for n_new, T in ((37, 37), (1, 1), (30, 5), (1, 1)):
        push(cache, seq, n_new, rng)
        ks, v = dequant_cache(cache, seq)
        k = keys_back(ks)
        q = (rng.standard_normal((T, 6, HD)) * 2.0 / math.sqrt(HD)).astype(np.float32)
        ref = ref_attention(q.astype(np.float64) * math.sqrt(HD), k, v, n_past=seq.n_tokens - T)
        for chunk in (16, 1024):
            out = run_attend(cache, seq, q, chunk)
            err = (np.abs(out - ref) / np.abs(ref).max(axis=2, keepdims=True)).max()
            assert err <= RTOL, (fmt, seq.n_tokens, T, chunk, err)


@pytest.mark.parametrize("pre", [False, True])
def test_query_aware_smoothing_scale(pre, monkeypatch):
    """smooth_stats (mode "qk"): key channel c is divided by s_c ~ (E[k_c^2] / E[q_c^2])^SMOOTH_QK_POW
    over the first batch (token 0 left out, k centred, E[q^2] over the KV group's query heads, and for
    pre-RoPE keys averaged over each RoPE pair), normalised to geometric mean 1 per KV head."""
    from pykv.kv import cache as kv_cache
    monkeypatch.setattr(kv_cache, "SMOOTH_MODE", "std" if pre else "qk")   # pre-RoPE keys: "qk" always
    rng = np.random.default_rng(5)
    cfg = make_cfg(6, 2)
    cache = KVCache(cfg, 64, "q4_0", "q4_0", page_tokens=16, k_prerope=pre)
    seq = cache.new_sequence()
    T, KVH, HD = 40, 2, cfg.head_dim
    k = (rng.standard_normal((T, KVH, HD)) * rng.uniform(0.2, 5.0, (1, KVH, HD)) + 3.0).astype(np.float32)
    q = (rng.standard_normal((T, 6, HD)) * rng.uniform(0.2, 5.0, (1, 6, HD))).astype(np.float32)
    cache.smooth_stats(0, seq, k, q)
    ks, qs = k[1:].astype(np.float64), q[1:].astype(np.float64).reshape(T - 1, KVH, 3, HD)
    ek = ks.var(axis=0)
    eq = (qs ** 2).mean(axis=(0, 2))
    if pre:
        eq = np.repeat(0.5 * (eq[:, 0::2] + eq[:, 1::2]), 2, axis=1)
    want = (ek / eq) ** kv_cache.SMOOTH_QK_POW
    want /= np.exp(np.log(want).mean(axis=1, keepdims=True))
    np.testing.assert_allclose(seq.k_scale[0], want, rtol=1e-4)
    np.testing.assert_allclose(seq.k_shift[0], ks.mean(axis=0), rtol=1e-5, atol=1e-5)
# ---- token-adaptive window -----------------------------------------------------------------------

def _round_trip(x, wt):
    """Rows (n, KVH, HD) as the window ring stores them: f16, or q8_0 blocks (kvquant)."""
    if wt == "f16":
        return x.astype(np.float16).astype(np.float64)
    from pykv.files.formats import row_bytes
    from pykv.kernels.kvquant import quantize_row
    fmt = KV_FORMATS[wt]
    out = np.empty(x.shape, np.float32)
    buf = np.empty(row_bytes(fmt, x.shape[2]), np.uint8)
    for i in range(x.shape[0]):
        for g in range(x.shape[1]):
            quantize_row(fmt.code, x[i, g], buf)
            dequantize_row(fmt.code, buf, out[i, g])
    return out.astype(np.float64)


@pytest.mark.parametrize("kt,vt,W,NS,wt,pre", [("nl2", "q4_0", 5, 4, "f16", False), ("q4_0", "nl3", 16, 0, "f16", False),
                                               ("iq4_nl", "f16", 40, 8, "f16", False),
                                               ("nl2", "nl3", 20, 4, "q8_0", False),
                                               ("nl3", "q4_0", 16, 4, "f16", True), ("q4_0", "nl2", 5, 0, "q8_0", True),
                                               ("nl2", "q4_0", 20, 4, "iq4_nl", False), ("nl2b", "nl2", 5, 0, "nl4", True),
                                               ("tc2b", "tc3b", 20, 4, "q8_0", False), ("tc1b", "nl2", 5, 0, "f16", True)])
def test_window_matches_slow_reference(kt, vt, W, NS, wt, pre):
    """kv_window W: each query t reads the keys / values of its own newest W tokens (positions
    > n_past + t - W) as f16 copies and older ones as stored in the pool, in prefill (the per-row
    boundary inside a batch) and decode (the ring) alike.  The slow reference builds every query's
    K/V from the pushed rows (f16) and the dequantized pool, then runs the float64 attention.
    pre: pre-RoPE keys, whose ring rows attention maps back and ropes like the pool's."""
    rng = np.random.default_rng(11 + W)
    cfg = make_cfg(6, 2)
    H, HD = cfg.n_heads, cfg.head_dim
    cache = KVCache(cfg, 256, kt, vt, page_tokens=16, max_seqs=3, kv_window=W, kv_sinks=NS, kv_window_type=wt,
                    k_prerope=pre)
    for l in cache.layers:
        l.k_pool.fill(0x7F)
        l.v_pool.fill(0x7F)
    rng.shuffle(cache.free_pages)
    seq, other = cache.new_sequence(), cache.new_sequence()
    keys_back = lambda k: k                             # noqa: E731
    if pre:
        from pykv.kernels.ops import rope_tables
        cos, sin = rope_tables(256, HD, 10000.0)
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), HD)
        cache.set_k_transform(cos, sin, sign)
        seq.k_shift[0] = rng.standard_normal((cfg.n_kv_heads, HD))
        seq.k_scale[0] = rng.uniform(0.5, 2.0, (cfg.n_kv_heads, HD))
        keys_back = _prerope_back(seq, sign, cos, sin)
    rows_k, rows_v = [], []
    for T in (37, 7, 1, 1, 3, 1, 19, 1):
        push(cache, other, 5, rng)      # interleaved: the pages are not contiguous
        k, v = kv_rows(cfg, T, rng), kv_rows(cfg, T, rng)
        cache.reserve(seq, T)
        cache.append(0, seq, k, v)      # attend follows its append, as in model.py (the staged rows)
        seq.n_tokens += T
        rows_k.append(k)
        rows_v.append(v)
        kq, vq = dequant_cache(cache, seq)             # pool rows (sinks: their f16 copies)
        kf, vf = _round_trip(np.concatenate(rows_k), wt), _round_trip(np.concatenate(rows_v), wt)
        if NS:                                          # sinks are f16 whatever the window's rows
            kf[:NS], vf[:NS] = kq[:NS], vq[:NS]
        if vt == "f16":
            vf = vq
        kf, kq = keys_back(kf), keys_back(kq)
        n, n_past = seq.n_tokens, seq.n_tokens - T
        q = (rng.standard_normal((T, H, HD)) * 2.0 / math.sqrt(HD)).astype(np.float32)
        ref = np.empty((T, H, HD))
        for t in range(T):
            near = (np.arange(n) > n_past + t - W)[:, None, None]
            ref[t] = ref_attention(q[t:t + 1].astype(np.float64) * math.sqrt(HD), np.where(near, kf, kq),
                                   np.where(near, vf, vq), n_past=n_past + t)[0, :, :]
        # the window really changes the answer (else this test could not fail)
        plain = ref_attention(q.astype(np.float64) * math.sqrt(HD), kq, vq, n_past=n_past)
        assert np.abs(plain - ref).max() > 1e-3
        scale = np.abs(ref).max(axis=2, keepdims=True)
        for chunk in (1024, 16, 7):
            err = (np.abs(run_attend(cache, seq, q, chunk) - ref) / scale).max()
            assert err <= RTOL, f"{kt}/{vt} W={W} n={n} T={T} chunk={chunk}: relative error {err:.3g}"


def test_window_bytes_and_truncate():
    """The window ring is W f16 rows per quantized layer side (bits accounting), and a windowed
    sequence can only be cut back where its ring still holds the f16 rows."""
    from pykv.kv.cache import seq_overhead_bytes
    from pykv.files.formats import parse_kv_type
    cfg = make_cfg(6, 2, n_layers=2)
    row = 2 * cfg.head_dim * cfg.n_kv_heads * cfg.n_layers
    q4, f16, i4 = (parse_kv_type(t) for t in ("q4_0", "f16", "int4"))
    assert seq_overhead_bytes(cfg, q4, f16, 16, window=32, n_sink=8) == (32 + 8) * row
    assert seq_overhead_bytes(cfg, q4, q4, 16, window=0, n_sink=0) == 0
    assert seq_overhead_bytes(cfg, i4, f16, 16, window=32) - seq_overhead_bytes(cfg, i4, f16, 16) == 0
    q8row = 34 * cfg.head_dim // 32 * cfg.n_kv_heads * cfg.n_layers
    assert seq_overhead_bytes(cfg, q4, q4, 16, window=32, n_sink=0, window_type="q8_0") == 2 * 32 * q8row
    cache = KVCache(cfg, 128, "q4_0", "f16", page_tokens=16, kv_window=8)
    seq = cache.new_sequence()
    assert seq.residual[(0, "k")].shape == (cfg.n_kv_heads, 8, 2 * cfg.head_dim)
    assert (0, "v") not in seq.residual
    rng = np.random.default_rng(0)
    push(cache, seq, 6, rng)
    assert cache.can_truncate(seq, 3)                   # all 6 tokens still in the ring
    push(cache, seq, 20, rng)
    assert not cache.can_truncate(seq, 20) and cache.can_truncate(seq, 26) and cache.can_truncate(seq, 0)


def test_gemm_tile_matches_numpy():
    """simd.gemm_tile, the prefill's micro-tile: C[m0:m0+MR, n0:n0+NR] (+)= A B for A read through element
    strides (row-major and transposed), B and C row-major, K not a multiple of anything; the rest of C
    is untouched."""
    from numba import njit

    from pykv.kernels.simd import gemm_tile

    rng = np.random.default_rng(5)
    for MR, NR, add in [(4, 24, False), (4, 16, True), (4, 8, False), (2, 8, True)]:
        mk = gemm_tile(MR, NR, add)

        @njit
        def run(A, am, ak, B, C, m0, n0, K):
            mk(A, am, ak, B, C, m0, n0, K)

        for trans in (False, True):
            M, N, K, m0, n0 = 9, 40, 13, 3, 8
            A = rng.standard_normal((K, M) if trans else (M, K)).astype(np.float32)
            B = rng.standard_normal((K, N)).astype(np.float32)
            C = rng.standard_normal((M, N)).astype(np.float32)
            want = C.copy()
            Am = A.T if trans else A
            want[m0:m0 + MR, n0:n0 + NR] = (want[m0:m0 + MR, n0:n0 + NR] if add else 0) + (
                Am[m0:m0 + MR, :K].astype(np.float64) @ B[:K, n0:n0 + NR])
            run(A, 1 if trans else K, M if trans else 1, B, C, m0, n0, K)
            np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("W", [8, 16])
def test_qk_pv_rows_match_numpy(W):
    """simd.qk_rows / pv_rows, decode's scores and values: RB query rows against KG keys (RB x KG sums in
    registers, folded by _sum_lanes) and RB rows of p times n value rows, from f16 rows at a byte offset and
    stride (the pool read in place) and from an f32 tile; only the addressed outputs change."""
    from numba import njit

    from pykv.kernels.simd import pv_rows, qk_rows

    rng = np.random.default_rng(9)
    HD, rb = 4 * W, 4 * W * 2 + 6                  # f16 rows with 6 bytes of padding between them
    K = rng.standard_normal((24, HD)).astype(np.float16)
    raw = np.zeros(10 + 24 * rb, np.uint8)
    for r in range(24):
        raw[10 + r * rb:10 + r * rb + 2 * HD] = K[r].view(np.uint8)
    Kf = K.astype(np.float32)
    for RB in (1, 2, 3):
        for KG in (1, 2, 4, 8):
            qk = qk_rows(RB, KG, W)

            @njit
            def run_qk(q, x0, src, so, rbytes, s, r0):
                qk(q, x0, src, so, rbytes, s, r0)

            q = rng.standard_normal((5, HD)).astype(np.float32)
            for src, so, rbytes in ((raw, 10 + 3 * rb, rb), (Kf, 3 * HD * 4, HD * 4)):
                s = np.full((5, 16), -7.0, np.float32)
                run_qk(q, 1, src, so, rbytes, s, 2)
                want = np.full((5, 16), -7.0, np.float32)
                want[1:1 + RB, 2:2 + KG] = q[1:1 + RB].astype(np.float64) @ Kf[3:3 + KG].T
                np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-5)
        for NV in (1, 2, 4):
            pv = pv_rows(RB, NV, W)

            @njit
            def run_pv(p, x0, src, so, rbytes, n, acc, c0):
                pv(p, x0, src, so, rbytes, n, acc, c0)

            p = rng.random((5, 24)).astype(np.float32)
            for n in (1, 5, 13):
                for src, so, rbytes in ((raw, 10 + 2 * rb, rb), (Kf, 2 * HD * 4, HD * 4)):
                    acc = rng.standard_normal((5, HD)).astype(np.float32)
                    want = acc.astype(np.float64)
                    c0 = HD - NV * W
                    want[2:2 + RB, c0:c0 + NV * W] += p[2:2 + RB, :n] @ Kf[2:2 + n, c0:c0 + NV * W]
                    run_pv(p, 2, src, so, rbytes, n, acc, c0)
                    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)


def test_fwht_is_the_scalar_transform_bit_for_bit():
    """simd.fwht (the rotation of q / k / v and of attention's output, quantized caches) against the
    scalar butterfly and float64 scaling it replaces: the same bits both ways for every size it covers,
    the orthonormal Hadamard transform (numpy) to rounding, and False with v untouched for other sizes."""
    from numba import njit

    from pykv.kernels.ops import _fwht_loops
    from pykv.kernels.simd import FWHT_SIZES, fwht
    from pykv.kv.transform import hadamard

    @njit(fastmath=True)
    def vector(v, sign, inverse):
        return fwht(v, sign, inverse)

    @njit(fastmath=True)
    def scalar(v, sign, inverse):
        _fwht_loops(v, sign, inverse)

    rng = np.random.default_rng(11)
    for n in FWHT_SIZES:
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), n)
        H = hadamard(n) / np.sqrt(n)
        for inverse in (False, True):
            x = (rng.standard_normal(n) * 30).astype(np.float32)
            a, b = x.copy(), x.copy()
            assert vector(a, sign, inverse)
            scalar(b, sign, inverse)
            assert np.array_equal(a, b), (n, inverse)
            want = sign * (H @ x) if inverse else H @ (sign * x)
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-4)
    x = rng.standard_normal(256).astype(np.float32)
    a = x.copy()
    assert not vector(a, np.ones(256, np.float32), False) and np.array_equal(a, x)

_CACHED_CALL = """
import sys
import numpy as np
from pykv.files.config import Config
from pykv.kv.cache import KVCache
cfg = Config(arch="llama", n_layers=1, dim=576, n_heads=9, n_kv_heads=3, ff_dim=64, rope_base=10000.0,
             rope_dims=64, norm_eps=1e-5, n_ctx_train=4096, n_vocab=32)
rng = np.random.default_rng(5)
cache = KVCache(cfg, 64, "q4_0", "q4_0", page_tokens=16)
seq = cache.new_sequence()
cache.reserve(seq, 40)
cache.append(0, seq, rng.standard_normal((40, 3, 64)).astype(np.float32),
             rng.standard_normal((40, 3, 64)).astype(np.float32))
seq.n_tokens = 40
q = (rng.standard_normal((8, 9, 64)) / 8).astype(np.float32)
out = np.zeros((8, 9, 64), np.float32)
cache.attend(0, seq, q, 32, 16, np.zeros((8, 3, 3, 3, 66), np.float32), out)
np.save(sys.argv[1], out)
"""


def test_attend_loads_from_the_cache_in_a_new_process(tmp_path):
    """attend calls _item's compiled specializations by symbol (attention._call_item): a new process that
    loads attend from Numba's cache must load them first (attention._ItemsFirst), or the call jumps to an
    unresolved symbol (a segfault).  The first run here compiles or loads; the second is a new process
    loading everything from the cache, and must get the same bits."""
    import subprocess
    import sys
    outs = []
    for i in range(2):
        f = tmp_path / f"out{i}.npy"
        r = subprocess.run([sys.executable, "-c", _CACHED_CALL, str(f)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        outs.append(np.load(f))
    assert np.abs(outs[0]).max() > 0
    assert np.array_equal(outs[0], outs[1])


def test_attend_from_one_process_and_item_from_another_do_not_crash(tmp_path):
    """Numba's mangled names carry the compiling process's id, so a cache holding attend from one process
    and _item from another (two processes compiled _item at once, and the other saved last) has attend
    calling names no loaded _item defines: a new process segfaulted (exit 139).  attention._ItemsFirst
    then compiles attend again against the loaded _item (and saves it); the next process loads that."""
    import os
    import shutil
    import subprocess
    import sys
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run(i):
        f = tmp_path / f"out{i}.npy"
        r = subprocess.run([sys.executable, "-c", _CACHED_CALL, str(f)], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, (i, r.returncode, r.stderr[-2000:])
        return np.load(f)

    want = run(0)                                       # attend and _item of process 0
    folder = next((tmp_path / "cache").rglob("attention.attend-*.nbi")).parent
    saved = tmp_path / "saved"
    saved.mkdir()
    for p in folder.glob("attention.attend-*"):
        shutil.copy(p, saved / p.name)
    for p in list(folder.glob("attention.attend-*")) + list(folder.glob("attention._item-*")):
        p.unlink()
    assert np.array_equal(run(1), want)                 # process 1 compiles both again
    for p in saved.iterdir():                           # process 0's attend over process 1's
        shutil.copy(p, folder / p.name)
    assert np.array_equal(run(2), want)                 # segfaulted before the check
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("attention.attend-*")}
    assert np.array_equal(run(3), want)
    # process 3 loads the attend that process 2 saved: nothing compiled or saved again
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("attention.attend-*")} == stamps


def test_stack_scratch_is_separate_and_falls_back_to_the_heap():
    """simd.stack_array (a work item's scratch in its stack frame): arrays of the asked shape, C-contiguous,
    none overlapping another; a shape over the capacity takes np.empty."""
    from numba import types
    from pykv.kernels.simd import stack_array
    s2, s1 = stack_array(types.float32, 2), stack_array(types.int64, 1)

    @numba.njit
    def fill(R, HD, n):
        a = s2(256, R, HD) if R * HD <= 256 else np.empty((R, HD), np.float32)
        b = s2(256, R, HD) if R * HD <= 256 else np.empty((R, HD), np.float32)
        c = s1(16, n)
        for i in range(R):
            for j in range(HD):
                a[i, j] = i * 1000 + j
                b[i, j] = -1.0
        for i in range(n):
            c[i] = 7 * i
        return a.copy(), b.copy(), c.copy(), a.strides, a.ctypes.data != b.ctypes.data

    for R, HD in ((3, 64), (2, 32), (5, 64)):          # the last: over 256 values, on the heap
        a, b, c, strides, apart = fill(R, HD, 9)
        assert apart and strides == (4 * HD, 4) and a.shape == (R, HD)
        assert np.array_equal(a, np.arange(R)[:, None] * 1000 + np.arange(HD)[None, :])
        assert np.all(b == -1.0) and np.array_equal(c, 7 * np.arange(9))
