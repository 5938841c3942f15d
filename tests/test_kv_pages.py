"""KVCache page sharing: refcounts, fork copy-on-write, truncate, export/import (no model needed)."""
import numpy as np
import pytest

from pykv.files.config import Config, PykvError
from pykv.kv.cache import KVCache

CFG = Config(arch="llama", n_layers=2, dim=64, ff_dim=128, n_heads=2, n_kv_heads=1, rope_base=10000.0,
             rope_dims=32, norm_eps=1e-5, n_ctx_train=256, n_vocab=32)
P = 8


def _feed(cache, seq, n, rng):
    """Append n random token rows to every layer, as Model._batch does (reserve, append, advance)."""
    cache.reserve(seq, n)
    for li in range(CFG.n_layers):
        k = rng.standard_normal((n, CFG.n_kv_heads, CFG.head_dim)).astype(np.float32)
        v = rng.standard_normal((n, CFG.n_kv_heads, CFG.head_dim)).astype(np.float32)
        cache.append(li, seq, k, v)
    seq.n_tokens += n


def _state(cache, seq):
    return {k: np.array(v) for k, v in cache.export_seq(seq).items()}


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kv", ["f16", "q4_0", "int4"])
def test_fork_shares_pages_and_copies_on_write(kv):
    rng = np.random.default_rng(1)
    c = KVCache(CFG, 64, kv, kv, page_tokens=P, max_seqs=4)
    a = c.new_sequence()
    _feed(c, a, 3 * P + 3, rng)                       # 3 full pages + a partial one
    free0 = len(c.free_pages)
    before = _state(c, a)
    b = c.fork(a)
    assert len(c.free_pages) == free0                 # nothing copied yet
    assert np.array_equal(a.page_table, b.page_table) and (c.page_refs[a.page_table[:4]] == 2).all()
    assert _same(before, _state(c, b))
    _feed(c, b, 2, rng)                               # b writes into the shared partial page: copied first
    assert len(c.free_pages) == free0 - 1
    assert a.page_table[3] != b.page_table[3] and np.array_equal(a.page_table[:3], b.page_table[:3])
    assert _same(before, _state(c, a))                # a's pages, sink rows and ring untouched
    c.free_sequence(a)                                # b still holds the full pages
    assert (c.page_refs[b.page_table[:3]] == 1).all() and len(c.free_pages) == free0
    c.free_sequence(b)
    assert len(c.free_pages) == c.n_pages and not c.page_refs.any()


def _rows(rng, n):
    return [(rng.standard_normal((n, CFG.n_kv_heads, CFG.head_dim)).astype(np.float32),
             rng.standard_normal((n, CFG.n_kv_heads, CFG.head_dim)).astype(np.float32)) for _ in range(CFG.n_layers)]


def _feed_rows(cache, seq, rows, s, e):
    cache.reserve(seq, e - s)
    for li, (k, v) in enumerate(rows):
        cache.append(li, seq, k[s:e], v[s:e])
    seq.n_tokens += e - s


def _token_rows(cache, seq):
    """Per pool, the stored rows of the sequence's tokens (KVH, n_tokens, row_bytes): non-KIVI types."""
    out = {}
    for k, a in cache.export_seq(seq).items():
        if k.endswith("pages"):
            out[k] = np.array(a).reshape(a.shape[0], a.shape[1] * P, -1)[:, :seq.n_tokens]
    return out


def test_truncate_returns_pages_and_is_exact():
    rng = np.random.default_rng(2)
    x, y = _rows(rng, 2 * P + 5), _rows(rng, 3)
    c = KVCache(CFG, 64, "q8_0", "q8_0", page_tokens=P, max_seqs=2)
    a, b = c.new_sequence(), c.new_sequence()
    _feed_rows(c, a, x, 0, 2 * P + 5)
    free = len(c.free_pages)
    c.truncate(a, P + 2)
    assert a.n_tokens == P + 2 and len(c.free_pages) == free + 1 and (a.page_table[2:] < 0).all()
    _feed_rows(c, a, y, 0, 3)
    _feed_rows(c, b, x, 0, P + 2)          # a sequence that was never longer
    _feed_rows(c, b, y, 0, 3)
    ra, rb = _token_rows(c, a), _token_rows(c, b)
    assert _same(ra, rb)
    with pytest.raises(PykvError):
        c.truncate(a, P + 6)               # cannot grow by truncating


def test_kivi_truncate_only_within_its_f16_window():
    rng = np.random.default_rng(3)
    c = KVCache(CFG, 128, "int4", "int4", page_tokens=P)
    a = c.new_sequence()
    _feed(c, a, 9 * P + 2, rng)                       # pages 0..4 quantized, 5..9 in the f16 ring
    assert c.can_truncate(a, 9 * P + 1) and c.can_truncate(a, 0)
    assert not c.can_truncate(a, 8 * P)               # page 5 already left the ring's reach
    with pytest.raises(PykvError):
        c.truncate(a, 4 * P)


def test_export_import_round_trip_and_budget():
    rng = np.random.default_rng(4)
    c = KVCache(CFG, 64, "q4_0", "int4", page_tokens=P, max_seqs=2)
    a = c.new_sequence()
    _feed(c, a, 5 * P + 1, rng)
    st = _state(c, a)
    b = c.new_sequence()
    c.import_seq(b, a.n_tokens, st)
    assert _same(st, _state(c, b)) and set(a.page_table[:6]).isdisjoint(b.page_table[:6])
    bad = dict(st)
    bad["0.k.pages"] = bad["0.k.pages"][:, :1]
    with pytest.raises(PykvError, match="shape"):
        c.import_seq(c.new_sequence(), a.n_tokens, bad)
    # a pool of 2 contexts: a third full sequence does not fit
    with pytest.raises(PykvError, match="KV budget exhausted"):
        _feed(c, c.new_sequence(), 64, rng)


def test_decode_chunks_split_long_sequences_not_short_ones():
    """chunk_for (decode, the CPU kernel's SERIAL_KEYS / CHUNK_MIN): whole pages; no split of a sequence
    shorter than CHUNK_MIN keys (a batched step's items stay long); a long one split over the workers."""
    from pykv.kernels.attention import CHUNK_MIN, SERIAL_KEYS
    c = KVCache(CFG, 8192, "f16", "f16", page_tokens=P, max_seqs=2)
    KVH = CFG.n_kv_heads
    for n in (1, SERIAL_KEYS // KVH, SERIAL_KEYS // KVH + 1, CHUNK_MIN - 1, CHUNK_MIN + 5, 4096, 8000):
        for workers in (1, 2, 8):
            ch = c.chunk_for(n, 1, workers)
            assert ch % P == 0 and ch > 0
            C = -(-n // ch)
            if n <= CHUNK_MIN:
                assert C == 1, (n, workers, ch)
            else:
                assert ch >= CHUNK_MIN
    # a long sequence: about CHUNKS_PER_THREAD chunks per worker over the KV heads
    assert -(-4096 // c.chunk_for(4096, 1, 8)) > -(-4096 // c.chunk_for(4096, 1, 1)) > 1
    assert c.chunk_for(100, 4, 8) == P * -(-100 // P)          # prefill: one chunk
