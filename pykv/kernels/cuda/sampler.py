"""Device sampling: a token id from a logits row that stays on the GPU (only the id comes down).

pick(logits, sampler, history, u) gives the same id as the reference pykv.decoder.sampler.Sampler.pick with the
same uniform draw u: repetition penalty (the history's distinct recent ids go up, only when a penalty is
set), then greedy (first maximal logit, NaN never picked) or top-k -> top-p -> min-p -> temperature, in
float64 like the CPU. Top-k is one single-block launch that reads the row a fixed number of times
whatever K is: a radix select of the K-th largest value (4 histogram passes of 8 bits over order-preserving
integer keys), one pass that gathers the values above it and its first ties in index order, and a rank
sort of the <= KMAX candidates (value descending, then id ascending, as K argmax passes would give them).
With top-k off or above KMAX the row is copied to the host and the CPU sampler picks."""
import math

import numpy as np
from numba import cuda

from pykv.kernels.cuda import SIM

KMAX = 256
NT = 32 if SIM else 256     # threads of the one sampling block (the simulator's barriers are slow)
_BUF = {}


@cuda.jit(device=True, inline=True)
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


@cuda.jit(device=True, inline=True)
def _block_argmax(work, sv, si):
    # (max value, its first index) of work, to every thread of the block
    t = cuda.threadIdx.x
    bv = -math.inf
    bi = work.shape[0]
    for j in range(t, work.shape[0], cuda.blockDim.x):
        v = work[j]
        if _better(v, j, bv, bi):
            bv = v
            bi = j
    sv[t] = bv
    si[t] = bi
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s and _better(sv[t + s], si[t + s], sv[t], si[t]):
            sv[t] = sv[t + s]
            si[t] = si[t + s]
        cuda.syncthreads()
        s //= 2
    rv = sv[0]
    ri = si[0]
    cuda.syncthreads()
    return rv, ri


@cuda.jit
def _penalize_kernel(logits, ids, penalty):
    i = cuda.grid(1)
    if i < ids.shape[0]:
        v = logits[ids[i]]
        logits[ids[i]] = v * penalty if v <= 0 else v / penalty


@cuda.jit(device=True, inline=True)
def _key(bits):
    # an unsigned 32-bit key (int64) of the float32 whose bits (int32) are given, in its order (-inf lowest; no NaN)
    b = np.int64(bits) & 0xFFFFFFFF
    return (b ^ 0xFFFFFFFF) if b >= 0x80000000 else (b | 0x80000000)


@cuda.jit(device=True, inline=True)
def _topk(work, wbits, K, hist, cnt, tc, tv, cand, cval):
    """cand/cval[0:K] = the K largest of work (value descending, then index ascending), by the block
    (wbits: work's bits as int32, the same memory):
    a radix select of the K-th largest key, a gather in index order, a rank sort."""
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = work.shape[0]
    prefix = np.int64(0)
    mask = np.int64(0)
    need = K                                   # how many of the keys matching prefix are still wanted
    for shift in range(24, -8, -8):            # 4 passes of 8 bits, high to low
        for b in range(t, 256, nt):
            hist[b] = 0
        cuda.syncthreads()
        for j in range(t, V, nt):
            kk = _key(wbits[j])
            if kk & mask == prefix:
                cuda.atomic.add(hist, (kk >> shift) & 255, 1)
        cuda.syncthreads()
        if t == 0:                             # the bin that holds the need-th largest matching key
            above = 0
            b = 255
            while b > 0 and above + hist[b] < need:
                above += hist[b]
                b -= 1
            cnt[0] = b
            cnt[1] = need - above
        cuda.syncthreads()
        prefix |= np.int64(cnt[0]) << shift
        mask |= np.int64(255) << shift
        need = cnt[1]
        cuda.syncthreads()
    # prefix: the K-th largest key; need: how many of its ties (the first ones by index) are in the top K
    per = (V + nt - 1) // nt                   # thread t gathers the contiguous slice [t*per, (t+1)*per)
    lo = min(V, t * per)
    hi = min(V, lo + per)
    ng = 0
    ne = 0
    for j in range(lo, hi):
        kk = _key(wbits[j])
        if kk > prefix:
            ng += 1
        elif kk == prefix:
            ne += 1
    cnt[2 + t] = ng
    cnt[2 + nt + t] = ne
    cuda.syncthreads()
    if t == 0:                                 # exclusive prefix sums: each slice's first slot
        a = 0
        e = 0
        for i in range(nt):
            x = cnt[2 + i]
            y = cnt[2 + nt + i]
            cnt[2 + i] = a
            cnt[2 + nt + i] = e
            a += x
            e += y
    cuda.syncthreads()
    og = cnt[2 + t]
    oe = cnt[2 + nt + t]
    first_tie = K - need                       # the ties' slots follow the K - need larger values
    for j in range(lo, hi):
        v = work[j]
        kk = _key(wbits[j])
        if kk > prefix:
            tc[og] = j
            tv[og] = v
            og += 1
        elif kk == prefix:
            if oe < need:
                tc[first_tie + oe] = j
                tv[first_tie + oe] = v
            oe += 1
    cuda.syncthreads()
    for c in range(t, K, nt):                  # rank sort: the candidates better than c
        v = tv[c]
        i = tc[c]
        r = 0
        for c2 in range(K):
            if _better(tv[c2], tc[c2], v, i):
                r += 1
        cand[r] = i
        cval[r] = v
    cuda.syncthreads()


@cuda.jit
def _sample_kernel(logits, work, wbits, K, temp, top_p, min_p, u, cand, cval, tc, tv, cnt, out):
    """out[0] = the sampled id (K == 0: greedy). cand/cval (KMAX,): the top-K ids / logits, descending.
    tc / tv (KMAX,), cnt (2 + 2 * blockDim,): _topk's scratch."""
    t = cuda.threadIdx.x
    sv = cuda.shared.array(NT, np.float32)
    si = cuda.shared.array(NT, np.int64)
    hist = cuda.shared.array(256, np.int32)
    for j in range(t, logits.shape[0], cuda.blockDim.x):
        v = logits[j]
        work[j] = -math.inf if math.isnan(v) else (np.float32(0.0) if v == 0 else v)   # -0.0: +0.0's key
    cuda.syncthreads()
    if K == 0:
        bv, bi = _block_argmax(work, sv, si)
        if t == 0:
            out[0] = bi
        return
    _topk(work, wbits, K, hist, cnt, tc, tv, cand, cval)
    if t != 0:
        return
    vmax = np.float64(cval[0])
    flat = vmax == -math.inf          # everything masked: uniform over what is left
    if flat:
        vmax = 0.0
    use_top_p = top_p < 1.0
    z = 0.0
    if use_top_p:
        for k in range(K):
            z += math.exp((0.0 if flat else np.float64(cval[k])) - vmax)
    m = K
    if min_p > 0.0:
        lim = vmax + math.log(min_p)
        m = 0
        for k in range(K):
            if (0.0 if flat else np.float64(cval[k])) >= lim:
                m += 1
    if use_top_p and m > 1:
        cum = 0.0
        for k in range(m):
            cum += math.exp((0.0 if flat else np.float64(cval[k])) - vmax)
            if cum / z >= top_p:
                m = min(m, k + 1)
                break
    if m == 1:
        out[0] = cand[0]
        return
    tot = 0.0
    for k in range(m):
        tot += math.exp(((0.0 if flat else np.float64(cval[k])) - vmax) / temp)
    r = u * tot
    c = 0.0
    j = m - 1
    for k in range(m):
        c += math.exp(((0.0 if flat else np.float64(cval[k])) - vmax) / temp)
        if c > r:
            j = k
            break
    out[0] = cand[j]


def _bufs(V):
    if _BUF.get("V") != V:
        work = cuda.device_array(V, np.float32)
        _BUF.update(V=V, work=work, wbits=work.view(np.int32), cand=cuda.device_array(KMAX, np.int64),
                    cval=cuda.device_array(KMAX, np.float32), out=cuda.device_array(1, np.int64),
                    tc=cuda.device_array(KMAX, np.int64), tv=cuda.device_array(KMAX, np.float32),
                    cnt=cuda.device_array(2 + 2 * NT, np.int32))
    return _BUF


def pick(logits, sampler, history, u: float) -> int:
    """The token sampler.pick would choose from the device row logits (V,) for the uniform draw u.
    The repetition penalty is applied to `logits` in place."""
    p = sampler.params
    V = logits.size
    logits = logits.reshape(V)
    n = p.repeat_last_n
    if p.repeat_penalty != 1.0 and n != 0 and len(history):
        recent = np.unique(np.asarray(history if n < 0 else history[-n:], np.int64))
        recent = recent[(recent >= 0) & (recent < V)]
        if recent.size:
            _penalize_kernel[-(-recent.size // 128), 128](logits, cuda.to_device(recent), np.float32(p.repeat_penalty))
    if p.temperature <= 0:
        K = 0
    else:
        K = int(p.top_k)
        if not 0 < K <= min(KMAX, V - 1):      # the whole row is a candidate: the CPU sampler picks
            host = logits.copy_to_host()
            params = type(p)(**{**p.__dict__, "repeat_penalty": 1.0})
            return type(sampler)(params, V).pick(host, history, u)
    b = _bufs(V)
    _sample_kernel[1, NT](logits, b["work"], b["wbits"], K, np.float64(p.temperature), np.float64(p.top_p),
                          np.float64(p.min_p), np.float64(u), b["cand"], b["cval"], b["tc"], b["tv"], b["cnt"],
                          b["out"])
    return int(b["out"].copy_to_host()[0])
