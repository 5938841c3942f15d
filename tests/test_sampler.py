import numpy as np
import pytest

from pykv.decoder.sampler import Sampler, SamplerParams


def P(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                repeat_penalty=1.0, repeat_last_n=64, seed=0)
    base.update(kw)
    return SamplerParams(**base)


def draws(params, logits, n, history=()):
    s = Sampler(params, len(logits))
    logits = np.asarray(logits, dtype=np.float32)
    return np.array([s.sample(logits, list(history)) for _ in range(n)])


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def test_defaults():
    p = SamplerParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.seed) == (1.0, 64, None)


def test_greedy_first_max():
    logits = np.array([0.1, 3.0, -1.0, 3.0], dtype=np.float32)
    for t in (0.0, -1.0):
        s = Sampler(P(temperature=t, seed=None), 4)
        assert all(s.sample(logits, []) == 1 for _ in range(20))


def test_greedy_with_repeat_penalty():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    s = Sampler(P(temperature=0.0, repeat_penalty=1.5), 3)
    assert s.sample(logits, []) == 0
    assert s.sample(logits, [0]) == 1


def test_wrong_size_raises():
    with pytest.raises(ValueError):
        Sampler(P(), 4).sample(np.zeros(5, np.float32), [])


def test_top_k():
    logits = [2.0, 1.9, 1.8, -5.0]
    d = draws(P(top_k=2), logits, 2000)
    assert set(d.tolist()) == {0, 1}
    assert set(draws(P(top_k=1), logits, 200).tolist()) == {0}
    # top_k=0 and top_k >= n_vocab are no-ops
    logits2 = [1.0, 0.9, 0.8, 0.7]
    assert set(draws(P(top_k=0), logits2, 2000).tolist()) == {0, 1, 2, 3}
    assert set(draws(P(top_k=10), logits2, 2000).tolist()) == {0, 1, 2, 3}


def test_top_p():
    # probs: 0.5, 0.3, 0.15, 0.05
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    assert set(draws(P(top_p=0.5), logits, 500).tolist()) == {0}
    assert set(draws(P(top_p=0.7), logits, 2000).tolist()) == {0, 1}
    assert set(draws(P(top_p=0.9), logits, 3000).tolist()) == {0, 1, 2}
    assert set(draws(P(top_p=1.0), logits, 5000).tolist()) == {0, 1, 2, 3}


def test_top_p_after_top_k():
    # after top_k=2 the renormalised probs are 0.625 / 0.375
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(draws(P(top_k=2, top_p=0.6), logits, 500).tolist()) == {0}
    assert set(draws(P(top_k=2, top_p=0.63), logits, 2000).tolist()) == {0, 1}


def test_min_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    # keep p >= min_p * p_max
    assert set(draws(P(min_p=0.5), logits, 2000).tolist()) == {0, 1}
    assert set(draws(P(min_p=0.29), logits, 3000).tolist()) == {0, 1, 2}
    assert set(draws(P(min_p=0.9), logits, 500).tolist()) == {0}


def test_min_p_and_top_p_combined():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    # top_p=0.95 alone keeps 4; min_p=0.6 keeps {0,1}
    assert set(draws(P(top_p=0.95, min_p=0.6), logits, 2000).tolist()) == {0, 1}
    # min_p=0.2 keeps all 4; top_p=0.6 keeps {0,1} (cumsum over original normaliser)
    assert set(draws(P(top_p=0.6, min_p=0.2), logits, 2000).tolist()) == {0, 1}


def test_repeat_penalty_positive_and_negative():
    s = Sampler(P(temperature=0.0, repeat_penalty=2.0), 3)
    pos = np.array([3.0, 2.0, 0.0], np.float32)  # 3/2 = 1.5 < 2
    assert s.sample(pos, [0]) == 1
    neg = np.array([-1.0, -1.5, -10.0], np.float32)  # -1*2 = -2 < -1.5
    assert s.sample(neg, [0]) == 1
    # a repeated token counts once
    assert s.sample(np.array([3.0, 1.0, 0.0], np.float32), [0, 0, 0, 0]) == 0


def test_repeat_last_n_window():
    logits = np.array([3.0, 2.0, 0.0], np.float32)
    s = Sampler(P(temperature=0.0, repeat_penalty=2.0, repeat_last_n=2), 3)
    assert s.sample(logits, [0, 2, 2]) == 0  # 0 is outside the window
    assert s.sample(logits, [2, 0, 2]) == 1
    s0 = Sampler(P(temperature=0.0, repeat_penalty=2.0, repeat_last_n=0), 3)
    assert s0.sample(logits, [0]) == 0
    sall = Sampler(P(temperature=0.0, repeat_penalty=2.0, repeat_last_n=-1), 3)
    assert sall.sample(logits, [0] + [2] * 500) == 1


def test_repeat_penalty_sampling_mode():
    logits = np.array([5.0, 4.0, -20.0], np.float32)
    d = draws(P(repeat_penalty=4.0, top_k=2), logits, 2000, history=[0])
    # 5/4 = 1.25 vs 4 -> token 1 dominates
    assert (d == 1).mean() > 0.9


def test_seed_repeatability():
    rng = np.random.default_rng(123)
    logits = rng.normal(size=500).astype(np.float32) * 2
    par = SamplerParams(seed=42, top_k=0, top_p=1.0, min_p=0.0)
    a = draws(par, logits, 200)
    b = draws(SamplerParams(seed=42, top_k=0, top_p=1.0, min_p=0.0), logits, 200)
    c = draws(SamplerParams(seed=43, top_k=0, top_p=1.0, min_p=0.0), logits, 200)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    # defaults too
    d1 = draws(SamplerParams(seed=7), logits, 100)
    d2 = draws(SamplerParams(seed=7), logits, 100)
    assert np.array_equal(d1, d2)


def test_input_not_modified():
    logits = np.array([3.0, -2.0, 1.0], np.float32)
    keep = logits.copy()
    Sampler(P(repeat_penalty=1.3), 3).sample(logits, [0, 1])
    assert np.array_equal(logits, keep)


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_distribution_matches_softmax(temp):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 0.2], np.float32)
    n = 20000
    d = draws(P(temperature=temp, seed=1234), logits, n)
    counts = np.bincount(d, minlength=len(logits))
    expected = softmax(logits.astype(np.float64) / temp) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # 5 dof: p=0.001 critical value is 20.5
    assert chi2 < 20.5, (chi2, counts, expected)


def test_distribution_after_top_k():
    logits = np.array([1.0, 0.8, 0.6, 0.0, -1.0], np.float32)
    n = 20000
    d = draws(P(temperature=0.7, top_k=3, seed=99), logits, n)
    counts = np.bincount(d, minlength=5)
    assert counts[3] == 0 and counts[4] == 0
    expected = softmax(logits[:3].astype(np.float64) / 0.7) * n
    chi2 = ((counts[:3] - expected) ** 2 / expected).sum()
    assert chi2 < 13.8  # 2 dof, p=0.001


def test_neg_inf_logits_never_sampled():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.1], np.float32)
    d = draws(SamplerParams(seed=0, top_k=0, top_p=1.0, min_p=0.0), logits, 1000)
    assert set(d.tolist()) <= {1, 3}


def test_large_vocab_default_params():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=49152).astype(np.float32) * 3
    s = Sampler(SamplerParams(seed=0), len(logits))
    top = set(np.argsort(-logits)[:40].tolist())
    for _ in range(50):
        assert s.sample(logits, []) in top


def test_nan_logits_ignored():
    logits = np.array([np.nan, 0.0, 1.0, np.nan], np.float32)
    assert Sampler(P(temperature=0.0), 4).sample(logits, []) == 2
    d = draws(P(top_k=3), logits, 500)
    assert set(d.tolist()) <= {1, 2}


def _reference_kept(logits, top_k, top_p, min_p):
    """Straightforward llama.cpp-order filtering: sort, top-k, top-p, min-p."""
    x = np.asarray(logits, np.float64)
    order = np.argsort(-x, kind="stable")
    x = x[order]
    if 0 < top_k < len(x):
        order, x = order[:top_k], x[:top_k]
    if top_p < 1.0:
        pr = softmax(x)
        cum = np.cumsum(pr)
        n = len(x)
        for i in range(len(x)):
            if cum[i] >= top_p:
                n = i + 1
                break
        order, x = order[:n], x[:n]
    if min_p > 0:
        keep = x >= x[0] + np.log(min_p)
        order, x = order[keep], x[keep]
    return set(order.tolist())


@pytest.mark.parametrize("top_k,top_p,min_p", [
    (40, 0.95, 0.05), (0, 0.95, 0.05), (0, 0.9, 0.0), (10, 1.0, 0.1),
    (0, 0.5, 0.3), (100, 0.7, 0.01), (0, 1.0, 0.0),
])
def test_candidates_match_reference(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k * 1000 + int(top_p * 100) + int(min_p * 100))
    for _ in range(20):
        logits = (rng.normal(size=2000) * rng.uniform(0.5, 4)).astype(np.float32)
        s = Sampler(P(top_k=top_k, top_p=top_p, min_p=min_p, temperature=0.7), 2000)
        idx, w = s.candidates(logits)
        assert set(idx.tolist()) == _reference_kept(logits, top_k, top_p, min_p)
        assert np.all(w > 0)
