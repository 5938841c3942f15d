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
  Act holds them (serially for a few tokens, from 8 tokens in a parallel region).  Measured on SmolLM2 (2 threads, Zen 5, AVX-512
  VNNI): decode 35 GB/s of weights from DRAM (2.9x the float tiles), prefill 3.9x dequantize + sgemm.
  Any weight with a non-finite f16 scale runs the generic per-row q8 kernel.
With q8_act=False, Q4_0 / Q4_1 / Q8_0 use float-activation tiles (vectorized across rows); prefill
(T >= _BLAS_MIN_T) then goes through numba.get_num_threads() Python threads, each dequantizing a run of
row tiles (a work item, the same runs at every thread count) to a float32 W^T chunk and calling a
single-threaded sgemm.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
from numba import literally, njit, prange, types
from numba.extending import overload
from numba._dispatcher import compute_fingerprint
import numba

from gguf import GGMLQuantizationType as _GT

from ..formats import KV_FORMATS
from .blocks import KVALUES_IQ4NL, deq_rows, rd_f16
from .ops import PAR_T
from .simd import h2f
# (the tiles' weight-prefetch policy per ISA class: kernels.tiles PF_BYTES / KPF_AHEAD)
from .tiles import (ISA, KBYTES, KTILE_ROWS, TILE_ROWS, dot_ktile_by, dot_tile_by, f16_bits, lanes, repack_ktile,
                    repack_ktile_nb)

__all__ = ["Weight", "Act", "prepare_weight", "matmul", "matmul_fused", "fuse", "Fused", "bind", "Bound", "get_rows", "set_exact", "quantize_act_q8",
           "quantize_act_q8k", "SUPPORTED_TYPES", "ISA"]

# fast-math without nnan/ninf (keeps inf/nan semantics honest) and without denormal flushing
_FM = {"contract", "reassoc", "nsz", "arcp"}

F32, F16, BF16 = int(_GT.F32), int(_GT.F16), int(_GT.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(_GT.Q4_0), int(_GT.Q4_1), int(_GT.Q5_0), int(_GT.Q5_1), int(_GT.Q8_0)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(_GT.Q2_K), int(_GT.Q3_K), int(_GT.Q4_K), int(_GT.Q5_K), int(_GT.Q6_K)
IQ4_NL = int(_GT.IQ4_NL)

# ggml type -> (elements per block, bytes per block)
_BLOCK = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
    IQ4_NL: (32, 18),
}
SUPPORTED_TYPES = tuple(_BLOCK)
_KV_CODE = np.full(max(_BLOCK) + 1, -1, np.int64)       # ggml type -> pykv.formats code (same bytes)
for _f in KV_FORMATS.values():
    if _f.ggml_type is not None and int(_f.ggml_type) in _BLOCK:
        _KV_CODE[int(_f.ggml_type)] = _f.code
del _f
_FLOAT_TYPES = (F32, F16, BF16)

_EXACT = False


def set_exact(flag: bool) -> None:
    """True: float activations, weights dequantized on the fly (for checking). False: fastest path."""
    global _EXACT
    _EXACT = bool(flag)


# ----------------------------------------------------------------------------------------------------
# scalar helpers
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _q3k_scale(w, o, j):
    """signed scale j (0..15) of a Q3_K block from the 12 packed bytes at w[o:o+12]."""
    lo = (np.int32(w[o + j]) & 15) if j < 8 else (np.int32(w[o + j - 8]) >> 4)
    return (lo | (((np.int32(w[o + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3) << 4)) - 32


@njit(cache=True, nogil=True, inline="always")
def _q23k_q(kind, w, o, e):
    """2-bit (Q2_K) or signed 3-bit (Q3_K) quant of element e (0..255) of the block at w[o:]."""
    h = e >> 7
    k = (e >> 5) & 3
    l = e & 31
    if kind == Q2_K:
        return (np.int32(w[o + 16 + 32 * h + l]) >> (2 * k)) & 3
    q = (np.int32(w[o + 32 + 32 * h + l]) >> (2 * k)) & 3
    if (np.int32(w[o + (e & 31)]) >> (e >> 5)) & 1 == 0:
        q -= 4
    return q


@njit(cache=True, nogil=True, inline="always")
def _k_scale_min(w, o, s):
    """6-bit (scale, min) of sub-block s (0..7) from the 12 packed bytes at w[o:o+12] (Q4_K/Q5_K)."""
    if s < 4:
        sc = np.int32(w[o + s]) & 63
        mn = np.int32(w[o + s + 4]) & 63
    else:
        sc = (np.int32(w[o + s + 4]) & 0x0F) | ((np.int32(w[o + s - 4]) >> 6) << 4)
        mn = (np.int32(w[o + s + 4]) >> 4) | ((np.int32(w[o + s]) >> 6) << 4)
    return sc, mn


# ----------------------------------------------------------------------------------------------------
# row dequantization (bit-exact with gguf.quants.dequantize: same float32 operations, no FMA contraction;
# the KV cache's formats through kernels.blocks.deq_rows, the K-quants here)
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _deq_row(kind, w, y):
    if kind < Q2_K or kind > Q6_K:        # the KV cache's formats: one decoder each
        deq_rows(_KV_CODE[kind], w, 0, 0, 1, y.reshape(1, y.shape[0]))
    else:
        _deq_row_k(kind, w, y)


@njit(cache=True, nogil=True)
def _deq_row_k(kind, w, y):
    """A K-quant row (Q2_K ... Q6_K)."""
    n = y.shape[0]
    if kind == Q2_K:
        for b in range(n // 256):
            o = 84 * b
            d = rd_f16(w, o + 80)
            dmin = rd_f16(w, o + 82)
            for s in range(16):
                sc = np.int32(w[o + s])
                dl = d * np.float32(sc & 15)
                ml = dmin * np.float32(sc >> 4)
                for l in range(16):
                    e = 16 * s + l
                    y[256 * b + e] = dl * np.float32(_q23k_q(Q2_K, w, o, e)) - ml
    elif kind == Q3_K:
        for b in range(n // 256):
            o = 110 * b
            d = rd_f16(w, o + 108)
            for s in range(16):
                dl = d * np.float32(_q3k_scale(w, o + 96, s))
                for l in range(16):
                    e = 16 * s + l
                    y[256 * b + e] = dl * np.float32(_q23k_q(Q3_K, w, o, e))
    elif kind == Q4_K or kind == Q5_K:
        bs = 144 if kind == Q4_K else 176
        qo = 16 if kind == Q4_K else 48
        for b in range(n // 256):
            o = bs * b
            d = rd_f16(w, o)
            dmin = rd_f16(w, o + 2)
            for s in range(8):
                sc, mn = _k_scale_min(w, o + 4, s)
                ds = d * np.float32(sc)
                dm = dmin * np.float32(mn)
                c = s >> 1
                sh = 4 * (s & 1)
                for l in range(32):
                    q = (np.int32(w[o + qo + 32 * c + l]) >> sh) & 15
                    if kind == Q5_K:
                        q |= ((np.int32(w[o + 16 + l]) >> s) & 1) << 4
                    y[256 * b + 32 * s + l] = ds * np.float32(q) - dm
    elif kind == Q6_K:
        for b in range(n // 256):
            o = 210 * b
            d = rd_f16(w, o + 208)
            for h in range(2):
                for k in range(4):
                    for l in range(32):
                        e = 128 * h + 32 * k + l
                        lo = (np.int32(w[o + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
                        hi = (np.int32(w[o + 128 + 32 * h + l]) >> (2 * k)) & 3
                        sc = np.float32(np.int8(w[o + 192 + e // 16]))
                        y[256 * b + e] = (d * sc) * np.float32((lo | (hi << 4)) - 32)


def _deq_row_of(kind, w, y):
    """_deq_row for a literal kind (get_rows): typed by the overload below."""
    raise NotImplementedError


_DEQ_ROW_KV = {}    # KV-format code -> njit (w, y) decoding one row with that code a compile-time constant


def _deq_row_kv(code: int):
    """A row decoder for one KV-format code: deq_rows with `code` a constant, so that Numba's branch pruning
    (after deq_rows is inlined) keeps that format's decoder only.  One dispatcher per code: the overload
    below is typed again inside the parfor, and a new function each time compiled twice."""
    f = _DEQ_ROW_KV.get(code)
    if f is None:
        def row(w, y):
            deq_rows(code, w, 0, 0, 1, y.reshape(1, y.shape[0]))
        # a name of its own per code: Numba's symbol for a function is its qualified name, argument types
        # and a per-process counter, so two codes' decoders compiled in two processes can share a symbol,
        # and the JIT links a cached caller to whichever of them it loaded first (issue 38)
        row.__name__ = row.__qualname__ = f"_deq_row_kv_{code}"
        f = _DEQ_ROW_KV[code] = njit(nogil=True)(row)
    return f


@overload(_deq_row_of, prefer_literal=True)
def _deq_row_of_typer(kind, w, y):
    """KV-format kinds (Q8_0 ...) through _deq_row_kv: with the code read from _KV_CODE at run time,
    get_rows for SmolLM2's Q8_0 embedding compiled every KV decoder (9.3 s, its first compile, Zen 3;
    3.6 s now). The K-quants: _deq_row_k."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    code = int(_KV_CODE[kind.literal_value])
    if code < 0:
        return lambda kind, w, y: _deq_row_k(kind, w, y)
    row = _deq_row_kv(code)
    return lambda kind, w, y: row(w, y)


@njit(cache=True, nogil=True, parallel=True)
def _get_rows_kernel(kind, raw, ids, out):
    """out[i] = W[ids[i]] dequantized; kind (a ggml type) is a compile-time literal (_call_kind)."""
    literally(kind)
    if ids.shape[0] >= PAR_T:
        for i in prange(ids.shape[0]):
            _deq_row_of(kind, raw[ids[i]], out[i])
    else:           # a decode step's row: not worth waking the threads
        for i in range(ids.shape[0]):
            _deq_row_of(kind, raw[ids[i]], out[i])


# ----------------------------------------------------------------------------------------------------
# exact mode: each row dequantized (bit-exact) into a per-chunk L1 buffer, float64 dots
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_exact(kind, raw, T, x, scratch, out):
    rows = raw.shape[0]
    nch = min(scratch.shape[0], rows)
    cols = x.shape[1]
    for c in prange(nch):
        buf = scratch[c]
        r0 = c * rows // nch
        r1 = (c + 1) * rows // nch
        for r in range(r0, r1):
            _deq_row(kind, raw[r], buf)
            for t in range(T):
                acc = 0.0
                for j in range(cols):
                    acc += np.float64(buf[j]) * np.float64(x[t, j])
                out[t, r] = acc


# ----------------------------------------------------------------------------------------------------
# float weights (F32/F16/BF16), float activations: used in both modes
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_f32(W, T, x, out):
    rows, cols = W.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += W[r, j] * x[t, j]
            out[t, r] = acc


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_f16(W, T, x, out):
    rows, cols = W.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += h2f(W[r, j]) * x[t, j]
            out[t, r] = acc


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_bf16(W, T, x, out):
    rows, cols = W.shape
    for r in prange(rows):
        for t in range(T):
            acc = np.float32(0.0)
            for j in range(cols):
                acc += np.uint32(np.uint32(W[r, j]) << np.uint32(16)).view(np.float32) * x[t, j]
            out[t, r] = acc


# ----------------------------------------------------------------------------------------------------
# activation quantization: q8 blocks of 32 (llama.cpp q8_0 / q8_1)
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=_FM)
def _act_set(x, T, X, XQ, XD, XS, XF):
    cols = x.shape[1]
    for t in range(T):
        for j in range(cols):
            X[t, j] = x[t, j]
    quantize_act_q8(X, T, XQ, XD, XS, XF)


@njit(cache=True, nogil=True, fastmath=_FM)
def quantize_act_q8(x, T, XQ, XD, XS, XF):
    """q8 blocks of x[:T] (the one activation quantizer; llama.cpp's q8_0 / q8_1 scheme): XQ int8 codes,
    XD scales amax / 127, XS int code sums, XF float sums."""
    for t in range(T):
        _q8_row(x, t, XQ, XD, XS, XF)


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _q8_row(x, t, XQ, XD, XS, XF):
    """quantize_act_q8 of token t."""
    for b in range(XD.shape[1]):
        sf = np.float32(0.0)
        for j in range(32):
            sf += x[t, 32 * b + j]
        XF[t, b] = sf
        amax = np.float32(0.0)
        for j in range(32):
            a = abs(x[t, 32 * b + j])
            if a > amax:
                amax = a
        d = amax / np.float32(127.0)
        idd = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        s = 0
        for j in range(32):
            v = x[t, 32 * b + j] * idd
            # roundf: half away from zero
            q = np.int32(np.floor(abs(v) + np.float32(0.5)))
            if v < 0:
                q = -q
            XQ[t, 32 * b + j] = q
            s += q
        XD[t, b] = d
        XS[t, b] = s


@njit(cache=True, nogil=True)
def quantize_act_q8k(x, T, XQ, XD, XB):
    """llama.cpp's q8_K blocks of x[:T] (quantize_row_q8_K_ref): per 256 values d = -max / 127 where max is
    the value of largest magnitude, q = rint(x / d) capped at 127; XB int sums of each 16 codes."""
    for t in range(T):
        _q8k_row(x, t, XQ, XD, XB)


@njit(cache=True, nogil=True, inline="always")
def _q8k_row(x, t, XQ, XD, XB):
    """quantize_act_q8k of token t."""
    for b in range(XD.shape[1]):
        amax = np.float32(0.0)
        for j in range(256):
            a = abs(x[t, 256 * b + j])
            if a > amax:
                amax = a
        if amax == 0:
            XD[t, b] = 0.0
            for j in range(256):
                XQ[t, 256 * b + j] = 0
            for h in range(16):
                XB[t, 16 * b + h] = 0
            continue
        mx = np.float32(0.0)
        for j in range(256):              # the first value of that magnitude (ggml keeps the first)
            v = x[t, 256 * b + j]
            if abs(v) == amax:
                mx = v
                break
        iscale = np.float32(-127.0) / mx
        for h in range(16):
            s = 0
            for j in range(16 * h, 16 * h + 16):
                q = min(127, np.int32(np.rint(iscale * x[t, 256 * b + j])))
                XQ[t, 256 * b + j] = q
                s += q
            XB[t, 16 * b + h] = s
        XD[t, b] = np.float32(1.0) / iscale


_PAR_QUANT_T = 8    # a kernel quantizes its activations in a parallel region from this many tokens


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM, inline="always")
def _quantize_tokens(k, x, T, XQ, XD, XS, XF):
    """Inside a parallel tile kernel: its activations' q8_0 (k False: XQ, XD, XS, XF) or q8_K (k True:
    XQ, XD, XS as XB) blocks, one token a work item from _PAR_QUANT_T tokens (prefill), else serially."""
    if T < _PAR_QUANT_T:
        for t in range(T):
            if k:
                _q8k_row(x, t, XQ, XD, XS)
            else:
                _q8_row(x, t, XQ, XD, XS, XF)
    else:
        for t in prange(T):
            if k:
                _q8k_row(x, t, XQ, XD, XS)
            else:
                _q8_row(x, t, XQ, XD, XS, XF)


@njit(cache=True, nogil=True, fastmath=_FM)
def _act_set_f(x, T, X, XF):
    """X[:T] = x and the float block sums XF (what the tile kernels read)."""
    cols = x.shape[1]
    nb = XF.shape[1]
    for t in range(T):
        for j in range(cols):
            X[t, j] = x[t, j]
        for b in range(nb):
            sf = np.float32(0.0)
            for j in range(32):
                sf += x[t, 32 * b + j]
            XF[t, b] = sf


# ----------------------------------------------------------------------------------------------------
# q8-activation integer-dot kernels
# ----------------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _dot_q8_generic(kind, w, xq, xd, xs):
    """dot of one raw weight row with one q8-quantized activation row (blocks of 32)."""
    nb = xd.shape[0]
    acc = np.float32(0.0)
    if kind == Q8_0:
        for b in range(nb):
            o = 34 * b
            isum = np.int32(0)
            for j in range(32):
                isum += np.int32(np.int8(w[o + 2 + j])) * np.int32(xq[32 * b + j])
            acc += rd_f16(w, o) * xd[b] * np.float32(isum)
    elif kind == Q4_0:
        for b in range(nb):
            o = 18 * b
            isum = np.int32(0)
            for j in range(16):
                v = np.int32(w[o + 2 + j])
                isum += (v & 15) * np.int32(xq[32 * b + j]) + (v >> 4) * np.int32(xq[32 * b + j + 16])
            acc += rd_f16(w, o) * xd[b] * np.float32(isum - 8 * xs[b])
    elif kind == IQ4_NL:
        for b in range(nb):
            o = 18 * b
            isum = np.int32(0)
            for j in range(16):
                v = np.int32(w[o + 2 + j])
                isum += (np.int32(KVALUES_IQ4NL[v & 15]) * np.int32(xq[32 * b + j])
                         + np.int32(KVALUES_IQ4NL[v >> 4]) * np.int32(xq[32 * b + j + 16]))
            acc += rd_f16(w, o) * xd[b] * np.float32(isum)
    elif kind == Q4_1:
        for b in range(nb):
            o = 20 * b
            isum = np.int32(0)
            for j in range(16):
                v = np.int32(w[o + 4 + j])
                isum += (v & 15) * np.int32(xq[32 * b + j]) + (v >> 4) * np.int32(xq[32 * b + j + 16])
            acc += xd[b] * (rd_f16(w, o) * np.float32(isum) + rd_f16(w, o + 2) * np.float32(xs[b]))
    elif kind == Q5_0 or kind == Q5_1:
        bs = 22 if kind == Q5_0 else 24
        ho = 2 if kind == Q5_0 else 4
        for b in range(nb):
            o = bs * b
            qh = (np.int64(w[o + ho]) | (np.int64(w[o + ho + 1]) << 8) | (np.int64(w[o + ho + 2]) << 16)
                  | (np.int64(w[o + ho + 3]) << 24))
            isum = np.int32(0)
            for j in range(16):
                v = np.int32(w[o + ho + 4 + j])
                lo = (v & 15) | np.int32(((qh >> j) & 1) << 4)
                hi = (v >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
                isum += lo * np.int32(xq[32 * b + j]) + hi * np.int32(xq[32 * b + j + 16])
            d = rd_f16(w, o)
            if kind == Q5_0:
                acc += d * xd[b] * np.float32(isum - 16 * xs[b])
            else:
                acc += xd[b] * (d * np.float32(isum) + rd_f16(w, o + 2) * np.float32(xs[b]))
    elif kind == Q2_K or kind == Q3_K:
        bs = 84 if kind == Q2_K else 110
        for sb in range(nb // 8):
            o = bs * sb
            sacc = np.float32(0.0)
            macc = np.float32(0.0)
            for a in range(8):             # activation block a = sub-blocks 2a, 2a+1 (16 each)
                b = 8 * sb + a
                x0 = 32 * b
                i0 = np.int32(0)
                i1 = np.int32(0)
                s0 = np.int32(0)
                s1 = np.int32(0)
                for l in range(16):
                    i0 += _q23k_q(kind, w, o, 32 * a + l) * np.int32(xq[x0 + l])
                    s0 += np.int32(xq[x0 + l])
                for l in range(16, 32):
                    i1 += _q23k_q(kind, w, o, 32 * a + l) * np.int32(xq[x0 + l])
                    s1 += np.int32(xq[x0 + l])
                if kind == Q2_K:
                    c0 = np.int32(w[o + 2 * a])
                    c1 = np.int32(w[o + 2 * a + 1])
                    sacc += xd[b] * np.float32((c0 & 15) * i0 + (c1 & 15) * i1)
                    macc += xd[b] * np.float32((c0 >> 4) * s0 + (c1 >> 4) * s1)
                else:
                    sacc += xd[b] * np.float32(_q3k_scale(w, o + 96, 2 * a) * i0
                                               + _q3k_scale(w, o + 96, 2 * a + 1) * i1)
            if kind == Q2_K:
                acc += rd_f16(w, o + 80) * sacc - rd_f16(w, o + 82) * macc
            else:
                acc += rd_f16(w, o + 108) * sacc
    elif kind == Q4_K or kind == Q5_K:
        bs = 144 if kind == Q4_K else 176
        qo = 16 if kind == Q4_K else 48
        for sb in range(nb // 8):
            o = bs * sb
            d = rd_f16(w, o)
            dmin = rd_f16(w, o + 2)
            sacc = np.float32(0.0)
            macc = np.float32(0.0)
            for s in range(8):
                sc, mn = _k_scale_min(w, o + 4, s)
                c = s >> 1
                sh = 4 * (s & 1)
                x0 = 256 * sb + 32 * s
                isum = np.int32(0)
                for l in range(32):
                    q = (np.int32(w[o + qo + 32 * c + l]) >> sh) & 15
                    if kind == Q5_K:
                        q |= ((np.int32(w[o + 16 + l]) >> s) & 1) << 4
                    isum += q * np.int32(xq[x0 + l])
                b = 8 * sb + s
                sacc += xd[b] * np.float32(sc * isum)
                macc += xd[b] * np.float32(mn * xs[b])
            acc += d * sacc - dmin * macc
    elif kind == Q6_K:
        for sb in range(nb // 8):
            o = 210 * sb
            d = rd_f16(w, o + 208)
            sacc = np.float32(0.0)
            for h in range(2):
                for k in range(4):
                    x0 = 256 * sb + 128 * h + 32 * k
                    i0 = np.int32(0)
                    i1 = np.int32(0)
                    for l in range(16):
                        lo = (np.int32(w[o + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
                        hi = (np.int32(w[o + 128 + 32 * h + l]) >> (2 * k)) & 3
                        i0 += ((lo | (hi << 4)) - 32) * np.int32(xq[x0 + l])
                    for l in range(16, 32):
                        lo = (np.int32(w[o + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
                        hi = (np.int32(w[o + 128 + 32 * h + l]) >> (2 * k)) & 3
                        i1 += ((lo | (hi << 4)) - 32) * np.int32(xq[x0 + l])
                    e = (128 * h + 32 * k) // 16
                    s0 = np.int32(np.int8(w[o + 192 + e]))
                    s1 = np.int32(np.int8(w[o + 192 + e + 1]))
                    sacc += xd[8 * sb + 4 * h + k] * np.float32(s0 * i0 + s1 * i1)
            acc += d * sacc
    return acc


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_q8_generic(kind, raw, T, XQ, XD, XS, out):
    rows = raw.shape[0]
    for r in prange(rows):
        w = raw[r]
        for t in range(T):
            out[t, r] = _dot_q8_generic(kind, w, XQ[t], XD[t], XS[t])



# ----------------------------------------------------------------------------------------------------
# row-interleaved float kernels (Q4_0, Q4_1, Q8_0): the decode fast path
#
# Repacked at load into tiles of R rows: q[tile, block, j, i] is byte j of block `block` of row
# tile*R + i, so for each (block, j) the R rows' bytes are contiguous. The innermost loop runs over the R rows of a tile (vector lanes: no
# horizontal reductions), with the 16/32 bytes of a block unrolled inside it; x stays float32 (no
# activation quantization: these were faster than the q8 integer-dot kernels here, and exact).
# Scales stay f16 (uint16 [tile, block, {d, m}, i]) so the bytes read equal ggml's. Q4_0 is stored
# as Q4_1 with m = -8 d (exact). A last partial tile is zero-padded; its rows go through Act._tail.
# ----------------------------------------------------------------------------------------------------

_TILE_MAX = 128
_R_Q4 = 64
_R_Q8 = 128


@njit(cache=True, nogil=True, inline="always")
def _tile_q4_1tok(qt, dm, tile, nb, R, x, xf, o):
    for i in range(R):
        o[i] = 0.0
    for b in range(nb):
        xb = x[32 * b:32 * b + 32]
        xsb = xf[b]
        for i in range(R):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for j in range(0, 16, 2):
                v = np.int32(qt[tile, b, j, i])
                u = np.int32(qt[tile, b, j + 1, i])
                s0 += np.float32(v & 15) * xb[j]
                s1 += np.float32(v >> 4) * xb[j + 16]
                s2 += np.float32(u & 15) * xb[j + 1]
                s3 += np.float32(u >> 4) * xb[j + 17]
            o[i] += h2f(dm[tile, b, 0, i]) * ((s0 + s1) + (s2 + s3)) + h2f(dm[tile, b, 1, i]) * xsb


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_tile_q4(qt, dm, rows, T, X, XF, tail, out):
    nt, nb, _, R = qt.shape
    for tile in prange(nt):
        r0 = tile * R
        full = r0 + R <= rows
        for t in range(T):
            if full:
                _tile_q4_1tok(qt, dm, tile, nb, R, X[t], XF[t], out[t, r0:r0 + R])
            else:
                _tile_q4_1tok(qt, dm, tile, nb, R, X[t], XF[t], tail[t, :R])
        if not full:
            for t in range(T):
                for i in range(rows - r0):
                    out[t, r0 + i] = tail[t, i]


@njit(cache=True, nogil=True, inline="always")
def _tile_q8_1tok(qt, dt, tile, nb, R, x, o):
    for i in range(R):
        o[i] = 0.0
    for b in range(nb):
        xb = x[32 * b:32 * b + 32]
        for i in range(R):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for j in range(0, 32, 2):
                s0 += np.float32(qt[tile, b, j, i]) * xb[j]
                s1 += np.float32(qt[tile, b, j + 1, i]) * xb[j + 1]
            o[i] += h2f(dt[tile, b, i]) * (s0 + s1)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_tile_q8(qt, dt, rows, T, X, tail, out):
    nt, nb, _, R = qt.shape
    for tile in prange(nt):
        r0 = tile * R
        full = r0 + R <= rows
        for t in range(T):
            if full:
                _tile_q8_1tok(qt, dt, tile, nb, R, X[t], out[t, r0:r0 + R])
            else:
                _tile_q8_1tok(qt, dt, tile, nb, R, X[t], tail[t, :R])
        if not full:
            for t in range(T):
                for i in range(rows - r0):
                    out[t, r0 + i] = tail[t, i]


# ---- several weights in one parallel region (decode: Q/K/V, gate/up): one prange launch instead of
# two or three.  Every weight must be a full-tile Q4 tile weight (rows % R == 0) with the same cols.

@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_tile_q4_3(qa, da, oa, qb, db, ob, qc, dc, oc, T, X, XF):
    na = qa.shape[0]
    nb_ = qb.shape[0]
    ntot = na + nb_ + qc.shape[0]
    nblk = qa.shape[1]
    R = qa.shape[3]
    for it in prange(ntot):
        for t in range(T):
            if it < na:
                _tile_q4_1tok(qa, da, it, nblk, R, X[t], XF[t], oa[t, it * R:it * R + R])
            elif it < na + nb_:
                k = it - na
                _tile_q4_1tok(qb, db, k, nblk, R, X[t], XF[t], ob[t, k * R:k * R + R])
            else:
                k = it - na - nb_
                _tile_q4_1tok(qc, dc, k, nblk, R, X[t], XF[t], oc[t, k * R:k * R + R])


# ---- integer-dot tiles (kernels.tiles: dot_tile_q4 / dot_tile_q8, dot_ktile_*; layouts there), one
# source for every ISA class.  Each kernel first quantizes its activation rows (serial: a few
# microseconds) unless the Act already holds them, then one prange over (row tile x _ITILE_TB tokens).
# Q4 tile sc: (nt, nb, 2, TILE_ROWS) f16 d, m; Q8: (nt, nb, 1, TILE_ROWS) f16 d.

_SPECIALIZED = {}


def _arg_key(disp, a):
    """What a compiled specialization depends on in argument a: Numba's type fingerprint (dtype, ndim,
    layout, writability: ~0.1 us), or the Numba type itself where it has none (a structref)."""
    try:
        return compute_fingerprint(a)
    except (NotImplementedError, ValueError, TypeError):
        return disp.typeof_pyval(a)


def _entry(disp, lits, args):
    """disp's compiled specialization for the literals lits (a tuple of ints, the leading arguments) and
    the types of args: compiled, or loaded from Numba's cache, once per process.  Keyed by the argument
    types too: an entry point unboxes its arguments as the types it was compiled for, without checking,
    so one compiled for another model's arrays would read these as those (issue 38)."""
    key = (disp, lits) + tuple(_arg_key(disp, a) for a in args)
    f = _SPECIALIZED.get(key)
    if f is None:
        # compile (or load from the cache) the literal signature at once: a plain call would first type
        # the kernel with int64 kinds, run Numba's untyped passes and inlining (~1 s a kernel, in every
        # process, cache or not) only to hit literally() and retry with the literals
        sig = tuple(types.literal(k) for k in lits) + tuple(disp.typeof_pyval(a) for a in args)
        f = _SPECIALIZED[key] = disp.compile(sig)
    return f


def _call_kind(disp, kind, *args):
    """disp(kind, *args) (kind: an int, or a tuple of ints passed as the leading arguments) where disp
    specializes on them with numba.literally: the compiled specialization is called directly (the
    dispatcher would redo its literal retry, milliseconds, on every call)."""
    lits = kind if isinstance(kind, tuple) else (kind,)
    return _entry(disp, lits, args)(*lits, *args)


_ITILE_TB = 16      # prefill: tokens per work item (a tile's weights stay in L1/L2 across them)


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _itile_tokens(kind, qt, sc, XQ, XD, XS, nb, out, r0, R, t, t1):
    """Tokens t .. t1-1 of one full row tile (its rows r0 .. r0+R of out): _TOK_NT tokens a call (the
    tile's weights unpacked once for a group where kernels.tiles.TOKEN_BLOCK says so), then one by one."""
    while t + _TOK_NT <= t1:
        u = t + _TOK_NT
        _dot_itile_n(kind, qt, sc, XQ[t:u], XD[t:u], XS[t:u], nb, out[t:u, r0:r0 + R])
        t = u
    for t in range(t, t1):
        _dot_itile(kind, qt, sc, XQ[t], XD[t], XS[t], nb, out[t, r0:r0 + R])


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_itile(kind, quant, qt, sc, rows, T, X, XQ, XD, XS, XF, tail, out):
    """Q4 / Q5 / Q8 integer tiles; kind (_KIND_ITILE_*) is a compile-time literal."""
    literally(kind)
    if quant:
        _quantize_tokens(False, X, T, XQ, XD, XS, XF)
    nt, nb, R = qt.shape[0], qt.shape[1], qt.shape[3]
    ntb = (T + _ITILE_TB - 1) // _ITILE_TB
    for it in prange(nt * ntb):
        tile = it // ntb
        t0 = (it % ntb) * _ITILE_TB
        t1 = min(T, t0 + _ITILE_TB)
        r0 = tile * R
        if r0 + R <= rows:
            _itile_tokens(kind, qt[tile], sc[tile], XQ, XD, XS, nb, out, r0, R, t0, t1)
        else:
            for t in range(t0, t1):
                _dot_itile(kind, qt[tile], sc[tile], XQ[t], XD[t], XS[t], nb, tail[t, :R])
                for i in range(rows - r0):
                    out[t, r0 + i] = tail[t, i]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_itile_3(ka, kb, kc, quant, qa, sa, oa, qb, sb, ob, qc, sc, oc, T, X, XQ, XD, XS, XF):
    """Three full-tile integer tile weights (Q4 / Q5 / Q8, any mix: ka, kb, kc) sharing X (Q/K/V, or
    gate/up with qc empty): one parallel region.  ka, kb, kc: compile-time literals."""
    literally(ka)
    literally(kb)
    literally(kc)
    if quant:
        _quantize_tokens(False, X, T, XQ, XD, XS, XF)
    na, nb_ = qa.shape[0], qb.shape[0]
    nblk, R = qa.shape[1], qa.shape[3]
    ntb = (T + _ITILE_TB - 1) // _ITILE_TB
    for w in prange((na + nb_ + qc.shape[0]) * ntb):
        it = w // ntb
        t0 = (w % ntb) * _ITILE_TB
        t1 = min(T, t0 + _ITILE_TB)
        if it < na:
            _itile_tokens(ka, qa[it], sa[it], XQ, XD, XS, nblk, oa, it * R, R, t0, t1)
        elif it < na + nb_:
            k = it - na
            _itile_tokens(kb, qb[k], sb[k], XQ, XD, XS, nblk, ob, k * R, R, t0, t1)
        else:
            k = it - na - nb_
            _itile_tokens(kc, qc[k], sc[k], XQ, XD, XS, nblk, oc, k * R, R, t0, t1)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def _mm_ktile(gt, quant, qt, rows, T, X, XQ, XD, XB, tail, out):
    """K-quant tiles (kernels.tiles.dot_ktile_*) against q8_K activations.  gt is a compile-time literal:
    a model compiles only the types it has.  Full tiles take _TOK_NT tokens a call (as _itile_tokens)."""
    literally(gt)
    if quant:
        _quantize_tokens(True, X, T, XQ, XD, XB, XD)
    nt, nsb, R = qt.shape[0], XD.shape[1], KTILE_ROWS
    ntb = (T + _ITILE_TB - 1) // _ITILE_TB
    for it in prange(nt * ntb):
        tile = it // ntb
        t = (it % ntb) * _ITILE_TB
        t1 = min(T, t + _ITILE_TB)
        r0 = tile * R
        if r0 + R <= rows:
            while t + _TOK_NT <= t1:
                u = t + _TOK_NT
                _dot_ktile_n(gt, qt[tile], XQ[t:u], XD[t:u], XB[t:u], nsb, out[t:u, r0:r0 + R])
                t = u
            for t in range(t, t1):
                _dot_ktile(gt, qt[tile], XQ[t], XD[t], XB[t], nsb, out[t, r0:r0 + R])
        else:
            for t in range(t, t1):
                _dot_ktile(gt, qt[tile], XQ[t], XD[t], XB[t], nsb, tail[t, :R])
                for i in range(rows - r0):
                    out[t, r0 + i] = tail[t, i]


# ---- prefill: dequantize the tiles once per call to float32 W^T (cols, rows), then one BLAS sgemm

@njit(cache=True, nogil=True, fastmath=_FM)
def _deq_tiles_q4_T(qt, dm, t0, t1, WT):
    _, nb, _, R = qt.shape
    for tile in range(t0, t1):
        r0 = (tile - t0) * R
        for b in range(nb):
            for j in range(16):
                lo = WT[32 * b + j]
                hi = WT[32 * b + j + 16]
                for i in range(R):
                    d = h2f(dm[tile, b, 0, i])
                    m = h2f(dm[tile, b, 1, i])
                    v = np.int32(qt[tile, b, j, i])
                    lo[r0 + i] = d * np.float32(v & 15) + m
                    hi[r0 + i] = d * np.float32(v >> 4) + m


@njit(cache=True, nogil=True, fastmath=_FM)
def _deq_tiles_q8_T(qt, dt, t0, t1, WT):
    _, nb, _, R = qt.shape
    for tile in range(t0, t1):
        r0 = (tile - t0) * R
        for b in range(nb):
            for j in range(32):
                row = WT[32 * b + j]
                for i in range(R):
                    row[r0 + i] = h2f(dt[tile, b, i]) * np.float32(qt[tile, b, j, i])


def _repack_tiles_rows(gt, raw, rows, cols, R, itile):
    """_repack_tiles, _REPACK_ROWS rows at a time into one (qt, sc) (a tile depends on its own R rows
    only): bounded numpy temporaries at any weight size."""
    step = max(R, _REPACK_ROWS // R * R)
    if rows <= step:
        return _repack_tiles(gt, raw, rows, cols, R, itile)
    nt = -(-rows // R)
    qt = sc = None
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        q, c = _repack_tiles(gt, raw[r0:r0 + n], n, cols, R, itile)
        if qt is None:
            qt = np.empty((nt,) + q.shape[1:], q.dtype)
            sc = np.empty((nt,) + c.shape[1:], c.dtype)
        qt[r0 // R:r0 // R + q.shape[0]] = q
        sc[r0 // R:r0 // R + c.shape[0]] = c
    return qt, sc


def _repack_tiles(gt, raw, rows, cols, R, itile):
    """ggml Q4_0 / Q4_1 / Q8_0 rows -> row-interleaved tiles (qt, sc) of R rows (the last zero-padded).
    Float-activation layout: qt[tile, b, j, row] (byte j of each row's block b); integer-tile layout:
    qt[tile, b, group, row, 4] (4 bytes of one row per 32-bit lane, kernels.tiles.dot_tile_q4/q8).
    sc: f16 bits, Q8_0 d (tile, b, row) (integer tiles: (tile, b, 1, row)), Q4 d and m (tile, b, 2, row)."""
    nb = cols // 32
    nt = -(-rows // R)
    pad = nt * R - rows
    bpb = _BLOCK[gt][1]
    blk = raw.reshape(rows, nb, bpb)
    if pad:
        blk = np.concatenate([blk, np.zeros((pad, nb, bpb), np.uint8)])
    d = f16_bits(blk[:, :, 0:2]).reshape(nt, R, nb).transpose(0, 2, 1)
    if gt == Q8_0:
        q = blk[:, :, 2:34] if itile else blk[:, :, 2:34].view(np.int8)
        sc = d[:, :, None, :] if itile else d
    else:
        qo = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, IQ4_NL: 2}[gt]
        q = blk[:, :, qo:qo + 16]
        if gt in (Q4_1, Q5_1):
            m = f16_bits(blk[:, :, 2:4]).reshape(nt, R, nb).transpose(0, 2, 1)
        else:  # Q4_0 / Q5_0: d * (q - z) = d * q + (-z d), and -z d is exact in f16 unless it overflows
            z = np.float16(-8.0 if gt == Q4_0 else -16.0)
            m = (np.ascontiguousarray(d).view(np.float16) * z).view(np.uint16)
        # integer Q4_0 / Q5_0 tiles keep d only (the dot subtracts z * sum(x), kernels.tiles' Q40 / Q50)
        sc = d[:, :, None, :] if itile and gt in (Q4_0, Q5_0, IQ4_NL) else np.stack([d, m], axis=2)
        if gt in (Q5_0, Q5_1):      # qh -> a fifth 4-byte group (kernels.tiles.dot_tile_q5's layout)
            qh = np.ascontiguousarray(blk[:, :, qo - 4:qo]).view(np.uint32)[..., 0]
            bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            lo = bits[..., :16].reshape(*qh.shape, 4, 4)         # [jj][c]
            hi = bits[..., 16:].reshape(*qh.shape, 4, 4)
            sh = np.arange(4, dtype=np.uint8)[:, None]
            q = np.concatenate([q, ((lo << sh) | (hi << (sh + 4))).sum(axis=-2, dtype=np.uint8)], axis=2)
    w = q.shape[2]
    if itile:
        qt = np.ascontiguousarray(lanes(q).reshape(nt, R, nb, w // 4).transpose(0, 2, 3, 1))
        qt = qt.view(np.uint8).reshape(nt, nb, w // 4, R, 4)
    else:
        qt = np.ascontiguousarray(q.reshape(nt, R, nb, w).transpose(0, 2, 3, 1))
    return qt, np.ascontiguousarray(sc)

# ----------------------------------------------------------------------------------------------------
# Python-level API
# ----------------------------------------------------------------------------------------------------

_KIND_RAW = 0        # generic raw-bytes kernels
_KIND_TILE_Q4 = 1    # row-interleaved Q4_0 / Q4_1
_KIND_TILE_Q8 = 2    # row-interleaved Q8_0
_KIND_ITILE_Q4 = 3   # integer-dot tiles (kernels.tiles), Q4_0 / Q4_1 (q8_0 activations)
_KIND_ITILE_Q8 = 4   # integer-dot tiles, Q8_0
_KIND_ITILE_Q5 = 6   # integer-dot tiles, Q5_1
_KIND_ITILE_Q40 = 7  # integer-dot tiles, Q4_0 (d only: llama.cpp's sum(q x) - 8 sum(x))
_KIND_ITILE_Q50 = 8  # integer-dot tiles, Q5_0 (d only)
_KIND_ITILE_IQ4 = 9  # integer-dot tiles, IQ4_NL (d only, nibbles through llama.cpp's int8 levels)
_KIND_KTILE = 5      # integer-dot K-quant tiles, Q2_K ... Q6_K (q8_K activations)
_ITILE_KINDS = (_KIND_ITILE_Q4, _KIND_ITILE_Q5, _KIND_ITILE_Q8, _KIND_ITILE_Q40, _KIND_ITILE_Q50, _KIND_ITILE_IQ4)   # q8_0 activations
_INT_KINDS = _ITILE_KINDS + (_KIND_KTILE,)
_TOK_NT = 4         # prefill: tokens per tile call (kernels.tiles.TOKEN_BLOCK: which formats group them)
# the integer tile dot of a literal _KIND_ITILE_* kind (only the kinds a kernel is called with compile)
_ITILE_FMT = {_KIND_ITILE_Q4: "q4", _KIND_ITILE_Q5: "q5", _KIND_ITILE_Q8: "q8", _KIND_ITILE_Q40: "q40",
              _KIND_ITILE_Q50: "q50", _KIND_ITILE_IQ4: "iq4"}
_dot_itile = dot_tile_by(_ITILE_FMT)
_dot_itile_n = dot_tile_by(_ITILE_FMT, _TOK_NT)
_KTILE_FMT = {Q2_K: "q2k", Q3_K: "q3k", Q4_K: "q4k", Q5_K: "q5k", Q6_K: "q6k"}
_dot_ktile = dot_ktile_by(_KTILE_FMT)
_dot_ktile_n = dot_ktile_by(_KTILE_FMT, _TOK_NT)
# byte offsets of each K-quant's f16 super-block scales (d, and dmin where there is one)
_K_F16 = {Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


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


_REPACK_ROWS = 4096      # rows a repack step: its numpy temporaries stay tens of MB at any weight size


def _repack_ktile_rows(fmt, blk, R):
    """repack_ktile of blk (rows, nsb, bytes) into one array, the last rows zero-padded to a whole tile:
    Q4_K / Q5_K / Q6_K by kernels.tiles.repack_ktile_nb, the others by numpy _REPACK_ROWS rows a step (a
    tile depends on its own R rows only) on numba.get_num_threads() Python threads.  The whole-tensor
    numpy repack's temporaries were several times the weight (peak RSS 1.9 GB for an 0.8 GB file)."""
    rows, nsb = blk.shape[0], blk.shape[1]
    out = repack_ktile_nb(fmt, blk, -(-rows // R))      # q4k / q5k / q6k: one parallel Numba pass
    if out is not None:
        return out
    step = max(R, _REPACK_ROWS // R * R)
    out = np.empty((-(-rows // R), nsb * KBYTES[fmt] * R), np.uint8)

    def one(r0):
        part = blk[r0:r0 + step]
        pad = -part.shape[0] % R
        if pad:
            part = np.concatenate([part, np.zeros((pad,) + part.shape[1:], np.uint8)])
        repack_ktile(fmt, part, out[r0 // R:r0 // R + part.shape[0] // R])
    _run_steps(one, range(0, rows, step))
    return out


def _run_steps(fn, starts) -> None:
    """fn(s) for every s, on up to numba.get_num_threads() threads (load-time repacks)."""
    starts = list(starts)
    n = min(numba.get_num_threads(), len(starts))
    if n <= 1:
        for s in starts:
            fn(s)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(n) as ex:
        for f in [ex.submit(fn, s) for s in starts]:
            f.result()


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
    weight per layer (the Python around each kernel call, 1.4 us, was 5 % of a 4.5 ms token; Zen 3).
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
