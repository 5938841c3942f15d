"""`pykv perplexity` (through the quantized KV cache, with KL divergence against an f16-cache run)
and `pykv plan` (what fits in a memory budget, for every KV type)."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from .config import PykvError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _progress(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)


def perplexity(model, ids, n_ctx: int, base=None, max_chunks=None, progress=None) -> dict:
    """Perplexity of `ids` in chunks of n_ctx tokens, every position after the first of a chunk scored.
    Each chunk is one fresh sequence prefilled through the model's KV cache, so every attention score
    reads the stored (quantized) K/V. With `base` (a model with an f16 cache), also the mean KL
    divergence KL(base || model) per token and the fraction of positions whose argmax agrees."""
    ids = np.asarray(ids, dtype=np.int64)
    n_chunks = len(ids) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise PykvError(f"the text has {len(ids)} tokens, fewer than one chunk of -c {n_ctx}")
    show = sys.stderr.isatty() if progress is None else progress
    bar = _progress(n_chunks * n_ctx * (2 if base is not None else 1), "perplexity") if show else None
    nll, kl, agree, n = 0.0, 0.0, 0, 0
    for c in range(n_chunks):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        lp = log_softmax(model.eval(model.new_sequence(), chunk, all_logits=True)[:-1])
        if bar is not None:
            bar.update(n_ctx)
        nll -= lp[np.arange(n_ctx - 1), chunk[1:]].sum()
        if base is not None:
            lb = log_softmax(base.eval(base.new_sequence(), chunk, all_logits=True)[:-1])
            if bar is not None:
                bar.update(n_ctx)
            kl += float((np.exp(lb) * (lb - lp)).sum())
            agree += int((lb.argmax(1) == lp.argmax(1)).sum())
        n += n_ctx - 1
    if bar is not None:
        bar.close()
    out = {"ppl": math.exp(nll / n), "n_tokens": n, "n_ctx": n_ctx,
           "ctk": model.cache.k_name(), "ctv": model.cache.v_name(), "kv_rotate": model.rotate,
           "kv_bytes_per_token": model.kv_bytes_per_token(), "q8_act": model.q8_act}
    if base is not None:
        out.update(kl=kl / n, top1=agree / n)
    return out


def cmd_perplexity(args) -> int:
    from .cli import load_from_args
    model_path, textfile = (args.args if len(args.args) == 2 else (None, args.args[0]))
    if len(args.args) > 2:
        raise PykvError("usage: pykv perplexity [MODEL] TEXTFILE")
    try:
        with open(textfile, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PykvError(f"cannot read {textfile}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PykvError(f"cannot read {textfile}: not UTF-8 text") from None
    model = load_from_args(args, model_path, q8_act=args.q8_act)
    ids = model.tokenize(text)
    base = None
    if args.kl_base:
        from .model import load
        base = load(model.path, n_ctx=args.ctx_size, kv_type_k=args.kl_base, kv_type_v=args.kl_base,
                    threads=args.threads, kv_rotate=False, q8_act=args.q8_act, device=args.device)
    res = perplexity(model, ids, args.ctx_size, base=base, max_chunks=args.chunks)
    if args.json:
        print(json.dumps(res))
    else:
        line = (f"ctk {res['ctk']} ctv {res['ctv']} rotate {'on' if res['kv_rotate'] else 'off'}: "
                f"ppl {res['ppl']:.4f} over {res['n_tokens']} tokens, "
                f"KV {res['kv_bytes_per_token']:.0f} B/token")
        if base is not None:
            line += f", KL {res['kl']:.5f}, top-1 agreement {100 * res['top1']:.2f}% vs {args.kl_base}"
        print(line)
    return 0


def plan_rows(path, memory: int, page_tokens: int = 32) -> tuple[dict, list[dict]]:
    from .formats import KV_FORMATS, bytes_per_token
    from .gguf_io import open_model
    from .kv_cache import seq_overhead_bytes
    gf, cfg = open_model(path)
    weights = sum(t.data.nbytes for t in gf.tensors.values())
    free = memory - weights
    info = {"model": path, "memory": memory, "weights_bytes": weights, "kv_memory": max(free, 0),
            "n_ctx_train": cfg.n_ctx_train, "n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim}
    rows = []
    for name, fmt in KV_FORMATS.items():
        if cfg.head_dim % fmt.block_size:
            continue
        bpt = bytes_per_token(fmt, fmt, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_tokens)
        fixed = seq_overhead_bytes(cfg, fmt, fmt, page_tokens)
        rows.append({"kv_type": name, "bits_per_value": 8 * bpt / (2 * cfg.n_layers * cfg.kv_dim),
                     "bytes_per_token": bpt, "seq_fixed_bytes": fixed,
                     "max_context": int(max(free - fixed, 0) // bpt),
                     "full_context_seqs": int(max(free, 0) // (cfg.n_ctx_train * bpt + fixed))})
    return info, rows


def cmd_plan(args) -> int:
    from .cli import parse_bytes
    from .models import ModelFetchError, resolve_model
    try:      # an existing path is opened as it is (a folder or a socket gets the file's own error)
        path = args.model if args.model and os.path.exists(args.model) else str(resolve_model(args.model))
    except ModelFetchError as e:
        raise PykvError(str(e)) from None
    memory = parse_bytes(args.memory)
    info, rows = plan_rows(path, memory)
    if info["kv_memory"] <= 0:
        raise PykvError(f"--memory {args.memory} ({memory:,} bytes) does not hold the weights "
                        f"({info['weights_bytes']:,} bytes), let alone a KV cache")
    if args.json:
        print(json.dumps({**info, "rows": rows}))
        return 0
    gib = 1024 ** 3
    print(f"model {path}: weights {info['weights_bytes'] / 2**20:.1f} MiB; memory {memory / gib:.2f} GiB; "
          f"KV memory {info['kv_memory'] / gib:.2f} GiB; {info['n_layers']} layers x {info['n_kv_heads']} KV heads "
          f"x head_dim {info['head_dim']}; trained context {info['n_ctx_train']}")
    print("| KV type | bits/value | bytes/token | fixed f16 bytes/seq | max context (1 seq) | "
          f"seqs of {info['n_ctx_train']} tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_type']} | {r['bits_per_value']:.2f} | {r['bytes_per_token']:,.0f} | "
              f"{r['seq_fixed_bytes']:,} | {r['max_context']:,} | {r['full_context_seqs']:,} |")
    return 0


def register_cli(sub) -> None:
    from .cli import _model_args
    p = sub.add_parser("perplexity", help="perplexity through the (quantized) KV cache, KL vs an f16 cache")
    p.add_argument("args", nargs="+", metavar="[MODEL] TEXTFILE")
    _model_args(p)
    p.set_defaults(ctx_size=1024)
    p.add_argument("--kl-base", default=None, help="KV type of the baseline run for KL / top-1 (e.g. f16)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--q8-act", action="store_true",
                   help="8-bit activations as `pykv run` uses them (default: float activations, so the "
                        "comparison measures the KV cache and not q8 rounding flips)")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("plan", help="bytes per token and what fits in a memory budget, for every KV type")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--memory", default="8GiB", help="memory for weights + KV cache (default 8GiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
