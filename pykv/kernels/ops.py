"""Small elementwise / row kernels of the decoder (CPU). Shapes in comments: T tokens, D width."""
import numpy as np
from numba import njit, prange

from pykv.kernels.simd import bits_f32, fwht


# Row kernels split their tokens over the threads from this many on (prefill); fewer (a decode step) run
# on the calling thread: waking the others costs more than the rows.  kernels.chain calls the _row forms:
# compiled once (not inlined) so that the chain and the separate calls run the same code, bit for bit.
PAR_T = 16


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", inline="always")
def _rmsnorm_row(x, w, eps, out, t):
    D = x.shape[1]
    ss = 0.0
    for i in range(D):
        ss += x[t, i] * x[t, i]
    r = 1.0 / np.sqrt(ss / D + eps)
    for i in range(D):
        out[t, i] = x[t, i] * r * w[i]


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def rmsnorm(x, w, eps, out):
    # x (T, D) f32, w (D,) f32 -> out (T, D)
    for t in range(x.shape[0]):
        _rmsnorm_row(x, w, eps, out, t)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _rope_vec(v, p, cos, sin, n_rot):
    # llama.cpp rope mode 0 (LLAMA GGUFs): adjacent pairs (2i, 2i+1) rotate by p * base^(-2i/n_rot)
    for i in range(n_rot // 2):
        c = cos[p, i]
        s = sin[p, i]
        a = v[2 * i]
        b = v[2 * i + 1]
        v[2 * i] = a * c - b * s
        v[2 * i + 1] = a * s + b * c


@njit(cache=True, nogil=True, fastmath=True)
def rope(x, pos0, cos, sin, n_rot):
    # x (T, nh, HD) f32, rotated in place at positions pos0 + t; cos/sin (n_ctx, n_rot/2).
    T, nh, HD = x.shape
    for t in range(T):
        for h in range(nh):
            _rope_vec(x[t, h], pos0 + t, cos, sin, n_rot)


@njit(cache=True, nogil=True, fastmath=True)
def add_inplace(x, y):
    # x (T, D) += y (T, D)
    T, D = x.shape
    for t in range(T):
        for i in range(D):
            x[t, i] += y[t, i]


def rope_tables(n_ctx, n_rot, base, freq_scale=1.0, freq_factors=None, ext_factor=0.0, attn_factor=1.0,
                beta_fast=32.0, beta_slow=1.0, n_ctx_orig=0):
    """cos/sin (n_ctx, n_rot/2) float32 of ggml's rope_ext (computed in float64), arguments as ggml names them:
    pair i at position p turns by theta = p * base^(-2i/n_rot) / freq_factors[i] (freq_factors (n_rot/2,):
    llama3's rope_freqs.weight; None = 1), interpolated as freq_scale * theta (linear: 1/factor).
    YaRN (ext_factor != 0): pairs below the correction range [lo, hi] (from beta_fast/beta_slow and n_ctx_orig)
    keep theta, pairs above it take freq_scale * theta, a linear ramp between, and cos/sin are multiplied by
    attn_factor * (1 + 0.1 ln(1/freq_scale))."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    theta = np.arange(n_ctx, dtype=np.float64)[:, None] * (base ** (-2.0 * i / n_rot))[None, :]
    if freq_factors is not None:
        theta /= np.asarray(freq_factors, np.float64)[None, :]
    mscale = float(attn_factor)
    if ext_factor != 0.0:
        lo, hi = rope_yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow)
        ramp = (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)) * ext_factor    # (n_rot/2,)
        theta = theta * (freq_scale * (1.0 - ramp) + ramp)[None, :]
        mscale *= 1.0 + 0.1 * np.log(1.0 / freq_scale)
    else:
        theta *= freq_scale
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def rope_yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims: the pair range [lo, hi] over which YaRN ramps from extrapolation to
    interpolation; a pair turning beta times over n_ctx_orig positions sits at n_rot ln(n_ctx_orig / (2 pi beta)) / (2 ln base)."""
    def corr_dim(n_turns):
        return n_rot * np.log(n_ctx_orig / (n_turns * 2.0 * np.pi)) / (2.0 * np.log(base))
    return max(0.0, float(np.floor(corr_dim(beta_fast)))), min(n_rot - 1.0, float(np.ceil(corr_dim(beta_slow))))


@njit(cache=True, nogil=True, inline="always")
def _butterfly(v):
    # unnormalised Walsh-Hadamard butterfly of a power-of-two length vector, in place
    n = v.shape[0]
    span = 1
    while span < n:
        for i0 in range(0, n, 2 * span):
            for i in range(i0, i0 + span):
                a = v[i]
                b = v[i + span]
                v[i] = a + b
                v[i + span] = a - b
        span *= 2


@njit(cache=True, nogil=True, inline="always")
def _fwht_vec(v, sign, inverse):
    # Forward: v <- H·diag(sign)·v / sqrt(HD) (orthonormal, HD a power of two); inverse:
    # v <- diag(sign)·H·v / sqrt(HD). The rotation that spreads KV outliers.  simd.fwht: the same bits
    # as _fwht_loops, as whole-vector IR, for the usual head dims.
    if not fwht(v, sign, inverse):
        _fwht_loops(v, sign, inverse)


@njit(cache=True, nogil=True, inline="always")
def _fwht_loops(v, sign, inverse):
    # _fwht_vec as scalar loops: the butterfly, the scaling in float64
    HD = v.shape[0]
    norm = 1.0 / np.sqrt(HD)
    if not inverse:
        for i in range(HD):
            v[i] *= sign[i]
    _butterfly(v)
    for i in range(HD):
        v[i] *= norm * sign[i] if inverse else norm


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def qkv_prep(q, k, v, pos0, cos, sin, n_rot, do_rope, shift, scale, smooth, sign, rotate, qmul):
    """Everything between the Q/K/V matmuls and the cache, in one call (decode is dispatch-bound):
    q (T, H, HD), k, v (T, KVH, HD) f32 in place, per token t at position pos0 + t:
      rope on q and k (if do_rope);
      key smoothing (if smooth): k = (k - shift) / scale, and each query head of KV group g times
          scale[g] (shift, scale: (KVH, HD)), so q.k changes only by a per-query constant;
      Hadamard rotation of q, k and v (if rotate, with the fixed signs `sign`);
      q *= qmul (the 1/sqrt(HD) softmax scale)."""
    T, H, HD = q.shape
    KVH = k.shape[1]
    G = H // KVH
    for t in range(T):
        p = pos0 + t
        for g in range(KVH):
            kv = k[t, g]
            if do_rope:
                _rope_vec(kv, p, cos, sin, n_rot)
            if smooth:
                for i in range(HD):
                    kv[i] = (kv[i] - shift[g, i]) / scale[g, i]
            if rotate:
                _fwht_vec(kv, sign, False)
                _fwht_vec(v[t, g], sign, False)
            for gi in range(G):
                qv = q[t, g * G + gi]
                if do_rope:
                    _rope_vec(qv, p, cos, sin, n_rot)
                if smooth:
                    for i in range(HD):
                        qv[i] *= scale[g, i]
                if rotate:
                    _fwht_vec(qv, sign, False)
                for i in range(HD):
                    qv[i] *= qmul


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def qkv_prep_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul):
    """qkv_prep for a step of S one-token sequences (batched decode) in one call: row s (q (S, H, HD),
    k, v (S, KVH, HD)) is at position pos[s] with its sequence's key smoothing shift[s, li], scale[s, li]
    ((S, L, KVH, HD)); each row runs qkv_prep's own code, so its bits are the sequence's own step's."""
    for s in range(q.shape[0]):
        _qkv_prep_seq(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, s)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", inline="always")
def _qkv_prep_seq(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul, s):
    """qkv_prep_seqs' row s (kvquant.prep_append_seqs runs the rows on the threads)."""
    qkv_prep(q[s:s + 1], k[s:s + 1], v[s:s + 1], pos[s], cos, sin, n_rot, np.bool_(True), shift[s, li], scale[s, li],
             smooth, sign, rotate, qmul)


@njit(cache=True, nogil=True, fastmath=True)
def key_xform(q, k, mk, mq, mu):
    """klt key layers (pykv.kv.transform), after qkv_prep: k[t, g] = mk[g] @ (k[t, g] - mu[g]) and each
    query head of KV group g q = mq[g] @ q, in place (mq[g] = mk[g]^-T: q.k changes by a per-query
    constant).  q (T, H, HD), k (T, KVH, HD), mk, mq (KVH, HD, HD), mu (KVH, HD) f32."""
    T, H, HD = q.shape
    KVH = k.shape[1]
    G = H // KVH
    tmp = np.empty(HD, np.float32)
    for t in range(T):
        for g in range(KVH):
            kv = k[t, g]
            for j in range(HD):
                tmp[j] = kv[j] - mu[g, j]
            for i in range(HD):
                acc = np.float32(0.0)
                for j in range(HD):
                    acc += mk[g, i, j] * tmp[j]
                kv[i] = acc
            for gi in range(G):
                qv = q[t, g * G + gi]
                for j in range(HD):
                    tmp[j] = qv[j]
                for i in range(HD):
                    acc = np.float32(0.0)
                    for j in range(HD):
                        acc += mq[g, i, j] * tmp[j]
                    qv[i] = acc


# ---- fused producers of a matmul activation (decode is launch / dispatch bound: one call each
# instead of two or three).  X (>=T, D) and XF (>=T, D // 32) are a matmul Act's float rows and block
# sums (Act.x, Act.xf; call Act.mark(T) afterwards).

@njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, inline="always")
def exp_neg(x):
    """exp(x) for x <= 0 (softmax weights, SiLU): Cody-Waite reduction + a degree-5 minimax polynomial, <= 1.1 ulp;
    branch-free so a loop of it vectorizes.  x < -87 (or -inf) gives 0."""
    xc = max(x, np.float32(-87.0))
    k = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - k * np.float32(0.693359375)             # ln 2 in two parts (Cody-Waite)
    r = r + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)                  # Cephes expf's minimax polynomial: <= 1.1 ulp here
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    e = bits_f32(np.uint32((np.int32(k) + 127) << 23))
    return p * e if x >= np.float32(-87.0) else np.float32(0.0)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _block_sums(X, XF, t):
    for b in range(XF.shape[1]):
        s = np.float32(0.0)
        for j in range(32):
            s += X[t, 32 * b + j]
        XF[t, b] = s


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def rmsnorm_act_row(x, w, eps, X, XF, t):
    # X[t] = rmsnorm(x[t]) * w, XF[t] its block sums
    _rmsnorm_row(x, w, eps, X, t)
    _block_sums(X, XF, t)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def add_rmsnorm_act_row(x, y, w, eps, X, XF, t):
    # x[t] += y[t]; X[t] = rmsnorm(x[t]) * w, XF[t] its block sums
    for i in range(x.shape[1]):
        x[t, i] += y[t, i]
    rmsnorm_act_row(x, w, eps, X, XF, t)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def swiglu_act_row(g, u, X, XF, t):
    # X[t] = silu(g[t]) * u[t], XF[t] its block sums
    for i in range(g.shape[1]):
        a = g[t, i]
        e = exp_neg(-abs(a))               # silu(a) = a / (1 + exp(-a)), from exp(-|a|) <= 1
        X[t, i] = (a if a >= np.float32(0.0) else a * e) / (np.float32(1.0) + e) * u[t, i]
    _block_sums(X, XF, t)


@njit(cache=True, nogil=True)
def attn_out_act_row(att, sign, rotate, X, XF, t):
    # att[t] (H, HD): each head rotated back (if rotate) in place; X[t] = att[t] as (H*HD,), XF[t] its block sums
    H, HD = att.shape[1], att.shape[2]
    for h in range(H):
        if rotate:
            _fwht_vec(att[t, h], sign, True)
        for i in range(HD):
            X[t, h * HD + i] = att[t, h, i]
    _block_sums(X, XF, t)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", parallel=True)
def rmsnorm_act(x, w, eps, X, XF):
    # X[:T] = rmsnorm(x) * w, XF its block sums
    T = x.shape[0]
    if T >= PAR_T:
        for t in prange(T):
            rmsnorm_act_row(x, w, eps, X, XF, np.int64(t))   # int64, as below: one specialization
    else:
        for t in range(T):
            rmsnorm_act_row(x, w, eps, X, XF, t)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", parallel=True)
def add_rmsnorm_act(x, y, w, eps, X, XF):
    # x += y; X[:T] = rmsnorm(x) * w, XF its block sums
    T = x.shape[0]
    if T >= PAR_T:
        for t in prange(T):
            add_rmsnorm_act_row(x, y, w, eps, X, XF, np.int64(t))   # int64, as below: one specialization
    else:
        for t in range(T):
            add_rmsnorm_act_row(x, y, w, eps, X, XF, t)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", parallel=True)
def swiglu_act(g, u, X, XF):
    # X[:T] = silu(g) * u, XF its block sums
    T = g.shape[0]
    if T >= PAR_T:
        for t in prange(T):
            swiglu_act_row(g, u, X, XF, np.int64(t))   # int64, as below: one specialization
    else:
        for t in range(T):
            swiglu_act_row(g, u, X, XF, t)


@njit(cache=True, nogil=True, parallel=True)
def attn_out_act(att, sign, rotate, X, XF):
    # att (T, H, HD): each head rotated back (if rotate) in place; X[:T] = att as (T, H*HD), XF its block sums
    T = att.shape[0]
    if T >= PAR_T:
        for t in prange(T):
            attn_out_act_row(att, sign, rotate, X, XF, np.int64(t))   # int64, as below: one specialization
    else:
        for t in range(T):
            attn_out_act_row(att, sign, rotate, X, XF, t)
