"""Whole-model tests: tiny synthetic GGUFs against the float64 reference, and the real SmolLM2."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import pykv
from pykv.kernels import matmul as mm
from tests.reference import gguf_forward, perplexity, write_tiny_gguf

TYPE_SETS = {
    "f32": {"default": T.F32},
    "f16": {"default": T.F16},
    "bf16": {"default": T.BF16, "token_embd": T.F16},
    "legacy": {"default": T.Q4_0, "attn_q": T.Q4_1, "attn_k": T.Q5_0, "attn_v": T.Q5_1, "attn_output": T.Q8_0,
               "ffn_gate": T.Q4_1, "ffn_up": T.Q5_1, "ffn_down": T.Q5_0, "token_embd": T.Q8_0},
    "kquant": {"default": T.Q4_K, "attn_q": T.Q5_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q6_K,
               "output": T.Q5_K},
}


@pytest.fixture(scope="module", params=sorted(TYPE_SETS))
def tiny(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{name}.gguf"
    write_tiny_gguf(path, TYPE_SETS[name], tied=(name != "kquant"), seed=len(name))
    return name, str(path)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_tiny_model_matches_float64_reference(tiny):
    name, path = tiny
    ids = [5, 77, 3, 260, 261, 9, 140, 33, 2, 250, 1]
    want = gguf_forward(path, ids)
    mm.set_exact(True)
    try:
        m = pykv.load(path, n_ctx=64, n_batch=4)       # several batches: prefill + cache reuse
        got = m.forward(ids)
    finally:
        mm.set_exact(False)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) < 1e-3, (name, rel_err(got, want))
    # the fast path (8-bit activations) stays close; K-quant weights take llama.cpp's q8_K activations
    # (one scale per 256 values, coarser than q8_0's 32): 4.2 % measured on this tiny model
    got_fast = pykv.load(path, n_ctx=64).forward(ids)
    assert rel_err(got_fast, want) < (5e-2 if name == "kquant" else 3e-2)


def test_tiny_decode_equals_prefill(tiny):
    _, path = tiny
    m = pykv.load(path, n_ctx=64, n_batch=8)
    ids = [5, 77, 3, 260, 261, 9, 140, 33, 2, 250, 1, 17, 99]
    full = m.forward(ids)
    seq = m.new_sequence()
    steps = np.concatenate([m.eval(seq, [i]) for i in ids])
    assert rel_err(steps, full) < 1e-4


def _ppl_top1(logits, ids):
    return perplexity(logits, ids), logits[:-1].argmax(1)


def _int_dot_weights(model) -> bool:
    """True when some matmul weight multiplies 8-bit activations in the default (non-exact) mode."""
    w = model.weights
    return any(x.int_dot for x in [w.output] + [getattr(l, f) for l in w.layers for f in
                                                 ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")])


@pytest.mark.parametrize("exact", [False, True], ids=["default-kernels", "float-activations"])
def test_smollm2_perplexity_and_top1_vs_hf(smollm2, ref, exact):
    ids = ref["text_ids"][:1024]
    mm.set_exact(exact)
    try:
        logits = smollm2.forward(ids)
    finally:
        mm.set_exact(False)
    ppl, top1 = _ppl_top1(logits, ids)
    hf_ppl = float(np.exp(-ref["hf_text_logprob"].mean()))
    agree = float((top1 == ref["hf_text_top1"][:len(top1)]).mean())
    print(f"exact={exact} ppl {ppl:.4f} (HF {hf_ppl:.4f}) top1 agreement {agree:.4f}")
    assert abs(ppl / hf_ppl - 1) < 0.005
    # the floor follows the kernels this host runs: llama.cpp's q8 activations where some weight takes
    # an integer-dot kernel (VNNI tiles on Zen 5: 96.6 %; AVX2 tiles on Zen 3: 95.4 %, 976 of 1023, at
    # ppl 19.240 vs HF 19.279; llama.cpp 96.5 %), float activations otherwise (99.9 %, as the exact
    # kernels). Each q8 rounding flip moves a near-tie: the floor leaves a few positions of margin.
    q8 = not exact and _int_dot_weights(smollm2)
    assert agree >= (0.95 if q8 else 0.995), (q8, agree)


def test_smollm2_prompt_logits_close_to_hf(smollm2, ref):
    mm.set_exact(True)
    try:
        got = smollm2.forward(ref["prompt_ids_0"])
    finally:
        mm.set_exact(False)
    want = ref["hf_prompt_logits_0"].astype(np.float32)
    assert rel_err(got, want) < 2e-3


def test_smollm2_greedy_matches_reference(smollm2, ref):
    ok = 0
    for i in range(4):
        ids = [int(t) for t in ref[f"prompt_ids_{i}"]]
        seq = smollm2.new_sequence()
        lg = smollm2.eval(seq, ids)[0]
        out = []
        for _ in range(16):
            t = int(np.argmax(lg))
            out.append(t)
            lg = smollm2.eval(seq, [t])[0]
        hf = list(ref[f"hf_greedy_{i}"][:16])
        ll = list(ref[f"llama_greedy_{i}"][:16])
        ok += out == hf or out == ll
    assert ok >= 3


def test_generate_api_streams_text(smollm2):
    pieces = list(smollm2.generate("The capital of France is", max_tokens=12, temperature=0))
    text = "".join(pieces)
    assert len(pieces) >= 2 and "Paris" in text
    # same seed, same sampled text; the stop string cuts the stream
    a = "".join(smollm2.generate("Once upon a time", max_tokens=10, temperature=0.9, seed=7))
    b = "".join(smollm2.generate("Once upon a time", max_tokens=10, temperature=0.9, seed=7))
    assert a == b
    cut = "".join(smollm2.generate("The capital of France is", max_tokens=12, temperature=0, stop=["Paris"]))
    assert "Paris" not in cut and text.startswith(cut)
    # token ids as prompt give the same continuation as text
    ids = smollm2.tokenize("The capital of France is")
    assert "".join(smollm2.generate(ids, max_tokens=12, temperature=0)) == text


def test_prompt_longer_than_context(smollm2_path):
    m = pykv.load(smollm2_path, n_ctx=8)
    with pytest.raises(pykv.PykvError, match="context"):
        list(m.generate("word " * 20, max_tokens=4))


@pytest.mark.parametrize("q8_act", [True, False])
def test_fresh_models_agree(smollm2_path, ref, q8_act):
    """No races, no uninitialized scratch: two fresh models (2 threads, several prefill batches; float
    activations: the sgemm prefill) produce the same bits."""
    ids = ref["text_ids"][:300]
    outs = [pykv.load(smollm2_path, n_ctx=512, threads=2, q8_act=q8_act).forward(ids) for _ in range(2)]
    assert np.array_equal(outs[1], outs[0])
