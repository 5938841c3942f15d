"""KV-cache storage formats, as data.

One table (``KV_FORMATS``) in the style of gguf-py's ``constants.py``: every format a KV cache page can
be stored in, with its integer ``code`` (what the Numba kernels in ``pykv.kernels.kvquant`` dispatch on),
its block geometry and its byte cost.

Byte cost of ONE token's head vector (``head_dim`` values) -- ``row_bytes``:

* float (f32/f16/bf16):   head_dim * {4, 2, 2}
* ggml block types:       head_dim / 32 * block_bytes  (byte layout identical to ggml / gguf.quants)
* fp8 (e4m3, e5m2):       head_dim + 4  (one f32 scale = amax/fp8_max per token per KV head, stored
                          in the first 4 bytes of the row, then one byte per value)
* KIVI int4 / int2:       the *value* layout: per token, groups of 32 along head_dim, each group
                          f16 scale d + f16 min m (4 bytes) then 32*bits/8 bytes of packed codes:
                          head_dim / 32 * (4 + 4*bits)  -> 20 bytes/32 values (int4), 12 (int2).
                          KIVI *keys* are quantized per channel across the P tokens of a page:
                          page = 4*head_dim bytes of (f16 scale, f16 min) per channel + P*head_dim*bits/8
                          bytes of codes, i.e. head_dim*bits/8 + 4*head_dim/P bytes per token amortized
                          (see ``kivi_page_bytes``).  For P = 32 that is the same 5 / 3 bits per value.

* nl4 / nl3 / nl2 (pykv's own):  blocks of 64 values, [f16 d][64*bits/8 bytes of codes]; value =
                          d * NL_TABLE[bits][code], the Lloyd-Max levels of a unit Gaussian (what a
                          Hadamard-rotated head vector looks like) -> 4.25 / 3.25 / 2.25 bits per value.
* klt3 / klt2 (pykv's own, keys only): nl blocks whose code width falls along the block (``nl_runs``:
                          runs of (positions, bits), widest first), for keys stored in the coordinates
                          of a calibrated per-head transform (pykv.kv.transform) whose channels are
                          sorted by how much they move the attention scores, each run scaled to unit
                          variance: the few channels that carry most of q.k get 6-8 bits, the tail 1-2.
* nl3b / nl2b (pykv's own): nl3 / nl2 with the block scale in one byte e: d = 2^((e - 160) / 8) (e = 0:
                          an all-zero block), 25 / 17 bytes per 64 values -> 3.125 / 2.125 bits per value.
* tc3b / tc2b / tc1b (pykv's own): trellis-coded blocks of 64 with nl3b / nl2b's bytes ([e][64 k-bit
                          symbols], k = 3 / 2; tc1b: 1, 9 bytes, 1.125 bits per value): value j =
                          d * TC_TABLE[window of the ``tc_len`` (9 / 8 / 8) stream bits
                          ending after symbol j] (zero bits before the stream), chosen by a Viterbi search
                          over the whole block (a bitshift trellis, as QTIP's): ~26 % less squared error
                          than nl3b / nl2b at the same 3.125 / 2.125 bits per value.

``bytes_per_token`` sums K and V over layers and KV heads; the f16 residual page KIVI keeps per
sequence (a constant, not a per-token cost) is not included.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as _T

__all__ = [
    "KVFormat", "KV_FORMATS", "KV_CODES", "parse_kv_type", "row_bytes", "kivi_page_bytes",
    "kv_bytes_per_token_head", "bytes_per_token", "bits_per_value",
    "CODE_F32", "CODE_F16", "CODE_BF16", "CODE_Q8_0", "CODE_Q4_0", "CODE_Q4_1", "CODE_Q5_0",
    "CODE_Q5_1", "CODE_IQ4_NL", "CODE_FP8_E4M3", "CODE_FP8_E5M2", "CODE_INT4", "CODE_INT2",
    "CODE_NL4", "CODE_NL3", "CODE_NL2", "CODE_KLT3", "CODE_KLT2", "CODE_NL3B", "CODE_NL2B", "CODE_TC3B",
    "CODE_TC2B", "CODE_TC1B", "N_CODES",
]


@dataclass(frozen=True)
class KVFormat:
    name: str
    code: int            # integer id used by the Numba kernels
    block_size: int      # values per block
    block_bytes: int     # bytes per block
    bits: float          # bits per value including block scales (fp8: excluding the per-row scale)
    kind: str            # 'float' | 'ggml' | 'fp8' | 'kivi' | 'nl' | 'klt' (nl blocks of transformed keys)
    ggml_type: _T | None  # the gguf type when the byte layout is ggml's
    row_extra: int = 0   # bytes per row on top of the blocks (fp8: the f32 row scale)
    nl_runs: tuple = ()  # nl / klt: the block's code widths as runs ((positions, bits), ...) summing to 64
    nl_scale: int = 2    # nl / klt: bytes of the block scale: 2 = f16 d, 1 = a log2 byte (d = 2^((e - 160) / 8))
    tc_len: int = 0      # tc: bits of the trellis window each value is read from (0: not trellis-coded)


CODE_F32 = 0
CODE_F16 = 1
CODE_BF16 = 2
CODE_Q8_0 = 3
CODE_Q4_0 = 4
CODE_Q4_1 = 5
CODE_Q5_0 = 6
CODE_Q5_1 = 7
CODE_IQ4_NL = 8
CODE_FP8_E4M3 = 9
CODE_FP8_E5M2 = 10
CODE_INT4 = 11
CODE_INT2 = 12
CODE_NL4 = 13
CODE_NL3 = 14
CODE_NL2 = 15
CODE_KLT3 = 16
CODE_KLT2 = 17
CODE_NL3B = 18
CODE_NL2B = 19
CODE_TC3B = 20
CODE_TC2B = 21
CODE_TC1B = 22
N_CODES = 23

_F = KVFormat
# name                 code            bs  bytes  bits   kind     ggml type
KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    _F("f32",      CODE_F32,       1,  4,  32.0, "float", _T.F32),
    _F("f16",      CODE_F16,       1,  2,  16.0, "float", _T.F16),
    _F("bf16",     CODE_BF16,      1,  2,  16.0, "float", _T.BF16),
    _F("q8_0",     CODE_Q8_0,     32, 34,   8.5, "ggml",  _T.Q8_0),
    _F("q4_0",     CODE_Q4_0,     32, 18,   4.5, "ggml",  _T.Q4_0),
    _F("q4_1",     CODE_Q4_1,     32, 20,   5.0, "ggml",  _T.Q4_1),
    _F("q5_0",     CODE_Q5_0,     32, 22,   5.5, "ggml",  _T.Q5_0),
    _F("q5_1",     CODE_Q5_1,     32, 24,   6.0, "ggml",  _T.Q5_1),
    _F("iq4_nl",   CODE_IQ4_NL,   32, 18,   4.5, "ggml",  _T.IQ4_NL),
    _F("fp8_e4m3", CODE_FP8_E4M3,  1,  1,   8.0, "fp8",   None, 4),
    _F("fp8_e5m2", CODE_FP8_E5M2,  1,  1,   8.0, "fp8",   None, 4),
    _F("int4",     CODE_INT4,     32, 20,   5.0, "kivi",  None),
    _F("int2",     CODE_INT2,     32, 12,   3.0, "kivi",  None),
    _F("nl4",      CODE_NL4,      64, 34,  4.25, "nl",    None, nl_runs=((64, 4),)),
    _F("nl3",      CODE_NL3,      64, 26,  3.25, "nl",    None, nl_runs=((64, 3),)),
    _F("nl2",      CODE_NL2,      64, 18,  2.25, "nl",    None, nl_runs=((64, 2),)),
    # 2 + 2*8 + 2*6 + 4*5 + 8*4 + 16*3 + 32*2 bits = 2 + 24 bytes
    _F("klt3",     CODE_KLT3,     64, 26,  3.25, "klt",   None, nl_runs=((2, 8), (2, 6), (4, 5), (8, 4), (16, 3), (32, 2))),
    # 2 + 4*6 + 4*4 + 8*3 + 16*2 + 32*1 bits = 2 + 16 bytes
    _F("klt2",     CODE_KLT2,     64, 18,  2.25, "klt",   None, nl_runs=((4, 6), (4, 4), (8, 3), (16, 2), (32, 1))),
    # nl3 / nl2 with the block scale in one log2 byte (steps of 2^(1/8)): an eighth of a bit less per value
    _F("nl3b",     CODE_NL3B,     64, 25, 3.125, "nl",    None, nl_runs=((64, 3),), nl_scale=1),
    _F("nl2b",     CODE_NL2B,     64, 17, 2.125, "nl",    None, nl_runs=((64, 2),), nl_scale=1),
    # nl3b / nl2b's bytes, each value read through a trellis window of 9 / 8 stream bits
    _F("tc3b",     CODE_TC3B,     64, 25, 3.125, "nl",    None, nl_runs=((64, 3),), nl_scale=1, tc_len=9),
    _F("tc2b",     CODE_TC2B,     64, 17, 2.125, "nl",    None, nl_runs=((64, 2),), nl_scale=1, tc_len=8),
    _F("tc1b",     CODE_TC1B,     64,  9, 1.125, "nl",    None, nl_runs=((64, 1),), nl_scale=1, tc_len=8),
)}
del _F

KV_CODES: dict[int, KVFormat] = {f.code: f for f in KV_FORMATS.values()}


def _check_table() -> None:
    for f in KV_FORMATS.values():
        assert abs(f.bits - f.block_bytes * 8 / f.block_size) < 1e-9, f
        if f.kind in ("nl", "klt"):
            assert sum(n for n, _ in f.nl_runs) == f.block_size == 64, f
            nbits = sum(n * b for n, b in f.nl_runs)
            assert nbits % 8 == 0 and f.nl_scale + nbits // 8 == f.block_bytes and f.nl_scale in (1, 2), f
            assert all(n & (n - 1) == 0 and 1 <= b <= 8 for n, b in f.nl_runs), f   # Hadamard per run
            if f.tc_len:                 # one symbol width, a window of at least two symbols, <= 9 bits
                assert len(f.nl_runs) == 1 and 2 * f.nl_runs[0][1] <= f.tc_len <= 9 and f.nl_scale == 1, f
    assert sorted(KV_CODES) == list(range(len(KV_FORMATS))) == list(range(N_CODES))


_check_table()


def parse_kv_type(name: str | KVFormat) -> KVFormat:
    """Look a format up by name (case-insensitive; '-' accepted for '_'); ValueError lists valid names."""
    if isinstance(name, KVFormat):
        return name
    key = str(name).strip().lower().replace("-", "_")
    aliases = {"fp16": "f16", "float16": "f16", "fp32": "f32", "float32": "f32", "fp8": "fp8_e4m3",
               "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "kivi4": "int4", "kivi2": "int2"}
    key = aliases.get(key, key)
    try:
        return KV_FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}; valid types: {', '.join(KV_FORMATS)}") from None


def _bits_int(fmt: KVFormat) -> int:
    return 4 if fmt.code == CODE_INT4 else 2


def row_bytes(fmt: str | KVFormat, head_dim: int) -> int:
    """Bytes of one token's head vector of ``head_dim`` values (for KIVI: the per-token value layout)."""
    fmt = parse_kv_type(fmt)
    if head_dim <= 0 or head_dim % fmt.block_size:
        raise ValueError(f"head_dim {head_dim} is not a positive multiple of {fmt.name}'s block size "
                         f"{fmt.block_size}")
    return head_dim // fmt.block_size * fmt.block_bytes + fmt.row_extra


def kivi_page_bytes(fmt: str | KVFormat, head_dim: int, page_tokens: int, is_key: bool) -> int:
    """Bytes of one page of ``page_tokens`` tokens for one KV head in a KIVI format.

    Keys (per channel over the page's tokens): 4*head_dim bytes of (f16 scale, f16 min) per channel,
    then page_tokens * head_dim * bits / 8 bytes of codes (token-major, see kernels/kvquant.py).
    Values (per token, groups of 32 along head_dim): page_tokens * row_bytes(fmt, head_dim).
    """
    fmt = parse_kv_type(fmt)
    if fmt.kind != "kivi":
        raise ValueError(f"{fmt.name} is not a KIVI format")
    if page_tokens <= 0:
        raise ValueError("page_tokens must be positive")
    rb = row_bytes(fmt, head_dim)
    if not is_key:
        return page_tokens * rb
    return 4 * head_dim + page_tokens * head_dim * _bits_int(fmt) // 8


def kv_bytes_per_token_head(fmt: str | KVFormat, head_dim: int, page_tokens: int, is_key: bool) -> float:
    """Amortized bytes one token costs in one KV head, for K (is_key) or V."""
    fmt = parse_kv_type(fmt)
    if fmt.kind == "kivi" and is_key:
        return kivi_page_bytes(fmt, head_dim, page_tokens, True) / page_tokens
    return float(row_bytes(fmt, head_dim))


def bytes_per_token(fmt_k: str | KVFormat, fmt_v: str | KVFormat, n_layers: int, n_kv_heads: int,
                    head_dim: int, page_tokens: int = 32, head_dim_v: int | None = None) -> float:
    """Bytes one token costs in the whole KV cache (K + V, all layers and KV heads); head_dim_v: the
    value head size where it differs from the key's."""
    per_head = (kv_bytes_per_token_head(fmt_k, head_dim, page_tokens, True)
                + kv_bytes_per_token_head(fmt_v, head_dim if head_dim_v is None else head_dim_v,
                                          page_tokens, False))
    return n_layers * n_kv_heads * per_head


def bits_per_value(fmt: str | KVFormat, head_dim: int, page_tokens: int = 32, is_key: bool = False) -> float:
    """Exact stored bits per value for a given head_dim (includes fp8's per-row scale)."""
    return 8.0 * kv_bytes_per_token_head(fmt, head_dim, page_tokens, is_key) / head_dim
