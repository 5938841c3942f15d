"""Train the codebooks of the trellis-coded KV formats (tc3b / tc2b) and write pykv/data/trellis.npz.

    python tools/train_trellis.py [--blocks 16000] [--iters 40] [--seed 0]

Lloyd iterations on unit-Gaussian blocks of 64 (what a Hadamard-rotated head vector looks like): encode
every block with the cache's own encoder (trellis.tc_viterbi: the same path and start state), then move
each of the 2^L levels to the mean of the values that chose it.  Deterministic for a seed; prints the
relative squared error per iteration (Lloyd-Max scalar levels at the same bits: 0.1175 / 0.0345)."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from numba import njit, prange

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pykv.files.formats import KV_FORMATS  # noqa: E402
from pykv.kernels.blocks import TC_FILE  # noqa: E402
from pykv.kernels.trellis import tc_perm, tc_viterbi  # noqa: E402


@njit(parallel=True)   # no cache: the tool runs as __main__, the test imports it
def _encode_all(X, cbp, L, k, states):
    """states[i] <- tc_viterbi's path of block X[i]; returns the summed squared error."""
    G = 1 << (L - k)
    err = np.zeros(X.shape[0])
    for i in prange(X.shape[0]):
        C = np.empty(1 << L, np.float32)
        m = np.empty(G, np.float32)
        mp = np.empty(G, np.float32)
        bb = np.empty(G, np.uint8)
        back = np.empty((X.shape[1], G), np.uint8)
        err[i] = tc_viterbi(X[i], cbp, L, k, states[i], C, m, mp, bb, back)
    return err.sum()


def train(L: int, k: int, blocks: int, iters: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((blocks, 64)).astype(np.float32)
    cb = rng.standard_normal(1 << L).astype(np.float32)
    states = np.empty(X.shape, np.int64)
    for it in range(iters):
        err = _encode_all(X, tc_perm(cb, L, k), L, k, states)
        sums = np.bincount(states.ravel(), X.ravel().astype(np.float64), 1 << L)
        cnt = np.bincount(states.ravel(), None, 1 << L)
        cb = np.where(cnt > 0, sums / np.maximum(cnt, 1), cb).astype(np.float32)
        print(f"L={L} k={k} iteration {it + 1}/{iters}: relative squared error {err / X.size:.5f}",
              file=sys.stderr, flush=True)
    return cb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16000)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=TC_FILE)
    a = ap.parse_args(argv)
    books = {f.name: train(f.tc_len, f.nl_runs[0][1], a.blocks, a.iters, a.seed)
             for f in KV_FORMATS.values() if f.tc_len}
    tmp = a.out + ".tmp.npz"
    np.savez(tmp, **books)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: " + ", ".join(f"{n} ({len(v)} levels)" for n, v in books.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
