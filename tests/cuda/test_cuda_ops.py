"""kernels.cuda.ops against the CPU ops (float32 tolerance) under the CUDA simulator: the norms with
their block sums, SwiGLU, rope, qkv_prep with rope / key smoothing / rotation on and off, attn_out_act."""
import numpy as np
import pytest

from pykv.kernels import ops as O
from tests.cuda_util import cuda_or_skip, dev, host

T, H, KVH, HD, D = 2, 4, 2, 64, 96
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def C():
    cuda_or_skip()
    from pykv.kernels.cuda import ops
    return ops


def _rng(s):
    return np.random.default_rng(s)


def test_rmsnorm_act_and_add(C):
    r = _rng(0)
    x, y = r.standard_normal((T, D)).astype(np.float32), r.standard_normal((T, D)).astype(np.float32)
    w = r.standard_normal(D).astype(np.float32)
    for add in (False, True):
        X, XF = np.zeros((T + 1, D), np.float32), np.zeros((T + 1, D // 32), np.float32)
        xc = x.copy()
        dx, dX, dXF = dev(x), dev(X), dev(XF)
        if add:
            O.add_rmsnorm_act(xc, y, w, 1e-5, X, XF)
            C.add_rmsnorm_act(dx, dev(y), dev(w), 1e-5, dX, dXF)
        else:
            O.rmsnorm_act(xc, w, 1e-5, X, XF)
            C.rmsnorm_act(dx, dev(w), 1e-5, dX, dXF)
        np.testing.assert_allclose(host(dx), xc, **TOL)
        np.testing.assert_allclose(host(dX), X, **TOL)
        np.testing.assert_allclose(host(dXF), XF, rtol=1e-5, atol=1e-4)
    out, dout = np.zeros((T, D), np.float32), dev(np.zeros((T, D), np.float32))
    O.rmsnorm(x, w, 1e-5, out)
    C.rmsnorm(dev(x), dev(w), 1e-5, dout)
    np.testing.assert_allclose(host(dout), out, **TOL)
    dx = dev(x)
    C.add_inplace(dx, dev(y))
    np.testing.assert_array_equal(host(dx), x + y)


def test_swiglu_act(C):
    r = _rng(1)
    F = 160                      # not a multiple of the 128-thread block
    g, u = (r.standard_normal((T, F)).astype(np.float32) for _ in range(2))
    X, XF = np.zeros((T, F), np.float32), np.zeros((T, F // 32), np.float32)
    dX, dXF = dev(X), dev(XF)
    O.swiglu_act(g, u, X, XF)
    C.swiglu_act(dev(g), dev(u), dX, dXF)
    np.testing.assert_allclose(host(dX), X, **TOL)
    np.testing.assert_allclose(host(dXF), XF, rtol=1e-5, atol=1e-4)


def _tables(n_rot=HD):
    return O.rope_tables(64, n_rot, 10000.0)


@pytest.mark.parametrize("do_rope,smooth,rotate", [(True, False, False), (True, True, True), (False, True, False),
                                                   (True, False, True)])
def test_qkv_prep(C, do_rope, smooth, rotate):
    r = _rng(2)
    q = r.standard_normal((T, H, HD)).astype(np.float32)
    k = r.standard_normal((T, KVH, HD)).astype(np.float32)
    v = r.standard_normal((T, KVH, HD)).astype(np.float32)
    shift = r.standard_normal((KVH, HD)).astype(np.float32)
    scale = r.uniform(0.5, 2.0, (KVH, HD)).astype(np.float32)
    sign = r.choice(np.array([-1.0, 1.0], np.float32), HD)
    cos, sin = _tables(48)        # a partial rotary dimension: the last 16 channels stay
    args = (7, cos, sin, 48, do_rope, shift, scale, smooth, sign, rotate, np.float32(0.125))
    dq, dk, dv = dev(q), dev(k), dev(v)
    C.qkv_prep(dq, dk, dv, *(dev(a) if isinstance(a, np.ndarray) else a for a in args))
    O.qkv_prep(q, k, v, *args)
    for d, c in ((dq, q), (dk, k), (dv, v)):
        np.testing.assert_allclose(host(d), c, **TOL)


def test_rope(C):
    r = _rng(3)
    x = r.standard_normal((T, H, HD)).astype(np.float32)
    cos, sin = _tables()
    dx = dev(x)
    C.rope(dx, 5, dev(cos), dev(sin), HD)
    O.rope(x, 5, cos, sin, HD)
    np.testing.assert_allclose(host(dx), x, **TOL)


@pytest.mark.parametrize("rotate", [False, True])
def test_attn_out_act(C, rotate):
    r = _rng(4)
    att = r.standard_normal((T, H, HD)).astype(np.float32)
    sign = r.choice(np.array([-1.0, 1.0], np.float32), HD)
    X, XF = np.zeros((T, H * HD), np.float32), np.zeros((T, H * HD // 32), np.float32)
    da, dX, dXF = dev(att), dev(X), dev(XF)
    C.attn_out_act(da, dev(sign), rotate, dX, dXF)
    O.attn_out_act(att, sign, rotate, X, XF)
    np.testing.assert_allclose(host(da), att, **TOL)
    np.testing.assert_allclose(host(dX), X, **TOL)
    np.testing.assert_allclose(host(dXF), XF, rtol=1e-5, atol=1e-4)


def test_fill_zero(C):
    a = dev(np.ones((3, 5, 7), np.float32))
    C.fill_zero(a)
    assert not host(a).any()
    b = dev(np.ones(105, np.float32))       # the kernel itself, striding: 2 blocks of 16 threads
    C._fill_zero_kernel[2, 16](b)
    assert not host(b).any()


def test_key_xform(C):
    """klt key layers: the GPU twin applies the same per-group maps to keys and their query heads."""
    r = _rng(7)
    q = r.standard_normal((T, H, HD)).astype(np.float32)
    k = r.standard_normal((T, KVH, HD)).astype(np.float32)
    mk = r.standard_normal((KVH, HD, HD)).astype(np.float32) / 8
    mq = r.standard_normal((KVH, HD, HD)).astype(np.float32) / 8
    mu = r.standard_normal((KVH, HD)).astype(np.float32)
    qc, kc = q.copy(), k.copy()
    O.key_xform(qc, kc, mk, mq, mu)
    assert not np.allclose(qc, q) and not np.allclose(kc, k)
    dq, dk = dev(q), dev(k)
    C.key_xform(dq, dk, dev(mk), dev(mq), dev(mu))
    np.testing.assert_allclose(host(dk), kc, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(host(dq), qc, rtol=1e-4, atol=1e-4)
