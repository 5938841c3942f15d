"""A decode step's work between two attentions in ONE parallel region (CPU).

A decode token's layer is ~10 kernel calls; each parallel region costs microseconds to start, and a
thread that finishes its static share of a small product waits for the others.  `chain` runs, for the T
one-token rows of a decode step (T = 1: one sequence's token; T > 1: a batched step's sequences), the tail
of layer l and the head of layer l+1 as numbered work items that the threads claim in order from a
shared counter:

    stage 0  attn_out_act (+ its q8 blocks)          an item per row
    stage 1  o = att @ wo                            one run of row tiles per thread (all T tokens)
    stage 2  x += o; rmsnorm (ffn_norm) (+ q8)       an item per row
    stage 3  g, u = x @ (w_gate, w_up)               runs over the tiles of both
    stage 4  swiglu (+ q8)                           an item per row
    stage 5  o = swiglu @ w_down                     runs
    stage 6  x += o; rmsnorm (next attn_norm) (+ q8) an item per row  (no tail: rmsnorm of x; no head: x += o)
    stage 7  q, k, v = x @ (wq, wk, wv)              runs over the tiles of the three
    stage 8  RoPE, smoothing, rotation (ops.qkv_prep); the K/V rows into the cache   1 item  (mode ATTN, T = 1)
    stage 9  attention over the cache: one item per (KV head, key chunk)            (mode ATTN)
    stage 10 the chunks' partials merged into att (layer l+1's attention output)   1 item  (mode ATTN)

An item waits (spinning, then yielding its core: sync.wait_until) until the nearest non-empty earlier stage has finished every item; a product item
that has to wait prefetches its first row tile meanwhile.  Items are claimed in increasing order and only wait on
lower-numbered ones, each held by a running thread, so the region finishes at any thread count (one
thread runs them in order).  Every product is the integer tile dot of the matmul kernels, so the
results equal matmul's bit for bit (several tokens: in matmul's token groups).

Stages 8-10 (mode ATTN: Model asks for them when the layer's cache is one they cover, KVCache.fold_args)
run layer l+1's attention in the same region, through the functions the separate calls run (qkv_prep,
kvquant's row append, attention's work item and merge), with the same chunks: the results are the
same bits, and a decode step has no Python between two chains.  A batched step (T > 1) runs its
sequences' attention between the chains (KVCache.append_seqs / attend_seqs, one call each a layer).

Weight codes (compile-time literals): matmul's _KIND_ITILE_* kind (q8_0 activations), or KOFF + the
ggml type of a K-quant tile (q8_K activations).
"""
import contextlib

import numpy as np
import numba
from numba import literally, njit, prange, types
from numba.experimental import structref

from pykv.kernels import matmul as M
from pykv.kernels.mm_raw import _FM, _q8_row, _q8k_row
from pykv.kernels.matmul import _ITILE_FMT, _KTILE_FMT, _TOK_NT, _TOK_NT_Q
from pykv.kernels.attention import _item as _att_item
from pykv.kernels.attention import merge_row
from pykv.kernels.kvquant import _append_row
from pykv.kernels.ops import add_rmsnorm_act_row, attn_out_act_row, qkv_prep, rmsnorm_act_row, swiglu_act_row
from pykv.kernels.simd import prefetch
from pykv.kernels.sync import fetch_add, load_acquire, wait_until
from pykv.kernels.tiles import KTILE_ROWS, TILE_ROWS, dot_any_by

KOFF = 100
TAIL, HEAD, ATTN = 1, 2, 4  # mode bits: layer l's tail (stages 0-6), layer l+1's head (6-7), its attention (8-10)
N_STAGES = 11
SYNC = 8 * (1 + N_STAGES)
MAX_ROWS = None     # a chain runs any number of one-token rows (a batched decode step's sequences)
_dot = dot_any_by(_ITILE_FMT, _KTILE_FMT, KOFF)
_dot_n = dot_any_by(_ITILE_FMT, _KTILE_FMT, KOFF, _TOK_NT_Q, _TOK_NT)    # the token groups of matmul's kernels
# Constant arguments to functions that Model's separate calls run too go in as int64, not as literals: a
# constant 0 would be typed Literal[int](0) and compile a second specialization of the callee (a long
# compile again on a cold cache, for attention's work item).
_I0 = np.int64(0)


@njit(cache=True, nogil=True, fastmath=_FM)
def _quant(c0, c1, c2, X, XQ, XD, XS, XF, XQK, XDK, XBK, t):
    """The activation blocks the weights of codes c0..c2 read (q8_0 and / or q8_K) of token t of X."""
    if c0 < KOFF or c1 < KOFF or c2 < KOFF:
        _q8_row(X, t, XQ, XD, XS, XF)
    if c0 >= KOFF or c1 >= KOFF or c2 >= KOFF:
        _q8k_row(X, t, XQK, XDK, XBK)


@njit(cache=True, nogil=True, fastmath=_FM)
def _tile(code, qt, sc, i, T, XQ, XD, XS, XQK, XDK, XBK, out):
    """Row tile i of one weight for tokens 0 .. T-1: out[:T, i*R:(i+1)*R], in the token groups of
    matmul's kernels (mm_tiles._itile_tokens: the same bits).  Compiled once per literal code: every
    chain with that weight type links the same code."""
    literally(code)
    if code >= KOFF:
        R, n, si, nb = KTILE_ROWS, _TOK_NT, 0, XDK.shape[1]
    else:
        R, n, si, nb = TILE_ROWS, _TOK_NT_Q, i, qt.shape[1]
    r0 = i * R
    t = 0
    while t + n <= T:
        u = t + n
        _dot_n(code, qt[i], sc[si], XQ[t:u], XD[t:u], XS[t:u], XQK[t:u], XDK[t:u], XBK[t:u], nb, out[t:u, r0:r0 + R])
        t = u
    for t in range(t, T):
        _dot(code, qt[i], sc[si], XQ[t], XD[t], XS[t], XQK[t], XDK[t], XBK[t], nb, out[t, r0:r0 + R])


@njit(cache=True, nogil=True, inline="always")
def _warm(qt, i):
    """Prefetch row tile i's weight bytes (an item waiting for the previous stage)."""
    t = qt[i]
    n = t.size
    for off in range(0, n, 64):
        prefetch(t, off)


@njit(cache=True, nogil=True)
def _warm_item(s, j, W):
    """Prefetch the first row tile of product stage s's item starting at tile j (W: chain's weights)."""
    wq, wk, wv, wo, wg, wu, wd = W[0], W[2], W[4], W[6], W[8], W[10], W[12]
    if s == 1:
        _warm(wo, j)
    elif s == 3:
        if j < wg.shape[0]:
            _warm(wg, j)
        else:
            _warm(wu, j - wg.shape[0])
    elif s == 5:
        _warm(wd, j)
    elif s == 7:
        if j < wq.shape[0]:
            _warm(wq, j)
        elif j < wq.shape[0] + wk.shape[0]:
            _warm(wk, j - wq.shape[0])
        else:
            _warm(wv, j - wq.shape[0] - wk.shape[0])


@njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _row(cq, ck, cv, co, cg, cu, cd, s, t, mode, eps, rotate, B, A, F):
    """Serial stage s (0, 2, 4, 6) for row t: a norm or activation and its q8 blocks (inlined: a call
    would pass _item's arrays on)."""
    att, sign, x, norm_f, norm_a, q, k, v, o, g, u = B
    AX, AXQ, AXD, AXS, AXF, AXQK, AXDK, AXBK = A
    FX, FXQ, FXD, FXS, FXF, FXQK, FXDK, FXBK = F
    if s == 0:
        attn_out_act_row(att, sign, rotate, AX, AXF, t)
        _quant(co, co, co, AX, AXQ, AXD, AXS, AXF, AXQK, AXDK, AXBK, t)
    elif s == 2:
        add_rmsnorm_act_row(x, o, norm_f, eps, AX, AXF, t)
        _quant(cg, cu, cu, AX, AXQ, AXD, AXS, AXF, AXQK, AXDK, AXBK, t)
    elif s == 4:
        swiglu_act_row(g, u, FX, FXF, t)
        _quant(cd, cd, cd, FX, FXQ, FXD, FXS, FXF, FXQK, FXDK, FXBK, t)
    else:
        tail = (mode & TAIL) != 0
        head = (mode & HEAD) != 0
        if tail and head:
            add_rmsnorm_act_row(x, o, norm_a, eps, AX, AXF, t)
        elif head:
            rmsnorm_act_row(x, norm_a, eps, AX, AXF, t)
        else:
            for i in range(x.shape[1]):
                x[t, i] += o[t, i]
        if head:
            _quant(cq, ck, cv, AX, AXQ, AXD, AXS, AXF, AXQK, AXDK, AXBK, t)


@njit(cache=True, nogil=True, fastmath=_FM)
def _item(cq, ck, cv, co, cg, cu, cd, s, j0, j1, T, mode, eps, rotate, W, B, A, F):
    """Stage s's work item: row tiles j0 .. j1-1 of its product for tokens 0 .. T-1, or rows j0 .. j1-1
    of its serial step (a function of its own, compiled once per weight codes, so the parallel region
    around it stays small to compile)."""
    wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd = W
    att, sign, x, norm_f, norm_a, q, k, v, o, g, u = B
    AX, AXQ, AXD, AXS, AXF, AXQK, AXDK, AXBK = A
    FX, FXQ, FXD, FXS, FXF, FXQK, FXDK, FXBK = F
    literally(cq)
    literally(ck)
    literally(cv)
    literally(co)
    literally(cg)
    literally(cu)
    literally(cd)
    if s % 2 == 0:
        for t in range(j0, j1):
            _row(cq, ck, cv, co, cg, cu, cd, s, t, mode, eps, rotate, B, A, F)
    elif s == 1:
        for j in range(j0, j1):
            _tile(co, wo, so, j, T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, o)
    elif s == 3:
        for j in range(j0, j1):
            if j < wg.shape[0]:
                _tile(cg, wg, sg, j, T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, g)
            else:
                _tile(cu, wu, su, j - wg.shape[0], T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, u)
    elif s == 5:
        for j in range(j0, j1):
            _tile(cd, wd, sd, j, T, FXQ, FXD, FXS, FXQK, FXDK, FXBK, o)
    else:
        for j in range(j0, j1):
            if j < wq.shape[0]:
                _tile(cq, wq, sq, j, T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, q)
            elif j < wq.shape[0] + wk.shape[0]:
                _tile(ck, wk, sk, j - wq.shape[0], T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, k)
            else:
                _tile(cv, wv, sv, j - wq.shape[0] - wk.shape[0], T, AXQ, AXD, AXS, AXQK, AXDK, AXBK, v)


@njit(cache=True, nogil=True, fastmath=_FM)
def _attn(s, j0, j1, rotate, n_past, chunk, ns_k, ns_v, li, smooth, K, pt, ksink, vsink, shift, scale):
    """Stage s (8-10) of layer l+1's attention for the token at position n_past (see chain): the same
    calls, with the same arguments, that Model._layer / KVCache make one by one."""
    q, k, v, kpool, vpool, kres, vres, cos, sin, sign, part, att, kx, kcos, ksin, km, qm = K
    kcode, kbits, vcode, rcode, Pg, n_rot = km[0], km[1], km[2], km[3], km[4], km[5]
    KVH, H, HD = k.shape[1], q.shape[1], q.shape[2]
    G = H // KVH
    n_tot = n_past + 1
    C = (n_tot + chunk - 1) // chunk
    pv = part[:KVH * C * G * (HD + 2)].reshape((1, KVH, C, G, HD + 2))
    if s == 8:
        qkv_prep(q, k, v, n_past, cos, sin, n_rot, np.bool_(True), shift[li], scale[li], smooth, sign, rotate, qm[0])
        for i in range(KVH):
            _append_row(k, kpool, pt, n_past, Pg, kcode, i)
        for i in range(KVH):
            _append_row(v, vpool, pt, n_past, Pg, vcode, i)
    elif s == 9:
        for it in range(j0, j1):           # attend's work item it (one query block): KV head, key chunk
            c = it % C
            a0 = c * chunk
            b0 = ((it + 1) % C) * chunk    # the next item's keys (it + 1 < j1; else none), prefetched at its end
            b1 = min(b0 + chunk, n_tot) if it + 1 < j1 else b0
            _att_item(q, kpool, vpool, kres, vres, ksink, vsink, pt, n_past, ns_k, ns_v, n_tot, n_tot, _I0, _I0,
                      Pg, kcode, kbits, vcode, rcode, it // C, _I0, np.int64(1), a0, min(a0 + chunk, n_tot), pv, c, kx,
                      kcos, ksin, pt, (it + 1) // C, b0, b1, False)   # False: attend's decode specialization
    else:
        merge_row(pv, C, G, _I0, att)


@njit(cache=True, nogil=True)
def _plan(mode, W, split, n_att, T):
    """chain's work items: per stage its row tiles nt (a serial stage: its T rows), items n (runs of
    tiles, at most split a product; a serial stage: one a row), first
    item, and the nearest non-empty earlier stage (-1: none).  n_att: the attention's work items (KV heads
    x key chunks; mode ATTN, one token).  Outside the
    parallel function: its array constructors would each become a parallel loop of their own."""
    wq, wk, wv, wo, wg, wu, wd = W[0], W[2], W[4], W[6], W[8], W[10], W[12]
    tail = (mode & TAIL) != 0
    head = (mode & HEAD) != 0
    nt = np.zeros(N_STAGES, np.int64)            # row tiles (a serial stage: rows)
    if tail:
        nt[0] = T
        nt[1] = wo.shape[0]
        nt[2] = T
        nt[3] = wg.shape[0] + wu.shape[0]
        nt[4] = T
        nt[5] = wd.shape[0]
    nt[6] = T
    if head:
        nt[7] = wq.shape[0] + wk.shape[0] + wv.shape[0]
        if mode & ATTN:
            nt[8] = 1
            nt[9] = n_att
            nt[10] = 1
    n = np.zeros(N_STAGES, np.int64)             # items: contiguous runs of tiles (products), else one each
    for s in range(N_STAGES):
        n[s] = min(nt[s], split) if s & 1 and s < 8 else nt[s]
    first = np.zeros(N_STAGES + 1, np.int64)     # first item of each stage
    prev = np.full(N_STAGES, -1, np.int64)       # the nearest non-empty earlier stage
    last = -1
    for s in range(N_STAGES):
        first[s + 1] = first[s] + n[s]
        prev[s] = last
        if n[s]:
            last = s
    return nt, n, first, prev


@njit(cache=True, nogil=True, parallel=True)
def chain(cq, ck, cv, co, cg, cu, cd, mode, eps, rotate, P, split, T, n_past, chunk, ns_k, ns_v, li, smooth,
          pt, ksink, vsink, shift, scale):
    """T one-token rows (rows 0 .. T-1 of B, A, F's arrays: a decode step's sequences) through stages 0-7
    above (mode: TAIL | HEAD bits), c*: the weights' codes.  W: (wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd): w* a weight's tiles (matmul
    Weight.qt), s* its scales (Weight.sc; any uint16 4-D array for a K-quant); B: (att (R, H, HD), sign,
    x (R, D), ffn_norm, the next attn_norm, q, k, v, o, g, u: the products' outputs (R, rows)), R >= T;
    A: the D-wide activation (matmul.Act x, xq, xd, xs, xf, xqk, xdk, xbk), F: the FF-wide one (W, B, A, F
    and sync are the fields of P, a ChainArgs: one object to unbox per call, not ~45 arrays); sync: int64 (SYNC,) scratch: the claim
    counter and each stage's done count, 64 bytes apart; split: the threads (numba.get_num_threads(), passed
    in: calling it here would keep the function out of Numba's cache): items per product, one run of
    row tiles each (a run keeps the tiles' prefetch-ahead inside the thread that reads them).
    Mode ATTN (T = 1), stages 8-10 (P.K: q3, k3, v3 (1, heads, HD), the layer's K / V pools, the f16 ring (unread), cos, sin,
    sign, part (flat), att3, the no-pre-RoPE kx / cos / sin, int64 (kcode, kbits, vcode, rcode, page
    tokens, n_rot), float32 (qmul,)): the token at n_past (chunk: keys per attention item; ns_k / ns_v
    sink rows read; li: the row of shift / scale, the sequence's key smoothing (smooth: applied); pt: its
    page table; ksink / vsink: its sink rows); without ATTN those are not read."""
    literally(cq)
    literally(ck)
    literally(cv)
    literally(co)
    literally(cg)
    literally(cu)
    literally(cd)
    W, B, A, F, K, sync = P.W, P.B, P.A, P.F, P.K, P.sync
    nt, n, first, prev = _plan(mode, W, split, K[3].shape[0] * ((n_past + chunk) // chunk), T)
    total = first[N_STAGES]
    for s in range(SYNC):
        sync[s] = 0
    for _ in prange(split):
        while True:
            it = fetch_add(sync, 0, 1)
            if it >= total:
                break
            s = 0
            while it >= first[s + 1]:
                s += 1
            j = it - first[s]
            j0 = j * nt[s] // n[s]
            j1 = (j + 1) * nt[s] // n[s]
            p = prev[s]
            if p >= 0 and load_acquire(sync, 8 + 8 * p) < n[p]:
                _warm_item(s, j0, W)
                wait_until(sync, 8 + 8 * p, n[p])
            if s >= 8:      # through a function pointer: one compiled attention for every chain (bind)
                P.fn.f(s, j0, j1, rotate, n_past, chunk, ns_k, ns_v, li, smooth, K, pt, ksink, vsink, shift, scale)
            else:
                _item(cq, ck, cv, co, cg, cu, cd, s, j0, j1, T, mode, eps, rotate, W, B, A, F)
            fetch_add(sync, 8 + 8 * s, 1)


# ----------------------------------------------------------------------------------------------------
# Python-level API
# ----------------------------------------------------------------------------------------------------

@structref.register
class ChainArgsType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class ChainArgs(structref.StructRefProxy):
    """chain's arrays (W, B, A, F, K: tuples, sync) and its attention (fn: an AttnFn) in one Numba
    struct: a call unboxes one object instead of ~60 arrays."""

    def __new__(cls, W, B, A, F, K, fn, sync):
        return structref.StructRefProxy.__new__(cls, W, B, A, F, K, fn, sync)


structref.define_proxy(ChainArgs, ChainArgsType, ["W", "B", "A", "F", "K", "fn", "sync"])


@njit(cache=True)
def _chain_args(W, B, A, F, K, fn, sync):
    """ChainArgs(...) through a cached constructor: the proxy's own (StructRefProxy.__new__) is compiled
    in every process, slowly for these ~60 array fields."""
    return ChainArgs(W, B, A, F, K, fn, sync)


@structref.register
class AttnFnType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class AttnFn(structref.StructRefProxy):
    """_attn as a first-class function (field f: a FunctionType, a pointer to its compiled code).  chain
    calls stages 8-10 through it: called directly, every chain specialization (one per mix of weight
    types) would link and compile its own copy of the attention; through the pointer it is compiled
    once, for all of them."""

    def __new__(cls, f):
        return structref.StructRefProxy.__new__(cls, f)


structref.define_proxy(AttnFn, AttnFnType, ["f"])


def _make_fn(f):
    return AttnFn(f)


@njit(cache=True, nogil=True)
def _attn_none(s, j0, j1, rotate, n_past, chunk, ns_k, ns_v, li, smooth, K, pt, ksink, vsink, shift, scale):
    """_attn's stand-in (attention_stand_in): its signature, no attention."""
    return


_FN_MAKERS = {}
_ATTN = [_attn]     # what attn_fn points chains at: _attn, or _attn_none inside attention_stand_in


@contextlib.contextmanager
def attention_stand_in():
    """Chains bound inside point at _attn_none: a compile helper (pykv.tools.warm) compiles a model's chains
    with it first, in idle mode (no attention run), and _attn after them.  The chains' compiled code is
    the same (the pointer's type, not its target, is in their signature), so the caller loads them, and
    _attn's callees that the caller compiles for its prompt meanwhile (kvquant.quantize_row,
    attention._deq) are in the cache by the time the helper gets to them."""
    _ATTN[0] = _attn_none
    try:
        yield
    finally:
        _ATTN[0] = _attn


def attn_fn(example):
    """An AttnFn for _attn with the argument types of example (a call's arguments)."""
    sig = types.void(*(types.unliteral(numba.typeof(a)) for a in example))
    mk = _FN_MAKERS.get(sig)
    if mk is None:      # a constructor taking _attn as that FunctionType (the dispatcher converts once)
        mk = _FN_MAKERS[sig] = njit((types.FunctionType(sig),), cache=True)(_make_fn)
    return mk(_ATTN[0])


def code(w) -> int | None:
    """The chain's literal code of a matmul Weight, or None when the chain cannot run it (not an
    integer tile weight, or a partial last row tile)."""
    if w.kind in M._ITILE_KINDS:
        return w.kind if w.rows % TILE_ROWS == 0 else None
    if w.kind == M._KIND_KTILE:
        return KOFF + w.ggml_type if w.rows % KTILE_ROWS == 0 else None
    return None


def enabled() -> bool:
    """False in matmul's exact mode (float activations everywhere): the chain's products are q8 only."""
    return not M._EXACT


class Chain:
    """chain() bound to one layer boundary: the tail of layer l (wo, w_gate, w_up, w_down, ffn_norm) and
    the head of layer l + 1 (wq, wk, wv, attn_norm), either may be None; arguments fixed at bind.
    Called with fa (KVCache.fold_args: n_past, chunk, ns_k, ns_v, li, smooth, pt, ksink, vsink, shift,
    scale), it runs layer l+1's attention too (mode ATTN; one token); without, it reads idle: arguments
    of the same types (one compiled chain serves both).  T: the step's one-token rows (a batched decode
    step's sequences; their attention runs outside, KVCache.append_seqs / attend_seqs)."""

    __slots__ = ("lits", "args", "idle", "rows", "entry")

    def __init__(self, lits, args, idle, rows):
        self.lits, self.args, self.idle, self.rows, self.entry = lits, args, idle, rows, None

    def __call__(self, fa=None, T: int = 1) -> None:
        if not 1 <= T <= self.rows or (fa is not None and T != 1):     # the kernel reads rows 0 .. T-1 unchecked
            raise ValueError(f"chain: {T} rows for a chain bound to {self.rows}" + (" with attention" if fa else ""))
        mode, eps, rotate, P = self.args
        if fa is None:
            fa = self.idle
        else:
            mode |= ATTN
        if self.entry is None:      # compiles or loads chain for these codes, then keeps its entry point
            self.entry = M._entry(chain, self.lits, (mode, eps, rotate, P, numba.get_num_threads(), T) + tuple(fa))
        self.entry(*self.lits, mode, eps, rotate, P, numba.get_num_threads(), T, *fa)


_NO_SC = np.zeros((1, 1, 1, 1), np.uint16)      # a K-quant weight's (unread) scales argument


def bind(tail, head, views, act_d, act_ff, sign, rotate: bool, eps: float, kv):
    """A Chain for one-token rows, or None when a weight is not one the chain runs (code).  tail: (wo,
    w_gate, w_up, w_down, ffn_norm) or None; head: (wq, wk, wv, attn_norm) or None; views: the run
    state's rows for MAX_ROWS tokens (None: all of them; model.Views: x, q, k, v, o, g, u, att3); act_d, act_ff: matmul.Act of
    widths D and FF; sign: the rotation signs (rotate: undo it on the attention output).  kv: the head
    layer's attention (any layer's where there is no head): (k_pool, v_pool, the f16 ring rows, cos,
    sin, part (flat), kx, kx_cos, kx_sin, int64 (kcode, kbits, vcode, rcode, page tokens, n_rot),
    float32 (qmul,)) and the idle per-call tuple (see Chain)."""
    if tail is None and head is None:
        return None
    t = tail if tail is not None else (head[0],) * 4 + (head[3],)
    h = head if head is not None else (tail[0],) * 3 + (tail[4],)
    ws = (h[0], h[1], h[2], t[0], t[1], t[2], t[3])
    codes = tuple(code(w) for w in ws)
    if None in codes:
        return None
    mode = (TAIL if tail is not None else 0) | (HEAD if head is not None else 0)
    W = ()
    for w in ws:
        W += (w.qt, w.sc if w.sc is not None else _NO_SC)
    v, a, f = views, act_d, act_ff
    B = (v.att3, sign, v.x, t[4], h[3], v.q, v.k, v.v, v.o, v.g, v.u)
    A = (a.x, a.xq, a.xd, a.xs, a.xf, a.xqk, a.xdk, a.xbk)
    F = (f.x, f.xq, f.xd, f.xs, f.xf, f.xqk, f.xdk, f.xbk)
    (kpool, vpool, kres, cos, sin, part, kx, kcos, ksin, km, qm), idle = kv
    K = (v.q3[:1], v.k3[:1], v.v3[:1], kpool, vpool, kres, kres, cos, sin, sign, part, v.att3[:1], kx, kcos, ksin,
         km, qm)         # the attention stages' one token
    fn = attn_fn((8, 0, 1, bool(rotate)) + idle[:6] + (K,) + idle[6:])   # _attn's argument order
    return Chain(codes, (mode, float(eps), bool(rotate),
                         _chain_args(W, B, A, F, K, fn, np.zeros(SYNC, np.int64))), idle, v.x.shape[0])
