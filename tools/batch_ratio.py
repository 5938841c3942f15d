"""Batched decode against one sequence, without HTTP: Decoder.step of S one-token sequences, and of one.

    python tools/batch_ratio.py [MODEL] [--seqs 8] [--depth 100] [--steps 20] [--rounds 3] [-ctk f16] [-ctv f16]
                                [--threads 2]

Prefills S sequences to depth .. depth + 3 (S - 1) tokens, then alternates rounds of --steps steps of
sequence 0 alone and of all S (every step one new token each, so the depth grows by 2 x steps a round),
and prints per round the median ms per step, tokens/s and the ratio S x (one step) / (S-sequence step): the
decode throughput of the batch in units of the single-sequence rate (issue 41 asks for 4 at S = 8); then
the same from each group's 10th-percentile step (on a host whose speed drifts, the steadier figure).
The host's ISA class (kernels.tiles.ISA) and CPU model are printed first: figures depend on both.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pykv.decoder.model import Decoder  # noqa: E402
from pykv.kernels.tiles import ISA  # noqa: E402
from pykv.tools.bench import cpu_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--depth", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    S = max(1, a.seqs)
    n_ctx = a.depth + 3 * S + 2 * a.steps * (a.rounds + 1) + 16      # the warm-up steps too
    d = Decoder(a.model, n_ctx=n_ctx, max_seqs=max(S, 2), threads=a.threads, kv_type_k=a.ctk, kv_type_v=a.ctv)
    print(f"host: {cpu_model()}, pykv class {ISA}, {os.cpu_count()} CPUs; {os.path.basename(d.path)}, "
          f"K/V {a.ctk}/{a.ctv}, {S} sequences from depth {a.depth}", flush=True)
    rng = np.random.default_rng(0)
    seqs = [d.cache.new_sequence() for _ in range(S)]
    for i, s in enumerate(seqs):
        d.eval(s, rng.integers(100, d.n_vocab // 2, a.depth + 3 * i))

    def steps(group):
        ts = []
        for _ in range(a.steps):
            work = [(s, [int(rng.integers(100, d.n_vocab // 2))]) for s in group]
            t0 = time.perf_counter()
            d.step(work)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3, float(np.percentile(ts, 10)) * 1e3

    steps(seqs[:1])          # compile and warm both shapes
    steps(seqs)
    for r in range(a.rounds):
        (one, one10), (many, many10) = steps(seqs[:1]), steps(seqs)
        print(f"round {r + 1}: 1 sequence {one:.2f} ms/step ({1e3 / one:.0f} t/s); {S} sequences {many:.2f} ms/step "
              f"({S * 1e3 / many:.0f} t/s); ratio {S * one / many:.2f}x; fastest tenth (p10) {one10:.2f} / "
              f"{many10:.2f} ms, ratio {S * one10 / many10:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
