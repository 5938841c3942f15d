"""Kernels over a weight's raw GGUF blocks: the block table, row dequantization (get_rows), the exact
(float64) mode, float weights, q8 activation quantization and the generic per-row q8 dot."""
from __future__ import annotations
import numpy as np
from numba import literally, njit, prange, types
from numba.extending import overload
from gguf import GGMLQuantizationType as _GT
from pykv.files.formats import KV_FORMATS
from pykv.kernels.blocks import KVALUES_IQ4NL, deq_rows, rd_f16
from pykv.kernels.ops import PAR_T
from pykv.kernels.simd import bits_f32, f32_bits, h2f

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
_KV_CODE = np.full(max(_BLOCK) + 1, -1, np.int64)       # ggml type -> pykv.files.formats code (same bytes)
for _f in KV_FORMATS.values():
    if _f.ggml_type is not None and int(_f.ggml_type) in _BLOCK:
        _KV_CODE[int(_f.ggml_type)] = _f.code
del _f


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
    """KV-format kinds (Q8_0 ...) through _deq_row_kv, the code a compile-time constant (read from
    _KV_CODE at run time, get_rows compiled every KV decoder). The K-quants: _deq_row_k."""
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
    """quantize_act_q8 of token t.  The block's max |x| is taken on the float bits as integers (a
    vectorized integer max; exact for every non-NaN value, NaN counts as 0 as a float compare would),
    in the loop of the block sum."""
    for b in range(XD.shape[1]):
        sf = np.float32(0.0)
        am = np.uint32(0)
        for j in range(32):
            v = x[t, 32 * b + j]
            sf += v
            a = np.uint32(f32_bits(v) & np.uint32(0x7FFFFFFF))
            a = np.uint32(a if a <= np.uint32(0x7F800000) else np.uint32(0))
            am = np.uint32(max(am, a))
        XF[t, b] = sf
        d = bits_f32(np.uint32(am)) / np.float32(127.0)
        idd = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        s = np.int32(0)
        for j in range(32):
            v = x[t, 32 * b + j] * idd
            # roundf: half away from zero
            q = np.int32(np.floor(abs(v) + np.float32(0.5)))
            q = -q if v < 0 else q
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


_PAR_QUANT_T = 32   # a kernel quantizes its activations in a parallel region from this many tokens


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
