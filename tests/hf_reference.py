"""Independent reference implementations used by the conversion tests.

* ``hf_forward``   – LLaMA forward in Hugging Face conventions (unpermuted q/k
  weights, rotate-half RoPE), float64, straight from a safetensors state dict.
* ``gguf_forward`` – LLaMA forward in llama.cpp conventions (permuted q/k
  weights, RoPE on adjacent pairs): tests/reference.py's, re-exported; the HF
  forward shares its layers (reference.llama_forward) and GPT-2 byte map.
* a tiny byte-level BPE trainer/encoder (GPT-2 / SmolLM pre-tokenization).
* a tiny HF checkpoint writer (random weights, BPE or SentencePiece tokenizer).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import regex

from tests.reference import B2U, gguf_forward, llama_forward, perplexity  # noqa: F401  (re-exported)

# ----------------------------------------------------------------------------
# forward passes
# ----------------------------------------------------------------------------


def rope_half(x, pos, base, n_rot=None, scale=1.0):
    """HF rotate-half RoPE on all of x: (T, H, d) (n_rot: unused, rope_pairs' signature)."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = (pos[:, None] / scale) * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


HF_NAMES = {
    "embd": "model.embed_tokens.weight", "norm": "model.norm.weight", "out": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_forward(tensors: dict, cfg: dict, ids) -> np.ndarray:
    """float64 logits (T, vocab), HF conventions."""
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    names = dict(HF_NAMES)
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in tensors:
        names["out"] = None
    rs = cfg.get("rope_scaling") or {}
    scale = float(rs.get("factor", 1.0)) if rs.get("type", rs.get("rope_type")) == "linear" else 1.0
    get = lambda k: np.asarray(tensors[k], dtype=np.float64)  # noqa: E731
    return llama_forward(get, cfg["num_hidden_layers"], n_head, n_kv, head_dim, cfg["rms_norm_eps"],
                         cfg.get("rope_theta", 10000.0), rope_half, ids, names, np.float64, scale)


# ----------------------------------------------------------------------------
# byte-level BPE (GPT-2 style), for tiny test tokenizers and as a reference
# ----------------------------------------------------------------------------

GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def pretokenize(text: str, pre: str = "gpt-2") -> list[str]:
    pieces = [text]
    if pre == "smollm":
        pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    out = []
    for p in pieces:
        out.extend(GPT2_SPLIT.findall(p))
    return ["".join(B2U[b] for b in w.encode("utf-8")) for w in out]


def train_bpe(text: str, n_merges: int, pre: str = "gpt-2") -> list[tuple[str, str]]:
    words: dict[tuple[str, ...], int] = {}
    for w in pretokenize(text, pre):
        t = tuple(w)
        words[t] = words.get(t, 0) + 1
    merges = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + c
        if not counts:
            break
        best = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    return merges


def bpe_encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]], pre: str = "gpt-2") -> list[int]:
    ranks = {m: i for i, m in enumerate(merges)}
    ids = []
    for w in pretokenize(text, pre):
        parts = list(w)
        while len(parts) > 1:
            best = min(((ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
            if best[0] == 1 << 30:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


# ----------------------------------------------------------------------------
# tiny checkpoints
# ----------------------------------------------------------------------------

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bpe_tokenizer(out: Path, text: str, n_merges: int = 40, pre: str = "smollm"):
    """tokenizer.json with specials at ids 0..2, then 256 byte tokens, then merges."""
    merges = train_bpe(text, n_merges, pre)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[B2U[b]] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if pre == "smollm":
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    else:
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in enumerate(SPECIALS)],
        "normalizer": None, "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
          "pad_token": "<|endoftext|>", "add_prefix_space": False, "chat_template": CHAT_TEMPLATE,
          "tokenizer_class": "GPT2Tokenizer", "model_max_length": 256}
    (out / "tokenizer_config.json").write_text(json.dumps(tc), encoding="utf-8")
    return vocab, merges


def write_spm_tokenizer(out: Path, text: str, vocab_size: int = 400):
    import sentencepiece as spm

    corpus = out / "_corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        byte_fallback=True, minloglevel=2, num_threads=1, seed_sentencepiece_size=10000)
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    tc = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
          "add_eos_token": False, "chat_template": CHAT_TEMPLATE, "tokenizer_class": "LlamaTokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(tc), encoding="utf-8")
    return vocab_size


def random_llama_tensors(cfg: dict, rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    s = 0.25

    def m(r, c):
        return (rng.standard_normal((r, c)) * s / np.sqrt(c) * 4).astype(np.float32)

    t = {"model.embed_tokens.weight": (rng.standard_normal((V, H)) * 0.5).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)}
    if not tied:
        t["lm_head.weight"] = m(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = m(nh * hd, H)
        t[p + "self_attn.k_proj.weight"] = m(nkv * hd, H)
        t[p + "self_attn.v_proj.weight"] = m(nkv * hd, H)
        t[p + "self_attn.o_proj.weight"] = m(H, nh * hd)
        t[p + "mlp.gate_proj.weight"] = m(F, H)
        t[p + "mlp.up_proj.weight"] = m(F, H)
        t[p + "mlp.down_proj.weight"] = m(H, F)
    return t
