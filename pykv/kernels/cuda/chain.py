"""GPU twin of kernels/chain.py: a decode token's work between two attentions in four launches.

The separate calls of a layer's tail and the next layer's head are eight launches (attn_out_act, wo,
add_rmsnorm_act, gate/up, swiglu_act, down, add_rmsnorm_act, q/k/v).  A Chain runs them as four:

    1. x += wo . attn_out(att)        att staged in shared memory, each head rotated back there
    2. X_ff = silu(w_gate . n) * (w_up . n),  n = rmsnorm(x) * ffn_norm, staged in shared memory
    3. x += w_down . X_ff             X_ff staged in shared memory (where it fits)
    4. q, k, v = (wq, wk, wv) . n,    n = rmsnorm(x) * attn_norm, staged in shared memory

(no tail: 4 only, layer 0's head; no head: 1-3 only, the last layer).  Every value is computed as the
separate kernels compute it: the same row dot (cuda.matmul._row_dot), warp sums, norm (ops._rmsnorm_row
with the same block size) and expressions, so the logits equal the unfused path's bit for bit.  The
attention (qkv_prep, append, attend) stays with the KV cache's calls: bind ignores kv.

Kernels are specialised at compile time: `_special` makes a copy of a kernel whose module globals KA, KB,
KC (weight kinds), ROT (undo the rotation) and the staged widths are constants, so the element decoder's
if-chain of every other weight type is dead code.  One copy per distinct combination (a model has a few).
PYKV_CUDA_FUSE=0 turns the chain off (the separate launches, for comparison)."""
import math
import os

import numpy as np
from numba import cuda

from pykv.kernels.cuda import WL, specialise, warp_sums
from pykv.kernels.cuda import matmul as CM
from pykv.kernels.cuda.matmul import _SH
from pykv.kernels.cuda import ops as CO

NW = CM.NW
NTH = NW * WL               # threads per block: a weight row per warp
MAX_ROWS = 1                # a chain runs one token (a batched step runs the separate launches)
XMAX = 8192                 # widest activation row staged in shared memory (32 KiB of float32)
f32 = np.float32
# the norm's block sum must run over the row kernels' thread count, or its bits differ from theirs
assert NTH == CO.NT, (NTH, CO.NT)

# compile-time constants of the kernels below (each specialised copy has its own, see _special)
KA = KB = KC = 0            # weight kinds (ggml types)
ROT = False                 # undo the Hadamard rotation of the attention output (kernel 1)
D = HD = FF = FS = 1        # model width, head width, FFN width, staged FFN width (FF, or 1: read global)


@cuda.jit(device=True, inline=True)
def _unrotate(xs, sign, D, HD):
    # xs (1, D) holds the attention output, heads of HD: ops._fwht_sh(inverse) per head, threads looping
    tid, nth = cuda.threadIdx.x, cuda.blockDim.x
    half = HD // 2
    span = 1
    while span < HD:
        for p in range(tid, (D // HD) * half, nth):
            i = p % half
            i0 = (p // half) * HD + (i // span) * 2 * span + i % span
            a = xs[0, i0]
            b = xs[0, i0 + span]
            xs[0, i0] = a + b
            xs[0, i0 + span] = a - b
        cuda.syncthreads()
        span *= 2
    norm = 1.0 / math.sqrt(HD)
    for e in range(tid, D, nth):
        xs[0, e] *= norm * sign[e % HD]
    cuda.syncthreads()


@cuda.jit
def _out_kernel(raw, fw, att, sign, x):
    # kernel 1: x[0, r] += wo[r] . attn_out(att[0])
    tid = cuda.threadIdx.x
    lane, wi = tid % WL, tid // WL
    r = cuda.blockIdx.x * NW + wi
    xs = cuda.shared.array((1, D), np.float32)
    sh = cuda.shared.array(_SH, np.float32)
    for e in range(tid, D, cuda.blockDim.x):
        xs[0, e] = att[0, e // HD, e % HD]
    cuda.syncthreads()
    if ROT:
        _unrotate(xs, sign, D, HD)
    acc = cuda.local.array(1, np.float32)
    acc[0] = 0.0
    if r < x.shape[1]:
        CM._row_dot(KA, raw, fw, r, xs, 0, 1, lane, acc)
    warp_sums(acc, sh, wi, lane)
    if lane == 0 and r < x.shape[1]:
        x[0, r] += acc[0]


@cuda.jit
def _gate_up_kernel(rg, fg, ru, fu, x, w, eps, X):
    # kernel 2: X[0, r] = silu(gate[r] . n) * (up[r] . n), n = rmsnorm(x[0]) * w
    tid = cuda.threadIdx.x
    lane, wi = tid % WL, tid // WL
    r = cuda.blockIdx.x * NW + wi
    xs = cuda.shared.array((1, D), np.float32)
    shn = cuda.shared.array(NTH, np.float32)
    sh = cuda.shared.array(_SH, np.float32)
    CO._rmsnorm_row(x, w, eps, xs, 0, shn)
    cuda.syncthreads()
    ag = cuda.local.array(1, np.float32)
    au = cuda.local.array(1, np.float32)
    ag[0] = 0.0
    au[0] = 0.0
    ok = r < X.shape[1]
    if ok:
        CM._row_dot(KA, rg, fg, r, xs, 0, 1, lane, ag)
        CM._row_dot(KB, ru, fu, r, xs, 0, 1, lane, au)
    warp_sums(ag, sh, wi, lane)
    warp_sums(au, sh, wi, lane)
    if lane == 0 and ok:
        a = ag[0]
        X[0, r] = a / (f32(1.0) + math.exp(-a)) * au[0]


@cuda.jit
def _down_kernel(raw, fw, X, x):
    # kernel 3: x[0, r] += down[r] . X[0]  (X staged in shared memory when FS == FF)
    tid = cuda.threadIdx.x
    lane, wi = tid % WL, tid // WL
    r = cuda.blockIdx.x * NW + wi
    xs = cuda.shared.array((1, FS), np.float32)
    sh = cuda.shared.array(_SH, np.float32)
    acc = cuda.local.array(1, np.float32)
    acc[0] = 0.0
    if FS == FF:
        for e in range(tid, FF, cuda.blockDim.x):
            xs[0, e] = X[0, e]
        cuda.syncthreads()
        if r < x.shape[1]:
            CM._row_dot(KA, raw, fw, r, xs, 0, 1, lane, acc)
    elif r < x.shape[1]:
        CM._row_dot(KA, raw, fw, r, X[0:1, 0:FF], 0, 1, lane, acc)
    warp_sums(acc, sh, wi, lane)
    if lane == 0 and r < x.shape[1]:
        x[0, r] += acc[0]


@cuda.jit
def _qkv_kernel(rq, fq, rk, fk, rv, fv, x, w, eps, q, k, v):
    # kernel 4: q, k, v[0] = (wq, wk, wv) . n, n = rmsnorm(x[0]) * w; rows of q, then k, then v
    tid = cuda.threadIdx.x
    lane, wi = tid % WL, tid // WL
    r = cuda.blockIdx.x * NW + wi
    nq, nk = q.shape[1], k.shape[1]
    xs = cuda.shared.array((1, D), np.float32)
    shn = cuda.shared.array(NTH, np.float32)
    sh = cuda.shared.array(_SH, np.float32)
    CO._rmsnorm_row(x, w, eps, xs, 0, shn)
    cuda.syncthreads()
    acc = cuda.local.array(1, np.float32)
    acc[0] = 0.0
    if r < nq:
        CM._row_dot(KA, rq, fq, r, xs, 0, 1, lane, acc)
    elif r < nq + nk:
        CM._row_dot(KB, rk, fk, r - nq, xs, 0, 1, lane, acc)
    elif r < nq + 2 * nk:
        CM._row_dot(KC, rv, fv, r - nq - nk, xs, 0, 1, lane, acc)
    warp_sums(acc, sh, wi, lane)     # outside the branches: a block can straddle two weights
    if lane == 0:
        if r < nq:
            q[0, r] = acc[0]
        elif r < nq + nk:
            k[0, r - nq] = acc[0]
        elif r < nq + 2 * nk:
            v[0, r - nq - nk] = acc[0]


def enabled() -> bool:
    """On unless PYKV_CUDA_FUSE=0 (then the model runs each call as its own launch)."""
    return os.environ.get("PYKV_CUDA_FUSE", "1") != "0"


class Chain:
    """The four launches of one layer boundary, arguments fixed at bind; called with the CPU chain's
    fold argument, which is ignored (the cache runs the attention)."""

    __slots__ = ("calls",)

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, fa=None, T: int = 1) -> None:
        for k, cfg, args in self.calls:
            k[cfg](*args)


def bind(tail, head, views, act_d, act_ff, sign, rotate: bool, eps: float, kv):
    """A Chain for one token (kernels.chain.bind's arguments), or None: no tail and no head, a model
    wider than XMAX, or a head width the shared rotation cannot take."""
    if tail is None and head is None:
        return None
    v, x = views, views.x
    Dm = x.shape[1]
    H, HDm = v.att3.shape[1], v.att3.shape[2]
    if Dm > XMAX or H * HDm != Dm or HDm & (HDm - 1):
        return None
    eps = f32(eps)
    calls = []
    if tail is not None:
        wo, wg, wu, wd, fnorm = tail
        FFm = wg.rows
        k1 = specialise(_out_kernel, KA=int(wo.kind), ROT=bool(rotate), D=Dm, HD=HDm)
        calls.append((k1, (CM.grid(Dm, NW), NTH), (wo.raw, wo.fw, v.att3, sign, x)))
        k2 = specialise(_gate_up_kernel, KA=int(wg.kind), KB=int(wu.kind), D=Dm)
        calls.append((k2, (CM.grid(FFm, NW), NTH), (wg.raw, wg.fw, wu.raw, wu.fw, x, fnorm, eps, act_ff.x)))
        k3 = specialise(_down_kernel, KA=int(wd.kind), FF=FFm, FS=FFm if FFm <= XMAX else 1)
        calls.append((k3, (CM.grid(Dm, NW), NTH), (wd.raw, wd.fw, act_ff.x, x)))
    if head is not None:
        wq, wk, wv, anorm = head
        k4 = specialise(_qkv_kernel, KA=int(wq.kind), KB=int(wk.kind), KC=int(wv.kind), D=Dm)
        n = wq.rows + 2 * wk.rows
        calls.append((k4, (CM.grid(n, NW), NTH), (wq.raw, wq.fw, wk.raw, wk.fw, wv.raw, wv.fw, x, anorm, eps,
                                                  v.q, v.k, v.v)))
    return Chain(tuple(calls))
