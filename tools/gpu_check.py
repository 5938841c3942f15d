#!/usr/bin/env python
"""The GPU check: one script for a real NVIDIA GPU (an H200: under 6 minutes), or for numba's CUDA
simulator with --tiny (small shapes, so the whole script is exercised without a GPU).

It needs numba, numba-cuda (not under the simulator), numpy, sentencepiece; gguf, regex, pyyaml and tqdm
are installed from wheels (--wheels DIR, default ./wheels) into --target when they are missing. No model
file is needed: a synthetic model with SmolLM2-135M-Instruct.Q4_1's exact shapes and weight types (read
from the real file: every layer matrix Q4_1, token_embd Q8_0 and tied, norms F32) and random weights is
written with gguf's writer (tests/reference.write_tiny_gguf).

    1. the CUDA tests (tests/test_cuda_*.py) on the device (PYKV_REAL_GPU=1), in a subprocess that runs
       beside step 2 and ends before step 3;
    2. greedy generation, CUDA vs CPU (exact float activations) on the synthetic model;
    3. attention bandwidth: bytes of K/V read / time of one attend_batch launch (merge included) for f16,
       q8_0, q4_0, int4 caches at 4K and 32K tokens x 1, 8, 32 sequences, beside a device-to-device
       copy's bandwidth (read + write bytes / time);
    4. end-to-end decode tokens/s at depth 16 and 4096 (device sampling), and kernel launches per token.

Prints everything; exits 1 on a mismatch (a failed test, or greedy tokens that differ at a step whose
top-2 logits are not a near tie).

    python tools/gpu_check.py                 # on the GPU machine
    NUMBA_ENABLE_CUDASIM=1 python tools/gpu_check.py --tiny
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# SmolLM2-135M-Instruct.Q4_1.gguf (read with gguf): 30 layers, dim 576, ff 1536, 9 heads, 3 KV heads,
# head_dim 64, vocab 49152, rope base 100000, context 8192; blk.*.{attn_q,k,v,output,ffn_gate,up,down} Q4_1,
# token_embd Q8_0 (tied output), norms F32.
SMOLLM2 = dict(dim=576, ff=1536, n_heads=9, n_kv=3, n_layers=30, n_vocab=49152, rope_base=100000.0, n_ctx=8192)
TINY = dict(dim=64, ff=64, n_heads=2, n_kv=1, n_layers=1, n_vocab=300, rope_base=100000.0, n_ctx=512)
DEPS = ("gguf", "regex", "yaml", "tqdm")


def log(msg=""):
    print(msg, flush=True)


def ensure_deps(wheels: str, target: str) -> None:
    missing = [m for m in DEPS if importlib.util.find_spec(m) is None]
    if not missing:
        return
    whl = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not whl:
        sys.exit(f"gpu_check: missing {', '.join(missing)} and no wheels in {wheels} (--wheels DIR)")
    log(f"installing {len(whl)} wheels from {wheels} into {target} (missing: {', '.join(missing)})")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                    *whl], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join([target, ROOT, os.environ.get("PYTHONPATH", "")])


# ---- launches -------------------------------------------------------------------------------------------
class LaunchCounter:
    """Counts CUDA kernel launches (a GPU: CUDADispatcher.call; the simulator: FakeCUDAKernel.__call__)."""

    def __init__(self):
        self.n = 0
        self.ok = False
        try:
            from numba import config
            if config.ENABLE_CUDASIM:
                from numba.cuda.simulator.kernel import FakeCUDAKernel as K
                name = "__call__"
            else:
                from numba.cuda.dispatcher import CUDADispatcher as K
                name = "call"
            orig = getattr(K, name)
            counter = self

            def wrapped(self, *a, **kw):
                if not getattr(self, "_device", False):     # the simulator's device functions: not launches
                    counter.n += 1
                return orig(self, *a, **kw)
            setattr(K, name, wrapped)
            self.ok = True
        except Exception as e:   # a numba-cuda layout this does not know
            log(f"(launch counting unavailable: {type(e).__name__}: {e})")


# ---- 1. tests ---------------------------------------------------------------------------------------------
def start_tests(tiny: bool):
    """The CUDA tests in a subprocess, started now and collected by finish_tests: they compile their kernels
    (NVVM, CPU-bound, on other cores) while step 2 runs, and end before the timed steps 3 and 4."""
    env = dict(os.environ)
    if tiny:     # the simulator: one short file stands for the suite (the CI runs all of it)
        args = ["tests/cuda/test_cuda_ops.py", "-k", "fill_zero or rope"]
    else:
        env["PYKV_REAL_GPU"] = "1"
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        args = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "test_cuda_*.py")))
        if importlib.util.find_spec("xdist"):   # the files compile their kernels (NVVM, CPU-bound) in parallel
            args = ["-n", str(min(len(args), os.cpu_count() or 1)), "--dist", "loadfile", *args]
    log("  started in the background: " + " ".join(["pytest", *args]))
    out = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                         stdout=out, stderr=subprocess.STDOUT, text=True)
    return p, out, time.perf_counter()


def finish_tests(job) -> bool:
    p, out, t0 = job
    rc = p.wait()
    out.seek(0)
    tail = out.read().strip().splitlines()
    out.close()
    log("\n".join(tail[-15:]))
    log(f"tests: exit {rc} in {time.perf_counter() - t0:.0f} s")
    return rc == 0


# ---- 2. greedy CUDA vs CPU --------------------------------------------------------------------------------
def greedy_check(path: str, n_gen: int) -> bool:
    import numpy as np
    import pykv
    from pykv.decoder.sampler import Sampler, SamplerParams
    prompt = [256, 72, 101, 108, 108, 111, 44, 32]
    res = {}
    for dev in ("cpu", "cuda"):
        m = pykv.load(path, n_ctx=128, device=dev, q8_act=False)
        seq = m.new_sequence()
        ids, hist, logits = list(prompt), list(prompt), []
        s = Sampler(SamplerParams(temperature=0.0), m.n_vocab)
        feed = ids
        for _ in range(n_gen):
            lg = m.eval(seq, feed)[0]
            logits.append(lg)
            feed = [m.be.sampler.pick(m.be.to_device(lg) if dev == "cuda" else lg, s, hist, 0.0)]
            hist += feed
        res[dev] = (hist[len(prompt):], np.array(logits))
    (tc, lc), (tg, lg) = res["cpu"], res["cuda"]
    diff = float(np.abs(lc[0] - lg[0]).max())
    log(f"prompt logits: max |cuda - cpu| = {diff:.3g} (logit range {float(np.ptp(lc[0])):.3g})")
    log(f"cpu  tokens: {tc}")
    log(f"cuda tokens: {tg}")
    if tc == tg:
        log("greedy: equal")
        return True
    i = next(j for j in range(len(tc)) if tc[j] != tg[j])
    top2 = np.sort(lc[i])[-2:]
    gap = float(top2[1] - top2[0])
    tie = gap <= 1e-3 * max(1.0, float(np.abs(lc[i]).max()))
    log(f"greedy: first difference at step {i}: cpu top-2 gap {gap:.3g} ({'a near tie' if tie else 'MISMATCH'})")
    return tie


# ---- 3. attention bandwidth ------------------------------------------------------------------------------
def _timed(fn, be, reps):
    fn()
    be.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        be.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(be, nbytes, reps):
    n = nbytes // 4
    src, dst = be.zeros(n), be.zeros(n)
    t = _timed(lambda: dst.copy_to_device(src), be, reps)
    return 2 * n * 4 / t, t


def attention_table(cfg_kw, tokens, seqs, kv_types, reps):
    import numpy as np
    from pykv.kernels.backend import get_backend
    from pykv.kv.cache import KVCache
    be = get_backend("cuda")
    cfg = _config(cfg_kw, n_layers=1)
    H, KVH, HD = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = H // KVH
    rows = []
    for kt in kv_types:
        for n in tokens:
            for S in seqs:
                cache = KVCache(cfg, n, kt, kt, max_seqs=S, k_smooth=False, backend=be)
                ss = []
                for _ in range(S):      # the bytes read do not depend on the values: pages reserved, not filled
                    s = cache.new_sequence()
                    cache.reserve(s, n)
                    s.n_tokens = n
                    ss.append(s)
                l = cache.layers[0]
                meta = be.to_device(np.array([(n, cache.n_sink(l.k_fmt, n), cache.n_sink(l.v_fmt, n),
                                               cache.n_quantized(l.k_fmt, n), cache.n_quantized(l.v_fmt, n))] * S,
                                             np.int32))
                stack = [be.to_device(np.stack([be.to_host(f(s, 0, nm)) for s in ss]))
                         for f, nm in ((cache.residual, "k"), (cache.residual, "v"), (cache.sink, "k"),
                                       (cache.sink, "v"))]
                pts = be.to_device(np.stack([s.page_table for s in ss]))
                chunk = cache.chunk_for(n, 1, be.workers())
                C = -(-n // chunk)
                q = be.to_device(np.random.default_rng(0).standard_normal((S, H, HD)).astype(np.float32) * 0.1)
                part, out = be.zeros((S, KVH, C, G, HD + 2)), be.zeros((S, H, HD))

                def fn():
                    be.attention.attend_batch(q, l.k_pool, l.v_pool, *stack, pts, meta, cache.P, l.k_fmt.code,
                                              l.k_bits, l.v_fmt.code, cache.F16_CODE, chunk, part, out)
                t = _timed(fn, be, reps)
                nbytes = S * n * cache.bytes_per_token()
                rows.append((kt, n, S, C, nbytes, t))
                log(f"  {kt:6s} {n:6d} tokens x {S:2d} seqs: {C:4d} chunks, {nbytes / 1e6:9.2f} MB in "
                    f"{t * 1e6:9.1f} us = {nbytes / t / 1e9:8.3g} GB/s")
    return rows


# ---- 4. decode speed ------------------------------------------------------------------------------------
def decode_speed(path, depths, n_tok, counter):
    import numpy as np
    import pykv
    from pykv.decoder.sampler import Sampler, SamplerParams
    m = pykv.load(path, n_ctx=max(depths) + n_tok + 8, device="cuda")
    rng = np.random.default_rng(1)
    s = Sampler(SamplerParams(temperature=0.0), m.n_vocab)
    out = []
    for d in depths:
        seq = m.new_sequence()
        ids = [int(i) for i in rng.integers(0, m.n_vocab, d)]
        t0 = time.perf_counter()
        tid = m.next_token(seq, ids, s, ids)
        m.be.synchronize()
        t_pp = time.perf_counter() - t0
        tid = m.next_token(seq, [tid], s, ids)          # warm (compiles at depth)
        c0, t0 = counter.n, time.perf_counter()
        for _ in range(n_tok):
            tid = m.next_token(seq, [tid], s, ids)       # the id comes down each step (a sync)
        dt = time.perf_counter() - t0
        launches = (counter.n - c0) / n_tok if counter.ok else float("nan")
        out.append((d, n_tok / dt, launches, d / t_pp))
        log(f"  depth {d:5d}: decode {n_tok / dt:8.1f} tokens/s, {launches:.0f} launches/token "
            f"(prefill of the depth: {d / t_pp:.0f} tokens/s)")
    return out


def _config(kw, n_layers=None):
    from pykv.files.config import Config
    import dataclasses
    fields = {f.name for f in dataclasses.fields(Config)}
    hd = kw["dim"] // kw["n_heads"]
    vals = dict(arch="llama", dim=kw["dim"], ff_dim=kw["ff"], n_heads=kw["n_heads"], n_kv_heads=kw["n_kv"],
                n_layers=n_layers or kw["n_layers"], n_vocab=kw["n_vocab"], head_dim=hd, rope_dims=hd,
                rope_base=kw["rope_base"], n_ctx_train=kw["n_ctx"], norm_eps=1e-5)
    return Config(**{k: v for k, v in vals.items() if k in fields})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (the simulator)")
    ap.add_argument("--wheels", default=os.path.join(ROOT, "wheels"), help="wheels of gguf, regex, pyyaml, tqdm")
    ap.add_argument("--target", default=os.path.join(tempfile.gettempdir(), "pykv_gpu_deps"))
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    ensure_deps(args.wheels, args.target)
    counter = LaunchCounter()
    from pykv.kernels.backend import cuda_error, get_backend
    err = cuda_error()
    if err:
        log(f"gpu_check: {err}")
        return 2
    from numba import config
    try:
        dev = "numba CUDA simulator" if config.ENABLE_CUDASIM else \
            get_backend("cuda").cuda.get_current_device().name.decode()
    except Exception:
        dev = "?"
    log(f"device: {dev}; {'tiny' if args.tiny else 'SmolLM2-135M'} shapes")
    ok = True
    tests = None
    if not args.skip_tests:
        log("\n== 1. CUDA tests on the device")
        tests = start_tests(args.tiny)

    shapes = TINY if args.tiny else SMOLLM2
    from gguf import GGMLQuantizationType as T
    from tests.reference import write_tiny_gguf
    path = os.path.join(tempfile.gettempdir(), "pykv_gpu_check_tiny.gguf" if args.tiny else "pykv_gpu_check_smollm2.gguf")
    t0 = time.perf_counter()
    write_tiny_gguf(path, {"default": T.Q4_1, "token_embd": T.Q8_0}, dim=shapes["dim"], ff=shapes["ff"],
                    n_heads=shapes["n_heads"], n_kv=shapes["n_kv"], n_layers=shapes["n_layers"], seed=0,
                    rope_base=shapes["rope_base"], n_vocab=shapes["n_vocab"], n_ctx=shapes["n_ctx"])
    log(f"\nsynthetic model {path}: {os.path.getsize(path) / 1e6:.1f} MB written in {time.perf_counter() - t0:.1f} s")

    log("\n== 2. greedy, CUDA vs CPU (exact float activations)")
    try:
        ok &= greedy_check(path, 2 if args.tiny else 16)
    finally:                  # the tests' results also when step 2 fails with an error
        if tests is not None:
            log("\n== 1. CUDA tests on the device (the results)")
            ok &= finish_tests(tests)

    log("\n== 3. attention bandwidth (attend_batch: one launch, merge included, for all sequences)")
    be = get_backend("cuda")
    bw, t = copy_bandwidth(be, (1 << 16) if args.tiny else (1 << 30), 2 if args.tiny else 10)
    log(f"  device-to-device copy: {bw / 1e9:.3g} GB/s (read + write bytes / time)")
    if args.tiny:
        rows = attention_table(shapes, (64,), (1, 2), ("q4_0", "int4"), 1)
    else:
        rows = attention_table(shapes, (4096, 32768), (1, 8, 32), ("f16", "q8_0", "q4_0", "int4"), 5)
    log("\n| KV | tokens | seqs | GB/s | % of copy |")
    log("|---|---:|---:|---:|---:|")
    for kt, n, S, C, nb, tt in rows:
        log(f"| {kt} | {n} | {S} | {nb / tt / 1e9:.3g} | {100 * nb / tt / bw:.3g} % |")

    log("\n== 4. decode speed (greedy, sampled on the device)")
    decode_speed(path, (16,) if args.tiny else (16, 4096), 1 if args.tiny else 64, counter)
    log(f"\ngpu_check: {'OK' if ok else 'MISMATCH'} in {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
