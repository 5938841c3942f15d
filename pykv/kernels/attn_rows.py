"""Attention's scores and value sums over one segment of key / value rows, for blocks of a few query
rows (every decode work item; attention._item calls them, the prefill's bigger blocks take its GEMM
micro-tiles).  simd.qk_rows / pv_rows keep up to 3 rows x QK_KG keys of partial sums (3 rows x PV_NV
vectors of output channels) in registers, VW float lanes each (the host's vectors: 16 on AVX-512, 8
else), reading f16 rows (an f16 pool, the sinks, the ring) in place or the f32 tile another format was
decoded into.  The loops here only pick the calls: rows in threes, then the last one or two; keys in
QK_KG, then one at a time; output channels in PV_NV * VW, then VW at a time.  qk can prefetch a later
segment's key rows meanwhile, a key group's worth with each group (pf_rows)."""
from numba import njit

from pykv.kernels.simd import prefetch, pv_rows, qk_rows
from pykv.kernels.tiles import L as VW

QK_KG = 8 if VW == 16 else 4      # keys per qk_rows call (3 rows x QK_KG accumulators in registers)
PV_NV = 4 if VW == 16 else 2      # vectors of columns per pv_rows call (3 x PV_NV accumulators)
_QKa, _QKb, _QKc = (qk_rows(rb, QK_KG, VW) for rb in (1, 2, 3))    # 1, 2, 3 rows x QK_KG keys
_QK1a, _QK1b, _QK1c = (qk_rows(rb, 1, VW) for rb in (1, 2, 3))      # x one key (a segment's last keys)
_PVa, _PVb, _PVc = (pv_rows(rb, PV_NV, VW) for rb in (1, 2, 3))     # 1, 2, 3 rows x PV_NV vectors
_PV1a, _PV1b, _PV1c = (pv_rows(rb, 1, VW) for rb in (1, 2, 3))      # x one vector (HD's rest)


@njit(cache=True, nogil=True, inline="always")
def pf_rows(kp, ko, rk, vp, vo, rv, a, b):
    """Prefetch rows a .. b-1 of a later segment: key rows at byte ko + r * rk of kp (rk 0: none), value
    rows at vo + r * rv of vp (rv 0: none)."""
    if rk > 0:
        for o in range((ko + a * rk) // 64 * 64, ko + b * rk, 64):
            prefetch(kp, o)
    if rv > 0:
        for o in range((vo + a * rv) // 64 * 64, vo + b * rv, 64):
            prefetch(vp, o)


@njit(cache=True, nogil=True)
def qk(qb, R, src, so, rb, n, s, kp, ko, rk, pn):
    """s[x, r] = qb[x] . key r for x < R, r < n; key r's row at byte so + r * rb of src (uint8: f16 rows,
    float32: the f32 tile).  HD a multiple of VW.  Meanwhile the key rows 0 .. pn-1 of a later segment
    (pf_rows' kp, ko, rk; pn 0: none) are prefetched, a key group's rows with each group: spread over the
    pass, not one burst that fills the core's miss queue."""
    r = 0
    pd = 0                  # rows of the later segment prefetched so far
    while r < n:
        o = so + r * rb
        if pd < pn:
            b = min(pn, r + QK_KG)
            pf_rows(kp, ko, rk, kp, 0, 0, pd, b)
            pd = b
        if r + QK_KG <= n:
            x = 0
            while x + 3 <= R:
                _QKc(qb, x, src, o, rb, s, r)
                x += 3
            if R - x == 2:
                _QKb(qb, x, src, o, rb, s, r)
            elif R - x == 1:
                _QKa(qb, x, src, o, rb, s, r)
            r += QK_KG
        else:
            x = 0
            while x + 3 <= R:
                _QK1c(qb, x, src, o, rb, s, r)
                x += 3
            if R - x == 2:
                _QK1b(qb, x, src, o, rb, s, r)
            elif R - x == 1:
                _QK1a(qb, x, src, o, rb, s, r)
            r += 1
    if pd < pn:
        pf_rows(kp, ko, rk, kp, 0, 0, pd, pn)


@njit(cache=True, nogil=True)
def pv(s, x0, R, src, so, rb, n, acc):
    """acc[x, :] += sum_{r < n} s[x, r] * value r for x0 <= x < R; value r's row at byte so + r * rb of
    src (uint8: f16 rows, float32: the f32 tile).  HD a multiple of VW."""
    HD = acc.shape[1]
    c = 0
    while c < HD:
        wide = c + PV_NV * VW <= HD
        x = x0
        while x + 3 <= R:
            if wide:
                _PVc(s, x, src, so, rb, n, acc, c)
            else:
                _PV1c(s, x, src, so, rb, n, acc, c)
            x += 3
        if R - x == 2:
            if wide:
                _PVb(s, x, src, so, rb, n, acc, c)
            else:
                _PV1b(s, x, src, so, rb, n, acc, c)
        elif R - x == 1:
            if wide:
                _PVa(s, x, src, so, rb, n, acc, c)
            else:
                _PV1a(s, x, src, so, rb, n, acc, c)
        c += PV_NV * VW if wide else VW
