"""`pykv perplexity` (through the quantized KV cache, with KL divergence against an f16-cache run)
and `pykv plan` (what fits in a memory budget, for every KV type)."""
from __future__ import annotations
import math
import sys
import numpy as np
from pykv.files.config import PykvError


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


def plan_rows(path, memory: int, page_tokens: int = 32) -> tuple[dict, list[dict]]:
    from pykv.files.formats import KV_FORMATS, bytes_per_token
    from pykv.files.gguf_io import open_model
    from pykv.kv.cache import seq_overhead_bytes
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
