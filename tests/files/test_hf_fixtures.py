"""Checkpoints written by transformers itself (tests/data/hf_fixtures, made by tools/make_hf_fixtures.py):
convert each one and compare pykv's logits with transformers' own; refusals of malformed RoPE sections;
the metadata llama.cpp's converter writes for the same checkpoint."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pykv import tools as C

FIX = Path(__file__).parents[1] / "data" / "hf_fixtures"
NAMES = sorted(p.name for p in FIX.iterdir() if (p / "reference.npz").is_file())


def test_fixture_set_covers_the_issue():
    cfgs = {n: json.loads((FIX / n / "config.json").read_text()) for n in NAMES}
    rope = {n: C.read_rope(c).type for n, c in cfgs.items()}
    assert set(rope.values()) == {"default", "linear", "llama3", "yarn"}
    assert {"rope_parameters" in c for c in cfgs.values()} == {True, False}          # both schemas
    assert {c["tie_word_embeddings"] for c in cfgs.values()} == {True, False}
    assert any(c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs.values())   # GQA
    assert any(c.get("dtype", c.get("torch_dtype")) == "bfloat16" for c in cfgs.values())


def pykv_logits(gguf_path, ids):
    import pykv
    from pykv.kernels import matmul as mm
    m = pykv.load(str(gguf_path), n_ctx=64, kv_type_k="f32", kv_type_v="f32", q8_act=False)
    mm.set_exact(True)
    try:
        return np.asarray(m.forward(list(ids)), np.float64)
    finally:
        mm.set_exact(False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_fixtures")
    return {(n, t): C.convert_hf(FIX / n, out / f"{n}-{t}.gguf", outtype=t) for n in NAMES for t in ("f32", "f16")}


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, outtype, converted):
    ref = np.load(FIX / name / "reference.npz")
    want = ref["logits" if outtype == "f32" else "logits_f16"].astype(np.float64)
    got = pykv_logits(converted[name, outtype], ref["ids"])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-5, f"{name} {outtype}: {err:.2e}"


def test_rope_matters_in_the_fixtures(converted, tmp_path):
    """The fixtures would catch a converter that dropped the RoPE section: the same weights with the
    default RoPE (base 10000) miss the reference by far more than the tolerance."""
    for name in ("tf5_llama3", "tf5_yarn", "tf4_linear", "tf4_default_untied"):
        d = tmp_path / name
        shutil.copytree(FIX / name, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
        (d / "config.json").write_text(json.dumps(cfg))
        ref = np.load(d / "reference.npz")
        got = pykv_logits(C.convert_hf(d, tmp_path / f"{name}.gguf", outtype="f32"), ref["ids"])
        assert np.abs(got - ref["logits"]).max() / np.abs(ref["logits"]).max() > 1e-3, name


def md_of(path) -> dict:
    return C.gguf_metadata(gguf.GGUFReader(path))


def test_rope_metadata(converted):
    md = md_of(converted["tf5_yarn", "f32"])
    assert md["llama.rope.freq_base"] == 10000.0 and md["llama.rope.scaling.type"] == "yarn"
    assert md["llama.rope.scaling.factor"] == 4.0 and md["llama.rope.scaling.original_context_length"] == 256
    assert not any(k.startswith("llama.rope.scaling.yarn") for k in md)
    md = md_of(converted["tf4_yarn_attn", "f32"])
    assert (md["llama.rope.scaling.yarn_attn_factor"], md["llama.rope.scaling.yarn_beta_fast"],
            md["llama.rope.scaling.yarn_beta_slow"]) == (1.25, 16.0, 2.0)
    md = md_of(converted["tf4_linear", "f32"])
    assert (md["llama.rope.scaling.type"], md["llama.rope.scaling.factor"]) == ("linear", 2.0)
    r = gguf.GGUFReader(converted["tf5_llama3", "f32"])
    assert not any(k.startswith("llama.rope.scaling") for k in C.gguf_metadata(r))
    t = {t.name: t for t in r.tensors}["rope_freqs.weight"]
    # theta 500, omp 32, low 1, high 4, factor 4: wavelengths 6.3, 13.7, 29.9, 65, ... against 32/4 and 32/1
    f = np.asarray(t.data)
    assert t.tensor_type == gguf.GGMLQuantizationType.F32 and f.shape == (8,)
    assert f[0] == 1.0 and 1.0 < f[1] < f[2] < 4.0 and (f[3:] == 4.0).all()


# ---- refusals: one line, exit code 2, nothing written --------------------------------------------

BAD = [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "unsupported rope_parameters.rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "unsupported rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters of type 'linear' lacks factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "x"}},
     "rope_parameters.factor must be a number, got 'x'"),
    ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters lacks rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}},
     "rope_parameters.rope_theta must be a number, got 'big'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 64}},
     "rope_parameters of type 'llama3' lacks high_freq_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64.5}},
     "rope_parameters.original_max_position_embeddings must be an integer, got 64.5"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False,
                          "original_max_position_embeddings": 64}}, "rope_parameters.truncate must be true"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": True,
                          "original_max_position_embeddings": 64}}, "rope_parameters.factor must be a number, got True"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "per layer type ['full_attention', 'sliding_attention'] is ambiguous"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported"),
    ({"rope_theta": None, "rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 2.0}},
     "rope_scaling.rope_type 'yarn' differs from rope_scaling.type 'linear'"),
    ({"rope_theta": [10000]}, "rope_theta must be a number, got [10000]"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),
]


@pytest.mark.parametrize("patch,msg", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_rope_refused(patch, msg, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(FIX / "tf4_default_untied", d)
    cfg = json.loads((d / "config.json").read_text())
    for k in ("rope_theta", "rope_scaling", "rope_parameters"):
        cfg.pop(k, None)
    cfg.update({k: v for k, v in patch.items() if v is not None})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ConvertError) as ei:
        C.convert_hf(d, tmp_path / "x.gguf")
    assert msg in str(ei.value) and "\n" not in str(ei.value) and str(ei.value).startswith("config.json: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_bad_rope_cli_exit_2(tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(FIX / "tf5_yarn", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["factor"] = "x"
    (d / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "pykv", "convert", str(d), str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300)
    assert p.returncode == 2
    err = p.stderr.strip()
    assert "\n" not in err and err.endswith("error: config.json: rope_parameters.factor must be a number, got 'x'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_rope_defaults_as_transformers():
    """Only transformers' own defaults: base 10000 without any RoPE section, llama3/yarn's original context =
    max_position_embeddings; a nested per-layer-type section with full_attention only is read."""
    assert C.read_rope({}) == C.RopeSpec("default", 10000.0)
    assert C.read_rope({"rope_scaling": None, "rope_theta": 5e5}) == C.RopeSpec("default", 5e5)
    r = C.read_rope({"max_position_embeddings": 512, "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}})
    assert (r.type, r.orig_ctx, r.factor, r.attn_factor) == ("yarn", 512, 2.0, None)
    r = C.read_rope({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 2.0, "mscale_all_dim": 1.0}})
    assert r.attn_factor == pytest.approx((0.2 * np.log(4) + 1) / (0.1 * np.log(4) + 1))


# ---- export: what transformers 5 reads back ------------------------------------------------------

@pytest.mark.parametrize("name", ["tf5_llama3", "tf4_llama3", "tf4_yarn_attn", "tf4_linear", "tf5_default_tied_mha"])
def test_export_rope_parameters_roundtrip(name, converted, tmp_path):
    src = json.loads((FIX / name / "config.json").read_text())
    want = C.read_rope(src)
    C.export_hf(converted[name, "f32"], tmp_path / "e", dtype="f32")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "rope_theta" not in cfg and "rope_scaling" not in cfg
    assert C.read_rope(cfg) == want and cfg["rope_parameters"] == want.hf_params()
    g2 = C.convert_hf(tmp_path / "e", tmp_path / "back.gguf", outtype="f32")
    a, b = md_of(converted[name, "f32"]), md_of(g2)
    assert {k: v for k, v in a.items() if k.startswith("llama.rope")} == \
           {k: v for k, v in b.items() if k.startswith("llama.rope")}
    ta = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(converted[name, "f32"]).tensors}
    tb = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(g2).tensors}
    assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def test_export_refuses_unrecoverable_llama3(converted, tmp_path):
    src = converted["tf5_llama3", "f32"]
    r = gguf.GGUFReader(src)
    freqs = np.asarray({t.name: t for t in r.tensors}["rope_freqs.weight"].data).copy()
    md = C.gguf_metadata(r)
    freqs[1] *= 1.001          # no llama3 parameters give these factors
    with pytest.raises(C.ConvertError, match="cannot recover llama3 rope parameters"):
        C.rope_from_gguf(md, freqs, 16)
    with pytest.raises(C.ConvertError, match="cannot recover llama3 rope parameters"):
        C.rope_from_gguf(md, np.array([1, 1, 1, 4, 4, 4, 4, 4], np.float32), 16)   # no smoothing band


# ---- the metadata llama.cpp's converter writes -------------------------------------------------------

def test_metadata_matches_llama_cpp_converter(converted):
    """tests/data/llama_cpp_convert_metadata.json holds what llama.cpp's convert_hf_to_gguf.py (LlamaModel:
    conversion/base.py TextModel.set_gguf_parameters for the rope keys, conversion/llama.py
    generate_extra_tensors for rope_freqs.weight, gguf-py's SpecialVocab for the tokenizer keys) wrote for
    these fixtures at --outtype f32, recorded once by tools/llama_cpp_metadata.py (llama-cpp-python 0.3.36's
    sources). Every key and value must be ours too, and the same tensors; general.name is the folder's."""
    want_all = json.loads((Path(__file__).parents[1] / "data" / "llama_cpp_convert_metadata.json").read_text())
    assert len(want_all) == 6
    for name, want in want_all.items():
        want = {k: v for k, v in want.items() if k != "_rope_freqs"}
        r = gguf.GGUFReader(converted[name, "f32"])
        got = C.gguf_metadata(r)
        got.pop("general.name")
        got["_tensors"] = sorted(t.name for t in r.tensors)
        assert got == want, (name, {k for k in set(got) | set(want) if got.get(k) != want.get(k)})
    # and the rope_freqs tensor llama.cpp computes (float32 torch) is ours bit for bit
    f = {t.name: t for t in gguf.GGUFReader(converted["tf5_llama3", "f32"]).tensors}["rope_freqs.weight"]
    assert np.asarray(f.data).tolist() == want_all["tf5_llama3"]["_rope_freqs"]


def test_runtime_reads_rope_metadata(converted):
    from pykv.files.config import Config, PykvError
    md = md_of(converted["tf4_yarn_attn", "f32"])
    c = Config.from_metadata(md)
    assert (c.rope_scaling, c.rope_freq_scale, c.rope_orig_ctx, c.yarn_beta_fast, c.yarn_beta_slow) == \
           ("yarn", 0.25, 32, 16.0, 2.0)
    assert c.yarn_ext_factor == 1.0 and c.yarn_attn_mul * (1 + 0.1 * np.log(4.0)) == pytest.approx(1.25)
    c = Config.from_metadata(md_of(converted["tf4_linear", "f32"]))
    assert (c.rope_scaling, c.rope_freq_scale, c.yarn_ext_factor, c.yarn_attn_mul) == ("linear", 0.5, 0.0, 1.0)
    with pytest.raises(PykvError, match="unsupported RoPE scaling type 'longrope'"):
        Config.from_metadata(dict(md, **{"llama.rope.scaling.type": "longrope"}))
