"""kernels.cuda.matmul against its CPU twin (exact mode: float activations, weights dequantized
bit-exact) for every weight type, T = 1 and T > 1 (two token tiles), under the CUDA simulator
(tests/conftest.py) or on a GPU with PYKV_REAL_GPU=1."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from pykv.kernels import matmul as M
from tests.cuda_util import cuda_or_skip, dev, host
from tests.kernels.test_matmul import TYPES, make_weight

K_TYPES = (GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K)
ROWS = 3          # several blocks (NW rows each)


def _cols(t):
    return 256 if t in K_TYPES else 64


def _cpu_mm(w, x):
    act = M.Act(w.cols, x.shape[0])
    act.set(x)
    out = np.zeros((x.shape[0], w.rows), np.float32)
    M.set_exact(True)
    try:
        M.matmul(w, act, out)
    finally:
        M.set_exact(False)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_matches_cpu(t):
    cuda_or_skip()
    from pykv.kernels.cuda import matmul as CM
    rng = np.random.default_rng(int(t))
    cols = _cols(t)
    data, _ = make_weight(t, ROWS, cols, rng)
    w = M.prepare_weight(t, data, ROWS, cols, q8_act=False)
    dw = CM.prepare_weight(t, data, ROWS, cols)
    for T in (1, 3):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        act = CM.Act(cols, 12)
        act.set(dev(x))
        out = dev(np.full((12, ROWS), np.nan, np.float32))
        CM.matmul(dw, act, out)
        got, want = host(out), _cpu_mm(w, x)
        np.testing.assert_allclose(got[:T], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        assert np.isnan(got[T:]).all()    # rows past T untouched
    ids = np.array([2, 0, 2])
    rows = dev(np.zeros((3, cols), np.float32))
    CM.get_rows(dw, ids, rows)
    want = np.zeros((3, cols), np.float32)
    M.get_rows(w, ids, want)
    np.testing.assert_array_equal(host(rows), want)     # same float32 operations: bit-exact


def test_matmul_fused_three_types():
    """Q, K, V of different types and row counts through one launch equal three CPU products."""
    cuda_or_skip()
    from pykv.kernels.cuda import matmul as CM
    rng = np.random.default_rng(7)
    cols, T = 256, 9                         # 9 tokens: two tiles of TT = 8
    specs = [(GT.Q4_K, 6), (GT.Q8_0, 3), (GT.F16, 5)]
    x = rng.standard_normal((T, cols)).astype(np.float32)
    act = CM.Act(cols, T)
    act.set(dev(x))
    ws, outs, want = [], [], []
    for t, r in specs:
        data, _ = make_weight(t, r, cols, rng)
        ws.append(CM.prepare_weight(t, data, r, cols))
        outs.append(dev(np.zeros((T, r), np.float32)))
        want.append(_cpu_mm(M.prepare_weight(t, data, r, cols, q8_act=False), x))
    CM.matmul_fused(ws, act, outs)
    for o, wnt in zip(outs, want):
        np.testing.assert_allclose(host(o), wnt, rtol=2e-5, atol=2e-5 * np.abs(wnt).max())
    outs2 = [dev(np.zeros((T, r), np.float32)) for _, r in specs[:2]]
    CM.matmul_fused(ws[:2], act, outs2)          # two weights: gate / up
    for o, wnt in zip(outs2, want):
        np.testing.assert_allclose(host(o), wnt, rtol=2e-5, atol=2e-5 * np.abs(wnt).max())


def test_act_set_block_sums():
    cuda_or_skip()
    from pykv.kernels.cuda import matmul as CM
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    act = CM.Act(64, 4)
    act.set(dev(x))
    assert act.T == 2
    np.testing.assert_array_equal(host(act.x)[:2], x)
    np.testing.assert_allclose(host(act.xf)[:2], x.reshape(2, 2, 32).sum(-1), rtol=1e-6, atol=1e-6)
