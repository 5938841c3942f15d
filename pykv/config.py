"""Model hyper-parameters read from GGUF `llama.*` metadata."""
from __future__ import annotations

from dataclasses import dataclass


class PykvError(Exception):
    """An error the user caused or can fix: the CLI prints its message on one line and exits non-zero."""


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

    @property
    def head_dim(self) -> int:  # HD
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:    # KVH * HD
        return self.n_kv_heads * self.head_dim

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
            n_ctx_train=get("context_length", 2048),
            n_vocab=int(n_vocab),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("n_layers", "dim", "ff_dim", "n_heads", "n_kv_heads", "n_vocab"):
            if getattr(self, name) <= 0:
                raise PykvError(f"bad model config: {name} = {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise PykvError(f"bad model config: embedding_length {self.dim} not divisible by head_count {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise PykvError(f"bad model config: head_count {self.n_heads} not a multiple of head_count_kv {self.n_kv_heads}")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise PykvError(f"bad model config: rope.dimension_count {self.rope_dims} (head_dim {self.head_dim})")
