"""numba.cuda twins of kernels.kvquant's paged-cache kernels: same names, same arguments (device arrays).

    append_rows(x f32[T, KVH, HD], pool, page_table, start, P, code)   tokens into their page slots
    write_residual(x, res, start, P, rcode)                             f16 rows (sinks, KIVI window)
    flush_residual(res, r0, pool, page, P, rcode, code, kbits, tmp)     a full residual page -> pool

One CUDA thread per (token, KV head, piece): a piece is kvquant.quantize_block's unit (a 32-value
block; a whole row for fp8, one scale per row), and a KIVI key page is one thread per (KV head, group
of 32 channels) (kvquant.kivi_kpage_group).  The threads call the CPU's own @njit quantizers (see
shared.py), so the bytes are the CPU's: one source, and byte-identical pools on both devices (the
quantizers keep products that feed an add unfused with simd.fmul_rn, since NVVM fuses into fma).
"""
import numpy as np
from numba import cuda

from pykv.kernels.blocks import deq_unit
from pykv.kernels.kvquant import kivi_kpage_group, quantize_block, row_units
from pykv.kernels.cuda.ops import HDMAX, _qkv_prep_tg, qkv_prep_seqs
from pykv.kernels.cuda.shared import SIM, blocks_for, dev

TPB = 32 if SIM else 128      # threads per block (the simulator runs each thread as a Python thread)

_quantize_block = dev(quantize_block)
_kivi_kpage_group = dev(kivi_kpage_group)
_deq_unit = dev(deq_unit)


@cuda.jit(device=True, inline=True)
def _append_unit(code, x, u, pool, g, page_table, j, P):
    # piece u of row x (HD,) quantized into token j's slot of KV head g
    rb = pool.shape[2] // P
    o = (j % P) * rb
    _quantize_block(code, x, u, pool[g, page_table[j // P], o:o + rb])


@cuda.jit
def _append_kernel(x, pool, page_table, start, P, code, NU):
    i = cuda.grid(1)
    KVH = x.shape[1]
    if i < x.shape[0] * KVH * NU:
        t = i // (NU * KVH)
        g = (i // NU) % KVH
        _append_unit(code, x[t, g], i % NU, pool, g, page_table, start + t, P)


def append_rows(x, pool, page_table, start, P, code) -> None:
    # x (T, KVH, HD) f32 -> quantize token start+t, head g into its slot of pool (KVH, n_pages, P*rb)
    T, KVH, HD = x.shape
    NU = row_units(code, HD)
    _append_kernel[blocks_for(T * KVH * NU, TPB), TPB](x, pool, page_table, start, P, code, NU)


@cuda.jit
def _append_seqs_kernel(k, v, kpool, vpool, page_tables, pos, P, kcode, vcode, NUK, NUV):
    # one thread per (sequence s, KV head g, piece of its K row then of its V row)
    i = cuda.grid(1)
    KVH = k.shape[1]
    per = KVH * (NUK + NUV)
    if i < k.shape[0] * per:
        s = i // per
        r = i % per
        if r < KVH * NUK:
            _append_unit(kcode, k[s, r // NUK], r % NUK, kpool, r // NUK, page_tables[s], pos[s], P)
        else:
            r -= KVH * NUK
            _append_unit(vcode, v[s, r // NUV], r % NUV, vpool, r // NUV, page_tables[s], pos[s], P)


def append_seqs(k, v, kpool, vpool, page_tables, pos, P, kcode, vcode) -> None:
    # kvquant.append_seqs on the device, one launch: k, v (S, KVH, HD), row s at token pos[s] (a device
    # array) through page_tables[s]
    S, KVH, HD = k.shape
    NUK, NUV = row_units(kcode, HD), row_units(vcode, HD)
    _append_seqs_kernel[blocks_for(S * KVH * (NUK + NUV), TPB), TPB](k, v, kpool, vpool, page_tables, pos, P,
                                                                     kcode, vcode, NUK, NUV)


@cuda.jit
def _prep_append_kernel(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, kpool, vpool,
                        page_tables, P, kcode, vcode, NUK, NUV):
    # one block of HD threads per (sequence s, KV group g): qkv_prep_seqs's rows, then thread u appends
    # piece u of the K row (u < NUK) or piece u - NUK of the V row
    s = cuda.blockIdx.x
    g = cuda.blockIdx.y
    _qkv_prep_tg(q, k, v, s, g, pos[s], cos, sin, n_rot, True, shift[s, li], scale[s, li], smooth, sign, rotate,
                 qmul)      # ends with a block barrier after the K / V rows are written
    u = cuda.threadIdx.x
    if u < NUK:
        _append_unit(kcode, k[s, g], u, kpool, g, page_tables[s], pos[s], P)
    elif u < NUK + NUV:
        _append_unit(vcode, v[s, g], u - NUK, vpool, g, page_tables[s], pos[s], P)


def prep_append_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, kpool, vpool,
                     page_tables, P, kcode, vcode) -> None:
    """ops.qkv_prep_seqs then append_seqs (the CPU twin's two calls) in one launch: a block per
    (sequence, KV group) ropes, smooths and rotates its rows, then quantizes the K / V pieces."""
    S, KVH, HD = k.shape
    NUK, NUV = row_units(kcode, HD), row_units(vcode, HD)
    if NUK + NUV > HD or HD > HDMAX:
        qkv_prep_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul)
        append_seqs(k, v, kpool, vpool, page_tables, pos, P, kcode, vcode)
        return
    _prep_append_kernel[(S, KVH), HD](q, k, v, pos, cos, sin, int(n_rot), shift, scale, int(li), bool(smooth), sign,
                                      bool(rotate), np.float32(qmul), kpool, vpool, page_tables, P, kcode, vcode,
                                      NUK, NUV)


@cuda.jit
def _residual_kernel(x, res, start, P, rcode, NU):
    i = cuda.grid(1)
    KVH = x.shape[1]
    if i < x.shape[0] * KVH * NU:
        u = i % NU
        t = i // (NU * KVH)
        g = (i // NU) % KVH
        _quantize_block(rcode, x[t, g], u, res[g, (start + t) % P])


def write_residual(x, res, start, P, rcode) -> None:
    # x (T, KVH, HD) f32, all in one page -> f16 rows res[g, (start + t) % P]
    T, KVH, HD = x.shape
    NU = row_units(rcode, HD)
    _residual_kernel[blocks_for(T * KVH * NU, TPB), TPB](x, res, start, P, rcode, NU)


@cuda.jit
def _unpack_kernel(res, r0, P, rcode, tmp, NU):
    # residual rows r0 .. r0+P-1 (f16) -> tmp (KVH, P, HD) f32
    i = cuda.grid(1)
    HD = tmp.shape[2]
    if i < tmp.shape[0] * P * NU:
        u = i % NU
        s = (i // NU) % P
        g = i // (NU * P)
        _deq_unit(rcode, res[g, r0 + s], 0, u, HD, tmp[g, s], 0)


@cuda.jit
def _page_kernel(tmp, pool, page, P, code, NU):
    # tmp (KVH, P, HD) f32 -> the token rows of pool[:, page]
    i = cuda.grid(1)
    if i < tmp.shape[0] * P * NU:
        u = i % NU
        s = (i // NU) % P
        g = i // (NU * P)
        rb = pool.shape[2] // P
        _quantize_block(code, tmp[g, s], u, pool[g, page, s * rb:(s + 1) * rb])


@cuda.jit
def _kpage_kernel(tmp, pool, page, kbits):
    # tmp (KVH, P, HD) f32 -> the KIVI key pages pool[:, page]: a thread per (KV head, 32 channels)
    i = cuda.grid(1)
    NG = tmp.shape[2] // 32
    if i < tmp.shape[0] * NG:
        _kivi_kpage_group(kbits, tmp[i // NG], i % NG, pool[i // NG, page])


def flush_residual(res, r0, pool, page, P, rcode, code, kbits, tmp) -> None:
    # quantize the full page held in residual rows r0 .. r0+P-1 of res (KVH, RING, 2*HD) into
    # pool[:, page]; tmp (KVH, P, HD) f32 scratch.
    KVH, _, HD = tmp.shape
    NU = row_units(rcode, HD)
    _unpack_kernel[blocks_for(KVH * P * NU, TPB), TPB](res, r0, P, rcode, tmp, NU)
    if kbits > 0:
        _kpage_kernel[blocks_for(KVH * (HD // 32), TPB), TPB](tmp, pool, page, kbits)
    else:
        NU = row_units(code, HD)
        _page_kernel[blocks_for(KVH * P * NU, TPB), TPB](tmp, pool, page, P, code, NU)
