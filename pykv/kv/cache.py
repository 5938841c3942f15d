"""The paged, block-quantized KV cache.

Per layer, K and V each own a pool  uint8[KVH, n_pages, page_bytes]:
    block formats (ggml, fp8, f16/f32, KIVI values): page_bytes = P * row_bytes, token-major, so token
    slot s of a page is bytes [s*row_bytes, (s+1)*row_bytes) of each KV head: HD/QK blocks of one token;
    KIVI keys: one page quantized per channel across its P tokens (formats.kivi_page_bytes).
Every layer uses the same page ids, so a sequence has ONE page table  int32[max_pages]  and a token
count.  Token-adaptive window (`kv_window` W > 0, every quantized non-KIVI type): each token is still
quantized once, into the pool, on append, and its f16 copy also goes to a per-sequence ring
uint8[KVH, W, 2*HD]; attention reads the newest W tokens of each query from the ring, older ones from
the pool (as if the token were quantized when it leaves the window). The pools, the per-sequence f16 rows and a device copy of the page table (uploaded by
`reserve` only when it changed) live where the cache's backend runs its kernels (kernels.backend:
`append` and `attend` call be.kvquant / be.attention, the CPU's or the cuda twins). Each token's K/V row is quantized once, when appended; KIVI types keep the newest, not yet
full page as f16 rows in a per-sequence residual buffer  uint8[KVH, P, 2*HD]  and quantize the page
once when it fills. Attention (kernels.attention.attend) reads the pools in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pykv.files.config import Config, PykvError
from pykv.files.formats import KV_FORMATS, kivi_page_bytes, parse_kv_type, row_bytes
from pykv.kernels.backend import get_backend

F16 = KV_FORMATS["f16"]
SMOOTH_MODE = "std"  # post-RoPE key channel scale: "qk" (E[k^2]/E[q^2])^SMOOTH_QK_POW, "std" std(k)^SMOOTH_ALPHA;
                     # pre-RoPE keys (k_pre) always use "qk" (see smooth_stats)
SMOOTH_ALPHA = 0.5
SMOOTH_QK_POW = 0.2  # "qk": below the white-noise optimum 1/4 (a lower KL proxy there)
N_SINK = 4           # default: first tokens of a sequence also kept as exact f16 rows for quantized KV types
CHUNKS_PER_THREAD = 4   # decode attention chunks per worker
KIVI_WINDOW = 3      # KIVI: full pages kept in f16 behind the newest one (KIVI's recent-token window)


def kivi_bits(fmt) -> int:
    """Integer width of a KIVI format (int4 -> 4, int2 -> 2); 0 for every other kind."""
    return int(fmt.name[3:]) if fmt.kind == "kivi" else 0


def windowed(fmt) -> bool:
    """Whether a type takes the token-adaptive f16 window (every quantized type but KIVI's own ring)."""
    return fmt.kind not in ("float", "kivi")


WINDOW_TYPES = ("f16", "q8_0", "iq4_nl", "nl4")   # the window's ring rows (attention tells them by width)


def seq_overhead_bytes(cfg: Config, k_fmt, v_fmt, page_tokens: int = 32, window: int = 0,
                       n_sink: int = N_SINK, window_type: str = "f16") -> int:
    """Fixed bytes a sequence holds beside its pages: f16 sink rows for quantized types, KIVI's
    recent-page ring and the token-adaptive window's ring (all layers, K + V)."""
    row = 2 * cfg.head_dim * cfg.n_kv_heads * cfg.n_layers          # one f16 token row, all layers
    wrow = row_bytes(KV_FORMATS[window_type], cfg.head_dim) * cfg.n_kv_heads * cfg.n_layers
    total = 0
    for f in (k_fmt, v_fmt):
        if f.kind != "float":
            total += n_sink * row
        if f.kind == "kivi":
            total += (KIVI_WINDOW + 1) * page_tokens * row
        elif windowed(f):
            total += window * wrow
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
    page_table: np.ndarray             # int32 (max_pages,), -1 = unallocated (host)
    n_tokens: int = 0
    pt_dev: object = None              # the page table where the kernels run (the same array on the CPU)
    residual: dict = field(default_factory=dict)   # (layer, "k"|"v") -> uint8 (KVH, RING, 2*HD) f16 ring
    sink: dict = field(default_factory=dict)       # (layer, "k"|"v") -> uint8 (KVH, n_sink, 2*HD): views of sink_rows
    sink_rows: object = None           # uint8 (n_layers, 2, KVH, n_sink, 2*HD): every layer's K / V sink rows
    k_shift: np.ndarray | None = None   # f32 (n_layers, KVH, HD): per-channel key mean removed before quantizing
    k_scale: np.ndarray | None = None   # f32 (n_layers, KVH, HD): keys divided, queries multiplied by it
    # (residual, sink, k_shift, k_scale: backend arrays, on the device with the cuda backend)


@dataclass
class DecodeGroup:
    """A step's one-token sequences as the batched decode kernels take them (KVCache.decode_group)."""
    pos: np.ndarray          # int64 (S,): each sequence's position (its tokens so far)
    page_tables: np.ndarray  # int32 (S, max_pages)
    meta: np.ndarray         # int64 (S, 3): n_past, attention chunk, offset of its partials in part
    items: np.ndarray        # int32 (N, 2): (sequence, work item of its attention)
    part: np.ndarray         # f32: the sequences' attention partials (decode_group says how)
    shift: np.ndarray        # f32 (S, L, KVH, HD): key smoothing
    scale: np.ndarray
    sinks: np.ndarray        # uint8 (S, L, 2, KVH, NS, 2*HD): f16 sink rows
    pos_k: object            # pos, meta, items where the kernels run (the same arrays on the CPU)
    meta_k: object
    items_k: object


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
                 max_seqs: int = 1, kv_budget: int | None = None, k_smooth: bool = True, k_prerope=False,
                 backend=None, kv_window: int = 0, kv_sinks: int = N_SINK, kv_window_type: str = "f16"):
        self.cfg, self.n_ctx, self.P = cfg, int(n_ctx), int(page_tokens)
        self.be = be = backend if backend is not None else get_backend("cpu")
        HD, KVH = cfg.head_dim, cfg.n_kv_heads
        if self.P <= 0:
            raise PykvError("page size must be positive")
        if not 0 <= int(kv_window) <= self.n_ctx or not 0 <= int(kv_sinks) <= self.n_ctx:
            raise PykvError(f"--kv-window ({kv_window}) and --kv-sinks ({kv_sinks}) must be in 0..{self.n_ctx}")
        self.W, self.NS = int(kv_window), int(kv_sinks)
        if kv_window_type not in WINDOW_TYPES:
            raise PykvError(f"--kv-window-type must be one of {', '.join(WINDOW_TYPES)}, got {kv_window_type!r}")
        self.wfmt = KV_FORMATS[kv_window_type]
        if self.W and HD % self.wfmt.block_size:
            raise PykvError(f"--kv-window-type {kv_window_type} needs head_dim divisible by {self.wfmt.block_size} "
                            f"(head_dim {HD})")
        if self.W and be.name != "cpu":
            raise PykvError(f"the KV window (--kv-window) runs on the CPU only for now (device {be.name})")
        k_fmts = _fmt_list(k_types, cfg.n_layers, "cache-type-k")
        v_fmts = _fmt_list(v_types, cfg.n_layers, "cache-type-v")
        for f in k_fmts + v_fmts:
            if (f.kind == "klt" or f.tc_len) and be.name != "cpu":   # klt: its calibrated key transform is
                # CPU code; tc: the Viterbi encoder needs scratch arrays a CUDA thread does not allocate
                raise PykvError(f"KV type {f.name} runs on the CPU only for now (device {be.name})")
            if HD % f.block_size:
                raise PykvError(f"KV type {f.name} needs head_dim divisible by {f.block_size} (head_dim {HD})")
        for f in v_fmts:
            if f.kind == "klt":
                raise PykvError(f"KV type {f.name} is a key type (its calibrated transform is for keys); "
                                "use it with -ctk, not -ctv")
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
        if k_prerope and be.name != "cpu":
            raise PykvError(f"pre-RoPE keys run on the CPU only for now (device {be.name})")
        # opt-in for now: lower KL for every type, but q4_0's ppl change on the reference text rose
        # (docs/kv-formats.md "Query-aware smoothing and pre-RoPE keys"); None = off
        self.k_pre = [bool(k_prerope) and sm for sm in self.k_smooth]   # keys stored before RoPE
        self.k_rope = None        # (cos, sin, Hadamard signs or None): set_k_transform
        self.k_xf = [None] * cfg.n_layers   # klt key layers: (mk, mq, mu) for ops.key_xform (set_key_xf)
        self.capture = None       # a kv_transform.Capture: append / attend report keys and queries to it
        self.layers = [LayerKV(kf, vf, be.zeros((KVH, n_pages, pk), np.uint8),
                               be.zeros((KVH, n_pages, pv), np.uint8))
                       for kf, vf, (pk, pv) in zip(k_fmts, v_fmts, self.page_bytes)]
        self.free_pages = list(range(n_pages - 1, -1, -1))
        self.page_refs = np.zeros(n_pages, np.int32)   # sequences holding each page (fork shares pages)
        self.ring = (KIVI_WINDOW + 1) * self.P   # residual rows per KV head: a ring of whole pages
        self._dummy_res = be.zeros((KVH, self.ring, 2 * HD), np.uint8)
        self._dummy_sink = be.zeros((KVH, self.NS, 2 * HD), np.uint8)
        # attend's "no pre-RoPE transform" arguments (kx with no rows), made once, not per layer call
        self._no_kx = ((np.zeros((0, HD), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))
                       if be.name == "cpu" else (None, None, None))
        # decode steps with at most this many (keys x KV heads) run attention on the calling thread
        # (the CPU kernel's SERIAL_KEYS; a device backend has none)
        self._serial_keys = getattr(be.attention, "SERIAL_KEYS", 0)
        # and split a decode step's keys into chunks of at least this many (the CPU kernel's CHUNK_MIN)
        self._chunk_min = getattr(be.attention, "CHUNK_MIN", 0)
        self._tmp = be.zeros((KVH, self.P, HD), np.float32)
        self._stage = {}     # "k"|"v" -> f16 rows (KVH, W + T, 2*HD) of a prefill batch and its window
        self._fold = None    # per layer: its decode attention can run inside the chain (fold_args)
        self._no_sinks = {}  # decode_group's unread rows by batch size
        self._part_dev = None  # decode_group's device partials, the last shape

    def set_k_transform(self, cos, sin, sign) -> None:
        """The model's RoPE tables (n_ctx, n_rot/2) and Hadamard signs (HD,) (None: no rotation), which
        attention needs to turn pre-RoPE keys (k_pre) back into roped keys."""
        self.k_rope = (cos, sin, sign)

    def set_key_xf(self, maps) -> None:
        """Per layer None or the klt key transform (mk, mq, mu) (kv_transform.layer_maps), needed by
        every layer whose key type is klt."""
        for li, (l, m) in enumerate(zip(self.layers, maps)):
            if (l.k_fmt.kind == "klt") != (m is not None):
                raise PykvError(f"layer {li}: a key transform is needed exactly for klt key types")
        self.k_xf = [None if m is None else tuple(self.be.to_device(np.ascontiguousarray(a, np.float32)) for a in m)
                     for m in maps]
        self._fold = None

    def key_xf_id(self) -> str | None:
        """sha256 (16 hex) of the klt key transforms (None without klt layers): a state file's pages
        are only meaningful under the same transforms (Session checks it)."""
        if all(m is None for m in self.k_xf):
            return None
        import hashlib
        h = hashlib.sha256()
        for m in self.k_xf:
            if m is not None:
                for a in m:
                    h.update(np.ascontiguousarray(self.be.to_host(a)).tobytes())
        return h.hexdigest()[:16]

    def _kx(self, seq: Sequence, li: int):
        """attend's pre-RoPE key transform for layer li: (kx, cos, sin); kx has no rows when the
        layer's keys are stored after RoPE (None on a device backend)."""
        if not self.k_pre[li]:
            return self._no_kx
        cos, sin, sign = self.k_rope
        rows = [seq.k_shift[li], seq.k_scale[li]] + ([sign[None]] if sign is not None else [])
        return np.ascontiguousarray(np.concatenate(rows), np.float32), cos, sin

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
        be = self.be
        seq = Sequence(np.full(self.max_pages_per_seq, -1, np.int32))
        seq.pt_dev = be.to_device(seq.page_table)
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        seq.k_shift = be.to_device(np.zeros(shape, np.float32))   # identity smoothing
        seq.k_scale = be.to_device(np.ones(shape, np.float32))
        seq.sink_rows = be.zeros((cfg.n_layers, 2) + self._dummy_sink.shape, np.uint8)
        self._sink_views(seq)
        for li, l in enumerate(self.layers):
            for name, fmt in (("k", l.k_fmt), ("v", l.v_fmt)):
                if fmt.kind == "kivi":
                    seq.residual[(li, name)] = be.zeros(self._dummy_res.shape, np.uint8)
                elif windowed(fmt) and self.W:
                    seq.residual[(li, name)] = be.zeros((cfg.n_kv_heads, self.W, row_bytes(self.wfmt, cfg.head_dim)),
                                                        np.uint8)
        return seq

    def _sink_views(self, seq: Sequence) -> None:
        """seq.sink's entries: views of seq.sink_rows for every quantized side (float sides have none)."""
        seq.sink = {}
        if self.NS:
            for li, l in enumerate(self.layers):
                for side, (name, fmt) in enumerate((("k", l.k_fmt), ("v", l.v_fmt))):
                    if fmt.kind != "float":
                        seq.sink[(li, name)] = seq.sink_rows[li, side]

    def free_sequence(self, seq: Sequence) -> None:
        """Give the sequence's pages back to the pool (a page shared with a fork stays with it)."""
        self._drop_pages(seq, 0)
        seq.n_tokens = 0
        self._upload(seq)

    def _drop_pages(self, seq: Sequence, first: int) -> None:
        for i in range(first, len(seq.page_table)):
            p = int(seq.page_table[i])
            if p >= 0:
                self.page_refs[p] -= 1
                if self.page_refs[p] == 0:
                    self.free_pages.append(p)
                seq.page_table[i] = -1

    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Make room for n_new more tokens (all layers), or raise a clear error. A page the writes
        land in that another sequence shares (a fork's last, partial page) is copied first."""
        total = seq.n_tokens + n_new
        if total > self.n_ctx:
            raise PykvError(f"context full: {total} tokens exceed the context size {self.n_ctx} (use -c)")
        end = math.ceil(total / self.P)
        need = [i for i in range(end) if seq.page_table[i] < 0]
        shared = [i for i in range(seq.n_tokens // self.P, end)
                  if seq.page_table[i] >= 0 and self.page_refs[seq.page_table[i]] > 1]
        if len(need) + len(shared) > len(self.free_pages):
            raise PykvError(f"KV budget exhausted: {total} tokens need {len(need) + len(shared)} more pages of "
                            f"{self.P} tokens, {len(self.free_pages)} free ({self.nbytes()} bytes in the pool)")
        for i in shared:                        # copy-on-write
            old, new = int(seq.page_table[i]), self.free_pages.pop()
            for l in self.layers:
                l.k_pool[:, new] = l.k_pool[:, old]
                l.v_pool[:, new] = l.v_pool[:, old]
            self.page_refs[old] -= 1
            self.page_refs[new] = 1
            seq.page_table[i] = new
        for i in need:
            seq.page_table[i] = p = self.free_pages.pop()
            self.page_refs[p] = 1
        if need or shared:
            taken = need + shared
            self._upload(seq, min(taken), max(taken) + 1)

    def _upload(self, seq: Sequence, lo: int = 0, hi: int | None = None) -> None:
        """The device copy of the page table follows the host's (the same array on the CPU): entries
        lo .. hi - 1 changed, copied into the device array in place (a step that takes a page sends
        those entries, not a new table)."""
        if seq.pt_dev is seq.page_table:
            return
        if seq.pt_dev is None or hi is None:
            seq.pt_dev = self.be.to_device(seq.page_table)
        else:
            self.be.copy_span(seq.pt_dev, seq.page_table, lo, hi)

    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence holding the same tokens: the pages are shared (copied on write, see
        reserve); the per-sequence f16 sink rows, KIVI ring and key smoothing are copied."""
        cp = self._copy
        new = Sequence(seq.page_table.copy(), seq.n_tokens,
                       residual={k: cp(v) for k, v in seq.residual.items()},
                       sink_rows=cp(seq.sink_rows), k_shift=cp(seq.k_shift), k_scale=cp(seq.k_scale))
        self._sink_views(new)
        new.pt_dev = self.be.to_device(new.page_table)
        held = seq.page_table[seq.page_table >= 0]
        self.page_refs[held] += 1
        return new

    def can_truncate(self, seq: Sequence, n: int) -> bool:
        """Whether truncate(seq, n) keeps the cache exact. KIVI pages that left the f16 ring are
        quantized and their f16 rows gone, so a KIVI sequence can only be cut back within its ring
        (or to 0); a windowed sequence's ring holds only its newest W tokens' f16 rows, so it can only
        be cut back to 0, to its length, or while it is no longer than W."""
        if not 0 <= n <= seq.n_tokens:
            return False
        if self.W and 0 < n < seq.n_tokens and seq.n_tokens > self.W and any(
                windowed(f) for l in self.layers for f in (l.k_fmt, l.v_fmt)):
            return False
        return n == 0 or all(self.n_quantized(f, n) == self.n_quantized(f, seq.n_tokens)
                             for l in self.layers for f in (l.k_fmt, l.v_fmt) if f.kind == "kivi")

    def truncate(self, seq: Sequence, n: int) -> None:
        """Cut the sequence back to its first n tokens; pages past them go back to the pool."""
        if not self.can_truncate(seq, n):
            raise PykvError(f"cannot cut a sequence of {seq.n_tokens} tokens back to {n} exactly")
        self._drop_pages(seq, math.ceil(n / self.P))
        seq.n_tokens = n
        self._upload(seq)

    def _copy(self, a):
        """A copy of a backend array, on the same backend."""
        return self.be.to_device(np.array(self.be.to_host(a)))

    def n_pages_held(self, seq: Sequence) -> int:
        """Pages in the sequence's page table (shared ones included)."""
        return int((seq.page_table >= 0).sum())

    # ---- sequence state as arrays (Session.save / Session.load) -------------------------
    def _stored_pages(self, fmt, n_tokens: int) -> int:
        """Pages of one pool that hold a sequence's data: KIVI's newest pages are not written yet."""
        return math.ceil(self.n_quantized(fmt, n_tokens) / self.P)

    def export_seq(self, seq: Sequence) -> dict:
        """The sequence's cache as stored: name -> numpy array. Per layer li and K/V: the pages with
        data  uint8 (KVH, n_pages, page_bytes), the f16 sink rows and KIVI ring; then the key
        smoothing (k_shift, k_scale)."""
        out = {}
        for li, l in enumerate(self.layers):
            for name, fmt, pool in (("k", l.k_fmt, l.k_pool), ("v", l.v_fmt, l.v_pool)):
                out[f"{li}.{name}.pages"] = pool[:, seq.page_table[:self._stored_pages(fmt, seq.n_tokens)]]
                if (li, name) in seq.sink:
                    out[f"{li}.{name}.sink"] = seq.sink[(li, name)]
                if (li, name) in seq.residual:
                    out[f"{li}.{name}.ring"] = seq.residual[(li, name)]
        out["k_shift"], out["k_scale"] = seq.k_shift, seq.k_scale
        return out

    def import_seq(self, seq: Sequence, n_tokens: int, arrays: dict) -> None:
        """Fill an empty sequence from export_seq's arrays (shapes checked: PykvError on a mismatch)."""
        want = {}
        for li, l in enumerate(self.layers):
            for name, fmt, pool in (("k", l.k_fmt, l.k_pool), ("v", l.v_fmt, l.v_pool)):
                want[f"{li}.{name}.pages"] = (pool.shape[0], self._stored_pages(fmt, n_tokens), pool.shape[2])
                if (li, name) in seq.sink:
                    want[f"{li}.{name}.sink"] = seq.sink[(li, name)].shape
                if (li, name) in seq.residual:
                    want[f"{li}.{name}.ring"] = seq.residual[(li, name)].shape
        want["k_shift"] = want["k_scale"] = seq.k_shift.shape
        if set(arrays) != set(want):
            raise PykvError("state does not match this cache's layout")
        for k, shape in want.items():
            if tuple(arrays[k].shape) != tuple(shape):
                raise PykvError(f"state array {k} has shape {tuple(arrays[k].shape)}, this cache needs {shape}")
        self.free_sequence(seq)
        self.reserve(seq, n_tokens)
        for li, l in enumerate(self.layers):
            for name, pool in (("k", l.k_pool), ("v", l.v_pool)):
                pages = arrays[f"{li}.{name}.pages"]
                pool[:, seq.page_table[:pages.shape[1]]] = pages
                for part, d in (("sink", seq.sink), ("ring", seq.residual)):
                    if (li, name) in d:
                        d[(li, name)][...] = arrays[f"{li}.{name}.{part}"]
        seq.k_shift[...] = arrays["k_shift"]
        seq.k_scale[...] = arrays["k_scale"]
        seq.n_tokens = n_tokens
    # ---- append / read -----------------------------------------------------------------
    def append(self, li: int, seq: Sequence, k: np.ndarray, v: np.ndarray) -> None:
        """Quantize k, v (T, KVH, HD) f32 for positions seq.n_tokens .. + T into layer li.
        The caller advances seq.n_tokens once all layers are appended."""
        l, kq = self.layers[li], self.be.kvquant
        if self.capture is not None:
            self.capture.keys(li, self.be.to_host(k), seq.n_tokens)
        for x, fmt, pool, name in ((k, l.k_fmt, l.k_pool, "k"), (v, l.v_fmt, l.v_pool, "v")):
            if fmt.kind != "float" and seq.n_tokens < self.NS:
                e = min(x.shape[0], self.NS - seq.n_tokens)
                kq.write_residual(x[:e], seq.sink[(li, name)], seq.n_tokens, self.NS, F16.code)
            if fmt.kind != "kivi":
                kq.append_rows(x, pool, seq.pt_dev, seq.n_tokens, self.P, fmt.code)
                if self.W and windowed(fmt):
                    self._window_append(seq.residual[(li, name)], name, x, seq.n_tokens)
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
                    kq.flush_residual(res, (pf * self.P) % self.ring, pool, seq.page_table[pf], self.P,
                                   F16.code, fmt.code, bits, self._tmp)
                seg = min((j // self.P + 1) * self.P, end)
                kq.write_residual(x[j - seq.n_tokens:seg - seq.n_tokens], res, j, self.ring, F16.code)
                j = seg

    def _window_append(self, ring, name: str, x, n0: int) -> None:
        """The f16 (or q8_0: --kv-window-type) copies of a batch x (T, KVH, HD) at positions n0.. : a batch of T > 1 is staged with
        the W - 1 window rows before it (attend reads them there: each query its own window), and the
        ring keeps the newest W.  The staging rows are the cache's, one set per side: attend(li, seq)
        must follow append(li, seq) before another append, as in Model._layer."""
        kq, T, W = self.be.kvquant, x.shape[0], self.W
        if T > 1:
            RS = W + T
            st = self._stage.get(name)
            if st is None or st.shape[1] != RS:
                st = self._stage[name] = np.zeros((ring.shape[0], RS, ring.shape[2]), np.uint8)
            js = np.arange(max(0, n0 - W), n0)
            st[:, js % RS] = ring[:, js % W]
            kq.write_residual(x, st, n0, RS, self.wfmt.code)
        kq.write_residual(x, ring, n0, W, self.wfmt.code)

    def _reads(self, seq: Sequence, li: int, name: str, fmt, n_tot: int, T: int):
        """(f16 ring, nq, w) for attention over one side: KIVI reads tokens >= nq from its page ring;
        a windowed decode step (T == 1) tokens >= n_tot - W from the ring; a windowed prefill batch
        all tokens from the pool and each query's window (w = W) from the staged rows."""
        if fmt.kind == "kivi":
            return seq.residual[(li, name)], self.n_quantized(fmt, n_tot), 0
        if self.W and windowed(fmt):
            if T == 1:
                return seq.residual[(li, name)], max(0, n_tot - self.W), 0
            return self._stage[name], n_tot, self.W
        return self._dummy_res, n_tot, 0

    def smooth_stats(self, li: int, seq: Sequence, k: np.ndarray, q: np.ndarray | None = None) -> None:
        """Fix layer li's key smoothing from the sequence's first batch of keys k (T, KVH, HD) and
        queries q (T, H, HD): roped, or not yet roped where the layer stores pre-RoPE keys (k_pre; then
        attention scales each key back before RoPE, so the smoothing stays exact for any s, and a
        query's weight on a RoPE pair is the mean of the pair's E[q^2]).
        Removing a fixed vector mu from every key shifts all of a query's scores by the same q.mu, and
        dividing key channels by s while multiplying query channels by s keeps q.k: attention is
        unchanged in exact arithmetic, while the block quantizer no longer spends its range on the
        large per-channel bias and spread of LLaMA keys (ops.qkv_prep applies it; the attention-sink
        token 0 is left out of the statistics).  The scale is query-aware (SMOOTH_MODE "qk"): white
        quantization noise on the smoothed (and rotated) key makes a score error of variance about
        (sum_c E[k_c^2] / s_c^2) * (sum_c E[q_c^2] s_c^2), least at s_c = (E[k_c^2] / E[q_c^2])^(1/4)
        (k centred; q over the KV group's query heads); "std": s_c = std(k_c)^SMOOTH_ALPHA, blind to q.
        With a device backend the batch's keys and queries are copied to the host once (at a
        sequence's first batch only) and the two (KVH, HD) results go back up: too little work for
        a kernel of its own."""
        k = self.be.to_host(k)
        ks = k[1:] if k.shape[0] > 1 else k
        mu = ks.mean(axis=0)
        seq.k_shift[li] = mu
        if ks.shape[0] < 2:
            return
        ek = ((ks - mu) ** 2).mean(axis=0)                        # (KVH, HD)
        if (SMOOTH_MODE == "qk" or self.k_pre[li]) and q is not None:
            q = self.be.to_host(q)
            qs = q[1:] if q.shape[0] > 1 else q
            T, H, HD = qs.shape
            eq = (qs.reshape(T, ek.shape[0], H // ek.shape[0], HD) ** 2).mean(axis=(0, 2))   # (KVH, HD)
            if self.k_pre[li]:
                n_rot = self.cfg.rope_dims
                pm = 0.5 * (eq[:, 0:n_rot:2] + eq[:, 1:n_rot:2])
                eq[:, 0:n_rot:2] = pm
                eq[:, 1:n_rot:2] = pm
            eq = np.maximum(eq, 1e-4 * eq.max(axis=1, keepdims=True) + 1e-20)
            ek = np.maximum(ek, 1e-4 * ek.max(axis=1, keepdims=True) + 1e-20)
            sc = (ek / eq) ** SMOOTH_QK_POW
        elif SMOOTH_ALPHA > 0:
            sd = np.sqrt(ek)
            sd = np.maximum(sd, 1e-2 * sd.max(axis=1, keepdims=True) + 1e-12)
            sc = sd ** SMOOTH_ALPHA
        else:
            return
        seq.k_scale[li] = (sc / np.exp(np.log(sc).mean(axis=1, keepdims=True))).astype(np.float32)

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

    def chunk_for(self, n_tot: int, T: int, workers: int) -> int:
        """Keys per attention work item. Decode (T == 1) splits one long sequence into about
        CHUNKS_PER_THREAD chunks per worker (the backend's: on the CPU the CPUs the process may use, not
        the threads in use, so that the bits do not depend on the thread count) over the KV heads so every
        core works on it, in chunks of at least the backend's CHUNK_MIN keys (a batched step's many
        sequences fill the threads: shorter chunks only add items); prefill already has many query blocks,
        so one chunk."""
        P, KVH = self.P, self.cfg.n_kv_heads
        if T > 1 or n_tot * KVH <= self._serial_keys:   # one chunk: a serial decode step splits for nothing
            return P * -(-n_tot // P)
        want = max(1, (CHUNKS_PER_THREAD * workers) // KVH)
        return P * max(1, -(-n_tot // (P * want)), -(-self._chunk_min // P))

    def fold_static(self, li: int, cos, sin, part, n_rot: int, qmul):
        """Layer li's decode-chain attention arguments (kernels.chain.bind's kv): (k_pool, v_pool, the
        f16 ring rows (unread), the model's RoPE tables cos / sin, its part scratch (flat), kx, kx_cos,
        kx_sin, int64 (kcode, kbits, vcode, rcode, page tokens, n_rot), float32 (qmul,)), and the
        chain's idle per-call tuple (see fold_args)."""
        l, KVH, HD = self.layers[li], self.cfg.n_kv_heads, self.cfg.head_dim
        km = np.array([l.k_fmt.code, l.k_bits, l.v_fmt.code, self.F16_CODE, self.P, n_rot], np.int64)
        idle = (0, 1, 0, 0, 0, False, np.zeros(1, np.int32), self._dummy_sink, self._dummy_sink,
                np.zeros((1, KVH, HD), np.float32), np.ones((1, KVH, HD), np.float32))
        return ((l.k_pool, l.v_pool, self._dummy_res, cos, sin, part) + tuple(self._no_kx)
                + (km, np.array([qmul], np.float32))), idle

    def _foldable(self, li: int, any_backend: bool = False) -> bool:
        """Layer li's decode attention is one the chain (the CPU's; any_backend: or a batched decode
        step, decode_group) runs: keys stored after RoPE with no klt transform, no KIVI ring, no f16
        window (its appends and reads stay in KVCache)."""
        l = self.layers[li]
        return ((any_backend or self.be.name == "cpu") and not self.k_pre[li] and self.k_xf[li] is None
                and "kivi" not in (l.k_fmt.kind, l.v_fmt.kind)
                and not (self.W and (windowed(l.k_fmt) or windowed(l.v_fmt))))

    def fold_args(self, seq: Sequence, chunk: int) -> list:
        """Per layer, for the decode step of seq's next token: the per-call arguments of a chain that
        runs the layer's attention (kernels.chain: n_past, chunk, ns_k, ns_v, li, smooth, page table,
        K / V sink rows, key shift, key scale), or None where append / attend must run here instead:
        a layer _foldable rules out, the sequence's first token (its keys fix the smoothing), a token
        that lands in the f16 sink rows, a capture in progress."""
        n_past, L = seq.n_tokens, len(self.layers)
        fold = self._fold
        if fold is None:
            fold = self._fold = [self._foldable(li) for li in range(L)]
        if self.capture is not None or n_past == 0:
            return [None] * L
        out = []
        for li, l in enumerate(self.layers):
            kq, vq = l.k_fmt.kind != "float", l.v_fmt.kind != "float"
            if not fold[li] or ((kq or vq) and n_past < self.NS):
                out.append(None)
                continue
            out.append((n_past, chunk, self.NS if kq else 0, self.NS if vq else 0, li, self.k_smooth[li],
                        seq.pt_dev, self.sink(seq, li, "k"), self.sink(seq, li, "v"), seq.k_shift, seq.k_scale))
        return out

    def attend(self, li: int, seq: Sequence, q: np.ndarray, n_past: int, chunk: int, part: np.ndarray,
               out: np.ndarray) -> None:
        """Fused attention over layer li's pages for queries q (T, H, HD), pre-scaled by 1/sqrt(HD),
        at positions n_past .. n_past + T - 1, whose K/V are already appended; out (T, H, HD).
        part: scratch (T, KVH, C, G, HD + 2) with C >= ceil((n_past + T) / chunk)."""
        l, T = self.layers[li], q.shape[0]
        if self.capture is not None:
            self.capture.queries(li, self.be.to_host(q), n_past)
        n_tot = n_past + T
        kres, nq_k, wk = self._reads(seq, li, "k", l.k_fmt, n_tot, T)
        vres, nq_v, wv = self._reads(seq, li, "v", l.v_fmt, n_tot, T)
        self.be.attention.attend(
                q, l.k_pool, l.v_pool, kres, vres, self.sink(seq, li, "k"), self.sink(seq, li, "v"),
                seq.pt_dev, n_past, self.n_sink(l.k_fmt, n_tot), self.n_sink(l.v_fmt, n_tot),
                nq_k, nq_v, wk, wv, self.P, l.k_fmt.code, l.k_bits, l.v_fmt.code, self.F16_CODE, chunk, part, out,
                *self._kx(seq, li))

    def decode_group(self, seqs, workers: int):
        """The per-step arrays of batched decode (attend_seqs, append_seqs, qkv_prep_seqs) for a step's
        one-token sequences, before their tokens are counted (page tables, smoothing and sink rows where
        the kernels run; positions, meta and items on the host); None where a sequence or layer needs
        the per-sequence path: a layer _foldable rules out, a capture, a sequence's first token or one
        that lands in the f16 sink rows."""
        L, be = len(self.layers), self.be
        if self.capture is not None or not all(self._foldable(li, True) for li in range(L)):
            return None
        quant = any(f.kind != "float" for l in self.layers for f in (l.k_fmt, l.v_fmt))
        if any(s.n_tokens == 0 or (quant and s.n_tokens < self.NS) for s in seqs):
            return None
        KVH, HD, G = self.cfg.n_kv_heads, self.cfg.head_dim, self.cfg.n_heads // self.cfg.n_kv_heads
        S = len(seqs)
        meta = np.zeros((S, 3), np.int64)
        items, off, cmax = [], 0, 1
        for i, s in enumerate(seqs):
            n = s.n_tokens + 1
            chunk = self.chunk_for(n, 1, workers)
            C = -(-n // chunk)
            meta[i] = (s.n_tokens, chunk, off)
            items.append(np.stack([np.full(KVH * C, i), np.arange(KVH * C)], axis=1))
            off += KVH * C * G * (HD + 2)
            cmax = max(cmax, C)
        # the partials: back to back on the CPU; a device kernel cannot reshape, so there one
        # (S, KVH, most chunks, G, HD + 2) array
        if be.name == "cpu":
            part = be.zeros(off, np.float32)
        else:           # kept from step to step (each step writes the partials it reads): no allocation per token
            shape = (S, KVH, cmax, G, HD + 2)
            if self._part_dev is None or tuple(self._part_dev.shape) != shape:
                self._part_dev = be.zeros(shape, np.float32)
            part = self._part_dev
        def stack(arrays):      # one (S, ...) array where the kernels run
            if be.name == "cpu":
                return np.stack(arrays)
            if len(arrays) == 1:    # the device array itself, as (1, ...): no copies
                return arrays[0].reshape((1,) + tuple(arrays[0].shape))
            return be.to_device(np.stack([be.to_host(a) for a in arrays]))

        if quant:
            sinks = stack([s.sink_rows for s in seqs])
        else:       # nothing reads them: zeros of the shape, made once per batch size
            sinks = self._no_sinks.get(S)
            if sinks is None:
                sinks = self._no_sinks[S] = be.zeros((S,) + tuple(seqs[0].sink_rows.shape), np.uint8)
        smooth = any(self.k_smooth)
        pos, items = np.array([s.n_tokens for s in seqs], np.int64), np.concatenate(items).astype(np.int32)
        return DecodeGroup(pos, stack([s.pt_dev for s in seqs]), meta, items, part,
                           stack([s.k_shift for s in seqs]) if smooth else self._no_smooth(S, 0.0),
                           stack([s.k_scale for s in seqs]) if smooth else self._no_smooth(S, 1.0), sinks,
                           *(be.to_device(a) for a in (pos, meta, items)))

    def _no_smooth(self, S: int, value: float):
        """Identity key smoothing rows (S, L, KVH, HD) of a batch size (kept: no layer smooths)."""
        key = (S, value)
        a = self._no_sinks.get(key)
        if a is None:
            a = self._no_sinks[key] = self.be.to_device(
                np.full((S, self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim), value, np.float32))
        return a

    def append_seqs(self, li: int, grp: "DecodeGroup", k, v, prep) -> None:
        """append for a decode group: k, v (S, KVH, HD), row s at its sequence's next position, after
        qkv_prep_seqs with prep = (q, cos, sin, n_rot, sign, rotate, qmul) and the group's smoothing (one
        call: a GPU runs both in one launch)."""
        l = self.layers[li]
        q, cos, sin, n_rot, sign, rotate, qmul = prep
        self.be.kvquant.prep_append_seqs(q, k, v, grp.pos_k, cos, sin, n_rot, grp.shift, grp.scale, li,
                                         self.k_smooth[li], sign, rotate, qmul, l.k_pool, l.v_pool,
                                         grp.page_tables, self.P, l.k_fmt.code, l.v_fmt.code)

    def attend_seqs(self, li: int, grp: "DecodeGroup", q, out) -> None:
        """attend for a decode group, one call: q (S, H, HD) -> out (S, H, HD)."""
        l, S = self.layers[li], q.shape[0]
        self.be.attention.attend_seqs(
            q.reshape(S, 1, *q.shape[1:]), l.k_pool, l.v_pool, self._dummy_res, self._dummy_res, grp.sinks, li,
            self.n_sink(l.k_fmt, self.NS), self.n_sink(l.v_fmt, self.NS), grp.page_tables, grp.meta_k, grp.items_k,
            self.P, l.k_fmt.code, l.k_bits, l.v_fmt.code, self.F16_CODE, grp.part, out.reshape(S, 1, *out.shape[1:]),
            *self._no_kx)

    def attend_batch(self, li: int, seqs, q, chunk: int, part, out) -> None:
        """One decode query per sequence (their newest token, already appended): q (S, H, HD) -> out
        (S, H, HD) through kernels' attend_batch, one launch for all S sequences; part (S, KVH, C, G,
        HD + 2) with C >= ceil(max n_tokens / chunk).  The sequences' f16 sink / residual rows and
        page tables are stacked into (S, ...) arrays here, a staging copy per call: the GPU bandwidth
        benchmark's entry (tools/gpu_check.py, the cuda twin's one launch); batched decode goes through
        decode_group / attend_seqs, which stack once per step and keep each sequence's own chunk."""
        l, be = self.layers[li], self.be
        if self.k_pre[li]:
            raise PykvError("batched decode does not support pre-RoPE keys yet (load with kv_prerope=False)")
        meta = np.array([(s.n_tokens, self.n_sink(l.k_fmt, s.n_tokens), self.n_sink(l.v_fmt, s.n_tokens),
                          self._reads(s, li, "k", l.k_fmt, s.n_tokens, 1)[1],
                          self._reads(s, li, "v", l.v_fmt, s.n_tokens, 1)[1])
                         for s in seqs], np.int32)
        stack = [be.to_device(np.stack([be.to_host(f(s, li, name)) for s in seqs]))
                 for f, name in ((self.residual, "k"), (self.residual, "v"), (self.sink, "k"), (self.sink, "v"))]
        be.attention.attend_batch(q, l.k_pool, l.v_pool, *stack,
                                  be.to_device(np.stack([s.page_table for s in seqs])), be.to_device(meta),
                                  self.P, l.k_fmt.code, l.k_bits, l.v_fmt.code, self.F16_CODE, chunk, part, out)

    def n_sink(self, fmt, n_tokens: int) -> int:
        """Tokens read from the exact f16 sink rows: quantization error on the attention-sink
        tokens, which most queries weigh heavily, costs far more than anywhere else."""
        return 0 if fmt.kind == "float" else min(self.NS, n_tokens)

    def sink(self, seq: Sequence, li: int, name: str) -> np.ndarray:
        return seq.sink.get((li, name), self._dummy_sink)

    def residual(self, seq: Sequence, li: int, name: str) -> np.ndarray:
        return seq.residual.get((li, name), self._dummy_res)
