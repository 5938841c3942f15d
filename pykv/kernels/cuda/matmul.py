"""GPU twin of kernels/matmul.py: products with GGUF weights kept quantized on the device.

Same public API: prepare_weight (uploads once), Act (device float32 rows), matmul, matmul_fused (2-3
weights, one launch), get_rows. Activations stay float32 on the GPU (no q8 activation quantization):
results match the CPU path's exact / float-activation mode within float32 tolerance.

Device layout: quantized weights are uploaded as their raw ggml blocks (uint8 (rows, row bytes)), F32 and
BF16 as float32 (rows, cols), F16 as float16 (rows, cols). Kernels: one warp per weight row, NW warps per
block, a tile of TT tokens per block (each weight element is decoded once per TT tokens); lane l reads
elements l, l + 32, ... (the 32 lanes of a warp read one 32-block together), float32 accumulators, a warp
sum (shuffles on a GPU; under the simulator 2 lanes and 16 rows per block, summed in shared memory).

Element decoders: one scalar function per format, _w_elem(kind, raw, fw, r, e); the product kernel is
compiled once per combination of weight kinds (cuda.specialise), so kind is a constant there and the
other formats' branches are dead code. The K-quant scale and
quant helpers are the CPU module's own (_q3k_scale, _q23k_q, _k_scale_min), compiled again for the
device from their Python source (a CUDA kernel cannot call a CPU @njit function)."""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from pykv.kernels import matmul as _cpu
from pykv.kernels import mm_raw as _raw
from pykv.kernels.blocks import IQ4NL_F
from pykv.kernels.mm_raw import BF16, F16, F32, IQ4_NL, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, SUPPORTED_TYPES
from pykv.kernels.cuda import SIM, WL, grid, specialise, warp_sums

__all__ = ["Weight", "Act", "prepare_weight", "matmul", "matmul_fused", "fuse", "bind", "get_rows", "SUPPORTED_TYPES"]

NW = 16 if SIM else 4    # warps (weight rows) per block; a warp: WL lanes (32 on a GPU, 2 simulated)
TT = 8          # tokens per block
NTG = 32 if SIM else 128    # threads of the get_rows / Act.set blocks
_SH = (NW, TT, WL) if SIM else (1, 1, 1)    # warp-sum scratch: only the simulator needs it
f32 = np.float32

_dev = cuda.jit(device=True, inline=True)
_q3k_scale = _dev(_raw._q3k_scale.py_func)
_q23k_q = _dev(_raw._q23k_q.py_func)
_k_scale_min = _dev(_raw._k_scale_min.py_func)

_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], np.float32)   # f16 exponent e -> 2^(e-25)


@cuda.jit(device=True, inline=True)
def _h2f(h):
    """IEEE half bits (int) -> float32, exact (subnormals, inf, NaN)."""
    h = np.int32(h)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = f32(m) * f32(5.9604644775390625e-08)            # 2^-24
    elif e == 31:
        v = f32(math.inf) if m == 0 else f32(math.nan)
    else:
        v = f32(m + 1024) * _POW2[e]
    return -v if h & 0x8000 else v


@cuda.jit(device=True, inline=True)
def _rd_f16(w, o):
    return _h2f(np.int32(w[o]) | (np.int32(w[o + 1]) << 8))


@cuda.jit(device=True, inline=True)
def _w_elem(kind, raw, fw, r, e):
    """Element e of weight row r as float32 (same float32 operations as the CPU's _deq_row)."""
    if kind == F32 or kind == F16 or kind == BF16:
        return f32(fw[r, e])
    w = raw[r]
    b = e >> 5
    j = e & 31
    if kind == Q8_0:
        o = 34 * b
        return _rd_f16(w, o) * f32(np.int8(w[o + 2 + j]))
    if kind == Q4_0 or kind == Q4_1:
        asym = kind == Q4_1
        o = 20 * b if asym else 18 * b
        q = (np.int32(w[o + (4 if asym else 2) + (j & 15)]) >> (4 * (j >> 4))) & 15
        if asym:
            return _rd_f16(w, o) * f32(q) + _rd_f16(w, o + 2)
        return _rd_f16(w, o) * f32(q - 8)
    if kind == IQ4_NL:
        o = 18 * b
        return _rd_f16(w, o) * IQ4NL_F[(np.int32(w[o + 2 + (j & 15)]) >> (4 * (j >> 4))) & 15]
    if kind == Q5_0 or kind == Q5_1:
        asym = kind == Q5_1
        o = 24 * b if asym else 22 * b
        h = o + 4 if asym else o + 2
        q = ((np.int32(w[h + 4 + (j & 15)]) >> (4 * (j >> 4))) & 15) | (((np.int32(w[h + (j >> 3)]) >> (j & 7)) & 1) << 4)
        if asym:
            return _rd_f16(w, o) * f32(q) + _rd_f16(w, o + 2)
        return _rd_f16(w, o) * f32(q - 16)
    bk = e >> 8
    ee = e & 255
    if kind == Q2_K:
        o = 84 * bk
        sc = np.int32(w[o + (ee >> 4)])
        dl = _rd_f16(w, o + 80) * f32(sc & 15)
        ml = _rd_f16(w, o + 82) * f32(sc >> 4)
        return dl * f32(_q23k_q(Q2_K, w, o, ee)) - ml
    if kind == Q3_K:
        o = 110 * bk
        dl = _rd_f16(w, o + 108) * f32(_q3k_scale(w, o + 96, ee >> 4))
        return dl * f32(_q23k_q(Q3_K, w, o, ee))
    if kind == Q4_K or kind == Q5_K:
        o = (144 if kind == Q4_K else 176) * bk
        qo = 16 if kind == Q4_K else 48
        s = ee >> 5
        l = ee & 31
        sc, mn = _k_scale_min(w, o + 4, s)
        ds = _rd_f16(w, o) * f32(sc)
        dm = _rd_f16(w, o + 2) * f32(mn)
        q = (np.int32(w[o + qo + 32 * (s >> 1) + l]) >> (4 * (s & 1))) & 15
        if kind == Q5_K:
            q |= ((np.int32(w[o + 16 + l]) >> s) & 1) << 4
        return ds * f32(q) - dm
    # Q6_K (the remaining type)
    o = 210 * bk
    h = ee >> 7
    k = (ee >> 5) & 3
    l = ee & 31
    lo = (np.int32(w[o + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
    hi = (np.int32(w[o + 128 + 32 * h + l]) >> (2 * k)) & 3
    sc = f32(np.int8(w[o + 192 + (ee >> 4)]))
    return (_rd_f16(w, o + 208) * sc) * f32((lo | (hi << 4)) - 32)


@cuda.jit(device=True, inline=True)
def _row_dot(kind, raw, fw, r, x, t0, nt, lane, acc):
    # acc[i] += W[r, lane::WL] . x[t0 + i, lane::WL] for i < nt
    for e in range(lane, x.shape[1], WL):
        wv = _w_elem(kind, raw, fw, r, e)
        for i in range(nt):
            acc[i] += wv * x[t0 + i, e]


@cuda.jit(device=True, inline=True)
def _store(acc, lane, r, ok, nt, t0, out):
    if lane == 0 and ok:
        for i in range(nt):
            out[t0 + i, r] = acc[i]


KA = KB = KC = 0     # the weight kinds of _mm3_kernel: constants of each specialised copy (_mm3)


@cuda.jit
def _mm3_kernel(ra, fa, na, oa, rb, fb, nb, ob, rc, fc, nc, oc, x, T):
    # out[t, r] = W[r] . x[t] for the rows of up to three weights sharing x, one launch: rows [0, na) of a,
    # then b, then c (nb = nc = 0: one weight); block (NW warps) = NW rows x TT tokens; weight kinds KA,
    # KB, KC are compile-time constants (_mm3)
    ka, kb, kc = KA, KB, KC
    lane = cuda.threadIdx.x % WL
    wi = cuda.threadIdx.x // WL
    r = cuda.blockIdx.x * NW + wi
    t0 = cuda.blockIdx.y * TT
    nt = min(TT, T - t0)
    sh = cuda.shared.array(_SH, np.float32)
    acc = cuda.local.array(TT, np.float32)
    for i in range(TT):
        acc[i] = 0.0
    if r < na:
        _row_dot(ka, ra, fa, r, x, t0, nt, lane, acc)
    elif r < na + nb:
        _row_dot(kb, rb, fb, r - na, x, t0, nt, lane, acc)
    elif r < na + nb + nc:
        _row_dot(kc, rc, fc, r - na - nb, x, t0, nt, lane, acc)
    warp_sums(acc, sh, wi, lane)     # outside the branches: a block can straddle two weights
    _store(acc, lane, r, r < na, nt, t0, oa)
    _store(acc, lane, r - na, na <= r and r < na + nb, nt, t0, ob)
    _store(acc, lane, r - na - nb, na + nb <= r and r < na + nb + nc, nt, t0, oc)


@cuda.jit
def _get_rows_kernel(kind, raw, fw, ids, out):
    i = cuda.blockIdx.x
    e = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if e < out.shape[1]:
        out[i, e] = _w_elem(kind, raw, fw, ids[i], e)


@cuda.jit
def _act_set_kernel(x, X, XF):
    # X[t] = x[t]; XF[t, b] its block sums (block: one token, one thread per 32-block and element)
    t = cuda.blockIdx.x
    for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        X[t, j] = x[t, j]
    cuda.syncthreads()
    for b in range(cuda.threadIdx.x, XF.shape[1], cuda.blockDim.x):
        s = np.float32(0.0)
        for j in range(32):
            s += X[t, 32 * b + j]
        XF[t, b] = s


# ----------------------------------------------------------------------------------------------------
# Python-level API
# ----------------------------------------------------------------------------------------------------

_DUMMY = {}


def _dummy():
    if "f" not in _DUMMY:
        _DUMMY["f"] = cuda.to_device(np.zeros((1, 1), np.float32))
        _DUMMY["u"] = cuda.to_device(np.zeros((1, 1), np.uint8))
    return _DUMMY["f"], _DUMMY["u"]


class Weight:
    """A 2-D GGUF weight on the device: ggml_type, rows, cols, nbytes (device bytes matmul reads),
    raw (uint8 (rows, row bytes) ggml blocks) or fw (float (rows, cols)), kind (= ggml_type)."""

    __slots__ = ("ggml_type", "rows", "cols", "nbytes", "raw", "fw", "kind")

    def __repr__(self):
        return f"cuda.Weight({self.ggml_type}, rows={self.rows}, cols={self.cols}, nbytes={self.nbytes})"


def prepare_weight(ggml_type: int, data: np.ndarray, rows: int, cols: int, q8_act: bool = True,
                   repack: bool = True) -> Weight:
    """Validate (the CPU's check_weight) and upload once. q8_act and repack are accepted for the CPU
    signature and ignored: the device path always uses float activations on the raw blocks."""
    gt, raw = _cpu.check_weight(ggml_type, data, rows, cols)
    df, du = _dummy()
    w = Weight()
    w.ggml_type = w.kind = gt
    w.rows, w.cols = int(rows), int(cols)
    if gt == F32:
        host = raw.view(np.float32)
    elif gt == F16:
        host = raw.view(np.float16)
    elif gt == BF16:      # widened to float32 on the host (no bit casts in device code)
        host = (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        host = None
    if host is None:
        w.raw, w.fw = cuda.to_device(raw), df
        w.nbytes = int(raw.nbytes)
    else:
        w.raw, w.fw = du, cuda.to_device(np.ascontiguousarray(host))
        w.nbytes = int(host.nbytes)
    return w


class Act:
    """Device activation rows: float32 x (max_tokens, cols) and xf (max_tokens, cols // 32) block sums
    (written by the fused producers in cuda.ops; the device matmul reads x only)."""

    def __init__(self, cols: int, max_tokens: int):
        cols, max_tokens = int(cols), int(max_tokens)
        if cols <= 0 or max_tokens <= 0:
            raise ValueError(f"Act: cols and max_tokens must be positive, got {cols}, {max_tokens}")
        from pykv.kernels.cuda.ops import fill_zero
        self.cols, self.max_tokens, self.T = cols, max_tokens, 0
        nb = cols // 32 if cols % 32 == 0 else 0
        self.x = cuda.device_array((max_tokens, cols), np.float32)
        self.xf = cuda.device_array((max_tokens, max(nb, 1)), np.float32)[:, :nb]
        fill_zero(self.x)

    def set(self, x) -> None:
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim != 2 or x.shape[1] != self.cols:
            raise ValueError(f"Act.set: expected x of shape (T, {self.cols}), got {tuple(x.shape)}")
        T = x.shape[0]
        if T < 1 or T > self.max_tokens:
            raise ValueError(f"Act.set: T={T} outside 1..{self.max_tokens}")
        if x.dtype != np.float32:
            raise ValueError(f"Act.set: x must be float32, got {x.dtype}")
        _act_set_kernel[T, NTG](x, self.x, self.xf)
        self.T = T

    def mark(self, T: int) -> None:
        if T < 1 or T > self.max_tokens:
            raise ValueError(f"Act.mark: T={T} outside 1..{self.max_tokens}")
        self.T = int(T)


def _mm3(ka, kb, kc):
    """_mm3_kernel for these weight kinds (one compiled copy per combination a model has)."""
    return specialise(_mm3_kernel, KA=int(ka), KB=int(kb), KC=int(kc))


def _check_out(w: Weight, T: int, out) -> None:
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != w.rows or out.shape[0] < T:
        raise ValueError(f"matmul: out must be float32 (>={T}, {w.rows}), got {out.dtype}{tuple(out.shape)}")


def matmul(w: Weight, act: Act, out) -> None:
    """out[t, r] = dot(W[r, :], x[t, :]) for t < act.T (one launch)."""
    T = act.T
    if act.cols != w.cols:
        raise ValueError(f"matmul: weight has {w.cols} cols, activation has {act.cols}")
    _check_out(w, T, out)
    _mm3(w.kind, w.kind, w.kind)[(grid(w.rows, NW), grid(T, TT)), WL * NW](
        w.raw, w.fw, w.rows, out, w.raw, w.fw, 0, out, w.raw, w.fw, 0, out, act.x, T)


def fuse(ws) -> tuple:
    """The CPU twin prepares its one-region choice here; one launch needs nothing: the weights' tuple."""
    return tuple(ws)


def bind(ws, act: Act, outs, T: int):
    """The CPU twin's bound decode call; here one launch has no Python worth saving: matmul or
    matmul_fused with these arguments (T: unused)."""
    if isinstance(ws, Weight):
        return functools.partial(matmul, ws, act, outs)
    return functools.partial(matmul_fused, ws, act, outs)


def matmul_fused(ws, act: Act, outs) -> None:
    """matmul(ws[i], act, outs[i]) for 2 or 3 weights sharing act (a tuple, as fuse returns), in one launch."""
    T = act.T
    if not 2 <= len(ws) <= 3:
        for w, o in zip(ws, outs):
            matmul(w, act, o)
        return
    for w, o in zip(ws, outs):
        if act.cols != w.cols:
            raise ValueError(f"matmul: weight has {w.cols} cols, activation has {act.cols}")
        _check_out(w, T, o)
    a, b = ws[0], ws[1]
    c, oc = (ws[2], outs[2]) if len(ws) == 3 else (ws[1], outs[1])
    nc = c.rows if len(ws) == 3 else 0
    n = a.rows + b.rows + nc
    _mm3(a.kind, b.kind, c.kind)[(grid(n, NW), grid(T, TT)), WL * NW](
        a.raw, a.fw, a.rows, outs[0], b.raw, b.fw, b.rows, outs[1], c.raw, c.fw, nc, oc, act.x, T)


def get_rows(w: Weight, ids, out) -> None:
    """out[i, :] = dequantize(W[ids[i], :]); ids a host integer array (uploaded) or a device array."""
    if isinstance(ids, np.ndarray) or not hasattr(ids, "copy_to_host"):
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"get_rows: ids must be a 1-D integer array, got {ids.dtype}{tuple(ids.shape)}")
        if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
            raise ValueError(f"get_rows: ids out of range [0, {w.rows})")
        ids = cuda.to_device(ids.astype(np.int64))
    n = ids.shape[0]
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[0] < n or out.shape[1] != w.cols:
        raise ValueError(f"get_rows: out must be float32 (>={n}, {w.cols}), got {out.dtype}{tuple(out.shape)}")
    if n:
        _get_rows_kernel[(n, grid(w.cols, NTG)), NTG](w.kind, w.raw, w.fw, ids, out)
