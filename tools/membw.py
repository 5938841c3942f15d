"""This host's DRAM read bandwidth: the physical limit of a decode step, which reads every weight once.

    python tools/membw.py [--mib 2048] [--threads 1,2] [--reps 5] [--json]

A Numba kernel streams an array much larger than the last-level cache (default 2 GiB) with a vectorized
float sum (four scalar accumulators), in prange chunks of 1 MiB, at each thread count; prints the best of
--reps passes in GB/s (10^9 bytes/s), with the host's ISA class and CPU model."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numba
import numpy as np
from numba import njit, prange

CHUNK = 1 << 18          # float32 values a work item (1 MiB)


@njit(parallel=True, fastmath=True, cache=True)
def stream_sum(a):
    """Sum of a (float32, a multiple of CHUNK long) by 1 MiB work items, four scalar accumulators each
    (LLVM widens them to vector registers), so that the loads, not one add's latency chain, set the pace.
    Scalar accumulators: an accumulator array kept the loop from being vectorized as well (about a
    quarter less at one thread)."""
    n = a.shape[0] // CHUNK
    parts = np.zeros(n, np.float32)
    for c in prange(n):
        b = a[c * CHUNK:(c + 1) * CHUNK]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for i in range(0, CHUNK, 4):
            s0 += b[i]
            s1 += b[i + 1]
            s2 += b[i + 2]
            s3 += b[i + 3]
        parts[c] = s0 + s1 + s2 + s3
    return parts.sum()


def bandwidth(a, threads: int, reps: int) -> float:
    numba.set_num_threads(threads)
    stream_sum(a)                      # compile / fault in
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        stream_sum(a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from pykv.tools.bench import cpu_model
    from pykv.kernels.tiles import ISA
    n = (a.mib << 20) // 4 // CHUNK * CHUNK
    arr = np.ones(n, np.float32)
    res = {}
    for t in (int(x) for x in a.threads.split(",")):
        t = min(t, numba.config.NUMBA_NUM_THREADS)
        res[t] = bandwidth(arr, t, a.reps)
    if a.json:
        print(json.dumps({"isa": ISA, "cpu": cpu_model(), "mib": a.mib, "gb_s": res}))
    else:
        print(f"DRAM read bandwidth, {a.mib} MiB streamed, best of {a.reps} ({ISA}, {cpu_model()}):")
        for t, v in res.items():
            print(f"  {t} thread{'s' if t > 1 else ''}: {v:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
