"""KV formats table and the per-row KV quantization kernels (pykv.files.formats, pykv.kernels.kvquant).

Oracles: gguf.quants (bit-exact with ggml) for f16/bf16/q8_0/q4_0/q4_1/q5_0/q5_1 bytes and for every
ggml dequantization; a float32 port of ggml's C quantize_row_iq4_nl_impl (gguf.quants has no iq4_nl
quantizer); a brute-force nearest-value search for fp8.
"""
import numpy as np
import pytest
from numba import njit
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from pykv.files import formats as F
from pykv.kernels import kvquant as K
from pykv.kernels import trellis as TR
from pykv.kernels.blocks import deq_kivi_k_rows
from pykv.kernels.simd import deq_q4_0, deq_q4_1, deq_q8_0

GGML = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
ALL = list(F.KV_FORMATS)
GUARD = 8  # sentinel bytes after each row: the kernels must not write past row_bytes


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

def make_rows(hd, seed):
    """A list of (label, f32[hd]) rows covering the cases the brief asks for."""
    rng = np.random.default_rng(seed)
    rows = [
        ("randn", rng.standard_normal(hd)),
        ("uniform", rng.uniform(-3, 5, hd)),
        ("positive", rng.uniform(0.5, 2.0, hd)),
        ("negative", -rng.uniform(0.5, 2.0, hd)),
        ("zeros", np.zeros(hd)),
        ("huge", rng.standard_normal(hd) * 1e4),
        ("tiny", rng.standard_normal(hd) * 1e-6),
        ("heavy", rng.standard_t(2, hd)),
    ]
    out = rng.standard_normal(hd) * 0.1
    out[rng.integers(hd)] = 40.0
    rows.append(("outlier", out))
    out = rng.standard_normal(hd) * 0.1
    out[rng.integers(hd)] = -40.0
    rows.append(("neg_outlier", out))
    # exact ties for the round-half rules: each block has max |x| = 127 or -8*..., values k + 0.5
    ties = rng.integers(-254, 255, hd) / 2.0
    ties[::32] = 127.0
    rows.append(("ties", ties))
    const = np.full(hd, 0.7)
    rows.append(("constant", const))
    mixed = rng.standard_normal(hd)
    mixed[:32] = 0.0  # one zero block next to a normal one
    rows.append(("zero_block", mixed))
    return [(label, np.ascontiguousarray(r, dtype=np.float32)) for label, r in rows]


def all_rows():
    for hd in (64, 128):
        for seed in (0, 1, 2):
            for label, x in make_rows(hd, seed):
                yield f"{label}-hd{hd}-s{seed}", x


ROWS = list(all_rows())


def qrow(fmt, x):
    f = F.KV_FORMATS[fmt]
    rb = F.row_bytes(f, x.shape[0])
    buf = np.full(rb + GUARD, 0xA5, dtype=np.uint8)
    K.quantize_row(f.code, x, buf[:rb])
    assert (buf[rb:] == 0xA5).all(), f"{fmt}: quantize_row wrote past the row"
    return buf[:rb].copy()


def dqrow(fmt, src, hd):
    out = np.full(hd + 1, 12345.0, dtype=np.float32)
    K.dequantize_row(F.KV_FORMATS[fmt].code, src, out[:hd])
    assert out[hd] == 12345.0
    return out[:hd].copy()


def gguf_bytes(fmt, x):
    f = F.KV_FORMATS[fmt]
    return np.ascontiguousarray(gq.quantize(x[None, :], f.ggml_type)).view(np.uint8).tobytes()


def gguf_dequant(fmt, raw, hd):
    f = F.KV_FORMATS[fmt]
    if f.ggml_type == T.F32:
        return raw.view(np.float32).copy()
    if f.ggml_type == T.F16:
        return gq.dequantize(raw.view(np.float16), T.F16).reshape(hd)
    return gq.dequantize(raw[None, :], f.ggml_type).reshape(hd)


# ------------------------------------------------------------------------------------------------
# formats table
# ------------------------------------------------------------------------------------------------

def test_format_table():
    assert set(F.KV_FORMATS) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
                                 "iq4_nl", "fp8_e4m3", "fp8_e5m2", "int4", "int2", "nl4", "nl3", "nl2",
                                 "klt3", "klt2", "nl3b", "nl2b", "tc3b", "tc2b", "tc1b"}
    codes = [f.code for f in F.KV_FORMATS.values()]
    assert len(set(codes)) == len(codes)
    from gguf.constants import GGML_QUANT_SIZES
    for f in F.KV_FORMATS.values():
        assert f.bits == pytest.approx(f.block_bytes * 8 / f.block_size)
        if f.ggml_type is not None:
            assert GGML_QUANT_SIZES[f.ggml_type] == (f.block_size, f.block_bytes), f.name
    assert F.KV_FORMATS["q8_0"].bits == 8.5


def test_row_bytes_hd64():
    want = {"f32": 256, "f16": 128, "bf16": 128, "q8_0": 68, "q4_0": 36, "q4_1": 40, "q5_0": 44,
            "q5_1": 48, "iq4_nl": 36, "fp8_e4m3": 68, "fp8_e5m2": 68, "int4": 40, "int2": 24,
            "nl4": 34, "nl3": 26, "nl2": 18, "klt3": 26, "klt2": 18, "nl3b": 25, "nl2b": 17,
            "tc3b": 25, "tc2b": 17, "tc1b": 9}
    assert {n: F.row_bytes(n, 64) for n in ALL} == want
    with pytest.raises(ValueError):
        F.row_bytes("q8_0", 48)


def test_bytes_per_token_smollm2():
    L, KVH, HD = 30, 3, 64
    bpt = {n: F.bytes_per_token(n, n, L, KVH, HD, 32) for n in ALL}
    assert bpt["f16"] == 23040
    assert bpt["q8_0"] == 12240
    assert bpt["q4_0"] == 6480
    assert bpt["f32"] == 46080 and bpt["bf16"] == 23040
    assert bpt["q4_1"] == 7200 and bpt["q5_0"] == 7920 and bpt["q5_1"] == 8640
    assert bpt["iq4_nl"] == 6480
    assert bpt["fp8_e4m3"] == bpt["fp8_e5m2"] == 12240
    assert bpt["int4"] == 7200 and bpt["int2"] == 4320
    # KIVI keys: HD*bits/8 + 4*HD/P per token
    assert F.kivi_page_bytes("int4", 64, 32, True) == 4 * 64 + 32 * 32
    assert F.kivi_page_bytes("int2", 64, 16, True) == 4 * 64 + 16 * 16
    assert F.kivi_page_bytes("int4", 64, 32, False) == 32 * 40
    assert F.bytes_per_token("int4", "int4", L, KVH, HD, 64) == L * KVH * (32 + 4 + 40)
    assert F.bytes_per_token("q8_0", "q4_0", L, KVH, HD) == L * KVH * (68 + 36)
    assert F.bits_per_value("fp8_e4m3", 64) == 8.5


def test_parse_kv_type():
    assert F.parse_kv_type("Q8_0") is F.KV_FORMATS["q8_0"]
    assert F.parse_kv_type("fp8-e5m2") is F.KV_FORMATS["fp8_e5m2"]
    assert F.parse_kv_type(F.KV_FORMATS["int2"]) is F.KV_FORMATS["int2"]
    with pytest.raises(ValueError) as e:
        F.parse_kv_type("q3_k")
    for n in ALL:
        assert n in str(e.value)


# ------------------------------------------------------------------------------------------------
# ggml types: bytes and values identical to gguf.quants
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [g for g in GGML if g != "iq4_nl"])
def test_ggml_bytes_match_gguf(fmt):
    for label, x in ROWS:
        got = qrow(fmt, x)
        assert got.tobytes() == gguf_bytes(fmt, x), f"{fmt} {label}"
        ref = gguf_dequant(fmt, got, x.shape[0])
        assert np.array_equal(dqrow(fmt, got, x.shape[0]), ref, equal_nan=True), f"{fmt} {label}"


def test_dequant_matches_gguf_on_random_bytes():
    """Every byte pattern the ggml block types can hold (random bytes, finite f16 scales)."""
    rng = np.random.default_rng(7)
    for fmt in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "bf16"):
        f = F.KV_FORMATS[fmt]
        raw = rng.integers(0, 256, F.row_bytes(f, 128), dtype=np.uint8)
        if f.kind == "ggml":
            blk = raw.reshape(-1, f.block_bytes)
            scales = rng.standard_normal(blk.shape[0] * 2).astype(np.float16).view(np.uint8)
            blk[:, :2] = scales.reshape(-1, 2, 2)[:, 0]
            if fmt in ("q4_1", "q5_1"):
                blk[:, 2:4] = scales.reshape(-1, 2, 2)[:, 1]
        else:
            raw = (rng.standard_normal(64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        got = dqrow(fmt, raw, 128 if f.kind == "ggml" else 64)
        assert np.array_equal(got, gguf_dequant(fmt, raw, got.shape[0])), fmt


def test_f16_edge_values():
    vals = [65504.0, 65519.99, 65520.0, 1e5, -1e5, np.inf, -np.inf, -0.0, 0.0, 2.0 ** -24,
            2.0 ** -25, 2.0 ** -25 * 1.0001, 3 * 2.0 ** -25, 5 * 2.0 ** -25, 2.0 ** -14,
            2.0 ** -14 * (1 - 2.0 ** -12), 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1e-30, -7e-8, 1.5e-5]
    x = np.zeros(64, dtype=np.float32)
    x[:len(vals)] = vals
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint8).tobytes()
    assert qrow("f16", x).tobytes() == want
    assert np.array_equal(dqrow("f16", np.frombuffer(want, np.uint8).copy(), 64),
                          np.frombuffer(want, np.float16).astype(np.float32))
    # every half bit pattern decodes as numpy does
    allh = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, dtype=np.float32)
    K.dequantize_row(F.CODE_F16, allh.view(np.uint8), out)
    assert np.array_equal(out, allh.view(np.float16).astype(np.float32), equal_nan=True)
    assert np.array_equal(out.view(np.uint32)[~np.isnan(out)],
                          allh.view(np.float16).astype(np.float32).view(np.uint32)[~np.isnan(out)])


def test_f16_rounding_exhaustive_sample():
    """f32 -> f16 against numpy on many random bit patterns (all exponents, NaN excluded)."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    x = x[: (x.shape[0] // 32) * 32]
    dst = np.empty((x.shape[0] // 32, 64), dtype=np.uint8)
    K.quantize_rows(F.CODE_F16, x.reshape(-1, 32), dst)
    with np.errstate(over="ignore"):
        assert np.array_equal(dst.reshape(-1).view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_f16_rows_with_nan_keep_numpy_bits():
    """Whole 32-value blocks convert with one vector instruction each (simd.f16_store32); a block holding
    a NaN takes the scalar path instead, whose NaN bits are numpy's (the instruction would set the quiet
    bit).  Either way the row is numpy's float16, bit for bit."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(96) * 100).astype(np.float32)
    nan_bits = np.array([0x7F800001, 0xFFC00123], dtype=np.uint32)     # a signaling NaN, a quiet one
    x[40:42] = nan_bits.view(np.float32)
    dst = np.empty(192, dtype=np.uint8)
    K.quantize_row(F.CODE_F16, x, dst)
    want = x.astype(np.float16).view(np.uint16)
    assert want[40] == 0x7C01                      # numpy keeps the signaling NaN signaling
    assert np.array_equal(dst.view(np.uint16), want)


def test_bf16_nan_inf():
    x = np.zeros(64, dtype=np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, 3.3895314e38, -1e-40, 1.00390625]
    x[6] = np.frombuffer(np.uint32(0x7F800001).tobytes(), np.float32)[0]  # signalling NaN
    x[7] = np.frombuffer(np.uint32(0xFFC0FFFF).tobytes(), np.float32)[0]
    assert qrow("bf16", x).tobytes() == gguf_bytes("bf16", x)


# ------------------------------------------------------------------------------------------------
# iq4_nl: float32 port of ggml quantize_row_iq4_nl_impl (block 32, no imatrix)
# ------------------------------------------------------------------------------------------------

KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
f32 = np.float32


def _best_index(x):
    if x <= KV[0]:
        return 0
    if x >= KV[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < KV[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - KV[mu - 1] < KV[mu] - x else mu


def ref_iq4nl_block(xb, ntry):
    amax, mx = f32(0), f32(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f32(1e-15):
        return f32(0), [8] * 32

    def sums(idd):
        sqx, sq2, L = f32(0), f32(0), []
        for v in xb:
            l = _best_index(idd * v)
            L.append(l)
            q, w = KV[l], v * v
            sqx = sqx + w * q * v
            sq2 = sq2 + w * q * q
        return sqx, sq2, L

    d = -mx / KV[0] if ntry > 0 else mx / KV[0]
    sqx, sq2, L = sums(f32(1) / d)
    d = sqx / sq2
    best = d * sqx
    for itry in range(-ntry, ntry + 1):
        a, b, _ = sums((f32(itry) + KV[0]) / mx)
        if b > 0 and a * a > best * b:
            d, best = a / b, (a / b) * a
    if ntry > 0:
        idd = f32(1) / d if d != 0 else f32(0)
        L = [_best_index(idd * v) for v in xb]
    return d, L


def ref_iq4nl_bytes(x, ntry):
    out = bytearray()
    for b in range(x.shape[0] // 32):
        d, L = ref_iq4nl_block(x[32 * b:32 * b + 32], ntry)
        out += np.float16(d).tobytes()
        out += bytes(L[j] | (L[j + 16] << 4) for j in range(16))
    return bytes(out)


def test_iq4_nl_matches_ggml_port():
    for label, x in ROWS[::3]:
        got = qrow("iq4_nl", x)
        assert got.tobytes() == ref_iq4nl_bytes(x, -1), label
        assert np.array_equal(dqrow("iq4_nl", got, x.shape[0]), gguf_dequant("iq4_nl", got, x.shape[0]))
    for label, x in ROWS[:8]:  # the ntry=7 search (llama-quantize's quantize_iq4_nl)
        dst = np.empty(F.row_bytes("iq4_nl", x.shape[0]), np.uint8)
        K.quantize_row_iq4_nl(x, dst, 7)
        assert dst.tobytes() == ref_iq4nl_bytes(x, 7), label


def test_iq4_nl_error_reasonable():
    x = np.random.default_rng(5).standard_normal(128).astype(np.float32)
    err_nl = np.abs(dqrow("iq4_nl", qrow("iq4_nl", x), 128) - x).mean()
    err_40 = np.abs(dqrow("q4_0", qrow("q4_0", x), 128) - x).mean()
    assert err_nl < 1.2 * err_40


# ------------------------------------------------------------------------------------------------
# quantize_rows (prefill / convert tool): whole tensors, any row length multiple of 32
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", GGML)
def test_quantize_rows_whole_tensor(fmt):
    rng = np.random.default_rng(11)
    X = (rng.standard_normal((37, 576)) * rng.uniform(0.01, 10, (37, 1))).astype(np.float32)
    X[3] = 0
    f = F.KV_FORMATS[fmt]
    dst = np.empty((37, F.row_bytes(f, 576)), np.uint8)
    K.quantize_rows(f.code, X, dst)
    if fmt == "iq4_nl":
        for i in (0, 3, 20):
            assert dst[i].tobytes() == ref_iq4nl_bytes(X[i], -1)
    else:
        assert dst.tobytes() == np.ascontiguousarray(gq.quantize(X, f.ggml_type)).view(np.uint8).tobytes()
    out = np.empty_like(X)
    for i in range(X.shape[0]):
        K.dequantize_row(f.code, dst[i], out[i])
    if f.ggml_type in (T.F32, T.F16):
        ref = dst.view(np.float32 if f.ggml_type == T.F32 else np.float16).astype(np.float32)
    else:
        ref = gq.dequantize(dst, f.ggml_type)
    assert np.array_equal(out, ref)


# ------------------------------------------------------------------------------------------------
# fp8
# ------------------------------------------------------------------------------------------------

def fp8_table(ebits, mbits, bias, has_inf):
    """The 256 values of an OCP fp8 format, from its definition."""
    t = np.zeros(256, dtype=np.float32)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> mbits) & ((1 << ebits) - 1)
        m = c & ((1 << mbits) - 1)
        emax = (1 << ebits) - 1
        if has_inf and e == emax:
            t[c] = s * np.inf if m == 0 else np.nan
        elif (not has_inf) and e == emax and m == (1 << mbits) - 1:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m * 2.0 ** (1 - bias - mbits)
        else:
            t[c] = s * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
    return t


FP8 = {"fp8_e4m3": (fp8_table(4, 3, 7, False), 448.0, 3, -6, 0x7E),
       "fp8_e5m2": (fp8_table(5, 2, 15, True), 57344.0, 2, -14, 0x7B)}


def ref_fp8_codes(v, table, max_mag):
    """Nearest finite fp8 value (saturating), ties to the even code."""
    mags = table[: max_mag + 1].astype(np.float64)
    a = np.abs(v.astype(np.float64))[:, None]
    dist = np.abs(a - mags[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    even = cand & (np.arange(max_mag + 1) % 2 == 0)[None, :]
    idx = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    return (idx | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8(fmt):
    table, fmax, mbits, emin, max_mag = FP8[fmt]
    assert table[max_mag] == fmax and np.isnan(table[0x7F])
    for label, x in ROWS:
        got = qrow(fmt, x)
        s = got[:4].view(np.float32)[0]
        assert s == np.float32(np.abs(x).max()) / np.float32(fmax), label
        deq = dqrow(fmt, got, x.shape[0])
        if s == 0:
            assert not got[4:].any() and not deq.any()
            continue
        assert np.array_equal(got[4:], ref_fp8_codes(x / s, table, max_mag)), label
        assert np.array_equal(deq, table[got[4:]] * s)
        bound = np.maximum(np.abs(x) * 2.0 ** -(mbits + 1), s * 2.0 ** (emin - mbits - 1))
        assert (np.abs(deq.astype(np.float64) - x) <= bound * (1 + 1e-6) + np.abs(x) * 2.0 ** -22).all(), label
    # representable values round-trip exactly (scale 1 and a power-of-two scale)
    finite = table[np.isfinite(table)]
    for scale in (1.0, 0.125):
        x = np.resize(finite, 256 if fmt == "fp8_e4m3" else 256).astype(np.float32) * np.float32(scale)
        x[0] = fmax * scale
        assert np.array_equal(dqrow(fmt, qrow(fmt, x), 256), x)


# ------------------------------------------------------------------------------------------------
# nl4 / nl3 / nl2: Lloyd-Max codebooks, blocks of 64
# ------------------------------------------------------------------------------------------------

# Lloyd-Max mean squared error of a unit Gaussian at 1..6 bits (Max 1960), and 8 bits: NL_TABLE's uniform
# levels on +-4 (measured on 2M samples: step^2 / 12 = 8.1e-5 plus the tails)
_LM_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499, 6: 0.000642, 8: 0.0000897}


@pytest.mark.parametrize("fmt", ["nl4", "nl3", "nl2", "klt3", "klt2", "nl3b", "nl2b"])
def test_nl_rows(fmt):
    """The bytes decode (numpy bit stream, code widths from the format's nl_runs) to d * level, each
    code is the level nearest x / d for the stored d, and on Gaussian rows the error is at most what the
    Lloyd-Max quantizers of the block's widths make for a known variance."""
    from pykv.kernels.blocks import NL_TABLE
    f = F.KV_FORMATS[fmt]
    widths = np.concatenate([np.full(n, b) for n, b in f.nl_runs])
    offs = np.concatenate([[0], np.cumsum(widths)[:-1]])
    tabs = {b: NL_TABLE[b, :1 << b].astype(np.float64) for b in set(widths.tolist())}
    for tab in tabs.values():
        assert (np.diff(tab) > 0).all() and np.allclose(tab, -tab[::-1])
    bb, sb = f.block_bytes, f.nl_scale
    assert bb == sb + widths.sum() // 8
    for label, x in ROWS:
        if label.startswith("huge"):
            continue      # scales past f16's range
        got = qrow(fmt, x)
        deq = dqrow(fmt, got, x.shape[0])
        for b in range(x.shape[0] // 64):
            blk = got[bb * b:bb * (b + 1)]
            if sb == 2:
                d = blk[:2].view(np.float16)[0].astype(np.float64)
            else:       # d = 2^((e - 160) / 8), the nearer step of the two around the fitted scale
                d = 0.0 if blk[0] == 0 else float(np.float32(2.0 ** ((int(blk[0]) - 160) / 8)))
            stream = np.unpackbits(blk[2 if sb == 2 else 1:], bitorder="little")
            codes = np.array([(stream[o:o + w] * (1 << np.arange(w))).sum() for o, w in zip(offs, widths)])
            want = np.array([d * tabs[w][c] for w, c in zip(widths, codes)])
            np.testing.assert_allclose(deq[64 * b:64 * (b + 1)], want, rtol=1e-6, atol=1e-30)
            xb = x[64 * b:64 * (b + 1)].astype(np.float64)
            if d != 0:
                for j in range(64):
                    t = tabs[widths[j]]
                    assert abs(xb[j] / d - t[codes[j]]) <= np.abs(xb[j] / d - t).min() + 1e-5, (label, j)
    X = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    err = sum(((dqrow(fmt, qrow(fmt, x), 128) - x) ** 2).sum() for x in X) / (X ** 2).sum()
    # the byte scale's steps of 2^(1/8) cost a little against the f16 scale (measured 0.2 % for nl2b)
    assert err < (1.01 if sb == 2 else 1.02) * np.mean([_LM_MSE[w] for w in widths])


# ------------------------------------------------------------------------------------------------
# tc3b / tc2b: trellis-coded blocks of 64
# ------------------------------------------------------------------------------------------------

def _tc_windows(blk, L, k):
    """Every position's trellis window from a block's symbol bytes (numpy, bit by bit): the L stream bits
    ending after symbol j, zero bits before the stream."""
    stream = np.concatenate([np.zeros(L - k, np.int64), np.unpackbits(blk, bitorder="little").astype(np.int64)])
    return np.array([(stream[k * j:k * j + L] * (1 << np.arange(L))).sum() for j in range(64)])


def _tc_best_sse(y, cb, L, k):
    """The least squared error over every symbol sequence (plain dynamic programming over the 2^L states,
    float64): what the cache's Viterbi must find."""
    S, K, G = 1 << L, 1 << k, 1 << (L - k)
    s = np.arange(S)
    cost = np.where(s % G == 0, (y[0] - cb) ** 2, np.inf)
    for j in range(1, 64):
        prev = (s % G)[:, None] * K + np.arange(K)[None, :]        # predecessors of each state
        cost = cost[prev].min(axis=1) + (y[j] - cb) ** 2
    return cost.min()


@pytest.mark.parametrize("fmt,nl", [("tc2b", "nl2b"), ("tc3b", "nl3b")])
def test_tc_rows(fmt, nl):
    """tc blocks decode (numpy bit stream) to d * TC_TABLE[window], the byte scale is the step nearest the
    block's RMS, the symbols are the least-squares path through the trellis (against plain dynamic
    programming), and on Gaussian rows the error is at least 20 % below the nl format of the same bytes."""
    from pykv.kernels.blocks import NL_E8, TC_ROW, TC_TABLE
    f = F.KV_FORMATS[fmt]
    L, k = f.tc_len, f.nl_runs[0][1]
    assert f.block_bytes == F.KV_FORMATS[nl].block_bytes
    cb = TC_TABLE[TC_ROW[f.code], :1 << L].astype(np.float64)
    assert np.abs(cb).max() < 5 and 0.8 < np.sqrt(np.mean(cb ** 2)) < 1.2     # a unit Gaussian's codebook
    checked = 0
    for label, x in ROWS:
        if label.startswith("huge"):
            continue
        got = qrow(fmt, x)
        deq = dqrow(fmt, got, x.shape[0])
        for b in range(x.shape[0] // 64):
            blk = got[f.block_bytes * b:f.block_bytes * (b + 1)]
            xb = x[64 * b:64 * (b + 1)].astype(np.float64)
            d = 0.0 if blk[0] == 0 else float(NL_E8[blk[0]])
            np.testing.assert_allclose(deq[64 * b:64 * (b + 1)], d * cb[_tc_windows(blk[1:], L, k)].astype(np.float32),
                                       rtol=1e-6, atol=1e-30)
            rms = np.sqrt(np.mean(xb ** 2))
            if d == 0:
                assert rms < NL_E8[1], label
                continue
            e = int(blk[0])
            assert all(abs(np.log(rms / d)) <= abs(np.log(rms / NL_E8[o])) + 1e-6 for o in (e - 1, e + 1) if 1 <= o <= 255)
            y = xb / d
            got_sse = ((y - cb[_tc_windows(blk[1:], L, k)]) ** 2).sum()
            assert got_sse <= _tc_best_sse(y, cb, L, k) * (1 + 1e-4) + 1e-9, (label, b)
            checked += 1
    assert checked >= 10
    X = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    err = {t: sum(((dqrow(t, qrow(t, x), 128) - x) ** 2).sum() for x in X) / (X ** 2).sum() for t in (fmt, nl)}
    assert err[fmt] < 0.8 * err[nl], err


def test_tc_codebooks_are_the_trained_ones(monkeypatch):
    """pykv/data/trellis.npz holds a codebook of 2^L levels for every tc format (tools/train_trellis.py),
    and a Lloyd iteration of the tool from that codebook barely moves it: it is a fixed point of the
    training, not a placeholder."""
    import importlib
    import pathlib
    from pykv.kernels.blocks import TC_FILE, TC_ROW, TC_TABLE
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[2] / "tools"))
    tool = importlib.import_module("train_trellis")
    books = np.load(TC_FILE)
    for f in F.KV_FORMATS.values():
        if not f.tc_len:
            continue
        L, k = f.tc_len, f.nl_runs[0][1]
        cb = books[f.name]
        assert cb.shape == (1 << L,) and np.array_equal(TC_TABLE[TC_ROW[f.code], :1 << L], cb)
        X = np.random.default_rng(8).standard_normal((3000, 64)).astype(np.float32)
        states = np.empty(X.shape, np.int64)
        err = tool._encode_all(X, TR.tc_perm(cb, L, k), L, k, states) / X.size
        sums = np.bincount(states.ravel(), X.ravel().astype(np.float64), 1 << L)
        cnt = np.bincount(states.ravel(), None, 1 << L)
        moved = np.where(cnt > 0, sums / np.maximum(cnt, 1), cb)
        assert err < {1: 0.30, 2: 0.085, 3: 0.0225}[k], (f.name, err)
        assert np.median(np.abs(moved - cb)) < 0.05, f.name


def test_nl_byte_scale_brackets_the_fitted_scale():
    """nl3b / nl2b's byte scale starts from the table step at or below the fitted d, found by compares
    against NL_E8 (the same e on CPU and GPU; floor(8 log2 d) used the devices' differing log2)."""
    from pykv.kernels.blocks import NL_E8
    rng = np.random.default_rng(5)
    ds = np.concatenate([NL_E8[1:], np.nextafter(NL_E8[1:], np.float32(0)), np.nextafter(NL_E8[1:], np.float32(9e9)),
                         (2.0 ** rng.uniform(-22, 14, 4000)).astype(np.float32), [np.float32(1e-30), np.float32(1e30)]])
    for d in ds.astype(np.float32):
        e = K.nl_e8_floor(d)
        assert 1 <= e <= 255
        assert NL_E8[e] <= d or e == 1, (d, e)
        assert e == 255 or d < NL_E8[e + 1], (d, e)


def test_nl_tables_are_read_through_one_function_each():
    """numba.cuda copies a module-level array into a kernel's constant memory once per place its code reads
    it; read at every use, the nl tables made the KV append kernel 70 KB of constants, over the GPU's 64 KiB
    (ptxas refused it on an H200; the simulator has no limit).  So each table is subscripted in exactly one
    function of the kernel sources: blocks.nl_level / nl_width / nl_offset / nl_e8."""
    import ast
    import pathlib
    root = pathlib.Path(K.__file__).parent
    reads = {}                                  # table name -> the functions that subscript it
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                        reads.setdefault(node.value.id, []).append(f"{path.name}:{fn.name}:{node.lineno}")
    want = {"NL_TABLE": "nl_level", "NL_BITS": "nl_width", "NL_OFF": "nl_offset", "NL_E8": "nl_e8",
            "TC_TABLE": "tc_level", "TC_LEN": "tc_len"}
    for name, fn in want.items():
        assert [r.rsplit(":", 1)[0] for r in reads.get(name, [])] == [f"blocks.py:{fn}"], (name, reads.get(name))


# ------------------------------------------------------------------------------------------------
# KIVI
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_kivi_value_rows(fmt):
    bits = 4 if fmt == "int4" else 2
    qmax = (1 << bits) - 1
    for label, x in ROWS:
        if label.startswith("huge"):
            x = x / np.float32(4)  # keep within f16 range for scales/mins
        got = qrow(fmt, x)
        deq = dqrow(fmt, got, x.shape[0])
        gb = 4 + 4 * bits
        for g in range(x.shape[0] // 32):
            d = got[gb * g:gb * g + 2].view(np.float16)[0].astype(np.float64)
            m = got[gb * g + 2:gb * g + 4].view(np.float16)[0].astype(np.float64)
            xb = x[32 * g:32 * g + 32].astype(np.float64)
            assert m <= xb.min() and m + qmax * d >= xb.max() * (1 - 1e-6) - 1e-30, label
            err = np.abs(deq[32 * g:32 * g + 32] - xb)
            assert (err <= d / 2 + 1e-6 * np.abs(xb).max() + 1e-30).all(), (label, err.max(), d)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("P", [32, 16])
def test_kivi_key_pages(bits, P):
    qmax = (1 << bits) - 1
    rng = np.random.default_rng(bits * 100 + P)
    for hd in (64, 128):
        xk = (rng.standard_normal((P, hd)) * rng.uniform(0.1, 5, hd)[None, :]
              + rng.standard_normal(hd)[None, :] * 3).astype(np.float32)
        xk[:, 5] = 0.0  # a constant channel
        xk[7, 9] = 60.0  # an outlier
        pb = F.kivi_page_bytes(f"int{bits}", hd, P, True)
        buf = np.full(pb + GUARD, 0xA5, np.uint8)
        K.kivi_quantize_kpage(bits, xk, buf[:pb])
        assert (buf[pb:] == 0xA5).all()
        page = buf[:pb].copy()
        d = page[:2 * hd].view(np.float16).astype(np.float64)
        m = page[2 * hd:4 * hd].view(np.float16).astype(np.float64)
        assert (m <= xk.min(axis=0)).all()
        deq = np.empty((P, hd), np.float32)
        deq_kivi_k_rows(bits, page, 0, P, deq, np.empty(hd, np.float32), np.empty(hd, np.float32))
        err = np.abs(deq - xk.astype(np.float64))
        assert (err <= d[None, :] / 2 + 1e-6 * np.abs(xk).max()).all()
        # codes decode as documented (token-major, groups of 32 channels)
        rb = hd * bits // 8
        codes = np.empty((P, hd), np.int64)
        for t in range(P):
            row = page[4 * hd + t * rb:4 * hd + (t + 1) * rb].astype(np.int64).reshape(hd // 32, -1)
            if bits == 4:
                codes[t] = np.concatenate([row & 15, row >> 4], axis=1).reshape(hd)
            else:
                codes[t] = np.concatenate([(row >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(hd)
        assert codes.max() <= qmax
        assert np.array_equal(deq, (codes.astype(np.float32) * d.astype(np.float32)[None, :]
                                    + m.astype(np.float32)[None, :]))


@njit(cache=False)
def _simd_decode(code, raw, bb, out):
    for b in range(out.size // 32):
        if code == F.CODE_Q8_0:
            deq_q8_0(raw, b * bb, out, 32 * b)
        elif code == F.CODE_Q4_0:
            deq_q4_0(raw, b * bb, out, 32 * b)
        else:
            deq_q4_1(raw, b * bb, out, 32 * b)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_simd_block_decoders_match_gguf(fmt):
    """The whole-block vector decoders attention uses (kernels.simd) equal gguf's dequantize bit for
    bit, on random bytes with random finite scales (negative, tiny, subnormal ones included)."""
    rng = np.random.default_rng(11)
    f = F.KV_FORMATS[fmt]
    nb = 64
    blk = rng.integers(0, 256, (nb, f.block_bytes), dtype=np.uint8)
    sc = np.concatenate([rng.standard_normal(nb) * 10.0 ** rng.integers(-7, 4, nb),
                         rng.standard_normal(nb)]).astype(np.float16)
    sc[:3] = [0.0, 6e-8, -65504.0]
    blk[:, 0:2] = sc[:nb].view(np.uint8).reshape(nb, 2)
    if fmt == "q4_1":
        blk[:, 2:4] = sc[nb:].view(np.uint8).reshape(nb, 2)
    out = np.full(nb * 32, np.nan, np.float32)
    _simd_decode(f.code, blk.reshape(-1), f.block_bytes, out)
    ref = gguf_dequant(fmt, blk.reshape(-1), nb * 32)
    assert np.array_equal(out, ref)
