"""Numba kernels that quantize and dequantize ONE token head vector (a "row") of a KV cache.

Every kernel dispatches on the integer format code of ``pykv.files.formats`` (``CODE_*``) and works on one
row in a ``uint8`` buffer:

    quantize_row(code, x f32[HD], dst u8[row_bytes])            once per token on append
    dequantize_row(code, src u8[row_bytes], out f32[HD])        KIVI page flushes (kernels.blocks.deq_rows)
    quantize_rows(code, X f32[N, HD], dst u8[N, row_bytes], ntry=-1)   prange over rows (convert tool)
    quantize_block(code, x, b, dst)     piece b < row_units(code, HD) of a row: quantize_row's loop body
                                        and one CUDA thread's work (kernels.cuda.kvquant calls these
                                        @njit functions on the GPU: CUDA-compatible code only, see
                                        kernels/cuda/shared.py)

The paged cache (pykv.kv.cache) appends through three kernels built on them:

    append_rows(x f32[T, KVH, HD], pool, page_table, start, P, code)   tokens into their page slots
    write_residual(x, res, start, P, rcode)                             f16 rows (sinks, KIVI window)
    flush_residual(res, r0, pool, page, P, rcode, code, kbits, tmp)     a full residual page -> pool

KIVI keys live in pages (per channel across the P tokens of a page):

    kivi_quantize_kpage(bits, xk f32[P, HD], dst u8[page_bytes])   (decoded by kernels.blocks.deq_kivi_k_rows)
    kivi_kpage_group(bits, xk, b, dst)   its channels 32b .. 32b+31 (one CUDA thread's work)

Byte layouts (little endian):
  f32 / f16 / bf16: the values.  f16 rounding = numpy astype(float16) (RNE, numpy's NaN mapping);
    bf16 = ggml_compute_fp32_to_bf16 (RNE, NaN forced quiet), as gguf.quants.
  q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl: ggml blocks, byte-identical with gguf.quants.quantize
    (float32 arithmetic in the same order, round-half-away for q8_0, trunc(x + .5) for the others).
    iq4_nl quantize = ggml's quantize_row_iq4_nl_ref (ntry = -1: one least-squares scale, what ggml's
    CPU from_float uses for a KV cache); ``quantize_row_iq4_nl(x, dst, 7)`` = quantize_iq4_nl without
    imatrix (llama-quantize).  gguf.quants has no iq4_nl quantizer, so that path is checked against a
    float32 port of the C code in the tests.  An all-zero block is stored as d = 0, nibbles 0x88.
  fp8_e4m3 / fp8_e5m2: [f32 scale s = amax / fp8_max][HD bytes]; byte = RNE(x / s) in the OCP format,
    saturating to +-max (e4m3 max 448, no inf; e5m2 max 57344); value = decode(byte) * s.
  int4 / int2 (KIVI) value rows: groups of 32 along HD, each [f16 d][f16 m][32*bits/8 bytes codes];
    int4: byte j holds elements j (low nibble) and j+16 (high nibble), like ggml q4_1;
    int2: byte j (0..7) holds elements j, j+8, j+16, j+24 at bit shifts 0, 2, 4, 6.
    m = min rounded DOWN to f16, d = (max - m) / (2^bits - 1) rounded UP to f16, so that
    [m, m + d * qmax] covers the group; code = round_half_away((x - m) / d) clamped to [0, qmax];
    value = code * d + m  ->  |x - value| <= d / 2 (plus float rounding).
  nl4 / nl3 / nl2, klt3 / klt2, nl3b / nl2b: blocks of 64, [f16 d, or (nl3b / nl2b) one byte e with
    d = blocks.NL_E8[e] = 2^((e - 160) / 8), the nearer of the two steps around the fitted d by the
    block's squared error][codes as one little-endian bit stream, element j
    taking blocks.NL_BITS[code, j] bits (nl: the same for all, klt: runs of widths, formats.nl_runs)];
    value = d * NL_TABLE[bits, code] (blocks.NL_TABLE: Lloyd-Max levels of a unit Gaussian).  d starts
    at the block's RMS and takes 4 Lloyd steps (nearest level, then d = sum(x q) / sum(q q)); the codes
    are the nearest levels for the stored (f16) d.
  int4 / int2 (KIVI) key pages (one KV head, P tokens):
    [f16 d[HD]][f16 m[HD]]  (4*HD bytes, per channel over the page's P tokens)
    then the codes TOKEN-MAJOR: token t's HD codes at 4*HD + t*HD*bits/8, packed in groups of 32
    channels exactly like a value row's codes (without the per-group d/m).  Token-major keeps one
    token's key contiguous, so a dot is one contiguous pass over HD*bits/8 bytes.

Float arithmetic here is compiled without fast-math (bit-exactness).  Attention (kernels.attention)
does not call these row kernels: it decodes tiles of K / V rows with kernels.blocks.deq_rows, the
decoders dequantize_row uses.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from pykv.files.formats import (CODE_BF16, CODE_F16, CODE_F32, CODE_FP8_E4M3, CODE_FP8_E5M2, CODE_INT2,
                       CODE_INT4, CODE_IQ4_NL, CODE_Q4_0, CODE_Q4_1, CODE_Q5_0, CODE_Q5_1, CODE_Q8_0)
from pykv.kernels.blocks import (IQ4NL_F, NL_BYTES, NL_SCALE, TC_ROW, deq_rows, nl_e8, nl_level, nl_offset,
                                 nl_width, rd_f16, tc_len)
from pykv.kernels.ops import PAR_T, _qkv_prep_seq, qkv_prep_seqs
from pykv.kernels.simd import bits_f32, f16_store32, f32_bits, floorf, fmul_rn, h2f
from pykv.kernels.trellis import TC_PERM, tc_viterbi

PAR_SEQ_VALUES = 1 << 15   # append_seqs: K values per step from which its rows run in parallel
PAR_PREP_SEQS = 4          # prep_append_seqs: sequences from which they run on the threads (cold rows and code)

# ----------------------------------------------------------------------------------------------
# bit casts and scalar helpers
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _u32(v):
    return np.uint32(v & 0xFFFFFFFF)


@njit(cache=True)
def f32_to_f16_bits(x):
    """float32 -> IEEE half bits (int64), round to nearest even; NaN mapped as numpy does."""
    u = np.int64(f32_bits(np.float32(x)))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    e = a >> 23
    mant = a & 0x7FFFFF
    if e == 255:
        if mant == 0:
            return sign | 0x7C00
        h = 0x7C00 + (mant >> 13)
        if h == 0x7C00:
            h += 1
        return sign | h
    if e >= 143:  # >= 65536: overflow
        return sign | 0x7C00
    if e >= 113:  # normal half
        h = ((e - 112) << 10) | (mant >> 13)
        rem = mant & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1  # a carry into the exponent is correct (up to inf)
        return sign | h
    if e < 102:  # below half of the smallest subnormal (2^-25): rounds to zero
        return sign
    m = mant | 0x800000
    shift = 126 - e  # 14..24
    h = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return sign | h


@njit(cache=True)
def f16_next_down(h):
    if h == 0:
        return 0x8001
    if h & 0x8000:
        return h + 1
    return h - 1


@njit(cache=True)
def f16_next_up(h):
    if h == 0x8000:
        return 1
    if h & 0x8000:
        return h - 1
    return h + 1


@njit(cache=True)
def wr_u16(buf, o, h):
    buf[o] = np.uint8(h & 0xFF)
    buf[o + 1] = np.uint8((h >> 8) & 0xFF)


@njit(cache=True)
def wr_f16(buf, o, x):
    wr_u16(buf, o, f32_to_f16_bits(x))


@njit(cache=True)
def wr_f32(buf, o, x):
    u = np.int64(f32_bits(np.float32(x)))
    buf[o] = np.uint8(u & 0xFF)
    buf[o + 1] = np.uint8((u >> 8) & 0xFF)
    buf[o + 2] = np.uint8((u >> 16) & 0xFF)
    buf[o + 3] = np.uint8((u >> 24) & 0xFF)


@njit(cache=True)
def roundf_away(v):
    """Round half away from zero in float32 exactly as gguf.quants.np_roundf (== C roundf)."""
    a = abs(v)
    fl = floorf(a)
    b = fl + floorf(np.float32(2.0) * (a - fl))
    if v < np.float32(0.0):
        return -b
    return b


@njit(cache=True)
def pow2f(k):
    """2^k as float32 for k in the normal range [-126, 127]."""
    return bits_f32(_u32((np.int64(k) + 127) << 23))


# ----------------------------------------------------------------------------------------------
# float formats
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def bf16_bits(x):
    n = np.int64(f32_bits(np.float32(x)))
    if (n & 0x7FFFFFFF) > 0x7F800000:
        n = (n & 0xFFFF0000) | (64 << 16)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n & 0xFFFF


# ----------------------------------------------------------------------------------------------
# ggml block quantizers (one block of 32 at x[xo:xo+32] -> dst[do:do+block_bytes])
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def _absmax_signed(x, xo, n):
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(n):
        v = x[xo + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return mx


@njit(cache=True)
def _minmax(x, xo, n):
    mn = x[xo]
    mx = x[xo]
    for j in range(1, n):
        v = x[xo + j]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@njit(cache=True)
def _qblk_q8_0(x, xo, dst, do):
    amax = np.float32(0.0)
    for j in range(32):
        a = abs(x[xo + j])
        if a > amax:
            amax = a
    d = amax / np.float32(127.0)
    idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    wr_f16(dst, do, d)
    for j in range(32):
        q = np.int64(roundf_away(x[xo + j] * idd))
        dst[do + 2 + j] = np.uint8(q & 0xFF)


@njit(cache=True)
def _qblk_q4_0(x, xo, dst, do):
    mx = _absmax_signed(x, xo, 32)
    d = mx / np.float32(-8.0)
    idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    wr_f16(dst, do, d)
    for j in range(16):
        q0 = min(np.int64(fmul_rn(x[xo + j], idd) + np.float32(8.5)), 15)
        q1 = min(np.int64(fmul_rn(x[xo + 16 + j], idd) + np.float32(8.5)), 15)
        dst[do + 2 + j] = np.uint8(q0 | (q1 << 4))


@njit(cache=True)
def _qblk_q4_1(x, xo, dst, do):
    mn, mx = _minmax(x, xo, 32)
    d = (mx - mn) / np.float32(15.0)
    idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    wr_f16(dst, do, d)
    wr_f16(dst, do + 2, mn)
    for j in range(16):
        q0 = min(np.int64(fmul_rn(x[xo + j] - mn, idd) + np.float32(0.5)), 15)
        q1 = min(np.int64(fmul_rn(x[xo + 16 + j] - mn, idd) + np.float32(0.5)), 15)
        dst[do + 4 + j] = np.uint8(q0 | (q1 << 4))


@njit(cache=True)
def _qblk_q5_0(x, xo, dst, do):
    mx = _absmax_signed(x, xo, 32)
    d = mx / np.float32(-16.0)
    idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    wr_f16(dst, do, d)
    qh = np.int64(0)
    for j in range(16):
        q0 = min(np.int64(fmul_rn(x[xo + j], idd) + np.float32(16.5)), 31)
        q1 = min(np.int64(fmul_rn(x[xo + 16 + j], idd) + np.float32(16.5)), 31)
        dst[do + 6 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
        qh |= ((q0 >> 4) & 1) << j
        qh |= ((q1 >> 4) & 1) << (j + 16)
    for k in range(4):
        dst[do + 2 + k] = np.uint8((qh >> (8 * k)) & 0xFF)


@njit(cache=True)
def _qblk_q5_1(x, xo, dst, do):
    mn, mx = _minmax(x, xo, 32)
    d = (mx - mn) / np.float32(31.0)
    idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    wr_f16(dst, do, d)
    wr_f16(dst, do + 2, mn)
    qh = np.int64(0)
    for j in range(16):
        q0 = min(np.int64(fmul_rn(x[xo + j] - mn, idd) + np.float32(0.5)), 31)
        q1 = min(np.int64(fmul_rn(x[xo + 16 + j] - mn, idd) + np.float32(0.5)), 31)
        dst[do + 8 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
        qh |= ((q0 >> 4) & 1) << j
        qh |= ((q1 >> 4) & 1) << (j + 16)
    for k in range(4):
        dst[do + 4 + k] = np.uint8((qh >> (8 * k)) & 0xFF)


@njit(cache=True)
def _best_index_iq4nl(x):
    """ggml best_index_int8 over the iq4_nl table, float32 arithmetic."""
    val = IQ4NL_F
    if x <= val[0]:
        return 0
    if x >= val[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < val[mav]:
            mu = mav
        else:
            ml = mav
    if x - val[mu - 1] < val[mu] - x:
        return mu - 1
    return mu


@njit(cache=True)
def _iq4nl_sums(x, xo, idd):
    val = IQ4NL_F
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for j in range(32):
        xj = x[xo + j]
        q = val[_best_index_iq4nl(idd * xj)]
        w = xj * xj
        sumqx += fmul_rn(w * q, xj)
        sumq2 += fmul_rn(w * q, q)
    return sumqx, sumq2


@njit(cache=True)
def _qblk_iq4_nl(x, xo, dst, do, ntry):
    val = IQ4NL_F
    mx = _absmax_signed(x, xo, 32)
    if abs(mx) < np.float32(1e-15):
        wr_u16(dst, do, np.int64(0))
        for j in range(16):
            dst[do + 2 + j] = np.uint8(0x88)
        return
    if ntry > 0:
        d = -mx / val[0]
    else:
        d = mx / val[0]
    idd = np.float32(1.0) / d
    sumqx, sumq2 = _iq4nl_sums(x, xo, idd)
    d = sumqx / sumq2
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        idd = (np.float32(itry) + val[0]) / mx
        sqx, sq2 = _iq4nl_sums(x, xo, idd)
        if sq2 > np.float32(0.0) and sqx * sqx > best * sq2:
            d = sqx / sq2
            best = d * sqx
    wr_f16(dst, do, d)
    if ntry > 0:
        idd = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    else:  # ref: the indices of the first pass (scale max / -127) are kept
        idd = np.float32(1.0) / (mx / val[0])
    for j in range(16):
        l0 = _best_index_iq4nl(idd * x[xo + j])
        l1 = _best_index_iq4nl(idd * x[xo + 16 + j])
        dst[do + 2 + j] = np.uint8(l0 | (l1 << 4))


@njit(cache=True)
def _nl_index(v, bits):
    """Index of the NL_TABLE[bits] level nearest to v (levels ascending; a tie takes the lower one).
    bits: int64 (blocks.nl_width)."""
    lo = np.int64(0)
    hi = (np.int64(1) << bits) - 1
    while hi - lo > 1:                 # NL_TABLE[bits, lo] <= v < NL_TABLE[bits, hi] once v is inside
        mid = (lo + hi) // 2
        if v < nl_level(bits, mid):
            hi = mid
        else:
            lo = mid
    if abs(v - nl_level(bits, hi)) < abs(v - nl_level(bits, lo)):
        return hi
    return lo


@njit(cache=True)
def nl_e8_floor(d):
    """The largest byte scale e in 1..255 with NL_E8[e] <= d (1 when d < NL_E8[1]): the lower of the two
    steps around d.  Float compares against the table only, so the CPU and a GPU pick the same e
    (not floor(8 * log2(d)): the two devices' log2 can differ in the last bit)."""
    lo = np.int64(1)
    hi = np.int64(256)
    while hi - lo > 1:                 # NL_E8[lo] <= d (or lo = 1), d < NL_E8[hi] (or hi = 256)
        mid = (lo + hi) // 2
        if nl_e8(mid) <= d:
            lo = mid
        else:
            hi = mid
    return lo


@njit(cache=True)
def _nl_sse(x, xo, code, d):
    """Squared error of block x[xo:xo+64] stored with scale d (each code the nearest level)."""
    idd = np.float32(1.0) / d
    e = np.float32(0.0)
    c = np.int64(code)
    for j in range(64):
        bits = nl_width(c, np.int64(j))
        r = x[xo + j] - fmul_rn(d, nl_level(bits, _nl_index(fmul_rn(x[xo + j], idd), bits)))
        e += fmul_rn(r, r)
    return e


@njit(cache=True, inline="always")
def _put_code(dst, o, bit, q, w):
    """OR the w-bit code q into dst's little-endian bit stream that starts at byte o, at bit `bit`
    (the stream's bytes zeroed first; w <= 8)."""
    p = o + (bit >> 3)
    sh = bit & 7
    dst[p] |= np.uint8((q << sh) & 0xFF)
    if sh + w > 8:
        dst[p + 1] |= np.uint8(q >> (8 - sh))


@njit(cache=True)
def _qblk_nl(x, xo, dst, do, code):
    """nl-family block (format `code`, position widths NL_BITS[code]) of x[xo:xo+64] -> dst[do:]."""
    c = np.int64(code)
    ss = np.float32(0.0)
    for j in range(64):
        ss += fmul_rn(x[xo + j], x[xo + j])
    d = np.float32(math.sqrt(ss / np.float32(64.0)))   # math.sqrt: numba.cuda has no np.sqrt ufunc
    for _ in range(4):
        if d == np.float32(0.0):
            break
        idd = np.float32(1.0) / d
        sqx = np.float32(0.0)
        sq2 = np.float32(0.0)
        for j in range(64):
            bits = nl_width(c, np.int64(j))
            q = nl_level(bits, _nl_index(fmul_rn(x[xo + j], idd), bits))
            sqx += fmul_rn(q, x[xo + j])
            sq2 += fmul_rn(q, q)
        d = sqx / sq2
    sb = NL_SCALE[code]
    if sb == 2:
        h = f32_to_f16_bits(d)
        wr_u16(dst, do, h)
        dh = h2f(np.uint16(h))
    else:                            # the byte scale: the better of the two steps around d
        e = 0
        if d > np.float32(0.0):
            lo = nl_e8_floor(d)
            hi = min(lo + 1, np.int64(255))
            e = lo if _nl_sse(x, xo, c, nl_e8(lo)) <= _nl_sse(x, xo, c, nl_e8(hi)) else hi
        dst[do] = np.uint8(e)
        dh = nl_e8(np.int64(e))
    idd = np.float32(1.0) / dh if dh != np.float32(0.0) else np.float32(0.0)
    for k in range(NL_BYTES[code] - sb):
        dst[do + sb + k] = np.uint8(0)
    for j in range(64):
        bits = nl_width(c, np.int64(j))
        q = _nl_index(fmul_rn(x[xo + j], idd), bits)
        _put_code(dst, do + sb, nl_offset(c, np.int64(j)), q, bits)


# ----------------------------------------------------------------------------------------------
# trellis-coded blocks (tc3b / tc2b / tc1b): the search is kernels.trellis
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def _qrow_tc(code, x, dst):
    """Row x (f32[HD], HD a multiple of 64) in trellis-coded format `code` -> dst: per block of 64 the byte
    scale nearest the block's RMS (tc codebooks are fitted to a unit Gaussian), then tc_viterbi's path."""
    c = np.int64(code)
    L = tc_len(c)
    k = nl_width(c, np.int64(0))
    G = np.int64(1) << (L - k)
    nb = NL_BYTES[code]
    cbp = TC_PERM[TC_ROW[code]]
    y = np.empty(64, np.float32)
    st = np.empty(64, np.int64)
    C = np.empty(np.int64(1) << L, np.float32)
    m = np.empty(G, np.float32)
    mp = np.empty(G, np.float32)
    bb = np.empty(G, np.uint8)
    back = np.empty((64, G), np.uint8)
    for b in range(x.shape[0] // 64):
        xo = 64 * b
        do = nb * b
        ss = np.float32(0.0)
        for j in range(64):
            ss += fmul_rn(x[xo + j], x[xo + j])
        d = np.float32(math.sqrt(ss / np.float32(64.0)))
        e = 0
        if d > np.float32(0.0):
            lo = nl_e8_floor(d)
            hi = min(lo + 1, np.int64(255))
            e = lo if fmul_rn(d, d) < fmul_rn(nl_e8(lo), nl_e8(hi)) else hi
        dst[do] = np.uint8(e)
        for q in range(1, nb):
            dst[do + q] = np.uint8(0)
        if e == 0:
            continue
        idd = np.float32(1.0) / nl_e8(np.int64(e))
        for j in range(64):
            y[j] = fmul_rn(x[xo + j], idd)
        tc_viterbi(y, cbp, L, k, st, C, m, mp, bb, back)
        for j in range(64):
            _put_code(dst, do + 1, k * j, st[j] >> (L - k), k)


# ----------------------------------------------------------------------------------------------
# fp8 (OCP e4m3fn / e5m2), per-row f32 scale
# ----------------------------------------------------------------------------------------------

FP8_E4M3_MAX = np.float32(448.0)
FP8_E5M2_MAX = np.float32(57344.0)


@njit(cache=True)
def fp8_encode(v, mbits, bias, fmax, max_mag):
    """float32 -> fp8 byte, round to nearest even, saturating to +-max (NaN -> 0x7F|sign)."""
    u = np.int64(f32_bits(np.float32(v)))
    sign = (u >> 24) & 0x80
    a = abs(v)
    if not (a < fmax):
        if a != a:
            return 0x7F | sign
        return max_mag | sign
    e = ((u >> 23) & 0xFF) - 127
    emin = 1 - bias
    if e < emin:
        e = emin
    y = a * pow2f(mbits - e)  # exact scaling, y < 2^(mbits+1)
    fl = floorf(y)
    r = y - fl
    n = np.int64(fl)
    if r > np.float32(0.5) or (r == np.float32(0.5) and (n & 1) == 1):
        n += 1
    mag = ((e + bias - 1) << mbits) + n  # also right for subnormals and for a carry into e
    if mag > max_mag:
        mag = max_mag
    return mag | sign


@njit(cache=True)
def _q_fp8(x, dst, e4m3):
    hd = x.shape[0]
    fmax = FP8_E4M3_MAX if e4m3 else FP8_E5M2_MAX
    amax = np.float32(0.0)
    for j in range(hd):
        a = abs(x[j])
        if a > amax:
            amax = a
    s = amax / fmax
    wr_f32(dst, np.int64(0), s)
    if s == np.float32(0.0):
        for j in range(hd):
            dst[4 + j] = 0
        return
    for j in range(hd):
        v = x[j] / s
        if e4m3:
            dst[4 + j] = np.uint8(fp8_encode(v, 3, 7, FP8_E4M3_MAX, 0x7E))
        else:
            dst[4 + j] = np.uint8(fp8_encode(v, 2, 15, FP8_E5M2_MAX, 0x7B))


# ----------------------------------------------------------------------------------------------
# KIVI group helpers (asymmetric, f16 d and m)
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def kivi_params(mn, mx, qmax):
    """(d16, m16, d, m): m = f16 rounded down from mn, d = f16 rounded up so m + qmax*d >= mx."""
    m16 = f32_to_f16_bits(mn)
    m = h2f(m16)
    if m > mn:
        m16 = f16_next_down(m16)
        m = h2f(m16)
    d = (mx - m) / np.float32(qmax)
    d16 = f32_to_f16_bits(d)
    df = h2f(d16)
    if df < d:
        d16 = f16_next_up(d16)
        df = h2f(d16)
    return d16, m16, df, m


@njit(cache=True)
def kivi_code(v, m, d, qmax):
    if d == np.float32(0.0):
        return 0
    c = np.int64(roundf_away((v - m) / d))
    if c < 0:
        return 0
    if c > qmax:
        return qmax
    return c


@njit(cache=True)
def _kivi_pack(x, xo, m, d, qmax, bits, dst, do):
    """The 32 codes of x[xo:xo+32] (KIVI group params m, d) packed into dst[do:do+4*bits]."""
    if bits == 4:
        for j in range(16):
            c0 = kivi_code(x[xo + j], m, d, qmax)
            c1 = kivi_code(x[xo + 16 + j], m, d, qmax)
            dst[do + j] = np.uint8(c0 | (c1 << 4))
    else:
        for j in range(8):
            c0 = kivi_code(x[xo + j], m, d, qmax)
            c1 = kivi_code(x[xo + 8 + j], m, d, qmax)
            c2 = kivi_code(x[xo + 16 + j], m, d, qmax)
            c3 = kivi_code(x[xo + 24 + j], m, d, qmax)
            dst[do + j] = np.uint8(c0 | (c1 << 2) | (c2 << 4) | (c3 << 6))


@njit(cache=True)
def _qgrp_kivi(x, b, dst, bits):
    """Group b of a KIVI value row: [f16 d][f16 m][codes] at dst[(4 + 4*bits) * b:]."""
    qmax = (1 << bits) - 1
    xo = 32 * b
    do = (4 + 4 * bits) * b
    mn, mx = _minmax(x, xo, 32)
    d16, m16, d, m = kivi_params(mn, mx, qmax)
    wr_u16(dst, do, d16)
    wr_u16(dst, do + 2, m16)
    _kivi_pack(x, xo, m, d, qmax, bits, dst, do + 4)


# ----------------------------------------------------------------------------------------------
# row API: quantize / dequantize
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def quantize_row_iq4_nl(x, dst, ntry):
    """iq4_nl with an explicit search width: -1 = ggml quantize_row_iq4_nl_ref, 7 = quantize_iq4_nl."""
    for b in range(x.shape[0] // 32):
        _qblk_iq4_nl(x, 32 * b, dst, 18 * b, ntry)


@njit(cache=True)
def row_units(code, n):
    """Independent pieces a row of n values quantizes in (quantize_block's b): its 32-value blocks
    (float formats: runs of 32 values), its 64-value blocks for nl4/nl3/nl2, or 1 for fp8 (one scale
    per row)."""
    if code == CODE_FP8_E4M3 or code == CODE_FP8_E5M2:
        return 1
    if NL_BYTES[code] > 0:
        return n // 64
    return (n + 31) // 32


@njit(cache=True)
def quantize_block(code, x, b, dst):
    """Piece b (< row_units(code, n)) of row x (f32[n]) -> its bytes in the row buffer dst: the b-th
    32-value block (float formats: values 32b .. 32b+31), or the whole row for fp8.  The unit of work
    of one CUDA thread in kernels.cuda.kvquant; quantize_row loops over it."""
    if code == CODE_F32:
        for j in range(32 * b, min(32 * b + 32, x.shape[0])):
            wr_f32(dst, 4 * j, x[j])
    elif code == CODE_F16:
        if not (32 * b + 32 <= x.shape[0] and f16_store32(x, 32 * b, dst, 64 * b)):
            for j in range(32 * b, min(32 * b + 32, x.shape[0])):
                wr_u16(dst, 2 * j, f32_to_f16_bits(x[j]))
    elif code == CODE_BF16:
        for j in range(32 * b, min(32 * b + 32, x.shape[0])):
            wr_u16(dst, 2 * j, bf16_bits(x[j]))
    elif code == CODE_Q8_0:
        _qblk_q8_0(x, 32 * b, dst, 34 * b)
    elif code == CODE_Q4_0:
        _qblk_q4_0(x, 32 * b, dst, 18 * b)
    elif code == CODE_Q4_1:
        _qblk_q4_1(x, 32 * b, dst, 20 * b)
    elif code == CODE_Q5_0:
        _qblk_q5_0(x, 32 * b, dst, 22 * b)
    elif code == CODE_Q5_1:
        _qblk_q5_1(x, 32 * b, dst, 24 * b)
    elif code == CODE_IQ4_NL:
        _qblk_iq4_nl(x, 32 * b, dst, 18 * b, -1)
    elif code == CODE_FP8_E4M3:
        _q_fp8(x, dst, True)
    elif code == CODE_FP8_E5M2:
        _q_fp8(x, dst, False)
    elif code == CODE_INT4:
        _qgrp_kivi(x, b, dst, 4)
    elif code == CODE_INT2:
        _qgrp_kivi(x, b, dst, 2)
    elif NL_BYTES[code] > 0:           # nl4 / nl3 / nl2 / klt3 / klt2 / nl3b / nl2b
        _qblk_nl(x, 64 * b, dst, NL_BYTES[code] * b, code)


@njit(cache=True)
def quantize_row(code, x, dst):
    if tc_len(np.int64(code)) > 0:     # trellis-coded: CPU only (its Viterbi scratch is allocated here)
        _qrow_tc(code, x, dst)
        return
    for b in range(row_units(code, x.shape[0])):
        quantize_block(code, x, b, dst)


@njit(cache=True)
def dequantize_row(code, src, out):
    deq_rows(code, src, 0, 0, 1, out.reshape(1, out.shape[0]))


# ----------------------------------------------------------------------------------------------
# whole-tensor helpers
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True)
def quantize_rows(code, X, dst, ntry=-1):
    """Quantize every row of X (row length: any multiple of the block size) into dst[N, row_bytes].
    ntry: iq4_nl's scale search width (-1: the KV cache's quantize_row_iq4_nl_ref, 7: llama-quantize's)."""
    for i in prange(X.shape[0]):
        if code == CODE_IQ4_NL:
            quantize_row_iq4_nl(X[i], dst[i], ntry)
        else:
            quantize_row(code, X[i], dst[i])


# ----------------------------------------------------------------------------------------------
# KIVI keys: per-channel quantization over a page of P tokens
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def kivi_kpage_group(bits, xk, b, dst):
    """Channels 32b .. 32b+31 of a KIVI key page: xk f32[P, HD] -> their d, m in the page header and
    their codes in every token row of dst (the page's bytes, layout below).  The unit of work of one
    CUDA thread; no scratch (d, m are read back from the header: h2f(d16), h2f(m16) = kivi_params' d, m)."""
    p, hd = xk.shape
    qmax = (1 << bits) - 1
    rb = hd * bits // 8
    for c in range(32 * b, 32 * b + 32):
        mn = xk[0, c]
        mx = xk[0, c]
        for t in range(1, p):
            v = xk[t, c]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d16, m16, d, m = kivi_params(mn, mx, qmax)
        wr_u16(dst, 2 * c, d16)
        wr_u16(dst, 2 * hd + 2 * c, m16)
    for t in range(p):
        o = 4 * hd + t * rb + 4 * bits * b
        if bits == 4:
            for j in range(16):
                c = 32 * b + j
                c0 = kivi_code(xk[t, c], rd_f16(dst, 2 * hd + 2 * c), rd_f16(dst, 2 * c), qmax)
                c1 = kivi_code(xk[t, c + 16], rd_f16(dst, 2 * hd + 2 * c + 32), rd_f16(dst, 2 * c + 32), qmax)
                dst[o + j] = np.uint8(c0 | (c1 << 4))
        else:
            for j in range(8):
                c = 32 * b + j
                q = np.int64(0)
                for k in range(4):
                    ck = c + 8 * k
                    q |= kivi_code(xk[t, ck], rd_f16(dst, 2 * hd + 2 * ck), rd_f16(dst, 2 * ck), qmax) << (2 * k)
                dst[o + j] = np.uint8(q)


@njit(cache=True)
def kivi_quantize_kpage(bits, xk, dst):
    """xk f32[P, HD] -> dst: [f16 d[HD]][f16 m[HD]][P token-major rows of HD*bits/8 code bytes]."""
    for b in range(xk.shape[1] // 32):
        kivi_kpage_group(bits, xk, b, dst)


# ----------------------------------------------------------------------------------------------
# the paged cache (pykv.kv.cache): token rows into pages, the f16 residual rows, page flushes
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _append_row(x, pool, page_table, start, P, code, i):
    KVH = x.shape[1]
    rb = pool.shape[2] // P
    t = i // KVH
    g = i % KVH
    j = start + t
    o = (j % P) * rb
    quantize_row(code, x[t, g], pool[g, page_table[j // P], o:o + rb])


@njit(cache=True, nogil=True, parallel=True)
def append_rows(x, pool, page_table, start, P, code):
    # x (T, KVH, HD) f32 -> quantize token start+t, head g into its slot of pool (KVH, n_pages, P*rb).
    # A decode step's KVH rows run on the calling thread (far too little work to wake threads for).
    T, KVH, HD = x.shape
    if T >= PAR_T:
        for i in prange(T * KVH):
            _append_row(x, pool, page_table, start, P, code, i)
    else:
        for i in range(T * KVH):
            _append_row(x, pool, page_table, start, P, code, i)


@njit(cache=True, nogil=True, inline="always")
def _append_seq_row(x, pool, page_tables, pos, P, code, s, g):
    rb = pool.shape[2] // P
    j = pos[s]
    o = (j % P) * rb
    quantize_row(code, x[s, g], pool[g, page_tables[s, j // P], o:o + rb])


@njit(cache=True, nogil=True, parallel=True)
def append_seqs(k, v, kpool, vpool, page_tables, pos, P, kcode, vcode):
    # a step of S one-token sequences (batched decode): k, v (S, KVH, HD) f32, row s -> token pos[s] of the
    # sequence whose page table is page_tables[s] (S, max_pages); the rows quantize as append_rows's.
    # A few rows run on the calling thread (far less work than waking the threads).
    S, KVH, HD = k.shape
    if S * KVH * HD >= PAR_SEQ_VALUES:
        for i in prange(2 * S * KVH):
            s, g = (i // 2) // KVH, (i // 2) % KVH
            if i % 2 == 0:
                _append_seq_row(k, kpool, page_tables, pos, P, kcode, s, g)
            else:
                _append_seq_row(v, vpool, page_tables, pos, P, vcode, s, g)
    else:
        for i in range(S * KVH):
            s, g = i // KVH, i % KVH
            _append_seq_row(k, kpool, page_tables, pos, P, kcode, s, g)
            _append_seq_row(v, vpool, page_tables, pos, P, vcode, s, g)


@njit(cache=True, nogil=True, parallel=True)
def prep_append_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, kpool, vpool,
                     page_tables, P, kcode, vcode):
    """ops.qkv_prep_seqs(q, k, v, pos, ... qmul), then append_seqs(k, v, kpool, ... vcode): a decode
    group's RoPE, smoothing, rotation and K / V appends (the GPU twin runs them as one launch).  From
    PAR_PREP_SEQS sequences a thread takes whole sequences (each row's own functions: the same bits)."""
    S, KVH = q.shape[0], k.shape[1]
    if S >= PAR_PREP_SEQS:
        for s in prange(S):
            _qkv_prep_seq(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, s)
            for g in range(KVH):
                _append_seq_row(k, kpool, page_tables, pos, P, kcode, s, g)
                _append_seq_row(v, vpool, page_tables, pos, P, vcode, s, g)
    else:
        qkv_prep_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul)
        append_seqs(k, v, kpool, vpool, page_tables, pos, P, kcode, vcode)


@njit(cache=True, nogil=True)
def write_residual(x, res, start, P, rcode):
    # x (T, KVH, HD) f32, all in one page -> f16 rows res[g, (start + t) % P]
    T, KVH, HD = x.shape
    for t in range(T):
        for g in range(KVH):
            quantize_row(rcode, x[t, g], res[g, (start + t) % P])


@njit(cache=True, nogil=True, parallel=True)
def flush_residual(res, r0, pool, page, P, rcode, code, kbits, tmp):
    # quantize the full page held in residual rows r0 .. r0+P-1 of res (KVH, RING, 2*HD) into
    # pool[:, page]; tmp (KVH, P, HD) f32 scratch.
    KVH = res.shape[0]
    for g in prange(KVH):
        for s in range(P):
            dequantize_row(rcode, res[g, r0 + s], tmp[g, s])
        if kbits > 0:
            kivi_quantize_kpage(kbits, tmp[g], pool[g, page])
        else:
            rb = pool.shape[2] // P
            for s in range(P):
                quantize_row(code, tmp[g, s], pool[g, page, s * rb:(s + 1) * rb])
