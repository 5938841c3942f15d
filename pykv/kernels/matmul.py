"""Matrix-vector / matrix-matrix products with GGUF weights kept quantized in memory.

Public API (used by the model code):

    prepare_weight(ggml_type, data, rows, cols) -> Weight      # once, at load
    Act(cols, max_tokens); act.set(x)                           # x float32 (T, cols)
    matmul(w, act, out)                                         # out[:T] = x @ W.T  (out float32 (>=T, rows))
    matmul_fused((wq, wk, wv), act, (q, k, v))                  # 2-3 weights, one parallel region (decode)
    fuse((wq, wk, wv))                                          # their one-region choice, made once (load)
    bind(w or fused, act, out or outs, T)()                     # the same, checks made once (decode)
    get_rows(w, ids, out)                                       # out[i] = dequantize(W[ids[i]])
    set_exact(flag)                                             # True: float activations (checking)

Block layouts (ggml, little endian; "d"/"m" are f16):
    Q8_0  34 B / 32: d, qs[32] int8                          x = d*q
    Q4_0  18 B / 32: d, qs[16]   (lo nibble: j, hi: j+16)   x = d*(q-8)
    Q4_1  20 B / 32: d, m, qs[16]                           x = d*q + m
    Q5_0  22 B / 32: d, qh u32, qs[16] (bit j of qh = bit 4 of element j)   x = d*(q-16)
    Q5_1  24 B / 32: d, m, qh u32, qs[16]                   x = d*q + m
    IQ4_NL 18 B / 32: d, qs[16] (as Q4_0)                   x = d*kvalues_iq4nl[q] (16 int8 levels)
    Q2_K  84 B / 256: scales[16] (lo nibble sc, hi nibble m), qs[64], d, dmin
          element 128h + 32k + l: q = (qs[32h + l] >> 2k) & 3, x = d*sc[e//16]*q - dmin*m[e//16]
    Q3_K 110 B / 256: hmask[32], qs[64], scales[12] (16 x 6-bit, stored +32), d
          q = ((qs[32h + l] >> 2k) & 3) - (0 if bit e//32 of hmask[e%32] else 4), x = d*(sc[e//16]-32)*q
    Q4_K 144 B / 256: d, dmin, scales[12] (8 x 6-bit sc and m), qs[128]
          (4 chunks of 32 bytes; chunk c: sub-block 2c = lo nibbles, 2c+1 = hi)   x = d*sc*q - dmin*m
    Q5_K 176 B / 256: d, dmin, scales[12], qh[32] (bit s of qh[l] = bit 4 of sub-block s, element l), qs[128]
    Q6_K 210 B / 256: ql[128], qh[64], scales[16] int8, d
          element 128h + 32k + l: lo4 = ql[64h + 32(k&1) + l] >> 4(k>>1), hi2 = qh[32h + l] >> 2k,
          x = d * sc[(128h + 32k + l) // 16] * (q - 32)

Quantized-activation ("q8") mode: activations are quantized once per Act (lazily, by the first kernel
that reads them) into llama.cpp's q8_0 blocks of 32 (d = amax/127, q = round(x/d), plus the block sum
of q) for every weight type but the K-quant tiles, which read llama.cpp's q8_K blocks of 256 (with int
sums per 16), so their dots equal llama.cpp's vec_dot_qX_K_q8_K.  Float weight types (F32/F16/BF16)
always use float x.

Integer-dot tiles (kernels.tiles: one source for the AVX-512 VNNI, AVX-VNNI, AVX2 and generic-vector
classes, chosen by what Numba compiles for), repacked at load:
  * Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL: tiles of TILE_ROWS rows whose 32-bit lanes hold 4 columns of
    one row, against q8_0 activations (llama.cpp's exact q4_0 ... q8_0, iq4_nl x q8 dot products).
  * Q2_K / Q3_K / Q4_K / Q5_K / Q6_K: tiles of KTILE_ROWS rows per 256-column super-block, against q8_K
    activations (scales unpacked at load to a byte per sub-block and row).
  One kernel per family serves decode and prefill (work items: tile x 16 tokens; a full tile takes 4
  of them a call, kernels.tiles.TOKEN_BLOCK); each call quantizes its activation rows first unless the
  Act holds them (serially for a few tokens, from 8 tokens in a parallel region).
  Any weight with a non-finite f16 scale runs the generic per-row q8 kernel.
With q8_act=False, Q4_0 / Q4_1 / Q8_0 use float-activation tiles (vectorized across rows); prefill
(T >= _BLAS_MIN_T) then goes through numba.get_num_threads() Python threads, each dequantizing a run of
row tiles (a work item, the same runs at every thread count) to a float32 W^T chunk and calling a
single-threaded sgemm.
"""
from __future__ import annotations
import numpy as np
import numba
from gguf import GGMLQuantizationType as _GT
from pykv.kernels.tiles import ISA, KBYTES, KTILE_ROWS, TILE_ROWS, dot_ktile_by, dot_tile_by, f16_bits, repack_ktile, repack_ktile_nb
from pykv.kernels.mm_raw import BF16, F16, F32, IQ4_NL, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, SUPPORTED_TYPES, _BLOCK, _act_set, _act_set_f, _get_rows_kernel, _mm_bf16, _mm_exact, _mm_f16, _mm_f32, _mm_q8_generic, quantize_act_q8, quantize_act_q8k
from pykv.kernels.mm_tiles import (_R_Q4, _R_Q8, _TILE_MAX, _call_kind, _entry, _mm_itile, _mm_itile_3, _mm_ktile,
                                   _mm_tile_q4, _mm_tile_q4_3, _mm_tile_q8, _repack_tiles_rows, _repack_ktile_rows,
                                   _KIND_RAW, _KIND_TILE_Q4, _KIND_TILE_Q8, _KIND_ITILE_Q4, _KIND_ITILE_Q8,
                                   _KIND_ITILE_Q5, _KIND_ITILE_Q40, _KIND_ITILE_Q50, _KIND_ITILE_IQ4, _KIND_KTILE,
                                   _ITILE_KINDS, _INT_KINDS, _TOK_NT, _TOK_NT_Q, _ITILE_FMT, _KTILE_FMT, _K_F16)
from pykv.kernels.mm_blas import _BLAS_MIN_T, _matmul_blas

__all__ = ["Weight", "Act", "prepare_weight", "matmul", "matmul_fused", "fuse", "Fused", "bind", "Bound", "get_rows", "set_exact", "quantize_act_q8",
           "quantize_act_q8k", "SUPPORTED_TYPES", "ISA"]
_FLOAT_TYPES = (F32, F16, BF16)

_EXACT = False


def set_exact(flag: bool) -> None:
    """True: float activations, weights dequantized on the fly (for checking). False: fastest path."""
    global _EXACT
    _EXACT = bool(flag)

# ----------------------------------------------------------------------------------------------------
# Python-level API
# ----------------------------------------------------------------------------------------------------



class Weight:
    """A 2-D GGUF weight prepared for matmul: ggml_type, rows, cols, nbytes (bytes matmul reads)."""

    __slots__ = ("ggml_type", "rows", "cols", "nbytes", "raw", "kind", "fw", "qt", "sc")

    @property
    def int_dot(self) -> bool:
        """True when the default (non-exact) mode uses 8-bit activations + integer dots."""
        return (self.kind == _KIND_RAW and self.ggml_type not in _FLOAT_TYPES) or self.kind in _INT_KINDS

    @property
    def act_block(self) -> int:
        """Activation quantization block of the integer path: 256 (q8_K, the K-quant tiles) or 32 (q8_0)."""
        return 256 if self.kind == _KIND_KTILE else 32

    def __repr__(self):
        return (f"Weight({_GT(self.ggml_type).name}, rows={self.rows}, cols={self.cols}, "
                f"nbytes={self.nbytes}, kind={self.kind})")


def _as_bytes(data: np.ndarray, rows: int, row_bytes: int, name: str) -> np.ndarray:
    if not isinstance(data, np.ndarray):
        raise ValueError(f"{name}: weight data must be a numpy array, got {type(data).__name__}")
    total = rows * row_bytes
    if data.nbytes != total:
        raise ValueError(f"{name}: expected {rows} rows x {row_bytes} bytes = {total} bytes for "
                         f"shape (rows={rows}), got array {data.dtype}{tuple(data.shape)} = {data.nbytes} bytes")
    if data.ndim >= 1 and data.shape[0] != rows and data.ndim == 2:
        raise ValueError(f"{name}: expected {rows} rows, got array of shape {tuple(data.shape)}")
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data.reshape(-1).view(np.uint8).reshape(rows, row_bytes)


def check_weight(ggml_type, data: np.ndarray, rows: int, cols: int):
    """(ggml type, raw uint8 (rows, row bytes)) of a GGUF 2-D weight (gguf shape [cols, rows]); shared by
    the CPU and CUDA prepare_weight. Raises ValueError on an unsupported type, a column count that is not
    a whole number of blocks, or data whose size does not match (rows, cols)."""
    try:
        gt = int(ggml_type)
    except (TypeError, ValueError):
        raise ValueError(f"ggml_type must be an integer, got {ggml_type!r}") from None
    if gt not in _BLOCK:
        try:
            nm = _GT(gt).name
        except ValueError:
            nm = str(gt)
        raise ValueError(f"unsupported weight type {nm}; supported: "
                         + ", ".join(_GT(t).name for t in SUPPORTED_TYPES))
    name = _GT(gt).name
    rows, cols = int(rows), int(cols)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"{name}: rows and cols must be positive, got rows={rows}, cols={cols}")
    be, bb = _BLOCK[gt]
    if cols % be:
        raise ValueError(f"{name}: cols={cols} is not a multiple of the block size {be}")
    return gt, _as_bytes(data, rows, cols // be * bb, name)


def prepare_weight(ggml_type: int, data: np.ndarray, rows: int, cols: int, q8_act: bool = True,
                   repack: bool = True) -> Weight:
    """Validate (check_weight) and wrap a GGUF 2-D weight (gguf shape [cols, rows]) for matmul/get_rows.
    q8_act=False keeps Q4_0/Q4_1/Q8_0 on the float-activation tiles and the K-quants on the generic kernel
    (the integer-dot tiles, q8 activations, are the default on every host).  repack=False: no tile copy
    (a weight only get_rows reads, such as an untied token_embd; matmul then runs the generic kernel)."""
    gt, raw = check_weight(ggml_type, data, rows, cols)
    rows, cols = int(rows), int(cols)
    bb = _BLOCK[gt][1]
    w = Weight()
    w.ggml_type, w.rows, w.cols = gt, rows, cols
    w.raw = raw
    w.kind = _KIND_RAW
    w.fw = w.qt = w.sc = None
    w.nbytes = int(raw.nbytes)
    if gt == F32:
        w.fw = raw.view(np.float32)
    elif gt in (F16, BF16):
        w.fw = raw.view(np.uint16)
    elif not repack:
        pass
    elif gt in (Q4_0, Q4_1, Q8_0) or (gt in (Q5_0, Q5_1, IQ4_NL) and q8_act):
        if q8_act:
            R, kind = TILE_ROWS, {Q8_0: _KIND_ITILE_Q8, Q5_0: _KIND_ITILE_Q50, Q5_1: _KIND_ITILE_Q5,
                                  Q4_0: _KIND_ITILE_Q40, Q4_1: _KIND_ITILE_Q4, IQ4_NL: _KIND_ITILE_IQ4}[gt]
        else:
            R, kind = (_R_Q8, _KIND_TILE_Q8) if gt == Q8_0 else (_R_Q4, _KIND_TILE_Q4)
        qt, sc = _repack_tiles_rows(gt, raw, rows, cols, R, q8_act)
        # the tile kernels run only with finite f16 scales (fast-math sums): inf / NaN stay on the generic kernel
        if _finite_f16(sc):
            w.qt, w.sc, w.kind = qt, sc, kind
            w.nbytes = int(qt.nbytes + sc.nbytes)
    elif gt in _KTILE_FMT and q8_act:
        R = KTILE_ROWS
        blk = raw.reshape(rows, -1, bb)
        if all(_finite_f16(f16_bits(blk[:, :, o:o + 2])) for o in _K_F16[gt]):
            w.qt = _repack_ktile_rows(_KTILE_FMT[gt], blk, R)
            w.kind = _KIND_KTILE
            w.nbytes = int(w.qt.nbytes)
    return w


def _finite_f16(h):
    return bool(np.all(h & np.uint16(0x7C00) != np.uint16(0x7C00)))


_N_CHUNKS = 64


class Act:
    """Preallocated activation buffer: float32 x (max_tokens, cols) and its q8 blocks."""

    def __init__(self, cols: int, max_tokens: int):
        cols, max_tokens = int(cols), int(max_tokens)
        if cols <= 0 or max_tokens <= 0:
            raise ValueError(f"Act: cols and max_tokens must be positive, got {cols}, {max_tokens}")
        self.cols = cols
        self.max_tokens = max_tokens
        self.T = 0
        self._q8_ok = False
        nb = cols // 32 if cols % 32 == 0 else 0
        self.x = np.zeros((max_tokens, cols), np.float32)
        self.xq = np.zeros((max_tokens, nb * 32), np.int8)
        self.xd = np.zeros((max_tokens, nb), np.float32)
        self.xs = np.zeros((max_tokens, nb), np.int32)
        self.xf = np.zeros((max_tokens, nb), np.float32)           # float sum of each x block
        nsb = cols // 256 if cols % 256 == 0 else 0                   # q8_K blocks (the K-quant tiles)
        self.xqk = np.zeros((max_tokens, nsb * 256), np.int8)
        self.xdk = np.zeros((max_tokens, nsb), np.float32)
        self.xbk = np.zeros((max_tokens, nsb * 16), np.int32)         # int sums of 16 codes
        self._q8k_ok = False
        self._tail = np.zeros((max_tokens, _TILE_MAX), np.float32)  # partial last row tile
        self._scratch = np.zeros((_N_CHUNKS, cols), np.float32)   # exact mode row buffers

    def set(self, x: np.ndarray) -> None:
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.cols:
            raise ValueError(f"Act.set: expected x of shape (T, {self.cols}), got {tuple(x.shape)}")
        T = x.shape[0]
        if T < 1 or T > self.max_tokens:
            raise ValueError(f"Act.set: T={T} outside 1..{self.max_tokens}")
        if x.dtype != np.float32:
            raise ValueError(f"Act.set: x must be float32, got {x.dtype}")
        _act_set_f(x, T, self.x, self.xf)
        self.T = T
        self._q8_ok = self._q8k_ok = False

    def mark(self, T: int) -> None:
        """x[:T] and xf[:T] were written directly (the fused producers in kernels.ops)."""
        if T < 1 or T > self.max_tokens:
            raise ValueError(f"Act.mark: T={T} outside 1..{self.max_tokens}")
        self.T = int(T)
        self._q8_ok = self._q8k_ok = False

    def _mark_quantized(self, k8: bool) -> None:
        """An integer kernel just quantized x[:T] into the q8_K (k8) or q8_0 blocks."""
        if k8:
            self._q8k_ok = True
        else:
            self._q8_ok = True

    def _need_q8(self) -> None:
        """The q8 blocks (only the generic integer-dot kernels read them): computed on first use."""
        if not self._q8_ok:
            _act_set(self.x, self.T, self.x, self.xq, self.xd, self.xs, self.xf)
            self._q8_ok = True


def _check_out(w: Weight, T: int, out: np.ndarray) -> None:
    if (out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != w.rows or out.shape[0] < T
            or not out.flags.c_contiguous):
        raise ValueError(f"matmul: out must be C-contiguous float32 (>={T}, {w.rows}), "
                         f"got {out.dtype}{tuple(out.shape)}")


def _int_args(w: Weight, T: int, act: Act, out: np.ndarray):
    """(kernel, literals, q8_K?, arguments after the quantize flag) of integer tile weight w for T tokens."""
    if w.kind == _KIND_KTILE:
        return _mm_ktile, (w.ggml_type,), True, (w.qt, w.rows, T, act.x, act.xqk, act.xdk, act.xbk, act._tail, out)
    return _mm_itile, (w.kind,), False, (w.qt, w.sc, w.rows, T, act.x, act.xq, act.xd, act.xs, act.xf, act._tail, out)


def _fused_args(f: "Fused", T: int, act: Act, outs) -> tuple:
    """_mm_itile_3's arguments after the quantize flag, for a one-region Fused f (f.ok == 1)."""
    a, b = f.ws[0], f.ws[1]
    oc = outs[2] if len(f.ws) == 3 else outs[1]
    return (a.qt, a.sc, outs[0], b.qt, b.sc, outs[1], f.cqt, f.csc, oc, T, act.x, act.xq, act.xd, act.xs, act.xf)


def matmul(w: Weight, act: Act, out: np.ndarray) -> None:
    """out[t, r] = dot(W[r, :], x[t, :]) for t < act.T."""
    T = act.T
    if act.cols != w.cols:
        raise ValueError(f"matmul: weight has {w.cols} cols, activation has {act.cols}")
    _check_out(w, T, out)
    gt = w.ggml_type
    if gt == F32:
        _mm_f32(w.fw, T, act.x, out)
    elif gt == F16:
        _mm_f16(w.fw, T, act.x, out)
    elif gt == BF16:
        _mm_bf16(w.fw, T, act.x, out)
    elif _EXACT:
        _mm_exact(gt, w.raw, T, act.x, act._scratch, out)
    elif w.kind in _INT_KINDS:
        disp, lits, k8, rest = _int_args(w, T, act, out)
        _call_kind(disp, lits, not (act._q8k_ok if k8 else act._q8_ok), *rest)
        act._mark_quantized(k8)
    elif T >= _BLAS_MIN_T and w.kind != _KIND_RAW:
        _matmul_blas(w, T, act.x, out)
    elif w.kind == _KIND_TILE_Q4:
        _mm_tile_q4(w.qt, w.sc, w.rows, T, act.x, act.xf, act._tail, out)
    elif w.kind == _KIND_TILE_Q8:
        _mm_tile_q8(w.qt, w.sc, w.rows, T, act.x, act._tail, out)
    else:
        act._need_q8()
        _mm_q8_generic(gt, w.raw, T, act.xq, act.xd, act.xs, out)


class Fused:
    """2 or 3 weights that share one activation (Q/K/V, gate/up) with matmul_fused's choice of one
    parallel region made once, at load (fuse); iterates like the tuple of its weights."""

    __slots__ = ("ws", "ok", "kinds", "cqt", "csc", "cols", "entry")

    def __init__(self, ws):
        self.ws = ws = tuple(ws)
        self.entry = None             # the compiled _mm_itile_3 specialization for these kinds
        itile = all(w.kind in _ITILE_KINDS for w in ws)                 # integer tiles, any mix of Q4 / Q5 / Q8
        q4 = all(w.kind == _KIND_TILE_Q4 for w in ws)                    # float Q4 tiles: decode only
        self.cols = ws[0].cols
        # 0: one call each; 1: one region for integer tiles; 2: for float Q4 tiles while act.T is small
        self.ok = 0
        if 2 <= len(ws) <= 3 and (itile or q4) and all(w.cols == self.cols and w.rows % w.qt.shape[3] == 0
                                                       for w in ws):
            self.ok = 1 if itile else 2
            c = ws[2] if len(ws) == 3 else ws[1]
            n = c.qt.shape[0] if len(ws) == 3 else 0       # two weights: an empty third
            self.cqt, self.csc = c.qt[:n], c.sc[:n]
            self.kinds = (ws[0].kind, ws[1].kind, c.kind)

    def __iter__(self):
        return iter(self.ws)

    def __len__(self):
        return len(self.ws)

    def __getitem__(self, i):
        return self.ws[i]


def fuse(ws) -> Fused:
    """The weights ws (2 or 3, sharing an activation) prepared for matmul_fused (Model keeps one per
    Q/K/V and gate/up, so a decode step does not redo the checks)."""
    return Fused(ws)


def matmul_fused(ws, act: Act, outs) -> None:
    """matmul(ws[i], act, outs[i]) for 2 or 3 weights sharing act (a Fused from fuse, or a tuple), in
    one parallel region when they are all full-tile integer tile weights (Q4_0 / Q4_1 / Q5_0 / Q5_1 /
    Q8_0, any mix: one region for a Q4_K_M file's Q5_0 Q/K and Q8_0 V), or float Q4 tile weights with
    act.T small (decode); otherwise one call each."""
    f = ws if isinstance(ws, Fused) else Fused(ws)
    T = act.T
    if not _EXACT and f.ok and f.cols == act.cols and (f.ok == 1 or T < _BLAS_MIN_T):
        ws = f.ws
        for w, o in zip(ws, outs):
            _check_out(w, T, o)
        if f.ok == 1:
            args = (not act._q8_ok,) + _fused_args(f, T, act, outs)
            if f.entry is None:       # compiles or loads the specialization, then keeps its entry point
                f.entry = _entry(_mm_itile_3, f.kinds, args)
            f.entry(*f.kinds, *args)
            act._q8_ok = True
        else:
            a, b = ws[0], ws[1]
            oc = outs[2] if len(ws) == 3 else outs[1]
            _mm_tile_q4_3(a.qt, a.sc, outs[0], b.qt, b.sc, outs[1], f.cqt, f.csc, oc, T, act.x, act.xf)
        return
    for w, o in zip(f.ws, outs):
        matmul(w, act, o)


class Bound:
    """matmul(ws, act, outs) (ws a Weight) or matmul_fused (ws a Fused or tuple), for act.T == T tokens,
    as one call whose checks and argument list were made once: Model's decode step keeps one per
    weight per layer (the Python around each kernel call was a visible share of a decode token).
    The first call, any call with another act.T, and every call in exact mode go through
    matmul / matmul_fused; once those picked a one-region integer kernel, later calls run its
    compiled entry point directly with the same arguments."""

    __slots__ = ("ws", "act", "outs", "T", "entry", "lits", "rest", "k8")

    def __init__(self, ws, act: "Act", outs, T: int):
        self.ws, self.act, self.outs, self.T = ws, act, outs, int(T)
        self.entry = None

    def __call__(self) -> None:
        a = self.act
        if self.entry is None or _EXACT or a.T != self.T:
            if isinstance(self.ws, Weight):
                matmul(self.ws, a, self.outs)
            else:
                matmul_fused(self.ws, a, self.outs)
            if self.entry is None and not _EXACT and a.T == self.T:
                self._resolve()
        else:
            self.entry(*self.lits, not (a._q8k_ok if self.k8 else a._q8_ok), *self.rest)
            a._mark_quantized(self.k8)

    def _resolve(self) -> None:
        """The entry point and arguments matmul / matmul_fused just used, where they used one of the
        literal-specialized integer kernels (else calls keep going through them)."""
        a, T, w = self.act, self.T, self.ws
        if isinstance(w, Fused):
            if w.ok == 1 and w.cols == a.cols and w.entry is not None:
                self.lits, self.k8, self.rest = w.kinds, False, _fused_args(w, T, a, self.outs)
                self.entry = w.entry
        elif w.ggml_type not in _FLOAT_TYPES and w.kind in _INT_KINDS:
            disp, self.lits, self.k8, self.rest = _int_args(w, T, a, self.outs)
            self.entry = _entry(disp, self.lits, (False,) + self.rest)


def bind(ws, act: "Act", outs, T: int) -> Bound:
    """ws: a Weight (outs: its output array) or a Fused / tuple of weights (outs: their outputs), for
    T tokens of act; calling the result runs matmul / matmul_fused on them (see Bound)."""
    if not isinstance(ws, (Weight, Fused)):
        ws = Fused(ws)
    return Bound(ws, act, outs, T)


def get_rows(w: Weight, ids: np.ndarray, out: np.ndarray) -> None:
    """out[i, :] = dequantize(W[ids[i], :]) (bit-exact with gguf.quants.dequantize)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"get_rows: ids must be a 1-D integer array, got {ids.dtype}{tuple(ids.shape)}")
    n = ids.shape[0]
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[0] < n or out.shape[1] != w.cols \
            or not out.flags.c_contiguous:
        raise ValueError(f"get_rows: out must be C-contiguous float32 (>={n}, {w.cols}), "
                         f"got {out.dtype}{tuple(out.shape)}")
    if n and (ids.min() < 0 or ids.max() >= w.rows):
        raise ValueError(f"get_rows: ids out of range [0, {w.rows})")
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    _call_kind(_get_rows_kernel, int(w.ggml_type), w.raw, ids, out)
