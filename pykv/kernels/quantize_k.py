"""K-quant weight quantizers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; super-blocks of QK_K = 256).

Same float32 operations in the same order as ggml's reference quantizers (ggml-quants.c, built
without FMA contraction), so the bytes equal what llama-quantize writes:

  * without an importance matrix ggml_quantize_chunk -> quantize_qX_K(..., NULL) -> quantize_row_qX_K_ref
    (make_qkx2_quants for Q2_K/Q4_K/Q5_K, make_q3_quants for Q3_K, make_qx_quants for Q6_K);
  * with one (per-column weights qw[cols]) quantize_row_qX_K_impl (make_qkx3_quants + make_qp_quants for
    Q2_K/Q4_K/Q5_K, make_qx_quants with weights for Q3_K/Q6_K).

Every intermediate is float32 (ints are converted where C converts them); L arrays keep C's
int8/uint8 storage. Block layouts (ggml field names, byte offsets inside one block):

    Q2_K  84 B: scales[16] (lo nibble scale, hi nibble min) @0, qs[64] @16, d @80, dmin @82
    Q3_K 110 B: hmask[32] @0, qs[64] @32, scales[12] (16 x 6-bit, +32) @96, d @108
    Q4_K 144 B: d @0, dmin @2, scales[12] (8 x 6-bit scale and min) @4, qs[128] @16
    Q5_K 176 B: d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
    Q6_K 210 B: ql[128] @0, qh[64] @128, scales[16] int8 @192, d @208
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from gguf import GGMLQuantizationType as _GT

from pykv.kernels.kvquant import f32_to_f16_bits, wr_u16
from pykv.kernels.simd import f32_bits, h2f

QK_K = 256
Q4_0, Q4_1, Q5_0, Q5_1 = int(_GT.Q4_0), int(_GT.Q4_1), int(_GT.Q5_0), int(_GT.Q5_1)
LEGACY_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24}   # the imatrix variants below
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(_GT.Q2_K), int(_GT.Q3_K), int(_GT.Q4_K), int(_GT.Q5_K), int(_GT.Q6_K)
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
K_TYPES = tuple(BLOCK_BYTES)

_F0 = np.float32(0.0)
_EPS = np.float32(1e-15)     # GROUP_MAX_EPS


# ----------------------------------------------------------------------------------------------
# scalar helpers
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def nearest_int(v):
    """ggml's nearest_int: round half to even through the 1.5*2^23 trick (|v| < 2^22)."""
    s = np.float32(v) + np.float32(12582912.0)
    return np.int64(f32_bits(s) & np.uint32(0x007FFFFF)) - 0x00400000


@njit(cache=True, inline="always")
def _sqrtf(v):
    return np.float32(math.sqrt(np.float64(v)))  # correctly rounded: equals sqrtf


@njit(cache=True, inline="always")
def _fp16_round(v):
    """(f16 bits, value read back) of float32 v, as GGML_FP32_TO_FP16 / GGML_FP16_TO_FP32."""
    h = f32_to_f16_bits(v)
    return h, np.float32(h2f(h))


# ----------------------------------------------------------------------------------------------
# ggml's scale searches (x: float32[n] view, L: int8/uint8[n] view written in place)
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def make_qkx(n, nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants / make_qkx3_quants (weights given): returns (scale, the_min)."""
    fmax = np.float32(nmax)
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > _F0:
        mn = _F0
    if mx <= mn:
        for i in range(n):
            L[i] = 0
        return _F0, -mn
    iscale = fmax / (mx - mn)
    scale = np.float32(1.0) / iscale
    best = _F0
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        L[i] = l
        diff = scale * np.float32(l) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fmax) / (mx - mn)
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            fl = np.float32(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F0:
                this_min = _F0
                this_scale = sum_xl / sum_l2
            cur = _F0
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur += w[i] * diff
            if cur < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = cur
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, inline="always")
def _signed_max(x, n):
    """(x[i], |x[i]|) for the first i of largest |x[i]| in x[:n] (make_qx / make_q3's search)."""
    mx = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    return mx, amax


@njit(cache=True)
def make_qx(n, nmax, x, L, qw):
    """make_qx_quants(rmse_type=1): weights qw[i] when qw has n entries, else x[i]^2. L = l + nmax."""
    use_qw = qw.shape[0] > 0
    fmax = np.float32(nmax)
    mx, amax = _signed_max(x, n)
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = np.float32(-nmax) / mx
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = qw[i] if use_qw else x[i] * x[i]
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != _F0 else _F0
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fmax + np.float32(0.1) * np.float32(step)) / mx
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = qw[i] if use_qw else x[i] * x[i]
            fl = np.float32(l)
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > _F0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def make_q3(n, nmax, x, L):
    """make_q3_quants(do_rmse=true). L = l + nmax."""
    mx, amax = _signed_max(x, n)
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = np.float32(-nmax) / mx
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fL = np.float32(L[i])
            slx = sumlx - w * x[i] * fL
            if slx > _F0:
                sl2 = suml2 - w * fL * fL
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > _F0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > _F0 else _F0


@njit(cache=True)
def make_qp(n, nmax, x, L, qw):
    """make_qp_quants: non-negative x (sub-block scales or mins) -> L uint8[n], returns the scale."""
    mx = _F0
    for i in range(n):
        mx = max(mx, x[i])
    if mx < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    fmax = np.float32(nmax)
    iscale = fmax / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = np.float32(1.0) / iscale
    best = _F0
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        best += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (np.float32(0.1) * np.float32(step) + fmax) / mx
        scale_is = np.float32(1.0) / iscale_is
        mse = _F0
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * np.float32(l)
            mse += qw[i] * diff * diff
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = np.float32(l)
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            fL = np.float32(L[i])
            slx = sumlx - w * x[i] * fL
            sl2 = suml2 - w * fL * fL
            if slx > _F0 and sl2 > _F0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != np.int64(L[i]):
                    fn = np.float32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > _F0 else _F0


# ----------------------------------------------------------------------------------------------
# packing helpers shared by the ref and the imatrix paths
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _pack_2bit(L, qs, o):
    """qs[o + j/4 + l] = 4 x 2-bit L, for j in {0, 128} (Q2_K / Q3_K)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            qs[o + j // 4 + l] = (np.int64(L[j + l]) | (np.int64(L[j + l + 32]) << 2)
                                  | (np.int64(L[j + l + 64]) << 4) | (np.int64(L[j + l + 96]) << 6)) & 0xFF


@njit(cache=True, inline="always")
def _scale_min_k4(sc12, o, j):
    a = np.int64(sc12[o + j])
    b = np.int64(sc12[o + j + 4])
    if j < 4:
        return a & 63, b & 63
    c = np.int64(sc12[o + j - 4])
    return (b & 0xF) | ((c >> 6) << 4), (b >> 4) | ((a >> 6) << 4)


@njit(cache=True, inline="always")
def _pack_scales_k4(Ls, Lm, dst, o):
    """8 x (6-bit scale, 6-bit min) into the 12 bytes dst[o:o+12] (Q4_K / Q5_K)."""
    for j in range(8):
        ls = np.int64(Ls[j])
        lm = np.int64(Lm[j])
        if j < 4:
            dst[o + j] = ls
            dst[o + j + 4] = lm
        else:
            dst[o + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
            dst[o + j - 4] |= ((ls >> 4) << 6) & 0xFF
            dst[o + j] |= ((lm >> 4) << 6) & 0xFF


@njit(cache=True, inline="always")
def _requant_k4(x, xo, dst, o, d, dmin, nmax, L):
    """Second pass of Q4_K / Q5_K: L from the stored 6-bit scales and the f16 d / dmin."""
    for j in range(8):
        sc, m = _scale_min_k4(dst, o + 4, j)
        dd = d * np.float32(sc)
        if dd == _F0:
            continue
        dm = dmin * np.float32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((x[xo + 32 * j + ii] + dm) / dd)))


@njit(cache=True, inline="always")
def _q3_scale(dst, o, j):
    """signed 6-bit scale j of a Q3_K block (scales at dst[o:o+12])."""
    lo = (np.int64(dst[o + j]) & 0xF) if j < 8 else (np.int64(dst[o + j - 8]) >> 4)
    return (lo | (((np.int64(dst[o + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@njit(cache=True, inline="always")
def _finish_q3(x, xo, dst, o, L):
    """Q3_K second pass from the packed scales and d, then hmask + qs."""
    d = np.float32(h2f(np.int64(dst[o + 108]) | (np.int64(dst[o + 109]) << 8)))
    for j in range(16):
        dd = d * np.float32(_q3_scale(dst, o + 96, j))
        if dd == _F0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(x[xo + 16 * j + ii] / dd))) + 4
    for m in range(32):
        dst[o + m] = 0
    for j in range(QK_K):
        if L[j] > 3:
            dst[o + (j % 32)] |= (1 << (j // 32)) & 0xFF
            L[j] -= 4
    _pack_2bit(L, dst, o + 32)


@njit(cache=True, inline="always")
def _pack_q3_scales(ls, dst, o, j):
    """store 6-bit ls (already offset by 32) as Q3_K scale j in dst[o:o+12] (zeroed before)."""
    if j < 8:
        dst[o + j] = ls & 0xF
    else:
        dst[o + j - 8] |= ((ls & 0xF) << 4) & 0xFF
    dst[o + 8 + j % 4] |= ((ls >> 4) << (2 * (j // 4))) & 0xFF


@njit(cache=True, inline="always")
def _finish_q5(L, dst, o):
    for m in range(32):
        dst[o + 16 + m] = 0
    for g in range(4):
        m1 = 1 << (2 * g)
        m2 = 2 << (2 * g)
        for j in range(32):
            l1 = np.int64(L[64 * g + j])
            l2 = np.int64(L[64 * g + j + 32])
            if l1 > 15:
                l1 -= 16
                dst[o + 16 + j] |= m1
            if l2 > 15:
                l2 -= 16
                dst[o + 16 + j] |= m2
            dst[o + 48 + 32 * g + j] = (l1 | (l2 << 4)) & 0xFF


@njit(cache=True, inline="always")
def _finish_q6(x, xo, dst, o, d, L):
    for j in range(16):
        dd = d * np.float32(np.int8(dst[o + 192 + j]))
        if dd == _F0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(x[xo + 16 * j + ii] / dd))) + 32
    for h in range(2):
        j = 128 * h
        for l in range(32):
            q1 = np.int64(L[j + l])
            q2 = np.int64(L[j + l + 32])
            q3 = np.int64(L[j + l + 64])
            q4 = np.int64(L[j + l + 96])
            dst[o + 64 * h + l] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
            dst[o + 64 * h + l + 32] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
            dst[o + 128 + 32 * h + l] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4)
                                         | ((q4 >> 4) << 6)) & 0xFF


# ----------------------------------------------------------------------------------------------
# one super-block, reference path (no imatrix)
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def _q2_k_ref(x, xo, dst, o, L, Laux, w, scales, mins):
    max_scale = _F0
    max_min = _F0
    for j in range(16):
        for l in range(16):
            w[l] = abs(x[xo + 16 * j + l])
        s, m = make_qkx(16, 3, x[xo + 16 * j: xo + 16 * j + 16], w, L[16 * j: 16 * j + 16], Laux,
                        np.float32(-0.5), np.float32(0.1), 15, True)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    q4 = np.float32(15.0)
    if max_scale > _F0:
        iscale = q4 / max_scale
        for j in range(16):
            dst[o + j] = nearest_int(iscale * scales[j]) & 0xFF
        hd, d = _fp16_round(max_scale / q4)
    else:
        for j in range(16):
            dst[o + j] = 0
        hd, d = _fp16_round(_F0)
    if max_min > _F0:
        iscale = q4 / max_min
        for j in range(16):
            dst[o + j] |= (nearest_int(iscale * mins[j]) << 4) & 0xFF
        hm, dmin = _fp16_round(max_min / q4)
    else:
        hm, dmin = _fp16_round(_F0)
    wr_u16(dst, o + 80, hd)
    wr_u16(dst, o + 82, hm)
    _finish_q2(x, xo, dst, o, d, dmin, L)


@njit(cache=True, inline="always")
def _finish_q2(x, xo, dst, o, d, dmin, L):
    for j in range(16):
        sc = np.int64(dst[o + j])
        dd = d * np.float32(sc & 0xF)
        if dd == _F0:
            continue
        dm = dmin * np.float32(sc >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((x[xo + 16 * j + ii] + dm) / dd)))
    _pack_2bit(L, dst, o + 16)


@njit(cache=True)
def _q3_k_ref(x, xo, dst, o, L, scales):
    max_scale = _F0
    amax = _F0
    for j in range(16):
        s = make_q3(16, 4, x[xo + 16 * j: xo + 16 * j + 16], L[16 * j: 16 * j + 16])
        scales[j] = s
        if abs(s) > amax:
            amax = abs(s)
            max_scale = s
    for k in range(12):
        dst[o + 96 + k] = 0
    if max_scale != _F0:
        iscale = np.float32(-32.0) / max_scale
        for j in range(16):
            l = np.int8(nearest_int(iscale * scales[j]) & 0xFF)   # int8_t l = nearest_int(...)
            ls = max(-32, min(31, np.int64(l))) + 32
            _pack_q3_scales(ls, dst, o + 96, j)
        hd, _ = _fp16_round(np.float32(1.0) / iscale)
    else:
        hd, _ = _fp16_round(_F0)
    wr_u16(dst, o + 108, hd)
    _finish_q3(x, xo, dst, o, L)


@njit(cache=True)
def _q45_k_ref(nmax, x, xo, dst, o, L, Laux, w, scales, mins, Ls, Lm):
    rmin = np.float32(-1.0) if nmax == 15 else np.float32(-0.5)
    nstep = 20 if nmax == 15 else 15
    max_scale = _F0
    max_min = _F0
    for j in range(8):
        sum_x2 = _F0
        for l in range(32):
            v = x[xo + 32 * j + l]
            sum_x2 += v * v
        av_x = _sqrtf(sum_x2 / np.float32(32.0))
        for l in range(32):
            w[l] = av_x + abs(x[xo + 32 * j + l])
        s, m = make_qkx(32, nmax, x[xo + 32 * j: xo + 32 * j + 32], w, L[32 * j: 32 * j + 32], Laux,
                        rmin, np.float32(0.1), nstep, False)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    inv_scale = np.float32(63.0) / max_scale if max_scale > _F0 else _F0
    inv_min = np.float32(63.0) / max_min if max_min > _F0 else _F0
    for j in range(8):
        Ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        Lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
    _pack_scales_k4(Ls, Lm, dst, o + 4)
    hd, d = _fp16_round(max_scale / np.float32(63.0))
    hm, dmin = _fp16_round(max_min / np.float32(63.0))
    wr_u16(dst, o, hd)
    wr_u16(dst, o + 2, hm)
    _requant_k4(x, xo, dst, o, d, dmin, nmax, L)


@njit(cache=True, inline="always")
def _q6_from_scales(x, xo, dst, o, L, scales):
    max_scale = _F0
    max_abs = _F0
    for j in range(16):
        if abs(scales[j]) > max_abs:
            max_abs = abs(scales[j])
            max_scale = scales[j]
    if max_abs < _EPS:
        for k in range(210):
            dst[o + k] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    hd, d = _fp16_round(np.float32(1.0) / iscale)
    wr_u16(dst, o + 208, hd)
    for j in range(16):
        dst[o + 192 + j] = min(127, nearest_int(iscale * scales[j])) & 0xFF
    _finish_q6(x, xo, dst, o, d, L)


# ----------------------------------------------------------------------------------------------
# one super-block, importance-weighted path (qw: float32[QK_K] weights of this block's columns)
# ----------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _sum_x2(x, xo):
    s = _F0
    for l in range(QK_K):
        s += x[xo + l] * x[xo + l]
    return s


@njit(cache=True)
def _q2_k_imat(x, xo, qw, dst, o, L, Laux, w, scales, mins, sw, Ls, Lm):
    sigma2 = _sum_x2(x, xo) / np.float32(QK_K)
    for j in range(16):
        s = _F0
        for l in range(16):
            v = x[xo + 16 * j + l]
            w[l] = qw[16 * j + l] * _sqrtf(sigma2 + v * v)
            s += w[l]
        sw[j] = s
        scales[j], mins[j] = make_qkx(16, 3, x[xo + 16 * j: xo + 16 * j + 16], w, L[16 * j: 16 * j + 16],
                                      Laux, np.float32(-0.9), np.float32(0.05), 36, False)
    dm = make_qp(16, 15, scales, Ls, sw)
    mm = make_qp(16, 15, mins, Lm, sw)
    hd, d = _fp16_round(dm)
    hm, dmin = _fp16_round(mm)
    wr_u16(dst, o + 80, hd)
    wr_u16(dst, o + 82, hm)
    for j in range(16):
        dst[o + j] = (np.int64(Ls[j]) | (np.int64(Lm[j]) << 4)) & 0xFF
    _finish_q2(x, xo, dst, o, d, dmin, L)


@njit(cache=True)
def _q3_k_imat(x, xo, qw, dst, o, L, w, scales, sw, Lq):
    sigma2 = np.float32(2.0) * _sum_x2(x, xo) / np.float32(QK_K)
    for j in range(16):
        s = _F0
        for l in range(16):
            v = x[xo + 16 * j + l]
            w[l] = qw[16 * j + l] * _sqrtf(sigma2 + v * v)
            s += w[l]
        sw[j] = s
        scales[j] = make_qx(16, 4, x[xo + 16 * j: xo + 16 * j + 16], L[16 * j: 16 * j + 16], w)
    for k in range(12):
        dst[o + 96 + k] = 0
    d_block = make_qx(16, 32, scales, Lq, sw)
    for j in range(16):
        _pack_q3_scales(np.int64(Lq[j]), dst, o + 96, j)
    hd, _ = _fp16_round(d_block)
    wr_u16(dst, o + 108, hd)
    _finish_q3(x, xo, dst, o, L)


@njit(cache=True)
def _q45_k_imat(nmax, x, xo, qw, dst, o, L, Laux, w, scales, mins, sw, Ls, Lm):
    sigma2 = np.float32(2.0) * _sum_x2(x, xo) / np.float32(QK_K)
    for j in range(8):
        s = _F0
        for l in range(32):
            v = x[xo + 32 * j + l]
            w[l] = qw[32 * j + l] * _sqrtf(sigma2 + v * v)
            s += w[l]
        sw[j] = s
        scales[j], mins[j] = make_qkx(32, nmax, x[xo + 32 * j: xo + 32 * j + 32], w, L[32 * j: 32 * j + 32],
                                      Laux, np.float32(-0.9), np.float32(0.05), 36, False)
    d_block = make_qp(8, 63, scales, Ls, sw)
    m_block = make_qp(8, 63, mins, Lm, sw)
    _pack_scales_k4(Ls, Lm, dst, o + 4)
    hd, d = _fp16_round(d_block)
    hm, dmin = _fp16_round(m_block)
    wr_u16(dst, o, hd)
    wr_u16(dst, o + 2, hm)
    _requant_k4(x, xo, dst, o, d, dmin, nmax, L)


# ----------------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def quantize_row_k(kind, x, qw, dst):
    """Quantize one float32 row (length a multiple of QK_K) into dst (uint8[row bytes]).
    qw: float32[len(x)] importance weights (llama-quantize's imatrix path) or an empty array."""
    imat = qw.shape[0] > 0
    L = np.zeros(QK_K, np.int8)
    Lu = np.zeros(QK_K, np.uint8)
    Laux = np.zeros(32, np.uint8)
    w = np.zeros(32, np.float32)
    scales = np.zeros(16, np.float32)
    mins = np.zeros(16, np.float32)
    sw = np.zeros(16, np.float32)
    Ls = np.zeros(16, np.uint8)
    Lm = np.zeros(16, np.uint8)
    Lq = np.zeros(16, np.int8)
    empty = np.zeros(0, np.float32)
    for b in range(x.shape[0] // QK_K):
        xo = QK_K * b
        bq = qw[xo: xo + QK_K] if imat else empty
        if kind == Q2_K:
            if imat:
                _q2_k_imat(x, xo, bq, dst, 84 * b, Lu, Laux, w, scales, mins, sw, Ls, Lm)
            else:
                _q2_k_ref(x, xo, dst, 84 * b, Lu, Laux, w, scales, mins)
        elif kind == Q3_K:
            if imat:
                _q3_k_imat(x, xo, bq, dst, 110 * b, L, w, scales, sw, Lq)
            else:
                _q3_k_ref(x, xo, dst, 110 * b, L, scales)
        elif kind == Q4_K or kind == Q5_K:
            nmax = 15 if kind == Q4_K else 31
            o = (144 if kind == Q4_K else 176) * b
            if imat:
                _q45_k_imat(nmax, x, xo, bq, dst, o, Lu, Laux, w, scales, mins, sw, Ls, Lm)
            else:
                _q45_k_ref(nmax, x, xo, dst, o, Lu, Laux, w, scales, mins, Ls, Lm)
            if kind == Q4_K:
                for g in range(4):
                    for l in range(32):
                        dst[o + 16 + 32 * g + l] = (np.int64(Lu[64 * g + l]) | (np.int64(Lu[64 * g + l + 32]) << 4)) & 0xFF
            else:
                _finish_q5(Lu, dst, o)
        elif kind == Q6_K:
            for j in range(16):
                scales[j] = make_qx(16, 32, x[xo + 16 * j: xo + 16 * j + 16], L[16 * j: 16 * j + 16],
                                    bq[16 * j: 16 * j + 16] if imat else empty)
            _q6_from_scales(x, xo, dst, 210 * b, L, scales)


@njit(cache=True, parallel=True)
def quantize_rows_k(kind, X, qw, dst):
    """X float32[rows, cols] -> dst uint8[rows, cols/256 * block bytes]; qw float32[cols] or empty."""
    for r in prange(X.shape[0]):
        quantize_row_k(kind, X[r], qw, dst[r])


# ----------------------------------------------------------------------------------------------
# legacy 32-blocks with an importance matrix (quantize_row_q4_0_impl ... q5_1_impl); without one
# llama.cpp uses the _ref quantizers, which pykv.kernels.kvquant already matches
# ----------------------------------------------------------------------------------------------

@njit(cache=True)
def quantize_row_legacy_imat(kind, x, qw, dst):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 row with importance weights qw float32[len(x)]."""
    n = x.shape[0]
    sum_x2 = _F0
    for j in range(n):
        sum_x2 += x[j] * x[j]
    sigma2 = sum_x2 / np.float32(n)
    w = np.zeros(32, np.float32)
    L = np.zeros(32, np.int8)
    Lu = np.zeros(32, np.uint8)
    Laux = np.zeros(32, np.uint8)
    bs = 18 if kind == Q4_0 else 20 if kind == Q4_1 else 22 if kind == Q5_0 else 24
    asym = kind == Q4_1 or kind == Q5_1
    for ib in range(n // 32):
        xb = x[32 * ib: 32 * ib + 32]
        o = bs * ib
        for j in range(32):
            w[j] = qw[32 * ib + j] * _sqrtf(sigma2 + xb[j] * xb[j])
        if asym:
            d, the_min = make_qkx(32, 15 if kind == Q4_1 else 31, xb, w, Lu, Laux,
                                  np.float32(-0.9), np.float32(0.05), 36, False)
            wr_u16(dst, o, f32_to_f16_bits(d))
            wr_u16(dst, o + 2, f32_to_f16_bits(-the_min))
            for j in range(32):
                L[j] = Lu[j]
        else:
            d = make_qx(32, 8 if kind == Q4_0 else 16, xb, L, w)
            wr_u16(dst, o, f32_to_f16_bits(d))
        qo = o + (2 if kind == Q4_0 else 4)
        if kind == Q5_0 or kind == Q5_1:
            qh = np.int64(0)
            for j in range(16):
                qh |= ((np.int64(L[j]) & 0x10) >> 4) << j
                qh |= ((np.int64(L[j + 16]) & 0x10) >> 4) << (j + 16)
            hb = o + (2 if kind == Q5_0 else 4)
            for k in range(4):
                dst[hb + k] = (qh >> (8 * k)) & 0xFF
            qo = hb + 4
        for j in range(16):
            dst[qo + j] = ((np.int64(L[j]) & 0xF) | ((np.int64(L[j + 16]) & 0xF) << 4)) & 0xFF


@njit(cache=True, parallel=True)
def quantize_rows_legacy_imat(kind, X, qw, dst):
    for r in prange(X.shape[0]):
        quantize_row_legacy_imat(kind, X[r], qw, dst[r])
