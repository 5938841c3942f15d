"""CPU twin of kernels/cuda/sampler.py: one token from a logits row of this backend (the reference
sampler, pykv.decoder.sampler.Sampler, on host logits), and the reference's top-k selection."""
import numpy as np
from numba import njit


def pick(logits, sampler, history, u: float) -> int:
    """The token sampler.pick chooses from logits (V,) for the uniform draw u."""
    return sampler.pick(np.asarray(logits).reshape(-1), history, u)


@njit(cache=True, nogil=True, inline="always")
def _worse(x, a, b):
    """Candidate a ranks below b: a smaller value, or the same value and a larger id."""
    return x[a] < x[b] or (x[a] == x[b] and a > b)


@njit(cache=True, nogil=True, inline="always")
def _sift(x, h, k, i):
    """Restore the min-heap h[:k] (its root the worst candidate) below position i."""
    while True:
        c = 2 * i + 1
        if c >= k:
            return
        if c + 1 < k and _worse(x, h[c + 1], h[c]):
            c += 1
        if not _worse(x, h[c], h[i]):
            return
        h[i], h[c] = h[c], h[i]
        i = c


_SPAN = 32      # values whose maximum top_k checks before looking at them one by one


@njit(cache=True, nogil=True, inline="always")
def _offer(x, h, k, j0, j1, worst):
    """Values j0 .. j1-1 into the heap h[:k]; returns the new worst kept value."""
    for j in range(j0, j1):
        if x[j] > worst:        # an equal value has a larger id than every kept one: not better
            h[0] = j
            _sift(x, h, k, 0)
            worst = x[h[0]]
    return worst


@njit(cache=True, nogil=True, fastmath={"nnan", "nsz", "reassoc"})
def _span_maxima(x, sm):
    """sm[s] = the maximum of x's span s (_SPAN values)."""
    for s in range(sm.shape[0]):
        j = s * _SPAN
        m = x[j]
        for i in range(j + 1, j + _SPAN):
            v = x[i]
            m = m if m >= v else v
        sm[s] = m


@njit(cache=True, nogil=True)
def _heap_init(x, h, k):
    for i in range(k):
        h[i] = i
    for i in range(k // 2 - 1, -1, -1):
        _sift(x, h, k, i)
    return x[h[0]]


@njit(cache=True, nogil=True)
def top_k(x, k, h):
    """h[:k] = the ids of the k largest values of x (float32 (V,), no NaN; 0 < k <= V), ties at the k-th
    value taken by lower id, as the device's radix select takes them; in no particular order.  A heap of
    the k best so far, offered only the spans of x (_SPAN values) whose maximum reaches t: the k-th
    largest of the spans' maxima (k values of x, so at most x's k-th largest), itself found by a heap pass
    over the maxima.  One pass over x whatever its order (sorted logits would otherwise sift at every value)."""
    n = x.shape[0]
    nsp = n // _SPAN
    if nsp < k:
        _offer(x, h, k, k, n, _heap_init(x, h, k))
        return
    sm = np.empty(nsp, np.float32)
    _span_maxima(x, sm)
    _offer(sm, h, k, k, nsp, _heap_init(sm, h, k))
    t = sm[h[0]]
    worst = _heap_init(x, h, k)
    for s in range(nsp):
        m = sm[s]
        if m >= t and m > worst:
            worst = _offer(x, h, k, max(k, s * _SPAN), (s + 1) * _SPAN, worst)
    _offer(x, h, k, max(k, nsp * _SPAN), n, worst)
