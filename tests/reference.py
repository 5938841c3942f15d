"""Plain numpy float64 references used by every test (slow, obvious, no Numba)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize


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


def rope_gguf(x, pos, base, n_rot):
    """llama.cpp rope mode 0 (NORM) on (T, n_heads, HD): rotates adjacent pairs (2i, 2i+1)."""
    x = x.copy()
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot)          # (T, n_rot/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
    x[..., 0:n_rot:2] = x0 * c - x1 * s
    x[..., 1:n_rot:2] = x0 * s + x1 * c
    return x


def attention(q, k, v, n_past=0):
    """Causal GQA attention. q (T, H, HD); k, v (n_past + T, KVH, HD). Query t sees keys 0..n_past+t."""
    Tq, H, HD = q.shape
    KVH = k.shape[1]
    g = H // KVH
    out = np.zeros_like(q, dtype=np.float64)
    for t in range(Tq):
        n = n_past + t + 1
        for h in range(H):
            s = k[:n, h // g, :] @ q[t, h] / np.sqrt(HD)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[:n, h // g, :]
    return out


class ReferenceModel:
    """A float64 forward of a llama GGUF, weights dequantized with gguf.quants."""

    def __init__(self, path):
        r = GGUFReader(path)
        md = {k: f.contents() for k, f in r.fields.items()}
        a = md["general.architecture"]
        self.n_layers = md[f"{a}.block_count"]
        self.n_heads = md[f"{a}.attention.head_count"]
        self.n_kv = md[f"{a}.attention.head_count_kv"]
        self.eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
        self.base = md.get(f"{a}.rope.freq_base", 10000.0)
        self.W = {t.name: tensor_f64(t) for t in r.tensors}
        self.dim = self.W["token_embd.weight"].shape[1]
        self.hd = self.dim // self.n_heads
        self.n_rot = md.get(f"{a}.rope.dimension_count", self.hd)

    def forward(self, ids):
        W, hd = self.W, self.hd
        ids = np.asarray(ids)
        Tn = len(ids)
        pos = np.arange(Tn, dtype=np.float64)
        x = W["token_embd.weight"][ids]
        for l in range(self.n_layers):
            p = f"blk.{l}."
            h = rmsnorm(x, W[p + "attn_norm.weight"], self.eps)
            q = (h @ W[p + "attn_q.weight"].T).reshape(Tn, self.n_heads, hd)
            k = (h @ W[p + "attn_k.weight"].T).reshape(Tn, self.n_kv, hd)
            v = (h @ W[p + "attn_v.weight"].T).reshape(Tn, self.n_kv, hd)
            q = rope_gguf(q, pos, self.base, self.n_rot)
            k = rope_gguf(k, pos, self.base, self.n_rot)
            o = attention(q, k, v).reshape(Tn, -1)
            x = x + o @ W[p + "attn_output.weight"].T
            h = rmsnorm(x, W[p + "ffn_norm.weight"], self.eps)
            g = h @ W[p + "ffn_gate.weight"].T
            u = h @ W[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
        x = rmsnorm(x, W["output_norm.weight"], self.eps)
        out = W.get("output.weight", W["token_embd.weight"])
        return x @ out.T


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


def gpt2_byte_tokens():
    """GPT-2's byte -> printable unicode mapping, as 256 token strings in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    m = dict(zip(bs, cs))
    return [chr(m[b]) for b in range(256)]


def write_tiny_gguf(path, types, *, dim=256, ff=512, n_heads=4, n_kv=2, n_layers=2, seed=0,
                    tied=True, rope_base=10000.0, rope_dims=None):
    """A tiny random llama GGUF; `types` maps a weight role ('attn_q', ..., 'token_embd', 'output')
    or 'default' to a ggml type. Tokenizer: gpt2 BPE over the 256 byte tokens + <s>, </s> + merges."""
    import gguf
    rng = np.random.default_rng(seed)
    toks = gpt2_byte_tokens() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt", "Ġth", "Ġthe"]
    merges = ["Ġ t", "Ġt h", "Ġth e"]
    ttype = [1] * 256 + [3, 3, 3, 1, 1, 1]
    V = len(toks)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(512)
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
    w.add_bos_token_id(V - 6 + 0)
    w.add_eos_token_id(V - 6 + 0)
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
