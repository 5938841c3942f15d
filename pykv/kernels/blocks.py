"""Decoders of the block formats: ONE definition per format, used by every kernel that dequantizes.

Callers: attention._item (tiles of K / V rows, the hot path, through deq_rows), kvquant.dequantize_row
(one KV row: deq_rows with n = 1) and matmul._deq_row (weight rows: get_rows and the exact mode).

Each decoder reads the encoded values at byte offset `so` of the uint8 array `src` and writes float32
values to the C-contiguous float32 array `out` from flat element offset `oo`:

    one block of 32 values   (src, so, out, oo):
        deq_q8_0, deq_q4_0, deq_q4_1 (= KIVI int4 value groups): kernels.simd's whole-block vector decoders
        deq_q5 (+ asym: q5_1), deq_iq4_nl;  deq_int2 (KIVI int2 value groups; + qb, see below)
    n values of a row        (src, so, n, out, oo):
        deq_f32, deq_f16, deq_bf16;  deq_fp8 (+ e4m3: the row's f32 scale at so, the codes after it)
    deq_rows(code, src, o0, rb, n, out)         n KV rows of any format (row r at byte o0 + r * rb) -> out[n, HD]
    deq_kivi_k_rows(bits, page, s0, n, out, dk, mk)   tokens s0 .. s0+n of a KIVI key page -> out[n, HD]
    deq_unit(code, src, ro, b, HD, out, oo)     piece b of one KV row (kvquant.row_units' pieces: a
                                                32-value block, an nl-family block of 64, or a whole fp8 row)
    deq_kivi_k_unit(bits, page, s, b, HD, out, oo)   channels 32b .. 32b+31 of token s of a KIVI key page
The two *_unit decoders are the per-thread work of kernels.cuda.attention (they call the same block
decoders; numba.cuda compiles these @njit functions for the GPU, so everything here keeps to the
CUDA-compatible subset: scalars, array indexing, the simd intrinsics; no allocation, no numpy calls).

All are ``inline='always'`` without fast-math flags of their own: inlined code is lowered with the
CALLER's flags, so kvquant and matmul (no fast-math) get values bit-exact with gguf.quants.dequantize
and attention gets its fast-math build of the same code.  Indices are np.uint64: Numba then emits no
negative-index wraparound selects (which turn contiguous loads into gathers).  f16 is decoded by
kernels.simd.h2f (hardware half -> float, vectorizes).  Like every kernel here: no bounds checks.
"""
import os

import numpy as np
from numba import njit

from pykv.files.formats import (CODE_BF16, CODE_F16, CODE_F32, CODE_FP8_E4M3, CODE_FP8_E5M2, CODE_INT2,
                       CODE_INT4, CODE_IQ4_NL, CODE_Q4_0, CODE_Q4_1, CODE_Q5_0, CODE_Q5_1, CODE_Q8_0,
                       KV_FORMATS, N_CODES)
from pykv.kernels.simd import bits_f32, deq_q4_0, deq_q4_1, deq_q8_0, h2f

U = np.uint64
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
IQ4NL_F = KVALUES_IQ4NL.astype(np.float32)
# nl family (nl4/nl3/nl2, klt3/klt2): row `bits` holds the 2^bits Lloyd-Max levels of a unit Gaussian,
# ascending (the positive half listed; 1-4 bits as nl4/nl3/nl2 always had them)
_LM = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3440, 2.1520],
       4: [0.1284, 0.3881, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
       5: [0.0659, 0.1981, 0.3314, 0.4667, 0.6049, 0.7471, 0.8946, 1.0488, 1.2118, 1.3863, 1.5762, 1.7872,
           2.0287, 2.3177, 2.6911, 3.2607],
       6: [0.0334, 0.1002, 0.1672, 0.2344, 0.3020, 0.3701, 0.4387, 0.5080, 0.5782, 0.6493, 0.7215, 0.7950,
           0.8700, 0.9467, 1.0252, 1.1060, 1.1892, 1.2752, 1.3646, 1.4577, 1.5552, 1.6580, 1.7669, 1.8834,
           2.0090, 2.1462, 2.2984, 2.4708, 2.6717, 2.9169, 3.2400, 3.7437]}
NL_MAXBITS = 8
NL_TABLE = np.zeros((NL_MAXBITS + 1, 1 << NL_MAXBITS), np.float32)   # (bits, level)
for _b, _h in _LM.items():
    NL_TABLE[_b, :1 << _b] = [-v for v in _h[::-1]] + _h
# 7 / 8 bits: uniform levels on +-4, no long literal table (8 bits, unit Gaussian: MSE 9.0e-5 against
# Lloyd-Max's 5.6e-5; klt3 uses it for its first two channels)
for _b in (7, 8):
    _n = 1 << _b
    NL_TABLE[_b, :_n] = (np.arange(_n) - (_n - 1) / 2) * (8.0 / _n)
# per format code: the code width of each of the 64 positions of an nl-family block, its bit offset in
# the block's code stream, and the block's bytes (0: not an nl-family code)
NL_BITS = np.zeros((N_CODES, 64), np.int32)
NL_OFF = np.zeros((N_CODES, 64), np.int32)
NL_BYTES = np.zeros(N_CODES, np.int32)
NL_SCALE = np.zeros(N_CODES, np.int32)     # bytes of the block scale: 2 = f16 d, 1 = log2 byte (NL_E8)
# the byte scale e -> d = 2^((e - 160) / 8) (e = 0: 0.0): 2^-19.9 .. 2^11.9 in steps of 2^(1/8)
NL_E8 = np.array([0.0] + [2.0 ** ((e - 160) / 8) for e in range(1, 256)], np.float32)
for _f in KV_FORMATS.values():
    if _f.nl_runs:
        NL_SCALE[_f.code] = _f.nl_scale
        _w = np.concatenate([np.full(n, b, np.int32) for n, b in _f.nl_runs])
        NL_BITS[_f.code] = _w
        NL_OFF[_f.code] = np.concatenate([[0], np.cumsum(_w)[:-1]])
        NL_BYTES[_f.code] = _f.block_bytes
# trellis-coded formats (tc3b / tc2b, formats.tc_len > 0): TC_LEN[code] = the window L in bits, TC_ROW[code]
# = its codebook's row of TC_TABLE (2^L levels for a unit Gaussian, trained by tools/train_trellis.py with
# the encoder trellis.tc_viterbi; pykv/data/trellis.npz)
TC_LEN = np.zeros(N_CODES, np.int32)
TC_ROW = np.zeros(N_CODES, np.int32)
_tc = [f for f in KV_FORMATS.values() if f.tc_len]
TC_TABLE = np.zeros((max(1, len(_tc)), 512), np.float32)
TC_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "trellis.npz")
_cbs = np.load(TC_FILE) if os.path.exists(TC_FILE) else {}
for _i, _f in enumerate(_tc):
    TC_LEN[_f.code] = _f.tc_len
    TC_ROW[_f.code] = _i
    if _f.name in _cbs and _cbs[_f.name].shape == (1 << _f.tc_len,):
        TC_TABLE[_i, :1 << _f.tc_len] = _cbs[_f.name]
del _b, _h, _n, _f, _w, _i, _tc, _cbs


# The nl tables are read only through these four functions, each with one signature (int64 indices): a
# numba.cuda kernel gets its own copy of a module-level array in constant memory for every place in its
# code that reads one, and with a read at each use the KV append kernel's copies outgrew the GPU's 64 KiB
# (ptxas: "too much global constant data"; the CUDA simulator has no such limit).
@njit(cache=True)
def nl_level(bits, i):
    """NL_TABLE[bits, i]: level i of the 2^bits-level codebook."""
    return NL_TABLE[bits, i]


@njit(cache=True)
def nl_width(code, j):
    """NL_BITS[code, j] as int64: the code width of position j of a format-`code` block."""
    return np.int64(NL_BITS[code, j])


@njit(cache=True)
def nl_offset(code, j):
    """NL_OFF[code, j] as int64: the bit offset of position j's code in the block's code stream."""
    return np.int64(NL_OFF[code, j])


@njit(cache=True)
def tc_len(code):
    """TC_LEN[code] as int64: the trellis window of a tc format in bits (0: not trellis-coded)."""
    return np.int64(TC_LEN[code])


@njit(cache=True)
def tc_level(code, i):
    """TC_TABLE[TC_ROW[code], i]: level i of a tc format's trellis codebook."""
    return TC_TABLE[TC_ROW[code], i]


@njit(cache=True)
def nl_e8(e):
    """NL_E8[e] = 2^((e - 160) / 8): the byte scale e's d (e = 0: 0.0)."""
    return NL_E8[e]

__all__ = ["deq_q8_0", "deq_q4_0", "deq_q4_1", "deq_q5", "deq_iq4_nl", "deq_int2", "deq_f32",
           "deq_f16", "deq_bf16", "deq_fp8", "deq_rows", "deq_kivi_k_rows", "deq_unit", "deq_kivi_k_unit", "rd_f16",
           "rd_f32", "rd_u32", "KVALUES_IQ4NL", "IQ4NL_F", "NL_TABLE", "NL_BITS", "NL_OFF", "NL_BYTES", "NL_SCALE", "NL_E8", "deq_nl",
           "nl_level", "nl_width", "nl_offset", "nl_e8", "TC_LEN", "TC_ROW", "TC_TABLE", "tc_len", "tc_level"]


# ----------------------------------------------------------------------------------------------
# scalars at a byte offset
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def rd_f16(src, o):
    p = U(o)
    return h2f(np.uint16(src[p]) | (np.uint16(src[p + U(1)]) << np.uint16(8)))


@njit(cache=True, inline="always")
def rd_u32(src, o):
    p = U(o)
    return np.uint32(np.uint32(src[p]) | (np.uint32(src[p + U(1)]) << np.uint32(8))
                     | (np.uint32(src[p + U(2)]) << np.uint32(16)) | (np.uint32(src[p + U(3)]) << np.uint32(24)))


@njit(cache=True, inline="always")
def rd_f32(src, o):
    return bits_f32(rd_u32(src, o))


@njit(cache=True, inline="always")
def opaque_bs(n):
    """32 for n >= 32, in a form LLVM cannot constant-fold: with a literal 32 some block loops get fully
    unrolled and vectorized ACROSS blocks with gathers (much slower) instead of along the block."""
    nb = n // 32
    return n // nb if nb > 0 else 32


# ----------------------------------------------------------------------------------------------
# block formats: one block of 32 values
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def deq_q5(src, so, out, oo, asym):
    """q5_0 [f16 d][u32 qh][16 nibble bytes]: d * (q - 16);  q5_1 (asym) [f16 d][f16 m][u32 qh][16 bytes]:
    d * q + m.  Bit 4 of element j is bit j of qh."""
    o = U(so)
    d = rd_f16(src, o)
    m = rd_f16(src, o + U(2)) if asym else np.float32(0.0)
    h = o + U(4) if asym else o + U(2)
    qh = np.int32(rd_u32(src, h))
    for j in range(16):                       # a literal 16 measured faster than the opaque length here
        v = np.int32(src[h + U(4 + j)])
        q0 = (v & 0xF) | (((qh >> j) & 1) << 4)
        q1 = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
        if asym:
            out[U(oo + j)] = d * np.float32(q0) + m
            out[U(oo + 16 + j)] = d * np.float32(q1) + m
        else:                                 # no "+ 0": -0.0 stays -0.0, as in ggml
            out[U(oo + j)] = d * np.float32(q0 - 16)
            out[U(oo + 16 + j)] = d * np.float32(q1 - 16)


@njit(cache=True, inline="always")
def deq_iq4_nl(src, so, out, oo):
    """[f16 d][16 nibble bytes]: d * KVALUES_IQ4NL[q] (table lookups: gathers whatever the length)."""
    o = U(so)
    d = rd_f16(src, o)
    for j in range(16):
        v = src[o + U(2 + j)]
        out[U(oo + j)] = d * IQ4NL_F[v & 0xF]
        out[U(oo + 16 + j)] = d * IQ4NL_F[v >> 4]


@njit(cache=True, inline="always")
def deq_int2(src, so, out, oo, qb):
    """KIVI int2 value group [f16 d][f16 m][8 bytes]: byte j holds elements j, j+8, j+16, j+24 (bit
    shifts 0, 2, 4, 6); value = d * code + m.  qb = 8, passed in as opaque_bs(HD) // 4 (see opaque_bs)."""
    o = U(so)
    d = rd_f16(src, o)
    m = rd_f16(src, o + U(2))
    for k in range(4):
        for j in range(qb):
            v = np.int32(src[o + U(4 + j)])
            out[U(oo + qb * k + j)] = d * np.float32((v >> (2 * k)) & 3) + m


@njit(cache=True, inline="always")
def deq_nl(src, so, out, oo, code):
    """nl-family block of 64 [scale][code bytes] (format `code`: nl4/nl3/nl2, klt3/klt2, nl3b/nl2b; the
    scale an f16 d, or one byte e: d = NL_E8[e]): element j's code is the NL_BITS[code, j] bits from
    bit NL_OFF[code, j] of the code bytes read as one little-endian bit stream; value = d *
    NL_TABLE[bits, code] (code widths <= 8).  Trellis-coded (tc_len(code) = L > 0, k-bit symbols): value j =
    d * tc_level(code, w), w the L stream bits ending after symbol j (bits before the stream are 0)."""
    o = U(so)
    sb = NL_SCALE[code]
    d = rd_f16(src, o) if sb == 2 else nl_e8(np.int64(src[o]))
    c = np.int64(code)
    L = tc_len(c)
    if L > 0:
        k = nl_width(c, np.int64(0))
        msk = (np.int64(1) << L) - 1
        for j in range(64):
            start = k * j + k - L
            if start < 0:
                v = np.int64(src[o + U(sb)]) << (-start)
            else:
                p = o + U(sb + (start >> 3))
                sh = start & 7
                v = np.int64(src[p]) >> sh
                if sh + L > 8:
                    v |= np.int64(src[p + U(1)]) << (8 - sh)
            out[U(oo + j)] = d * tc_level(c, v & msk)
        return
    for j in range(64):
        bits = nl_width(c, np.int64(j))
        bit = nl_offset(c, np.int64(j))
        p = o + U(sb + (bit >> 3))
        sh = bit & 7
        v = np.int64(src[p]) >> sh
        if sh + bits > 8:
            v |= np.int64(src[p + U(1)]) << (8 - sh)
        out[U(oo + j)] = d * nl_level(bits, v & ((1 << bits) - 1))


# ----------------------------------------------------------------------------------------------
# row formats: n values
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def deq_f32(src, so, n, out, oo):
    for i in range(n):
        out[U(oo + i)] = rd_f32(src, U(so + 4 * i))


@njit(cache=True, inline="always")
def deq_f16(src, so, n, out, oo):
    for i in range(n):
        out[U(oo + i)] = rd_f16(src, U(so + 2 * i))


@njit(cache=True, inline="always")
def deq_bf16(src, so, n, out, oo):
    o = U(so)
    for i in range(n):
        out[U(oo + i)] = bits_f32(np.uint32((np.uint32(src[o + U(2 * i)]) << np.uint32(16))
                                            | (np.uint32(src[o + U(2 * i + 1)]) << np.uint32(24))))


@njit(cache=True, inline="always")
def deq_fp8(src, so, n, out, oo, e4m3):
    """[f32 s][n codes] -> code value * s.  e5m2: the byte is the top byte of an f16 (inf / NaN
    included).  e4m3: S.EEEE.MMM -> f16 S.0EEEE.MMM0000000 = value * 2^-8 (subnormals too), times
    256 s (exact: a power of two); 0x7F / 0xFF are NaN."""
    o = U(so)
    s = rd_f32(src, o)
    if e4m3:
        s *= np.float32(256.0)
        for i in range(n):
            b = np.uint16(src[o + U(4 + i)])
            v = h2f(((b & np.uint16(0x80)) << np.uint16(8)) | ((b & np.uint16(0x7F)) << np.uint16(7)))
            out[U(oo + i)] = v * s if (b & np.uint16(0x7F)) != np.uint16(0x7F) else np.float32(np.nan)
    else:
        for i in range(n):
            out[U(oo + i)] = h2f(np.uint16(src[o + U(4 + i)]) << np.uint16(8)) * s


# ----------------------------------------------------------------------------------------------
# KV rows: one format dispatch for n rows
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def deq_rows(code, src, o0, rb, n, out):
    """n rows of KV format `code` (row r at byte o0 + r * rb of src) -> out[0:n, 0:HD] f32."""
    HD = out.shape[1]
    nb = HD // 32
    qb = opaque_bs(HD) // 4
    if code == CODE_F16:
        for r in range(n):
            deq_f16(src, o0 + r * rb, HD, out[r], 0)
    elif code == CODE_Q8_0:          # whole-block vector decoders (simd.py): LLVM left these scalar
        for r in range(n):
            for b in range(nb):
                deq_q8_0(src, o0 + r * rb + 34 * b, out, r * HD + 32 * b)
    elif code == CODE_Q4_0:
        for r in range(n):
            for b in range(nb):
                deq_q4_0(src, o0 + r * rb + 18 * b, out, r * HD + 32 * b)
    elif code == CODE_Q4_1 or code == CODE_INT4:   # same bytes: [f16 d][f16 m][16 nibble bytes]
        for r in range(n):
            for b in range(nb):
                deq_q4_1(src, o0 + r * rb + 20 * b, out, r * HD + 32 * b)
    elif code == CODE_IQ4_NL:
        for r in range(n):
            row = out[r]
            for b in range(nb):
                deq_iq4_nl(src, o0 + r * rb + 18 * b, row, 32 * b)
    elif code == CODE_Q5_0 or code == CODE_Q5_1:
        asym = code == CODE_Q5_1
        bb = 24 if asym else 22
        for r in range(n):
            row = out[r]
            for b in range(nb):
                deq_q5(src, o0 + r * rb + bb * b, row, 32 * b, asym)
    elif code == CODE_INT2:
        for r in range(n):
            row = out[r]
            for b in range(nb):
                deq_int2(src, o0 + r * rb + 12 * b, row, 32 * b, qb)
    elif NL_BYTES[code] > 0:         # nl4 / nl3 / nl2 / klt3 / klt2 / nl3b / nl2b
        bb = NL_BYTES[code]
        for r in range(n):
            row = out[r]
            for b in range(HD // 64):
                deq_nl(src, o0 + r * rb + bb * b, row, 64 * b, code)
    elif code == CODE_FP8_E4M3 or code == CODE_FP8_E5M2:
        e4m3 = code == CODE_FP8_E4M3
        for r in range(n):
            deq_fp8(src, o0 + r * rb, HD, out[r], 0, e4m3)
    elif code == CODE_F32:
        for r in range(n):
            deq_f32(src, o0 + r * rb, HD, out[r], 0)
    elif code == CODE_BF16:
        for r in range(n):
            deq_bf16(src, o0 + r * rb, HD, out[r], 0)
    else:
        raise ValueError("unknown KV format code")


@njit(cache=True, inline="always")
def deq_kivi_k_rows(bits, page, s0, n, out, dk, mk):
    """Tokens s0 .. s0+n of a KIVI key page (kvquant's layout) -> out[0:n]: code * d[c] + m[c]
    (per-channel d, m; dk, mk f32[HD] scratch)."""
    HD = out.shape[1]
    for c in range(HD):
        dk[c] = rd_f16(page, U(2 * c))
        mk[c] = rd_f16(page, U(2 * HD + 2 * c))
    rb = HD * bits // 8
    for r in range(n):
        o = U(4 * HD + (s0 + r) * rb)
        if bits == 4:
            for b in range(HD // 32):
                for j in range(16):
                    v = np.int32(page[o + U(16 * b + j)])
                    c = 32 * b + j
                    out[r, c] = np.float32(v & 0xF) * dk[c] + mk[c]
                    out[r, c + 16] = np.float32(v >> 4) * dk[c + 16] + mk[c + 16]
        else:
            for b in range(HD // 32):
                for j in range(8):
                    v = np.int32(page[o + U(8 * b + j)])
                    c = 32 * b + j
                    out[r, c] = np.float32(v & 3) * dk[c] + mk[c]
                    out[r, c + 8] = np.float32((v >> 2) & 3) * dk[c + 8] + mk[c + 8]
                    out[r, c + 16] = np.float32((v >> 4) & 3) * dk[c + 16] + mk[c + 16]
                    out[r, c + 24] = np.float32((v >> 6) & 3) * dk[c + 24] + mk[c + 24]


# ----------------------------------------------------------------------------------------------
# one piece of a row: the per-thread unit of the CUDA kernels
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def deq_unit(code, src, ro, b, HD, out, oo):
    """Piece b of the HD-value KV row of format `code` at byte ro of src -> out[oo + 32b ...]: the
    b-th block of 32 values (float formats: values 32b .. min(32b + 32, HD)), the b-th block of 64 for
    the nl family (-> out[oo + 64b ...]), or the whole row for fp8 (b = 0).  Same decoders, same values
    as deq_rows."""
    o = oo + 32 * b
    if code == CODE_F16:
        deq_f16(src, ro + 64 * b, min(32, HD - 32 * b), out, o)
    elif code == CODE_Q8_0:
        deq_q8_0(src, ro + 34 * b, out, o)
    elif code == CODE_Q4_0:
        deq_q4_0(src, ro + 18 * b, out, o)
    elif code == CODE_Q4_1 or code == CODE_INT4:
        deq_q4_1(src, ro + 20 * b, out, o)
    elif code == CODE_IQ4_NL:
        deq_iq4_nl(src, ro + 18 * b, out, o)
    elif code == CODE_Q5_0:
        deq_q5(src, ro + 22 * b, out, o, False)
    elif code == CODE_Q5_1:
        deq_q5(src, ro + 24 * b, out, o, True)
    elif code == CODE_INT2:
        deq_int2(src, ro + 12 * b, out, o, 8)
    elif code == CODE_FP8_E4M3 or code == CODE_FP8_E5M2:
        deq_fp8(src, ro, HD, out, oo, code == CODE_FP8_E4M3)
    elif code == CODE_F32:
        deq_f32(src, ro + 128 * b, min(32, HD - 32 * b), out, o)
    elif code == CODE_BF16:
        deq_bf16(src, ro + 64 * b, min(32, HD - 32 * b), out, o)
    elif NL_BYTES[code] > 0:         # nl4 / nl3 / nl2 / nl3b / nl2b (klt too): blocks of 64
        deq_nl(src, ro + NL_BYTES[code] * b, out, oo + 64 * b, code)


@njit(cache=True, inline="always")
def deq_kivi_k_unit(bits, page, s, b, HD, out, oo):
    """Channels 32b .. 32b+31 of token s of a KIVI key page -> out[oo + 32b ...]: code * d[c] + m[c],
    as deq_kivi_k_rows (d, m read from the page header)."""
    o = U(4 * HD + s * (HD * bits // 8) + 4 * bits * b)
    for c in range(32 * b, 32 * b + 32):
        j = c - 32 * b
        if bits == 4:
            v = np.int32(page[o + U(j % 16)])
            q = (v >> (4 * (j // 16))) & 0xF
        else:
            v = np.int32(page[o + U(j % 8)])
            q = (v >> (2 * (j // 8))) & 3
        out[U(oo + c)] = np.float32(q) * rd_f16(page, U(2 * c)) + rd_f16(page, U(2 * HD + 2 * c))
