"""A LLaMA GGUF of a real model's shape with random weights, for speed and memory benchmarks.

    python tools/make_synthetic.py SHAPE OUT.gguf [--type q4_k_m] [--seed 0] [--layers N] [--force]

SHAPE: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, tinyllama-1.1b (or `tiny`, a small shape for tests).
--type: a plain type (f16, q8_0, q4_0, q4_k, q6_k, ...) or a llama-quantize mix (q4_k_m, q5_k_m, ...):
each tensor gets the type llama-quantize would give it (pykv.tools.quant_plan), filled with random valid blocks
(sane scales, random quants) written straight to the file, so an 8B file needs no float copy and no
quantizer.  The vocabulary has the shape's size and kind: GPT-2 byte-level BPE (the Llama 3 shapes) or
SentencePiece (tinyllama), generated (256 byte tokens, then filler pieces), so prompts tokenize.
Llama 3 shapes carry rope_freqs.weight (llama3 RoPE scaling).  pykv and llama.cpp both run the files;
the logits mean nothing."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

SHAPES = {
    #                 layers dim    ff     heads kv  vocab   tied   vocab kind  rope base  ctx
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 128256, True, "gpt2", 500000.0, 131072),
    "llama-3.2-3b": (28, 3072, 8192, 24, 8, 128256, True, "gpt2", 500000.0, 131072),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 128256, False, "gpt2", 500000.0, 131072),
    "tinyllama-1.1b": (22, 2048, 5632, 32, 4, 32000, False, "llama", 10000.0, 2048),
    "tiny": (2, 256, 512, 4, 2, 1024, True, "gpt2", 10000.0, 512),
    "tiny-spm": (2, 256, 512, 4, 2, 1024, False, "llama", 10000.0, 512),
}


def _b2u() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def vocab(kind: str, size: int):
    """(tokens, token types, scores or None, merges or None, bos, eos)."""
    if kind == "gpt2":
        b2u = _b2u()
        toks = [b2u[b] for b in range(256)]
        letters = [b2u[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
        merges, seen = [], set(toks)
        for a in letters:                      # a few real merges: "Ġa", "Ġb", ... then pairs
            m = b2u[32] + a
            merges.append(f"{b2u[32]} {a}")
            toks.append(m)
            seen.add(m)
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        fill = size - len(toks) - len(specials)
        toks += [f"<fill{i}>" for i in range(fill)] + specials
        types = [1] * (size - len(specials)) + [3] * len(specials)
        return toks, types, None, merges, size - 3, size - 2
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["▁"] + list(letters) + ["▁" + c for c in letters]
    toks += pieces
    types += [1] * len(pieces)
    fill = size - len(toks)
    toks += [f"▁fill{i}" for i in range(fill)]
    types += [1] * fill
    scores = [0.0] * 259 + [-float(i) for i in range(len(toks) - 259)]
    return toks, types, scores, None, 1, 2


def random_rows(tt, rows: int, cols: int, rng, scale: float = 0.02) -> np.ndarray:
    """Random valid bytes (rows, row_bytes) of ggml type tt, dequantizing to values of about scale."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    if tt == T.F32:
        return (rng.standard_normal((rows, cols), np.float32) * scale).view(np.uint8).reshape(rows, -1)
    if tt in (T.F16, T.BF16):
        x = rng.standard_normal((rows, cols), np.float32) * scale
        if tt == T.F16:
            return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    bs, bb = GGML_QUANT_SIZES[tt]
    nb = cols // bs
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)

    def f16(off, v):
        raw[:, :, off:off + 2] = np.full((rows, nb), v, np.float16).view(np.uint8).reshape(rows, nb, 2)
    if tt in (T.Q8_0,):
        f16(0, scale / 64)
    elif tt in (T.Q4_0, T.IQ4_NL):
        f16(0, scale / 4)
    elif tt == T.Q4_1:
        f16(0, scale / 4)
        f16(2, -2 * scale)
    elif tt == T.Q5_0:
        f16(0, scale / 8)
    elif tt == T.Q5_1:
        f16(0, scale / 8)
        f16(2, -2 * scale)
    elif tt in (T.Q4_K, T.Q5_K):
        f16(0, scale / 63 / (3 if tt == T.Q4_K else 6))
        f16(2, scale / 63)
    elif tt == T.Q6_K:
        f16(208, scale / 32 / 64)
    elif tt == T.Q3_K:
        f16(108, scale / 32 / 4)
    elif tt == T.Q2_K:
        f16(80, scale / 15 / 2)
        f16(82, scale / 15)
    else:
        raise SystemExit(f"make_synthetic: no random block generator for {tt.name}")
    return raw.reshape(rows, nb * bb)


def tensor_list(shape):
    L, D, FF, H, KV, V, tied = shape[:7]
    hd = D // H
    out = [("token_embd.weight", V, D), ("output_norm.weight", None, D)]
    if not tied:
        out.append(("output.weight", V, D))
    for l in range(L):
        p = f"blk.{l}."
        out += [(p + "attn_norm.weight", None, D), (p + "attn_q.weight", D, D), (p + "attn_k.weight", KV * hd, D),
                (p + "attn_v.weight", KV * hd, D), (p + "attn_output.weight", D, D), (p + "ffn_norm.weight", None, D),
                (p + "ffn_gate.weight", FF, D), (p + "ffn_up.weight", FF, D), (p + "ffn_down.weight", D, FF)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick file)")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    import gguf
    from gguf import GGMLQuantizationType as T
    from pykv.tools.quant_plan import MIXES, plan_types
    if os.path.exists(a.out) and not a.force:
        raise SystemExit(f"make_synthetic: {a.out} exists (--force to replace it)")
    mix = MIXES.get(a.type.lower())
    if mix is None:
        raise SystemExit(f"make_synthetic: unknown --type {a.type!r}; one of {', '.join(sorted(MIXES))}")
    shape = list(SHAPES[a.shape])
    if a.layers:
        shape[0] = a.layers
    L, D, FF, H, KV, V, tied, vkind, base, ctx = shape
    rng = np.random.default_rng(a.seed)
    tensors = tensor_list(shape)
    mats = [(n, (r, c)) for n, r, c in tensors if r is not None]
    types = dict(zip([n for n, _ in mats], plan_types(mats, mix, L)))

    tmp = a.out + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"synthetic {a.shape} {a.type}")
    w.add_block_count(L)
    w.add_context_length(ctx)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D // H)
    w.add_vocab_size(V)
    w.add_file_type(mix.file_type)
    toks, ttypes, scores, merges, bos, eos = vocab(vkind, V)
    w.add_tokenizer_model("gpt2" if vkind == "gpt2" else "llama")
    if vkind == "gpt2":
        w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(ttypes)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)
    llama3 = a.shape.startswith("llama-3")
    plan = []
    for name, rows, cols in tensors:
        if rows is None:
            plan.append((name, T.F32, (cols,), cols * 4))
        else:
            tt = types[name]
            bs, bb = gguf.constants.GGML_QUANT_SIZES[tt]
            plan.append((name, tt, (rows, cols), rows * (cols // bs) * bb))
    if llama3:
        plan.append(("rope_freqs.weight", T.F32, ((D // H) // 2,), (D // H) // 2 * 4))
    for name, tt, shp, nbytes in plan:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, raw_dtype=tt)
        else:           # the byte shape (rows, row bytes): gguf-py derives the element shape from the type
            w.add_tensor_info(name, (shp[0], nbytes // shp[0]), np.dtype(np.uint8), nbytes, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    done, total = 0, sum(p[3] for p in plan)
    tty = sys.stderr.isatty()
    if not tty:
        print(f"make_synthetic: writing {a.out} ({total / 1e9:.2f} GB of tensors)", file=sys.stderr, flush=True)
    for name, tt, shp, nbytes in plan:
        if name == "rope_freqs.weight":        # llama3 scaling: factor 32, low 1, high 4, original context 8192
            hd = D // H
            freqs = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
            wl = 2 * np.pi / freqs
            f = np.where(wl < 8192 / 4, 1.0, np.where(wl > 8192 / 1, 32.0,
                                                      1.0 / ((1 - (8192 / wl - 1) / 3) / 32 + (8192 / wl - 1) / 3)))
            data = f.astype(np.float32)
        elif len(shp) == 1:
            data = (1.0 + 0.1 * rng.standard_normal(shp[0])).astype(np.float32)
        else:
            rows, cols = shp
            step = max(1, (1 << 26) // max(1, cols))      # rows a chunk (~64 M values)
            parts = [random_rows(tt, min(step, rows - r), cols, rng, 0.5 if "token_embd" in name else 0.02)
                     for r in range(0, rows, step)]
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        w.write_tensor_data(data)
        done += nbytes
        if tty:                                 # piped: the one line above says what is happening
            print(f"\rmake_synthetic: {done / total:6.1%} {name:32s}", end="", file=sys.stderr, flush=True)
    w.close()
    os.replace(tmp, a.out)
    print(("\n" if tty else "") + f"make_synthetic: wrote {a.out} ({os.path.getsize(a.out) / 1e9:.2f} GB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
