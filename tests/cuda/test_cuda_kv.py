"""The KV cache on the cuda backend against the CPU's, under NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py).

Two caches of the same shape and page order, one per backend, are fed the same K/V batches: a prefill,
single-token decodes and batches that straddle pages (P = 4), past the sinks and, for KIVI, past the
f16 window so pages are flushed.  Then
  * every pool, sink and residual buffer is byte-identical (quantize-on-append, all KV types);
  * attention (kernels.cuda.attention: decode, prefill, several chunk counts, GQA groups 1 / 3 / 8,
    attend_batch over sequences of different lengths) equals the CPU's within float32 tolerance.
The simulator runs every CUDA thread as a Python thread, so the shapes are tiny (HD 32, 1-2 KV heads).
With PYKV_REAL_GPU=1 the same tests run the kernels on a GPU.
"""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from pykv.files.config import Config
from pykv.files.formats import KV_FORMATS
from pykv.kernels.backend import CudaBackend, get_backend
from pykv.kernels.cuda.shared import SIM
from pykv.kv.cache import KVCache

FORMATS = [n for n, f in KV_FORMATS.items() if f.kind not in ("nl", "klt")]
NL = [n for n, f in KV_FORMATS.items() if f.kind == "nl" and not f.tc_len]   # blocks of 64: head_dim 64 here;
# klt and the trellis-coded types: CPU only
P = 4
RTOL = 1e-4


class _KVOnly(CudaBackend):
    """The cuda backend's KV half (this branch before the cuda-core merge has no cuda matmul / ops)."""

    def __init__(self):
        from numba import cuda
        self.cuda, self.name = cuda, "cuda"
        for m in ("kvquant", "attention"):
            setattr(self, m, importlib.import_module(f"pykv.kernels.cuda.{m}"))

    def zeros(self, shape, dtype=np.float32):
        return self.cuda.to_device(np.zeros(shape, dtype))


@pytest.fixture(scope="module")
def be():
    try:
        backend = get_backend("cuda")
    except ModuleNotFoundError:
        backend = _KVOnly()
    # The simulator's threads hand the GIL to each other at every syncthreads; Python's default 5 ms
    # switch interval makes that about 5x slower than 0.2 ms.
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4 if SIM else old)
    yield backend
    sys.setswitchinterval(old)


def make_cfg(G, KVH, HD=32):
    return Config(arch="llama", n_layers=1, dim=G * KVH * HD, ff_dim=4 * HD, n_heads=G * KVH,
                  n_kv_heads=KVH, rope_base=10000.0, rope_dims=HD, norm_eps=1e-5, n_ctx_train=4096,
                  n_vocab=32)


def twin_caches(be, cfg, kt, vt, n_seqs=1, n_ctx=64):
    """A CPU cache and a cuda cache with the same (shuffled) free-page order."""
    order = np.random.default_rng(7).permutation(n_seqs * (n_ctx // P))
    out = []
    for b in (None, be):
        c = KVCache(cfg, n_ctx, kt, vt, page_tokens=P, max_seqs=n_seqs, backend=b)
        c.free_pages = [int(i) for i in order]
        out.append(c)
    return out


def rows(cfg, n, rng):
    x = rng.standard_normal((n, cfg.n_kv_heads, cfg.head_dim)) * rng.uniform(0.3, 2.0, (1, cfg.n_kv_heads,
                                                                                         cfg.head_dim))
    x[rng.random(x.shape) < 0.02] *= 6.0
    return x.astype(np.float32)


def feed(caches, seqs, n, rng):
    """Append n tokens of the same random K/V to each (cache, seq) pair."""
    k, v = rows(caches[0].cfg, n, rng), rows(caches[0].cfg, n, rng)
    for c, s in zip(caches, seqs):
        c.reserve(s, n)
        c.append(0, s, c.be.to_device(k), c.be.to_device(v))
        s.n_tokens += n


def batches(cache, total, plan):
    """Batch sizes from plan (cycled), clipped so KIVI batches do not cross a page (kivi_batch_limit)."""
    n, i = 0, 0
    while n < total:
        b = min(plan[i % len(plan)], total - n)
        lim = cache.kivi_batch_limit(n)
        if lim is not None:
            b = min(b, lim)
        yield b
        n += b
        i += 1


def same_bytes(cpu, dev, seq_c, seq_d, what):
    for li, (lc, ld) in enumerate(zip(cpu.layers, dev.layers)):
        for name, a, b in (("k_pool", lc.k_pool, ld.k_pool), ("v_pool", lc.v_pool, ld.v_pool)):
            bh = dev.be.to_host(b)
            bad = np.argwhere(a != bh)
            assert bad.size == 0, f"{what}: {name} differs at {len(bad)} bytes, first {bad[0].tolist()}"
        for name in ("k", "v"):
            for f in (cpu.residual, cpu.sink):
                a = f(seq_c, li, name)
                b = dev.be.to_host(getattr(dev, f.__name__)(seq_d, li, name))
                assert (a == b).all(), f"{what}: {f.__name__} {name} differs"


def attend_both(cpu, dev, sc, sd, q, chunk):
    T, H, HD = q.shape
    KVH = cpu.cfg.n_kv_heads
    n_past = sc.n_tokens - T
    C = -(-sc.n_tokens // chunk)
    outs = []
    for c, s in ((cpu, sc), (dev, sd)):
        part = c.be.zeros((T, KVH, C, H // KVH, HD + 2), np.float32)
        out = c.be.zeros((T, H, HD), np.float32)
        c.attend(0, s, c.be.to_device(q), n_past, chunk, part, out)
        outs.append(c.be.to_host(out))
    return outs


def close(a, b, what):
    err = np.abs(a - b).max() / max(np.abs(a).max(), 1e-6)
    assert np.isfinite(b).all() and err <= RTOL, f"{what}: relative error {err:.2e}"


def hd_for(fmt):
    return 64 if KV_FORMATS[fmt].kind == "nl" else 32


@pytest.mark.parametrize("fmt", FORMATS + NL)
def test_append_bytes_identical(be, fmt):
    """Quantize-on-append, sinks, KIVI window and page flushes: the cuda cache's bytes are the CPU's."""
    cfg = make_cfg(1, 2, HD=hd_for(fmt))
    cpu, dev = twin_caches(be, cfg, fmt, fmt)
    sc, sd = cpu.new_sequence(), dev.new_sequence()
    rng = np.random.default_rng(1)
    for n in batches(cpu, 26, [7, 1, 1, 5, 3, 1]):       # 26 > (KIVI_WINDOW + 2) * P: two KIVI flushes
        feed((cpu, dev), (sc, sd), n, rng)
        same_bytes(cpu, dev, sc, sd, f"{fmt} after {sc.n_tokens} tokens")


@pytest.mark.parametrize("fmt,G", [(f, 3) for f in FORMATS] + [("q4_0", 1), ("q4_0", 8), ("int4", 8),
                                                               ("f16", 1), ("nl4", 1), ("nl3b", 3)])
def test_attend_matches_cpu(be, fmt, G):
    """Decode (T = 1) at page-straddling depths and prefill (T > 1, causal, n_past > 0) over several
    chunk counts, GQA group G."""
    cfg = make_cfg(G, 2 if G < 8 else 1, HD=hd_for(fmt))
    H, HD = cfg.n_heads, cfg.head_dim
    cpu, dev = twin_caches(be, cfg, fmt, fmt)
    sc, sd = cpu.new_sequence(), dev.new_sequence()
    rng = np.random.default_rng(2)
    for n in batches(cpu, 18, [6, 5, 7]):
        feed((cpu, dev), (sc, sd), n, rng)
        q = rng.standard_normal((n, H, HD)).astype(np.float32) * 0.3
        for chunk in [64] + ([3] if sc.n_tokens == 18 else []):    # one chunk; 6 chunks of 3 keys
            a, b = attend_both(cpu, dev, sc, sd, q, chunk)
            close(a, b, f"{fmt} G={G} prefill T={n} n={sc.n_tokens} chunk={chunk}")
    for chunk in (7, 4, 64):                             # decode: depths 19, 20 (a page's end), 21
        feed((cpu, dev), (sc, sd), 1, rng)
        q = rng.standard_normal((1, H, HD)).astype(np.float32) * 0.3
        a, b = attend_both(cpu, dev, sc, sd, q, chunk)
        close(a, b, f"{fmt} G={G} decode n={sc.n_tokens} chunk={chunk}")


@pytest.mark.parametrize("kt,vt", [("q4_0", "q4_0"), ("int4", "int2"), ("f16", "f16")])
def test_attend_batch_matches_cpu(be, kt, vt):
    """attend_batch: three sequences of different lengths (one past the KIVI window) in one launch."""
    cfg = make_cfg(3, 2)
    H, HD, KVH = cfg.n_heads, cfg.head_dim, cfg.n_kv_heads
    cpu, dev = twin_caches(be, cfg, kt, vt, n_seqs=3)
    pairs = [(cpu.new_sequence(), dev.new_sequence()) for _ in range(3)]
    rng = np.random.default_rng(3)
    for (sc, sd), total in zip(pairs, (5, 22, 11)):
        for n in batches(cpu, total, [4, 1]):
            feed((cpu, dev), (sc, sd), n, rng)
    q = rng.standard_normal((3, H, HD)).astype(np.float32) * 0.3
    for chunk in (4, 64):
        C = -(-22 // chunk)
        outs = []
        for c, seqs in ((cpu, [p[0] for p in pairs]), (dev, [p[1] for p in pairs])):
            part = c.be.zeros((3, KVH, C, H // KVH, HD + 2), np.float32)
            out = c.be.zeros((3, H, HD), np.float32)
            c.attend_batch(0, seqs, c.be.to_device(q), chunk, part, out)
            outs.append(c.be.to_host(out))
        close(*outs, f"{kt}/{vt} batch chunk={chunk}")
        for i, (sc, _) in enumerate(pairs):               # and the CPU batch = the CPU's single attend
            a, _b = attend_both(cpu, dev, sc, pairs[i][1], q[i:i + 1], chunk)
            assert np.array_equal(a[0], outs[0][i])


def test_cuda_attention_limits(be):
    """Shapes the shared-memory tiles cannot hold give a one-line error, not a wrong answer."""
    from pykv.files.config import PykvError
    q = np.zeros((1, 17, 32), np.float32)
    with pytest.raises(PykvError, match="query heads per KV head"):
        be.attention.attend(q, np.zeros((1, 1, 8), np.uint8), np.zeros((1, 1, 8), np.uint8), None, None, None,
                            None, None, 0, 0, 0, 1, 1, 0, 0, 4, 1, 0, 1, 1, 4, None, None)


def test_smooth_stats_on_device(be):
    """Key smoothing statistics from device keys land in the sequence's device arrays, equal to the CPU's."""
    cfg = make_cfg(3, 2)
    cpu, dev = twin_caches(be, cfg, "q8_0", "q8_0")
    sc, sd = cpu.new_sequence(), dev.new_sequence()
    k = rows(cfg, 7, np.random.default_rng(4)) + 3.0
    cpu.smooth_stats(0, sc, k)
    dev.smooth_stats(0, sd, dev.be.to_device(k))
    for name in ("k_shift", "k_scale"):
        a, b = getattr(sc, name), dev.be.to_host(getattr(sd, name))
        assert np.abs(a - 1.0 * (name == "k_scale")).max() > 0.1, f"{name} was not set"
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("kt", ["klt2", "tc2b"])
def test_cpu_only_types_refused_on_cuda(kt):
    """klt key types need their calibrated key transform and the trellis-coded types a Viterbi search,
    CPU code for now: a cuda cache of them is a one-line error, not wrong numbers (the other nl types
    run there: the tests above)."""
    from pykv.files.config import PykvError
    cfg = make_cfg(1, 1, HD=64)
    assert KVCache(cfg, 64, "nl4", "nl3b", page_tokens=P, backend=get_backend("cuda")).layers[0].k_fmt.name == "nl4"
    with pytest.raises(PykvError, match="CPU only"):
        KVCache(cfg, 64, kt, "f16", page_tokens=P, backend=get_backend("cuda"))


def test_page_table_follows_the_host_in_place(be):
    """A reserve that takes pages copies only those entries into the same device page table; truncate
    and free keep it equal to the host's too."""
    cfg = make_cfg(1, 1)
    _, dev = twin_caches(be, cfg, "f16", "f16", n_seqs=2)
    seq = dev.new_sequence()
    first = seq.pt_dev
    rng = np.random.default_rng(1)
    for n in (3, 2, 7, 1, 9):                    # batches that straddle pages (P = 4)
        feed([dev], [seq], n, rng)
        assert seq.pt_dev is first                # no new device table
        np.testing.assert_array_equal(dev.be.to_host(seq.pt_dev), seq.page_table)
    other = dev.new_sequence()                    # a second sequence takes pages in between
    feed([dev], [other], 5, rng)
    feed([dev], [seq], 6, rng)
    np.testing.assert_array_equal(dev.be.to_host(seq.pt_dev), seq.page_table)
    np.testing.assert_array_equal(dev.be.to_host(other.pt_dev), other.page_table)
    dev.truncate(seq, 5)
    np.testing.assert_array_equal(dev.be.to_host(seq.pt_dev), seq.page_table)
    assert (seq.page_table[2:] < 0).all()
    dev.free_sequence(seq)
    np.testing.assert_array_equal(dev.be.to_host(seq.pt_dev), seq.page_table)
