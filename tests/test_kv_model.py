"""The quantized KV cache inside the model: per-layer types, exact transforms, KIVI residual pages,
perplexity through the cache, and the real model's perplexity budget per KV type."""
import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import pykv
from tests.reference import write_tiny_gguf

IDS = [5, 77, 3, 260, 261, 9, 140, 33, 2, 250, 1, 17, 99, 45, 200, 201, 7, 8, 9, 10, 11, 12, 13, 14,
       15, 16, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kv") / "tiny.gguf", {"default": T.F32}, n_layers=2))


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_per_layer_kv_types(tiny_path):
    m = pykv.load(tiny_path, n_ctx=64, kv_type_k=["q8_0", "q4_0"], kv_type_v=["int4", "f16"])
    assert [l.k_fmt.name for l in m.cache.layers] == ["q8_0", "q4_0"]
    assert [l.v_fmt.name for l in m.cache.layers] == ["int4", "f16"]
    per_layer = [(l.k_pool.nbytes + l.v_pool.nbytes) / m.cache.capacity_tokens() for l in m.cache.layers]
    assert m.kv_bytes_per_token() == pytest.approx(sum(per_layer))
    ref = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32").forward(IDS)
    err_mixed = rel(m.forward(IDS), ref)
    err_q8 = rel(pykv.load(tiny_path, n_ctx=64, kv_type_k="q8_0", kv_type_v="q8_0").forward(IDS), ref)
    # measured: q8_0 everywhere 0.0066, this mix 0.042 (q4_0 everywhere: 0.12); the 4-bit layer costs
    # more than 8-bit everywhere, and the 8-bit / f16 / KIVI parts keep it well below all-q4_0
    assert err_q8 < 0.01 and err_q8 < err_mixed < 0.06, (err_q8, err_mixed)
    with pytest.raises(pykv.PykvError, match="per-layer"):
        pykv.load(tiny_path, n_ctx=64, kv_type_k=["q8_0"] * 3)


def test_rotation_and_smoothing_leave_attention_unchanged(tiny_path):
    """Hadamard rotation and key smoothing are exact in real arithmetic: with an f32 cache they
    change the logits only by float rounding."""
    base = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32", kv_rotate=False).forward(IDS)
    rot = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32", kv_rotate=True).forward(IDS)
    assert rel(rot, base) < 1e-5
    m = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32", kv_rotate=True, n_batch=16)
    m.cache.k_smooth = [True] * len(m.cache.layers)     # force smoothing on a float cache
    assert rel(m.forward(IDS), base) < 1e-5
    assert np.abs(m.seq.k_shift).max() > 0 and np.abs(m.seq.k_scale - 1).max() > 0


def test_prerope_keys_leave_attention_unchanged(tiny_path):
    """Pre-RoPE keys with query-aware smoothing and rotation are exact in real arithmetic: an f32
    cache forced through that path (keys smoothed and stored before RoPE, roped back inside
    attention) gives the plain f32 cache's logits up to float rounding."""
    base = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32", kv_rotate=False).forward(IDS)
    m = pykv.load(tiny_path, n_ctx=64, kv_type_k="f32", kv_type_v="f32", kv_rotate=True, n_batch=16)
    m.cache.k_smooth = m.cache.k_pre = [True] * len(m.cache.layers)
    assert rel(m.forward(IDS), base) < 1e-5
    assert np.abs(m.seq.k_shift).max() > 0 and np.abs(m.seq.k_scale - 1).max() > 0


@pytest.mark.parametrize("kv,W", [("q4_0", 0), ("nl3", 0), ("nl3", 5)])
def test_prerope_decode_steps_equal_prefill(tiny_path, kv, W):
    """With pre-RoPE keys (kv_prerope=True), token-by-token decode after a first batch of 8 reads the
    same cache as a prefill in batches of 8 (same smoothing statistics); W > 0: with the token-adaptive
    window too (its ring rows are pre-RoPE keys as well, roped back like the pool's)."""
    m = pykv.load(tiny_path, n_ctx=64, kv_type_k=kv, kv_type_v=kv, page_tokens=8, n_batch=8, kv_prerope=True,
                  kv_window=W)
    assert all(m.cache.k_pre)
    full = m.forward(IDS)
    seq = m.new_sequence()
    steps = np.concatenate([m.eval(seq, IDS[:8], all_logits=True)] + [m.eval(seq, [i]) for i in IDS[8:]])
    assert rel(steps, full) < 1e-4
    off = pykv.load(tiny_path, n_ctx=64, kv_type_k=kv, kv_type_v=kv, page_tokens=8, n_batch=8, kv_window=W)
    assert not any(off.cache.k_pre)
    assert rel(off.forward(IDS), full) > 1e-4     # really a different path


@pytest.mark.parametrize("kv", ["q4_0", "int4", "int2", "fp8_e4m3", "iq4_nl", "nl2b", "klt2"])
def test_decode_steps_equal_prefill(tiny_path, kv):
    """Token-by-token decode and batched prefill read the same quantized cache, KIVI's f16 newest
    page included (a full page is quantized when the next token arrives, batches stop at pages)."""
    # key smoothing is fixed by the first batch (1 token here vs all of them): off for the comparison
    vt = "nl2" if kv == "klt2" else kv      # klt types hold keys only
    m = pykv.load(tiny_path, n_ctx=64, kv_type_k=kv, kv_type_v=vt, page_tokens=8, n_batch=64, kv_smooth=False)
    full = m.forward(IDS)
    seq = m.new_sequence()
    steps = np.concatenate([m.eval(seq, [i]) for i in IDS])
    assert seq.n_tokens == len(IDS)
    assert rel(steps, full) < 1e-4


def test_perplexity_cli_json(tiny_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the the then there thé þe " * 40)
    r = subprocess.run([sys.executable, "-m", "pykv", "perplexity", tiny_path, str(text), "-c", "32",
                        "-ctk", "q4_0", "-ctv", "q4_0", "--kl-base", "f16", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["ppl"] > 1 and res["kl"] >= 0 and 0 <= res["top1"] <= 1
    assert res["kv_bytes_per_token"] == 2 * 2 * 2 * 64 // 32 * 18   # layers x (K+V) x KVH x blocks x 18
    assert res["q8_act"] is False           # KV comparisons run with float activations by default
    r = subprocess.run([sys.executable, "-m", "pykv", "perplexity", tiny_path, str(text), "-c", "32",
                        "--q8-act", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["q8_act"] is True


LLAMA_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "iq4_nl")     # recorded in reference.npz (llama_text_*)
# issue #3's perplexity budget over the f16 cache; two-sided: a KV type that *improves* perplexity by
# more than its budget is as suspect (a leak of future tokens, a cache that is not read) as one that
# costs more
BUDGET = {"q8_0": 0.003, "q4_0": 0.02, "int4": 0.02, "int2": 0.10}


@pytest.fixture(scope="module")
def kv_logprobs(smollm2_path, ref):
    """log p(next reference token) at each of the 1023 positions of the reference text (ctx 1024)
    through each KV type's cache: one model, one cache swap per type, float activations as
    `pykv perplexity` uses (only the KV cache differs between runs)."""
    from pykv.api.evaluate import log_softmax
    ids = ref["text_ids"][:1024].astype(np.int64)
    m = pykv.load(smollm2_path, n_ctx=1024, q8_act=False)
    out = {}
    for kv in ("f16",) + LLAMA_TYPES + ("int4", "int2"):
        m.set_kv_types(kv, kv)
        assert m.cache.k_name() == m.cache.v_name() == kv
        lp = log_softmax(m.forward(ids)[:-1])
        out[kv] = lp[np.arange(len(ids) - 1), ids[1:]]
    return out


def test_smollm2_kv_perplexity_budget(kv_logprobs):
    """|ppl(type) / ppl(f16) - 1| within the budget per type."""
    got = {kv: float(np.exp(kv_logprobs["f16"].mean() - kv_logprobs[kv].mean()) - 1) for kv in BUDGET}
    print({k: f"{100 * v:+.2f}%" for k, v in got.items()})
    for kv, lim in BUDGET.items():
        assert abs(got[kv]) <= lim, (kv, got[kv])


def test_smollm2_kv_perplexity_change_vs_llamacpp(kv_logprobs, ref):
    """Per KV type, pykv's perplexity change over its own f16 cache is no worse than llama.cpp's change
    over its f16 cache on the same 1023 positions (llama-cpp-python 0.3.36, recorded in reference.npz).

    Margin: both changes are means over 1023 token log-probs, so their difference has a sampling error;
    pairing the runs token by token, d_t = (pykv_f16 - pykv_T)_t - (llama_f16 - llama_T)_t, and
    mean(d) = Δln ppl(pykv) - Δln ppl(llama.cpp). We allow mean(d) <= 2 standard errors of mean(d)
    (std(d) / sqrt(1023)). The standard error is computed, not chosen: 0.35 % for q8_0 (llama.cpp's 8-bit
    activations make its two runs drift apart), 1.0-1.8 % for the 4-bit types. That is docs/kv-formats.md's
    "±1 % is noise" made exact: pykv's iq4_nl change (+1.89 % in docs/kv-formats.md, +2.97 % on an AVX2 host:
    float rounding differs, and flips 4-bit levels) and llama.cpp's (+1.86 %) are equal within it, while
    a broken format is far outside it (an iq4_nl scale 25 % too large: +160 %). Smaller breaks of the
    types llama.cpp does poorly on are the budget test's (a q4_0 quantizer that truncates: +9.3 %, within
    2 standard errors of llama.cpp's +6.2 % but over the 2 % budget)."""
    lf, rows = ref["llama_text_logprob_f16"].astype(np.float64), []
    for kv in LLAMA_TYPES:
        d = (kv_logprobs["f16"] - kv_logprobs[kv]) - (lf - ref[f"llama_text_logprob_{kv}"].astype(np.float64))
        se = float(d.std(ddof=1) / np.sqrt(len(d)))
        pykv_delta = float(np.exp(kv_logprobs["f16"].mean() - kv_logprobs[kv].mean()) - 1)
        llama_delta = float(np.exp(lf.mean() - ref[f"llama_text_logprob_{kv}"].mean()) - 1)
        rows.append((kv, pykv_delta, llama_delta, float(d.mean()), se))
    print("\n".join(f"{kv}: pykv {100 * p:+.2f}% llama.cpp {100 * l:+.2f}% diff {100 * m:+.2f}% (se {100 * e:.2f}%)"
                    for kv, p, l, m, e in rows))
    for kv, p, l, m, e in rows:
        assert m <= 2 * e, (kv, p, l, m, e)


def test_plan_json_for_smollm2(smollm2_path):
    r = subprocess.run([sys.executable, "-m", "pykv", "plan", smollm2_path, "--memory", "8GiB", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    rows = {row["kv_type"]: row for row in res["rows"]}
    assert set(rows) >= {"f16", "q8_0", "q4_0", "int4", "int2", "fp8_e4m3", "iq4_nl"}
    assert (rows["f16"]["bytes_per_token"], rows["q8_0"]["bytes_per_token"], rows["q4_0"]["bytes_per_token"]) \
        == (23040, 12240, 6480)
    free = 8 * 2**30 - res["weights_bytes"]
    for row in rows.values():
        assert row["max_context"] == (free - row["seq_fixed_bytes"]) // row["bytes_per_token"]
        assert row["full_context_seqs"] == free // (8192 * row["bytes_per_token"] + row["seq_fixed_bytes"])
    # a real cache of that type costs what plan says
    m = pykv.load(smollm2_path, n_ctx=64, kv_type_k="int4", kv_type_v="q4_0")
    assert m.kv_bytes_per_token() == (rows["int4"]["bytes_per_token"] + rows["q4_0"]["bytes_per_token"]) / 2
