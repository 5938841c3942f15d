"""A model's meaning checked before any kernel runs: every metadata key the runtime reads (presence, type,
range), the tokenizer tables (sizes, merges, special ids) and every tensor's name, shape and type.

A file that passes `validate` cannot reach the kernels with a zero or NaN hyper-parameter, a tensor whose
shape disagrees with the config, or a token id outside the vocabulary. Each failure is one line naming
the file, the key or tensor, and what was wrong (`ModelFileError`, a PykvError: the CLI exits 2).
"""
from __future__ import annotations

import math

from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from pykv.files.config import Config, ModelFileError, PykvError

# the weight types pykv runs (matmul and get_rows)
WEIGHT_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                T.Q6_K}

# llama.cpp's token types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
TOKEN_TYPES = range(0, 7)
SPECIAL_IDS = ("bos", "eos", "unknown", "eot", "eom")          # tokenizer.ggml.<name>_token_id the tokenizer reads
LAYER_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")


# ---- value kinds ---------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return type(v).__name__


# (key under the architecture, kind, required, lower bound); every arch key Config.from_metadata reads
ARCH_KEYS = (
    ("block_count", "int", True, 1),
    ("embedding_length", "int", True, 1),
    ("feed_forward_length", "int", True, 1),
    ("attention.head_count", "int", True, 1),
    ("attention.head_count_kv", "int", False, 1),
    ("context_length", "int", False, 1),
    ("vocab_size", "int", False, 1),
    ("rope.dimension_count", "int", False, 2),
    ("rope.scaling.original_context_length", "int", False, 1),
    ("attention.key_length", "int", False, 1),
    ("attention.value_length", "int", False, 1),
    ("rope.freq_base", "pos", False, None),
    ("attention.layer_norm_rms_epsilon", "pos", False, None),
    ("rope.scaling.factor", "nonneg", False, None),
    ("rope.scaling.yarn_attn_factor", "nonneg", False, None),
    ("rope.scaling.yarn_beta_fast", "finite", False, None),
    ("rope.scaling.yarn_beta_slow", "finite", False, None),
    ("rope.scaling.type", "str", False, None),
)
TOKENIZER_STR = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
TOKENIZER_BOOL = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")


class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, what: str, msg: str):
        raise ModelFileError(f"{self.path}: {what}: {msg}")

    def key(self, md: dict, key: str, kind: str, required: bool, low=None):
        if key not in md:
            if required:
                self.fail(f"metadata {key}", "missing")
            return None
        v = md[key]
        what = f"metadata {key}"
        if kind == "int":
            if not _is_int(v):
                self.fail(what, f"is {_kind(v)}, expected an integer")
            if low is not None and v < low:
                self.fail(what, f"{v!r}, expected >= {low}")
        elif kind in ("pos", "nonneg", "finite"):
            if not _is_num(v):
                self.fail(what, f"is {_kind(v)}, expected a number")
            if not math.isfinite(v):
                self.fail(what, f"{v!r}, expected a finite number")
            if kind == "pos" and v <= 0:
                self.fail(what, f"{v!r}, expected > 0")
            if kind == "nonneg" and v < 0:
                self.fail(what, f"{v!r}, expected >= 0")
        elif kind == "str" and not isinstance(v, str):
            self.fail(what, f"is {_kind(v)}, expected a string")
        elif kind == "bool" and not isinstance(v, bool):
            self.fail(what, f"is {_kind(v)}, expected a bool")
        return v


def check_metadata(md: dict, path: str) -> Config:
    """Types and ranges of every key the runtime reads, then the Config built from them (its cross-key
    checks: head counts divide, head_dim even, RoPE dims fit) with the file named."""
    c = _Checker(path)
    arch = c.key(md, "general.architecture", "str", True)
    if arch != "llama":
        c.fail("metadata general.architecture", f"unsupported architecture {arch!r} (pykv runs 'llama')")
    for key, kind, required, low in ARCH_KEYS:
        c.key(md, f"{arch}.{key}", kind, required, low)
    try:
        cfg = Config.from_metadata(md)
    except PykvError as e:
        raise ModelFileError(f"{path}: {e}") from None
    for key in ("attention.key_length", "attention.value_length"):
        v = md.get(f"{arch}.{key}")
        if v is not None and v != cfg.head_dim:
            c.fail(f"metadata {arch}.{key}", f"{v}, pykv needs embedding_length / head_count = {cfg.head_dim}")
    return cfg


def check_tokenizer(md: dict, path: str, n_vocab: int) -> None:
    """The vocabulary tables: token list (strings, as many as the model's vocabulary), token types and
    scores of the same length, BPE merges naming existing tokens, special ids in range."""
    c = _Checker(path)
    for key in TOKENIZER_STR:
        c.key(md, key, "str", False)
    for key in TOKENIZER_BOOL:
        c.key(md, key, "bool", False)
    model = md.get("tokenizer.ggml.model", "llama")
    if model not in ("gpt2", "llama"):
        c.fail("metadata tokenizer.ggml.model", f"unsupported tokenizer {model!r} (pykv runs 'gpt2' and 'llama')")
    tokens = c.key(md, "tokenizer.ggml.tokens", "list", True)
    if not isinstance(tokens, list) or not tokens:
        c.fail("metadata tokenizer.ggml.tokens", "expected a non-empty array of strings")
    if not all(isinstance(t, str) for t in tokens):
        c.fail("metadata tokenizer.ggml.tokens", "expected an array of strings")
    n = len(tokens)
    if n != n_vocab:
        c.fail("metadata tokenizer.ggml.tokens", f"has {n} tokens, the model's vocabulary is {n_vocab}")
    types = md.get("tokenizer.ggml.token_type")
    if types is not None:
        what = "metadata tokenizer.ggml.token_type"
        if not isinstance(types, list) or len(types) != n:
            c.fail(what, f"expected an array of {n} integers")
        bad = next((t for t in types if not _is_int(t) or t not in TOKEN_TYPES), None)
        if bad is not None:
            c.fail(what, f"bad token type {bad!r} (0..6)")
        if model == "llama":
            seen = {}
            for i, t in enumerate(types):
                if t == 6:
                    if not _is_byte_token(tokens[i]):
                        c.fail("metadata tokenizer.ggml.tokens", f"byte token {i} is {tokens[i]!r}, expected <0xNN>")
                    if tokens[i] in seen:
                        c.fail("metadata tokenizer.ggml.tokens", f"byte token {i} repeats token {seen[tokens[i]]} ({tokens[i]})")
                    seen[tokens[i]] = i
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None:
        what = "metadata tokenizer.ggml.scores"
        if not isinstance(scores, list) or len(scores) != n:
            c.fail(what, f"expected an array of {n} numbers")
        if not all(_is_num(s) and math.isfinite(s) for s in scores):
            c.fail(what, "expected finite numbers")
    merges = md.get("tokenizer.ggml.merges")
    if merges is not None and model == "gpt2":
        what = "metadata tokenizer.ggml.merges"
        if not isinstance(merges, list):
            c.fail(what, f"is {_kind(merges)}, expected an array of strings")
        vocab = set(tokens)
        for i, m in enumerate(merges):
            pos = m.find(" ", 1) if isinstance(m, str) else -1
            if pos < 0 or m[:pos] not in vocab or m[pos + 1:] not in vocab:
                c.fail(what, f"merge {i} ({m!r}) does not name two tokens of the vocabulary")
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        v = c.key(md, key, "int", False, 0)
        if v is not None and v >= n:
            c.fail(f"metadata {key}", f"{v}, outside the vocabulary of {n} tokens")


def _is_byte_token(s: str) -> bool:
    return len(s) == 6 and s.startswith("<0x") and s.endswith(">") and all(
        ch in "0123456789ABCDEF" for ch in s[3:5])


def expected_tensors(cfg: Config) -> dict[str, tuple[tuple, str]]:
    """name -> (ggml-order shape, role) of every tensor a llama model may hold: role 'mat' (any weight
    type the matmul kernels run), 'f32' (norms, rope factors); output.weight and rope_freqs.weight are
    optional."""
    D, FF, V, KV = cfg.dim, cfg.ff_dim, cfg.n_vocab, cfg.kv_dim
    out = {"token_embd.weight": ((D, V), "mat"), "output.weight": ((D, V), "mat"),
           "output_norm.weight": ((D,), "f32"), "rope_freqs.weight": ((cfg.rope_dims // 2,), "f32")}
    rows = {"attn_q": D, "attn_k": KV, "attn_v": KV, "attn_output": D, "ffn_gate": FF, "ffn_up": FF, "ffn_down": D}
    for l in range(cfg.n_layers):
        p = f"blk.{l}."
        for n in LAYER_NORMS:
            out[p + n + ".weight"] = ((D,), "f32")
        for n in LAYER_MATS:
            out[p + n + ".weight"] = ((FF if n == "ffn_down" else D, rows[n]), "mat")
    return out


OPTIONAL = ("output.weight", "rope_freqs.weight")


def check_tensors(tensors: dict, cfg: Config, path: str) -> None:
    """Every tensor known, every needed tensor present, shapes from the config, types the kernels run,
    rows made of whole blocks. tensors: name -> TensorInfo (ggml-order shape, ggml type)."""
    c = _Checker(path)
    n_min = cfg.n_layers * (len(LAYER_MATS) + len(LAYER_NORMS)) + 2
    if n_min > len(tensors):      # before building a table of n_layers entries
        c.fail(f"metadata {cfg.arch}.block_count", f"{cfg.n_layers} layers need at least {n_min} tensors, "
                                                   f"the file holds {len(tensors)}")
    want = expected_tensors(cfg)
    for name in tensors:
        if name not in want:
            c.fail(f"tensor {name}", "not a tensor of a llama model with this config "
                                     f"({cfg.n_layers} layers)")
    for name, (shape, role) in want.items():
        ti = tensors.get(name)
        if ti is None:
            if name not in OPTIONAL:
                c.fail(f"tensor {name}", "missing")
            continue
        what = f"tensor {name}"
        if tuple(ti.shape) != shape:
            c.fail(what, f"has shape {list(ti.shape)}, the config needs {list(shape)}")
        gt = T(ti.ggml_type)
        if role == "f32" and gt != T.F32:
            c.fail(what, f"has type {gt.name}, expected F32")
        if role == "mat":
            if gt not in WEIGHT_TYPES:
                c.fail(what, f"has unsupported type {gt.name}")
            bs = GGML_QUANT_SIZES[gt][0]
            if shape[0] % bs:
                c.fail(what, f"rows of {shape[0]} values are not whole {gt.name} blocks of {bs}")
        bad = nonfinite_count(ti)
        if bad:
            c.fail(what, f"holds {bad} NaN/inf {'values' if gt in (T.F32, T.F16, T.BF16) else 'block scales'}")


def validate(gf) -> Config:
    """All checks on an opened GGUFFile; returns its Config."""
    md = gf.metadata
    cfg = check_metadata(md, gf.path)
    check_tokenizer(md, gf.path, cfg.n_vocab)
    check_tensors(gf.tensors, cfg, gf.path)
    release = getattr(gf, "release", None)
    if release is not None:         # the scan above read every byte: those pages need not stay ours
        for name in gf.tensors:
            release(name)
    return cfg


# byte offsets of the f16 scales (d, and m / dmin where there is one) inside one block of each type
_F16_SCALES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
               T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def nonfinite_count(ti) -> int:
    """How many values (float types) or f16 block scales (block types) of a tensor are NaN or inf."""
    import numpy as np
    gt = T(ti.ggml_type)
    raw = ti.data
    if gt == T.F32:
        return int(raw.size - np.count_nonzero(np.isfinite(raw)))
    if gt == T.F16:
        bits, mask = raw.reshape(-1).view(np.uint16), 0x7C00
    elif gt == T.BF16:
        bits, mask = raw.reshape(-1).view(np.uint16), 0x7F80
    elif gt in _F16_SCALES:         # every block size is even and tensors are aligned: a u16 view
        u16 = raw.reshape(-1).view(np.uint16).reshape(-1, GGML_QUANT_SIZES[gt][1] // 2)
        return sum(int(np.count_nonzero((u16[:, o // 2] & 0x7C00) == 0x7C00)) for o in _F16_SCALES[gt])
    else:
        return 0
    return int(np.count_nonzero((bits & mask) == mask))
