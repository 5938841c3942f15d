"""Calibrated key transforms for the klt key types (transform coding of the keys).

A query's score error from quantized keys is q . e (e = k - k_hat).  With the key covariance Sk
(centred) and the query second moment Sq of a KV head (its G query heads pooled), the expected squared
error for a key map y = A (k - mu) and queries q' = A^-T q (so q'.y = q.(k - mu): exact, and q.mu is
the same for every key of a query, which softmax ignores) is what the quantizer's noise on y costs,
weighted by E[q' q'^T] = A^-T Sq A^-1.  The *balanced* map

    Sk = Lk Lk^T (Cholesky),  Lk^T Sq Lk = U diag(sigma^2) U^T (sigma descending),
    A = diag(sigma)^(1/2) U^T Lk^-1

makes both the keys' and the queries' second moments diag(sigma): channel i of y moves the scores by
sigma_i, and the first few channels carry most of the score variance.  The klt formats
(formats.KV_FORMATS: nl blocks with code widths falling along the block, ``nl_runs``) spend their bits
there: y's channels in sigma order fill the runs, a sign-flipped Walsh-Hadamard transform inside each
run makes its values Gaussian-like and equal in spread, and each run is scaled to unit variance so one
f16 scale per block serves every width.  All of it folds into one
matrix per KV head: the key side M_k (HD, HD) applied to k - mu after RoPE (and after the cache's
Hadamard rotation, whose matrix R is folded in: M_k = A R^T, mu_r = R mu, M_q = A^-T R^T), the query
side M_q = M_k^-T.  `ops.key_xform` applies them; attention then runs unchanged on the stored y.

The statistics come from the model's own keys and queries on the built-in calibration text
(pykv/data/kv_calib.txt, not the reference text), run once through an f16 cache without rotation,
in windows of min(n_ctx, CALIB_CTX) tokens, token 0 of each window (the attention sink, kept exact in
f16 anyway) left out.  They are cached per model fingerprint, ids and window in
``$PYKV_CACHE/kv_transform`` (default ~/.cache/pykv), so a second load costs one eigendecomposition per
KV head and layer.  klt types are key types only: on values the same map does worse than the Hadamard
rotation.  Figures: docs/code-notes.md.
"""
from __future__ import annotations

import hashlib
from importlib import resources
import json
import os
import sys
import tempfile

import numpy as np

from pykv.files.config import PykvError

VERSION = 1
CALIB_CTX = 1024     # calibration window (tokens); shorter when the model's context is
REG = 1e-6           # ridge on Sk and Sq (relative to their mean diagonal) before the factorizations
SIGN_SEED = 0x4B17   # the run Hadamards' fixed sign flips
Q_SHRINK = 0.7      # Sq shrunk toward its mean diagonal before the map (0: the pooled query moment as
                    # measured, 1: the keys' own KLT): a pooled query moment over-trusts the directions
                    # that most queries leave alone and some use (the sweep: docs/code-notes.md)


# ---- statistics -----------------------------------------------------------------------------------

class Capture:
    """Accumulates per layer and KV head the key sum / second moment and the pooled query second moment
    (KVCache.capture: append passes the keys, attend the queries, both as the cache sees them)."""

    def __init__(self, n_layers: int, kvh: int, hd: int):
        self.n = np.zeros(n_layers)
        self.ks = np.zeros((n_layers, kvh, hd))
        self.kk = np.zeros((n_layers, kvh, hd, hd))
        self.nq = np.zeros(n_layers)
        self.qq = np.zeros((n_layers, kvh, hd, hd))

    def keys(self, li: int, k: np.ndarray, pos0: int) -> None:        # k (T, KVH, HD)
        k = np.asarray(k, np.float64)[max(0, 1 - pos0):]              # position 0 left out
        self.n[li] += k.shape[0]
        self.ks[li] += k.sum(axis=0)
        self.kk[li] += np.einsum("tgi,tgj->gij", k, k)

    def queries(self, li: int, q: np.ndarray, pos0: int) -> None:     # q (T, H, HD)
        q = np.asarray(q, np.float64)[max(0, 1 - pos0):]
        T, H, HD = q.shape
        kvh = self.qq.shape[1]
        q = q.reshape(T, kvh, H // kvh, HD)
        self.nq[li] += T * (H // kvh)
        self.qq[li] += np.einsum("tgai,tgaj->gij", q, q)

    def stats(self) -> dict:
        n = self.n[:, None, None]
        mu = self.ks / n
        sk = self.kk / n[..., None] - np.einsum("lgi,lgj->lgij", mu, mu)
        sq = self.qq / self.nq[:, None, None, None]
        return {"mu": mu, "sk": sk, "sq": sq}


def fingerprint(path) -> str:
    """sha256 over the file size and 16 samples of 64 KiB spread over the file (fast, content-based)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for i in range(16):
            f.seek(size * i // 16)
            h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def default_calib_text() -> str:
    """The built-in calibration text (pykv/data/kv_calib.txt: plain English written for pykv, not the
    reference text)."""
    return resources.files("pykv").joinpath("data/kv_calib.txt").read_text(encoding="utf-8")


def _cache_path(model, ids, win: int) -> str:
    base = os.environ.get("PYKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pykv")
    key = hashlib.sha256(json.dumps([VERSION, fingerprint(model.path), list(map(int, ids)), win]).encode())
    return os.path.join(base, "kv_transform", key.hexdigest()[:24] + ".npz")


def calib_stats(model, use_cache: bool = True, quiet: bool = False) -> dict:
    """mu (L, KVH, HD), sk, sq (L, KVH, HD, HD) float64 of the model's roped keys and queries (queries
    as attention gets them: roped, times 1/sqrt(HD)) on the built-in calibration text.  Leaves the
    model with an f16 cache (Model.set_kv_types builds the real one next)."""
    ids = model.tokenize(default_calib_text())
    win = min(model.n_ctx, CALIB_CTX)
    path = _cache_path(model, ids, win)
    if use_cache and os.path.exists(path):
        try:
            with np.load(path) as z:
                st = {k: z[k] for k in ("mu", "sk", "sq")}
            if all(np.isfinite(v).all() for v in st.values()):
                return st
        except (OSError, ValueError, KeyError):
            pass                              # unreadable (or not finite): measure again and overwrite
    if not quiet and sys.stderr.isatty():
        print("pykv: calibrating the klt key transform (once per model)", file=sys.stderr, flush=True)
    cfg = model.config
    model.set_kv_types("f16", "f16", kv_rotate=False)
    cap = Capture(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    model.cache.capture = cap
    try:
        for s in range(0, len(ids), win):
            chunk = ids[s:s + win]
            if len(chunk) < 16 and s:
                break
            model.eval(model.new_sequence(), chunk)
    finally:
        model.cache.capture = None
    st = cap.stats()
    if use_cache and all(np.isfinite(v).all() for v in st.values()):     # a failed run is not kept
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp.npz")
        os.close(fd)
        try:
            np.savez(tmp, **st)
            os.replace(tmp, path)
        except OSError:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return st


# ---- the maps -------------------------------------------------------------------------------------

def hadamard(n: int) -> np.ndarray:
    """Sylvester's Walsh-Hadamard matrix (n a power of two), entries +-1: the order ops._butterfly uses."""
    i = np.arange(n)
    pc = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(pc % 2 == 0, 1.0, -1.0)


def rotation_matrix(sign) -> np.ndarray:
    """R (HD, HD) of the cache's key / query rotation (ops._fwht_vec forward): v -> H diag(sign) v / sqrt(HD)."""
    sign = np.asarray(sign, np.float64)
    return hadamard(len(sign)) * sign[None, :] / np.sqrt(len(sign))


def balanced_map(sk: np.ndarray, sq: np.ndarray, runs) -> np.ndarray:
    """A (HD, HD): y = A (k - mu) in the klt layout of nl_runs `runs` (module docstring).  HD a
    multiple of 64: sorted channel i goes to block i % nb, position i // nb (every block gets the
    same share of the large channels)."""
    HD = sk.shape[0]
    eye = np.eye(HD)
    sk = sk + REG * max(np.trace(sk) / HD, 1e-30) * eye
    sq = (1 - Q_SHRINK) * sq + Q_SHRINK * np.trace(sq) / HD * eye
    sq = sq + REG * max(np.trace(sq) / HD, 1e-30) * eye
    lk = np.linalg.cholesky(sk)
    lam, u = np.linalg.eigh(lk.T @ sq @ lk)
    order = np.argsort(-lam, kind="stable")
    lam, u = np.maximum(lam[order], 0.0), u[:, order]
    sig = np.sqrt(lam) + 1e-30
    a = (np.sqrt(sig)[:, None] * u.T) @ np.linalg.inv(lk)      # var((A k)_i) = sig_i
    nb = HD // 64
    perm = np.array([j * nb + b for b in range(nb) for j in range(64)])
    a, sig = a[perm], sig[perm]
    rng = np.random.default_rng(SIGN_SEED)
    for b in range(nb):
        o = 64 * b
        for n, _bits in runs:
            h = hadamard(n) * rng.choice([-1.0, 1.0], n)[None, :] / np.sqrt(n)
            a[o:o + n] = h @ a[o:o + n] / np.sqrt(sig[o:o + n].mean())
            o += n
    return a


def layer_maps(stats: dict, k_fmts, sign=None) -> list:
    """Per layer: None (not a klt key type) or (mk, mq, mu) float32 (KVH, HD, HD), (KVH, HD, HD),
    (KVH, HD) for ops.key_xform, with the cache's rotation (signs `sign`, None: no rotation) folded in."""
    r = None if sign is None else rotation_matrix(sign)
    out = []
    for li, f in enumerate(k_fmts):
        if f.kind != "klt":
            out.append(None)
            continue
        mus, sks, sqs = stats["mu"][li], stats["sk"][li], stats["sq"][li]
        kvh, hd = mus.shape
        mk = np.zeros((kvh, hd, hd))
        mq = np.zeros((kvh, hd, hd))
        mu = np.zeros((kvh, hd))
        for g in range(kvh):
            a = balanced_map(sks[g], sqs[g], f.nl_runs)
            ai_t = np.linalg.inv(a).T
            if r is None:
                mk[g], mq[g], mu[g] = a, ai_t, mus[g]
            else:
                mk[g], mq[g], mu[g] = a @ r.T, ai_t @ r.T, r @ mus[g]
        if not (np.isfinite(mk).all() and np.isfinite(mq).all()):
            raise PykvError(f"klt key transform of layer {li} is not finite (degenerate calibration keys)")
        out.append((mk.astype(np.float32), mq.astype(np.float32), mu.astype(np.float32)))
    return out
