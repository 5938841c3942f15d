"""Fused attention over the paged, block-quantized KV cache (CPU).

Nothing here dequantizes the cache to memory: every score reads one K row in place through
`kvquant.dot_row` (block scales applied once per block) and every V row is accumulated straight
from its blocks through `kvquant.axpy_row`. Work items are (query token t, KV head g, chunk c of
keys); each reads its K/V rows once for all G = H/KVH query heads sharing them, keeps an online
softmax (m, l, acc) per head in `part`, and a second pass merges the chunks with log-sum-exp weights.

Pools (one per layer, K and V):  uint8[n_pages, KVH, P * row_bytes]  (token-major rows in a page)
    KIVI keys instead hold one per-channel-quantized page per (page, g): uint8[n_pages, KVH, page_bytes]
Residual (KIVI types only): uint8[KVH, P, 2 * HD] f16 rows of the sequence's newest, not yet full page.
"""
import numpy as np
from numba import njit, prange

from .kvquant import axpy_row, dot_row, kivi_dot_k


@njit(cache=True, nogil=True, inline="always")
def _k_score(q, kpool, kres, page_table, j, g, nq, P, kcode, kbits, rcode):
    if j >= nq:                      # newest tokens: f16 residual page
        return dot_row(rcode, q, kres[g, j % P])
    page = page_table[j // P]
    if kbits > 0:                    # KIVI keys: per-channel page
        return kivi_dot_k(kbits, q, kpool[page, g], j % P, P)
    rb = kpool.shape[2] // P
    o = (j % P) * rb
    return dot_row(kcode, q, kpool[page, g, o:o + rb])


@njit(cache=True, nogil=True, inline="always")
def _v_accum(p, acc, vpool, vres, page_table, j, g, nq, P, vcode, rcode):
    if j >= nq:
        axpy_row(rcode, p, vres[g, j % P], acc)
        return
    page = page_table[j // P]
    rb = vpool.shape[2] // P
    o = (j % P) * rb
    axpy_row(vcode, p, vpool[page, g, o:o + rb], acc)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def attend(q, kpool, vpool, kres, vres, page_table, n_past, nq_k, nq_v, P,
           kcode, kbits, vcode, rcode, chunk, part, out):
    """q (T, H, HD) f32, already scaled by 1/sqrt(HD); out (T, H, HD) f32.
    Query t attends to keys 0 .. n_past + t (causal). Keys j < nq_k (values j < nq_v) are read
    from the pools through the page table, later ones from the f16 residual rows.
    part: f32 scratch (T, KVH, C, G, HD + 2) with C >= ceil((n_past + T) / chunk)."""
    T, H, HD = q.shape
    KVH = kpool.shape[1]
    G = H // KVH
    C = (n_past + T + chunk - 1) // chunk
    n_items = KVH * C * T
    for it in prange(n_items):
        t = it % T
        c = (it // T) % C
        g = it // (T * C)
        j0 = c * chunk
        j1 = min(j0 + chunk, n_past + t + 1)
        for gi in range(G):
            part[t, g, c, gi, 0] = -np.inf
            part[t, g, c, gi, 1] = 0.0
            for i in range(HD):
                part[t, g, c, gi, 2 + i] = 0.0
        for j in range(j0, j1):
            for gi in range(G):
                h = g * G + gi
                s = _k_score(q[t, h], kpool, kres, page_table, j, g, nq_k, P, kcode, kbits, rcode)
                st = part[t, g, c, gi]
                m = st[0]
                if s > m:
                    corr = np.exp(m - s)
                    st[1] *= corr
                    for i in range(HD):
                        st[2 + i] *= corr
                    st[0] = s
                    m = s
                p = np.exp(s - m)
                st[1] += p
                _v_accum(p, st[2:], vpool, vres, page_table, j, g, nq_v, P, vcode, rcode)
    for th in prange(T * H):
        t = th // H
        h = th % H
        g = h // G
        gi = h % G
        mx = -np.inf
        for c in range(C):
            mx = max(mx, part[t, g, c, gi, 0])
        lsum = 0.0
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
