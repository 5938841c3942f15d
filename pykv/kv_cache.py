"""The paged, block-quantized KV cache.

Per layer, K and V each own a pool  uint8[KVH, n_pages, page_bytes]:
    block formats (ggml, fp8, f16/f32, KIVI values): page_bytes = P * row_bytes, token-major, so token
    slot s of a page is bytes [s*row_bytes, (s+1)*row_bytes) of each KV head: HD/QK blocks of one token;
    KIVI keys: one page quantized per channel across its P tokens (formats.kivi_page_bytes).
Every layer uses the same page ids, so a sequence has ONE page table  int32[max_pages]  and a token
count. Each token's K/V row is quantized once, when appended; KIVI types keep the newest, not yet
full page as f16 rows in a per-sequence residual buffer  uint8[KVH, P, 2*HD]  and quantize the page
once when it fills. Attention (kernels.attention.attend) reads the pools in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import Config, PykvError
from .formats import KV_FORMATS, kivi_page_bytes, parse_kv_type, row_bytes
from .kernels.attention import attend as _attend
from .kernels.kvquant import append_rows, flush_residual, write_residual

F16 = KV_FORMATS["f16"]
SMOOTH_ALPHA = 0.5   # key channels divided by (std)^alpha, queries multiplied by it (see smooth_stats)
N_SINK = 4           # first tokens of a sequence also kept as exact f16 rows for quantized KV types
CHUNKS_PER_THREAD = 4   # decode attention chunks per thread (8 and 16 measured no faster)
KIVI_WINDOW = 3      # KIVI: full pages kept in f16 behind the newest one (KIVI's recent-token window)


def kivi_bits(fmt) -> int:
    """Integer width of a KIVI format (int4 -> 4, int2 -> 2); 0 for every other kind."""
    return int(fmt.name[3:]) if fmt.kind == "kivi" else 0


def seq_overhead_bytes(cfg: Config, k_fmt, v_fmt, page_tokens: int = 32) -> int:
    """Fixed f16 bytes a sequence holds beside its pages: sink rows for quantized types, and KIVI's
    recent-page ring (all layers, K + V)."""
    row = 2 * cfg.head_dim * cfg.n_kv_heads * cfg.n_layers          # one f16 token row, all layers
    total = 0
    for f in (k_fmt, v_fmt):
        if f.kind != "float":
            total += N_SINK * row
        if f.kind == "kivi":
            total += (KIVI_WINDOW + 1) * page_tokens * row
    return total


@dataclass
class LayerKV:
    k_fmt: object
    v_fmt: object
    k_pool: np.ndarray     # uint8 (KVH, n_pages, page_bytes_k): head-major, so a sequence's pages of
    v_pool: np.ndarray     # uint8 (KVH, n_pages, page_bytes_v)  one head are one contiguous stream

    @property
    def k_bits(self) -> int:   # > 0: KIVI keys (per-channel pages)
        return kivi_bits(self.k_fmt)


@dataclass
class Sequence:
    page_table: np.ndarray             # int32 (max_pages,), -1 = unallocated
    n_tokens: int = 0
    residual: dict = field(default_factory=dict)   # (layer, "k"|"v") -> uint8 (KVH, P, 2*HD)
    sink: dict = field(default_factory=dict)       # (layer, "k"|"v") -> uint8 (KVH, N_SINK, 2*HD)
    k_shift: np.ndarray | None = None   # f32 (n_layers, KVH, HD): per-channel key mean removed before quantizing
    k_scale: np.ndarray | None = None   # f32 (n_layers, KVH, HD): keys divided, queries multiplied by it


def _fmt_list(types, n_layers, what):
    if isinstance(types, str):
        types = [types]
    types = list(types)
    if len(types) == 1:
        types = types * n_layers
    if len(types) != n_layers:
        raise PykvError(f"{what}: got {len(types)} per-layer KV types for {n_layers} layers")
    try:
        return [parse_kv_type(t) for t in types]
    except ValueError as e:
        raise PykvError(str(e)) from None


class KVCache:
    F16_CODE = F16.code          # format of the residual rows
    def __init__(self, cfg: Config, n_ctx: int, k_types="f16", v_types="f16", page_tokens: int = 32,
                 max_seqs: int = 1, kv_budget: int | None = None, k_smooth: bool = True):
        self.cfg, self.n_ctx, self.P = cfg, int(n_ctx), int(page_tokens)
        HD, KVH = cfg.head_dim, cfg.n_kv_heads
        if self.P <= 0:
            raise PykvError("page size must be positive")
        k_fmts = _fmt_list(k_types, cfg.n_layers, "cache-type-k")
        v_fmts = _fmt_list(v_types, cfg.n_layers, "cache-type-v")
        for f in k_fmts + v_fmts:
            if HD % f.block_size:
                raise PykvError(f"KV type {f.name} needs head_dim divisible by {f.block_size} (head_dim {HD})")
        self.max_pages_per_seq = math.ceil(self.n_ctx / self.P)
        self.page_bytes = [(self._page_bytes(kf, True), self._page_bytes(vf, False))
                           for kf, vf in zip(k_fmts, v_fmts)]
        self.bytes_per_page = sum(KVH * (a + b) for a, b in self.page_bytes)   # all layers, K + V
        if kv_budget is not None:
            n_pages = int(kv_budget) // self.bytes_per_page
            if n_pages < 1:
                raise PykvError(f"KV budget {kv_budget} bytes cannot hold one page of {self.P} tokens "
                                f"({self.bytes_per_page} bytes)")
        else:
            n_pages = max_seqs * self.max_pages_per_seq
        self.n_pages = n_pages
        self.k_smooth = [bool(k_smooth) and f.kind in ("ggml", "fp8", "nl") for f in k_fmts]
        self.layers = [LayerKV(kf, vf, np.zeros((KVH, n_pages, pk), np.uint8),
                               np.zeros((KVH, n_pages, pv), np.uint8))
                       for kf, vf, (pk, pv) in zip(k_fmts, v_fmts, self.page_bytes)]
        self.free_pages = list(range(n_pages - 1, -1, -1))
        self.ring = (KIVI_WINDOW + 1) * self.P   # residual rows per KV head: a ring of whole pages
        self._dummy_res = np.zeros((KVH, self.ring, 2 * HD), np.uint8)
        self._dummy_sink = np.zeros((KVH, N_SINK, 2 * HD), np.uint8)
        self._tmp = np.zeros((KVH, self.P, HD), np.float32)

    def _page_bytes(self, fmt, is_key: bool) -> int:
        if fmt.kind == "kivi" and is_key:
            return kivi_page_bytes(fmt, self.cfg.head_dim, self.P, True)
        return self.P * row_bytes(fmt, self.cfg.head_dim)

    def k_name(self) -> str:
        return ",".join(dict.fromkeys(l.k_fmt.name for l in self.layers))

    def v_name(self) -> str:
        return ",".join(dict.fromkeys(l.v_fmt.name for l in self.layers))

    # ---- byte accounting -------------------------------------------------------------
    def bytes_per_token(self) -> float:
        return self.bytes_per_page / self.P

    def nbytes(self) -> int:
        return sum(l.k_pool.nbytes + l.v_pool.nbytes for l in self.layers)

    def capacity_tokens(self) -> int:
        return self.n_pages * self.P

    # ---- sequences ---------------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        cfg = self.cfg
        seq = Sequence(np.full(self.max_pages_per_seq, -1, np.int32))
        seq.k_shift = np.zeros((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), np.float32)   # identity
        seq.k_scale = np.ones((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), np.float32)    # smoothing
        for li, l in enumerate(self.layers):
            for name, fmt in (("k", l.k_fmt), ("v", l.v_fmt)):
                if fmt.kind == "kivi":
                    seq.residual[(li, name)] = np.zeros_like(self._dummy_res)
                if fmt.kind != "float":
                    seq.sink[(li, name)] = np.zeros_like(self._dummy_sink)
        return seq

    def free_sequence(self, seq: Sequence) -> None:
        for i, p in enumerate(seq.page_table):
            if p >= 0:
                self.free_pages.append(int(p))
                seq.page_table[i] = -1
        seq.n_tokens = 0

    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Make room for n_new more tokens (all layers), or raise a clear error."""
        total = seq.n_tokens + n_new
        if total > self.n_ctx:
            raise PykvError(f"context full: {total} tokens exceed the context size {self.n_ctx} (use -c)")
        need = [i for i in range(math.ceil(total / self.P)) if seq.page_table[i] < 0]
        if len(need) > len(self.free_pages):
            raise PykvError(f"KV budget exhausted: {total} tokens need {len(need)} more pages of {self.P} "
                            f"tokens, {len(self.free_pages)} free ({self.nbytes()} bytes in the pool)")
        for i in need:
            seq.page_table[i] = self.free_pages.pop()

    # ---- append / read -----------------------------------------------------------------
    def append(self, li: int, seq: Sequence, k: np.ndarray, v: np.ndarray) -> None:
        """Quantize k, v (T, KVH, HD) f32 for positions seq.n_tokens .. + T into layer li.
        The caller advances seq.n_tokens once all layers are appended."""
        l = self.layers[li]
        for x, fmt, pool, name in ((k, l.k_fmt, l.k_pool, "k"), (v, l.v_fmt, l.v_pool, "v")):
            if fmt.kind != "float" and seq.n_tokens < N_SINK:
                e = min(x.shape[0], N_SINK - seq.n_tokens)
                write_residual(x[:e], seq.sink[(li, name)], seq.n_tokens, N_SINK, F16.code)
            if fmt.kind != "kivi":
                append_rows(x, pool, seq.page_table, seq.n_tokens, self.P, fmt.code)
                continue
            # KIVI: the newest KIVI_WINDOW + 1 pages live in f16 rows (a ring); a page is quantized
            # once, when the token that pushes it out of that window arrives, so the queries of a
            # page always see it in f16 (decode and a page-aligned prefill, see kivi_batch_limit,
            # then read exactly the same values).
            res = seq.residual[(li, name)]
            bits = kivi_bits(fmt) if name == "k" else 0
            j, end = seq.n_tokens, seq.n_tokens + x.shape[0]
            while j < end:
                pf = j // self.P - 1 - KIVI_WINDOW     # the page leaving the f16 window
                if j % self.P == 0 and pf >= 0:
                    flush_residual(res, (pf * self.P) % self.ring, pool, seq.page_table[pf], self.P,
                                   F16.code, fmt.code, bits, self._tmp)
                seg = min((j // self.P + 1) * self.P, end)
                write_residual(x[j - seq.n_tokens:seg - seq.n_tokens], res, j, self.ring, F16.code)
                j = seg

    def smooth_stats(self, li: int, seq: Sequence, k: np.ndarray) -> None:
        """Fix layer li's key smoothing from the sequence's first batch of (roped) keys k (T, KVH, HD).
        Removing a fixed vector mu from every key shifts all of a query's scores by the same q.mu, and
        dividing key channels by s while multiplying query channels by s keeps q.k: attention is
        unchanged in exact arithmetic, while the block quantizer no longer spends its range on the
        large per-channel bias and spread of LLaMA keys (ops.qkv_prep applies it; the attention-sink
        token 0 is left out of the statistics)."""
        ks = k[1:] if k.shape[0] > 1 else k
        mu = ks.mean(axis=0)
        seq.k_shift[li] = mu
        if SMOOTH_ALPHA > 0 and ks.shape[0] > 1:
            sd = np.sqrt(((ks - mu) ** 2).mean(axis=0))           # (KVH, HD)
            sd = np.maximum(sd, 1e-2 * sd.max(axis=1, keepdims=True) + 1e-12)
            sc = sd ** SMOOTH_ALPHA
            seq.k_scale[li] = sc / np.exp(np.log(sc).mean(axis=1, keepdims=True))

    def n_quantized(self, fmt, n_tokens: int) -> int:
        """Tokens read from the pool (the rest come from the f16 residual: KIVI's newest page)."""
        if fmt.kind != "kivi":
            return n_tokens
        return max(0, ((n_tokens - 1) // self.P - KIVI_WINDOW) * self.P)

    def kivi_batch_limit(self, n_tokens: int) -> int | None:
        """With KIVI layers a batch must not cross a page boundary, so every query sees the pages
        quantized exactly as a token-by-token decode would; None when no layer is KIVI."""
        if not any(f.kind == "kivi" for l in self.layers for f in (l.k_fmt, l.v_fmt)):
            return None
        return self.P - n_tokens % self.P

    def chunk_for(self, n_tot: int, T: int, threads: int) -> int:
        """Keys per attention work item. Decode (T == 1) splits one long sequence into about
        CHUNKS_PER_THREAD chunks per thread over the KV heads so every core works on it; prefill
        already has many query blocks, so one chunk."""
        P, KVH = self.P, self.cfg.n_kv_heads
        if T > 1:
            return P * -(-n_tot // P)
        want = max(1, (CHUNKS_PER_THREAD * threads) // KVH)
        return P * max(1, -(-n_tot // (P * want)))

    def attend(self, li: int, seq: Sequence, q: np.ndarray, n_past: int, chunk: int, part: np.ndarray,
               out: np.ndarray) -> None:
        """Fused attention over layer li's pages for queries q (T, H, HD), pre-scaled by 1/sqrt(HD),
        at positions n_past .. n_past + T - 1, whose K/V are already appended; out (T, H, HD).
        part: scratch (T, KVH, C, G, HD + 2) with C >= ceil((n_past + T) / chunk)."""
        l, n_tot = self.layers[li], n_past + q.shape[0]
        _attend(q, l.k_pool, l.v_pool, self.residual(seq, li, "k"), self.residual(seq, li, "v"),
                self.sink(seq, li, "k"), self.sink(seq, li, "v"), seq.page_table, n_past,
                self.n_sink(l.k_fmt, n_tot), self.n_sink(l.v_fmt, n_tot),
                self.n_quantized(l.k_fmt, n_tot), self.n_quantized(l.v_fmt, n_tot), self.P,
                l.k_fmt.code, l.k_bits, l.v_fmt.code, self.F16_CODE, chunk, part, out)

    def n_sink(self, fmt, n_tokens: int) -> int:
        """Tokens read from the exact f16 sink rows: quantization error on the attention-sink
        tokens, which most queries weigh heavily, costs far more than anywhere else."""
        return 0 if fmt.kind == "float" else min(N_SINK, n_tokens)

    def sink(self, seq: Sequence, li: int, name: str) -> np.ndarray:
        return seq.sink.get((li, name), self._dummy_sink)

    def residual(self, seq: Sequence, li: int, name: str) -> np.ndarray:
        return seq.residual.get((li, name), self._dummy_res)
