"""Plain numpy float64 references used by every test (slow, obvious, no Numba): the llama forward in
llama.cpp conventions, attention, RoPE, the GPT-2 byte map, tiny random GGUFs.  hf_reference.py adds the
Hugging Face side (its RoPE and names, a BPE trainer, tiny HF checkpoints) on top of these."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from pykv.api.evaluate import log_softmax


def tensor_f64(t) -> np.ndarray:
    """Dequantize a GGUFReader tensor to float64 with numpy shape (ne1, ne0) (rows, row length)."""
    tt = T(int(t.tensor_type))
    ne = [int(x) for x in t.shape]
    if tt == T.F32:
        a = np.asarray(t.data, dtype=np.float64)
    elif tt == T.F16:
        a = np.asarray(t.data).view(np.float16).astype(np.float64)
    else:
        a = dequantize(np.asarray(t.data), tt).astype(np.float64)
    return a.reshape(ne[::-1]) if len(ne) > 1 else a.reshape(ne)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_pairs(x, pos, base, n_rot=None, scale=1.0):
    """llama.cpp rope mode 0 (NORM) on (T, n_heads, HD): rotates adjacent pairs (2i, 2i+1) of the first
    n_rot dimensions (default: all); scale: linear position scaling (positions divided by it)."""
    n_rot = x.shape[-1] if n_rot is None else n_rot
    x = x.copy()
    i = np.arange(n_rot // 2)
    theta = (pos[:, None] / scale) * base ** (-2.0 * i / n_rot)          # (T, n_rot/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
    x[..., 0:n_rot:2] = x0 * c - x1 * s
    x[..., 1:n_rot:2] = x0 * s + x1 * c
    return x


def q16_query(q):
    """The query as pykv's integer-dot scores over q8_0 keys see it (attention._quant_q16): per block of
    32 values xq = rint(q / d) int16 with d = amax / 32767 in float32, back to xq * d."""
    x = np.asarray(q, np.float32).reshape(-1, 32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(32767.0)
    idd = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(x * idd).astype(np.float64) * d).reshape(np.shape(q))


def attention(q, k, v, n_past=0, q_from=None, n_from=0):
    """Causal GQA attention. q (T, H, HD); k, v (n_past + T, KVH, HD). Query t sees keys 0..n_past+t.
    q_from (as q): the query the keys j >= n_from are scored with instead (pool keys read by
    integer dots see the query's int16 form, f16 sink rows the float query)."""
    Tq, H, HD = q.shape
    n, KVH = k.shape[0], k.shape[1]
    g = H // KVH
    out = np.empty(q.shape, np.result_type(q, k, v))
    mask = np.arange(n)[None, :] > (n_past + np.arange(Tq))[:, None]
    for h in range(H):
        s = q[:, h] @ k[:, h // g].T / np.sqrt(HD)
        if q_from is not None:
            s[:, n_from:] = q_from[:, h] @ k[n_from:, h // g].T / np.sqrt(HD)
        s[mask] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[:, h] = p @ v[:, h // g]
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def llama_forward(get, n_layer, n_head, n_kv, head_dim, eps, base, rope, ids, names, dtype, scale=1.0,
                  n_rot=None):
    """Logits (T, vocab) of a llama: get(name) -> weight (rows, cols); names: GGUF_NAMES or the HF ones;
    rope(x, pos, base, n_rot, scale)."""
    ids = np.asarray(ids)
    Tn = len(ids)
    pos = np.arange(Tn, dtype=np.float64)
    x = get(names["embd"])[ids].astype(dtype)
    for i in range(n_layer):
        n = lambda k: names[k].format(i=i)  # noqa: E731
        h = rmsnorm(x, get(n("attn_norm")), eps)
        q = (h @ get(n("q")).T).reshape(Tn, n_head, head_dim)
        k = (h @ get(n("k")).T).reshape(Tn, n_kv, head_dim)
        v = (h @ get(n("v")).T).reshape(Tn, n_kv, head_dim)
        q, k = rope(q, pos, base, n_rot, scale), rope(k, pos, base, n_rot, scale)
        x = x + attention(q, k, v).reshape(Tn, -1) @ get(n("o")).T
        h = rmsnorm(x, get(n("ffn_norm")), eps)
        x = x + (silu(h @ get(n("gate")).T) * (h @ get(n("up")).T)) @ get(n("down")).T
    x = rmsnorm(x, get(names["norm"]), eps)
    out = get(names["out"]) if names["out"] else get(names["embd"])
    return x @ out.T


GGUF_NAMES = {
    "embd": "token_embd.weight", "norm": "output_norm.weight", "out": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight", "o": "blk.{i}.attn_output.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight",
}


def gguf_forward(path, ids, dtype=np.float64) -> np.ndarray:
    """Logits (T, vocab) of a llama GGUF in llama.cpp conventions (any weight type gguf.quants
    dequantizes), weights in `dtype`."""
    r = GGUFReader(path)
    md = {k: f.contents() for k, f in r.fields.items()}
    a = md.get("general.architecture", "llama")
    tens = {t.name: t for t in r.tensors}
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tensor_f64(tens[name]).astype(dtype)
        return cache[name]

    n_head = md[f"{a}.attention.head_count"]
    head_dim = md.get(f"{a}.attention.key_length", md[f"{a}.embedding_length"] // n_head)
    names = dict(GGUF_NAMES)
    if "output.weight" not in tens:
        names["out"] = None
    scale = float(md[f"{a}.rope.scaling.factor"]) if md.get(f"{a}.rope.scaling.type") == "linear" else 1.0
    return llama_forward(get, md[f"{a}.block_count"], n_head, md.get(f"{a}.attention.head_count_kv", n_head),
                         head_dim, md[f"{a}.attention.layer_norm_rms_epsilon"],
                         md.get(f"{a}.rope.freq_base", 10000.0), rope_pairs, ids, names, dtype, scale,
                         md.get(f"{a}.rope.dimension_count", head_dim))


def perplexity(logits, ids) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1]."""
    lp = log_softmax(logits[:-1])
    return float(np.exp(-lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


# ---- synthetic data ------------------------------------------------------------------------------

def random_blocks(ggml_type, rows, cols, rng, scale=0.05):
    """Random valid bytes (rows, row_bytes) of a ggml block type, dequantizing to values ~scale.
    Types gguf.quants can quantize are quantized from random floats; K-quants get random bytes with
    sane f16 super-block scales."""
    tt = T(ggml_type)
    if tt in (T.F32,):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if tt in (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return quantize_f32((rng.standard_normal((rows, cols)) * scale).astype(np.float32), tt)
    from gguf.constants import GGML_QUANT_SIZES
    bs, bb = GGML_QUANT_SIZES[tt]
    nb = cols // bs
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    d = lambda v: np.full((rows, nb), v, np.float16).view(np.uint8).reshape(rows, nb, 2)
    if tt in (T.Q4_K, T.Q5_K):       # d, dmin first (6-bit scales up to 63, values up to 15/31)
        raw[:, :, 0:2] = d(scale / 63 / (3 if tt == T.Q4_K else 6))
        raw[:, :, 2:4] = d(scale / 63)
    elif tt == T.Q6_K:               # ql, qh, scales(int8), d last
        raw[:, :, 208:210] = d(scale / 32 / 64)
    else:
        raise ValueError(f"no random block generator for {tt.name}")
    return raw.reshape(rows, nb * bb)


def quantize_f32(x, tt):
    from gguf.quants import quantize
    return quantize(x, T(tt))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (written here, independently of pykv.files.tokenizer's: the
    tests' BPE encoder is an oracle for pykv's tokenizer)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


B2U = bytes_to_unicode()


def write_tiny_gguf(path, types, *, dim=256, ff=512, n_heads=4, n_kv=2, n_layers=2, seed=0,
                    tied=True, rope_base=10000.0, rope_dims=None, n_vocab=None, n_ctx=512):
    """A tiny random llama GGUF; `types` maps a weight role ('attn_q', ..., 'token_embd', 'output')
    or 'default' to a ggml type. Tokenizer: gpt2 BPE over the 256 byte tokens + <s>, </s> + merges,
    padded with unreachable filler tokens to n_vocab (a real model's vocabulary size) when given."""
    import gguf
    rng = np.random.default_rng(seed)
    toks = [B2U[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt", "Ġth", "Ġthe"]
    merges = ["Ġ t", "Ġt h", "Ġth e"]
    ttype = [1] * 256 + [3, 3, 3, 1, 1, 1]
    if n_vocab is not None and n_vocab > len(toks):
        fill = n_vocab - len(toks)
        toks, ttype = toks + [f"<fill{i}>" for i in range(fill)], ttype + [1] * fill
    V = len(toks)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(n_ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(rope_dims or dim // n_heads)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(toks)
    w.add_token_types(ttype)
    w.add_token_merges(merges)
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    w.add_add_bos_token(False)
    hd = dim // n_heads

    def add(name, role, rows, cols, scale=0.05):
        tt = T(types.get(role, types.get("default", T.F32)))
        data = random_blocks(tt, rows, cols, rng, scale)
        if tt in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=tt)

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32))

    add("token_embd.weight", "token_embd", V, dim, 0.5)
    norm("output_norm.weight")
    if not tied:
        add("output.weight", "output", V, dim, 0.1)
    for l in range(n_layers):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        add(p + "attn_q.weight", "attn_q", dim, dim, 0.1)
        add(p + "attn_k.weight", "attn_k", n_kv * hd, dim, 0.1)
        add(p + "attn_v.weight", "attn_v", n_kv * hd, dim)
        add(p + "attn_output.weight", "attn_output", dim, dim)
        add(p + "ffn_gate.weight", "ffn_gate", ff, dim)
        add(p + "ffn_up.weight", "ffn_up", ff, dim)
        add(p + "ffn_down.weight", "ffn_down", dim, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
