"""GPU twin of kernels/ops.py: the small row kernels of the decoder, same names and arguments, one
launch each. Block layouts: a token row per block (rmsnorm*, 128 threads, shared-memory sums), a KV
group per block (qkv_prep: HD threads; rope, smoothing and the Hadamard butterflies in shared memory),
a head per block (attn_out_act). X / XF: a matmul Act's rows and 32-block sums, as on the CPU."""
import math

import numpy as np
from numba import cuda

from pykv.kernels.cuda import SIM, block_sum, grid

HDMAX = 256     # largest head_dim the shared-memory vector kernels take
NT = 32 if SIM else 128     # threads of the row kernels (a power of two, a multiple of 32)
f32 = np.float32


@cuda.jit
def _fill_zero_kernel(a):
    i = cuda.grid(1)
    while i < a.shape[0]:       # grid-stride
        a[i] = 0
        i += cuda.gridsize(1)


def fill_zero(a) -> None:
    """a[...] = 0 (any shape, contiguous).  Under the simulator the zeros are copied from the host: it
    runs a kernel's every thread as a Python thread, and zeroing the scratch and cache arrays that way
    took most of the CUDA tests' time (tests/cuda/test_cuda_ops.py runs the kernel itself there)."""
    flat = a.reshape(a.size)
    if not a.size:
        return
    if SIM:
        flat.copy_to_device(np.zeros(a.size, a.dtype))
    else:
        _fill_zero_kernel[grid(a.size, 256), 256](flat)


@cuda.jit(device=True, inline=True)
def _block_sums(X, XF, t, b0, b1):
    # XF[t, b] = sum of X[t, 32 b : 32 b + 32] for b in [b0, b1) (one thread each)
    b = b0 + cuda.threadIdx.x
    if b < b1 and b < XF.shape[1]:
        s = f32(0.0)
        for j in range(32):
            s += X[t, 32 * b + j]
        XF[t, b] = s


@cuda.jit(device=True, inline=True)
def _rmsnorm_row(x, w, eps, out, t, sh):
    D = x.shape[1]
    ss = f32(0.0)
    for i in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        ss += x[t, i] * x[t, i]
    ss = block_sum(ss, sh)
    r = f32(1.0) / math.sqrt(ss / D + eps)
    for i in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        out[t, i] = x[t, i] * r * w[i]


@cuda.jit
def _rmsnorm_kernel(x, w, eps, out):
    sh = cuda.shared.array(NT, np.float32)
    _rmsnorm_row(x, w, eps, out, cuda.blockIdx.x, sh)


def rmsnorm(x, w, eps, out) -> None:
    # x (T, D) f32, w (D,) f32 -> out (T, D)
    _rmsnorm_kernel[x.shape[0], NT](x, w, f32(eps), out)


@cuda.jit
def _rmsnorm_act_kernel(x, y, add, w, eps, X, XF):
    t = cuda.blockIdx.x
    if add:
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            x[t, i] += y[t, i]
    sh = cuda.shared.array(NT, np.float32)
    _rmsnorm_row(x, w, eps, X, t, sh)
    cuda.syncthreads()
    for b0 in range(0, XF.shape[1], cuda.blockDim.x):
        _block_sums(X, XF, t, b0, XF.shape[1])


def rmsnorm_act(x, w, eps, X, XF) -> None:
    # X[:T] = rmsnorm(x) * w, XF its block sums
    _rmsnorm_act_kernel[x.shape[0], NT](x, x, False, w, f32(eps), X, XF)


def add_rmsnorm_act(x, y, w, eps, X, XF) -> None:
    # x += y; X[:T] = rmsnorm(x) * w, XF its block sums
    _rmsnorm_act_kernel[x.shape[0], NT](x, y, True, w, f32(eps), X, XF)


@cuda.jit
def _add_kernel(x, y):
    t = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.shape[1]:
        x[t, i] += y[t, i]


def add_inplace(x, y) -> None:
    # x (T, D) += y (T, D)
    _add_kernel[(grid(x.shape[1], NT), x.shape[0]), NT](x, y)


@cuda.jit
def _swiglu_kernel(g, u, X, XF):
    t = cuda.blockIdx.y
    i0 = cuda.blockIdx.x * cuda.blockDim.x
    i = i0 + cuda.threadIdx.x
    if i < g.shape[1]:
        a = g[t, i]
        X[t, i] = a / (f32(1.0) + math.exp(-a)) * u[t, i]
    cuda.syncthreads()
    _block_sums(X, XF, t, i0 // 32, min(g.shape[1], i0 + cuda.blockDim.x) // 32)


def swiglu_act(g, u, X, XF) -> None:
    # X[:T] = silu(g) * u, XF its block sums (blocks of NT elements: whole 32-blocks each)
    _swiglu_kernel[(grid(g.shape[1], NT), g.shape[0]), NT](g, u, X, XF)


# ---- vectors of one head in shared memory (thread i owns element i; blockDim == HD) -----------------

@cuda.jit(device=True, inline=True)
def _rope_sh(sv, p, cos, sin, n_rot):
    i = cuda.threadIdx.x
    if i < n_rot // 2:
        c = cos[p, i]
        s = sin[p, i]
        a = sv[2 * i]
        b = sv[2 * i + 1]
        sv[2 * i] = a * c - b * s
        sv[2 * i + 1] = a * s + b * c
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _fwht_sh(sv, sign, inverse, HD):
    # ops._fwht_vec on the shared vector: forward H diag(sign) v / sqrt(HD), inverse diag(sign) H v / sqrt(HD)
    i = cuda.threadIdx.x
    if not inverse:
        sv[i] *= sign[i]
    cuda.syncthreads()
    span = 1
    while span < HD:
        if i < HD // 2:
            i0 = (i // span) * 2 * span + i % span
            a = sv[i0]
            b = sv[i0 + span]
            sv[i0] = a + b
            sv[i0 + span] = a - b
        cuda.syncthreads()
        span *= 2
    norm = 1.0 / math.sqrt(HD)
    sv[i] *= norm * sign[i] if inverse else norm
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _qkv_prep_tg(q, k, v, t, g, p, cos, sin, n_rot, do_rope, shift, scale, smooth, sign, rotate, qmul):
    # row t, KV group g at position p, by the block's HD threads (shift, scale: (KVH, HD))
    i = cuda.threadIdx.x
    HD = q.shape[2]
    G = q.shape[1] // k.shape[1]
    sv = cuda.shared.array(HDMAX, np.float32)
    sv[i] = k[t, g, i]
    cuda.syncthreads()
    if do_rope:
        _rope_sh(sv, p, cos, sin, n_rot)
    if smooth:
        sv[i] = (sv[i] - shift[g, i]) / scale[g, i]
        cuda.syncthreads()
    if rotate:
        _fwht_sh(sv, sign, False, HD)
    k[t, g, i] = sv[i]
    cuda.syncthreads()
    if rotate:
        sv[i] = v[t, g, i]
        _fwht_sh(sv, sign, False, HD)
        v[t, g, i] = sv[i]
        cuda.syncthreads()
    for gi in range(G):
        h = g * G + gi
        sv[i] = q[t, h, i]
        cuda.syncthreads()
        if do_rope:
            _rope_sh(sv, p, cos, sin, n_rot)
        if smooth:
            sv[i] *= scale[g, i]
        if rotate:
            _fwht_sh(sv, sign, False, HD)
        q[t, h, i] = sv[i] * qmul
        cuda.syncthreads()


@cuda.jit
def _qkv_prep_kernel(q, k, v, pos0, cos, sin, n_rot, do_rope, shift, scale, smooth, sign, rotate, qmul):
    t = cuda.blockIdx.x
    _qkv_prep_tg(q, k, v, t, cuda.blockIdx.y, pos0 + t, cos, sin, n_rot, do_rope, shift, scale, smooth, sign,
                 rotate, qmul)


@cuda.jit
def _qkv_prep_seqs_kernel(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul):
    s = cuda.blockIdx.x
    _qkv_prep_tg(q, k, v, s, cuda.blockIdx.y, pos[s], cos, sin, n_rot, True, shift[s, li], scale[s, li], smooth,
                 sign, rotate, qmul)


def _check_hd(HD):
    if HD > HDMAX:
        raise ValueError(f"cuda ops: head_dim {HD} > {HDMAX}")


def qkv_prep(q, k, v, pos0, cos, sin, n_rot, do_rope, shift, scale, smooth, sign, rotate, qmul) -> None:
    """ops.qkv_prep on the device: q (T, H, HD), k, v (T, KVH, HD) in place (rope, key smoothing,
    Hadamard rotation, q *= qmul); one block per token and KV group."""
    T, H, HD = q.shape
    _check_hd(HD)
    _qkv_prep_kernel[(T, k.shape[1]), HD](q, k, v, int(pos0), cos, sin, int(n_rot), bool(do_rope), shift, scale,
                                          bool(smooth), sign, bool(rotate), f32(qmul))


def qkv_prep_seqs(q, k, v, pos, cos, sin, n_rot, shift, scale, li, smooth, sign, rotate, qmul) -> None:
    """ops.qkv_prep_seqs on the device, one launch: row s of q (S, H, HD), k, v (S, KVH, HD) at position
    pos[s] (a device array), its smoothing shift[s, li], scale[s, li]."""
    S, H, HD = q.shape
    _check_hd(HD)
    _qkv_prep_seqs_kernel[(S, k.shape[1]), HD](q, k, v, pos, cos, sin, int(n_rot), shift, scale, int(li),
                                               bool(smooth), sign, bool(rotate), f32(qmul))


@cuda.jit(device=True, inline=True)
def _row_dot(m, g, i, v, HD):
    # row i of m[g] (HD x HD) . v (HD,)
    acc = f32(0.0)
    for j in range(HD):
        acc += m[g, i, j] * v[j]
    return acc


@cuda.jit
def _key_xform_kernel(q, k, mk, mq, mu):
    # block (t, g): thread i computes element i of the group's key, then of each of its query heads
    t, g = cuda.blockIdx.x, cuda.blockIdx.y
    i = cuda.threadIdx.x
    HD = k.shape[2]
    G = q.shape[1] // k.shape[1]
    tmp = cuda.shared.array(HDMAX, np.float32)
    if i < HD:
        tmp[i] = k[t, g, i] - mu[g, i]
    cuda.syncthreads()
    if i < HD:
        k[t, g, i] = _row_dot(mk, g, i, tmp, HD)
    for gi in range(G):
        h = g * G + gi
        cuda.syncthreads()
        if i < HD:
            tmp[i] = q[t, h, i]
        cuda.syncthreads()
        if i < HD:
            q[t, h, i] = _row_dot(mq, g, i, tmp, HD)


def key_xform(q, k, mk, mq, mu) -> None:
    """klt key layers: k[t, g] = mk[g] @ (k[t, g] - mu[g]), each query head of group g q = mq[g] @ q, in
    place.  q (T, H, HD), k (T, KVH, HD), mk, mq (KVH, HD, HD), mu (KVH, HD) f32."""
    T, KVH, HD = k.shape
    _check_hd(HD)
    if T:
        _key_xform_kernel[(T, KVH), HD](q, k, mk, mq, mu)


@cuda.jit
def _rope_kernel(x, pos0, cos, sin, n_rot):
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    sv = cuda.shared.array(HDMAX, np.float32)
    i = cuda.threadIdx.x
    sv[i] = x[t, h, i]
    cuda.syncthreads()
    _rope_sh(sv, pos0 + t, cos, sin, n_rot)
    x[t, h, i] = sv[i]


def rope(x, pos0, cos, sin, n_rot) -> None:
    # x (T, nh, HD) f32, rotated in place at positions pos0 + t; cos/sin (n_ctx, n_rot/2)
    T, nh, HD = x.shape
    _check_hd(HD)
    _rope_kernel[(T, nh), HD](x, int(pos0), cos, sin, int(n_rot))


@cuda.jit
def _attn_out_kernel(att, sign, rotate, X, XF):
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    i = cuda.threadIdx.x
    HD = att.shape[2]
    sv = cuda.shared.array(HDMAX, np.float32)
    sv[i] = att[t, h, i]
    cuda.syncthreads()
    if rotate:
        _fwht_sh(sv, sign, True, HD)
        att[t, h, i] = sv[i]
    X[t, h * HD + i] = sv[i]
    cuda.syncthreads()
    if HD % 32 == 0:
        _block_sums(X, XF, t, h * HD // 32, (h + 1) * HD // 32)


@cuda.jit
def _block_sums_kernel(X, XF):
    t = cuda.blockIdx.y
    _block_sums(X, XF, t, cuda.blockIdx.x * cuda.blockDim.x, XF.shape[1])


def attn_out_act(att, sign, rotate, X, XF) -> None:
    # att (T, H, HD): each head rotated back (if rotate) in place; X[:T] = att as (T, H*HD), XF its block sums
    T, H, HD = att.shape
    _check_hd(HD)
    _attn_out_kernel[(T, H), HD](att, sign, bool(rotate), X, XF)
    if HD % 32 and XF.shape[1]:
        _block_sums_kernel[(grid(XF.shape[1], 32), T), 32](X, XF)
