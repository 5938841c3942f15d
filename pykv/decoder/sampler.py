"""llama.cpp-style token sampling over a float32 logits vector.

Chain order (llama.cpp's default for the parameters we support):

    repetition penalty -> top-k -> top-p -> min-p -> temperature -> dist

``temperature <= 0`` selects greedy decoding: the repetition penalty is still
applied (as llama.cpp does), then the first maximal logit is returned.

Everything is numpy and per-token cost is O(V) plus a sort of the surviving
candidates only (top-k and min-p shrink the set before any sort happens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["SamplerParams", "Sampler"]


@dataclass
class SamplerParams:
    temperature: float = 0.8
    top_k: int = 40              # <= 0: off
    top_p: float = 0.95          # >= 1: off
    min_p: float = 0.05          # <= 0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64      # 0: off, -1: whole history
    seed: Optional[int] = None   # None: nondeterministic


class Sampler:
    def __init__(self, params: SamplerParams, n_vocab: int):
        if n_vocab <= 0:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        self.params = params
        self.n_vocab = int(n_vocab)
        self.rng = np.random.default_rng(params.seed)

    # -- individual stages -------------------------------------------------
    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        n = p.repeat_last_n
        if p.repeat_penalty == 1.0 or n == 0 or not len(history):
            return logits
        recent = history if n < 0 else history[-n:]
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < self.n_vocab)]
        if ids.size == 0:
            return logits
        out = logits.copy()
        v = out[ids]
        # llama.cpp: each distinct token penalised once; logit <= 0 is
        # multiplied, positive logit divided.
        out[ids] = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        return out

    # -- main entry ----------------------------------------------------------
    def _prepare(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        if logits.shape[0] != self.n_vocab:
            raise ValueError(f"expected {self.n_vocab} logits, got {logits.shape[0]}")
        if np.isnan(logits).any():  # treat NaN as "never pick"
            logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
        return self._penalize(logits, history)

    def greedy(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Repetition penalty, then the first maximal logit."""
        return int(np.argmax(self._prepare(logits, history)))

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()):
        """Run the filter chain; return (token ids, unnormalised probabilities
        after temperature).  Ids are in no particular order.  Ignores
        ``temperature <= 0`` (treated as 1)."""
        p = self.params
        temp = p.temperature if p.temperature > 0 else 1.0
        logits = self._prepare(logits, history)

        # top-k (argpartition: O(V)); everything after works on the survivors
        k = int(p.top_k)
        V = self.n_vocab
        if 0 < k < V:
            idx = np.argpartition(logits, V - k)[V - k:]
            vals = logits[idx].astype(np.float64)
        else:
            idx = np.arange(V)
            vals = logits.astype(np.float64)

        vmax = float(vals.max())
        if vmax == -math.inf:  # everything masked: uniform over what is left
            vals = np.zeros_like(vals)
            vmax = 0.0

        # top-p and min-p each keep a prefix of the descending order, and the
        # top-p cumulative sum is normalised over the post-top-k set.  So we
        # compute that normaliser first, apply min-p as an O(n) filter, and
        # sort only the survivors; the kept prefix is identical to applying
        # the two filters in llama.cpp's order.
        use_top_p = p.top_p < 1.0
        z = float(np.exp(vals - vmax).sum()) if use_top_p else 1.0

        if p.min_p > 0.0:
            keep = vals >= vmax + math.log(p.min_p)
            if not keep.all():
                idx, vals = idx[keep], vals[keep]

        if use_top_p and idx.size > 1:
            order = np.argsort(-vals, kind="stable")
            idx, vals = idx[order], vals[order]
            cum = np.cumsum(np.exp(vals - vmax)) / z
            cut = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            if cut < idx.size:
                idx, vals = idx[:cut], vals[:cut]

        # temperature -> unnormalised softmax weights
        return idx, np.exp((vals - vmax) / temp)

    def draw(self) -> float:
        """The uniform number in [0, 1) of one sampling step (0.0 when greedy: nothing is drawn)."""
        return float(self.rng.random()) if self.params.temperature > 0 else 0.0

    def pick(self, logits: np.ndarray, history: Sequence[int], u: float) -> int:
        """One token for the uniform draw u (ignored when greedy): the candidates in descending order
        of logit (ties: lower id first), the first whose cumulative weight exceeds u times the total.
        The device sampler (kernels.cuda.sampler) gives the same id for the same u."""
        if self.params.temperature <= 0:
            return self.greedy(logits, history)
        idx, w = self.candidates(logits, history)
        if idx.size == 1:
            return int(idx[0])
        order = np.lexsort((idx, -w))
        idx, w = idx[order], w[order]
        cdf = np.cumsum(w)
        j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(idx[min(j, idx.size - 1)])

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        return self.pick(logits, history, self.draw())
