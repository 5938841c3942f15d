"""Benchmark pykv.kernels.matmul on the real model's shapes.

    python tools/bench_matmul.py [--model PATH] [--threads 1,2] [--reps N] [--prefill 512]
                                 [--blas-min-t 16]   (a huge value: prefill through the tile kernels)

Prints, per weight type and thread count, decode matvec GB/s of weight bytes (median over reps of a
pass over every layer matrix of that type, like one token does), and for T=prefill tokens the
tokens/s-equivalent of a full pass over those matrices.  First, per thread count, the host's read
ceiling: a plain parallel sum over a buffer as large as the model's weights (--read-mb), the GB/s a
memory-bound decode cannot beat.
"""
import argparse
import os
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader, quants

from pykv.kernels import matmul as M

DEFAULT_MODEL = os.path.expanduser("~/.cache/pykv/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def load(path):
    r = GGUFReader(path)
    ws = []
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        ws.append((t.name, M.prepare_weight(int(t.tensor_type), t.data, rows, cols)))
    return ws


# byte offsets of each K-quant's f16 super-block scales
_K_SCALES = {GT.Q2_K: (80, 82), GT.Q3_K: (108,), GT.Q4_K: (0, 2), GT.Q5_K: (0, 2), GT.Q6_K: (208,)}


def synth(ggml_type, shapes, rng):
    """Weights of another type with the model's shapes (random data)."""
    out = []
    be = M._BLOCK[int(ggml_type)][0]
    for name, rows, cols in shapes:
        cols = cols // be * be          # K-quants: 576 -> 512
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        if ggml_type == GT.F32:
            data = x
        elif ggml_type == GT.F16:
            data = x.astype(np.float16)
        elif ggml_type in _K_SCALES:     # gguf cannot quantize K-quants: random blocks
            bpb = M._BLOCK[int(ggml_type)][1]
            data = rng.integers(0, 256, size=(rows, cols // 256, bpb), dtype=np.uint8)
            for o in _K_SCALES[ggml_type]:                                 # finite f16 super-block scales
                data[:, :, o:o + 2] = rng.uniform(0, 0.02, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
            data = data.reshape(rows, -1)
        else:
            data = quants.quantize(x, ggml_type)
        out.append((name, M.prepare_weight(int(ggml_type), data, rows, cols)))
    return out


def bench_pass(ws, T, reps, rng):
    acts, outs = {}, []
    for _, w in ws:
        if w.cols not in acts:
            acts[w.cols] = M.Act(w.cols, T)
            acts[w.cols].set(rng.standard_normal((T, w.cols)).astype(np.float32))
        outs.append(np.zeros((T, w.rows), np.float32))
    for (_, w), o in zip(ws, outs):      # warm up / compile
        M.matmul(w, acts[w.cols], o)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for (_, w), o in zip(ws, outs):
            M.matmul(w, acts[w.cols], o)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), sum(w.raw.nbytes for _, w in ws)   # ggml bytes


@numba.njit(parallel=True, cache=True)
def _read_sum(a, nt):
    """Sum of a (int64), one contiguous share per thread (nt shares): a streaming read at the host's bandwidth."""
    share = a.size // nt
    tot = 0
    for t in numba.prange(nt):
        s = 0                                  # scalar accumulator (vectorized by LLVM)
        hi = a.size if t == nt - 1 else (t + 1) * share
        for i in range(t * share, hi):
            s += a[i]
        tot += s
    return tot


def read_ceiling(mb, reps):
    """(best, median) GB/s of _read_sum over an mb-MB buffer."""
    a = np.ones(max(1, int(mb * 1e6) // 8), np.int64)
    assert _read_sum(a, numba.get_num_threads()) == a.size
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _read_sum(a, numba.get_num_threads())
        ts.append(time.perf_counter() - t0)
    return a.nbytes / min(ts) / 1e9, a.nbytes / float(np.median(ts)) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K,F16,BF16,F32")
    ap.add_argument("--exact", action="store_true", help="benchmark the float-activation mode")
    ap.add_argument("--blas-min-t", type=int, default=M._BLAS_MIN_T,
                    help="tile weights with T >= this use dequantize + sgemm (a huge value: tile kernels only)")
    ap.add_argument("--read-mb", type=float, default=None,
                    help="buffer size of the read-ceiling line (default: the model file's size; 0: skip)")
    a = ap.parse_args()
    M.set_exact(a.exact)
    M._BLAS_MIN_T = a.blas_min_t
    rng = np.random.default_rng(0)
    model = load(a.model)
    layer = [(n, w) for n, w in model if n.startswith("blk.")]
    head = [(n, w) for n, w in model if not n.startswith("blk.")]
    shapes = [(n, w.rows, w.cols) for n, w in layer[:7]]      # one layer's matrices
    groups = {}
    groups[f"{GT(layer[0][1].ggml_type).name} (model layers x{len(layer)})"] = layer
    groups[f"{GT(head[0][1].ggml_type).name} (model LM head {head[0][1].rows}x{head[0][1].cols})"] = head
    for tn in a.types.split(","):
        t = GT[tn]
        groups[f"{tn} (one layer's shapes, x4)"] = synth(t, shapes * 4, rng)     # 4 distinct copies
    for nt in [int(s) for s in a.threads.split(",")]:
        numba.set_num_threads(nt)
        print(f"--- threads={nt} exact={a.exact}")
        mb = os.path.getsize(a.model) / 1e6 if a.read_mb is None else a.read_mb
        if mb > 0:
            best, med = read_ceiling(mb, a.reps)
            print(f"{'read ceiling (sum of ' + format(mb, '.0f') + ' MB)':45s} read   {best:6.2f} GB/s best, "
                  f"{med:.2f} median", flush=True)
        for g, ws in groups.items():
            dt, nb = bench_pass(ws, 1, a.reps, rng)
            line = f"{g:45s} decode {nb / dt / 1e9:6.2f} GB/s ({dt * 1e3:7.3f} ms/pass, {len(ws)} mats)"
            if a.prefill > 1:
                dtp, _ = bench_pass(ws, a.prefill, max(3, a.reps // 5), rng)
                line += f" | T={a.prefill}: {a.prefill / dtp:8.0f} tok/s ({dtp / dt:5.1f}x one matvec pass)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
