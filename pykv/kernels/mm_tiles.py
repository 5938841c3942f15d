"""Tile kernels over weights repacked at load: float-activation Q4/Q8 tiles, the integer-dot tiles of
kernels.tiles (decode and prefill), the tiles' dequantization for the BLAS prefill, and the repack."""
from __future__ import annotations
import numpy as np
from numba import literally, njit, prange, types
from numba._dispatcher import compute_fingerprint
from pykv.kernels.simd import h2f
import numba
from pykv.kernels.tiles import (KBYTES, KTILE_ROWS, TOKEN_NT, dot_ktile_by, dot_tile_by, f16_bits, lanes, repack_ktile,
                                 repack_ktile_nb)
from pykv.kernels.mm_raw import (IQ4_NL, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _BLOCK, _FM,
                                 _quantize_tokens)

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
_TOK_NT = 4         # prefill: tokens per K tile call (kernels.tiles.TOKEN_BLOCK: which formats group them)
_TOK_NT_Q = TOKEN_NT   # tokens per Q4 / Q5 / Q8 tile call (kernels.tiles: 8 where KOUTER, else 4)
# the integer tile dot of a literal _KIND_ITILE_* kind (only the kinds a kernel is called with compile)
_ITILE_FMT = {_KIND_ITILE_Q4: "q4", _KIND_ITILE_Q5: "q5", _KIND_ITILE_Q8: "q8", _KIND_ITILE_Q40: "q40",
              _KIND_ITILE_Q50: "q50", _KIND_ITILE_IQ4: "iq4"}
_dot_itile = dot_tile_by(_ITILE_FMT)
_dot_itile_n = dot_tile_by(_ITILE_FMT, _TOK_NT_Q)
_KTILE_FMT = {Q2_K: "q2k", Q3_K: "q3k", Q4_K: "q4k", Q5_K: "q5k", Q6_K: "q6k"}
_dot_ktile = dot_ktile_by(_KTILE_FMT)
_dot_ktile_n = dot_ktile_by(_KTILE_FMT, _TOK_NT)
# byte offsets of each K-quant's f16 super-block scales (d, and dmin where there is one)
_K_F16 = {Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}

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
    """Tokens t .. t1-1 of one full row tile (its rows r0 .. r0+R of out): _TOK_NT_Q tokens a call (the
    tile's weights unpacked once for a group where kernels.tiles.TOKEN_BLOCK says so), then one by one."""
    while t + _TOK_NT_Q <= t1:
        u = t + _TOK_NT_Q
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
