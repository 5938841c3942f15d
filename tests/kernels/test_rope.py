"""RoPE on fewer dimensions than head_dim (llama.rope.dimension_count < head_dim): the kernels and a
whole tiny model against numpy references."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

import pykv
from pykv.kernels import matmul as mm
from pykv.kernels.ops import qkv_prep, rope, rope_tables
from tests.reference import gguf_forward, write_tiny_gguf

BASE = 10000.0


def rope_ref(x, pos0, n_rot):
    """float64 rope written as complex rotations: pair (2i, 2i+1) is z_i = x[2i] + j x[2i+1], turned by
    (pos0 + t) * BASE^(-2i / n_rot); dimensions n_rot.. pass through unchanged."""
    out = x.astype(np.float64)
    p = pos0 + np.arange(x.shape[0], dtype=np.float64)
    theta = BASE ** (-np.arange(0, n_rot, 2) / n_rot)                       # (n_rot/2,)
    z = (out[..., 0:n_rot:2] + 1j * out[..., 1:n_rot:2]) * np.exp(1j * p[:, None, None] * theta)
    out[..., 0:n_rot:2], out[..., 1:n_rot:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("n_rot", [16, 32, 64])
@pytest.mark.parametrize("pos0", [0, 1000])
def test_rope_kernels_partial_dims(n_rot, pos0):
    rng = np.random.default_rng(n_rot + pos0)
    T, H, KVH, HD = 3, 6, 2, 64
    cos, sin = rope_tables(1100, n_rot, BASE)
    q = rng.standard_normal((T, H, HD)).astype(np.float32)
    k = rng.standard_normal((T, KVH, HD)).astype(np.float32)
    v = rng.standard_normal((T, KVH, HD)).astype(np.float32)
    want_q, want_k = rope_ref(q, pos0, n_rot), rope_ref(k, pos0, n_rot)

    got = q.copy()
    rope(got, pos0, cos, sin, n_rot)
    assert np.abs(got - want_q).max() < 1e-4
    assert np.array_equal(got[..., n_rot:], q[..., n_rot:])       # untouched, bit for bit

    # the fused decode path: rope only (no smoothing, no rotation, q scale 1)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    shift, scale = np.zeros((KVH, HD), np.float32), np.ones((KVH, HD), np.float32)
    qkv_prep(q2, k2, v2, pos0, cos, sin, n_rot, True, shift, scale, False, np.ones(HD, np.float32), False,
             np.float32(1.0))
    assert np.abs(q2 - want_q).max() < 1e-4 and np.abs(k2 - want_k).max() < 1e-4
    assert np.array_equal(k2[..., n_rot:], k[..., n_rot:]) and np.array_equal(v2, v)


def test_tiny_model_partial_rope_matches_reference(tmp_path):
    """head_dim 64, rope on 32 of them: pykv's forward (exact kernels, prefill in batches plus decode
    steps, f32 cache) equals the float64 reference model that reads rope.dimension_count."""
    path = write_tiny_gguf(tmp_path / "rope32.gguf", {"default": GT.F32}, rope_dims=32, seed=4)
    ids = [5, 77, 3, 260, 261, 9, 140, 33, 2, 250, 1, 17, 99]
    want = gguf_forward(str(path), ids)
    mm.set_exact(True)
    try:
        m = pykv.load(str(path), n_ctx=64, n_batch=4, kv_type_k="f32", kv_type_v="f32")
        assert m.config.rope_dims == 32 and m.config.head_dim == 64
        got = m.forward(ids)
        seq = m.new_sequence()
        steps = np.concatenate([m.eval(seq, [i]) for i in ids])
    finally:
        mm.set_exact(False)
    rel = lambda a: float(np.linalg.norm(a - want) / np.linalg.norm(want))  # noqa: E731
    assert rel(got) < 1e-4 and rel(steps) < 1e-4, (rel(got), rel(steps))
