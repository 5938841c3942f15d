"""Fused attention over the paged, block-quantized KV cache (CPU).

Flash-attention style tiles.  A work item is (KV head g, chunk c of keys, block of query tokens); its
query rows are the TB query tokens x G = H/KVH heads that share the KV head (decode: TB = 1, so the
G heads).  Keys are walked in segments of at most TILE tokens that stay inside one page (and on one
side of the quantized / f16-residual boundary).  Per segment:

  1. the segment's K rows are decoded ONCE into a small f32 tile (L1-resident, TILE x HD) by
     kernels.blocks.deq_rows (one format dispatch per segment, not per row), through _deq: deq_rows
     built with this module's fast-math flags, one function called from every tile site;
  2. scores s[row, r] = dot(q[row], K[r]) for every query row (the decode work is shared by the
     G heads and, in prefill, by the TB query tokens);
  3. online softmax per query row, rescaling (m, l, acc) once per segment, p = exp(s - m) by a
     vectorizable exp;
  4. the V rows are decoded once into a tile and acc[row] += sum_r p[row, r] * V[r].
A prefill's blocks of TB x G >= 8 rows run 2 and 4 as register-blocked GEMM micro-tiles (simd.gemm_tile:
the outputs of 4 keys x 24 rows, or 4 rows x 16 channels, in registers over the inner loop) instead of
the dot-per-row loops (_scores_mk / _accum_mk, in _item's prefill specialization only).
Smaller blocks (every decode item) run 2 and 4 through kernels.attn_rows (simd.qk_rows / pv_rows): 3 rows
x 8 keys of partial sums (3 rows x 64 output channels; half that with 8-lane vectors) in registers, the
keys' lane sums folded together instead of one horizontal sum per key; f16 rows (the sinks, the ring,
an f16 pool) are read in place by them, with no tile in between.
q8_0 pool rows skip the tiles too (kernels.kvdot reads them in place): 1 + 2 become exact int32 dots
of the int8 keys with the query rows' int16 form (_quant_q16, once per work item), and 4 adds each V
row's int8 values, made float once, to the G rows with weight p * d (the block scale folded in).

Partials (m, l, acc) go to `part`; a second pass merges the chunks with log-sum-exp weights.
Each work item's few small tiles (~10 KB) live in its own stack frame (simd.stack_array), each its own
slot: no malloc / free per item, and LLVM knows they alias nothing (views of one shared buffer would
get alias checks in the tile loops).  Blocks too big for the slots (a prefill's many rows, head_dim
over S_HD) take np.empty instead.
f16 (the residual rows, f16 caches and every f16 block scale) is decoded with the hardware half ->
float conversion (`fpext half`, vcvtph2ps on x86), which vectorizes; the cache itself is never
dequantized to memory beyond one tile.

Pools (one per layer, K and V):  uint8[KVH, n_pages, P * row_bytes]  (token-major rows in a page;
    head-major pages, so one head's pages are one stream for the hardware prefetcher)
    KIVI keys instead hold one per-channel-quantized page per (g, page): uint8[KVH, n_pages, page_bytes]
Residual (KIVI types and the token-adaptive window): uint8[KVH, RING, rb] f16 rows (rb = 2 * HD) of the
    newest tokens, or q8_0 rows (rb = HD / 32 * 34) for a q8_0 window.

Pre-RoPE keys (kx non-empty, kv_cache's k_pre): the stored keys are (k - shift) / scale of the key BEFORE
RoPE, Hadamard-rotated; each decoded K tile is mapped back (inverse rotation, * scale + shift) and roped
at its positions before the scores, so the queries are plain roped queries (KVQuant's pre-RoPE keys:
the per-channel statistics of unroped keys are stable, those of roped keys are smeared by position).

deq_rows (blocks.py, inside _deq) and the kvdot intrinsics are inlined here: Numba's cache folder is named by
a hash of every kernel source (kernels/__init__.py), so an edit there recompiles this module too.
"""
import re

import numpy as np
from numba import errors, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pykv.files.formats import CODE_IQ4_NL, CODE_NL4, CODE_Q8_0
from pykv.kernels import folder_lock
from pykv.kernels.blocks import deq_kivi_k_rows, deq_rows
from pykv.kernels.kvdot import UNIT, accum_q8_0_1, accum_q8_0_3, scores_q8_0_1, scores_q8_0_3
from pykv.kernels.ops import _fwht_vec, _rope_vec, exp_neg
from pykv.kernels.attn_rows import VW, pf_rows, pv as _pv, qk as _qk
from pykv.kernels.simd import bits_f32, gemm_tile, stack_array

TILE = 32          # keys per segment (the f32 K and V tiles: TILE x HD floats each)
PF_AHEAD = 2       # segments ahead whose pool rows are prefetched
QBLOCK = 8         # query tokens per work item in prefill
_Z = np.int64(0)    # a constant int64 argument (a literal 0 would compile a second _item / merge_row)
SERIAL_KEYS = 384  # decode steps with at most this many (keys x KV heads) run on the calling thread
CHUNK_MIN = 256    # keys a decode work item takes at least (KVCache.chunk_for; a batched step: fewer, longer items)
_FM = {"reassoc", "contract", "nsz", "arcp"}   # no nnan / ninf: -inf is a real state here
S_ROWS = 16        # a work item's scratch is in its stack frame up to S_ROWS query rows and head_dim S_HD
                   # (~90 KB of stack a work item: thread stacks are MBs)
S_HD = 128
CAP_Q = S_ROWS * S_HD   # (the stack arrays' capacities: literal constants)
CAP_T = TILE * S_HD
CAP_S = S_ROWS * TILE
CAP_D = S_ROWS * S_HD // 32
_f1 = stack_array(types.float32, 1)
_f2 = stack_array(types.float32, 2)
_i1 = stack_array(types.int64, 1)
_h2 = stack_array(types.int16, 2)


# ----------------------------------------------------------------------------------------------
# scalar helpers
# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# tile math.  Short loops (HD = 64) are dominated by per-loop-entry costs (horizontal reductions,
# runtime alias checks), so both work on 4 / 8 keys per loop entry.
# ----------------------------------------------------------------------------------------------

@njit(cache=True, fastmath=_FM, inline="always")
def _scores(qx, kt, n, sx):
    """sx[r] = dot(qx, kt[r]) for r < n: four keys per pass over qx (4 independent reductions)."""
    HD = qx.shape[0]
    r = 0
    while r + 4 <= n:
        k0 = kt[r]
        k1 = kt[r + 1]
        k2 = kt[r + 2]
        k3 = kt[r + 3]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for i in range(HD):
            qv = qx[i]
            a0 += qv * k0[i]
            a1 += qv * k1[i]
            a2 += qv * k2[i]
            a3 += qv * k3[i]
        sx[r] = a0
        sx[r + 1] = a1
        sx[r + 2] = a2
        sx[r + 3] = a3
        r += 4
    while r < n:
        k0 = kt[r]
        a0 = np.float32(0.0)
        for i in range(HD):
            a0 += qx[i] * k0[i]
        sx[r] = a0
        r += 1


@njit(cache=True, fastmath=_FM, inline="always")
def _scores3(q0, q1, q2, kt, n, s0, s1, s2):
    """_scores for three query rows at once: each K row is loaded once for the three (two keys x
    three rows = six independent reductions per pass)."""
    HD = q0.shape[0]
    r = 0
    while r + 2 <= n:
        k0 = kt[r]
        k1 = kt[r + 1]
        a00 = np.float32(0.0)
        a01 = np.float32(0.0)
        a10 = np.float32(0.0)
        a11 = np.float32(0.0)
        a20 = np.float32(0.0)
        a21 = np.float32(0.0)
        for i in range(HD):
            u = k0[i]
            w = k1[i]
            a00 += q0[i] * u
            a01 += q0[i] * w
            a10 += q1[i] * u
            a11 += q1[i] * w
            a20 += q2[i] * u
            a21 += q2[i] * w
        s0[r] = a00
        s0[r + 1] = a01
        s1[r] = a10
        s1[r + 1] = a11
        s2[r] = a20
        s2[r + 1] = a21
        r += 2
    while r < n:
        k0 = kt[r]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for i in range(HD):
            a0 += q0[i] * k0[i]
            a1 += q1[i] * k0[i]
            a2 += q2[i] * k0[i]
        s0[r] = a0
        s1[r] = a1
        s2[r] = a2
        r += 1


@njit(cache=True, fastmath=_FM, inline="always")
def _accum(px, vt, n, ax):
    """ax += sum_r px[r] * vt[r] for r < n: four keys per pass over ax (one load/store of ax), summed
    in _accum2's order."""
    HD = ax.shape[0]
    r = 0
    while r + 4 <= n:
        p0 = px[r]
        p1 = px[r + 1]
        p2 = px[r + 2]
        p3 = px[r + 3]
        v0 = vt[r]
        v1 = vt[r + 1]
        v2 = vt[r + 2]
        v3 = vt[r + 3]
        for i in range(HD):
            ax[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])
        r += 4
    while r < n:
        p0 = px[r]
        v0 = vt[r]
        for i in range(HD):
            ax[i] += p0 * v0[i]
        r += 1


@njit(cache=True, fastmath=_FM, inline="always")
def _accum2(p0, p1, vt, n, a0, a1):
    """_accum for two query rows at once: each V row is loaded once for both."""
    HD = a0.shape[0]
    r = 0
    while r + 4 <= n:
        x0 = p0[r]
        x1 = p0[r + 1]
        x2 = p0[r + 2]
        x3 = p0[r + 3]
        y0 = p1[r]
        y1 = p1[r + 1]
        y2 = p1[r + 2]
        y3 = p1[r + 3]
        v0 = vt[r]
        v1 = vt[r + 1]
        v2 = vt[r + 2]
        v3 = vt[r + 3]
        for i in range(HD):
            u0 = v0[i]
            u1 = v1[i]
            u2 = v2[i]
            u3 = v3[i]
            a0[i] += (x0 * u0 + x1 * u1) + (x2 * u2 + x3 * u3)
            a1[i] += (y0 * u0 + y1 * u1) + (y2 * u2 + y3 * u3)
        r += 4
    while r < n:
        v0 = vt[r]
        x0 = p0[r]
        y0 = p1[r]
        for i in range(HD):
            a0[i] += x0 * v0[i]
            a1[i] += y0 * v0[i]
        r += 1


# GEMM micro-tiles for the blocks of many query rows of a prefill (TB x G rows).  The
# scores are computed transposed, sT[r, x] = K[r] . q[x] (4 keys x 24 / 16 / 8 rows a call), and the
# output as acc[x, :] += sum_r sT[r, x] V[r, :] (4 rows x 16 columns a call), each with its outputs in
# registers (simd.gemm_tile), which is faster than _scores3 / _accum2 on these blocks.
_S24 = gemm_tile(4, 24, False)
_S16 = gemm_tile(4, 16, False)
_S8 = gemm_tile(4, 8, False)
_PV = gemm_tile(4, 16, True)


@njit(cache=True, nogil=True, fastmath=_FM)
def _scores_mk(kt, n, qbT, sT, R, s):
    """s[x, r] = dot(kt[r], qbT[:, x]) for r < n, x < R, through sT[r, x] (r < n rounded up to 4; kt, sT:
    TILE rows; every x < qbT.shape[1], a multiple of 8), then transposed into s (the softmax reads
    contiguous rows)."""
    HD = kt.shape[1]
    Rp = qbT.shape[1]
    for r in range(0, n, 4):
        c = 0
        while c + 24 <= Rp:
            _S24(kt, HD, 1, qbT, sT, r, c, HD)
            c += 24
        if c + 16 <= Rp:
            _S16(kt, HD, 1, qbT, sT, r, c, HD)
            c += 16
        if c < Rp:
            _S8(kt, HD, 1, qbT, sT, r, c, HD)
    for x in range(R):
        for r in range(n):
            s[x, r] = sT[r, x]


@njit(cache=True, nogil=True, fastmath=_FM)
def _accum_mk(s, n, vt, acc, x0, Rp):
    """acc[x, :] += sum_{r < n} s[x, r] * vt[r, :] for x0 <= x < Rp (x0 % 4 == 0, Rp % 4 == 0, HD % 16 == 0)."""
    HD = vt.shape[1]
    for x in range(x0, Rp, 4):
        for c in range(0, HD, 16):
            _PV(s, s.shape[1], 1, vt, acc, x, c, n)


# ----------------------------------------------------------------------------------------------
# one work item
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=_FM)
def _deq(code, src, o0, rb, n, out):
    """blocks.deq_rows built once with this module's fast-math flags and called, not inlined, from
    _item's eight tile sites: inlined at each, its format switch made attend very slow to compile."""
    deq_rows(code, src, o0, rb, n, out)


@njit(cache=True, nogil=True, fastmath=_FM)
def _quant_q16(qb, xq, xd):
    """The query rows qb (R, HD) as int16 blocks of 32 for kvdot's scores: xq = rint(qb / xd) with
    xd = amax / 32767 per block (xq with no columns: nothing to do).  16 bits, not llama.cpp's 8-bit
    q8_0 query: the int dot against the int8 keys is still exact, and the query's rounding (2**-16 of
    its block's amax) moves sharp attention far less than an 8-bit query's."""
    for x in range(xq.shape[0]):
        for b in range(xq.shape[1] // 32):
            amax = np.float32(0.0)
            for i in range(32 * b, 32 * b + 32):
                amax = max(amax, abs(qb[x, i]))
            d = amax / np.float32(32767.0)
            idd = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            xd[x, b] = d
            for i in range(32 * b, 32 * b + 32):
                xq[x, i] = np.int16(np.rint(qb[x, i] * idd))


@njit(cache=True, nogil=True, fastmath=_FM)
def _unpre(kt, n, j, g, KVH, kx, cos, sin):
    """Pre-RoPE keys kt[:n] (KV head g, positions j..) back to roped keys in place: inverse rotation,
    * scale + shift, RoPE at each row's position (see attend's kx)."""
    HD = kt.shape[1]
    for r in range(n):
        kv = kt[r]
        if kx.shape[0] > 2 * KVH:
            _fwht_vec(kv, kx[2 * KVH], True)
        for i in range(HD):
            kv[i] = kv[i] * kx[KVH + g, i] + kx[g, i]
        _rope_vec(kv, j + r, cos, sin, 2 * cos.shape[1])


@njit(cache=True, inline="always")
def _ring_code(width, HD, rcode):
    """The format of ring rows `width` bytes wide: f16 (rcode, the sinks' and KIVI's), or the
    token-adaptive window's --kv-window-type (kv.cache.WINDOW_TYPES: q8_0, iq4_nl, nl4)."""
    if width == 2 * HD:
        return rcode
    if width == HD // 32 * 34:
        return CODE_Q8_0
    if width == HD // 32 * 18:
        return CODE_IQ4_NL
    return CODE_NL4


@njit(cache=True, nogil=True, inline="always")
def _seg_rows(page_table, f, j1, P, rbk, rbv, nq_k, nq_v, kbits):
    """The pool rows of keys f .. (to the end of f's page, j1, or TILE keys), for attn_rows.pf_rows: (page,
    keys n, key byte offset, key row bytes, value offset, value row bytes); row bytes 0 where they are
    not pool rows (f >= nq_k / nq_v; KIVI keys)."""
    pg = page_table[f // P]
    s = f - (f // P) * P
    n = min(j1 - f, P - s, TILE)
    return pg, n, s * rbk, (rbk if f < nq_k and kbits == 0 else 0), s * rbv, (rbv if f < nq_v else 0)


@njit(cache=True, nogil=True, inline="always")
def _fetch_segment(kpool, vpool, page_table, g, f, j1, P, rbk, rbv, nq_k, nq_v, kbits):
    """Prefetch KV head g's segment from key f (_seg_rows) in one burst; returns how many keys it holds."""
    pg, n, ko, rk, vo, rv = _seg_rows(page_table, f, j1, P, rbk, rbv, nq_k, nq_v, kbits)
    pf_rows(kpool[g, pg], ko, rk, vpool[g, pg], vo, rv, 0, n)
    return n


@njit(cache=True, nogil=True, fastmath=_FM)
def _item(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv, P,
          kcode, kbits, vcode, rcode, g, t0, t1, j0, j1, part, c, kx, cos, sin, npt, ng, nj0, nj1, mt):
    """Keys [j0, j1) (already clipped to the causal end of query t1 - 1) for query tokens [t0, t1) and
    the G heads of KV head g; (m, l, acc) per query row -> part[t, g, c, gi].
    wk > 0 (wv > 0): token-adaptive window, row x reads key (value) j from the f16 ring when
    j >= lim[x] - wk, else from the pool: every query of a prefill batch sees what its own decode
    step would.  Only the <= QBLOCK keys where the rows disagree decode both tiles (kt2 / vt2).
    kx (see attend): the pre-RoPE key transform (applied to every decoded K tile: sink, ring, pool),
    or no rows.  npt, ng, nj0, nj1: the work item its thread runs next (keys nj0 .. nj1 of KV head ng through
    page table npt; nj1 <= nj0: none), whose first segments this item's last ones prefetch: the thread's
    stream of pool rows goes on between items.  The segment PF_AHEAD - 1 after the next one is fetched
    meanwhile: its keys at the top of the segment (on f16 rows read in place, kdir: a group at a time in
    _qk's pass, so the core does not wait on a full miss queue as it did on a burst of 64 lines), its
    values before this one's V.  mt (a literal: one specialization each): the GEMM micro-tiles (_scores_mk / _accum_mk)
    may run, for >= 8 rows on float K and V tiles without a window (prefill); decode passes False, and
    its specialization holds none of their code (which slowed decode down)."""
    H, HD = q.shape[1], q.shape[2]
    KVH = kpool.shape[0]
    G = H // KVH
    TB = t1 - t0
    R = TB * G
    # scratch in the stack frame where it fits (a decode item: no malloc / free, and the optimizer knows
    # the tiles alias nothing), else on the heap (a prefill's bigger blocks)
    qb = _f2(CAP_Q, R, HD) if R * HD <= CAP_Q else np.empty((R, HD), np.float32)
    gm = mt and R >= 8 and HD % 16 == 0 and vcode != CODE_Q8_0 and wk == 0 and wv == 0
    vec = HD % VW == 0                   # scores / values by _qk / _pv (else the loops below)
    Rp = (R + 7) // 8 * 8 if gm else 0
    qbT = np.zeros((HD, Rp), np.float32) if Rp > 0 else _f2(1, HD, 0)  # the query rows transposed, zero past R
    sT = np.empty((TILE, Rp), np.float32) if Rp > 0 else _f2(1, TILE, 0)
    R2 = max(R, Rp)
    acc = _f2(CAP_Q, R2, HD) if R2 * HD <= CAP_Q else np.empty((R2, HD), np.float32)
    acc[:] = 0.0                         # rows R.. (and s's): the micro-tiles' padding, zero
    mrow = _f1(S_ROWS, R) if R <= S_ROWS else np.empty(R, np.float32)
    mrow[:] = -np.inf
    lrow = _f1(S_ROWS, R) if R <= S_ROWS else np.empty(R, np.float32)
    lrow[:] = 0.0
    lim = _i1(S_ROWS, R) if R <= S_ROWS else np.empty(R, np.int64)          # row x sees keys j < lim[x]
    s = _f2(CAP_S, R2, TILE) if R2 <= S_ROWS else np.empty((R2, TILE), np.float32)
    s[R:] = 0.0
    small = HD <= S_HD
    kt = _f2(CAP_T, TILE, HD) if small else np.empty((TILE, HD), np.float32)
    vt = _f2(CAP_T, TILE, HD) if small else np.empty((TILE, HD), np.float32)
    win = wk > 0 or wv > 0                      # the f16 rows of a segment the rows disagree on
    nw = TILE if win else 0
    kt2 = _f2(CAP_T, nw, HD) if small else np.empty((nw, HD), np.float32)
    vt2 = _f2(CAP_T, nw, HD) if small else np.empty((nw, HD), np.float32)
    dk = _f1(S_HD, HD) if small else np.empty(HD, np.float32)
    mk = _f1(S_HD, HD) if small else np.empty(HD, np.float32)
    for tb in range(TB):
        for gi in range(G):
            x = tb * G + gi
            lim[x] = n_past + t0 + tb + 1
            for i in range(HD):
                qb[x, i] = q[t0 + tb, g * G + gi, i]
                if gm:
                    qbT[i, x] = qb[x, i]
    # q8_0 pool rows are read in place by kvdot (see the module doc); pre-RoPE keys need a K tile
    kq8 = kcode == CODE_Q8_0 and kbits == 0 and kx.shape[0] == 0 and HD % UNIT == 0
    vq8 = vcode == CODE_Q8_0
    nx = HD if kq8 else 0
    xq = _h2(CAP_Q, R, nx) if R * nx <= CAP_Q else np.empty((R, nx), np.int16)
    xd = _f2(CAP_D, R, nx // 32) if R * nx <= CAP_Q else np.empty((R, nx // 32), np.float32)
    _quant_q16(qb, xq, xd)
    rbk = kpool.shape[2] // P
    rbv = vpool.shape[2] // P
    rbr = ksink.shape[2]                         # f16 sink rows (2 * HD bytes)
    rbk_r = kres.shape[2]                        # ring rows: f16 (2 * HD bytes) or, for the window's
    rbv_r = vres.shape[2]                        # narrower rows of --kv-window-type (_ring_code)
    rck = _ring_code(rbk_r, HD, rcode)
    rcv = _ring_code(rbv_r, HD, rcode)
    RING = kres.shape[1]                         # residual rows: a ring (token j -> j % RING)
    RINGV = vres.shape[1]
    NS = ksink.shape[1]
    wlo_k = n_past + t0 + 1 - wk                 # window: keys below wlo are pool rows for every
    whi_k = n_past + t1 - wk                     # row, keys from whi on ring rows for every row
    wlo_v = n_past + t0 + 1 - wv
    whi_v = n_past + t1 - wv
    f = j0          # this item's first PF_AHEAD segments' pool rows, fetched together (not a miss at a time)
    while f < j0 + TILE * PF_AHEAD and f < j1 and (f < nq_k or f < nq_v):
        f += _fetch_segment(kpool, vpool, page_table, g, f, j1, P, rbk, rbv, nq_k, nq_v, kbits)
    j = j0
    nf = nj0        # the next item's keys prefetched so far
    while j < j1:
        pg = j // P
        sp = j - pg * P                              # slot in the page
        e = min(j1, (pg + 1) * P, j + TILE)
        if j < nq_k:
            e = min(e, nq_k)
        if j < nq_v:
            e = min(e, nq_v)
        if j < ns_k:
            e = min(e, ns_k)
        if j < ns_v:
            e = min(e, ns_v)
        if wk > 0:
            if j < wlo_k:
                e = min(e, wlo_k)
            elif j < whi_k:
                e = min(e, whi_k)
        if wv > 0:
            if j < wlo_v:
                e = min(e, wlo_v)
            elif j < whi_v:
                e = min(e, whi_v)
        if j >= nq_k or wk > 0:                      # the ring rows of a segment do not wrap
            e = min(e, (j // RING + 1) * RING)
        if j >= nq_v or wv > 0:
            e = min(e, (j // RINGV + 1) * RINGV)
        n = e - j
        kmix = False
        vmix = False
        kint = False
        vint = False
        xlo = 0                                      # rows below xlo see none of the segment
        while xlo < R - 1 and lim[xlo] <= j:
            xlo += 1
        page = page_table[pg] if (j < nq_k or j < nq_v) else 0
        # ---- K: f16 rows (sinks, ring, an f16 pool) are read in place (kdir), others through the tile kt
        if j < ns_k:                                 # attention-sink tokens: exact f16 copies
            ksrc = ksink[g].reshape(NS * rbr)
            ko, krb, kc = j * rbr, rbr, rcode
        elif j >= nq_k or (wk > 0 and j >= whi_k):
            ksrc = kres[g].reshape(RING * rbk_r)
            ko, krb, kc = (j % RING) * rbk_r, rbk_r, rck
        else:                                        # (an f16 pool has no window and no KIVI bits)
            ksrc = kpool[g, page]
            ko, krb, kc = sp * rbk, rbk, kcode
        kdir = vec and not gm and kx.shape[0] == 0 and kc == rcode
        # a later segment's pool rows, fetched meanwhile (see the doc): this item's, or past its end the
        # first segments of the next item
        f = e + TILE * (PF_AHEAD - 1)
        pn, pko, prk, pvo, prv, ppg, pgh = 0, 0, 0, 0, 0, 0, g
        if f < j1 and (f < nq_k or f < nq_v):
            ppg, pn, pko, prk, pvo, prv = _seg_rows(page_table, f, j1, P, rbk, rbv, nq_k, nq_v, kbits)
        elif nf < nj1 and nf < nj0 + TILE * PF_AHEAD:
            ppg, pn, pko, prk, pvo, prv = _seg_rows(npt, nf, nj1, P, rbk, rbv, nj1, nj1, kbits)
            pgh = ng
            nf += pn
        tk = kpool[pgh, ppg]
        tv = vpool[pgh, ppg]
        if not kdir:
            pf_rows(tk, pko, prk, tk, 0, 0, 0, pn)
        if kdir:
            pass
        elif j < ns_k or j >= nq_k or (wk > 0 and j >= whi_k):
            _deq(kc, ksrc, ko, krb, n, kt)
        elif kbits > 0:
            deq_kivi_k_rows(kbits, kpool[g, page], sp, n, kt, dk, mk)
        elif kq8 and not (wk > 0 and j >= wlo_k):
            kint = True
            x = xlo
            while x + 3 <= R:
                scores_q8_0_3(kpool[g, page], sp * rbk, rbk, n, xq, xd, s, x)
                x += 3
            while x < R:
                scores_q8_0_1(kpool[g, page], sp * rbk, rbk, n, xq, xd, s, x)
                x += 1
        else:
            _deq(kcode, kpool[g, page], sp * rbk, rbk, n, kt)
            if wk > 0 and j >= wlo_k:
                kmix = True
                _deq(rck, kres[g].reshape(RING * rbk_r), (j % RING) * rbk_r, rbk_r, n, kt2)
        if kx.shape[0] > 0:                          # pre-RoPE keys: back to roped keys
            _unpre(kt, n, j, g, KVH, kx, cos, sin)
            if kmix:                                 # the window's ring rows: the same keys, same map
                _unpre(kt2, n, j, g, KVH, kx, cos, sin)
        # ---- scores (three query rows per pass over the K tile where all three see the whole
        # tile: every decode row), then online softmax per query row
        mts = gm and not kint                        # this segment's scores and V through the micro-tiles
        if mts:
            _scores_mk(kt, n, qbT, sT, R, s)
        sdone = kdir or (vec and not gm and not kint and not kmix)    # every row's n scores by _qk
        if kdir:
            _qk(qb, R, ksrc, ko, krb, n, s, tk, pko, prk, pn)       # with the later segment's keys
        elif sdone:
            _qk(qb, R, kt, 0, HD * 4, n, s, tk, 0, 0, 0)
        x3 = R if kmix or kint or mts or sdone else 0
        while x3 + 3 <= R and min(lim[x3], lim[x3 + 1], lim[x3 + 2]) - j >= n:
            _scores3(qb[x3], qb[x3 + 1], qb[x3 + 2], kt, n, s[x3], s[x3 + 1], s[x3 + 2])
            x3 += 3
        for x in range(R):
            nv = min(n, lim[x] - j)                  # causal: keys this row may see in the tile
            if nv <= 0:
                if mts:                              # the row is read by _accum_mk
                    for r in range(n):
                        s[x, r] = np.float32(0.0)
                continue
            if kmix:                                 # pool rows below this row's window, f16 from it
                m1 = min(max(lim[x] - wk - j, 0), nv)
                if m1 > 0:
                    _scores(qb[x], kt, m1, s[x])
                if nv > m1:
                    _scores(qb[x], kt2[m1:], nv - m1, s[x, m1:])
            elif x >= x3 and not kint:
                _scores(qb[x], kt, nv, s[x])
            mx = mrow[x]
            for r in range(nv):
                mx = max(mx, s[x, r])
            if mx > mrow[x]:
                corr = exp_neg(mrow[x] - mx)
                lrow[x] *= corr
                for i in range(HD):
                    acc[x, i] *= corr
                mrow[x] = mx
            ls = np.float32(0.0)
            for r in range(nv):
                p = exp_neg(s[x, r] - mx)
                s[x, r] = p
                ls += p
            for r in range(nv, n):
                s[x, r] = np.float32(0.0)
            lrow[x] += ls
        # ---- V: f16 rows read in place (vdir), others through the tile vt
        pf_rows(tv, 0, 0, tv, pvo, prv, 0, pn)       # the later segment's values
        if j < ns_v:
            vsrc = vsink[g].reshape(NS * rbr)
            vo, vrb, vc = j * rbr, rbr, rcode
        elif j >= nq_v or (wv > 0 and j >= whi_v):
            vsrc = vres[g].reshape(RINGV * rbv_r)
            vo, vrb, vc = (j % RINGV) * rbv_r, rbv_r, rcv
        else:
            vsrc = vpool[g, page]
            vo, vrb, vc = sp * rbv, rbv, vcode
        vdir = vec and not gm and vc == rcode
        if vdir:
            _pv(s, xlo, R, vsrc, vo, vrb, n, acc)
        elif j < ns_v or j >= nq_v or (wv > 0 and j >= whi_v):
            _deq(vc, vsrc, vo, vrb, n, vt)
        elif vq8 and not (wv > 0 and j >= wlo_v):
            vint = True
            x = xlo
            while x + 3 <= R:
                accum_q8_0_3(vpool[g, page], sp * rbv, rbv, n, s, x, acc)
                x += 3
            while x < R:
                accum_q8_0_1(vpool[g, page], sp * rbv, rbv, n, s, x, acc)
                x += 1
        else:
            _deq(vcode, vpool[g, page], sp * rbv, rbv, n, vt)
            if wv > 0 and j >= wlo_v:
                vmix = True
                _deq(rcv, vres[g].reshape(RINGV * rbv_r), (j % RINGV) * rbv_r, rbv_r, n, vt2)
        if vmix:
            for x in range(xlo, R):
                m1 = min(max(lim[x] - wv - j, 0), n)
                if m1 > 0:
                    _accum(s[x], vt, m1, acc[x])
                if n > m1:
                    _accum(s[x, m1:], vt2[m1:], n - m1, acc[x])
        elif mts:
            _accum_mk(s, n, vt, acc, xlo // 4 * 4, Rp)
        elif vdir:
            pass
        elif vec and not gm and not vint:
            _pv(s, xlo, R, vt, 0, HD * 4, n, acc)
        elif not vint:               # rows xlo.. see the segment (their p past their causal end are 0)
            x = xlo
            while x + 2 <= R:
                _accum2(s[x], s[x + 1], vt, n, acc[x], acc[x + 1])
                x += 2
            if x < R:
                _accum(s[x], vt, n, acc[x])
        j = e
    for tb in range(TB):
        for gi in range(G):
            x = tb * G + gi
            st = part[t0 + tb, g, c, gi]
            st[0] = mrow[x]
            st[1] = lrow[x]
            for i in range(HD):
                st[2 + i] = acc[x, i]


def item_cres(tys, mt):
    """_item's compiled specialization for argument types tys and the literal mt (compiled, or loaded from
    Numba's cache, now: _call_item needs its symbol in the process)."""
    sig = tuple(tys) + (types.literal(mt),)
    cres = _item.overloads.get(sig)
    if cres is None:
        _item.compile(sig)
        cres = _item.overloads[sig]
    return cres


@intrinsic
def _call_item(typingctx, fargs, mt):
    """_item(*fargs, mt): a call to _item's own compiled specialization by its symbol, the call Numba makes,
    without adding _item's code to the caller.  Numba links a callee's optimized module into every
    caller and runs the optimizer and code generation over all of it again: attend's compile would redo
    both _item specializations, which LLVM does not inline (4 call sites in its module).  The JIT
    resolves the symbol because _item is compiled (or loaded) first: here at attend's typing, and by
    _ItemsFirst when attend comes from the cache."""
    if not isinstance(mt, types.BooleanLiteral):
        raise errors.TypingError("_call_item: mt must be a literal bool")
    tys = tuple(types.unliteral(t) for t in fargs.types)
    cres = item_cres(tys, mt.literal_value)
    sig = types.void(fargs, mt)

    def codegen(context, builder, signature, args):
        vals = cgutils.unpack_tuple(builder, args[0])
        ins = [context.cast(builder, v, a, b) for v, a, b in zip(vals, fargs.types, tys)]
        ins.append(args[1])
        context.call_internal(builder, cres.fndesc, cres.signature, ins)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _work(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv, P,
          kcode, kbits, vcode, rcode, chunk, part, kx, cos, sin, it, C, NB, QB):
    """Work item it of attend: (KV head, key chunk, query block)."""
    # query blocks zig-zag (0, NB-1, 1, NB-2, ...) so a static split of the iterations gives
    # every thread a similar share of the causal work
    T = q.shape[0]
    z = it % NB
    bq = z // 2 if z % 2 == 0 else NB - 1 - z // 2
    c = (it // NB) % C
    g = it // (NB * C)
    t0 = bq * QB
    t1 = min(t0 + QB, T)
    j0 = c * chunk
    j1 = min(j0 + chunk, n_past + t1)
    # (page_table, 0, 0, 0: no next item to prefetch; attend's items go to the threads in zig-zag order)
    if QB > 1:       # a prefill: the specialization of _item with its GEMM micro-tiles
        _call_item((q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv,
                    P, kcode, kbits, vcode, rcode, g, t0, t1, j0, j1, part, c, kx, cos, sin, page_table, _Z, _Z,
                    _Z), True)
    else:
        _call_item((q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv,
                    P, kcode, kbits, vcode, rcode, g, t0, t1, j0, j1, part, c, kx, cos, sin, page_table, _Z, _Z,
                    _Z), False)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def attend(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv, P,
           kcode, kbits, vcode, rcode, chunk, part, out, kx, cos, sin):
    """q (T, H, HD) f32, already scaled by 1/sqrt(HD); out (T, H, HD) f32.
    Query t attends to keys 0 .. n_past + t (causal). Keys j < ns_k (values j < ns_v) are the
    sequence's attention-sink tokens, read from their f16 copies ksink/vsink (KVH, NS, 2*HD);
    keys j < nq_k (values j < nq_v) are read from the pools through the page table, later ones
    from the f16 residual rows kres/vres (KVH, RING, 2*HD), a ring (token j in row j % RING; KIVI:
    whole pages).  wk / wv > 0: the token-adaptive window (see _item): query t reads keys / values
    j >= n_past + t + 1 - wk from the ring, older ones from the pool (decode passes nq = n - w instead).
    part: f32 scratch (T, KVH, C, G, HD + 2) with C >= ceil((n_past + T) / chunk).
    Any chunk >= 1 works; multiples of P (and of TILE) split the fewest segments.
    kx f32 (0 or 2*KVH [+1], HD): no rows, or pre-RoPE keys: stored key = R((k - kx[g]) / kx[KVH + g])
    with R the Hadamard rotation of signs kx[2*KVH] (that row absent: no rotation) of the unroped
    key k; cos/sin (n_ctx, n_rot/2) the RoPE tables (unused without kx rows)."""
    T, H, HD = q.shape
    KVH = kpool.shape[0]
    G = H // KVH
    C = (n_past + T + chunk - 1) // chunk
    QB = min(T, QBLOCK)
    NB = (T + QB - 1) // QB
    n_items = KVH * C * NB
    if T == 1 and (n_past + 1) * KVH <= SERIAL_KEYS:
        # a short decode step: less work than waking the threads costs (a parallel region's launch)
        for it in range(n_items):
            _work(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv,
                  P, kcode, kbits, vcode, rcode, chunk, part, kx, cos, sin, it, C, NB, QB)
    else:
        for it in prange(n_items):
            _work(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv,
                  P, kcode, kbits, vcode, rcode, chunk, part, kx, cos, sin, it, C, NB, QB)
    if T * H <= 64:      # decode: a few heads, not worth a second parallel region (its launch)
        for t in range(T):
            merge_row(part, C, G, t, out)
    else:
        for th in prange(T * H):
            _merge(part, C, G, th // H, th % H, out)


_ITEM_SYMBOL = re.compile(rb"_ZN4pykv7kernels9attention5_item\w+")   # _item's mangled names


class _ItemsFirst:
    """attend's cache, loading _item's cached specializations (for this CPU) before attend's own code:
    attend calls them by symbol (_call_item), and a symbol the JIT cannot resolve is a crash, not an
    error (a fresh process that loads attend from the cache, without _item, segfaulted).
    A symbol names the process that compiled it (Numba's mangled names carry a per-process id): when
    two processes compile one _item specialization at once (the compile helper of pykv.tools.warm, the test
    suite's two workers), the cache can keep one's _item and the other's attend, which calls names
    that no loaded _item defines (a segfault, reproduced in tests/kernels/test_attention.py).  So the cached
    attend is used only when every _item name its code calls is loaded; else it is compiled again here,
    against the loaded _item, and saved over the stale entry."""

    def __init__(self, cache):
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def load_overload(self, sig, target_context):
        cf = getattr(_item._cache, "_cache_file", None)     # None: Numba's cache is off
        own = getattr(self.cache, "_cache_file", None)
        if cf is None or own is None:
            return self.cache.load_overload(sig, target_context)
        codegen = target_context.codegen()
        magic = codegen.magic_tuple()
        for key in cf._load_index():
            if key[1] == magic:
                _item.compile(key[0])       # (may compile and save: not under the lock below)
        with folder_lock(own._cache_path):       # no save of attend between the check and the load
            name = own._load_index().get(self.cache._index_key(sig, codegen))
            if name is None:
                return None
            try:
                with open(own._data_path(name), "rb") as f:
                    need = set(_ITEM_SYMBOL.findall(f.read()))
            except OSError:
                return None
            # a match can run on into the next string of the file (no separator there): a loaded name
            # that begins it covers it
            have = [c.fndesc.mangled_name.encode() for c in _item.overloads.values()]
            if not all(any(n.startswith(h) for h in have) for n in need):
                return None
            return self.cache.load_overload(sig, target_context)


attend._cache = _ItemsFirst(attend._cache)


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _merge(part, C, G, t, h, out):
    """out[t, h] = the chunks' partials (m, l, acc) of query t, head h merged with log-sum-exp weights."""
    HD = out.shape[2]
    g = h // G
    gi = h % G
    mx = -np.inf
    for c in range(C):
        if part[t, g, c, gi, 1] > 0.0:
            mx = max(mx, part[t, g, c, gi, 0])
    lsum = np.float32(0.0)
    for i in range(HD):
        out[t, h, i] = 0.0
    for c in range(C):
        if part[t, g, c, gi, 1] > 0.0:
            w = np.exp(part[t, g, c, gi, 0] - mx)
            lsum += part[t, g, c, gi, 1] * w
            for i in range(HD):
                out[t, h, i] += part[t, g, c, gi, 2 + i] * w
    inv = 1.0 / lsum
    for i in range(HD):
        out[t, h, i] *= inv


@njit(cache=True, nogil=True, fastmath=_FM)
def merge_row(part, C, G, t, out):
    """out[t, h] for every head h (_merge), on the calling thread: a decode step's merge (compiled once,
    not inlined: kernels.chain calls it too, and gets the same bits)."""
    for h in range(out.shape[1]):
        _merge(part, C, G, t, h, out)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FM)
def attend_seqs(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits,
                vcode, rcode, part, out, kx, cos, sin):
    """Decode attention of a step of S one-token sequences (batched decode) in one parallel region:
    q (S, 1, H, HD) -> out (S, 1, H, HD).  Sequence s: sinks[s, li, 0 | 1] its f16 sink rows (KVH, NS,
    2*HD) of keys / values (ns_k / ns_v of them read), page_tables[s], meta[s] = (n_past, chunk, offset
    of its partials (1, KVH, C, G, HD + 2) in the flat part); items (N, 2): (s, work item of its attend).
    The items and the merge run attend's own code (_item's decode specialization, merge_row) with the
    sequence's chunk, so each sequence gets the bits of its own decode step.  kres / vres: unread rows
    (no ring here)."""
    S, H, HD = q.shape[0], q.shape[2], q.shape[3]
    KVH = kpool.shape[0]
    G = H // KVH
    N = items.shape[0]
    keys = 0
    for s in range(S):
        keys += (meta[s, 0] + 1) * KVH
    if keys <= SERIAL_KEYS:
        for i in range(N):
            _seq_item(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits,
                      vcode, rcode, part, kx, cos, sin, i, KVH, G, HD)
    else:
        for i in prange(N):     # (a prange index is unsigned: cast, so _seq_item has one specialization)
            _seq_item(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits,
                      vcode, rcode, part, kx, cos, sin, np.int64(i), KVH, G, HD)
    for s in range(S):
        n_past, chunk, off = meta[s, 0], meta[s, 1], meta[s, 2]
        C = (n_past + chunk) // chunk
        ps = part[off:off + KVH * C * G * (HD + 2)].reshape((1, KVH, C, G, HD + 2))
        merge_row(ps, C, G, _Z, out[s])


@njit(cache=True, nogil=True, inline="always")
def _seq_keys(meta, items, i):
    """Work item items[i] of attend_seqs: (sequence s, KV head g, key chunk c of C, its keys a0 .. a1)."""
    s, it = items[i, 0], items[i, 1]
    n_tot, chunk = meta[s, 0] + 1, meta[s, 1]
    C = (n_tot + chunk - 1) // chunk
    c = it % C
    a0 = c * chunk
    return s, it // C, c, C, a0, min(a0 + chunk, n_tot)


@njit(cache=True, nogil=True, fastmath=_FM)
def _seq_item(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits, vcode,
              rcode, part, kx, cos, sin, i, KVH, G, HD):
    """Work item items[i] of attend_seqs: attend's decode item (KV head, key chunk) of one sequence,
    calling _item as the decode chain does (kernels.chain: the same bits as attend); items[i + 1]'s first
    segments are prefetched at its end (a thread's static share of the items runs them in order)."""
    s, g, c, C, a0, a1 = _seq_keys(meta, items, i)
    n_past, off = meta[s, 0], meta[s, 2]
    ps = part[off:off + KVH * C * G * (HD + 2)].reshape((1, KVH, C, G, HD + 2))
    s2, g2, b0, b1 = s, _Z, _Z, _Z
    if i + 1 < items.shape[0]:
        s2, g2, _, _, b0, b1 = _seq_keys(meta, items, i + 1)
    _item(q[s], kpool, vpool, kres, vres, sinks[s, li, 0], sinks[s, li, 1], page_tables[s], n_past, ns_k, ns_v,
          n_past + 1, n_past + 1, _Z, _Z, P, kcode, kbits, vcode, rcode, g, _Z, np.int64(1), a0, a1, ps, c,
          kx, cos, sin, page_tables[s2], g2, b0, b1, False)


def attend_batch(q, kpool, vpool, kres, vres, ksink, vsink, page_tables, meta, P, kcode, kbits, vcode, rcode,
                 chunk, part, out, kx=None, cos=None, sin=None):
    """One decode query per sequence: q (S, H, HD) -> out (S, H, HD) over S sequences of one layer's
    pools.  Sequence s: kres/vres[s] (KVH, RING, 2*HD), ksink/vsink[s] (KVH, NS, 2*HD), page_tables[s]
    (max_pages,) int32, meta[s] = (n_tokens incl. the query's, ns_k, ns_v, nq_k, nq_v) (KVCache.attend's
    quantities); part (S, KVH, C, G, HD + 2), C >= ceil(max n_tokens / chunk).  The CPU runs attend
    per sequence; the cuda twin runs all S in one launch (the bandwidth benchmark, batched decode).
    No pre-RoPE keys here (kx must be None or have no rows)."""
    kx, cos, sin = _no_kx(q.shape[2], kx)
    for s in range(q.shape[0]):
        n, ns_k, ns_v, nq_k, nq_v = (int(v) for v in meta[s])
        attend(q[s:s + 1], kpool, vpool, kres[s], vres[s], ksink[s], vsink[s], page_tables[s], n - 1, ns_k,
               ns_v, nq_k, nq_v, 0, 0, P, kcode, kbits, vcode, rcode, chunk, part[s:s + 1], out[s:s + 1], kx, cos,
               sin)


def _no_kx(HD, kx):
    if kx is not None and kx.shape[0] > 0:
        raise ValueError("attend_batch: pre-RoPE keys are not supported")
    return np.zeros((0, HD), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32)
