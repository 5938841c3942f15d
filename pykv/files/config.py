"""Model hyper-parameters read from GGUF `llama.*` metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass


class PykvError(Exception):
    """An error the user caused or can fix: the CLI prints its message on one line and exits non-zero."""


class ModelFileError(PykvError):
    """A model file whose bytes or content are corrupt, inconsistent or out of range (one line: the file,
    the key or tensor, what was wrong)."""


class ContextWarning(UserWarning):
    """A context size above the model's training context: allowed, but quality may drop past it."""


@dataclass(frozen=True)
class Config:
    arch: str
    n_layers: int          # llama.block_count
    dim: int               # llama.embedding_length (D)
    ff_dim: int            # llama.feed_forward_length (FF)
    n_heads: int           # llama.attention.head_count (H)
    n_kv_heads: int        # llama.attention.head_count_kv (KVH)
    rope_base: float       # llama.rope.freq_base
    rope_dims: int         # llama.rope.dimension_count (<= head_dim)
    norm_eps: float        # llama.attention.layer_norm_rms_epsilon
    n_ctx_train: int       # llama.context_length
    n_vocab: int           # llama.vocab_size or len(tokenizer.ggml.tokens)
    # RoPE scaling, as llama.cpp reads it (llama-model.cpp / llama-context.cpp). Llama 3's per-pair frequency
    # factors are the rope_freqs.weight tensor (model.py), not metadata.
    rope_scaling: str = "linear"     # llama.rope.scaling.type: none | linear | yarn (absent: linear, factor 1)
    rope_freq_scale: float = 1.0     # 1 / llama.rope.scaling.factor (1 when absent or type none)
    rope_orig_ctx: int = 0           # llama.rope.scaling.original_context_length (YaRN's n_ctx_orig; absent: n_ctx_train)
    yarn_beta_fast: float = 32.0     # llama.rope.scaling.yarn_beta_fast: pairs turning more often over n_ctx_orig extrapolate
    yarn_beta_slow: float = 1.0      # llama.rope.scaling.yarn_beta_slow: pairs turning less often interpolate
    yarn_attn_factor: float = 0.0    # llama.rope.scaling.yarn_attn_factor: the cos/sin magnitude (HF's attention_factor);
                                     # 0 = absent: 1 + 0.1 ln(factor), as transformers and llama.cpp compute it

    @property
    def head_dim(self) -> int:  # HD
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:    # KVH * HD
        return self.n_kv_heads * self.head_dim

    @property
    def yarn_ext_factor(self) -> float:   # llama.cpp: 1 for YaRN, else 0 (no ramp)
        return 1.0 if self.rope_scaling == "yarn" else 0.0

    @property
    def yarn_attn_mul(self) -> float:
        """ggml rope's attn_factor: the wanted cos/sin magnitude over the 1 + 0.1 ln(1/freq_scale) ggml applies
        itself under YaRN (llama-context.cpp's cancellation), so the product is yarn_attn_factor."""
        if self.rope_scaling != "yarn" or not self.yarn_attn_factor:
            return 1.0
        return self.yarn_attn_factor / (1.0 + 0.1 * math.log(1.0 / self.rope_freq_scale))

    @classmethod
    def from_metadata(cls, md: dict) -> "Config":
        arch = md.get("general.architecture")
        if arch != "llama":
            raise PykvError(f"unsupported architecture {arch!r} (pykv runs 'llama')")

        def get(key, default=None, typ=int):
            v = md.get(f"{arch}.{key}", default)
            if v is None:
                raise PykvError(f"GGUF metadata is missing {arch}.{key}")
            try:
                return typ(v)
            except (TypeError, ValueError):
                raise PykvError(f"GGUF metadata {arch}.{key} has a bad value {v!r}") from None

        n_heads = get("attention.head_count")
        dim = get("embedding_length")
        n_vocab = md.get(f"{arch}.vocab_size")
        if n_vocab is None:
            n_vocab = len(md.get("tokenizer.ggml.tokens", ()))
        head_dim = dim // n_heads if n_heads > 0 else 0
        scaling = md.get(f"{arch}.rope.scaling.type", "linear")
        if scaling not in ("none", "linear", "yarn"):
            raise PykvError(f"unsupported RoPE scaling type {scaling!r} (pykv runs none, linear, yarn)")
        factor = get("rope.scaling.factor", 0.0, float)
        n_ctx_train = get("context_length", 2048)
        cfg = cls(
            arch=arch,
            n_layers=get("block_count"),
            dim=dim,
            ff_dim=get("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            rope_base=get("rope.freq_base", 10000.0, float),
            rope_dims=get("rope.dimension_count", head_dim),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5, float),
            n_ctx_train=n_ctx_train,
            n_vocab=int(n_vocab),
            rope_scaling=scaling,
            rope_freq_scale=1.0 if factor == 0.0 or scaling == "none" else 1.0 / factor,
            rope_orig_ctx=get("rope.scaling.original_context_length", n_ctx_train),
            yarn_beta_fast=get("rope.scaling.yarn_beta_fast", 32.0, float),
            yarn_beta_slow=get("rope.scaling.yarn_beta_slow", 1.0, float),
            yarn_attn_factor=get("rope.scaling.yarn_attn_factor", 0.0, float),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name, key in (("n_layers", "block_count"), ("dim", "embedding_length"), ("ff_dim", "feed_forward_length"),
                          ("n_heads", "attention.head_count"), ("n_kv_heads", "attention.head_count_kv"),
                          ("n_vocab", "vocab_size"), ("n_ctx_train", "context_length")):
            if getattr(self, name) <= 0:
                raise PykvError(f"metadata llama.{key} = {getattr(self, name)}, expected >= 1")
        if self.dim % self.n_heads:
            raise PykvError(f"metadata llama.embedding_length {self.dim} is not divisible by "
                            f"llama.attention.head_count {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise PykvError(f"metadata llama.attention.head_count {self.n_heads} is not a multiple of "
                            f"llama.attention.head_count_kv {self.n_kv_heads}")
        if self.head_dim % 2:
            raise PykvError(f"head_dim = embedding_length / head_count = {self.head_dim} is odd (RoPE rotates pairs)")
        if self.rope_dims < 2 or self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise PykvError(f"metadata llama.rope.dimension_count {self.rope_dims}: expected even, "
                            f"2..head_dim {self.head_dim}")
        if not (0 < self.norm_eps < math.inf):
            raise PykvError(f"metadata llama.attention.layer_norm_rms_epsilon = {self.norm_eps}, expected finite > 0")
        if not (self.rope_base > 0 and self.rope_freq_scale > 0 and self.yarn_attn_factor >= 0) or not all(
                math.isfinite(v) for v in (self.rope_base, self.rope_freq_scale, self.yarn_attn_factor,
                                           self.yarn_beta_fast, self.yarn_beta_slow)):
            raise PykvError(f"bad RoPE metadata: llama.rope.freq_base {self.rope_base}, rope.scaling.factor "
                            f"{1 / self.rope_freq_scale if self.rope_freq_scale else 0}, "
                            f"yarn_attn_factor {self.yarn_attn_factor}, yarn betas {self.yarn_beta_fast}, "
                            f"{self.yarn_beta_slow}")
        if self.rope_scaling == "yarn" and self.rope_orig_ctx <= 0:
            raise PykvError(f"metadata llama.rope.scaling.original_context_length = {self.rope_orig_ctx}, expected >= 1")
