"""Benchmark pykv.kernels.attention.attend on SmolLM2's attention shape (decode, T=1; or a prefill batch).

    python tools/bench_attention.py [--depths 1024,4096] [--types f16,q8_0,q4_0,int4]
                                    [--threads 1,2] [--reps 50] [--layers 30] [--prefill T]

SmolLM2's layout: 9 query heads, 3 KV heads, head_dim 64, page size 32, K and V of the same type,
the chunk size model.py picks for decode.  `--layers` layers each get their own pools (filled to the
depth), and one timed pass calls attend once per layer, as one decode token does, so the working set
(30 layers x depth x K+V) is the real one, not one layer hot in L2.  Prints the median over passes of
ms per layer call and the tokens/s the attention alone would allow (an upper bound on decode speed), from the median.
--prefill T: the call is a T-token prefill batch, the last T of the depth's tokens (queries at positions
depth - T .. depth - 1, causal), as one n_batch chunk of a prompt runs it; tokens/s counts the T tokens.
"""
import argparse
import time

import numba
import numpy as np

from pykv.files.config import Config
from pykv.kv.cache import KVCache


def smol_config(n_layers=1):
    return Config(arch="llama", n_layers=n_layers, dim=576, ff_dim=1536, n_heads=9, n_kv_heads=3,
                  rope_base=10000.0, rope_dims=64, norm_eps=1e-5, n_ctx_train=8192, n_vocab=49152)


def build(cfg, kt, vt, depth, rng, P=32):
    cache = KVCache(cfg, depth + 1, kt, vt, page_tokens=P)
    seq = cache.new_sequence()
    KVH, HD = cfg.n_kv_heads, cfg.head_dim
    step = 512
    while seq.n_tokens < depth:
        n = min(step, depth - seq.n_tokens)
        cache.reserve(seq, n)
        k = rng.standard_normal((n, KVH, HD)).astype(np.float32)
        v = rng.standard_normal((n, KVH, HD)).astype(np.float32)
        for li in range(cfg.n_layers):
            cache.append(li, seq, k, v)
        seq.n_tokens += n
    return cache, seq


def bench_one(cache, seq, cfg, reps, rng, T=1):
    """(median wall, min wall, median CPU) ms per layer call over `reps` passes over every layer.
    CPU time (all threads) is the steadier number on a shared machine."""
    H, KVH, HD = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n_tot = seq.n_tokens
    n_past = n_tot - T
    chunk = cache.chunk_for(n_tot, T, cache.be.workers())
    C = -(-n_tot // chunk)
    part = np.zeros((T, KVH, C, H // KVH, HD + 2), np.float32)
    q = (rng.standard_normal((T, H, HD)) / 8).astype(np.float32)
    out = np.zeros((T, H, HD), np.float32)
    calls = []
    for li, l in enumerate(cache.layers):
        calls.append((li, seq, q, n_past, chunk, part, out))
    for args in calls:   # compile / warm
        cache.attend(*args)
    ts, cs = [], []
    for _ in range(reps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        for args in calls:
            cache.attend(*args)
        ts.append((time.perf_counter() - t0) / len(calls))
        cs.append((time.process_time() - c0) / len(calls))
    return float(np.median(ts)) * 1e3, float(np.min(ts)) * 1e3, float(np.median(cs)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="1024,4096")
    ap.add_argument("--types", default="f16,q8_0,q4_0,int4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prefill", type=int, default=1, help="queries per call (1: a decode step)")
    a = ap.parse_args()
    cfg = smol_config(a.layers)
    rng = np.random.default_rng(0)
    threads = [min(int(t), numba.config.NUMBA_NUM_THREADS) for t in a.threads.split(",")]
    print(f"{a.layers} layers, ms per layer call (median and min over {a.reps} passes), attention-only tokens/s")
    print(f"{'type':>8} {'depth':>6} {'thr':>3} {'ms/layer':>9} {'min ms':>8} {'cpu ms':>8} {'tok/s':>8} {'KV MB':>7}")
    for kt in a.types.split(","):
        for depth in (int(d) for d in a.depths.split(",")):
            cache, seq = build(cfg, kt, kt, depth, rng)
            for th in threads:
                numba.set_num_threads(th)
                med, mn, cpu = bench_one(cache, seq, cfg, a.reps, rng, a.prefill)
                print(f"{kt:>8} {depth:>6} {th:>3} {med:9.3f} {mn:8.3f} {cpu:8.3f} {1e3 * a.prefill / (a.layers * med):8.1f} "
                      f"{cache.bytes_per_token() * depth / 1e6:7.1f}", flush=True)


if __name__ == "__main__":
    main()
