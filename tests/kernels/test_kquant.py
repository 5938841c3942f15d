"""K-quant quantizers, llama-quantize's type mixes and imatrix files (`pykv quantize`).

Fixtures under tests/data were made by llama.cpp's tools through tools/kquant_compare.py:
kquant_llama.npz (rows of SmolLM2's blk.0.ffn_down and llama-quantize's bytes for them, with and
without an imatrix), kquant_llama_types.json (llama-quantize's type per tensor for each target),
imatrix-smollm2-blk0.gguf (llama-imatrix's file cut to its metadata and layer 0)."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pykv import tools as C
from pykv.tools import quant_plan as P
from pykv.kernels import quantize_k as K

sys.path.insert(0, str(Path(__file__).parents[1]))
DATA = Path(__file__).parents[1] / "data"
FIX = np.load(DATA / "kquant_llama.npz")
TYPES_JSON = json.loads((DATA / "kquant_llama_types.json").read_text())
IMAT = DATA / "imatrix-smollm2-blk0.gguf"
K_QT = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _quant(x, qt, qw=None):
    return C.encode(x, qt, qw=qw)


# ----------------------------------------------------------------------------------------------
# quantizers against llama-quantize's bytes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qt", K_QT, ids=lambda t: t.name)
def test_k_quantizer_bytes_equal_llama_quantize(qt):
    x = FIX["x"]
    assert np.array_equal(_quant(x, qt), FIX[qt.name]), qt.name


@pytest.mark.parametrize("qt", K_QT, ids=lambda t: t.name)
def test_k_quantizer_imatrix_bytes_equal_llama_quantize(qt):
    key = f"{qt.name}-imat"
    if key not in FIX:
        pytest.skip(f"no {key} in the fixture")
    assert np.array_equal(_quant(FIX["x"], qt, FIX["qw"]), FIX[key]), key


def test_imatrix_changes_the_bytes_and_the_weighted_error():
    """The imatrix path is really taken: other bytes, and a lower qw-weighted error than without."""
    x, qw = FIX["x"], FIX["qw"]
    for qt in K_QT:
        a, b = _quant(x, qt), _quant(x, qt, qw)
        assert not np.array_equal(a, b), qt.name
        ea = ((gguf.quants.dequantize(a, qt) - x) ** 2 * qw).sum()
        eb = ((gguf.quants.dequantize(b, qt) - x) ** 2 * qw).sum()
        assert eb < ea, qt.name


# relative RMS error bounds of a Gaussian row (measured: 0.66-0.8x of these)
_REL_RMS = {QT.Q2_K: 0.45, QT.Q3_K: 0.2, QT.Q4_K: 0.1, QT.Q5_K: 0.05, QT.Q6_K: 0.025}


@pytest.mark.parametrize("qt", K_QT, ids=lambda t: t.name)
def test_k_round_trip_error_and_edge_rows(qt):
    rng = np.random.default_rng(int(qt))
    x = (rng.standard_normal((8, 512)) * rng.uniform(1e-3, 10, (8, 1))).astype(np.float32)
    x[0] = 0                       # all-zero super-blocks
    x[1, :256] = 0.5               # constant
    x[2] = np.abs(x[2])            # one-signed
    x[3, ::17] *= 40               # outliers
    q = _quant(x, qt)
    assert q.shape == (8, 2 * K.BLOCK_BYTES[int(qt)])
    y = gguf.quants.dequantize(q, qt)
    assert np.all(y[0] == 0)
    for r in (4, 5, 6, 7):
        rel = np.sqrt(np.mean((y[r] - x[r]) ** 2)) / np.sqrt(np.mean(x[r] ** 2))
        assert rel < _REL_RMS[qt], (qt.name, r, rel)
    assert np.max(np.abs(y[1, :256] - 0.5)) < 0.5 * _REL_RMS[qt]


def test_legacy_imatrix_variants_move_towards_the_weights():
    x, qw = FIX["x"][:, :576], FIX["qw"][:576]
    # the fixture rows are a dequantized Q4_1 tensor: requantized to Q4_1 they come back exact; add noise
    x = (x + np.random.default_rng(5).normal(0, 0.5 * x.std(), x.shape)).astype(np.float32)
    for qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        plain, weighted = _quant(x, qt), _quant(x, qt, qw)
        assert np.array_equal(plain, gguf.quants.quantize(x, qt))      # no imatrix: ggml's ref bytes
        ea = ((gguf.quants.dequantize(plain, qt) - x) ** 2 * qw).sum()
        eb = ((gguf.quants.dequantize(weighted, qt) - x) ** 2 * qw).sum()
        assert eb < ea, qt.name


# ----------------------------------------------------------------------------------------------
# type mixes: llama-quantize's choice per tensor on SmolLM2 (n_embd 576: most tensors fall back)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", sorted(TYPES_JSON["llama_quantize_types"]))
def test_mix_types_equal_llama_quantize(target):
    tensors = [(n, tuple(s)) for n, s in TYPES_JSON["tensors"] if len(s) > 1]
    got = P.plan_types(tensors, P.MIXES[target], TYPES_JSON["n_layer"])
    want = TYPES_JSON["llama_quantize_types"][target]
    diff = {n: (want[n], g.name) for (n, _), g in zip(tensors, got) if want[n] != g.name}
    assert not diff, diff


def test_fallback_table():
    assert P.fallback(QT.Q4_K, 576) == QT.Q5_0
    assert P.fallback(QT.Q5_K, 576) == QT.Q5_1
    assert P.fallback(QT.Q6_K, 576) == QT.Q8_0
    assert P.fallback(QT.Q2_K, 576) == QT.Q4_0
    assert P.fallback(QT.Q4_K, 1536) == QT.Q4_K
    assert P.fallback(QT.Q4_K, 100) == QT.F16


# ----------------------------------------------------------------------------------------------
# imatrix files
# ----------------------------------------------------------------------------------------------

def test_read_real_imatrix():
    w = P.read_imatrix(IMAT)
    r = gguf.GGUFReader(IMAT)
    sums = {t.name[:-8]: np.asarray(t.data, np.float32).reshape(-1) for t in r.tensors if t.name.endswith(".in_sum2")}
    cnts = {t.name[:-7]: float(np.asarray(t.data)[0]) for t in r.tensors if t.name.endswith(".counts")}
    assert sorted(w) == sorted(sums) and "blk.0.ffn_down.weight" in w
    for k in w:
        assert w[k].dtype == np.float32 and w[k].shape == sums[k].shape
        assert np.array_equal(w[k], sums[k] / np.float32(cnts[k]))
    assert np.array_equal(w["blk.0.ffn_down.weight"], FIX["qw"])


def _corrupt(tmp_path, name, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_imatrix_errors_are_one_line(tmp_path, tiny256):
    raw = IMAT.read_bytes()
    cases = {
        "missing.gguf": None,
        "trunc.gguf": raw[: len(raw) // 2],
        "garbage.dat": b"\x03\x00\x00\x00\xff\xff",
        "empty.dat": b"",
    }
    for name, data in cases.items():
        p = tmp_path / name if data is None else _corrupt(tmp_path, name, data)
        with pytest.raises(P.ImatrixError) as e:
            P.read_imatrix(p)
        assert "\n" not in str(e.value) and "imatrix" in str(e.value), name
    with pytest.raises(P.ImatrixError, match="general.type"):       # a model, not an imatrix
        P.read_imatrix(tiny256)


def test_legacy_dat_imatrix(tmp_path):
    vals = np.arange(1, 7, dtype=np.float32)
    name = b"blk.0.attn_q.weight"
    raw = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 4, 6) + vals.tobytes()
    w = P.read_imatrix(_corrupt(tmp_path, "m.dat", raw))
    assert list(w) == ["blk.0.attn_q.weight"] and np.array_equal(w["blk.0.attn_q.weight"], vals / np.float32(4))


def test_imatrix_size_mismatch(tmp_path):
    w = {"blk.0.attn_q.weight": np.ones(5, np.float32), "token_embd.weight": np.ones(5, np.float32)}
    assert P.imatrix_for(w, "token_embd.weight", 576) is None       # llama-quantize skips it
    assert P.imatrix_for(w, "blk.1.attn_q.weight", 576) is None
    with pytest.raises(P.ImatrixError, match="5 values for blk.0.attn_q.weight.*576 columns"):
        P.imatrix_for(w, "blk.0.attn_q.weight", 576)


# ----------------------------------------------------------------------------------------------
# quantize -> load -> forward on a tiny model whose rows hold whole super-blocks
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny256(tmp_path_factory):
    import hf_reference as R
    from tests.files.test_convert import make_tiny
    mp = pytest.MonkeyPatch()
    mp.setattr(R, "TINY", dict(R.TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2))
    try:
        d, _, _ = make_tiny(tmp_path_factory.mktemp("tiny256"), "bpe", dtype="f32", seed=3)
    finally:
        mp.undo()
    return C.convert_hf(d, tmp_path_factory.mktemp("tiny256out") / "f32.gguf", outtype="f32")


IDS = [5, 17, 99, 3, 250, 42, 7, 130]


# 1 - correlation of the logits with the f32 model's (measured on this random model: q6_k 0.0015,
# q3_k_m 0.058, q2_k 0.29; its logits are sensitive: q8_0 weights already move the max logit 2 %)
@pytest.mark.parametrize("target,tol", [("q6_k", 0.005), ("q3_k_m", 0.12), ("q2_k", 0.5)])
def test_quantize_load_forward(tiny256, tmp_path, target, tol):
    import pykv
    out = C.quantize_gguf(tiny256, tmp_path / f"{target}.gguf", target)
    r = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type for t in r.tensors}
    mix = P.MIXES[target]
    assert types["blk.0.ffn_gate.weight"] == mix.base
    assert int(C.gguf_metadata(r)["general.file_type"]) == mix.file_type
    ref = np.asarray(pykv.load(str(tiny256), n_ctx=32, kv_type_k="f32", kv_type_v="f32").forward(IDS), np.float64)
    got = np.asarray(pykv.load(str(out), n_ctx=32, kv_type_k="f32", kv_type_v="f32").forward(IDS), np.float64)
    assert np.all(np.isfinite(got)) and got.shape == ref.shape
    err = 1 - np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert err < tol, (target, err)


def test_quantize_cli_errors_leave_no_file(tiny256, tmp_path):
    bad = _corrupt(tmp_path, "bad.imatrix", b"GGUF\x03\x00")
    out = tmp_path / "o.gguf"
    with pytest.raises(C.ConvertError) as e:
        C.quantize_gguf(tiny256, out, "q4_k_m", imatrix=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConvertError, match="unsupported type"):
        C.quantize_gguf(tiny256, out, "q4_k_x")
    with pytest.raises(C.ConvertError, match="576 values for blk.0.* 256 columns"):
        C.quantize_gguf(tiny256, out, "q4_k_m", imatrix=IMAT)       # SmolLM2's rows are 576 long
    assert not out.exists() and not list(tmp_path.glob(".o.gguf*"))
