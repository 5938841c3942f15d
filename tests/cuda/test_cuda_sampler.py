"""The device sampler (kernels.cuda.sampler.pick) gives the reference Sampler.pick's token for the same
uniform draw: greedy (NaN, ties, a repetition penalty), top-k / top-p / min-p / temperature, and the
host fallback when top-k is off."""
import numpy as np
import pytest

from pykv.decoder.sampler import Sampler, SamplerParams
from tests.cuda_util import cuda_or_skip, dev

V = 100


@pytest.fixture(scope="module")
def S():
    cuda_or_skip()
    from pykv.kernels.cuda import sampler
    return sampler


def _both(S, logits, params, history, u):
    s = Sampler(params, len(logits))
    return S.pick(dev(logits), s, history, u), s.pick(logits.copy(), history, u)


def test_greedy(S):
    r = np.random.default_rng(0)
    x = r.standard_normal(V).astype(np.float32)
    x[[17, 71]] = 9.0          # a tie: the lower id
    x[5] = np.nan               # never picked
    got, want = _both(S, x, SamplerParams(temperature=0.0), [], 0.0)
    assert got == want == 17
    # a penalty on 17 leaves 71
    got, want = _both(S, x, SamplerParams(temperature=0.0, repeat_penalty=2.0), [17, 3], 0.0)
    assert got == want == 71


@pytest.mark.parametrize("top_k,top_p,min_p,temp", [(8, 1.0, 0.0, 1.0), (12, 0.9, 0.05, 0.7),
                                                    (10, 0.5, 0.0, 1.5), (5, 1.0, 0.02, 3.0)])
def test_topk_topp_same_id(S, top_k, top_p, min_p, temp):
    r = np.random.default_rng(top_k)
    x = (2.0 * r.standard_normal(V)).astype(np.float32)
    p = SamplerParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=1.1)
    seen = set()
    for u in (0.05, 0.35, 0.65, 0.97):
        got, want = _both(S, x, p, [3, 4, 5], float(u))
        assert got == want
        seen.add(got)
    assert len(seen) > 1       # the draws reach different candidates


def test_top_k_off_falls_back_to_host(S):
    x = np.random.default_rng(9).standard_normal(V).astype(np.float32)
    p = SamplerParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0)
    for u in (0.1, 0.6, 0.95):
        got, want = _both(S, x, p, [], u)
        assert got == want


def _topk_ref(x, K):
    """The K largest (NaN as -inf, -0.0 as 0.0) by value descending, then id ascending."""
    w = np.where(np.isnan(x), -np.inf, x).astype(np.float32) + np.float32(0.0)
    order = np.lexsort((np.arange(len(w)), -w.astype(np.float64)))[:K]
    return order, w[order]


@pytest.mark.parametrize("case", ["ties", "inf", "nan_row", "signed_zero", "kmax"])
def test_topk_candidates_in_order(S, case):
    """The radix-select top-k lists exactly the K best candidates, ties at the cut by lower id."""
    r = np.random.default_rng(3)
    n, K = V, 7
    x = np.round(r.standard_normal(n), 1).astype(np.float32)        # many equal values
    if case == "ties":
        x[:] = np.float32(1.0)
        x[[40, 60, 80]] = 2.0                                       # 3 above the cut, then the first 4 ties
    elif case == "inf":
        x[::3] = -np.inf
        x[[9, 90]] = np.inf
    elif case == "nan_row":
        x[:] = np.nan                                               # flat: every id ties at -inf
    elif case == "signed_zero":
        x[:] = -1.0
        x[[50, 10, 30]] = [0.0, -0.0, 0.0]                          # equal: by id 10, 30, 50
        K = 2
    else:
        n, K = 1000, S.KMAX
        x = np.round(r.standard_normal(n), 1).astype(np.float32)
    p = SamplerParams(temperature=1.0, top_k=K, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    S.pick(dev(x), Sampler(p, n), [], 0.5)
    want_i, want_v = _topk_ref(x, K)
    got_i = S._BUF["cand"].copy_to_host()[:K]
    got_v = S._BUF["cval"].copy_to_host()[:K]
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v, want_v)
