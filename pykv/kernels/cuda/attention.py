"""numba.cuda twin of kernels.attention: fused attention over the paged, block-quantized KV cache in
the flash-decoding shape.

    attend(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, P,
           kcode, kbits, vcode, rcode, chunk, part, out)          the CPU's arguments, device arrays
    attend_batch(q (S, H, HD), kpool, vpool, kres (S, KVH, RING, 2*HD), vres, ksink (S, KVH, NS, 2*HD),
                 vsink, page_tables (S, max_pages) int32, meta (S, 5) int32, P, kcode, kbits, vcode,
                 rcode, chunk, part (S, KVH, C, G, HD + 2), out (S, H, HD))
        one decode query (T = 1) for each of S sequences of one layer's pools, in ONE launch (the merge
        included): sequence s holds meta[s] = (n_tokens incl. the query's, ns_k, ns_v, nq_k, nq_v), the
        KVCache.attend quantities; C >= ceil(max n_tokens / chunk); chunks past a shorter sequence's
        end write empty partials (l = 0) that the merge skips.

Layout.  Kernel 1 runs one thread block per (chunk c of `chunk` keys, KV head g, query block) (grid
(C, KVH, query blocks); attend_batch: (C, KVH, S)).  Its query rows are the query block's tokens x
the G = H / KVH heads of the KV group (at most RMAX rows; decode: the G heads).  The block walks its
keys in tiles of at most TILE tokens that stay inside one page and on one side of the sink / pool /
f16-residual boundaries (the CPU's segments); per tile:
  1. the tile's K and V rows are decoded ONCE into shared memory for all query rows, one thread per
     (row, piece of 32 values; 64 for the nl types), by kernels.blocks' own decoders (deq_unit / deq_kivi_k_unit: the sink
     and KIVI residual rows are f16, the pool rows any KV format, KIVI keys per-channel pages);
  2. scores, one thread per (query row, key): dot over HD in shared memory (rows padded to HD + 1
     floats: no bank conflicts);
  3. online softmax, one thread per query row: (max, sum) updated, the tile's scores turned into
     weights, the rescale factor kept;
  4. acc, one thread per (query row, channel): acc = acc * rescale + sum_r p[r] * V[r].
The block writes (max, sum, acc) per query row to part (T, KVH, C, G, HD + 2), the CPU's layout.
The merge is in the same launch: a block that has written its partials takes a ticket (an integer
atomic per query block and KV head, after a fence), and the last of the C chunk blocks combines the C
partials of its rows with log-sum-exp weights into out (one launch per attention; the merge's order is
fixed, no float atomics).  There is no warp shuffle anywhere (every reduction is a loop of one thread over
shared memory), so the simulator and a GPU run the same code.

Rotation, key smoothing and sinks need nothing here: queries and keys arrive rotated / smoothed
(ops.qkv_prep), the sink and residual rows and the boundaries ns_* / nq_* come from the cache, as on
the CPU.  Limits: head_dim <= HDMAX, G <= RMAX (a one-line PykvError otherwise).
"""
import math

import numpy as np
from numba import cuda, float32, njit

from pykv.files.config import PykvError
from pykv.kernels.blocks import deq_kivi_k_unit, deq_unit
from pykv.kernels.kvquant import row_units
from pykv.kernels.cuda.shared import SIM, dev

TILE = 16         # keys per tile (K and V decoded once into shared memory for all query rows)
HDMAX = 128       # largest head_dim the shared tiles hold
RMAX = 16         # query rows (query tokens x heads of one KV group) per block
NT = 8 if SIM else 128    # threads per block (the simulator runs each thread as a Python thread)
HP = HDMAX + 1    # shared row stride bound (rows are HD + 1 floats: no bank conflicts)
_KT = TILE * HP   # shared array sizes (compile-time constants)
_QS = RMAX * HDMAX
_SC = RMAX * TILE


@njit(cache=True)
def _dot(a, ao, b, bo, n):
    """sum_i a[ao + i] * b[bo + i], i < n (float32)."""
    s = np.float32(0.0)
    for i in range(n):
        s += a[ao + i] * b[bo + i]
    return s


@njit(cache=True)
def _wsum(p, po, vt, vo, stride, n):
    """sum_r p[po + r] * vt[vo + r * stride], r < n (float32): one channel of the weighted V tile."""
    s = np.float32(0.0)
    for r in range(n):
        s += p[po + r] * vt[vo + r * stride]
    return s


_d_dot = dev(_dot)
_d_wsum = dev(_wsum)
_d_unit = dev(deq_unit)
_d_kivi = dev(deq_kivi_k_unit)
_d_units = dev(row_units)


@cuda.jit(device=True)
def _chunk(q, t0, t1, n_past, g, c, j0, j1, kpool, vpool, kres, vres, ksink, vsink, page_table,
           ns_k, ns_v, nq_k, nq_v, P, kcode, kbits, vcode, rcode, part):
    """Keys [j0, j1) for query tokens [t0, t1) (q's rows) and the G heads of KV head g -> part[t, g, c]
    (max, sum, acc) per query row."""
    # the block's shared scratch: decoded key / value tiles, queries, accumulators, scores, row stats
    kt = cuda.shared.array(_KT, float32)
    vt = cuda.shared.array(_KT, float32)
    qs = cuda.shared.array(_QS, float32)
    acc = cuda.shared.array(_QS, float32)
    s = cuda.shared.array(_SC, float32)
    ms = cuda.shared.array(RMAX, float32)
    ls = cuda.shared.array(RMAX, float32)
    cs = cuda.shared.array(RMAX, float32)
    tid = cuda.threadIdx.x
    H = q.shape[1]
    HD = q.shape[2]
    G = H // kpool.shape[0]
    R = (t1 - t0) * G
    ST = HD + 1
    for u in range(tid, R * HD, NT):
        x = u // HD
        qs[u] = q[t0 + x // G, g * G + x % G, u % HD]
        acc[u] = 0.0
    for x in range(tid, R, NT):
        ms[x] = -math.inf
        ls[x] = 0.0
    rbk = kpool.shape[2] // P
    rbv = vpool.shape[2] // P
    RING = kres.shape[1]
    nur = _d_units(rcode, HD)
    cuda.syncthreads()
    j = j0
    while j < j1:
        pg = j // P
        sp = j - pg * P
        e = min(j1, (pg + 1) * P, j + TILE)
        if j < nq_k:
            e = min(e, nq_k)
        if j < nq_v:
            e = min(e, nq_v)
        if j < ns_k:
            e = min(e, ns_k)
        if j < ns_v:
            e = min(e, ns_v)
        n = e - j
        page = page_table[pg] if (j < nq_k or j < nq_v) else 0
        # 1. decode the K and V rows of the tile once
        if j < ns_k or j >= nq_k:
            nuk = nur
        elif kbits > 0:
            nuk = HD // 32
        else:
            nuk = _d_units(kcode, HD)
        for u in range(tid, n * nuk, NT):
            r = u // nuk
            b = u % nuk
            if j < ns_k:
                _d_unit(rcode, ksink[g, j + r], 0, b, HD, kt, r * ST)
            elif j >= nq_k:
                _d_unit(rcode, kres[g, (j + r) % RING], 0, b, HD, kt, r * ST)
            elif kbits > 0:
                _d_kivi(kbits, kpool[g, page], sp + r, b, HD, kt, r * ST)
            else:
                _d_unit(kcode, kpool[g, page], (sp + r) * rbk, b, HD, kt, r * ST)
        nuv = nur if (j < ns_v or j >= nq_v) else _d_units(vcode, HD)
        for u in range(tid, n * nuv, NT):
            r = u // nuv
            b = u % nuv
            if j < ns_v:
                _d_unit(rcode, vsink[g, j + r], 0, b, HD, vt, r * ST)
            elif j >= nq_v:
                _d_unit(rcode, vres[g, (j + r) % RING], 0, b, HD, vt, r * ST)
            else:
                _d_unit(vcode, vpool[g, page], (sp + r) * rbv, b, HD, vt, r * ST)
        cuda.syncthreads()
        # 2. scores of the keys each query row may see (causal: key j + r <= n_past + its token)
        for u in range(tid, R * n, NT):
            x = u // n
            r = u % n
            if j + r <= n_past + t0 + x // G:
                s[x * TILE + r] = _d_dot(qs, x * HD, kt, r * ST, HD)
        cuda.syncthreads()
        # 3. online softmax per query row
        for x in range(tid, R, NT):
            nv = min(n, n_past + t0 + x // G + 1 - j)
            mo = ms[x]
            mx = mo
            for r in range(nv):
                mx = max(mx, s[x * TILE + r])
            corr = float32(1.0)
            lsum = float32(0.0)
            if nv > 0:
                corr = math.exp(mo - mx)
                for r in range(nv):
                    p = math.exp(s[x * TILE + r] - mx)
                    s[x * TILE + r] = p
                    lsum += p
                ms[x] = mx
            for r in range(max(nv, 0), n):
                s[x * TILE + r] = 0.0
            ls[x] = ls[x] * corr + lsum
            cs[x] = corr
        cuda.syncthreads()
        # 4. acc = acc * rescale + p . V
        for u in range(tid, R * HD, NT):
            x = u // HD
            acc[u] = acc[u] * cs[x] + _d_wsum(s, x * TILE, vt, u % HD, ST, n)
        cuda.syncthreads()
        j = e
    W = HD + 2
    for u in range(tid, R * W, NT):
        x = u // W
        i = u % W
        t = t0 + x // G
        gi = x % G
        if i == 0:
            part[t, g, c, gi, 0] = ms[x]
        elif i == 1:
            part[t, g, c, gi, 1] = ls[x]
        else:
            part[t, g, c, gi, i] = acc[x * HD + i - 2]
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _merge_th(part, C, G, t, h, out):
    """out[t, h] = the C chunks' partials of part merged with log-sum-exp weights (chunks with sum 0
    saw no key), by the block's threads."""
    g = h // G
    gi = h % G
    mx = float32(-math.inf)
    for c in range(C):
        if part[t, g, c, gi, 1] > 0.0:
            mx = max(mx, part[t, g, c, gi, 0])
    lsum = float32(0.0)
    for c in range(C):
        if part[t, g, c, gi, 1] > 0.0:
            lsum += part[t, g, c, gi, 1] * math.exp(part[t, g, c, gi, 0] - mx)
    for i in range(cuda.threadIdx.x, out.shape[2], NT):
        a = float32(0.0)
        for c in range(C):
            if part[t, g, c, gi, 1] > 0.0:
                a += part[t, g, c, gi, 2 + i] * math.exp(part[t, g, c, gi, 0] - mx)
        out[t, h, i] = a / lsum


@cuda.jit(device=True, inline=True)
def _last(tickets, i, n):
    """True in every thread of the block that is the last of n blocks to reach ticket i (it sets the
    ticket back to 0 for the next launch): that block merges the partials the n wrote.  Integer atomics
    and fences only (no float atomics: the merge's order is fixed)."""
    flag = cuda.shared.array(1, np.int32)
    cuda.threadfence()          # this block's partials are visible to the whole device ...
    cuda.syncthreads()          # ... for every thread, before the block takes its ticket
    if cuda.threadIdx.x == 0:
        flag[0] = 1 if cuda.atomic.add(tickets, i, 1) == n - 1 else 0
        if flag[0]:
            tickets[i] = 0
    cuda.syncthreads()
    if flag[0]:
        cuda.threadfence()
    return flag[0] != 0


@cuda.jit(device=True, inline=True)
def _merge_group(part, C, G, t0, t1, g, out):
    # out[t, g * G + gi] for the query tokens [t0, t1) and the G heads of KV head g
    for t in range(t0, t1):
        for gi in range(G):
            _merge_th(part, C, G, t, g * G + gi, out)


@cuda.jit
def _attend_kernel(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v,
                   P, kcode, kbits, vcode, rcode, chunk, QB, part, tickets, out):
    c = cuda.blockIdx.x
    g = cuda.blockIdx.y
    t0 = cuda.blockIdx.z * QB
    t1 = min(t0 + QB, q.shape[0])
    j0 = c * chunk
    j1 = min(j0 + chunk, n_past + t1)
    _chunk(q, t0, t1, n_past, g, c, j0, j1, kpool, vpool, kres, vres, ksink, vsink, page_table,
           ns_k, ns_v, nq_k, nq_v, P, kcode, kbits, vcode, rcode, part)
    C = cuda.gridDim.x
    if _last(tickets, cuda.blockIdx.z * cuda.gridDim.y + g, C):
        _merge_group(part, C, q.shape[1] // kpool.shape[0], t0, t1, g, out)


@cuda.jit
def _batch_kernel(q, kpool, vpool, kres, vres, ksink, vsink, page_tables, meta, P, kcode, kbits, vcode,
                  rcode, chunk, part, tickets, out):
    c = cuda.blockIdx.x
    g = cuda.blockIdx.y
    sq = cuda.blockIdx.z
    n = meta[sq, 0]
    j0 = c * chunk
    j1 = min(j0 + chunk, n)
    _chunk(q[sq:sq + 1], 0, 1, n - 1, g, c, j0, j1, kpool, vpool, kres[sq], vres[sq], ksink[sq], vsink[sq],
           page_tables[sq], meta[sq, 1], meta[sq, 2], meta[sq, 3], meta[sq, 4], P, kcode, kbits, vcode,
           rcode, part[sq:sq + 1])
    C = cuda.gridDim.x
    if _last(tickets, sq * cuda.gridDim.y + g, C):
        _merge_group(part[sq:sq + 1], C, q.shape[1] // kpool.shape[0], 0, 1, g, out[sq:sq + 1])


@cuda.jit
def _seqs_kernel(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits,
                 vcode, rcode, part, tickets, out):
    """One block per work item items[i] = (sequence s, item of its attend: KV head x chunk), each with
    its sequence's own chunk (meta[s]): the CPU's attend_seqs items; s's partials in part[s]; the last
    of s's C items of KV head g merges them into out[s]."""
    i = cuda.blockIdx.x
    s = items[i, 0]
    it = items[i, 1]
    n_past = meta[s, 0]
    chunk = meta[s, 1]
    C = (n_past + chunk) // chunk
    c = it % C
    g = it // C
    j0 = c * chunk
    j1 = min(j0 + chunk, n_past + 1)
    _chunk(q[s], 0, 1, n_past, g, c, j0, j1, kpool, vpool, kres, vres, sinks[s, li, 0], sinks[s, li, 1],
           page_tables[s], ns_k, ns_v, n_past + 1, n_past + 1, P, kcode, kbits, vcode, rcode, part[s:s + 1])
    if _last(tickets, s * kpool.shape[0] + g, C):
        _merge_group(part[s:s + 1], C, q.shape[2] // kpool.shape[0], 0, 1, g, out[s])


_TICKETS = {}


def _tickets(n: int):
    """Zeroed int32 device counters, at least n (each kernel leaves its tickets at 0 again)."""
    t = _TICKETS.get("t")
    if t is None or t.shape[0] < n:
        t = _TICKETS["t"] = cuda.to_device(np.zeros(max(int(n), 1024), np.int32))
    return t


def _check(HD, G):
    if HD > HDMAX or G > RMAX:
        raise PykvError(f"cuda attention supports head_dim <= {HDMAX} and <= {RMAX} query heads per KV head "
                        f"(got head_dim {HD}, {G})")


def attend_seqs(q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P, kcode, kbits,
                vcode, rcode, part, out, kx=None, cos=None, sin=None) -> None:
    """attention.attend_seqs on the device: q (S, 1, H, HD) -> out (S, 1, H, HD) in one launch for
    all S sequences (the items, the last of each sequence's items merging), each sequence with its own chunk; meta (S, 3) and items
    (N, 2) as the CPU's, device arrays (KVCache.decode_group puts them there); part (S, KVH, C, G, HD + 2)
    with C the most chunks of a sequence (meta's offsets unused)."""
    if kx is not None:
        raise PykvError("pre-RoPE keys run on the CPU only for now")
    S, H, HD = q.shape[0], q.shape[2], q.shape[3]
    KVH = kpool.shape[0]
    _check(HD, H // KVH)
    _seqs_kernel[items.shape[0], NT](q, kpool, vpool, kres, vres, sinks, li, ns_k, ns_v, page_tables, meta, items, P,
                                     kcode, kbits, vcode, rcode, part, _tickets(S * KVH), out)


def attend(q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past, ns_k, ns_v, nq_k, nq_v, wk, wv, P,
           kcode, kbits, vcode, rcode, chunk, part, out, kx=None, cos=None, sin=None) -> None:
    """q (T, H, HD) f32, already scaled by 1/sqrt(HD); out (T, H, HD) f32; the CPU attend's arguments
    and semantics (kernels.attention.attend), without pre-RoPE keys (kx: None).  part: f32 (T, KVH, C,
    G, HD + 2), C >= ceil((n_past + T) / chunk).  The token-adaptive window is CPU-only for now (KVCache
    refuses it here): wk = wv = 0."""
    if kx is not None:
        raise PykvError("pre-RoPE keys run on the CPU only for now")
    if wk or wv:
        raise PykvError("the KV window (--kv-window) runs on the CPU only for now")
    T, H, HD = q.shape
    KVH = kpool.shape[0]
    G = H // KVH
    _check(HD, G)
    C = (n_past + T + chunk - 1) // chunk
    QB = min(T, RMAX // G)
    NB = (T + QB - 1) // QB
    _attend_kernel[(C, KVH, NB), NT](q, kpool, vpool, kres, vres, ksink, vsink, page_table, n_past,
                                     ns_k, ns_v, nq_k, nq_v, P, kcode, kbits, vcode, rcode, chunk, QB, part,
                                     _tickets(NB * KVH), out)


def attend_batch(q, kpool, vpool, kres, vres, ksink, vsink, page_tables, meta, P, kcode, kbits, vcode,
                 rcode, chunk, part, out, kx=None, cos=None, sin=None) -> None:
    """One decode query per sequence, S sequences in one launch (see the module docstring)."""
    if kx is not None:
        raise PykvError("pre-RoPE keys run on the CPU only for now")
    S, H, HD = q.shape
    KVH = kpool.shape[0]
    G = H // KVH
    _check(HD, G)
    C = part.shape[2]
    _batch_kernel[(C, KVH, S), NT](q, kpool, vpool, kres, vres, ksink, vsink, page_tables, meta, P,
                                   kcode, kbits, vcode, rcode, chunk, part, _tickets(S * KVH), out)
