"""The encoder of the trellis-coded KV types (tc3b / tc2b / tc1b): a Viterbi search over a bitshift
trellis for the bit stream whose decoded values (kernels.blocks.deq_nl) have the least squared error.
kernels.kvquant's row quantizer calls it once per block when a token is appended; tools/train_trellis.py
trains the codebooks (pykv/data/trellis.npz) with it.  CPU only: the search needs scratch arrays of
2^L floats that a CUDA thread does not allocate.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from pykv.files.formats import KV_FORMATS
from pykv.kernels.blocks import TC_ROW, TC_TABLE

# State s (L bits) = the window a value is read from; the next symbol (k bits) enters at the top:
# s' = (s >> k) | (sym << (L - k)).  So the K = 2^k predecessors of s are p = g K + t (g = s's low
# L - k bits, t = 0..K-1).  Costs are kept in the layout [t * G + g] of p = g K + t (G = 2^(L - k)):
# the min over a state's predecessors and the cost update then both run along contiguous memory.

def tc_perm(cb, L: int, k: int):
    """A codebook cb[2^L] in tc_viterbi's layout: out[t * G + g] = cb[g * K + t]."""
    K, G = 1 << k, 1 << (L - k)
    return np.ascontiguousarray(np.asarray(cb, np.float32)[:G * K].reshape(G, K).T).reshape(-1)


U = np.uint64
TC_PERM = np.zeros_like(TC_TABLE)        # TC_TABLE's rows in tc_viterbi's layout
for _f in KV_FORMATS.values():
    if _f.tc_len:
        _k = _f.nl_runs[0][1]
        TC_PERM[TC_ROW[_f.code], :1 << _f.tc_len] = tc_perm(TC_TABLE[TC_ROW[_f.code]], _f.tc_len, _k)
del _f, _k


@njit(cache=True)
def tc_viterbi(y, cbp, L, k, st, C, m, mp, bb, back):
    """The least-squares path through the trellis for y[n] (values in codebook units; the first state's
    low L - k bits are 0): st[j] <- the state of position j; returns the squared error.  cbp: the codebook
    in tc_perm's layout; scratch: C f32[2^L], m, mp f32[G], bb u8[G], back u8[n, G]."""
    K = U(1) << U(k)
    G = U(1) << U(L - k)
    GK = G // K
    gm = G - U(1)
    n = y.shape[0]
    big = np.float32(3e38)
    y0 = y[0]
    for t in range(K):
        for g in range(G):
            o = U(t) * G + U(g)
            e = y0 - cbp[o]
            C[o] = e * e if ((U(g) * K + U(t)) & gm) == U(0) else big
    for j in range(1, n):
        for g in range(G):
            m[g] = C[g]
            bb[g] = 0
        for t in range(U(1), K):
            tb = np.uint8(t)
            for g in range(G):
                c = C[t * G + U(g)]
                mg = m[g]
                bb[g] = tb if c < mg else bb[g]
                m[g] = c if c < mg else mg
        for g in range(G):
            back[U(j), U(g)] = bb[g]
        for i in range(GK):              # m of the groups g = i K + t, regrouped by t
            for t in range(K):
                mp[U(t) * GK + U(i)] = m[U(i) * K + U(t)]
        yj = y[j]
        for t in range(K):
            for h in range(K):
                ob = U(t) * G + U(h) * GK
                mb = U(t) * GK
                for i in range(GK):
                    e = yj - cbp[ob + U(i)]
                    C[ob + U(i)] = mp[mb + U(i)] + e * e
    bs = U(0)
    b = C[0]
    for t in range(K):
        for g in range(G):
            c = C[U(t) * G + U(g)]
            if c < b:
                b = c
                bs = U(g) * K + U(t)
    st[n - 1] = bs
    for j in range(n - 1, 0, -1):
        g = U(st[j]) & gm
        st[j - 1] = g * K + U(back[U(j), g])
    return b
