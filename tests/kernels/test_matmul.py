"""Kernels of pykv.kernels.matmul against gguf.quants.dequantize (bit-exact with ggml) in float64."""
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants

from pykv.kernels import matmul as M

TYPES = [GT.F32, GT.F16, GT.BF16, GT.Q8_0, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.IQ4_NL, GT.Q2_K, GT.Q3_K,
         GT.Q4_K, GT.Q5_K, GT.Q6_K]
K_TYPES = (GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K)
# byte offsets of the f16 super-block scales: (d, dmin) or (d,) for the symmetric types
_K_SCALES = {GT.Q2_K: (80, 82), GT.Q3_K: (108,), GT.Q4_K: (0, 2), GT.Q5_K: (0, 2), GT.Q6_K: (208,)}
ROWS = 133     # > one row tile (64 / 128) and not a multiple of anything useful


def _product(w, x):
    """matmul(w, x) for float32 x (T, cols) through a fresh Act: the (T, w.rows) result (NaN-filled first)."""
    act = M.Act(x.shape[1], x.shape[0])
    act.set(x)
    out = np.full((x.shape[0], w.rows), np.nan, np.float32)
    M.matmul(w, act, out)
    return out


def _cols(t):
    return 768 if t in K_TYPES else 352     # 3 super-blocks / 11 blocks


def _f16_bytes(v):
    return np.asarray(v, np.float16).view(np.uint8).reshape(*np.shape(v), 2)


def make_weight(t, rows, cols, rng, jit_free=False):
    """(data as GGUFReader gives it, float64 dequantized reference)."""
    if t == GT.F32:
        data = rng.standard_normal((rows, cols)).astype(np.float32)
    elif t == GT.F16:
        data = rng.standard_normal((rows, cols)).astype(np.float16)
    elif t in K_TYPES:
        # gguf cannot quantize K-quants: random valid blocks with sane f16 super-block scales
        bpb = M._BLOCK[int(t)][1]
        nb = rows * cols // 256
        blocks = rng.integers(0, 256, size=(nb, bpb), dtype=np.uint8)
        offs = _K_SCALES[t]
        lo = -0.02 if len(offs) == 1 else 0.0       # symmetric types: signed d; else d, dmin >= 0
        for o in offs:
            blocks[:, o:o + 2] = _f16_bytes(rng.uniform(lo, 0.02, nb))
        data = blocks.reshape(rows, -1)
    elif t == GT.IQ4_NL and jit_free:
        # random valid blocks (sane f16 d, any nibbles), made without running a Numba kernel: under
        # test_tiles_isa's NUMBA_CPU_NAME a kernel is compiled for that class and may not run on this host
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
        blocks[:, 0:2] = _f16_bytes(rng.uniform(-0.02, 0.02, rows * cols // 32))
        data = blocks.reshape(rows, -1)
    elif t == GT.IQ4_NL:
        # gguf cannot quantize IQ4_NL: pykv's port of llama-quantize's quantize_iq4_nl makes the blocks,
        # gguf.quants dequantizes them (the reference below)
        from pykv.kernels.kvquant import quantize_row_iq4_nl
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        data = np.zeros((rows, cols // 32 * 18), np.uint8)
        for r in range(rows):
            quantize_row_iq4_nl(x[r], data[r], 7)
    else:
        data = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)
    ref = quants.dequantize(data, t).astype(np.float64).reshape(rows, cols)
    return data, ref


def q8_blocks(x):
    """The kernels' q8 activation blocks of x (T, cols): int8 codes (T, cols), scales (T, cols // 32)."""
    T, cols = x.shape
    xq = np.zeros((T, cols), np.int8)
    xd, xs, xf = (np.zeros((T, cols // 32), dt) for dt in (np.float32, np.int32, np.float32))
    M.quantize_act_q8(np.ascontiguousarray(x, np.float32), T, xq, xd, xs, xf)
    return xq, xd


def q8_emulate(x, block=32):
    """float64 x after the q8 activation quantization (what the integer path sees): llama.cpp's q8_0
    blocks of 32, or its q8_K blocks of 256 (block=256, the K-quant tiles)."""
    if block == 256:
        T, cols = x.shape
        xq = np.zeros((T, cols), np.int8)
        xd, xb = np.zeros((T, cols // 256), np.float32), np.zeros((T, cols // 16), np.int32)
        M.quantize_act_q8k(np.ascontiguousarray(x, np.float32), T, xq, xd, xb)
        assert np.array_equal(xb, xq.reshape(T, -1, 16).sum(axis=-1))
    else:
        xq, xd = q8_blocks(x)
    return (xq.reshape(x.shape[0], -1, block) * xd[..., None].astype(np.float64)).reshape(x.shape)


def test_q8k_activation_blocks_match_llama_cpp_rule():
    """q8_K (quantize_row_q8_K_ref): d = max / -127 with max the value of largest magnitude, codes
    rint(x / d) capped at 127, so the extreme value maps to -127 exactly and no code is -128."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[0, 5] = 9.0
    x[1, 300] = -9.0
    x[2, 256:] = 0.0                                        # an all-zero block
    xq = np.zeros((3, 512), np.int8)
    xd, xb = np.zeros((3, 2), np.float32), np.zeros((3, 32), np.int32)
    M.quantize_act_q8k(x, 3, xq, xd, xb)
    assert xq[0, 5] == -127 and xq[1, 300] == -127 and xq.min() >= -127
    assert xd[0, 0] == np.float32(1) / (np.float32(-127) / np.float32(9)) and xd[2, 1] == 0
    iscale = np.float32(-127) / x[0, np.abs(x[0, :256]).argmax()]
    assert np.array_equal(xq[0, :256], np.minimum(127, np.rint(iscale * x[0, :256])).astype(np.int8))
    assert np.array_equal(xb, xq.reshape(3, -1, 16).sum(axis=-1))


def test_q8_activation_blocks_match_gguf_q8_0():
    """The activation quantizer gives gguf's q8_0 codes (ggml's, bit for bit) and its f16 scales."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(3)
    x[1] *= np.float32(1e-4)
    x[2, :32] = 0.0                                         # an all-zero block
    x[3] = rng.integers(-254, 255, 256) / np.float32(2)     # exact .5 ties
    x[3, ::32] = 127.0
    x[4, 7] = 900.0                                         # an outlier
    xq, xd = q8_blocks(x)
    ref = np.ascontiguousarray(quants.quantize(x, GT.Q8_0)).view(np.uint8).reshape(6, -1, 34)
    assert np.array_equal(xq.view(np.uint8).reshape(6, -1, 32), ref[:, :, 2:])
    assert np.array_equal(xd.astype(np.float16), ref[:, :, :2].copy().view(np.float16)[..., 0])
    # f32 scales: amax / 127 to 1 ulp (fast-math may divide as amax * (1 / 127))
    np.testing.assert_array_max_ulp(xd, np.abs(x.reshape(6, -1, 32)).max(axis=-1) / np.float32(127), 1)


def assert_kernel_result(w, x, ref_w, out):
    """out (T, rows) equals float64 x @ W^T elementwise to 1e-5 of each dot's magnitude scale, with x
    first q8-quantized where the default kernel multiplies 8-bit activations (w.int_dot): the float
    paths (F32/F16/BF16, float tiles, their sgemm prefill) have no looser excuse."""
    xr = q8_emulate(x, w.act_block) if w.int_dot else x.astype(np.float64)
    ref = xr @ ref_w.T
    scale = np.abs(xr) @ np.abs(ref_w).T
    bad = np.abs(out - ref) > 1e-5 * scale + 1e-30
    assert not bad.any(), (w, np.argwhere(bad)[:5], np.abs(out - ref).max())


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    old = numba.get_num_threads()
    n = min(request.param, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    yield n
    numba.set_num_threads(old)


@pytest.fixture
def exact_mode():
    yield M.set_exact
    M.set_exact(False)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul(t, T, threads, exact_mode):
    rng = np.random.default_rng(1000 * int(t) + T)
    cols = _cols(t)
    data, ref_w = make_weight(t, ROWS, cols, rng)
    w = M.prepare_weight(int(t), data, ROWS, cols)
    assert (w.ggml_type, w.rows, w.cols) == (int(t), ROWS, cols)
    assert w.nbytes > 0
    act = M.Act(cols, 7)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    act.set(x)
    ref = x.astype(np.float64) @ ref_w.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(ref_w).T     # error scale of each dot
    out = np.full((7, ROWS), np.nan, np.float32)

    exact_mode(True)
    M.matmul(w, act, out)
    assert np.all(np.abs(out[:T] - ref) <= 1e-5 * scale + 1e-30)
    assert np.all(np.isnan(out[T:]))          # rows past T untouched

    exact_mode(False)
    out[:] = np.nan
    M.matmul(w, act, out)
    err = np.linalg.norm(out[:T] - ref) / np.linalg.norm(ref)
    if not w.int_dot:
        # float weights, and the float-activation Q4_0/Q4_1/Q8_0 tile kernels (hosts without VNNI)
        assert np.all(np.abs(out[:T] - ref) <= 1e-5 * scale + 1e-30)
    else:
        assert err < 2e-2                     # 8-bit activation quantization
        # and the integer path computes exactly the dot with the quantized activations
        ref_q = q8_emulate(x, w.act_block) @ ref_w.T
        assert np.linalg.norm(out[:T] - ref_q) <= 1e-6 * np.linalg.norm(scale)
    assert np.all(np.isnan(out[T:]))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_get_rows_exact(t, threads):
    rng = np.random.default_rng(int(t))
    cols = _cols(t)
    data, ref_w = make_weight(t, ROWS, cols, rng)
    w = M.prepare_weight(int(t), data, ROWS, cols)
    for ids in (np.array([0, 132, 5, 5, 17, 64], np.int32), np.arange(ROWS, dtype=np.int64)):
        out = np.zeros((len(ids), cols), np.float32)
        M.get_rows(w, ids, out)
        assert np.array_equal(out, ref_w[ids].astype(np.float32))


def test_matmul_reuses_act_across_weights():
    """One Act.set feeds several weights (Q, K, V) and later calls with other T."""
    rng = np.random.default_rng(7)
    cols = 256
    ws, refs = [], []
    for t, rows in ((GT.Q4_1, 40), (GT.Q8_0, 13), (GT.Q4_K, 9)):
        data, ref_w = make_weight(t, rows, cols, rng)
        ws.append(M.prepare_weight(int(t), data, rows, cols))
        refs.append(ref_w)
    act = M.Act(cols, 16)
    for T in (16, 1, 3):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        act.set(x)
        for w, ref_w in zip(ws, refs):
            out = np.zeros((16, w.rows), np.float32)
            M.matmul(w, act, out)
            assert_kernel_result(w, x, ref_w, out[:T])


def test_prefill_long_matches_rowwise():
    """T large enough for the prefill (token-tiled / BLAS) path equals T single-token calls."""
    rng = np.random.default_rng(11)
    cols, rows, T = 320, 70, 67
    for t in (GT.Q4_1, GT.Q8_0, GT.Q5_0, GT.F16):
        data, ref_w = make_weight(t, rows, cols, rng)
        w = M.prepare_weight(int(t), data, rows, cols)
        x = rng.standard_normal((T, cols)).astype(np.float32)
        out = _product(w, x)
        assert_kernel_result(w, x, ref_w, out)
        # and each row equals the single-token call
        act1, out1 = M.Act(cols, 1), np.zeros((1, rows), np.float32)
        for i in (0, 33, T - 1):
            act1.set(x[i:i + 1])
            M.matmul(w, act1, out1)
            assert_kernel_result(w, x[i:i + 1], ref_w, out1)


INT_TILE_TYPES = (GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0, GT.IQ4_NL) + K_TYPES


@pytest.mark.parametrize("t", INT_TILE_TYPES, ids=lambda t: t.name)
def test_prefill_token_groups_equal_single_tokens(t, threads):
    """A prefill through the integer tiles (full tiles take M._TOK_NT (K tiles) / M._TOK_NT_Q tokens a call,
    the weights unpacked once for them where kernels.tiles.TOKEN_BLOCK says so; the last tokens of a work item and
    the partial last row tile go one by one) gives what one-token calls give (the same integer sums;
    the float epilogue may round in another order under fast-math: 1e-6 of each dot's scale), and that
    is the q8 emulation's dot."""
    rng = np.random.default_rng(23 + int(t))
    rows, cols, T = 37, 512, 16 + 2 * M._TOK_NT + 3     # work items of 16 and 11 tokens: groups, then singles
    data, ref_w = make_weight(t, rows, cols, rng)
    w = M.prepare_weight(int(t), data, rows, cols)
    assert w.kind in M._INT_KINDS
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[5] *= np.float32(30)
    out = _product(w, x)
    assert_kernel_result(w, x, ref_w, out)
    xr = q8_emulate(x, w.act_block)
    scale = np.abs(xr) @ np.abs(ref_w).T
    act1, out1 = M.Act(cols, 1), np.zeros((1, rows), np.float32)
    for i in range(T):
        act1.set(x[i:i + 1])
        M.matmul(w, act1, out1)
        assert np.all(np.abs(out[i] - out1[0]) <= 1e-6 * scale[i]), (i, np.abs(out[i] - out1[0]).max())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_prepare_weight_rejects_bad_sizes(t):
    rng = np.random.default_rng(3)
    cols = _cols(t)
    data, _ = make_weight(t, ROWS, cols, rng)
    with pytest.raises(ValueError):
        M.prepare_weight(int(t), data, ROWS + 1, cols)          # too few bytes
    with pytest.raises(ValueError):
        M.prepare_weight(int(t), data, ROWS - 1, cols)          # too many bytes
    if t not in (GT.F32, GT.F16, GT.BF16):
        with pytest.raises(ValueError):
            M.prepare_weight(int(t), data, ROWS, cols + 16)     # not a whole number of blocks
    with pytest.raises(ValueError):
        M.prepare_weight(int(t), data.reshape(-1)[:-1], ROWS, cols)


def test_prepare_weight_rejects_unsupported_type():
    with pytest.raises(ValueError, match="unsupported"):
        M.prepare_weight(int(GT.IQ2_XXS), np.zeros((4, 66), np.uint8), 4, 256)
    with pytest.raises(ValueError, match="unsupported"):
        M.prepare_weight(12345, np.zeros((4, 4), np.uint8), 4, 4)


def test_bad_call_arguments():
    rng = np.random.default_rng(5)
    data, _ = make_weight(GT.Q8_0, 8, 64, rng)
    w = M.prepare_weight(int(GT.Q8_0), data, 8, 64)
    act = M.Act(64, 2)
    with pytest.raises(ValueError):
        act.set(np.zeros((3, 64), np.float32))                 # T > max_tokens
    with pytest.raises(ValueError):
        act.set(np.zeros((1, 32), np.float32))                 # wrong cols
    act.set(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError):
        M.matmul(w, act, np.zeros((2, 7), np.float32))         # wrong rows
    with pytest.raises(ValueError):
        M.matmul(w, act, np.zeros((1, 8), np.float32))         # fewer than T rows
    with pytest.raises(ValueError):
        M.matmul(w, M.Act(32, 1), np.zeros((1, 8), np.float32))  # cols mismatch
    with pytest.raises(ValueError):
        M.get_rows(w, np.array([8]), np.zeros((1, 64), np.float32))


@pytest.fixture(params=["int", "float"])
def tile_kind(request):
    """Both Q4_0/Q4_1/Q8_0 tile families: the integer-dot tiles (kernels.tiles, for the ISA class Numba
    compiles for) and the float-activation tiles (prepare_weight's q8_act=False)."""
    return request.param


def _tile_ref(w, x, ref_w):
    """What a tile weight's decode kernel computes: the q8-activation dot (integer tiles) or the float one."""
    return (q8_emulate(x, w.act_block) if w.int_dot else x.astype(np.float64)) @ ref_w.T


@pytest.mark.parametrize("gt", [GT.Q8_0, GT.Q4_1, GT.Q4_0])
def test_large_activations_stay_finite(gt, tile_kind):
    """Regression: fastmath once folded the f16-scale rebias constant into the dot sums, giving
    inf - inf = NaN once activations reached ~100 (SmolLM2's FFN reaches thousands)."""
    rng = np.random.default_rng(5)
    rows, cols = 192, 1536
    W = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    W[0] = 0.0
    q = quants.quantize(W, gt)
    w = M.prepare_weight(gt, q, rows, cols, q8_act=tile_kind == "int")
    x = (rng.standard_normal((3, cols)) * 3000).astype(np.float32)
    act = M.Act(cols, 4)
    act.set(x)
    out = np.zeros((3, rows), np.float32)
    M.matmul(w, act, out)
    ref = _tile_ref(w, x, quants.dequantize(q, gt).astype(np.float64))
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("T", [1, 3, 16, 40])
def test_tile_paths_exact_and_fused(T, threads, tile_kind):
    """The tile kernels (decode; VNNI: prefill too), the float tiles' dequantize + sgemm prefill path
    (T >= 16) and matmul_fused (Q/K/V and gate/up in one parallel region) all equal float64 on the
    dequantized weights (with q8-quantized activations for the VNNI kernels), partial row tiles included."""
    rng = np.random.default_rng(100 + T)
    cols = 256
    ws, refs, outs = [], [], []
    for t, rows in ((GT.Q4_1, 128), (GT.Q4_0, 64), (GT.Q4_1, 192), (GT.Q8_0, 200)):
        data, ref_w = make_weight(t, rows, cols, rng)
        ws.append(M.prepare_weight(int(t), data, rows, cols, q8_act=tile_kind == "int"))
        refs.append(ref_w)
        outs.append(np.zeros((T, rows), np.float32))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    act = M.Act(cols, 64)
    act.set(x)
    M.matmul_fused(ws[:3], act, outs[:3])       # three full-tile Q4 weights: one region
    M.matmul_fused(ws[2:], act, outs[2:])       # mixed kinds: falls back to one call each
    for w, ref_w, out in zip(ws, refs, outs):
        assert w.kind in (M._INT_KINDS if tile_kind == "int" else (1, 2)), w
        ref = _tile_ref(w, x, ref_w) if (w.int_dot or T < M._BLAS_MIN_T) else x.astype(np.float64) @ ref_w.T
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), (w, T)


@pytest.mark.parametrize("T", [1, 20])
def test_fuse_plan_equals_separate_calls(T):
    """matmul_fused through a fuse() plan (the model's Q/K/V and gate/up; the second call runs the kept
    entry point) gives every weight's output bit-for-bit as its own matmul call, for a one-region mix
    (Q4_0 / Q8_0 / Q5_1 integer tiles), a pair, and a set that cannot share a region (a partial row tile)."""
    rng = np.random.default_rng(7 + T)
    cols = 256
    sets = [((GT.Q4_0, 64), (GT.Q8_0, 128), (GT.Q5_1, 64)), ((GT.Q4_1, 128), (GT.Q8_0, 64)),
            ((GT.Q4_1, 64), (GT.Q8_0, 200))]
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for spec in sets:
        ws = [M.prepare_weight(int(t), make_weight(t, rows, cols, rng)[0], rows, cols) for t, rows in spec]
        plan = M.fuse(ws)
        assert list(plan) == ws and len(plan) == len(ws)
        assert bool(plan.ok) == all(w.rows % w.qt.shape[3] == 0 for w in ws), spec
        refs = []
        for w in ws:
            a1 = M.Act(cols, 32)
            a1.set(x)
            refs.append(np.zeros((T, w.rows), np.float32))
            M.matmul(w, a1, refs[-1])
        for rep in range(2):
            act = M.Act(cols, 32)
            act.set(x)
            outs = [np.full((T, w.rows), np.nan, np.float32) for w in ws]
            M.matmul_fused(plan, act, outs)
            for w, o, r in zip(ws, outs, refs):
                assert np.array_equal(o, r), (spec, w, rep)
    with pytest.raises(ValueError):        # the outputs are still checked on the planned path
        M.matmul_fused(M.fuse(ws[:2]), act, [np.zeros((T, 3), np.float32)] * 2)


def test_bound_calls_equal_matmul():
    """matmul.bind (Model's decode products): every call, the first through matmul / matmul_fused and
    later ones through the kept entry point, writes what matmul writes for the activation's current
    values (fresh x each call: the activation is re-quantized), for single weights of each integer kind
    (Q4_0 tiles, Q8_0 tiles, a Q6_K K-quant tile, F16) and a fused Q/K/V set; an act.T other than the
    bound T, and exact mode, go back through matmul."""
    rng = np.random.default_rng(41)
    cols = 512
    R = M.TILE_ROWS          # the fused set needs whole row tiles (64 rows on avx512vnni, 32 below)
    specs = [(GT.Q4_0, 2 * R), (GT.Q8_0, 3 * R), (GT.Q6_K, 64), (GT.F16, 40)]
    ws = [M.prepare_weight(int(t), make_weight(t, rows, cols, rng)[0], rows, cols) for t, rows in specs]
    fused = M.fuse([ws[0], ws[1], M.prepare_weight(int(GT.Q5_1), make_weight(GT.Q5_1, R, cols, rng)[0], R, cols)])
    assert fused.ok == 1
    act, ref_act = M.Act(cols, 4), M.Act(cols, 4)
    bound = [(w, np.zeros((1, w.rows), np.float32)) for w in ws]
    calls = [M.bind(w, act, o, 1) for w, o in bound]
    fouts = tuple(np.zeros((1, w.rows), np.float32) for w in fused)
    fcall = M.bind(fused, act, fouts, 1)
    for rep in range(3):
        x = rng.standard_normal((1, cols)).astype(np.float32) * np.float32(1 + 10 * rep)
        ref_act.set(x)
        for c, (w, o) in zip(calls, bound):
            act.set(x)
            o[:] = np.nan
            c()
            r = np.zeros_like(o)
            M.matmul(w, ref_act, r)
            assert np.array_equal(o, r), (w, rep)
        act.set(x)
        fcall()
        for w, o in zip(fused, fouts):
            r = np.zeros_like(o)
            M.matmul(w, ref_act, r)
            assert np.array_equal(o, r), (w, rep)
    assert all(c.entry is not None for c in calls[:3]) and fcall.entry is not None and calls[3].entry is None
    x2 = rng.standard_normal((2, cols)).astype(np.float32)      # another T: through matmul, both rows
    act.set(x2)
    ref_act.set(x2)
    o2, r2 = np.full((2, ws[0].rows), np.nan, np.float32), np.zeros((2, ws[0].rows), np.float32)
    b2 = M.bind(ws[0], act, o2, 1)
    b2.entry = calls[0].entry                                   # even with an entry kept, T=2 goes to matmul
    b2.lits, b2.rest, b2.k8 = calls[0].lits, calls[0].rest, False
    b2()
    M.matmul(ws[0], ref_act, r2)
    assert np.array_equal(o2, r2)
    M.set_exact(True)
    try:
        act.set(x2[:1])
        ref_act.set(x2[:1])
        o, r = bound[0][1], np.zeros((1, ws[0].rows), np.float32)
        calls[0]()
        M.matmul(ws[0], ref_act, r)
        assert np.array_equal(o, r)
    finally:
        M.set_exact(False)


@pytest.mark.parametrize("bad", [0x7C00, 0xFC00, 0x7E01], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("gt", [GT.Q8_0, GT.Q4_1, GT.Q4_0], ids=lambda t: t.name)
def test_nonfinite_scale_keeps_generic_kernel(gt, bad):
    """A weight with an inf/NaN f16 block scale stays on the generic kernel (prepare_weight's fallback:
    the tile kernels decode scales as finite numbers), so the bad scale shows in its row's output as
    ggml's would (non-finite) instead of as a silent finite 65536, and every other row is exact."""
    rng = np.random.default_rng(9)
    rows, cols = 70, 256
    data = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gt)
    bpb = M._BLOCK[int(gt)][1]
    data[5, bpb:bpb + 2] = np.array([bad], np.uint16).view(np.uint8)       # d of row 5's 2nd block
    with np.errstate(invalid="ignore"):
        ref_w = quants.dequantize(data, gt).astype(np.float64).reshape(rows, cols)
    assert not np.isfinite(ref_w[5]).all()
    ok = np.arange(rows) != 5
    for q8_act in (False, True):
        w = M.prepare_weight(int(gt), data, rows, cols, q8_act=q8_act)
        for T in (1, 20):         # decode and the prefill dispatch
            x = rng.standard_normal((T, cols)).astype(np.float32)
            out = _product(w, x)
            assert not np.isfinite(out[:, 5]).any(), (w, out[:, 5])
            assert_kernel_result(w, x, ref_w[ok], out[:, ok])


def _f16_at(blk, o):
    return blk[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def llama_k_ints(t, blk):
    """Q2_K / Q3_K super-blocks blk uint8 (..., bytes) decoded as llama.cpp's vec_dot reads them:
    (q int (..., 16, 16) per sub-block of 16, scale int (..., 16), min int (..., 16) (Q3_K: 0), d, dmin)."""
    lead = blk.shape[:-1]
    shift = np.arange(0, 8, 2).reshape(4, 1)
    if t == GT.Q2_K:
        qs = blk[..., 16:80].reshape(*lead, 2, 1, 32)
        q = ((qs >> shift) & 3).astype(np.int64)                       # element 128h + 32k + l
        sc, mn = (blk[..., 0:16] & 15).astype(np.int64), (blk[..., 0:16] >> 4).astype(np.int64)
        d, dmin = _f16_at(blk, 80), _f16_at(blk, 82)
    else:
        qs = blk[..., 32:96].reshape(*lead, 2, 1, 32)
        hm = blk[..., 0:32].reshape(*lead, 1, 32) >> np.arange(8).reshape(8, 1)   # element 32t + l
        q = ((qs >> shift) & 3).astype(np.int64) - 4 * (1 - (hm & 1).reshape(*lead, 2, 4, 32))
        s = blk[..., 96:108].astype(np.int64)
        j = np.arange(16)
        low = np.where(j < 8, s[..., j % 8] & 15, s[..., j % 8] >> 4)
        sc = (low | (((s[..., 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        mn = np.zeros_like(sc)
        d, dmin = _f16_at(blk, 108), np.zeros(lead, np.float32)
    return q.reshape(*lead, 16, 16), sc, mn, d, dmin


def llama_vec_dot_k(t, blk, xq, xd):
    """llama.cpp's vec_dot_q2_K_q8_K / vec_dot_q3_K_q8_K (reference C) in numpy: blk (rows, nsb, bytes),
    q8_K activations xq int8 (nsb * 256,), xd f32 (nsb,) -> (rows,) float64, and each dot's error scale."""
    q, sc, mn, d, dmin = llama_k_ints(t, blk)
    x = xq.astype(np.int64).reshape(-1, 16, 16)
    isum = (sc * (q * x).sum(-1)).sum(-1)                               # exact int sums per super-block
    msum = (mn * x.sum(-1)).sum(-1)
    xd = xd.astype(np.float64)
    ref = (xd * (d * isum - dmin * msum)).sum(-1)
    scale = (np.abs(xd) * (np.abs(d) * (np.abs(sc) * np.abs(q * x).sum(-1)).sum(-1)
                           + np.abs(dmin) * np.abs(mn * x.sum(-1)).sum(-1))).sum(-1)
    return ref, scale


@pytest.mark.parametrize("source", ["random", "quantized"])
@pytest.mark.parametrize("t", [GT.Q2_K, GT.Q3_K], ids=lambda t: t.name)
def test_q23k_tiles_equal_llama_cpp_integer_dot(t, source, threads):
    """The Q2_K / Q3_K K tiles compute llama.cpp's integer dot against q8_K: random valid blocks and
    pykv's quantizer's blocks (== llama-quantize's, test_kquant), the emulation anchored to gguf."""
    from pykv import tools as C
    rng = np.random.default_rng(17 + int(t))
    rows, cols, T = 37, 768, 3                  # a partial last row tile
    if source == "random":
        data, ref_w = make_weight(t, rows, cols, rng)
    else:
        data = C.encode(rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.05), t)
        ref_w = quants.dequantize(data, t).astype(np.float64).reshape(rows, cols)
    blk = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // 256, -1)
    # the emulation's decoding is ggml's: d * sc * q (- dmin * m) equals gguf's dequantize bit for bit
    q, sc, mn, d, dmin = llama_k_ints(t, blk)
    deq = (d[..., None, None] * sc[..., None].astype(np.float32)) * q.astype(np.float32) \
        - dmin[..., None, None] * mn[..., None].astype(np.float32)
    assert np.array_equal(deq.reshape(rows, cols).astype(np.float64), ref_w)
    w = M.prepare_weight(int(t), data, rows, cols)
    assert w.kind == M._KIND_KTILE and w.act_block == 256, w
    x = rng.standard_normal((T, cols)).astype(np.float32)
    x[1] *= np.float32(40)
    out = _product(w, x)
    xq, xd, xb = np.zeros((T, cols), np.int8), np.zeros((T, cols // 256), np.float32), np.zeros((T, cols // 16), np.int32)
    M.quantize_act_q8k(x, T, xq, xd, xb)
    for i in range(T):
        ref, scale = llama_vec_dot_k(t, blk, xq[i], xd[i])
        assert np.all(np.abs(out[i] - ref) <= 1e-6 * scale + 1e-30), (i, np.abs(out[i] - ref).max(), scale.max())


def test_loader_weight_types_are_the_kernels():
    """The loader's accepted weight types (gguf_io, read before Numba loads) are exactly what matmul runs."""
    from pykv.files.gguf_io import WEIGHT_TYPES
    assert {int(t) for t in WEIGHT_TYPES} == set(M.SUPPORTED_TYPES)


@pytest.mark.parametrize("t", [GT.Q8_0, GT.Q4_1, GT.Q5_0, GT.Q6_K, GT.Q4_K])
def test_repack_in_row_steps_equals_whole(t, monkeypatch):
    """prepare_weight repacks a weight _REPACK_ROWS rows at a time (bounded temporaries, peak RSS): the
    tiles equal one whole-tensor repack, a padded last tile included."""
    rng = np.random.default_rng(9)
    rows, cols = 5 * M.TILE_ROWS + 3, 256
    raw = make_weight(t, rows, cols, rng)[0]
    whole = M.prepare_weight(int(t), raw, rows, cols)
    from pykv.kernels import mm_tiles
    monkeypatch.setattr(mm_tiles, "_REPACK_ROWS", 2 * max(M.TILE_ROWS, M.KTILE_ROWS))
    steps = M.prepare_weight(int(t), raw, rows, cols)
    assert whole.kind == steps.kind and whole.qt is not None
    assert np.array_equal(whole.qt, steps.qt)
    assert (whole.sc is None and steps.sc is None) or np.array_equal(whole.sc, steps.sc)


@pytest.mark.parametrize("fmt", ["q4k", "q5k", "q6k"])
def test_numba_k_repack_equals_numpy(fmt):
    """kernels.tiles.repack_ktile_nb (the load-time repack of Q4_K / Q5_K / Q6_K, one parallel pass) writes
    repack_ktile's layout bit for bit, on blocks of random bytes, with a zero-padded last tile."""
    from pykv.kernels.tiles import KBYTES, KTILE_ROWS, repack_ktile, repack_ktile_nb
    rng = np.random.default_rng(13)
    bb = {"q4k": 144, "q5k": 176, "q6k": 210}[fmt]
    R = KTILE_ROWS
    for rows in (R, 3 * R + 5):
        blk = rng.integers(0, 256, size=(rows, 3, bb), dtype=np.uint8)
        pad = -rows % R
        full = np.concatenate([blk, np.zeros((pad,) + blk.shape[1:], np.uint8)]) if pad else blk
        want = repack_ktile(fmt, full)
        got = repack_ktile_nb(fmt, blk, -(-rows // R))
        assert got.shape == want.shape == (-(-rows // R), 3 * KBYTES[fmt] * R)
        assert np.array_equal(got, want)
