"""Where one decode token's time goes: wall time per kernel call of the forward pass.

    python tools/profile_decode.py [MODEL] [--threads 1,2] [--depth 16] [--tokens 32] [--prefill N]
                                   [-ctk f16] [-ctv f16]

Wraps the backend's kernel entry points (matmul, ops, the KV cache's append / attend) with timers,
decodes --tokens tokens after a --depth-token prefill, and prints per entry point: calls per token,
microseconds per call, and per token, plus the untimed remainder (Python glue) and tokens/s without
the wrappers.  Timings include each call's Python dispatch and (for parallel kernels) region launch.
--prefill N: the same split for one N-token prefill after the --depth tokens (in the model's n_batch chunks)
instead of single-token decodes; per entry point: calls and milliseconds over the whole prefill.
-ctk / -ctv: the KV cache's key / value types (the model default rotation: on for quantized types).
A decode step runs each layer's products after its attention as one chain call (kernels.chain, where
every weight is an integer tile type): those show as "chain ..." rows ("+ attn": the next layer's
attention ran inside it); --no-chain times the separate calls instead, --no-fold keeps the chains but
runs the attention between them.
"""
import argparse
import collections
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pykv  # noqa: E402
from pykv.kernels import matmul as M  # noqa: E402


def _wrap(obj, name, label, acc):
    f = getattr(obj, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        acc[label].append(time.perf_counter() - t0)
        return r
    setattr(obj, name, g)
    return f


def _label_matmul(acc, mm):
    f0, f1 = mm.matmul, mm.matmul_fused

    def matmul(w, act, out):
        t0 = time.perf_counter()
        f0(w, act, out)
        acc[_mm_label(w)].append(time.perf_counter() - t0)

    def fused(ws, act, outs):
        t0 = time.perf_counter()
        f1(ws, act, outs)
        acc[_mm_label(ws)].append(time.perf_counter() - t0)
    mm.matmul, mm.matmul_fused = matmul, fused
    return f0, f1


def _mm_label(ws):
    if isinstance(ws, M.Weight):
        return f"matmul {M._GT(ws.ggml_type).name} {ws.rows}x{ws.cols}"
    return f"fused {'+'.join(M._GT(w.ggml_type).name for w in ws)} {'/'.join(str(w.rows) for w in ws)}"


def _timed(f, label, acc):
    """f() timed under label."""
    def g():
        t0 = time.perf_counter()
        f()
        acc[label].append(time.perf_counter() - t0)
    return g


def _timed_bound(b, acc):
    """A decode product the model keeps bound (matmul.bind), timed under its matmul label."""
    return _timed(b, _mm_label(b.ws), acc)


def _timed_chain(c, i, n, acc):
    """Decode chain i of n (kernels.chain), timed: the first runs the first layer's norm and Q/K/V, the
    last the last layer's output and FFN, the others a layer's output and FFN plus the next one's Q/K/V;
    with "+ attn" the Q/K/V layer's attention too (KVCache.fold_args)."""
    base = ("chain: norm, q/k/v" if i == 0 else "chain: o, ffn" if i == n - 1
            else "chain: o, ffn, next q/k/v")

    def g(fa=None):
        t0 = time.perf_counter()
        c(fa)
        acc[base if fa is None else base + " + attn"].append(time.perf_counter() - t0)
    return g


def prefill(model, seq, n, depth):
    """Seconds for one n-token prefill after depth tokens, in chunks of the model's batch size."""
    seq.n_tokens = depth
    ids = (np.arange(n, dtype=np.int64) * 7 + 3) % model.n_vocab
    nb = model.n_batch
    t0 = time.perf_counter()
    for c in range(0, n, nb):
        model._batch(seq, ids[c:c + nb], False)
    return time.perf_counter() - t0


def decode(model, seq, n, depth):
    seq.n_tokens = depth
    ids = np.array([1], np.int64)
    t0 = time.perf_counter()
    for i in range(n):
        model._batch(seq, ids + i, False)
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    ap.add_argument("-ctk", default="f16", help="KV cache key type")
    ap.add_argument("-ctv", default="f16", help="KV cache value type")
    ap.add_argument("--no-chain", action="store_true", help="decode through the separate calls, not kernels.chain")
    ap.add_argument("--no-fold", action="store_true",
                    help="each layer's attention between the chains, not inside them (KVCache.fold_args)")
    a = ap.parse_args()
    if a.prefill < 0 or a.tokens < 1 or a.depth < 0:
        ap.error("--prefill and --depth must be >= 0, --tokens >= 1")
    model = pykv.load(a.model, n_ctx=a.depth + max(a.tokens, a.prefill) + 8, kv_type_k=a.ctk, kv_type_v=a.ctv)
    if a.no_chain:
        model._chains = False           # Model._decode_chains: none
    if a.no_fold:
        model.cache.fold_args = lambda seq, chunk: [None] * model.config.n_layers
    seq = model.new_sequence()
    # seconds per unit (a decoded token, or the whole prefill) and the timed runs' units
    if a.prefill:
        units = 1
        step = lambda: prefill(model, seq, a.prefill, a.depth)     # noqa: E731
    else:
        units = a.tokens
        step = lambda: decode(model, seq, a.tokens, a.depth)       # noqa: E731
    model.eval(seq, np.arange(a.depth, dtype=np.int64) % model.n_vocab)
    for th in [int(s) for s in a.threads.split(",")]:
        numba.set_num_threads(th)
        model.threads = th          # the model sets its count around each call (pykv.decoder.threads)
        decode(model, seq, 4, a.depth)                       # warm
        step()
        plain = min(step() for _ in range(3))
        acc = collections.defaultdict(list)
        be = model.be
        saved = []
        saved.append((be.matmul, ("matmul", "matmul_fused"), _label_matmul(acc, be.matmul)))
        for mod, names in ((be.ops, ("rmsnorm_act", "add_rmsnorm_act", "qkv_prep", "attn_out_act", "swiglu_act",
                                     "add_inplace", "rmsnorm")), (be.matmul, ("get_rows",)),
                           (model.cache, ("append", "attend"))):
            saved.append((mod, names, [_wrap(mod, nm, nm, acc) for nm in names]))
        bound = model._bound          # decode's bound products (Model._bound_calls): timed copies
        model._bound = {li: tuple(_timed_bound(b, acc) for b in c) for li, c in bound.items()}
        chains = model._chains        # decode's chains (Model._decode_chains): timed copies
        if chains:
            model._chains = [_timed_chain(c, i, len(chains), acc) for i, c in enumerate(chains)]
        per = step()
        model._bound, model._chains = bound, chains
        for mod, names, fs in saved:
            for nm, f in zip(names, fs):
                if mod is model.cache:
                    delattr(mod, nm)
                else:
                    setattr(mod, nm, f)
        tot = sum(sum(v) for v in acc.values()) / units
        print(f"\n== {os.path.basename(model.path)}  threads {th}  depth {a.depth}  K/V {a.ctk}/{a.ctv}  "
              f"load {os.getloadavg()[0]:.2f}")
        if a.prefill:
            print(f"plain: {plain * 1e3:.1f} ms for a {a.prefill}-token prefill = {a.prefill / plain:.1f} t/s;  "
                  f"wrapped: {per * 1e3:.1f} ms")
        else:
            print(f"plain: {plain * 1e3:.3f} ms/token = {1 / plain:.1f} t/s;  wrapped: {per * 1e3:.3f} ms/token")
        unit = "pp" if a.prefill else "tok"
        print(f"{'entry point':48s} {'calls/' + unit:>9s} {'us/call':>9s} {'us/' + unit:>9s}")
        rows = sorted(acc.items(), key=lambda kv: -sum(kv[1]))
        for k, v in rows:
            v = np.array(v)
            n = len(v) / units
            print(f"{k:48s} {n:9.1f} {np.median(v) * 1e6:9.1f} {v.sum() / units * 1e6:9.1f}")
        print(f"{'(timed total)':48s} {'':9s} {'':9s} {tot * 1e6:9.1f}")
        print(f"{'(glue: wrapped - timed)':48s} {'':9s} {'':9s} {(per - tot) * 1e6:9.1f}")


if __name__ == "__main__":
    main()
