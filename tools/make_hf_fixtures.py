"""Write tests/data/hf_fixtures/: tiny random LLaMA checkpoints saved by transformers itself, with its logits.

Not run by CI (needs torch + transformers; made with torch 2.13.0 + transformers 5.24.0):
    python tools/make_hf_fixtures.py [--out tests/data/hf_fixtures] [--check-export]

Each fixture is a folder transformers' save_pretrained wrote (config.json, model.safetensors,
generation_config.json) plus the test suite's tiny byte-level BPE tokenizer.json (tests/hf_reference.py,
the tokenizer pykv convert reads for SmolLM-style models) and reference.npz:
    ids (T,) int64              fixed token ids, T = 48 positions (past llama3's and YaRN's original context)
    logits (T, V) f32           transformers' float32 forward of the saved weights
    logits_f16 (T, V) f32       the same forward with every 2-D weight rounded to f16 (norms stay f32, as
                                `pykv convert --outtype f16` and llama.cpp's converter keep them)
transformers 4 schema ("tf4" fixtures): transformers 5 cannot save it, so the tool saves with transformers 5
and rewrites config.json as transformers 4 wrote it (top-level rope_theta; rope_scaling with "type" for
linear and "rope_type" for llama3/yarn, as Llama 2 / Llama 3.1 configs have them; torch_dtype), then reloads
the folder with transformers 5 and checks its logits are unchanged.
Weights are re-drawn at a larger scale than transformers' init (std 0.02 makes attention almost uniform, so
RoPE would hardly show in the logits).
--check-export: also converts each fixture with pykv (f32), exports it back with `pykv export`, loads the
export with AutoModelForCausalLM.from_pretrained and prints the largest logit difference.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import hf_reference as R  # noqa: E402

T = 48
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
# name: (schema, dtype, tied, config overrides, rope_parameters)
FIXTURES = {
    "tf4_default_untied": ("tf4", "float32", False, {}, {"rope_type": "default", "rope_theta": 50000.0}),
    "tf5_default_tied_mha": ("tf5", "float32", True, {"num_key_value_heads": 4},
                             {"rope_type": "default", "rope_theta": 50000.0}),
    "tf4_linear": ("tf4", "float32", False, {}, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "tf5_linear_tied": ("tf5", "float32", True, {"num_key_value_heads": 1},
                        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "tf4_llama3": ("tf4", "float32", False, {},
                   {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "tf5_llama3": ("tf5", "float32", False, {},
                   {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "tf5_yarn": ("tf5", "float32", False, {"max_position_embeddings": 1024},
                 {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 256}),
    "tf4_yarn_attn": ("tf4", "float32", True, {"max_position_embeddings": 128},
                      {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                       "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0}),
    "tf5_bf16": ("tf5", "bfloat16", False, {}, {"rope_type": "default", "rope_theta": 500000.0}),
}


def to_tf4(cfg: dict) -> dict:
    cfg = dict(cfg)
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    typ = rp.pop("rope_type")
    cfg["rope_scaling"] = None if typ == "default" else (
        {"type": typ, **rp} if typ == "linear" else {"rope_type": typ, **rp})
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.46.0"
    return cfg


def forward(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def make(name: str, out: Path, vocab_size: int, tok_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    schema, dtype, tied, over, rope = FIXTURES[name]
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    cfg = LlamaConfig(**dict(BASE, **over), vocab_size=vocab_size, tie_word_embeddings=tied,
                      rope_parameters=dict(rope))
    torch.manual_seed(sum(map(ord, name)))
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for pn, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in pn:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / p.shape[1] ** 0.5))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / fn, d / fn)
    ids = np.random.default_rng(sum(map(ord, name))).integers(0, vocab_size, T).tolist()
    before = forward(model.float(), ids) if dtype == "float32" else None
    if schema == "tf4":
        cp = d / "config.json"
        cp.write_text(json.dumps(to_tf4(json.loads(cp.read_text())), indent=2) + "\n")
    # the reference is the saved folder as transformers loads it (a model cast to bf16 in memory would also
    # round its inv_freq buffer)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    logits = forward(model, ids)
    assert before is None or np.array_equal(before, logits), f"{name}: the saved folder reloads differently"
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(p.half().float())
    logits_f16 = forward(model, ids)
    np.savez_compressed(d / "reference.npz", ids=np.asarray(ids, np.int64), logits=logits.astype(np.float32),
                        logits_f16=logits_f16.astype(np.float32))
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, max |logit| {np.abs(logits).max():.3f}, "
          f"f16 weights move logits by {np.abs(logits_f16 - logits).max() / np.abs(logits).max():.2e} rel")


def check_export(name: str, out: Path, tmp: Path) -> None:
    """pykv convert (f32) -> pykv export (f32) -> transformers: logits against the reference."""
    from transformers import AutoModelForCausalLM
    from pykv import tools as C
    d = out / name
    ref = np.load(d / "reference.npz")
    g = tmp / f"{name}.gguf"
    C.convert_hf(d, g, outtype="f32", force=True)
    e = tmp / f"{name}-export"
    C.export_hf(g, e, dtype="f32", force=True)
    m = AutoModelForCausalLM.from_pretrained(e, dtype=torch.float32).eval()
    got = forward(m, ref["ids"].tolist())
    rp = json.loads((e / "config.json").read_text())["rope_parameters"]
    err = np.abs(got - ref["logits"]).max() / np.abs(ref["logits"]).max()
    print(f"{name}: export -> transformers rel err {err:.2e}; rope_parameters {rp}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "hf_fixtures")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--check-export", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    names = a.only or list(FIXTURES)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.check_export:
            text = (ROOT / "tests" / "data" / "eval-gpl3.txt").read_text(encoding="utf-8")
            vocab, _ = R.write_bpe_tokenizer(tmp, text, n_merges=40)
            for name in names:
                make(name, a.out, len(vocab), tmp)
        else:
            for name in names:
                check_export(name, a.out, tmp)


if __name__ == "__main__":
    main()
